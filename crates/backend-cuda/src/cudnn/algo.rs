//! Algorithm choice, by measurement once per geometry (PyTorch's `cudnn.benchmark`), and the
//! calls that run a convolution with the choice.
//!
//! For each direction (forward, gradient of the input, gradient of the weight) the first call
//! of a geometry asks cuDNN to time every algorithm on the real operands
//! (`cudnnFind*AlgorithmEx`), with the largest workspace kiln's memory pool can give (up to
//! 4 GiB or a quarter of the device's memory), and keeps the list of those that ran, fastest
//! first. Later calls take the first whose workspace the pool can give now (an algorithm whose
//! workspace cannot be had is skipped, not an error), so a steady step makes no search and no
//! driver allocation (the workspace is a pool block, back in the cache after the call).
//!
//! Measuring synchronizes the device, which a CUDA graph capture forbids: while capturing, a
//! geometry not measured yet takes cuDNN's heuristic ranking (`cudnnGet*Algorithm_v7`, host
//! only) for that call, and is measured at its first call outside a capture.
//!
//! With f32 and TF32 off the convolution asks for FMA math; an algorithm reported with another
//! math type is dropped, so f32 results stay full f32 products, as on the CPU.

use std::ffi::c_void;

use cudarc::cudnn::sys;
use kiln_core::{Error, Result};

use super::desc::Plan;
use super::status;
use crate::device::DeviceState;
use crate::memory::{Buffer, alloc};

/// The three convolutions cuDNN computes for a geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Dir {
    /// `y = conv(x, w)`.
    Forward,
    /// `dx` from `w` and `dy` (backward data).
    Data,
    /// `dw` from `x` and `dy` (backward filter).
    Filter,
}

impl Dir {
    pub fn op(self) -> &'static str {
        match self {
            Dir::Forward => "conv2d",
            Dir::Data => "conv2d_backward_data",
            Dir::Filter => "conv2d_backward_filter",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
    /// How many algorithms cuDNN has for this direction (its `*_ALGO_COUNT`).
    fn count(self) -> u32 {
        match self {
            Dir::Forward => sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as u32,
            Dir::Data => {
                sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as u32
            }
            Dir::Filter => {
                sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as u32
            }
        }
    }
}

/// One usable algorithm: cuDNN's number for it, the math type it was measured with, and the
/// workspace it needs.
#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate {
    algo: u32,
    math: sys::cudnnMathType_t,
    workspace: usize,
    /// What the search measured, ms (0 from the heuristic).
    time: f32,
}

impl Candidate {
    /// What the search measured, ms (0 from the heuristic).
    pub(super) fn time(&self) -> f32 {
        self.time
    }
}

impl std::fmt::Display for Candidate {
    /// `algo 1 (tensor op) 0.123 ms, 4.0 MiB`, for `KILN_CUDNN_LOG=1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use sys::cudnnMathType_t::*;
        let math = match self.math {
            CUDNN_DEFAULT_MATH => "default",
            CUDNN_TENSOR_OP_MATH => "tensor op",
            CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION => "tensor op, converting",
            CUDNN_FMA_MATH => "fma",
        };
        let mib = self.workspace as f64 / (1 << 20) as f64;
        write!(
            f,
            "algo {} ({math}) {:.3} ms, {mib:.1} MiB",
            self.algo, self.time
        )
    }
}

/// The layout shared by cuDNN's three `*AlgoPerf_t` structs, read with plain integers so that
/// a value this binding's enums do not know is skipped rather than undefined behavior.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawPerf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math: u32,
    reserved: [i32; 3],
}

const _: () = {
    use std::mem::{align_of, size_of};
    assert!(size_of::<RawPerf>() == size_of::<sys::cudnnConvolutionFwdAlgoPerf_t>());
    assert!(size_of::<RawPerf>() == size_of::<sys::cudnnConvolutionBwdDataAlgoPerf_t>());
    assert!(size_of::<RawPerf>() == size_of::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>());
    assert!(align_of::<RawPerf>() == align_of::<sys::cudnnConvolutionFwdAlgoPerf_t>());
};

fn math_of(v: u32) -> Option<sys::cudnnMathType_t> {
    use sys::cudnnMathType_t::*;
    [
        CUDNN_DEFAULT_MATH,
        CUDNN_TENSOR_OP_MATH,
        CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        CUDNN_FMA_MATH,
    ]
    .into_iter()
    .find(|m| *m as u32 == v)
}

fn fwd_algo(v: u32) -> Option<sys::cudnnConvolutionFwdAlgo_t> {
    use sys::cudnnConvolutionFwdAlgo_t::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
    .into_iter()
    .find(|a| *a as u32 == v)
}

fn data_algo(v: u32) -> Option<sys::cudnnConvolutionBwdDataAlgo_t> {
    use sys::cudnnConvolutionBwdDataAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
    .into_iter()
    .find(|a| *a as u32 == v)
}

fn filter_algo(v: u32) -> Option<sys::cudnnConvolutionBwdFilterAlgo_t> {
    use sys::cudnnConvolutionBwdFilterAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ]
    .into_iter()
    .find(|a| *a as u32 == v)
}

/// The device pointers of one call: the two operands and the output, in cuDNN's order for
/// the direction (forward: `x`, `w`, `y`; data: `w`, `dy`, `dx`; filter: `x`, `dy`, `dw`).
#[derive(Clone, Copy)]
pub(super) struct Operands {
    pub a: u64,
    pub b: u64,
    pub out: u64,
}

/// The workspace algorithm `algo` needs for `dir` on `plan`, or `None` when cuDNN does not
/// support it there.
fn workspace_size(h: sys::cudnnHandle_t, plan: &Plan, dir: Dir, algo: u32) -> Option<usize> {
    let mut bytes = 0usize;
    // SAFETY: live handle and descriptors (under the device's cuDNN lock), a valid out-pointer.
    let r = unsafe {
        match dir {
            Dir::Forward => sys::cudnnGetConvolutionForwardWorkspaceSize(
                h,
                plan.x,
                plan.w,
                plan.conv,
                plan.y,
                fwd_algo(algo)?,
                &mut bytes,
            ),
            Dir::Data => sys::cudnnGetConvolutionBackwardDataWorkspaceSize(
                h,
                plan.w,
                plan.y,
                plan.conv,
                plan.x,
                data_algo(algo)?,
                &mut bytes,
            ),
            Dir::Filter => sys::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                h,
                plan.x,
                plan.y,
                plan.conv,
                plan.w,
                filter_algo(algo)?,
                &mut bytes,
            ),
        }
    };
    (r == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS).then_some(bytes)
}

/// The perf results that ran, as candidates (fastest first, as cuDNN sorts them), keeping
/// only the math type asked for when it is FMA (TF32 off).
fn candidates(perf: &[RawPerf], want: sys::cudnnMathType_t) -> Vec<Candidate> {
    perf.iter()
        .filter(|p| p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32)
        .filter_map(|p| {
            let math = math_of(p.math)?;
            let fma = sys::cudnnMathType_t::CUDNN_FMA_MATH;
            (want != fma || math == fma).then_some(Candidate {
                algo: p.algo,
                math,
                workspace: p.memory,
                time: p.time,
            })
        })
        .collect()
}

/// The most workspace a search offers the algorithms (those asking for more are not timed):
/// 4 GiB, or a quarter of the device's memory if less. The fastest algorithms of ResNet-sized
/// layers need far less; FFT ones on large layers ask for gigabytes.
pub(super) const MEASURE_WORKSPACE_CAP: usize = 4 << 30;

/// Searches `dir`'s algorithms on the real operands (module docs): synchronizes the device.
pub(super) fn measure(
    dev: &'static DeviceState,
    h: sys::cudnnHandle_t,
    plan: &Plan,
    want: sys::cudnnMathType_t,
    dir: Dir,
    ops: Operands,
) -> Result<Vec<Candidate>> {
    let op = dir.op();
    // The largest workspace any algorithm asks for, capped (the block stays in the pool's
    // cache afterwards), then smaller ones if the pool cannot give it.
    let cap = (dev.device().total_memory()? / 4).min(MEASURE_WORKSPACE_CAP);
    let mut sizes: Vec<usize> = (0..dir.count())
        .filter_map(|a| workspace_size(h, plan, dir, a))
        .filter(|&b| b <= cap)
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let mut ws: Option<Buffer> = None;
    for &bytes in &sizes {
        if bytes == 0 {
            break;
        }
        match alloc(dev, bytes) {
            Ok(b) => {
                ws = Some(b);
                break;
            }
            Err(Error::OutOfMemory { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    let (ws_ptr, ws_bytes) = ws
        .as_ref()
        .map_or((0, 0), |b| (b.device_ptr(), b.len_bytes()));
    let n = 2 * dir.count() as usize;
    let mut perf = vec![
        RawPerf {
            algo: 0,
            status: u32::MAX,
            time: 0.0,
            memory: 0,
            determinism: 0,
            math: 0,
            reserved: [0; 3],
        };
        n
    ];
    let mut got = 0i32;
    let (a, b, out) = (
        ops.a as *const c_void,
        ops.b as *const c_void,
        ops.out as *mut c_void,
    );
    let wsp = ws_ptr as *mut c_void;
    // SAFETY: live handle and descriptors under the device's cuDNN lock; the operand pointers
    // are live device buffers of the descriptors' shapes (the caller's contract), the output
    // is a fresh buffer the search may overwrite, the workspace holds `ws_bytes`; `perf` has
    // room for `n` results, each laid out as cuDNN's perf struct (checked above).
    let r = unsafe {
        match dir {
            Dir::Forward => sys::cudnnFindConvolutionForwardAlgorithmEx(
                h,
                plan.x,
                a,
                plan.w,
                b,
                plan.conv,
                plan.y,
                out,
                n as i32,
                &mut got,
                perf.as_mut_ptr().cast(),
                wsp,
                ws_bytes,
            ),
            Dir::Data => sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                h,
                plan.w,
                a,
                plan.y,
                b,
                plan.conv,
                plan.x,
                out,
                n as i32,
                &mut got,
                perf.as_mut_ptr().cast(),
                wsp,
                ws_bytes,
            ),
            Dir::Filter => sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                h,
                plan.x,
                a,
                plan.y,
                b,
                plan.conv,
                plan.w,
                out,
                n as i32,
                &mut got,
                perf.as_mut_ptr().cast(),
                wsp,
                ws_bytes,
            ),
        }
    };
    status(r, op)?;
    drop(ws);
    perf.truncate(got.clamp(0, n as i32) as usize);
    Ok(candidates(&perf, want))
}

/// cuDNN's heuristic ranking for `dir` (host only: usable while a CUDA graph is captured).
pub(super) fn heuristic(
    h: sys::cudnnHandle_t,
    plan: &Plan,
    want: sys::cudnnMathType_t,
    dir: Dir,
) -> Result<Vec<Candidate>> {
    let n = 2 * dir.count() as usize;
    let mut perf = vec![
        RawPerf {
            algo: 0,
            status: u32::MAX,
            time: 0.0,
            memory: 0,
            determinism: 0,
            math: 0,
            reserved: [0; 3],
        };
        n
    ];
    let mut got = 0i32;
    // SAFETY: live handle and descriptors under the device's cuDNN lock; `perf` has room for
    // `n` results laid out as cuDNN's perf structs.
    let r = unsafe {
        match dir {
            Dir::Forward => sys::cudnnGetConvolutionForwardAlgorithm_v7(
                h,
                plan.x,
                plan.w,
                plan.conv,
                plan.y,
                n as i32,
                &mut got,
                perf.as_mut_ptr().cast(),
            ),
            Dir::Data => sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                h,
                plan.w,
                plan.y,
                plan.conv,
                plan.x,
                n as i32,
                &mut got,
                perf.as_mut_ptr().cast(),
            ),
            Dir::Filter => sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                h,
                plan.x,
                plan.y,
                plan.conv,
                plan.w,
                n as i32,
                &mut got,
                perf.as_mut_ptr().cast(),
            ),
        }
    };
    status(r, dir.op())?;
    perf.truncate(got.clamp(0, n as i32) as usize);
    Ok(candidates(&perf, want))
}

/// Runs `dir` with the first candidate whose workspace the pool can give and that cuDNN runs
/// (module docs); the error of the last one tried when none does;
/// `alpha`/`beta` are host scalars of the type cuDNN expects for the data type (f64 for
/// doubles, f32 otherwise), `beta` zero (the output is overwritten).
pub(super) fn execute(
    dev: &'static DeviceState,
    h: sys::cudnnHandle_t,
    plan: &Plan,
    dir: Dir,
    cands: &[Candidate],
    ops: Operands,
    scalars: (*const c_void, *const c_void),
) -> Result<()> {
    let op = dir.op();
    // Why the last candidate could not run (its workspace, or cuDNN refusing it).
    let mut last_err = None;
    for c in cands {
        plan.set_math(c.math, op)?;
        // What the search reported, or what cuDNN asks now for the math type set, if more
        // (PyTorch asks again too: the two have been seen to differ).
        let bytes =
            workspace_size(h, plan, dir, c.algo).map_or(c.workspace, |b| b.max(c.workspace));
        let ws = if bytes == 0 {
            None
        } else {
            match alloc(dev, bytes) {
                Ok(b) => Some(b),
                Err(e @ Error::OutOfMemory { .. }) => {
                    last_err = Some(e);
                    continue;
                }
                Err(e) => return Err(e),
            }
        };
        let wsp = ws.as_ref().map_or(0, |b| b.device_ptr()) as *mut c_void;
        let (a, b, out) = (
            ops.a as *const c_void,
            ops.b as *const c_void,
            ops.out as *mut c_void,
        );
        let (alpha, beta) = scalars;
        let _prof = crate::profile::launch(dev, op, true);
        // SAFETY: live handle (bound to the current stream) and descriptors under the device's
        // cuDNN lock; operands and output are live device buffers of the descriptors' shapes;
        // the workspace holds `bytes` bytes and is freed (stream-ordered) after
        // the call is queued; alpha/beta point at live host scalars of the right type.
        let r = unsafe {
            match dir {
                Dir::Forward => sys::cudnnConvolutionForward(
                    h,
                    alpha,
                    plan.x,
                    a,
                    plan.w,
                    b,
                    plan.conv,
                    fwd_algo(c.algo).ok_or_else(|| bad_algo(op, c.algo))?,
                    wsp,
                    bytes,
                    beta,
                    plan.y,
                    out,
                ),
                Dir::Data => sys::cudnnConvolutionBackwardData(
                    h,
                    alpha,
                    plan.w,
                    a,
                    plan.y,
                    b,
                    plan.conv,
                    data_algo(c.algo).ok_or_else(|| bad_algo(op, c.algo))?,
                    wsp,
                    bytes,
                    beta,
                    plan.x,
                    out,
                ),
                Dir::Filter => sys::cudnnConvolutionBackwardFilter(
                    h,
                    alpha,
                    plan.x,
                    a,
                    plan.y,
                    b,
                    plan.conv,
                    filter_algo(c.algo).ok_or_else(|| bad_algo(op, c.algo))?,
                    wsp,
                    bytes,
                    beta,
                    plan.w,
                    out,
                ),
            }
        };
        // The output is overwritten whole (beta = 0), so a refused candidate leaves nothing
        // the next one depends on.
        match status(r, op) {
            Ok(()) => return Ok(()),
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.unwrap_or_else(|| {
        Error::backend(
            op,
            "cuDNN reported no algorithm that can run this convolution",
        )
    }))
}

fn bad_algo(op: &'static str, algo: u32) -> Error {
    Error::backend(op, format!("cuDNN reported unknown algorithm {algo}"))
}
