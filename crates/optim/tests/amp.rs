//! Mixed precision on the CPU backend: the GradScaler (planted overflow, growth, unscale before
//! clipping, errors), f32 master weights for 16-bit parameters, and an MLP trained under bf16
//! autocast (and f16 autocast with the scaler) reaching its f32 accuracy.

use kiln_autograd::{Var, autocast};
use kiln_backend_cpu::Cpu;
use kiln_core::testing::assert_close;
use kiln_core::{DType, Generator, RandDist, Reduction, Tensor};
use kiln_nn::{LinearConfig, Module, ModuleExt, Relu, Sequential};
use kiln_optim::{
    AdamConfig, AdamWConfig, GradScaler, GradScalerConfig, Optimizer, SgdConfig, clip_grad_norm,
    grad_norm,
};

type B = Cpu;

fn dev() -> <Cpu as kiln_core::Backend>::Device {
    Cpu::device(0)
}
fn t(v: &[f32]) -> Tensor<B> {
    Tensor::from_vec(v.to_vec(), [v.len()], &dev()).unwrap()
}
fn vals(p: &Var<B>) -> Vec<f64> {
    p.tensor().to_f64_vec().unwrap()
}

/// `loss = Σ c·p` for two parameters, so each gradient is `c` times the scale.
fn scaled_backward(scaler: &GradScaler<B>, p: &Var<B>, q: &Var<B>) {
    let c = Var::constant(t(&[0.5, -1.0]));
    let loss = p
        .mul(&c)
        .unwrap()
        .add(&q.mul(&c).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
}

#[test]
fn planted_overflow_skips_the_step_halves_the_scale_then_grows() {
    let (p, q) = (Var::param(t(&[1.0, 2.0])), Var::param(t(&[3.0, 4.0])));
    let mut opt = SgdConfig::new(0.1)
        .init(vec![p.clone(), q.clone()])
        .unwrap();
    let mut scaler: GradScaler<B> = GradScalerConfig::new()
        .with_init_scale(1024.0)
        .with_growth_interval(3)
        .init()
        .unwrap();
    assert_eq!(scaler.get_scale(), 1024.0);

    // Step 1: an inf planted in one gradient. Skipped, parameters untouched, scale halved.
    scaled_backward(&scaler, &p, &q);
    q.set_grad(Some(t(&[f32::INFINITY, 1.0]))).unwrap();
    assert!(!scaler.step(&mut opt).unwrap(), "the step must be skipped");
    scaler.update().unwrap();
    assert_close("p after skip", &vals(&p), &[1.0, 2.0], 0.0);
    assert_close("q after skip", &vals(&q), &[3.0, 4.0], 0.0);
    assert_eq!(scaler.get_scale(), 512.0);
    opt.zero_grad();

    // A NaN counts as well.
    scaled_backward(&scaler, &p, &q);
    p.set_grad(Some(t(&[f32::NAN, 1.0]))).unwrap();
    assert!(!scaler.step(&mut opt).unwrap());
    scaler.update().unwrap();
    assert_eq!(scaler.get_scale(), 256.0);
    opt.zero_grad();

    // Then clean steps: each updates with the true (unscaled) gradient; after 3 the scale
    // doubles.
    let mut want_p = [1.0f64, 2.0];
    for i in 0..3 {
        scaled_backward(&scaler, &p, &q);
        assert_close(
            "scaled grad",
            &p.grad().unwrap().to_f64_vec().unwrap(),
            &[128.0, -256.0],
            0.0,
        );
        assert!(scaler.step(&mut opt).unwrap(), "clean step {i}");
        scaler.update().unwrap();
        opt.zero_grad();
        want_p = [want_p[0] - 0.1 * 0.5, want_p[1] + 0.1];
        assert_close("p", &vals(&p), &want_p, 1e-6);
    }
    assert_eq!(scaler.get_scale(), 512.0);
    assert_eq!(scaler.growth_tracker(), 0);
}

#[test]
fn unscale_before_clipping_and_misuse_errors() {
    let (p, q) = (Var::param(t(&[1.0, 2.0])), Var::param(t(&[3.0, 4.0])));
    let mut opt = SgdConfig::new(1.0)
        .init(vec![p.clone(), q.clone()])
        .unwrap();
    let mut scaler: GradScaler<B> = GradScaler::new().unwrap();
    assert_eq!(scaler.get_scale(), 65536.0);
    scaled_backward(&scaler, &p, &q);
    scaler.unscale_(&opt).unwrap();
    // Clipping sees the true gradients: norm of [0.5, -1, 0.5, -1].
    let n = grad_norm(opt.params()).unwrap();
    assert!((n - 2.5f64.sqrt()).abs() < 1e-6, "{n}");
    clip_grad_norm(opt.params(), 0.5).unwrap();
    assert!(scaler.unscale_(&opt).is_err(), "unscaling twice");
    assert!(scaler.step(&mut opt).unwrap());
    assert!(scaler.step(&mut opt).is_err(), "stepping twice");
    scaler.update().unwrap();
    assert!(scaler.update().is_err(), "update without a step");
    let moved: f64 = vals(&p)
        .iter()
        .zip([1.0, 2.0])
        .chain(vals(&q).iter().zip([3.0, 4.0]))
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    assert!(
        (moved - 0.5).abs() < 1e-4,
        "the clipped step has norm 0.5, got {moved}"
    );
    // Bad hyperparameters are typed errors.
    assert!(
        GradScalerConfig::new()
            .with_init_scale(0.0)
            .init::<B>()
            .is_err()
    );
    assert!(
        GradScalerConfig::new()
            .with_backoff_factor(1.5)
            .init::<B>()
            .is_err()
    );
    assert!(
        GradScalerConfig::new()
            .with_growth_factor(f64::NAN)
            .init::<B>()
            .is_err()
    );
    assert!(
        GradScalerConfig::new()
            .with_growth_interval(0)
            .init::<B>()
            .is_err()
    );
    // Disabled: the loss passes through and steps always run.
    let mut off = GradScaler::<B>::disabled();
    assert_eq!(off.get_scale(), 1.0);
    p.set_grad(Some(t(&[f32::INFINITY, 0.0]))).unwrap();
    assert!(off.step(&mut opt).unwrap());
    off.update().unwrap();
}

/// A bf16 parameter taking updates below half its ulp: through the f32 master they
/// accumulate; the state is f32; save/load round-trips.
#[test]
fn sixteen_bit_params_update_through_f32_masters() {
    for dtype in [DType::BF16, DType::F16] {
        let p = Var::param(t(&[1.0, -1.0]).to_dtype(dtype).unwrap());
        let mut opt = SgdConfig::new(1.0)
            .with_momentum(0.0)
            .init(vec![p.clone()])
            .unwrap();
        // bf16's ulp at 1 is 2^-7 ≈ 0.0078, f16's 2^-10 ≈ 0.001: 1e-4 rounds away alone.
        for _ in 0..100 {
            p.set_grad(Some(t(&[1e-4, -1e-4]).to_dtype(dtype).unwrap()))
                .unwrap();
            opt.step().unwrap();
        }
        assert_eq!(p.dtype(), dtype);
        let v = vals(&p);
        // 1 - 100·1e-4 = 0.99, rounded to the type (bf16: 0.98828125; half its spacing there
        // is 0.002). Without masters every step rounds back to 1.
        assert!((v[0] - 0.99).abs() < 0.003, "{dtype}: {v:?}");
        assert!((v[1] + 0.99).abs() < 0.003, "{dtype}: {v:?}");
        // The f32 master is saved with the state; a fresh SGD resumes from it.
        let st = opt.state().unwrap();
        let master = st.tensors["0.master_weight"].to_f64_vec().unwrap();
        assert!((master[0] - 0.99).abs() < 1e-4, "{dtype}: {master:?}");
        let q = Var::param(p.tensor());
        let mut resumed = SgdConfig::new(1.0).init(vec![q.clone()]).unwrap();
        resumed.load_state(st).unwrap();
        for (x, o) in [(&p, &mut opt), (&q, &mut resumed)] {
            x.set_grad(Some(t(&[0.004, -0.004]).to_dtype(dtype).unwrap()))
                .unwrap();
            o.step().unwrap();
        }
        assert_eq!(vals(&p), vals(&q), "{dtype}");

        let mut adam = AdamConfig::new(1e-3).init(vec![p.clone()]).unwrap();
        p.set_grad(Some(t(&[1.0, 1.0]).to_dtype(dtype).unwrap()))
            .unwrap();
        adam.step().unwrap();
        let st = adam.state().unwrap();
        assert_eq!(st.tensors["0.exp_avg"].dtype(), DType::F32, "state in f32");
        let mut again = AdamConfig::new(1e-3).init(vec![p.clone()]).unwrap();
        again.load_state(st).unwrap();
    }
}

/// Four Gaussian blobs in 16 dimensions (noise drawn with `seed`); labels `i64`.
fn blobs(seed: u64, n: usize) -> (Tensor<B>, Tensor<B>) {
    let normal = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    // The same centers for the training and the test set; the noise differs.
    let centers = Generator::new(1)
        .sample::<B>([4, 16], normal, DType::F32, &dev())
        .unwrap()
        .mul_scalar(1.5)
        .unwrap();
    let labels: Vec<i64> = (0..n).map(|i| (i % 4) as i64).collect();
    let y = Tensor::<B>::from_vec(labels, [n], &dev()).unwrap();
    let noise = Generator::new(seed)
        .sample::<B>([n, 16], normal, DType::F32, &dev())
        .unwrap();
    let x = centers.index_select(0, &y).unwrap().add(&noise).unwrap();
    (x, y)
}

/// Trains a 16-64-4 MLP with Adam for 150 steps at `precision` and returns the test accuracy.
fn train(precision: Option<DType>) -> f64 {
    let (x, y) = blobs(7, 512);
    let (xt, yt) = blobs(8, 512);
    let mut g = Generator::new(3);
    let model = Sequential::new()
        .add(LinearConfig::new(16, 64).init::<B>(&dev(), &mut g).unwrap())
        .add(Relu)
        .add(LinearConfig::new(64, 4).init::<B>(&dev(), &mut g).unwrap());
    let mut opt = AdamConfig::new(1e-2).init(model.parameters()).unwrap();
    let mut scaler: GradScaler<B> = GradScalerConfig::new()
        .with_enabled(precision == Some(DType::F16))
        .init()
        .unwrap();
    let x = Var::constant(x);
    for _ in 0..150 {
        let loss = {
            let _amp = precision.map(|d| autocast(d).unwrap());
            let logits = model.forward(&x).unwrap();
            assert_eq!(logits.dtype(), precision.unwrap_or(DType::F32));
            logits.cross_entropy(&y, Reduction::Mean).unwrap()
        };
        assert_eq!(loss.dtype(), DType::F32);
        scaler.scale(&loss).unwrap().backward().unwrap();
        for p in opt.params() {
            assert_eq!(p.grad().unwrap().dtype(), DType::F32);
        }
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        opt.zero_grad();
    }
    let logits = kiln_autograd::no_grad(|| {
        let _amp = precision.map(|d| autocast(d).unwrap());
        model.forward(&Var::constant(xt)).unwrap().tensor()
    });
    let pred = logits.argmax(-1, false).unwrap().to_f64_vec().unwrap();
    let want = yt.to_f64_vec().unwrap();
    pred.iter().zip(&want).filter(|(a, b)| a == b).count() as f64 / want.len() as f64
}

#[test]
fn mlp_trains_under_autocast_to_its_f32_accuracy() {
    let f32_acc = train(None);
    let bf16_acc = train(Some(DType::BF16));
    let f16_acc = train(Some(DType::F16));
    eprintln!("accuracy: f32 {f32_acc}, bf16 {bf16_acc}, f16 {f16_acc}");
    assert!(f32_acc > 0.9, "the problem is learnable in f32: {f32_acc}");
    assert!(
        bf16_acc >= f32_acc - 0.02,
        "bf16 {bf16_acc} vs f32 {f32_acc}"
    );
    assert!(f16_acc >= f32_acc - 0.02, "f16 {f16_acc} vs f32 {f32_acc}");
}

/// A bf16 16-32-4 MLP (the same weights for the same `seed`).
fn bf16_mlp(seed: u64) -> Sequential<B> {
    let mut g = Generator::new(seed);
    Sequential::new()
        .add(
            LinearConfig::new(16, 32)
                .with_dtype(DType::BF16)
                .init::<B>(&dev(), &mut g)
                .unwrap(),
        )
        .add(Relu)
        .add(
            LinearConfig::new(32, 4)
                .with_dtype(DType::BF16)
                .init::<B>(&dev(), &mut g)
                .unwrap(),
        )
}

/// One AdamW step of `model` on batch `k` of the blobs.
fn bf16_step(model: &Sequential<B>, opt: &mut dyn Optimizer<B>, k: u64) {
    let (x, y) = blobs(100 + k, 64);
    let x = Var::constant(x.to_dtype(DType::BF16).unwrap());
    let logits = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
    let loss = logits.cross_entropy(&y, Reduction::Mean).unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
    opt.zero_grad();
}

/// Every parameter's bits (f64 bits, so -0 and +0 differ; bf16 → f64 is exact).
fn bits(model: &Sequential<B>) -> Vec<Vec<u64>> {
    model
        .parameters()
        .iter()
        .map(|p| {
            assert_eq!(p.dtype(), DType::BF16);
            vals(p).iter().map(|v| v.to_bits()).collect()
        })
        .collect()
}

fn amp_tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln_optim_amp_{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// The f32 masters of bf16 parameters are saved with the optimizer state, so a run resumed
/// from files (model, then optimizer, or the other way round) continues bit for bit as the
/// uninterrupted one; a state without masters (an older file) still loads and resumes from
/// the rounded weights, which differs.
#[test]
fn bf16_masters_are_saved_and_a_resumed_run_matches_bit_for_bit() {
    let adamw = || AdamWConfig::new(1e-3);
    let model = bf16_mlp(5);
    let mut opt = adamw().init(model.parameters()).unwrap();
    for k in 0..4 {
        bf16_step(&model, &mut opt, k);
    }
    let st = opt.state().unwrap();
    for i in 0..4 {
        let m = &st.tensors[&format!("{i}.master_weight")];
        assert_eq!(m.dtype(), DType::F32);
        assert_eq!(m.shape(), model.parameters()[i].tensor().shape());
    }
    let (model_path, opt_path) = (amp_tmp("model.safetensors"), amp_tmp("opt.safetensors"));
    model.save(&model_path).unwrap();
    opt.save_state(&opt_path).unwrap();
    // An "old" state file: the same state without the masters.
    let mut old = st.clone();
    old.tensors.retain(|k, _| !k.ends_with(".master_weight"));
    let old_path = amp_tmp("old.safetensors");
    old.save(&old_path).unwrap();

    // Fresh models (other initial weights) and optimizers resumed from the files.
    let resume = |state: &std::path::Path, model_first: bool| {
        let m = bf16_mlp(6);
        let mut o = adamw().init(m.parameters()).unwrap();
        if model_first {
            m.load(&model_path).unwrap();
        }
        o.load_state_file(state).unwrap();
        if !model_first {
            m.load(&model_path).unwrap();
        }
        (m, o)
    };
    let (m1, mut o1) = resume(&opt_path, true);
    let (m2, mut o2) = resume(&opt_path, false);
    let (m3, mut o3) = resume(&old_path, true);
    assert!(bits(&m1) == bits(&model));
    for k in 4..8 {
        bf16_step(&model, &mut opt, k);
        bf16_step(&m1, &mut o1, k);
        bf16_step(&m2, &mut o2, k);
        bf16_step(&m3, &mut o3, k);
    }
    let want = bits(&model);
    assert!(bits(&m1) == want, "resumed (model loaded first) diverged");
    assert!(
        bits(&m2) == want,
        "resumed (optimizer loaded first) diverged"
    );
    assert!(
        bits(&m3) != want,
        "without masters the run resumes from the rounded weights, so it differs"
    );
    // ... and takes its masters from the widened weights: a state saved now has them.
    assert!(o3.state().unwrap().tensors.contains_key("0.master_weight"));

    // A master that does not round to the parameter (weights of another run) is dropped:
    // the step widens the parameter, exactly as with a state without masters.
    let (m4, mut o4) = resume(&opt_path, true);
    let (m5, mut o5) = resume(&old_path, true);
    for m in [&m4, &m5] {
        let other = bf16_mlp(9);
        for (p, q) in m.parameters().iter().zip(other.parameters()) {
            p.set_tensor(q.tensor()).unwrap();
        }
    }
    bf16_step(&m4, &mut o4, 8);
    bf16_step(&m5, &mut o5, 8);
    assert!(bits(&m4) == bits(&m5), "a foreign master was used");

    // Errors name the op and the tensor; a rejected state changes nothing.
    let before = opt.state().unwrap();
    let mut bad = before.clone();
    bad.tensors.insert("0.master_weight".into(), t(&[1.0, 2.0]));
    let one = bad.tensors["1.master_weight"]
        .to_dtype(DType::BF16)
        .unwrap();
    bad.tensors.insert("1.master_weight".into(), one);
    let e = opt.load_state(bad).unwrap_err().to_string();
    assert!(
        e.starts_with("Adam::load_state")
            && e.contains("`0.master_weight`")
            && e.contains("`1.master_weight`: expected f32"),
        "{e}"
    );
    let after = opt.state().unwrap();
    assert_eq!(
        after.tensors["0.master_weight"].to_f64_vec().unwrap(),
        before.tensors["0.master_weight"].to_f64_vec().unwrap()
    );
    // An f32 parameter has no master.
    let p = Var::param(t(&[1.0, 2.0]));
    let mut f32_opt = adamw().init(vec![p.clone()]).unwrap();
    p.set_grad(Some(t(&[1.0, 1.0]))).unwrap();
    f32_opt.step().unwrap();
    let mut st = f32_opt.state().unwrap();
    assert!(!st.tensors.contains_key("0.master_weight"));
    st.tensors.insert("0.master_weight".into(), t(&[1.0, 2.0]));
    let e = f32_opt.load_state(st).unwrap_err().to_string();
    assert!(
        e.contains("parameter 0 is f32 and has no master copy"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(model_path.parent().unwrap());
}
