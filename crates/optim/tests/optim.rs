//! Optimizer steps against hand-computed values, clipping, schedules, state save/load and a
//! tiny training run, on the f64 reference backend.

use kiln_autograd::Var;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::assert_close;
use kiln_core::{DType, Generator, RandDist, Reduction, Tensor};
use kiln_nn::{LinearConfig, Module, Relu, Sequential, loss};
use kiln_optim::{
    AdamConfig, AdamWConfig, Constant, CosineAnnealing, LinearWarmup, LrSchedule, Optimizer,
    SgdConfig, StepLr, clip_grad_norm, clip_grad_value, grad_norm,
};

type B = Reference;
const DEV: RefDevice = RefDevice(0);

fn t(v: &[f64]) -> Tensor<B> {
    Tensor::from_vec(v.to_vec(), [v.len()], &DEV).unwrap()
}
fn vals(p: &Var<B>) -> Vec<f64> {
    p.tensor().to_vec().unwrap()
}
fn close(a: &[f64], b: &[f64]) {
    assert_close("parameters", a, b, 1e-12);
}

#[test]
fn sgd_plain_step() {
    let p = Var::param(t(&[1.0, 2.0]));
    let mut opt = SgdConfig::new(0.1).init(vec![p.clone()]).unwrap();
    p.set_grad(Some(t(&[0.5, -1.0]))).unwrap();
    opt.step().unwrap();
    close(&vals(&p), &[0.95, 2.1]);
    opt.zero_grad();
    assert!(p.grad().is_none());
    // No gradient: no update.
    opt.step().unwrap();
    close(&vals(&p), &[0.95, 2.1]);
}

/// SGD with momentum, dampening, Nesterov and weight decay, in plain f64 (torch.optim.SGD).
fn sgd_ref(p: &mut [f64], buf: &mut Option<Vec<f64>>, g: &[f64], c: SgdConfig) {
    let d: Vec<f64> = g
        .iter()
        .zip(p.iter())
        .map(|(g, p)| g + c.weight_decay * p)
        .collect();
    let b: Vec<f64> = match buf {
        None => d.clone(),
        Some(b) => b
            .iter()
            .zip(&d)
            .map(|(b, d)| c.momentum * b + (1.0 - c.dampening) * d)
            .collect(),
    };
    let upd: Vec<f64> = if c.nesterov {
        d.iter().zip(&b).map(|(d, b)| d + c.momentum * b).collect()
    } else {
        b.clone()
    };
    for (p, u) in p.iter_mut().zip(&upd) {
        *p -= c.lr * u;
    }
    *buf = Some(b);
}

#[test]
fn sgd_momentum_nesterov_weight_decay_match_the_formula() {
    let grads = [[0.5, -1.0, 0.25], [-0.2, 0.3, 0.0], [1.0, 1.0, -2.0]];
    for cfg in [
        SgdConfig::new(0.1).with_momentum(0.9),
        SgdConfig::new(0.1).with_momentum(0.9).with_dampening(0.1),
        SgdConfig::new(0.05)
            .with_momentum(0.8)
            .with_nesterov(true)
            .with_weight_decay(0.01),
        SgdConfig::new(0.1).with_weight_decay(0.1),
    ] {
        let p = Var::param(t(&[1.0, -2.0, 3.0]));
        let mut opt = cfg.init(vec![p.clone()]).unwrap();
        let mut want = vec![1.0, -2.0, 3.0];
        let mut buf = None;
        for g in &grads {
            p.set_grad(Some(t(g))).unwrap();
            opt.step().unwrap();
            sgd_ref(&mut want, &mut buf, g, cfg);
            close(&vals(&p), &want);
        }
    }
    // Hand-computed: momentum 0.9, lr 0.1, g = 1 twice: buf 1 then 1.9; p = 1 - 0.1 - 0.19.
    let p = Var::param(t(&[1.0]));
    let mut opt = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .init(vec![p.clone()])
        .unwrap();
    for _ in 0..2 {
        p.set_grad(Some(t(&[1.0]))).unwrap();
        opt.step().unwrap();
    }
    close(&vals(&p), &[1.0 - 0.1 - 0.19]);
    assert!(
        SgdConfig::new(0.1)
            .with_nesterov(true)
            .init::<B>(vec![])
            .is_err()
    );
    assert!(SgdConfig::new(-1.0).init::<B>(vec![]).is_err());
    assert!(SgdConfig::new(f64::NAN).init::<B>(vec![]).is_err());
}

#[test]
fn one_adam_step_is_the_formula() {
    // After one step m̂ = g and v̂ = g², so p -= lr * g / (|g| + eps).
    let p = Var::param(t(&[1.0, -2.0, 0.0]));
    let mut opt = AdamConfig::new(0.01).init(vec![p.clone()]).unwrap();
    let g = [0.5, -4.0, 1e-3];
    p.set_grad(Some(t(&g))).unwrap();
    opt.step().unwrap();
    let want: Vec<f64> = [1.0, -2.0, 0.0]
        .iter()
        .zip(&g)
        .map(|(p, g)| p - 0.01 * g / (g.abs() + 1e-8))
        .collect();
    close(&vals(&p), &want);
}

/// torch.optim.Adam / AdamW in plain f64.
#[allow(clippy::too_many_arguments)]
fn adam_ref(
    p: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    g: &[f64],
    t: i32,
    c: AdamConfig,
    decoupled: bool,
) {
    for i in 0..p.len() {
        let mut gi = g[i];
        if decoupled {
            p[i] *= 1.0 - c.lr * c.weight_decay;
        } else {
            gi += c.weight_decay * p[i];
        }
        m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
        v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        p[i] -= c.lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + c.eps);
    }
}

#[test]
fn adam_and_adamw_match_the_formula_over_several_steps() {
    let grads = [
        [0.5, -1.0, 0.25],
        [-0.2, 0.3, 0.0],
        [1.0, 1.0, -2.0],
        [0.1, 0.1, 0.1],
    ];
    for (decoupled, cfg) in [
        (false, AdamConfig::new(0.01)),
        (
            false,
            AdamConfig::new(0.02)
                .with_betas(0.8, 0.99)
                .with_weight_decay(0.1),
        ),
        (true, AdamWConfig::new(0.01).0),
        (
            true,
            AdamWConfig::new(0.05)
                .with_weight_decay(0.3)
                .with_eps(1e-6)
                .0,
        ),
    ] {
        let p = Var::param(t(&[1.0, -2.0, 3.0]));
        let mut opt = if decoupled {
            AdamWConfig(cfg).init(vec![p.clone()]).unwrap()
        } else {
            cfg.init(vec![p.clone()]).unwrap()
        };
        assert_eq!(opt.name(), if decoupled { "adamw" } else { "adam" });
        let (mut want, mut m, mut v) = (vec![1.0, -2.0, 3.0], vec![0.0; 3], vec![0.0; 3]);
        for (k, g) in grads.iter().enumerate() {
            p.set_grad(Some(t(g))).unwrap();
            opt.step().unwrap();
            adam_ref(&mut want, &mut m, &mut v, g, k as i32 + 1, cfg, decoupled);
            close(&vals(&p), &want);
        }
    }
    assert_eq!(AdamWConfig::default().0.weight_decay, 1e-2);
    assert!(
        AdamConfig::new(0.1)
            .with_betas(1.0, 0.9)
            .init::<B>(vec![])
            .is_err()
    );
}

#[test]
fn parameters_without_gradients_keep_their_value_and_state() {
    let a = Var::param(t(&[1.0]));
    let b = Var::param(t(&[1.0]));
    let mut opt = AdamConfig::new(0.1)
        .init(vec![a.clone(), b.clone()])
        .unwrap();
    a.set_grad(Some(t(&[1.0]))).unwrap();
    opt.step().unwrap();
    close(&vals(&b), &[1.0]);
    // b's first step later is still a first step (bias correction from t = 1).
    opt.zero_grad();
    b.set_grad(Some(t(&[2.0]))).unwrap();
    opt.step().unwrap();
    close(&vals(&b), &[1.0 - 0.1 * 2.0 / (2.0 + 1e-8)]);
    let st = opt.state().unwrap();
    assert_eq!(st.tensors["0.step"].to_scalar().unwrap(), 1.0);
    assert_eq!(st.tensors["1.step"].to_scalar().unwrap(), 1.0);
}

#[test]
fn clipping_by_global_norm_and_value() {
    let a = Var::param(t(&[0.0, 0.0]));
    let b = Var::param(t(&[0.0]));
    let c = Var::param(t(&[0.0])); // no gradient: ignored
    a.set_grad(Some(t(&[3.0, 4.0]))).unwrap();
    b.set_grad(Some(t(&[12.0]))).unwrap();
    let ps = [a.clone(), b.clone(), c.clone()];
    assert!((grad_norm(&ps).unwrap() - 13.0).abs() < 1e-12);
    // Below the threshold: untouched.
    assert!((clip_grad_norm(&ps, 20.0).unwrap().to_scalar().unwrap() - 13.0).abs() < 1e-12);
    close(&a.grad().unwrap().to_vec().unwrap(), &[3.0, 4.0]);
    // Above: scaled by max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_.
    let n = clip_grad_norm(&ps, 6.5).unwrap().to_scalar().unwrap();
    assert!((n - 13.0).abs() < 1e-12);
    let k = 6.5 / (13.0 + 1e-6);
    close(&a.grad().unwrap().to_vec().unwrap(), &[3.0 * k, 4.0 * k]);
    close(&b.grad().unwrap().to_vec().unwrap(), &[12.0 * k]);
    assert!((grad_norm(&ps).unwrap() - 6.5).abs() < 1e-5);
    assert!(c.grad().is_none());
    clip_grad_value(&ps, 1.0).unwrap();
    close(&b.grad().unwrap().to_vec().unwrap(), &[1.0]);
    assert!(clip_grad_norm(&ps, -1.0).is_err());
    assert_eq!(grad_norm::<B>(&[c]).unwrap(), 0.0);
}

#[test]
fn schedules() {
    let s = StepLr {
        base: 1.0,
        step_size: 3,
        gamma: 0.1,
    };
    let got: Vec<f64> = (0..7).map(|i| s.lr(i)).collect();
    let want = [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.01];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{got:?}");
    }
    let c = CosineAnnealing {
        base: 1.0,
        t_max: 4,
        eta_min: 0.1,
    };
    assert!((c.lr(0) - 1.0).abs() < 1e-12);
    assert!((c.lr(2) - 0.55).abs() < 1e-12);
    assert!((c.lr(4) - 0.1).abs() < 1e-12);
    assert!((c.lr(9) - 0.1).abs() < 1e-12);
    let half = 0.1 + 0.9 * (1.0 + (std::f64::consts::PI / 4.0).cos()) / 2.0;
    assert!((c.lr(1) - half).abs() < 1e-12);
    let w = LinearWarmup {
        warmup: 4,
        start_factor: 0.0,
        after: c,
    };
    let got: Vec<f64> = (0..6).map(|i| w.lr(i)).collect();
    let want = [0.0, 0.25, 0.5, 0.75, 1.0, half];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{got:?}");
    }
    assert_eq!(Constant(0.3).lr(100), 0.3);
    let boxed: Box<dyn LrSchedule> = Box::new(s);
    assert!((boxed.lr(3) - 0.1).abs() < 1e-12);
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln_optim_{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn state_round_trip_resumes_exactly_and_bad_state_is_rejected() {
    let grads = [[0.5, -1.0], [0.2, 0.1], [-0.3, 0.7], [0.9, -0.9]];
    for kind in ["sgd", "adam", "adamw"] {
        let make = |p: &Var<B>| -> Box<dyn Optimizer<B>> {
            match kind {
                "sgd" => Box::new(
                    SgdConfig::new(0.1)
                        .with_momentum(0.9)
                        .init(vec![p.clone()])
                        .unwrap(),
                ),
                "adam" => Box::new(AdamConfig::new(0.1).init(vec![p.clone()]).unwrap()),
                _ => Box::new(AdamWConfig::new(0.1).init(vec![p.clone()]).unwrap()),
            }
        };
        let p1 = Var::param(t(&[1.0, 2.0]));
        let mut o1 = make(&p1);
        for g in &grads[..2] {
            p1.set_grad(Some(t(g))).unwrap();
            o1.step().unwrap();
        }
        o1.set_lr(0.05);
        let path = tmp(&format!("{kind}.safetensors"));
        o1.state().unwrap().save(&path).unwrap();
        // A fresh optimizer over a copy of the parameter resumes from the file.
        let p2 = Var::param(p1.tensor());
        let mut o2 = make(&p2);
        let st = kiln_optim::OptimizerState::load(&path, o2.params()).unwrap();
        o2.load_state(st).unwrap();
        assert_eq!(o2.lr(), 0.05);
        for g in &grads[2..] {
            for (p, o) in [(&p1, &mut o1), (&p2, &mut o2)] {
                p.set_grad(Some(t(g))).unwrap();
                o.step().unwrap();
            }
            assert_eq!(vals(&p1), vals(&p2), "{kind}");
        }
    }

    // Errors: another optimizer's state, a wrong shape, an unknown tensor. Nothing changes.
    let p = Var::param(t(&[1.0, 2.0]));
    let mut adam = AdamConfig::new(0.1).init(vec![p.clone()]).unwrap();
    p.set_grad(Some(t(&[1.0, 1.0]))).unwrap();
    adam.step().unwrap();
    let good = adam.state().unwrap();
    let sgd_state = {
        let q = Var::param(t(&[1.0, 2.0]));
        let mut s = SgdConfig::new(0.1)
            .with_momentum(0.9)
            .init(vec![q.clone()])
            .unwrap();
        q.set_grad(Some(t(&[1.0, 1.0]))).unwrap();
        s.step().unwrap();
        s.state().unwrap()
    };
    let e = adam.load_state(sgd_state).unwrap_err().to_string();
    assert!(e.contains("sgd") && e.contains("adam"), "{e}");
    let mut wrong = good.clone();
    wrong
        .tensors
        .insert("0.exp_avg".into(), t(&[1.0, 2.0, 3.0]));
    wrong.tensors.insert("7.exp_avg".into(), t(&[1.0]));
    wrong.metadata.insert("lr".into(), "0.5".into());
    let e = adam.load_state(wrong).unwrap_err().to_string();
    assert!(
        e.contains("`0.exp_avg`") && e.contains("`7.exp_avg`"),
        "{e}"
    );
    assert_eq!(adam.lr(), 0.1, "a rejected state changes nothing");
    let st = adam.state().unwrap();
    assert_eq!(
        st.tensors["0.exp_avg"].to_vec::<f64>().unwrap(),
        good.tensors["0.exp_avg"].to_vec::<f64>().unwrap()
    );
    let mut missing = good.clone();
    missing.tensors.remove("0.exp_avg_sq");
    assert!(adam.load_state(missing).is_err());
}

/// Saving optimizer state replaces the previous file in one step: a reader of the old file
/// keeps all of it, and no temporary file remains.
#[test]
fn state_save_replaces_the_previous_file_atomically() {
    let p = Var::param(t(&[1.0, 2.0, 3.0]));
    let mut adam = AdamConfig::new(0.1).init(vec![p.clone()]).unwrap();
    let dir = std::env::temp_dir().join(format!("kiln_optim_atomic_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("adam.safetensors");
    p.set_grad(Some(t(&[1.0, -1.0, 0.5]))).unwrap();
    adam.step().unwrap();
    adam.state().unwrap().save(&path).unwrap();
    let old_bytes = std::fs::read(&path).unwrap();
    let mut reader = std::fs::File::open(&path).unwrap();
    adam.step().unwrap();
    let newer = adam.state().unwrap();
    newer.save(&path).unwrap();
    let back = kiln_optim::OptimizerState::load(&path, adam.params()).unwrap();
    assert_eq!(
        back.tensors["0.exp_avg"].to_vec::<f64>().unwrap(),
        newer.tensors["0.exp_avg"].to_vec::<f64>().unwrap()
    );
    #[cfg(unix)]
    {
        use std::io::Read;
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got, old_bytes, "the old file was overwritten in place");
    }
    #[cfg(not(unix))]
    drop((&mut reader, old_bytes));
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(names.len(), 1, "no temporary file remains");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tiny_mlp_learns_xor_like_data() {
    // 64 points in 2-d, label = quadrant parity; an MLP must fit it, a linear model cannot.
    let n = 64;
    let x = Generator::new(3)
        .sample::<B>(
            [n, 2],
            RandDist::Uniform {
                low: -1.0,
                high: 1.0,
            },
            DType::F64,
            &DEV,
        )
        .unwrap();
    let xv = x.to_vec::<f64>().unwrap();
    let y: Vec<i64> = (0..n)
        .map(|i| ((xv[2 * i] > 0.0) ^ (xv[2 * i + 1] > 0.0)) as i64)
        .collect();
    let y = Tensor::<B>::from_vec(y, [n], &DEV).unwrap();
    let mut g = Generator::new(1);
    let model = Sequential::<B>::new()
        .add(
            LinearConfig::new(2, 16)
                .with_dtype(DType::F64)
                .init::<B>(&DEV, &mut g)
                .unwrap(),
        )
        .add(Relu)
        .add(
            LinearConfig::new(16, 2)
                .with_dtype(DType::F64)
                .init::<B>(&DEV, &mut g)
                .unwrap(),
        );
    let mut opt = AdamConfig::new(0.05).init(model.parameters()).unwrap();
    let xin = Var::constant(x);
    let mut losses = Vec::new();
    for _ in 0..150 {
        opt.zero_grad();
        let l = loss::cross_entropy(&model.forward(&xin).unwrap(), &y, Reduction::Mean).unwrap();
        losses.push(l.tensor().to_scalar().unwrap());
        l.backward().unwrap();
        opt.step().unwrap();
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < 0.3 * first, "loss {first} -> {last}");
    let logits = model.forward(&xin).unwrap().tensor();
    assert!(loss::accuracy(&logits, &y).unwrap() > 0.9);
}

/// Three parameters of different shapes, with fixed gradients per step.
fn three_params() -> Vec<Var<B>> {
    vec![
        Var::param(
            Generator::new(1)
                .sample::<B>(
                    [3, 4],
                    RandDist::Normal {
                        mean: 0.0,
                        std: 1.0,
                    },
                    DType::F64,
                    &DEV,
                )
                .unwrap(),
        ),
        Var::param(
            Generator::new(2)
                .sample::<B>(
                    [4],
                    RandDist::Normal {
                        mean: 0.0,
                        std: 1.0,
                    },
                    DType::F64,
                    &DEV,
                )
                .unwrap(),
        ),
        Var::param(
            Generator::new(3)
                .sample::<B>(
                    [2, 1, 3],
                    RandDist::Normal {
                        mean: 0.0,
                        std: 1.0,
                    },
                    DType::F64,
                    &DEV,
                )
                .unwrap(),
        ),
    ]
}

fn set_grads(ps: &[Var<B>], step: u64, skip: Option<usize>) {
    for (i, p) in ps.iter().enumerate() {
        if Some(i) == skip {
            p.zero_grad();
            continue;
        }
        let g = Generator::new(100 * step + i as u64)
            .randn_like(&p.tensor())
            .unwrap();
        p.set_grad(Some(g)).unwrap();
    }
}

fn build(kind: &str, ps: Vec<Var<B>>) -> Box<dyn Optimizer<B>> {
    match kind {
        "sgd" => Box::new(sgd_nesterov().init(ps).unwrap()),
        "adam" => Box::new(
            AdamConfig::new(0.01)
                .with_weight_decay(0.1)
                .init(ps)
                .unwrap(),
        ),
        _ => Box::new(AdamWConfig::new(0.01).init(ps).unwrap()),
    }
}

fn sgd_nesterov() -> SgdConfig {
    SgdConfig::new(0.1)
        .with_momentum(0.9)
        .with_nesterov(true)
        .with_weight_decay(0.01)
}

/// Several parameters in one multi-tensor update, split into groups once one of them misses a
/// step (Adam's step counts then differ), each parameter against the formula on its own.
#[test]
fn multi_tensor_updates_match_the_formula_per_parameter() {
    for kind in ["sgd", "adam", "adamw"] {
        let ps = three_params();
        let mut opt = build(kind, ps.clone());
        let mut want: Vec<Vec<f64>> = ps.iter().map(vals).collect();
        let n: Vec<usize> = want.iter().map(Vec::len).collect();
        let mut bufs: Vec<Option<Vec<f64>>> = vec![None; 3];
        let mut moments: Vec<(Vec<f64>, Vec<f64>)> =
            n.iter().map(|&k| (vec![0.0; k], vec![0.0; k])).collect();
        let mut steps = [0i32; 3];
        for step in 0..6u64 {
            let skip = (step == 2).then_some(1);
            set_grads(&ps, step, skip);
            opt.step().unwrap();
            for (i, p) in ps.iter().enumerate() {
                let Some(g) = p.grad() else { continue };
                let g: Vec<f64> = g.to_vec().unwrap();
                steps[i] += 1;
                let (m, v) = &mut moments[i];
                match kind {
                    "sgd" => sgd_ref(&mut want[i], &mut bufs[i], &g, sgd_nesterov()),
                    "adam" => {
                        let c = AdamConfig::new(0.01).with_weight_decay(0.1);
                        adam_ref(&mut want[i], m, v, &g, steps[i], c, false)
                    }
                    _ => {
                        let c = AdamWConfig::new(0.01).0;
                        adam_ref(&mut want[i], m, v, &g, steps[i], c, true)
                    }
                }
                assert_close(
                    &format!("{kind} step {step} param {i}"),
                    &vals(p),
                    &want[i],
                    1e-12,
                );
            }
        }
    }
}

/// Two steps of `torch.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)` and
/// of `torch.optim.AdamW(lr=0.01, weight_decay=0.1)`, worked out by hand in PyTorch's order of
/// operations (SGD exactly in rationals: step 1 is `p - 0.1 * 1.9 * (g + 0.01 p)`).
#[test]
fn two_steps_give_pytorchs_numbers() {
    let grads = [[0.5, -1.0, 0.25], [-0.2, 0.3, 1.0]];
    let sgd_want = [
        [0.9031, -1.8062, 0.45155],
        [0.89807411, -1.77714822, 0.240037055],
    ];
    let adamw_want = [
        [0.9890000002, -1.9880000001, 0.4895000004],
        [0.9845549418114511, -1.9817335142428225, 0.4801667356151488],
    ];
    for (kind, want) in [("sgd", sgd_want), ("adamw", adamw_want)] {
        let p = Var::param(t(&[1.0, -2.0, 0.5]));
        let mut opt: Box<dyn Optimizer<B>> = match kind {
            "sgd" => Box::new(sgd_nesterov().init(vec![p.clone()]).unwrap()),
            _ => Box::new(
                AdamWConfig::new(0.01)
                    .with_weight_decay(0.1)
                    .init(vec![p.clone()])
                    .unwrap(),
            ),
        };
        for (g, w) in grads.iter().zip(want) {
            p.set_grad(Some(t(g))).unwrap();
            opt.step().unwrap();
            close(&vals(&p), &w);
        }
    }
}

#[test]
fn a_parameter_replaced_between_steps_is_updated_from_its_new_value() {
    let ps = three_params();
    let mut opt = build("adam", ps.clone());
    set_grads(&ps, 0, None);
    opt.step().unwrap();
    // Replacing a parameter from outside (loading weights) is seen at the next step.
    ps[1].set_tensor(t(&[5.0, 5.0, 5.0, 5.0])).unwrap();
    let reference = Var::param(t(&[5.0, 5.0, 5.0, 5.0]));
    let mut single = AdamConfig::new(0.01)
        .with_weight_decay(0.1)
        .init(vec![reference.clone()])
        .unwrap();
    // Give the single-parameter optimizer the same history for that parameter.
    let st = opt.state().unwrap();
    let mut one = kiln_optim::OptimizerState {
        tensors: Default::default(),
        metadata: st.metadata.clone(),
    };
    for b in ["step", "exp_avg", "exp_avg_sq"] {
        one.tensors
            .insert(format!("0.{b}"), st.tensors[&format!("1.{b}")].clone());
    }
    single.load_state(one).unwrap();
    set_grads(&ps, 1, None);
    reference.set_grad(ps[1].grad()).unwrap();
    opt.step().unwrap();
    single.step().unwrap();
    assert_eq!(vals(&ps[1]), vals(&reference));
}

#[test]
fn optimizer_state_follows_a_model_moved_to_another_device() {
    for kind in ["sgd", "adam"] {
        let ps = three_params();
        let mut opt = build(kind, ps.clone());
        set_grads(&ps, 0, None);
        opt.step().unwrap();
        let other = RefDevice(1);
        for p in &ps {
            p.set_tensor(p.tensor().to_device(&other).unwrap()).unwrap();
            p.zero_grad();
        }
        for (i, p) in ps.iter().enumerate() {
            let g = Generator::new(7 + i as u64)
                .randn_like(&p.tensor())
                .unwrap();
            p.set_grad(Some(g)).unwrap();
        }
        opt.step().unwrap();
        assert!(ps.iter().all(|p| p.device() == other), "{kind}");
    }
}
