//! Convolutions through cuDNN's graph (backend) API (`KILN_CUDNN_API=graph`,
//! `set_cudnn_api(CudnnApi::Graph)`) against kiln's im2col path on the CPU and against the
//! legacy cuDNN API on the GPU: outputs and the gradients of input, weight and bias (so the
//! forward, backward-data and backward-filter graphs) for 3×3 "same", stride 2, 1×1, dilation,
//! 2 groups, depthwise and a 3-channel stem, in f32 with TF32 off and on, f64, bf16 and f16.
//! The graph path's calls are counted (`cudnn_graph_calls`), so a silent fall back to the
//! legacy API fails the ungrouped cases; a geometry measured before a CUDA graph capture is
//! captured through the graph path, one first seen inside it takes the legacy path.
//!
//! Without a GPU every test prints `skipped: no CUDA device 0 (<reason>)`; without cuDNN it
//! prints so and compares the im2col path on both sides (`KILN_REQUIRE_CUDNN=1` makes that a
//! failure).

mod conv_case;

use std::sync::Mutex;

use conv_case::{Case, case, compare, cpu, on, run, widened};

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, CudnnApi, gpu_or_skip};
use kiln_core::{DType, Error, Tensor};
use kiln_nn::conv2d_grouped;

/// The API and TF32 switches are process-wide: each test holds this.
static SWITCH: Mutex<()> = Mutex::new(());

/// The GPU and whether cuDNN is there (failing when `KILN_REQUIRE_CUDNN=1` and it is not).
fn gpu() -> Option<(CudaDevice, bool)> {
    let dev = gpu_or_skip(0)?;
    kiln_nn::set_conv_routing(false);
    kiln_backend_cuda::set_cudnn(true);
    let cudnn = match kiln_backend_cuda::cudnn_version() {
        Ok(v) => {
            eprintln!("cuDNN {v}");
            true
        }
        Err(why) => {
            let must = std::env::var("KILN_REQUIRE_CUDNN").is_ok_and(|v| v == "1");
            assert!(!must, "KILN_REQUIRE_CUDNN=1 but cuDNN is unusable: {why}");
            eprintln!("cuDNN not exercised ({why}): comparing the im2col path on both sides");
            false
        }
    };
    Some((dev, cudnn))
}

/// Restores the API and TF32 switches when a test ends (also on a failure).
struct Restore(bool, CudnnApi);

impl Restore {
    fn new() -> Restore {
        Restore(
            kiln_backend_cuda::allow_tf32(),
            kiln_backend_cuda::cudnn_api(),
        )
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        kiln_backend_cuda::set_allow_tf32(self.0);
        kiln_backend_cuda::set_cudnn_api(self.1);
    }
}

/// The geometries (see `conv_case::Case`).
const CASES: &[Case] = &[
    case([2, 16, 8, 8], 16, 3, 1, 1, 1, 1), // 3×3 "same", ResNet-like
    case([2, 16, 9, 9], 32, 3, 2, 1, 1, 1), // stride 2, odd size
    case([2, 16, 8, 8], 32, 1, 2, 0, 1, 1), // 1×1 stride-2 projection
    case([2, 8, 7, 7], 8, 1, 1, 0, 1, 1),   // 1×1
    case([2, 3, 16, 16], 16, 3, 1, 1, 1, 1), // 3-channel stem
    case([2, 8, 9, 9], 8, 3, 1, 2, 2, 1),   // dilation 2 with padding
    case([2, 16, 8, 8], 16, 3, 1, 1, 1, 2), // 2 groups
    case([2, 16, 8, 8], 16, 3, 2, 1, 1, 16), // depthwise, stride 2
];

/// One dtype setting of the sweep: the dtype on the GPU, TF32, the CPU reference's dtype and
/// rounding, the tolerance.
struct Setting {
    name: &'static str,
    dtype: DType,
    tf32: bool,
    tol: f64,
}

const SETTINGS: &[Setting] = &[
    Setting {
        name: "f32",
        dtype: DType::F32,
        tf32: false,
        tol: 1e-4,
    },
    // TF32 rounds the operands to a 10-bit mantissa: f16's tolerance, against f64.
    Setting {
        name: "tf32",
        dtype: DType::F32,
        tf32: true,
        tol: 5e-3,
    },
    Setting {
        name: "f64",
        dtype: DType::F64,
        tf32: false,
        tol: 1e-10,
    },
    Setting {
        name: "bf16",
        dtype: DType::BF16,
        tf32: false,
        tol: 3e-2,
    },
    Setting {
        name: "f16",
        dtype: DType::F16,
        tf32: false,
        tol: 5e-3,
    },
];

/// The CPU reference of `s` for `ops`.
fn reference(ops: &[Tensor<Cpu>; 4], s: &Setting, c: &Case) -> [Vec<f64>; 4] {
    let r = match s.dtype {
        DType::BF16 | DType::F16 => widened(ops, s.dtype, DType::F32),
        _ if s.tf32 => on::<Cpu>(ops, DType::F64, &cpu()),
        dt => on::<Cpu>(ops, dt, &cpu()),
    };
    run::<Cpu>(&r, c, true)
}

#[test]
fn graph_api_conv_matches_the_cpu_im2col_path() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dev, cudnn)) = gpu() else { return };
    let _restore = Restore::new();
    kiln_backend_cuda::set_cudnn_api(CudnnApi::Graph);
    let mut fell_back = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        let ops = c.operands(10 + i as u64);
        for s in SETTINGS {
            kiln_backend_cuda::set_allow_tf32(s.tf32);
            let want = reference(&ops, s, c);
            let before = kiln_backend_cuda::cudnn_graph_calls();
            let got = run::<Cuda>(&on::<Cuda>(&ops, s.dtype, &dev), c, false);
            let calls = kiln_backend_cuda::cudnn_graph_calls() - before;
            compare(&format!("graph {} {c:?}", s.name), &got, &want, s.tol);
            eprintln!("{} {c:?}: {calls} graph calls", s.name);
            // Forward, data and filter gradients each ran through the graph API wherever cuDNN
            // is there, for every ungrouped geometry in f32, TF32 and the 16-bit types; f64
            // and grouped ones may take the legacy path (only reported).
            if cudnn && c.groups == 1 && s.dtype != DType::F64 && calls < 3 {
                fell_back.push(format!("{} {c:?}: {calls} graph calls", s.name));
            }
        }
    }
    assert!(
        fell_back.is_empty(),
        "fell back to the legacy API: {fell_back:#?}"
    );
}

#[test]
fn graph_and_legacy_apis_agree_on_the_gpu() {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dev, _)) = gpu() else { return };
    let _restore = Restore::new();
    kiln_backend_cuda::set_allow_tf32(false);
    for (i, c) in CASES.iter().enumerate() {
        for (dt, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
            let ops = on::<Cuda>(&c.operands(40 + i as u64), dt, &dev);
            kiln_backend_cuda::set_cudnn_api(CudnnApi::Legacy);
            let legacy = run::<Cuda>(&ops, c, false);
            kiln_backend_cuda::set_cudnn_api(CudnnApi::Graph);
            let graph = run::<Cuda>(&ops, c, false);
            compare(&format!("graph vs legacy {dt} {c:?}"), &graph, &legacy, tol);
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
fn graph_api_conv_is_captured_in_a_cuda_graph() {
    use kiln_backend_cuda::{CudaGraph, write_static};
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dev, cudnn)) = gpu() else { return };
    let _restore = Restore::new();
    kiln_backend_cuda::set_allow_tf32(true);
    kiln_backend_cuda::set_cudnn_api(CudnnApi::Graph);
    // A geometry measured before the capture (it is captured through the graph API), and one
    // seen first inside it (the legacy API's heuristic choice; no other test uses it).
    let measured = case([2, 16, 6, 6], 16, 3, 1, 1, 1, 1);
    let fresh = case([2, 8, 7, 6], 16, 3, 1, 1, 1, 1);
    run_tensors(
        &on::<Cuda>(&measured.operands(1), DType::F32, &dev),
        &measured,
    )
    .unwrap();
    let host = |t: &Tensor<Cuda>| t.to_f64_vec().unwrap();
    for (i, c) in [measured, fresh].iter().enumerate() {
        let fixed = on::<Cuda>(&c.operands(700 + i as u64), DType::F32, &dev);
        let before = kiln_backend_cuda::cudnn_graph_calls();
        let (graph, outs) = CudaGraph::capture(&dev, || run_tensors(&fixed, c)).unwrap();
        let calls = kiln_backend_cuda::cudnn_graph_calls() - before;
        if cudnn {
            let want = if i == 0 { 3 } else { 0 };
            assert_eq!(calls, want, "graph calls captured for {c:?}");
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
        // The eager run of the fresh geometry measures through the graph API what the capture
        // ran with the legacy heuristic: TF32's tolerance.
        compare(&format!("captured {c:?}"), &got, &want, 5e-3);
    }
}

#[test]
fn the_references_hold_on_the_cpu() {
    // The same cases, settings and tolerances with the CPU standing in for the GPU (TF32 is
    // exact f32 there, within its tolerance): checks the harness itself, without a GPU.
    for (i, c) in CASES.iter().enumerate() {
        let ops = c.operands(10 + i as u64);
        for s in SETTINGS {
            let want = reference(&ops, s, c);
            let got = run::<Cpu>(&on::<Cpu>(&ops, s.dtype, &cpu()), c, false);
            compare(&format!("cpu {} {c:?}", s.name), &got, &want, s.tol);
        }
    }
}
