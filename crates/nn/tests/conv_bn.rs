//! `ConvBnAct` and `Conv2d::fold_batch_norm` on the CPU: the folded eval forward equals
//! conv → batch norm (running statistics) → activation over several geometries (stride,
//! padding, dilation, groups, with and without a convolution bias, affine on and off, ReLU
//! and none), in f32 and f64; training mode is the three layers unchanged (outputs, running
//! statistics); the cached fold follows parameter and statistic changes; an eval forward that
//! records gives the unfused layers' gradients; state dicts keep PyTorch's names; bad input is
//! a typed error; a 16-bit convolution with an f32 batch norm folds in f32 and rounds once. The
//! CUDA fused kernel is compared in `cuda_conv_bn.rs`.

use kiln_autograd::{Var, no_grad};
use kiln_backend_cpu::Cpu;
use kiln_core::{Activation, Backend, DType, Error, Generator, RandDist, Tensor};
use kiln_nn::{
    BatchNorm, BatchNormConfig, Conv2d, Conv2dConfig, ConvBnAct, Module, ModuleExt, Relu,
    Sequential,
};

type B = Cpu;

fn dev() -> <B as Backend>::Device {
    Cpu::device(0)
}

fn normal(dims: &[usize], seed: u64, dtype: DType) -> Tensor<B> {
    let d = RandDist::Normal {
        mean: 0.2,
        std: 1.0,
    };
    Generator::new(seed)
        .sample::<B>(dims.to_vec(), d, dtype, &dev())
        .unwrap()
}

fn host(t: &Tensor<B>) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

#[track_caller]
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    kiln_core::testing::assert_close(what, got, want, tol)
}

/// One geometry of the tests.
#[derive(Clone, Copy, Debug)]
struct Geo {
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
    dil: usize,
    groups: usize,
    conv_bias: bool,
    affine: bool,
    act: Activation,
}

const GEOS: &[Geo] = &[
    Geo {
        cin: 3,
        cout: 8,
        k: 3,
        stride: 1,
        pad: 1,
        dil: 1,
        groups: 1,
        conv_bias: false,
        affine: true,
        act: Activation::Relu,
    },
    Geo {
        cin: 4,
        cout: 6,
        k: 3,
        stride: 2,
        pad: 1,
        dil: 1,
        groups: 2,
        conv_bias: true,
        affine: true,
        act: Activation::Relu,
    },
    Geo {
        cin: 6,
        cout: 6,
        k: 3,
        stride: 1,
        pad: 2,
        dil: 2,
        groups: 6,
        conv_bias: true,
        affine: false,
        act: Activation::Relu,
    },
    Geo {
        cin: 5,
        cout: 7,
        k: 1,
        stride: 2,
        pad: 0,
        dil: 1,
        groups: 1,
        conv_bias: false,
        affine: false,
        act: Activation::Identity,
    },
    Geo {
        cin: 4,
        cout: 8,
        k: 2,
        stride: 1,
        pad: 0,
        dil: 1,
        groups: 4,
        conv_bias: true,
        affine: true,
        act: Activation::Identity,
    },
];

fn conv_of(g: &Geo, dtype: DType, seed: u64) -> Conv2d<B> {
    Conv2dConfig::new(g.cin, g.cout, g.k)
        .with_stride(g.stride)
        .with_padding(g.pad)
        .with_dilation(g.dil)
        .with_groups(g.groups)
        .with_bias(g.conv_bias)
        .with_dtype(dtype)
        .init::<B>(&dev(), &mut Generator::new(seed))
        .unwrap()
}

/// A batch norm with drawn affine parameters and running statistics (positive variances).
fn bn_of(g: &Geo, dtype: DType, seed: u64) -> BatchNorm<B> {
    let bn = BatchNormConfig::new(g.cout)
        .with_affine(g.affine)
        .with_eps(1e-3)
        .with_dtype(dtype)
        .init_2d::<B>(&dev())
        .unwrap();
    let c = [g.cout];
    if let (Some(w), Some(b)) = (&bn.weight, &bn.bias) {
        w.set_tensor(normal(&c, seed, dtype)).unwrap();
        b.set_tensor(normal(&c, seed + 1, dtype)).unwrap();
    }
    let rm = bn.running_mean.as_ref().unwrap();
    rm.set_tensor(normal(&c, seed + 2, dtype)).unwrap();
    let var = normal(&c, seed + 3, dtype)
        .abs()
        .unwrap()
        .add_scalar(0.2)
        .unwrap();
    bn.running_var.as_ref().unwrap().set_tensor(var).unwrap();
    bn
}

fn act(y: Var<B>, a: Activation) -> Var<B> {
    match a {
        Activation::Relu => y.relu().unwrap(),
        _ => y,
    }
}

/// The reference: the three layers one after the other, the batch norm in eval mode.
fn unfused(conv: &Conv2d<B>, bn: &mut BatchNorm<B>, a: Activation, x: &Var<B>) -> Var<B> {
    bn.set_training(false);
    act(bn.forward(&conv.forward(x).unwrap()).unwrap(), a)
}

fn input(g: &Geo, dtype: DType, seed: u64) -> Var<B> {
    Var::constant(normal(&[2, g.cin, 7, 6], seed, dtype))
}

#[test]
fn the_folded_eval_forward_equals_conv_bn_act() {
    for (dtype, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12)] {
        for (i, g) in GEOS.iter().enumerate() {
            let seed = 10 * i as u64;
            let x = input(g, dtype, seed + 7);
            let (conv, mut bn) = (conv_of(g, dtype, seed), bn_of(g, dtype, seed));
            let want = host(&unfused(&conv, &mut bn, g.act, &x).tensor());

            let mut m =
                ConvBnAct::new(conv_of(g, dtype, seed), bn_of(g, dtype, seed), g.act).unwrap();
            m.eval();
            assert!(m.folds());
            let what = format!("{g:?} {dtype:?}");
            let y = no_grad(|| m.forward(&x)).unwrap();
            assert_close(&format!("no_grad {what}"), &host(&y.tensor()), &want, tol);
            // Recording (the parameters require gradients): the differentiable fold.
            let y = m.forward(&x).unwrap();
            assert_close(&format!("recording {what}"), &host(&y.tensor()), &want, tol);
            // The cached fold, a second time.
            let y = no_grad(|| m.forward(&x)).unwrap();
            assert_close(&format!("cached {what}"), &host(&y.tensor()), &want, tol);

            // `fold_batch_norm`: a plain Conv2d, then the activation.
            let folded = conv.fold_batch_norm(&bn).unwrap();
            assert!(folded.bias.is_some());
            assert_eq!(folded.weight.dims(), conv.weight.dims());
            let y = act(folded.forward(&x).unwrap(), g.act);
            assert_close(
                &format!("fold_batch_norm {what}"),
                &host(&y.tensor()),
                &want,
                tol,
            );
        }
    }
}

/// The fold does not equal the unfused layers when the batch norm is left out: the test above
/// can fail (a sanity check of its reference).
#[test]
fn the_reference_is_not_the_bare_convolution() {
    let g = &GEOS[0];
    let x = input(g, DType::F32, 3);
    let (conv, mut bn) = (conv_of(g, DType::F32, 0), bn_of(g, DType::F32, 0));
    let want = host(&unfused(&conv, &mut bn, g.act, &x).tensor());
    let bare = host(&act(conv.forward(&x).unwrap(), g.act).tensor());
    let diff = want
        .iter()
        .zip(&bare)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff > 0.1, "the batch norm changed nothing ({diff})");
}

#[test]
fn training_mode_runs_the_three_layers() {
    let g = &GEOS[1];
    let x = input(g, DType::F32, 5);
    let conv = conv_of(g, DType::F32, 1);
    let mut bn = bn_of(g, DType::F32, 1);
    let m = ConvBnAct::new(conv_of(g, DType::F32, 1), bn_of(g, DType::F32, 1), g.act).unwrap();
    assert!(!m.folds());
    for _ in 0..2 {
        bn.set_training(true);
        let want = act(bn.forward(&conv.forward(&x).unwrap()).unwrap(), g.act);
        let got = m.forward(&x).unwrap();
        assert_eq!(host(&got.tensor()), host(&want.tensor()));
    }
    for name in ["running_mean", "running_var"] {
        let buf = |bufs: Vec<(String, Var<B>)>, n: &str| {
            host(&bufs.into_iter().find(|(k, _)| k == n).unwrap().1.tensor())
        };
        assert_eq!(
            buf(m.named_buffers(), &format!("bn.{name}")),
            buf(bn.named_buffers(), name)
        );
    }
    // Gradients as through the three layers.
    let (gx, gw) = {
        let x = Var::leaf(x.tensor());
        m.forward(&x)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        (x.grad().unwrap(), m.conv.weight.grad().unwrap())
    };
    let x2 = Var::leaf(x.tensor());
    bn.set_training(true);
    let y = act(bn.forward(&conv.forward(&x2).unwrap()).unwrap(), g.act);
    y.sum_all().unwrap().backward().unwrap();
    assert_close("dx", &host(&gx), &host(&x2.grad().unwrap()), 1e-5);
    assert_close("dw", &host(&gw), &host(&conv.weight.grad().unwrap()), 1e-5);
}

/// An eval forward that records differentiates the fold: the gradients of the input, the
/// convolution's weight and bias and the batch norm's weight and bias are the unfused layers'.
#[test]
fn a_recording_eval_forward_gives_the_unfused_gradients() {
    let g = &GEOS[1];
    let x = Var::leaf(input(g, DType::F64, 9).tensor());
    let (conv, mut bn) = (conv_of(g, DType::F64, 2), bn_of(g, DType::F64, 2));
    unfused(&conv, &mut bn, g.act, &x)
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut m = ConvBnAct::new(conv_of(g, DType::F64, 2), bn_of(g, DType::F64, 2), g.act).unwrap();
    m.eval();
    let x2 = Var::leaf(x.tensor());
    m.forward(&x2)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_close(
        "dx",
        &host(&x2.grad().unwrap()),
        &host(&x.grad().unwrap()),
        1e-10,
    );
    let pairs = [
        (&m.conv.weight, &conv.weight),
        (m.conv.bias.as_ref().unwrap(), conv.bias.as_ref().unwrap()),
        (m.bn.weight.as_ref().unwrap(), bn.weight.as_ref().unwrap()),
        (m.bn.bias.as_ref().unwrap(), bn.bias.as_ref().unwrap()),
    ];
    for (i, (a, b)) in pairs.into_iter().enumerate() {
        assert_close(
            &format!("parameter {i}"),
            &host(&a.grad().unwrap()),
            &host(&b.grad().unwrap()),
            1e-10,
        );
    }
}

/// The cached fold follows new parameters and statistics (set as an optimizer or a loaded
/// state dict sets them), and `set_fold(false)` runs the three layers.
#[test]
fn the_cached_fold_follows_changes() {
    let g = &GEOS[0];
    let x = input(g, DType::F32, 11);
    let (conv, mut bn) = (conv_of(g, DType::F32, 4), bn_of(g, DType::F32, 4));
    let mut m = ConvBnAct::new(conv_of(g, DType::F32, 4), bn_of(g, DType::F32, 4), g.act).unwrap();
    m.eval();
    no_grad(|| m.forward(&x)).unwrap();
    for (mine, theirs, seed) in [
        (
            m.bn.running_var.clone().unwrap(),
            bn.running_var.clone().unwrap(),
            20,
        ),
        (m.bn.weight.clone().unwrap(), bn.weight.clone().unwrap(), 21),
        (m.conv.weight.clone(), conv.weight.clone(), 22),
    ] {
        let t = normal(&mine.dims(), seed, DType::F32).abs().unwrap();
        mine.set_tensor(t.clone()).unwrap();
        theirs.set_tensor(t).unwrap();
        let want = host(&unfused(&conv, &mut bn, g.act, &x).tensor());
        let got = no_grad(|| m.forward(&x)).unwrap();
        assert_close(&format!("after {seed}"), &host(&got.tensor()), &want, 2e-5);
    }
    m.set_fold(false);
    assert!(!m.folds());
    let want = host(&unfused(&conv, &mut bn, g.act, &x).tensor());
    assert_close(
        "unfolded",
        &host(&m.forward(&x).unwrap().tensor()),
        &want,
        1e-6,
    );
}

/// PyTorch's names (`conv.weight`, `bn.running_mean`, ...), or the caller's, so a state dict
/// written by `nn.Sequential(conv, bn, relu)`-like modules or a torchvision ResNet loads.
#[test]
fn state_dicts_keep_pytorch_names() {
    let g = &GEOS[1];
    let m = ConvBnAct::new(conv_of(g, DType::F32, 0), bn_of(g, DType::F32, 0), g.act).unwrap();
    let names: Vec<String> = m.state_dict().into_iter().map(|(k, _)| k).collect();
    for n in [
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ] {
        assert!(names.iter().any(|k| k == n), "{n} missing from {names:?}");
    }
    assert_eq!(m.parameters().len(), 4);
    let m = m.with_names("conv1", "bn1");
    let names: Vec<String> = m.state_dict().into_iter().map(|(k, _)| k).collect();
    assert!(names.iter().any(|k| k == "conv1.weight"));
    assert!(names.iter().any(|k| k == "bn1.running_var"));

    // A state dict saved from the unfused layers loads into the module and gives their output.
    let (conv, mut bn) = (conv_of(g, DType::F32, 8), bn_of(g, DType::F32, 8));
    let path =
        std::env::temp_dir().join(format!("kiln-conv-bn-{}.safetensors", std::process::id()));
    let seq = Sequential::<B>::new()
        .add(conv)
        .add(bn_of(g, DType::F32, 8));
    seq.save(&path).unwrap();
    let mut m = ConvBnAct::new(conv_of(g, DType::F32, 99), bn_of(g, DType::F32, 99), g.act)
        .unwrap()
        .with_names("0", "1");
    m.load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    m.eval();
    let x = input(g, DType::F32, 12);
    let conv = conv_of(g, DType::F32, 8);
    let want = host(&unfused(&conv, &mut bn, g.act, &x).tensor());
    assert_close(
        "loaded",
        &host(&no_grad(|| m.forward(&x)).unwrap().tensor()),
        &want,
        2e-5,
    );
}

/// A `ConvBnAct` without an activation takes the `Relu` after it in a `Sequential`.
#[test]
fn a_sequential_relu_joins_the_fold() {
    let g = &GEOS[3];
    let x = input(g, DType::F32, 13);
    let (conv, mut bn) = (conv_of(g, DType::F32, 5), bn_of(g, DType::F32, 5));
    let want = host(&unfused(&conv, &mut bn, Activation::Relu, &x).tensor());
    let mut seq = Sequential::<B>::new()
        .add(ConvBnAct::new(conv_of(g, DType::F32, 5), bn_of(g, DType::F32, 5), g.act).unwrap())
        .add(Relu);
    seq.eval();
    let got = no_grad(|| seq.forward(&x)).unwrap();
    assert_close("sequential", &host(&got.tensor()), &want, 2e-5);
}

fn invalid(r: Result<impl Sized, Error>, op: &str) -> String {
    match r {
        Err(Error::InvalidArgument { op: o, msg }) => {
            assert_eq!(o, op, "{msg}");
            msg
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("no error"),
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let g = &GEOS[0];
    // Channel counts that do not match.
    let bn7 = BatchNormConfig::new(7).init_2d::<B>(&dev()).unwrap();
    let msg = invalid(
        ConvBnAct::new(conv_of(g, DType::F32, 0), bn7, g.act),
        "ConvBnAct::new",
    );
    assert!(msg.contains("7"), "{msg}");
    let bn7 = BatchNormConfig::new(7).init_2d::<B>(&dev()).unwrap();
    invalid(
        conv_of(g, DType::F32, 0).fold_batch_norm(&bn7),
        "Conv2d::fold_batch_norm",
    );
    // A batch norm in training mode, or without running statistics, does not fold.
    let (conv, mut bn) = (conv_of(g, DType::F32, 0), bn_of(g, DType::F32, 0));
    bn.set_training(true);
    let msg = invalid(conv.fold_batch_norm(&bn), "Conv2d::fold_batch_norm");
    assert!(msg.contains("training"), "{msg}");
    let mut untracked = BatchNormConfig::new(g.cout)
        .with_track_running_stats(false)
        .init_2d::<B>(&dev())
        .unwrap();
    untracked.set_training(false);
    invalid(conv.fold_batch_norm(&untracked), "Conv2d::fold_batch_norm");
    // ... but a ConvBnAct over one runs unfolded (batch statistics in both modes, as the
    // batch norm alone).
    let mut m = ConvBnAct::new(conv_of(g, DType::F32, 0), untracked, g.act).unwrap();
    m.eval();
    assert!(!m.folds());
    assert!(m.forward(&input(g, DType::F32, 1)).is_ok());
    // Inputs of the wrong channel count or rank, in eval mode (folded) and training mode.
    let mut m = ConvBnAct::new(conv_of(g, DType::F32, 0), bn_of(g, DType::F32, 0), g.act).unwrap();
    for training in [false, true] {
        m.set_training(training);
        let x = Var::constant(normal(&[2, 4, 7, 6], 0, DType::F32));
        assert!(no_grad(|| m.forward(&x)).is_err());
        let x = Var::constant(normal(&[3, 7, 6], 0, DType::F32));
        assert!(no_grad(|| m.forward(&x)).is_err());
    }
}

/// A 16-bit convolution with an f32 batch norm (what the batch norm itself accepts): the fold
/// computes in f32 and rounds once to the convolution's dtype.
#[test]
fn mixed_dtypes_fold_in_the_convolutions_dtype() {
    let g = &GEOS[1];
    for (conv_dt, bn_dt, tol) in [
        (DType::BF16, DType::F32, 5e-2),
        (DType::F16, DType::F32, 1e-2),
    ] {
        let x = Var::constant(normal(&[2, g.cin, 7, 6], 31, conv_dt));
        let (conv, mut bn) = (conv_of(g, conv_dt, 6), bn_of(g, bn_dt, 6));
        let want = host(&unfused(&conv, &mut bn, g.act, &x).tensor());
        let mut m = ConvBnAct::new(conv_of(g, conv_dt, 6), bn_of(g, bn_dt, 6), g.act).unwrap();
        m.eval();
        let y = no_grad(|| m.forward(&x)).unwrap();
        assert_eq!(y.dtype(), conv_dt);
        let what = format!("{conv_dt:?} conv, {bn_dt:?} batch norm");
        assert_close(&what, &host(&y.tensor()), &want, tol);
        let folded = conv.fold_batch_norm(&bn).unwrap();
        assert_eq!(folded.weight.dtype(), conv_dt);
        assert_eq!(folded.bias.as_ref().unwrap().dtype(), conv_dt);
    }
}
