//! Convolutions through cuDNN (the CUDA backend's `Backend::conv2d` and its two gradients)
//! against kiln's im2col path on the CPU: outputs and the gradients of input, weight and bias,
//! for stride, padding, dilation, groups (depthwise included), 1×1 kernels and batch 1, in f32
//! (TF32 off), f64, bf16 and f16; the fallback (`set_cudnn(false)`, the `KILN_CUDNN=0` switch,
//! and `conv2d_im2col_path`) giving the same; the numerical gradient check of the recorded op
//! in f64; typed errors for bad shapes. With tensor-core math (TF32, bf16, f16) each cuDNN
//! layout (`set_cudnn_layout`: NHWC forced, NCHW forced, auto) against the CPU, NHWC's calls
//! counted so that a silent fall back to NCHW fails, and NHWC in a CUDA graph. The layout tests
//! run cuDNN's legacy API (which the layout switch steers); the others take the API
//! `KILN_CUDNN_API` names, so `KILN_CUDNN_API=graph` runs them through the graph API.
//!
//! Without a GPU every test prints `skipped: no CUDA device 0 (<reason>)`. Without cuDNN on
//! the GPU machine the backend prints once that convolutions use the im2col path, each test
//! prints that cuDNN was not exercised, and the comparisons still run (im2col on both sides);
//! set `KILN_REQUIRE_CUDNN=1` to make that a failure instead.

mod conv_case;

use std::sync::Mutex;

use conv_case::{Case, case, compare, cpu, on, run, widened};

use kiln_autograd::{CheckOptions, Var, assert_backward};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, gpu_or_skip};
use kiln_core::testing::check_close;
use kiln_core::{DType, Error, Tensor};
use kiln_nn::{Window, conv2d_grouped, conv2d_im2col_path};

/// The cuDNN switch is process-wide: tests that flip it, or depend on it, hold this.
static SWITCH: Mutex<()> = Mutex::new(());

/// The GPU, having said whether cuDNN is there (and failed when it must be).
fn gpu() -> Option<CudaDevice> {
    let dev = gpu_or_skip(0)?;
    // These tests are about cuDNN: no shape may be routed to im2col by measurement (that is
    // `cuda_conv_route.rs`'s subject).
    kiln_nn::set_conv_routing(false);
    match kiln_backend_cuda::cudnn_version() {
        Ok(v) => eprintln!("cuDNN {v}"),
        Err(why) => {
            let must = std::env::var("KILN_REQUIRE_CUDNN").is_ok_and(|v| v == "1");
            assert!(!must, "KILN_REQUIRE_CUDNN=1 but cuDNN is unusable: {why}");
            eprintln!("cuDNN not exercised ({why}): comparing the im2col path on both sides");
        }
    }
    Some(dev)
}

/// The geometries (see `conv_case::Case`).
const CASES: &[Case] = &[
    case([2, 3, 9, 9], 4, 3, 1, 1, 1, 1),   // 3×3 "same"
    case([2, 4, 10, 11], 6, 3, 2, 1, 1, 1), // stride 2, odd width
    case([2, 3, 9, 9], 5, 3, 1, 2, 2, 1),   // dilation 2 with padding
    case([2, 4, 8, 8], 6, 3, 1, 1, 1, 2),   // 2 groups
    case([2, 6, 8, 8], 6, 3, 2, 1, 1, 6),   // depthwise, stride 2
    case([2, 8, 7, 7], 5, 1, 1, 0, 1, 1),   // 1×1
    case([1, 3, 12, 10], 4, 5, 1, 2, 1, 1), // batch 1, 5×5
    Case {
        k: [3, 1],
        ..case([3, 2, 6, 5], 3, 1, 1, 0, 1, 1)
    }, // rectangular kernel
];

#[test]
fn cudnn_conv_matches_the_cpu_im2col_path() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    kiln_backend_cuda::set_allow_tf32(false);
    kiln_backend_cuda::set_cudnn(true);
    for (i, c) in CASES.iter().enumerate() {
        let ops = c.operands(10 + i as u64);
        for (dt, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
            let want = run::<Cpu>(&on::<Cpu>(&ops, dt, &cpu()), c, true);
            let got = run::<Cuda>(&on::<Cuda>(&ops, dt, &dev), c, false);
            compare(&format!("{dt} {c:?}"), &got, &want, tol);
        }
        // 16-bit: against the CPU in f32 on the same rounded values; the GPU rounds each
        // result (and the bias add) to 16 bits.
        for (dt, tol) in [(DType::BF16, 3e-2), (DType::F16, 5e-3)] {
            let want = run::<Cpu>(&widened(&ops, dt, DType::F32), c, true);
            let got = run::<Cuda>(&on::<Cuda>(&ops, dt, &dev), c, false);
            compare(&format!("{dt} {c:?}"), &got, &want, tol);
        }
    }
}

#[test]
fn the_fallback_gives_the_same() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    kiln_backend_cuda::set_allow_tf32(false);
    for (i, c) in CASES.iter().enumerate() {
        let ops = on::<Cuda>(&c.operands(40 + i as u64), DType::F32, &dev);
        kiln_backend_cuda::set_cudnn(true);
        let native = run::<Cuda>(&ops, c, false);
        let direct = run::<Cuda>(&ops, c, true);
        kiln_backend_cuda::set_cudnn(false); // what KILN_CUDNN=0 sets
        let switched = run::<Cuda>(&ops, c, false);
        kiln_backend_cuda::set_cudnn(true);
        compare(&format!("im2col {c:?}"), &direct, &native, 1e-4);
        compare(&format!("KILN_CUDNN=0 {c:?}"), &switched, &native, 1e-4);
    }
}

#[test]
fn cudnn_conv_passes_the_gradient_check_in_f64() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    kiln_backend_cuda::set_cudnn(true);
    for (i, c) in CASES.iter().enumerate() {
        let [x, w, b, _] = on::<Cuda>(&c.operands(70 + i as u64), DType::F64, &dev);
        let c = *c;
        assert_backward(
            move |v: &[Var<Cuda>]| conv2d_grouped(&v[0], &v[1], Some(&v[2]), c.window(), c.groups),
            &[x, w, b],
            &CheckOptions::default().with_seed(i as u64),
        );
    }
}

#[test]
fn bad_shapes_keep_their_typed_errors() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    kiln_backend_cuda::set_cudnn(true);
    let x = Var::constant(Tensor::<Cuda>::zeros([1, 3, 5, 5], DType::F32, &dev).unwrap());
    let w = Var::constant(Tensor::<Cuda>::zeros([4, 2, 3, 3], DType::F32, &dev).unwrap());
    let e = conv2d_grouped(&x, &w, None, Window::new(3), 1).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { op: "conv2d", .. }),
        "channels: {e}"
    );
    let w = Var::constant(Tensor::<Cuda>::zeros([4, 3, 7, 7], DType::F32, &dev).unwrap());
    let e = conv2d_grouped(&x, &w, None, Window::new(7), 1).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { op: "conv2d", .. }),
        "window: {e}"
    );
}

#[test]
fn the_comparisons_hold_on_the_cpu() {
    // The same cases, operands and tolerances with the CPU standing in for the GPU (its
    // 16-bit convolution rounds like the GPU's, through the im2col path): checks the harness
    // itself, and runs without a GPU.
    for (i, c) in CASES.iter().chain(TC_CASES).enumerate() {
        let ops = c.operands(10 + i as u64);
        let want = run::<Cpu>(&on::<Cpu>(&ops, DType::F64, &cpu()), c, true);
        let got = run::<Cpu>(&on::<Cpu>(&ops, DType::F32, &cpu()), c, false);
        compare(&format!("f32 {c:?}"), &got, &want, 1e-4);
        for (dt, tol) in [(DType::BF16, 3e-2), (DType::F16, 5e-3)] {
            let want = run::<Cpu>(&widened(&ops, dt, DType::F32), c, true);
            let got = run::<Cpu>(&on::<Cpu>(&ops, dt, &cpu()), c, false);
            compare(&format!("{dt} {c:?}"), &got, &want, tol);
        }
    }
}

/// Output and the gradients of input, weight and bias as tensors (no host read: capturable).
fn run_tensors(ops: &[Tensor<Cuda>; 4], c: &Case) -> kiln_core::Result<[Tensor<Cuda>; 4]> {
    let [x, w, b, r] = ops;
    let (x, w, b) = (
        Var::param(x.clone()),
        Var::param(w.clone()),
        Var::param(b.clone()),
    );
    let y = conv2d_grouped(&x, &w, Some(&b), c.window(), c.groups)?;
    y.backward_with(r)?;
    let grad = |v: &Var<Cuda>| {
        v.grad()
            .ok_or_else(|| Error::invalid("test", "no gradient"))
    };
    Ok([y.tensor(), grad(&x)?, grad(&w)?, grad(&b)?])
}

#[test]
fn cudnn_conv_is_captured_in_a_cuda_graph() {
    use kiln_backend_cuda::{CudaGraph, write_static};
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    kiln_backend_cuda::set_allow_tf32(false);
    kiln_backend_cuda::set_cudnn(true);
    // A geometry measured before the capture (this also creates the handle), and one seen
    // first inside it (cuDNN's heuristic choice; no other test uses it).
    let measured = CASES[0];
    let fresh = case([2, 5, 7, 6], 3, 3, 1, 1, 1, 1);
    let host = |t: &Tensor<Cuda>| t.to_f64_vec().unwrap();
    run_tensors(
        &on::<Cuda>(&measured.operands(1), DType::F32, &dev),
        &measured,
    )
    .unwrap();
    for (i, c) in [measured, fresh].iter().enumerate() {
        let fixed = on::<Cuda>(&c.operands(100 + i as u64), DType::F32, &dev);
        let (graph, outs) = CudaGraph::capture(&dev, || run_tensors(&fixed, c)).unwrap();
        // New values in the captured input, then one replay against the eager result.
        let next = on::<Cuda>(&c.operands(200 + i as u64), DType::F32, &dev);
        write_static(&fixed[0], &next[0]).unwrap();
        graph.replay().unwrap();
        let eager = run_tensors(
            &[
                next[0].clone(),
                fixed[1].clone(),
                fixed[2].clone(),
                fixed[3].clone(),
            ],
            c,
        )
        .unwrap();
        let got = outs.each_ref().map(host);
        let want = eager.each_ref().map(host);
        compare(&format!("captured {c:?}"), &got, &want, 1e-4);
    }
}

#[test]
fn under_autocast_the_conv_runs_in_the_low_dtype_on_both_paths() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    kiln_backend_cuda::set_cudnn(true);
    let c = CASES[1];
    let ops = on::<Cuda>(&c.operands(300), DType::F32, &dev);
    let [x, w, b, _] = &ops;
    let (x, w, b) = (
        Var::param(x.clone()),
        Var::param(w.clone()),
        Var::param(b.clone()),
    );
    let _ac = kiln_autograd::autocast(DType::BF16).unwrap();
    let native = conv2d_grouped(&x, &w, Some(&b), c.window(), c.groups).unwrap();
    let im2col = conv2d_im2col_path(&x, &w, Some(&b), c.window(), c.groups).unwrap();
    assert_eq!(native.dtype(), DType::BF16);
    assert_eq!(im2col.dtype(), DType::BF16);
    let (a, b) = (
        native.tensor().to_f64_vec().unwrap(),
        im2col.tensor().to_f64_vec().unwrap(),
    );
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    check_close(&a, &b, 3e-2 * scale, 3e-2).unwrap();
    // The gradients flow back through the casts to the f32 parameters.
    native.sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
    assert_eq!(x.grad().unwrap().dtype(), DType::F32);
}

/// Geometries of ResNet's kind, with channel counts cuDNN's NHWC tensor-core kernels take
/// (multiples of 8), for the layout tests beside [`CASES`]: 3×3 "same", a 1×1 stride-2
/// projection, and one strided, padded, dilated and grouped.
const TC_CASES: &[Case] = &[
    case([2, 16, 8, 8], 16, 3, 1, 1, 1, 1),
    case([2, 16, 8, 8], 32, 1, 2, 0, 1, 1),
    case([2, 16, 9, 9], 32, 3, 2, 1, 2, 2),
];

/// Restores the layout switch, TF32 and the cuDNN API when a layout test ends (also on a
/// failure), so that the other tests run as they expect. The layout tests run the legacy API,
/// the one the layout switch steers (`cuda_conv_graph.rs` tests the graph API), whatever
/// `KILN_CUDNN_API` says.
struct Restore(bool, kiln_backend_cuda::CudnnApi);

impl Restore {
    fn legacy() -> Restore {
        let r = Restore(
            kiln_backend_cuda::allow_tf32(),
            kiln_backend_cuda::cudnn_api(),
        );
        kiln_backend_cuda::set_cudnn_api(kiln_backend_cuda::CudnnApi::Legacy);
        r
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        kiln_backend_cuda::set_cudnn_layout(kiln_backend_cuda::CudnnLayout::Nchw);
        kiln_backend_cuda::set_allow_tf32(self.0);
        kiln_backend_cuda::set_cudnn_api(self.1);
    }
}

/// Each case in TF32, bf16 and f16 against the CPU's im2col path, with the layout switch at
/// `layout`; returns how many cuDNN calls ran NHWC per case of [`TC_CASES`] and dtype.
fn tensor_core_sweep(dev: &CudaDevice, layout: kiln_backend_cuda::CudnnLayout) -> Vec<u64> {
    kiln_backend_cuda::set_cudnn_layout(layout);
    kiln_backend_cuda::set_allow_tf32(true);
    let mut nhwc = Vec::new();
    for (i, c) in CASES.iter().chain(TC_CASES).enumerate() {
        let ops = c.operands(500 + i as u64);
        // TF32 rounds the operands to a 10-bit mantissa: f16's tolerance, against f64.
        let refs = [
            (DType::F32, 5e-3, on::<Cpu>(&ops, DType::F64, &cpu())),
            (DType::BF16, 3e-2, widened(&ops, DType::BF16, DType::F32)),
            (DType::F16, 5e-3, widened(&ops, DType::F16, DType::F32)),
        ];
        for (dt, tol, reference) in refs {
            let want = run::<Cpu>(&reference, c, true);
            let before = kiln_backend_cuda::cudnn_nhwc_calls();
            let got = run::<Cuda>(&on::<Cuda>(&ops, dt, dev), c, false);
            compare(&format!("{layout:?} {dt} {c:?}"), &got, &want, tol);
            if i >= CASES.len() {
                nhwc.push(kiln_backend_cuda::cudnn_nhwc_calls() - before);
            }
        }
    }
    nhwc
}

#[test]
fn each_cudnn_layout_matches_the_cpu_in_tf32_bf16_and_f16() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    let _restore = Restore::legacy();
    kiln_backend_cuda::set_cudnn(true);
    let cudnn = kiln_backend_cuda::cudnn_available();
    use kiln_backend_cuda::CudnnLayout::{Auto, Nchw, Nhwc};
    let forced = tensor_core_sweep(&dev, Nhwc);
    eprintln!("NHWC calls per TC case and dtype (forced nhwc): {forced:?}");
    // Forward, input gradient and weight gradient each ran NHWC where cuDNN offers it, which
    // it does for every ungrouped ResNet geometry; the grouped one is only reported.
    for (j, n) in forced.iter().enumerate() {
        let c = TC_CASES[j / 3];
        if cudnn && c.groups == 1 {
            assert!(*n >= 3, "{c:?} (dtype {}): {n} NHWC calls, want 3", j % 3);
        }
    }
    let nchw = tensor_core_sweep(&dev, Nchw);
    assert!(
        nchw.iter().all(|n| *n == 0),
        "forced nchw ran NHWC: {nchw:?}"
    );
    let auto = tensor_core_sweep(&dev, Auto);
    eprintln!("NHWC calls per TC case and dtype (auto): {auto:?}");
}

#[test]
fn strict_f32_and_f64_stay_nchw_when_nhwc_is_forced() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    let _restore = Restore::legacy();
    kiln_backend_cuda::set_cudnn(true);
    kiln_backend_cuda::set_allow_tf32(false);
    kiln_backend_cuda::set_cudnn_layout(kiln_backend_cuda::CudnnLayout::Nhwc);
    let c = TC_CASES[0];
    let ops = c.operands(600);
    let before = kiln_backend_cuda::cudnn_nhwc_calls();
    for (dt, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        let want = run::<Cpu>(&on::<Cpu>(&ops, dt, &cpu()), &c, true);
        let got = run::<Cuda>(&on::<Cuda>(&ops, dt, &dev), &c, false);
        compare(&format!("{dt} {c:?}"), &got, &want, tol);
    }
    assert_eq!(kiln_backend_cuda::cudnn_nhwc_calls(), before);
}

#[test]
fn nhwc_cudnn_conv_is_captured_in_a_cuda_graph() {
    use kiln_backend_cuda::{CudaGraph, write_static};
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu() else { return };
    let _restore = Restore::legacy();
    kiln_backend_cuda::set_cudnn(true);
    kiln_backend_cuda::set_allow_tf32(true);
    kiln_backend_cuda::set_cudnn_layout(kiln_backend_cuda::CudnnLayout::Nhwc);
    // One geometry measured before the capture, one seen first inside it (NHWC heuristic;
    // no other test uses it).
    let measured = TC_CASES[0];
    let fresh = case([2, 8, 7, 6], 16, 3, 1, 1, 1, 1);
    let host = |t: &Tensor<Cuda>| t.to_f64_vec().unwrap();
    run_tensors(
        &on::<Cuda>(&measured.operands(1), DType::F32, &dev),
        &measured,
    )
    .unwrap();
    for (i, c) in [measured, fresh].iter().enumerate() {
        let fixed = on::<Cuda>(&c.operands(700 + i as u64), DType::F32, &dev);
        let before = kiln_backend_cuda::cudnn_nhwc_calls();
        let (graph, outs) = CudaGraph::capture(&dev, || run_tensors(&fixed, c)).unwrap();
        if kiln_backend_cuda::cudnn_available() {
            assert!(kiln_backend_cuda::cudnn_nhwc_calls() >= before + 3, "{c:?}");
        }
        let next = on::<Cuda>(&c.operands(800 + i as u64), DType::F32, &dev);
        write_static(&fixed[0], &next[0]).unwrap();
        graph.replay().unwrap();
        let eager = run_tensors(
            &[
                next[0].clone(),
                fixed[1].clone(),
                fixed[2].clone(),
                fixed[3].clone(),
            ],
            c,
        )
        .unwrap();
        let got = outs.each_ref().map(host);
        let want = eager.each_ref().map(host);
        // The eager run may measure an algorithm other than the captured heuristic one: TF32's
        // tolerance.
        compare(&format!("captured nhwc {c:?}"), &got, &want, 5e-3);
    }
}
