//! `autocast` on the CPU backend: its op lists (low, f32, widest, untouched), scopes (nested,
//! disabled, restored on drop), the backward's dtypes, the cast cache, and agreement with f32.

use kiln_autograd::{
    AttnMask, Var, autocast, autocast_cache_len, autocast_disabled, autocast_dtype,
};
use kiln_backend_cpu::Cpu;
use kiln_core::testing::assert_close;
use kiln_core::{DType, Generator, RandDist, Reduction, Tensor};

fn dev() -> <Cpu as kiln_core::Backend>::Device {
    Cpu::device(0)
}

fn normal(seed: u64, shape: &[usize]) -> Tensor<Cpu> {
    let n = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    Generator::new(seed)
        .sample::<Cpu>(shape.to_vec(), n, DType::F32, &dev())
        .unwrap()
}

fn labels() -> Tensor<Cpu> {
    Tensor::<Cpu>::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0, 1], [8], &dev()).unwrap()
}

fn vals(t: &Tensor<Cpu>) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

#[test]
fn low_list_runs_in_the_autocast_dtype() {
    let x = Var::constant(normal(1, &[8, 5]));
    let w = Var::param(normal(2, &[5, 3]));
    let wl = Var::param(normal(3, &[3, 5]));
    let b = Var::param(normal(4, &[3]));
    for low in [DType::BF16, DType::F16] {
        let _amp = autocast(low).unwrap();
        assert_eq!(autocast_dtype(), Some(low));
        assert_eq!(x.matmul(&w).unwrap().dtype(), low, "matmul");
        assert_eq!(x.linear(&wl, Some(&b)).unwrap().dtype(), low, "linear");
        // Batched products too (bmm).
        let xb = Var::constant(normal(5, &[2, 4, 5]));
        assert_eq!(xb.matmul(&w).unwrap().dtype(), low, "batched matmul");
    }
    assert_eq!(autocast_dtype(), None);
    assert_eq!(
        x.matmul(&w).unwrap().dtype(),
        DType::F32,
        "outside the scope"
    );
}

#[test]
fn f32_list_runs_in_f32() {
    let x = Var::constant(normal(1, &[8, 5]));
    let w = Var::param(normal(2, &[5, 3]));
    let _amp = autocast(DType::BF16).unwrap();
    let h = x.matmul(&w).unwrap();
    assert_eq!(h.dtype(), DType::BF16);
    assert_eq!(h.softmax(-1).unwrap().dtype(), DType::F32, "softmax");
    assert_eq!(
        h.log_softmax(-1).unwrap().dtype(),
        DType::F32,
        "log_softmax"
    );
    let ce = h.cross_entropy(&labels(), Reduction::Mean).unwrap();
    assert_eq!(ce.dtype(), DType::F32, "cross_entropy");
    assert_eq!(h.sum_all().unwrap().dtype(), DType::F32, "sum");
    assert_eq!(h.mean(&[0], false).unwrap().dtype(), DType::F32, "mean");
    assert_eq!(h.exp().unwrap().dtype(), DType::F32, "exp");
    assert_eq!(h.abs().unwrap().log().unwrap().dtype(), DType::F32, "log");
    assert_eq!(h.pow_scalar(2.0).unwrap().dtype(), DType::F32, "pow");
    assert_eq!(h.softplus().unwrap().dtype(), DType::F32, "softplus");
    let ln = h.layer_norm(&[3], None, None, 1e-5).unwrap();
    assert_eq!(ln.dtype(), DType::F32, "layer_norm");
    let g = Var::param(Tensor::<Cpu>::ones([3], DType::F32, &dev()).unwrap());
    let rn = h.rms_norm(&[3], Some(&g), 1e-5).unwrap();
    assert_eq!(rn.dtype(), DType::F32, "rms_norm");
    // Untouched: activations, max reductions and views keep the input's dtype.
    assert_eq!(h.relu().unwrap().dtype(), DType::BF16, "relu");
    assert_eq!(h.gelu().unwrap().dtype(), DType::BF16, "gelu");
    assert_eq!(h.max_all().unwrap().dtype(), DType::BF16, "max");
    assert_eq!(h.t().unwrap().dtype(), DType::BF16, "t");
}

#[test]
fn binary_ops_meet_at_the_widest_dtype_only_under_autocast() {
    let a = Var::constant(normal(1, &[4, 3]).to_dtype(DType::BF16).unwrap());
    let b = Var::param(normal(2, &[4, 3]));
    assert!(
        a.add(&b).is_err(),
        "mixed dtypes outside autocast stay an error"
    );
    let _amp = autocast(DType::BF16).unwrap();
    let y = a.add(&b).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let want: Vec<f64> = vals(&a.tensor())
        .iter()
        .zip(vals(&b.tensor()))
        .map(|(x, y)| x + y)
        .collect();
    assert_close("bf16 + f32", &vals(&y.tensor()), &want, 1e-6);
    let c = Var::cat(&[a.clone(), b.clone()], 0).unwrap();
    assert_eq!(c.dtype(), DType::F32, "cat");
    // The f32 operand's gradient is f32, the bf16 one's bf16.
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(b.grad().unwrap().dtype(), DType::F32);
}

#[test]
fn f64_and_integers_are_never_cast() {
    let x = Var::constant(normal(1, &[4, 5]).to_dtype(DType::F64).unwrap());
    let w = Var::param(normal(2, &[5, 3]).to_dtype(DType::F64).unwrap());
    let _amp = autocast(DType::BF16).unwrap();
    assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F64);
    assert_eq!(x.softmax(-1).unwrap().dtype(), DType::F64);
}

#[test]
fn scopes_nest_disable_and_restore() {
    let x = Var::constant(normal(1, &[4, 5]));
    let w = Var::param(normal(2, &[5, 3]));
    assert!(autocast(DType::F32).is_err(), "f32 is no autocast dtype");
    assert!(autocast(DType::I64).is_err());
    {
        let _outer = autocast(DType::BF16).unwrap();
        {
            let _inner = autocast(DType::F16).unwrap();
            assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F16);
            {
                let _off = autocast_disabled();
                assert_eq!(autocast_dtype(), None);
                assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F32);
            }
            assert_eq!(autocast_dtype(), Some(DType::F16));
        }
        assert_eq!(x.matmul(&w).unwrap().dtype(), DType::BF16);
    }
    assert_eq!(autocast_dtype(), None);
    // Another thread has its own state.
    let _amp = autocast(DType::BF16).unwrap();
    std::thread::spawn(|| assert_eq!(autocast_dtype(), None))
        .join()
        .unwrap();
}

/// A two-layer MLP's loss and gradients under bf16 autocast agree with f32 within bf16's
/// precision, and the gradients of the f32 parameters are f32.
#[test]
fn gradients_of_f32_params_are_f32_and_close() {
    let x = Var::constant(normal(1, &[8, 5]));
    let run = |amp: bool| {
        let w1 = Var::param(normal(2, &[16, 5]).mul_scalar(0.4).unwrap());
        let b1 = Var::param(normal(3, &[16]).mul_scalar(0.1).unwrap());
        let w2 = Var::param(normal(4, &[3, 16]).mul_scalar(0.25).unwrap());
        let loss = {
            let _amp = amp.then(|| autocast(DType::BF16).unwrap());
            let h = x.linear(&w1, Some(&b1)).unwrap().relu().unwrap();
            let z = h.linear(&w2, None).unwrap();
            assert_eq!(z.dtype(), if amp { DType::BF16 } else { DType::F32 });
            z.cross_entropy(&labels(), Reduction::Mean).unwrap()
        };
        assert_eq!(loss.dtype(), DType::F32);
        loss.backward().unwrap();
        let grads: Vec<Tensor<Cpu>> = [&w1, &b1, &w2].iter().map(|p| p.grad().unwrap()).collect();
        (loss.tensor().to_scalar().unwrap(), grads)
    };
    let (l32, g32) = run(false);
    let (l16, g16) = run(true);
    assert!(
        (l32 - l16).abs() < 0.02 * l32.abs().max(1.0),
        "{l32} vs {l16}"
    );
    for (a, b) in g32.iter().zip(&g16) {
        assert_eq!(b.dtype(), DType::F32, "gradient of an f32 parameter");
        let (a, b) = (vals(a), vals(b));
        let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = a
            .iter()
            .zip(&b)
            .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            err <= 0.03 * scale,
            "max error {err} for gradient scale {scale}"
        );
    }
}

#[test]
fn attention_products_low_softmax_f32() {
    let q = Var::param(normal(1, &[2, 4, 8]));
    let k = Var::param(normal(2, &[2, 4, 8]));
    let v = Var::param(normal(3, &[2, 4, 8]));
    let _amp = autocast(DType::BF16).unwrap();
    for mask in [
        AttnMask::None,
        AttnMask::Causal,
        AttnMask::Additive(Tensor::<Cpu>::zeros([4, 4], DType::F32, &dev()).unwrap()),
    ] {
        let y = q
            .scaled_dot_product_attention(&k, &v, &mask, 0.0, None, None)
            .unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(q.grad().unwrap().dtype(), DType::F32);
    }
}

#[test]
fn parameter_casts_are_cached_and_stay_valid() {
    let x = Var::constant(normal(1, &[4, 5]));
    let w = Var::param(normal(2, &[3, 5]));
    {
        let _amp = autocast(DType::BF16).unwrap();
        // A layer applied twice casts its weight once.
        let y1 = x.linear(&w, None).unwrap();
        let y2 = x.linear(&w, None).unwrap();
        assert_eq!(autocast_cache_len(), 1);
        y1.add(&y2).unwrap().sum_all().unwrap().backward().unwrap();
        let g_twice = vals(&w.grad().unwrap());
        w.zero_grad();
        // After that backward freed the cast, a second step in the same scope casts again.
        x.linear(&w, None)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g_once = vals(&w.grad().unwrap());
        let half: Vec<f64> = g_twice.iter().map(|g| g / 2.0).collect();
        assert_close(
            "a weight used twice gets twice the gradient",
            &g_once,
            &half,
            1e-6,
        );
        // An update inside the scope makes the entry stale: the new values are used.
        w.set_tensor(w.tensor().mul_scalar(0.0).unwrap()).unwrap();
        let y = x.linear(&w, None).unwrap();
        assert!(
            vals(&y.tensor()).iter().all(|&v| v == 0.0),
            "stale cast reused"
        );
        // Nothing cached under no_grad.
        let _ = kiln_autograd::no_grad(|| x.linear(&Var::param(normal(9, &[3, 5])), None));
        assert_eq!(autocast_cache_len(), 1);
    }
    assert_eq!(autocast_cache_len(), 0, "cleared when the scope ends");
}

#[test]
fn batch_norm_keeps_the_input_dtype_and_group_norm_runs_in_f32_under_autocast() {
    let dev = kiln_backend_cpu::Cpu::device(0);
    let x = Var::constant(
        kiln_core::Generator::new(5)
            .uniform::<kiln_backend_cpu::Cpu>([4, 6, 3, 3], -1.0, 1.0, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
    );
    let _amp = kiln_autograd::autocast(DType::BF16).unwrap();
    // Batch norm: output in the input's dtype, statistics in f32 (`batch_norm_half.rs`).
    let (y, stats) = x.batch_norm_train(None, None, 1e-5).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(stats.mean.dtype(), DType::F32);
    assert_eq!(
        x.group_norm(3, None, None, 1e-5).unwrap().dtype(),
        DType::F32
    );
}
