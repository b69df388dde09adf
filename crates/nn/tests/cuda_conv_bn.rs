//! `ConvBnAct` in eval mode on CUDA (the folded convolution through cuDNN's fused
//! convolution → bias → ReLU graph, `Backend::conv2d_bias_act`) against the same module on
//! the CPU run unfolded (convolution, batch norm on running statistics, activation), NCHW, in
//! f32 with TF32 off and on, and under bf16 and f16 autocast; ReLU and no activation; 3×3
//! "same", stride 2, a 1×1 projection, a 3-channel stem, 2 groups and depthwise. Each case
//! also runs with the fused graph switched off (`set_cudnn_fusion(false)`: the folded
//! convolution, a bias add and the activation), and prints whether the fused graph ran
//! (`cudnn_fused_calls`): cuDNN serves runtime fusion for some dtypes and layouts only, and
//! falls back silently for the rest (`KILN_CUDNN_LOG=1` prints why).
//! `KILN_REQUIRE_CUDNN_FUSION=1` makes a bf16 or f16 case that did not run fused a failure.
//!
//! Without a GPU every test prints `skipped: no CUDA device 0 (<reason>)`.

use std::sync::Mutex;

use kiln_autograd::{Var, autocast, no_grad};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, cudnn_fused_calls, gpu_or_skip, set_cudnn_fusion};
use kiln_core::testing::check_close;
use kiln_core::{Activation, Backend, DType, Generator, Tensor};
use kiln_nn::{BatchNormConfig, Conv2dConfig, ConvBnAct, Module, ModuleExt};

/// The TF32 and fusion switches are process-wide: each test holds this.
static SWITCH: Mutex<()> = Mutex::new(());

/// One geometry: input `[n, c, h, w]`, `oc` outputs, kernel, stride, padding, groups, a
/// convolution bias, the activation.
#[derive(Clone, Copy, Debug)]
struct Case {
    x: [usize; 4],
    oc: usize,
    k: usize,
    stride: usize,
    pad: usize,
    groups: usize,
    bias: bool,
    act: Activation,
}

#[allow(clippy::too_many_arguments)]
const fn case(
    x: [usize; 4],
    oc: usize,
    k: usize,
    stride: usize,
    pad: usize,
    groups: usize,
    bias: bool,
    act: Activation,
) -> Case {
    Case {
        x,
        oc,
        k,
        stride,
        pad,
        groups,
        bias,
        act,
    }
}

const RELU: Activation = Activation::Relu;
const NONE: Activation = Activation::Identity;

const CASES: &[Case] = &[
    case([4, 64, 16, 16], 64, 3, 1, 1, 1, false, RELU), // ResNet 3×3 "same"
    case([4, 64, 16, 16], 128, 3, 2, 1, 1, false, RELU), // stride 2
    case([4, 64, 16, 16], 128, 1, 2, 0, 1, false, NONE), // 1×1 projection shortcut
    case([4, 64, 16, 16], 64, 3, 1, 1, 1, false, NONE), // second conv of a block
    case([4, 3, 32, 32], 64, 3, 1, 1, 1, false, RELU),  // 3-channel stem
    case([2, 16, 9, 9], 32, 3, 1, 1, 2, true, RELU),    // 2 groups, a conv bias
    case([2, 16, 8, 8], 16, 3, 2, 1, 16, true, RELU),   // depthwise, stride 2
];

/// `n` deterministic values in `[lo, lo + span)`.
fn values(n: usize, seed: usize, lo: f32, span: f32) -> Vec<f32> {
    (0..n)
        .map(|i| lo + span * (((i * 37 + seed * 11) % 101) as f32 / 101.0))
        .collect()
}

/// The case's module on `dev` in eval mode: the convolution drawn from one seed (the same
/// weights on every backend), the batch norm's parameters and running statistics set.
fn module<B: Backend>(c: &Case, dev: &B::Device) -> ConvBnAct<B> {
    let conv = Conv2dConfig::new(c.x[1], c.oc, c.k)
        .with_stride(c.stride)
        .with_padding(c.pad)
        .with_groups(c.groups)
        .with_bias(c.bias)
        .init::<B>(dev, &mut Generator::new(7))
        .unwrap();
    let bn = BatchNormConfig::new(c.oc).init_2d::<B>(dev).unwrap();
    let set = |v: &Option<Var<B>>, vals: Vec<f32>| {
        let t = Tensor::<B>::from_vec(vals, [c.oc], dev).unwrap();
        v.as_ref().unwrap().set_tensor(t).unwrap();
    };
    set(&bn.weight, values(c.oc, 1, 0.5, 1.0));
    set(&bn.bias, values(c.oc, 2, -0.5, 1.0));
    set(&bn.running_mean, values(c.oc, 3, -0.2, 0.4));
    set(&bn.running_var, values(c.oc, 4, 0.5, 1.5));
    let mut m = ConvBnAct::new(conv, bn, c.act).unwrap();
    m.eval();
    m
}

fn host<B: Backend>(t: &Tensor<B>) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// How each precision runs on the GPU: TF32 on or off, the autocast dtype, the tolerance
/// (absolute and relative, against outputs of size ~1).
#[derive(Clone, Copy, Debug)]
enum Precision {
    F32,
    Tf32,
    Bf16,
    F16,
}

impl Precision {
    fn tol(self) -> f64 {
        match self {
            Precision::F32 => 1e-4,
            Precision::Tf32 => 1e-2,
            Precision::Bf16 => 4e-2,
            Precision::F16 => 1e-2,
        }
    }
    fn low(self) -> Option<DType> {
        match self {
            Precision::Bf16 => Some(DType::BF16),
            Precision::F16 => Some(DType::F16),
            _ => None,
        }
    }
}

/// The GPU's eval forward of `c` in `p`, fused graph on or off; and whether the fused graph
/// ran.
fn gpu_forward(
    dev: &CudaDevice,
    c: &Case,
    p: Precision,
    fused: bool,
    x: &[f32],
) -> (Vec<f64>, bool) {
    kiln_backend_cuda::set_allow_tf32(matches!(p, Precision::Tf32));
    set_cudnn_fusion(fused);
    let m = module::<Cuda>(c, dev);
    let x = Var::constant(Tensor::<Cuda>::from_vec(x.to_vec(), c.x, dev).unwrap());
    let _ac = p.low().map(|d| autocast(d).unwrap());
    let before = cudnn_fused_calls();
    let y = no_grad(|| m.forward(&x)).unwrap();
    let ran = cudnn_fused_calls() > before;
    (host(&y.tensor()), ran)
}

/// Restores TF32 and the fusion switch when a test ends (also on a failure).
struct Restore(bool);

impl Drop for Restore {
    fn drop(&mut self) {
        kiln_backend_cuda::set_allow_tf32(self.0);
        set_cudnn_fusion(true);
    }
}

fn run(p: Precision) {
    let _lock = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu_or_skip(0) else {
        return;
    };
    kiln_nn::set_conv_routing(false);
    let _restore = Restore(kiln_backend_cuda::allow_tf32());
    let require = std::env::var("KILN_REQUIRE_CUDNN_FUSION").is_ok_and(|v| v == "1");
    let cpu = Cpu::device(0);
    for c in CASES {
        let n: usize = c.x.iter().product();
        let x = values(n, 5, -1.0, 2.0);
        // The reference: the CPU's three layers (the module with folding off), f32.
        let mut reference = module::<Cpu>(c, &cpu);
        reference.set_fold(false);
        let xc = Var::constant(Tensor::<Cpu>::from_vec(x.clone(), c.x, &cpu).unwrap());
        let want = host(&no_grad(|| reference.forward(&xc)).unwrap().tensor());
        let (got, ran) = gpu_forward(&dev, c, p, true, &x);
        eprintln!(
            "{p:?} {c:?}: {}",
            if ran {
                "fused graph"
            } else {
                "not fused (fallback)"
            }
        );
        if require && matches!(p, Precision::Bf16 | Precision::F16) {
            assert!(ran, "{p:?} {c:?}: the fused graph did not run");
        }
        let tol = p.tol();
        if let Err(e) = check_close(&got, &want, tol, tol) {
            panic!("{p:?} {c:?} fused: {e}");
        }
        let (unfused, ran) = gpu_forward(&dev, c, p, false, &x);
        assert!(!ran, "the fused graph ran while switched off");
        if let Err(e) = check_close(&unfused, &want, tol, tol) {
            panic!("{p:?} {c:?} fusion off: {e}");
        }
    }
}

#[test]
fn fused_eval_matches_the_cpu_f32() {
    run(Precision::F32);
}

#[test]
fn fused_eval_matches_the_cpu_tf32() {
    run(Precision::Tf32);
}

#[test]
fn fused_eval_matches_the_cpu_bf16() {
    run(Precision::Bf16);
}

#[test]
fn fused_eval_matches_the_cpu_f16() {
    run(Precision::F16);
}
