//! Layers, containers, save/load, losses and gradient checks, on the f64 reference backend
//! (exact math, two virtual devices for `to_device`).

use std::collections::BTreeMap;

use kiln_autograd::{CheckOptions, Var, check_backward};
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::assert_close;
use kiln_core::{DType, Generator, RandDist, Reduction, Tensor};
use kiln_nn::loss::{accuracy, bce_with_logits, correct_count, cross_entropy, mse};
use kiln_nn::{
    Conv2dConfig, Dropout, Flatten, Gelu, LinearConfig, MaxPool2d, Module, ModuleExt, Relu,
    Sequential, Sigmoid, Tanh, Window, conv2d, max_pool2d,
};

type B = Reference;
const DEV: RefDevice = RefDevice(0);

fn t(v: &[f64], dims: &[usize]) -> Tensor<B> {
    Tensor::from_vec(v.to_vec(), dims.to_vec(), &DEV).unwrap()
}

fn randn(dims: &[usize], seed: u64) -> Tensor<B> {
    Generator::new(seed)
        .sample(
            dims.to_vec(),
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            DType::F64,
            &DEV,
        )
        .unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) {
    assert_close("values", a, b, tol);
}

fn mlp(seed: u64) -> Sequential<B> {
    let mut g = Generator::new(seed);
    Sequential::new()
        .add(
            LinearConfig::new(4, 3)
                .with_dtype(DType::F64)
                .init::<B>(&DEV, &mut g)
                .unwrap(),
        )
        .add(Relu)
        .add(
            LinearConfig::new(3, 2)
                .with_dtype(DType::F64)
                .init::<B>(&DEV, &mut g)
                .unwrap(),
        )
}

#[test]
fn linear_is_x_wt_plus_b() {
    let l = LinearConfig::new(3, 2)
        .with_dtype(DType::F64)
        .init::<B>(&DEV, &mut Generator::new(1))
        .unwrap();
    assert_eq!(l.weight.dims(), vec![2, 3]);
    assert_eq!(l.bias.as_ref().unwrap().dims(), vec![2]);
    l.weight
        .set_tensor(t(&[1., 2., 3., 4., 5., 6.], &[2, 3]))
        .unwrap();
    l.bias
        .as_ref()
        .unwrap()
        .set_tensor(t(&[0.5, -1.], &[2]))
        .unwrap();
    let x = Var::constant(t(&[1., 0., -1., 2., 1., 0.], &[2, 3]));
    let y = l.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    // row 0: [1-3, 4-6] + b = [-1.5, -3]; row 1: [2+2, 8+5] + b = [4.5, 12]
    assert_eq!(y, vec![-1.5, -3., 4.5, 12.]);
    let names: Vec<String> = l.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "bias"]);
    assert!(l.forward(&Var::constant(randn(&[2, 4], 0))).is_err());
    let nb = LinearConfig::new(3, 2)
        .with_bias(false)
        .init::<B>(&DEV, &mut Generator::new(1))
        .unwrap();
    assert_eq!(nb.parameters().len(), 1);
    assert!(
        LinearConfig::new(0, 2)
            .init::<B>(&DEV, &mut Generator::new(1))
            .is_err()
    );
}

#[test]
fn sequential_names_match_pytorch() {
    let m = mlp(3);
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
    assert_eq!(m.num_params(), 4 * 3 + 3 + 3 * 2 + 2);
    assert!(
        m.describe()
            .starts_with("Sequential((0): Linear(in=4, out=3")
    );
    // Same seed, same weights; another seed, other weights.
    let a = mlp(3).state_dict();
    let b = mlp(3).state_dict();
    let c = mlp(4).state_dict();
    for ((_, x), (_, y)) in a.iter().zip(&b) {
        assert_eq!(x.to_vec::<f64>().unwrap(), y.to_vec::<f64>().unwrap());
    }
    assert_ne!(
        a[0].1.to_vec::<f64>().unwrap(),
        c[0].1.to_vec::<f64>().unwrap()
    );
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln_nn_mod_{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn save_then_load_reproduces_outputs() {
    let a = mlp(1);
    let b = mlp(2);
    let x = Var::constant(randn(&[5, 4], 9));
    let ya = a.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    let yb = b.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    assert_ne!(ya, yb);
    let p = tmp("mlp.safetensors");
    a.save(&p).unwrap();
    b.load(&p).unwrap();
    let yb = b.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    assert_eq!(ya, yb);
}

#[test]
fn bad_files_are_rejected_and_leave_the_model_unchanged() {
    let m = mlp(1);
    let before: Vec<Vec<f64>> = m
        .state_dict()
        .iter()
        .map(|(_, t)| t.to_vec().unwrap())
        .collect();
    let unchanged = |m: &Sequential<B>| {
        let now: Vec<Vec<f64>> = m
            .state_dict()
            .iter()
            .map(|(_, t)| t.to_vec().unwrap())
            .collect();
        assert_eq!(now, before);
    };
    let good: BTreeMap<String, Tensor<B>> = mlp(7).state_dict().into_iter().collect();

    // Missing tensor: every other one is fine, but nothing may be assigned.
    let mut missing = good.clone();
    missing.remove("2.bias");
    let e = m
        .load_tensors("missing.safetensors", missing)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing tensors: `2.bias`"), "{e}");
    assert!(e.contains("missing.safetensors"), "{e}");
    unchanged(&m);

    // Extra tensor.
    let mut extra = good.clone();
    extra.insert("4.weight".into(), randn(&[2, 2], 0));
    let e = m.load_tensors("extra", extra).unwrap_err().to_string();
    assert!(e.contains("unexpected tensors: `4.weight`"), "{e}");
    unchanged(&m);

    // Wrong shape (a transposed weight) and wrong dtype.
    let mut shaped = good.clone();
    shaped.insert("0.weight".into(), randn(&[4, 3], 0));
    shaped.insert(
        "0.bias".into(),
        Tensor::zeros([3], DType::F32, &DEV).unwrap(),
    );
    let e = m.load_tensors("shaped", shaped).unwrap_err().to_string();
    assert!(
        e.contains("`0.weight`: expected f64 [3, 4], file has f64 [4, 3]"),
        "{e}"
    );
    assert!(
        e.contains("`0.bias`: expected f64 [3], file has f32 [3]"),
        "{e}"
    );
    unchanged(&m);

    // The same through a file, and a file that does not exist.
    let p = tmp("bad.safetensors");
    let named: Vec<(String, Tensor<B>)> = good
        .iter()
        .filter(|(k, _)| k.as_str() != "0.bias")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    kiln_nn::save_safetensors(&p, &named, None).unwrap();
    let e = m.load(&p).unwrap_err().to_string();
    assert!(
        e.contains("`0.bias`") && e.contains("bad.safetensors"),
        "{e}"
    );
    unchanged(&m);
    assert!(m.load(tmp("nope.safetensors")).is_err());
    unchanged(&m);

    // The good one loads.
    m.load_tensors("good", good).unwrap();
}

#[test]
fn to_device_moves_every_parameter_and_the_optimizer_view_follows() {
    let m = mlp(1);
    let held = m.parameters(); // what an optimizer would hold
    let x0 = randn(&[2, 4], 3);
    let y0 = m.forward(&Var::constant(x0.clone())).unwrap().tensor();
    let m = m.to_device(&RefDevice(1)).unwrap();
    for p in m.parameters().iter().chain(&held) {
        assert_eq!(p.device(), RefDevice(1));
    }
    // Inputs on the old device are an error naming both devices; on the new one it works.
    let e = m
        .forward(&Var::constant(x0.clone()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("ref") && e.contains("ref:1"), "{e}");
    let y1 = m
        .forward(&Var::constant(x0.to_device(&RefDevice(1)).unwrap()))
        .unwrap()
        .tensor();
    assert_eq!(y1.device(), &RefDevice(1));
    assert_eq!(y0.to_vec::<f64>().unwrap(), y1.to_vec::<f64>().unwrap());
}

#[test]
fn activations_and_flatten() {
    let x = Var::constant(t(&[-1.0, 0.0, 2.0, 0.5], &[1, 4]));
    let get = |m: &dyn Module<B>| m.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    assert_eq!(get(&Relu), vec![0.0, 0.0, 2.0, 0.5]);
    close(
        &get(&Sigmoid),
        &[-1.0f64, 0.0, 2.0, 0.5].map(|v| 1.0 / (1.0 + (-v).exp())),
        1e-12,
    );
    close(&get(&Tanh), &[-1.0f64, 0.0, 2.0, 0.5].map(f64::tanh), 1e-12);
    // GELU(x) = x Φ(x): Φ(-1) = 0.158655..., Φ(2) = 0.977249..., Φ(0.5) = 0.691462...
    close(
        &get(&Gelu),
        &[-0.158_655_253_9, 0.0, 1.954_499_736_1, 0.345_731_230_6],
        1e-9,
    );
    let img = Var::constant(randn(&[2, 3, 4, 5], 1));
    assert_eq!(Flatten.forward(&img).unwrap().dims(), vec![2, 60]);
}

#[test]
fn dropout_masks_are_deterministic_scaled_and_off_in_eval() {
    let x = Var::constant(Tensor::<B>::ones([1000], DType::F64, &DEV).unwrap());
    let mut d = Dropout::new(0.25, &mut Generator::new(42)).unwrap();
    let a = d.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    let b = d.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap();
    assert_eq!(d.step(), 2);
    // Kept values are scaled by 1 / (1 - p); roughly p of them are dropped.
    assert!(
        a.iter()
            .all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-12)
    );
    let dropped = a.iter().filter(|&&v| v == 0.0).count();
    assert!((200..300).contains(&dropped), "{dropped}");
    assert_ne!(a, b, "each forward draws a new mask");
    // A second layer built from the same generator replays the same masks, step by step.
    let d2 = Dropout::new(0.25, &mut Generator::new(42)).unwrap();
    assert_eq!(d2.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap(), a);
    d2.set_step(1);
    assert_eq!(d2.forward(&x).unwrap().tensor().to_vec::<f64>().unwrap(), b);
    // The mask is a function of (key, step) only, so a backend with the same Philox (the CPU
    // and the GPU) draws the same: check it against the generator itself.
    let m = d.mask(&x.tensor(), 0).unwrap().to_vec::<f64>().unwrap();
    assert_eq!(m, a);
    // Eval mode is the identity and draws nothing.
    d.eval();
    let e = d.forward(&x).unwrap();
    assert!(e.ptr_eq(&x));
    assert_eq!(d.step(), 2);
    assert!(Dropout::new(1.0, &mut Generator::new(0)).is_err());
    // The gradient goes through the same mask.
    d.train();
    let p = Var::param(Tensor::<B>::ones([1000], DType::F64, &DEV).unwrap());
    d.set_step(0);
    d.forward(&p)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(p.grad().unwrap().to_vec::<f64>().unwrap(), a);
}

/// Direct convolution by definition, for comparison.
#[allow(clippy::too_many_arguments)]
fn naive_conv(
    x: &[f64],
    [n, c, h, w]: [usize; 4],
    wt: &[f64],
    [oc, kh, kw]: [usize; 3],
    b: &[f64],
    s: usize,
    p: usize,
    dl: usize,
) -> (Vec<f64>, [usize; 4]) {
    let oh = (h + 2 * p - dl * (kh - 1) - 1) / s + 1;
    let ow = (w + 2 * p - dl * (kw - 1) - 1) / s + 1;
    let mut out = vec![0.0; n * oc * oh * ow];
    for ni in 0..n {
        for o in 0..oc {
            for y in 0..oh {
                for xx in 0..ow {
                    let mut acc = b[o];
                    for ci in 0..c {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * s + ky * dl) as isize - p as isize;
                                let ix = (xx * s + kx * dl) as isize - p as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                acc += x[((ni * c + ci) * h + iy as usize) * w + ix as usize]
                                    * wt[((o * c + ci) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    out[((ni * oc + o) * oh + y) * ow + xx] = acc;
                }
            }
        }
    }
    (out, [n, oc, oh, ow])
}

#[test]
fn conv2d_matches_the_definition() {
    for &(s, p, dl) in &[(1, 0, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2), (3, 0, 1)] {
        let conv = Conv2dConfig::new(2, 3, 3)
            .with_stride(s)
            .with_padding(p)
            .with_dilation(dl)
            .with_dtype(DType::F64)
            .init::<B>(&DEV, &mut Generator::new(5))
            .unwrap();
        let x = randn(&[2, 2, 7, 6], 11);
        let y = conv.forward(&Var::constant(x.clone())).unwrap().tensor();
        let (want, dims) = naive_conv(
            &x.to_vec().unwrap(),
            [2, 2, 7, 6],
            &conv.weight.tensor().to_vec().unwrap(),
            [3, 3, 3],
            &conv.bias.as_ref().unwrap().tensor().to_vec().unwrap(),
            s,
            p,
            dl,
        );
        assert_eq!(y.dims(), &dims, "s={s} p={p} d={dl}");
        close(&y.to_vec::<f64>().unwrap(), &want, 1e-12);
        // Twice through the cached indices gives the same.
        let y2 = conv.forward(&Var::constant(x)).unwrap().tensor();
        assert_eq!(y.to_vec::<f64>().unwrap(), y2.to_vec::<f64>().unwrap());
    }
    let conv = Conv2dConfig::new(2, 3, 3)
        .init::<B>(&DEV, &mut Generator::new(5))
        .unwrap();
    assert!(
        conv.forward(&Var::constant(randn(&[1, 3, 5, 5], 0)))
            .is_err()
    );
    assert!(
        conv.forward(&Var::constant(randn(&[1, 2, 2, 2], 0)))
            .is_err()
    );
    assert!(conv.forward(&Var::constant(randn(&[2, 5, 5], 0))).is_err());
    let names: Vec<String> = conv
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["weight", "bias"]);
    assert_eq!(conv.weight.dims(), vec![3, 2, 3, 3]);
}

#[test]
fn conv2d_gradients_pass_check_backward() {
    for (seed, window) in [
        (1, Window::new(3).with_padding(1)),
        (2, Window::new(2).with_stride(2)),
        (
            3,
            Window::new(3)
                .with_stride(2)
                .with_padding(2)
                .with_dilation(2),
        ),
    ] {
        let x = randn(&[2, 2, 5, 6], seed);
        let k = window.kernel[0];
        let w = randn(&[3, 2, k, k], seed + 10);
        let b = randn(&[3], seed + 20);
        check_backward(
            |v: &[Var<B>]| conv2d(&v[0], &v[1], Some(&v[2]), window),
            &[x, w, b],
            &CheckOptions::default().with_seed(seed),
        )
        .unwrap_or_else(|e| panic!("{window:?}: {e}"));
    }
}

#[test]
fn max_pool2d_forward_and_gradients() {
    // 1 x 1 x 4 x 4, 2x2 windows.
    let x = t(
        &[
            1., 5., 2., 0., //
            3., 4., 8., 1., //
            0., 0., 7., 9., //
            6., 2., 3., 3.,
        ],
        &[1, 1, 4, 4],
    );
    let pool = MaxPool2d::<B>::new(2);
    let y = pool.forward(&Var::constant(x.clone())).unwrap().tensor();
    assert_eq!(y.dims(), &[1, 1, 2, 2]);
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![5., 8., 6., 9.]);
    // The gradient goes to the arg-max of each window.
    let p = Var::param(x);
    pool.forward(&p)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = p.grad().unwrap().to_vec::<f64>().unwrap();
    let mut want = vec![0.0; 16];
    for i in [1, 6, 12, 11] {
        want[i] = 1.0;
    }
    assert_eq!(g, want);
    // Padding counts as -inf; stride 1 overlapping windows.
    let xn = t(&[-1., -2., -3., -4.], &[1, 1, 2, 2]);
    let y = max_pool2d(
        &Var::constant(xn),
        Window::new(2).with_stride(2).with_padding(1),
    )
    .unwrap()
    .tensor();
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![-1., -2., -3., -4.]);
    // Numerical check on random inputs (no ties), overlapping windows and several channels.
    for (seed, window) in [
        (1, Window::new(2).with_stride(2)),
        (2, Window::new(3).with_stride(1).with_padding(1)),
    ] {
        check_backward(
            |v: &[Var<B>]| max_pool2d(&v[0], window),
            &[randn(&[2, 3, 5, 4], seed)],
            &CheckOptions::default().with_seed(seed),
        )
        .unwrap_or_else(|e| panic!("{window:?}: {e}"));
    }
    assert!(max_pool2d(&Var::constant(randn(&[1, 1, 1, 1], 0)), Window::new(2)).is_err());
    // Degenerate windows are errors, not panics.
    let x4 = Var::constant(randn(&[1, 1, 4, 4], 0));
    assert!(max_pool2d(&x4, Window::new(0)).is_err());
    assert!(max_pool2d(&x4, Window::new(2).with_stride(0)).is_err());
    let w0 = Var::constant(randn(&[1, 1, 0, 0], 0));
    assert!(conv2d(&x4, &w0, None, Window::new(0)).is_err());
    assert!(MaxPool2d::<B>::new(0).forward(&x4).is_err());
}

#[test]
fn lenet_shapes_and_names() {
    let mut g = Generator::new(0);
    let net = Sequential::<B>::new()
        .add(
            Conv2dConfig::new(1, 6, 5)
                .with_padding(2)
                .init::<B>(&DEV, &mut g)
                .unwrap(),
        )
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Conv2dConfig::new(6, 16, 5).init::<B>(&DEV, &mut g).unwrap())
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Flatten)
        .add(LinearConfig::new(400, 10).init::<B>(&DEV, &mut g).unwrap());
    let x = Generator::new(1).rand::<B>([2, 1, 28, 28], &DEV).unwrap();
    let y = net.forward(&Var::constant(x)).unwrap();
    assert_eq!(y.dims(), vec![2, 10]);
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias"
        ]
    );
}

#[test]
fn losses_match_their_formulas() {
    // Cross-entropy: mean over rows of logsumexp - logit[label].
    let logits = t(&[1.0, 2.0, 3.0, 0.0, 0.0, 0.0], &[2, 3]);
    let labels = Tensor::<B>::from_vec(vec![2i64, 0], [2], &DEV).unwrap();
    let l = cross_entropy(&Var::constant(logits.clone()), &labels, Reduction::Mean)
        .unwrap()
        .tensor()
        .to_scalar()
        .unwrap();
    let r0 = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln() - 3.0;
    let r1 = 3f64.ln();
    assert!((l - (r0 + r1) / 2.0).abs() < 1e-12);
    check_backward(
        |v: &[Var<B>]| cross_entropy(&v[0], &labels, Reduction::Mean),
        &[randn(&[4, 3], 1).narrow(0, 0, 2).unwrap()],
        &CheckOptions::default(),
    )
    .unwrap();

    // MSE.
    let pred = Var::constant(t(&[1.0, 2.0, 3.0], &[3]));
    let m = mse(&pred, &t(&[1.0, 0.0, 6.0], &[3]), Reduction::Mean)
        .unwrap()
        .tensor()
        .to_scalar()
        .unwrap();
    assert!((m - (0.0 + 4.0 + 9.0) / 3.0).abs() < 1e-12);
    assert!(mse(&pred, &t(&[1.0, 0.0], &[2]), Reduction::Mean).is_err());

    // BCE with logits, stable for large |x|, exact gradient sigmoid(x) - t at x = 0.
    let x = t(&[0.0, 100.0, -100.0, 1.5], &[4]);
    let tg = t(&[1.0, 0.0, 0.0, 0.25], &[4]);
    let want: f64 = [
        2f64.ln(),
        100.0,
        0.0,
        (1.0 + (-1.5f64).exp()).ln() + 1.5 * 0.75,
    ]
    .iter()
    .sum::<f64>()
        / 4.0;
    let p = Var::param(x);
    let l = bce_with_logits(&p, &tg, Reduction::Mean).unwrap();
    assert!((l.tensor().to_scalar().unwrap() - want).abs() < 1e-9);
    l.backward().unwrap();
    let g = p.grad().unwrap().to_vec::<f64>().unwrap();
    assert!((g[0] - (0.5 - 1.0) / 4.0).abs() < 1e-12, "{g:?}");
    let tg2 = Generator::new(5)
        .sample::<B>(
            [3, 2],
            RandDist::Uniform {
                low: 0.0,
                high: 1.0,
            },
            DType::F64,
            &DEV,
        )
        .unwrap();
    check_backward(
        |v: &[Var<B>]| bce_with_logits(&v[0], &tg2, Reduction::Mean),
        &[randn(&[3, 2], 6)],
        &CheckOptions::default(),
    )
    .unwrap();
}

#[test]
fn accuracy_counts_argmax_hits() {
    let logits = t(&[0.1, 0.9, 0.8, 0.2, 0.3, 0.7], &[3, 2]);
    let labels = Tensor::<B>::from_vec(vec![1i64, 1, 1], [3], &DEV).unwrap();
    assert_eq!(correct_count(&logits, &labels).unwrap(), 2);
    assert!((accuracy(&logits, &labels).unwrap() - 2.0 / 3.0).abs() < 1e-12);
    let bad = Tensor::<B>::from_vec(vec![1i64, 1], [2], &DEV).unwrap();
    assert!(accuracy(&logits, &bad).is_err());
}
