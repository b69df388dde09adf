//! Convolutions through cuDNN (cudarc's `cudnn`, loaded at run time): the CUDA backend's answer
//! to `Backend::conv2d` and its two gradients.
//!
//! kiln's own convolution (kiln-nn: im2col gathers and one GEMM) runs at about half cuDNN's
//! speed on ResNet-sized layers, so where cuDNN is there the CUDA backend hands convolutions to
//! it, as PyTorch does, and kiln-nn's im2col path is what runs without it.
//!
//! - **Optional at run time.** libcudnn is opened only when a convolution first asks
//!   ([`available`]): when it is missing (it is not part of the driver; PyTorch's wheels carry it
//!   in `site-packages/nvidia/cudnn/lib`), older than 9, or incomplete, the backend says so once
//!   on stderr and answers "not offered", and convolutions take the im2col path. cudarc panics
//!   on a call into a library it cannot open, so nothing here calls cuDNN before that check.
//!   `KILN_CUDNN=0` (or [`set_cudnn`]) forces the im2col path, to compare the two;
//!   `KILN_CUDNN_LOG=1` prints each geometry's measured algorithms per format and, with the
//!   layout at `auto`, both formats' times and the one kept.
//! - **One handle per device**, created on first use and bound to the calling thread's current
//!   stream before every call, kept with the device's plans under one lock (`State`).
//! - **Algorithms measured once per geometry** and cached per device (`algo.rs`); workspaces
//!   are blocks of kiln's memory pool, never a `cudaMalloc` per call.
//! - **Operands**: NCHW, packed and 256-byte aligned (a strided or offset view is copied first,
//!   so that the algorithm measured for a geometry meets the same alignment every time); f32
//!   (FMA math unless TF32 is allowed, see `blas.rs`), f64, and f16/bf16 computing in f32.
//!   Geometries cuDNN's 32-bit descriptors cannot hold, and empty tensors, are not offered.
//! - **Two memory formats for tensor-core math** (TF32, bf16, f16): cuDNN's fastest Hopper
//!   kernels are NHWC/KRSC ones, which NCHW descriptors never reach, so such a geometry may
//!   instead run on NHWC copies of its operands, transposed by kiln's strided copy, with the
//!   result transposed back (`nhwc.rs`). With `KILN_CUDNN_LAYOUT=auto` (or
//!   [`set_cudnn_layout`]) the faster of the two whole calls, transposes included, is measured
//!   once per geometry and direction and kept (`pick.rs`); the default is NCHW, since on an
//!   H100 `auto` gained no more than the noise (see `CudnnLayout::Nchw`); `nhwc` forces NHWC;
//!   f64 and strict f32 (FMA) are always NCHW. [`cudnn_nhwc_calls`] counts NHWC calls.
//! - **Two APIs**: the legacy one above (`algo.rs`) and the backend (graph) API (`graph.rs`),
//!   whose engines, timed per geometry and direction as `cudnn.benchmark` does, include
//!   Hopper's NHWC tensor-core kernels for NCHW tensors; a geometry the graph API cannot
//!   serve, or first seen inside a capture, takes the legacy path. By default (`auto`) the
//!   graph API serves tensor-core math (TF32, bf16, f16); strict f32 and f64 take, per
//!   geometry and direction, the API whose fastest measured choice is faster (the legacy
//!   search's Winograd/FFT algorithms win ResNet-18's layers, the graph engines some others)
//!   (`KILN_CUDNN_API=auto|graph|legacy`, [`set_cudnn_api`]). The layout switch applies to the
//!   legacy API only.
//! - **Fused inference epilogue** (`fused.rs`): a forward convolution with a per-channel bias
//!   and a ReLU as one graph (convolution → pointwise add → pointwise ReLU), for kiln-nn's
//!   folded Conv + BatchNorm in eval mode (`Backend::conv2d_bias_act`); selected and cached
//!   as the graph API's convolutions, declined (`None`) where cuDNN serves no engine. By
//!   default for TF32 convolutions only (where it measured faster); `KILN_CUDNN_FUSION=1` or
//!   [`set_cudnn_fusion`]`(true)` for every dtype, `=0` or `(false)` never.
//! - **Errors**: a cuDNN status other than success becomes `Error::Backend` naming the op and
//!   the status; an allocation that fails stays `Error::OutOfMemory`.
//! - **CUDA graphs**: a convolution captured after its geometry was measured replays the
//!   measured algorithm and format; one not measured yet takes cuDNN's heuristic choice, in
//!   NCHW (NHWC when forced), during the capture (measuring synchronizes, which a capture
//!   forbids). NHWC's transposes are plain kernels, captured like any other, and their
//!   scratch comes from the pool as a workspace does. The handle is never created
//!   during a capture: a first convolution inside one takes the im2col path.

mod algo;
mod backend;
mod desc;
mod fused;
mod graph;
mod nhwc;
mod pick;
mod sdpa;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cudnn::sys;
use kiln_core::{Conv2dSpec, DType, Error, Layout, Result};

use crate::device::DeviceState;
use crate::memory::{Buffer, alloc};
pub(crate) use algo::Dir;
use desc::Key;
pub(crate) use fused::conv_bias_act;
pub use fused::{cudnn_fused_calls, cudnn_fusion, set_cudnn_fusion};
pub use graph::{CudnnApi, cudnn_api, cudnn_graph_calls, set_cudnn_api};
pub use nhwc::{CudnnLayout, cudnn_layout, cudnn_nhwc_calls, set_cudnn_layout};
use pick::Geometry;
pub(crate) use sdpa::{
    Call as SdpaCall, run as sdpa_run, too_small as sdpa_too_small, wanted as sdpa_wanted,
};
pub use sdpa::{cudnn_attention, cudnn_attention_calls, set_cudnn_attention};

/// A cuDNN status as a typed error naming `op` (the status itself, e.g.
/// `CUDNN_STATUS_NOT_SUPPORTED`).
fn status(r: sys::cudnnStatus_t, op: &'static str) -> Result<()> {
    if r == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    Err(Error::backend(op, format!("cuDNN {r:?}")))
}

static SWITCH: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1: off; 2: on

/// `KILN_CUDNN_LOG=1`: each measured geometry prints its fastest algorithms per format
/// (stderr), the first being the one that runs, with the times cuDNN's search measured; at
/// `auto`, each format's whole-call time (NHWC with its transposes) and the one kept.
fn log_choices() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUDNN_LOG").is_ok_and(|v| v == "1"))
}

/// Whether convolutions may use cuDNN (default: yes, unless `KILN_CUDNN=0`); cuDNN must also
/// be present ([`cudnn_available`]).
pub fn cudnn_enabled() -> bool {
    match SWITCH.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_CUDNN").map_or(true, |v| v != "0");
            SWITCH.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Allows (`true`, the default) or forbids cuDNN for convolutions; forbidden, they take
/// kiln-nn's im2col path. Affects convolutions recorded from now on.
pub fn set_cudnn(on: bool) {
    SWITCH.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether cuDNN 9 could be loaded (opening it on first call); when not, the reason was
/// printed once on stderr.
pub fn cudnn_available() -> bool {
    available().is_ok()
}

/// cuDNN's version (e.g. 90100 for 9.1.0), or why it cannot be used.
pub fn cudnn_version() -> std::result::Result<usize, String> {
    available().map_err(|e| e.to_string())
}

/// Opens cuDNN once: present, version 9 or later, its convolution sublibraries loadable. On
/// failure the reason is printed once (module docs).
fn available() -> std::result::Result<usize, &'static str> {
    static STATE: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let r = STATE.get_or_init(|| {
        let r = probe();
        if let Err(why) = &r {
            eprintln!("kiln: {why}; convolutions use kiln's im2col path");
        }
        r
    });
    r.as_ref().map(|v| *v).map_err(|s| s.as_str())
}

/// Every cuDNN function kiln calls (after `cudnnGetVersion`), checked once by [`probe`].
const SYMBOLS: &[&str] = &[
    "cudnnOpsVersionCheck",
    "cudnnCnnVersionCheck",
    "cudnnCreate",
    "cudnnDestroy",
    "cudnnSetStream",
    "cudnnCreateTensorDescriptor",
    "cudnnSetTensor4dDescriptor",
    "cudnnDestroyTensorDescriptor",
    "cudnnCreateFilterDescriptor",
    "cudnnSetFilter4dDescriptor",
    "cudnnDestroyFilterDescriptor",
    "cudnnCreateConvolutionDescriptor",
    "cudnnSetConvolution2dDescriptor",
    "cudnnSetConvolutionGroupCount",
    "cudnnSetConvolutionMathType",
    "cudnnDestroyConvolutionDescriptor",
    "cudnnGetConvolutionForwardWorkspaceSize",
    "cudnnGetConvolutionBackwardDataWorkspaceSize",
    "cudnnGetConvolutionBackwardFilterWorkspaceSize",
    "cudnnFindConvolutionForwardAlgorithmEx",
    "cudnnFindConvolutionBackwardDataAlgorithmEx",
    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
    "cudnnGetConvolutionForwardAlgorithm_v7",
    "cudnnGetConvolutionBackwardDataAlgorithm_v7",
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
    "cudnnConvolutionForward",
    "cudnnConvolutionBackwardData",
    "cudnnConvolutionBackwardFilter",
];

fn probe() -> std::result::Result<usize, String> {
    // SAFETY: only tries to dlopen libcudnn by its candidate names; must come before any
    // other cuDNN call (cudarc panics on a library it cannot open).
    if !unsafe { sys::is_culib_present() } {
        return Err("cuDNN not found (libcudnn.so.9 not on the library path)".into());
    }
    // SAFETY: the library is present; cudnnGetVersion exists in every version.
    let version = unsafe { sys::cudnnGetVersion() };
    if version < 90000 {
        return Err(format!(
            "cuDNN {version} found, but kiln binds cuDNN 9 (libcudnn.so.9)"
        ));
    }
    // cudarc panics on a symbol it cannot find: every one kiln calls must be there first.
    // SAFETY: looks symbols up in the opened library without calling them.
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        .filter(|name| {
            unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err()
        })
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "cuDNN {version} found but it lacks {}",
            missing.join(", ")
        ));
    }
    // SAFETY: present (checked above); they load the sublibraries and compare their versions.
    let checks = unsafe { [sys::cudnnOpsVersionCheck(), sys::cudnnCnnVersionCheck()] };
    for r in checks {
        if r != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            return Err(format!(
                "cuDNN {version} found but not usable ({r:?}: is libcudnn_cnn.so.9 beside \
                 libcudnn.so.9?)"
            ));
        }
    }
    Ok(version)
}

/// One device's cuDNN: the handle, the stream it is bound to, the plans of the geometries
/// seen, each with the algorithms measured per direction, and the graph API's measured plans
/// per geometry and direction.
struct State {
    handle: sys::cudnnHandle_t,
    stream: usize,
    plans: HashMap<Key, Geometry>,
    graph: graph::Cache,
    /// `auto`'s choice of API for FMA math, per geometry and direction (true: graph).
    api_pick: HashMap<(Key, Dir), bool>,
    /// The fused convolution + bias + activation graphs measured (`fused.rs`).
    fused: fused::Cache,
    /// The fused attention graphs measured (`sdpa.rs`).
    sdpa: sdpa::Cache,
}

// SAFETY: the handle is used only under the device's lock below, after binding the device's
// context; descriptors are host objects.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        self.plans.clear();
        self.graph.clear();
        self.fused.clear();
        self.sdpa.clear();
        // SAFETY: the handle was created by `cudnnCreate` and is destroyed once.
        unsafe {
            sys::cudnnDestroy(self.handle);
        }
    }
}

/// The lock of device `ordinal`'s cuDNN state (`None` until the first convolution).
fn slot(ordinal: usize) -> Option<&'static Mutex<Option<State>>> {
    static SLOTS: OnceLock<Vec<Mutex<Option<State>>>> = OnceLock::new();
    SLOTS
        .get_or_init(|| {
            (0..crate::device::device_count())
                .map(|_| Mutex::new(None))
                .collect()
        })
        .get(ordinal)
}

/// Whether convolutions of `dtype` go to cuDNN now: enabled, loadable, a dtype it convolves.
pub(crate) fn offered(dtype: DType) -> bool {
    cudnn_enabled() && usable(dtype)
}

/// Whether cuDNN can convolve `dtype` at all, whatever the switch says: the gradients of a
/// convolution recorded through cuDNN are computed by it even if [`set_cudnn`] turned it off
/// since.
pub(crate) fn usable(dtype: DType) -> bool {
    desc::types(dtype, false).is_some() && available().is_ok()
}

/// A packed, offset-0 view of an operand: its buffer, or a packed copy of a strided or offset
/// view (module docs).
pub(crate) fn packed(buf: Arc<Buffer>, l: &Layout, dtype: DType) -> Result<Arc<Buffer>> {
    if l.offset() == 0 && l.is_contiguous() {
        return Ok(buf);
    }
    crate::ops::contiguous(&buf, l, dtype).map(Arc::new)
}

/// Whether every tensor of the convolution fits cuDNN's 32-bit descriptors and none is empty.
fn fits(dims: &[[usize; 4]]) -> bool {
    dims.iter().all(|d| {
        let n: Option<usize> = d.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        n.is_some_and(|n| n > 0 && n <= i32::MAX as usize)
    })
}

/// The device's cuDNN state (`guard`, its lock held), created on first use, its handle bound
/// to the calling thread's current stream; `None` when it does not exist yet and may not be
/// created now (a capture: module docs). The device's context must be current.
fn bound<'a>(
    guard: &'a mut Option<State>,
    dev: &'static DeviceState,
    op: &'static str,
) -> Result<Option<&'a mut State>> {
    let st = match guard {
        Some(st) => st,
        None => {
            if dev.capturing() {
                // Creating a handle allocates; not inside a capture (module docs).
                return Ok(None);
            }
            let mut h = std::ptr::null_mut();
            // SAFETY: valid out-pointer; the device's context is current (the caller's
            // contract); the handle lives as long as the process' device state.
            status(unsafe { sys::cudnnCreate(&mut h) }, op)?;
            guard.insert(State {
                handle: h,
                stream: 0,
                plans: HashMap::new(),
                graph: HashMap::new(),
                api_pick: HashMap::new(),
                fused: HashMap::new(),
                sdpa: HashMap::new(),
            })
        }
    };
    let stream = dev.stream();
    if st.stream != stream as usize {
        // SAFETY: a live handle under the lock; the stream belongs to this device's context.
        status(unsafe { sys::cudnnSetStream(st.handle, stream as _) }, op)?;
        st.stream = stream as usize;
    }
    Ok(Some(st))
}

/// One convolution call in direction `dir`: `a`, `b` are the operands (packed, on `dev`),
/// the output (of `out_dims`) is allocated here. `Ok(None)` when cuDNN is not offered for it
/// (module docs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    dev: &'static DeviceState,
    dir: Dir,
    a: &Buffer,
    b: &Buffer,
    key_dims: ([usize; 4], [usize; 4], [usize; 4]),
    out_dims: [usize; 4],
    spec: &Conv2dSpec,
    dtype: DType,
) -> Result<Option<Buffer>> {
    let (x, w, y) = key_dims;
    let on = if dir == Dir::Forward {
        offered(dtype)
    } else {
        usable(dtype)
    };
    if !on || !fits(&[x, w, y]) {
        return Ok(None);
    }
    let tf32 = crate::blas::allow_tf32();
    let Some((_, _, math)) = desc::types(dtype, tf32) else {
        return Ok(None);
    };
    let Some(slot) = slot(dev.ordinal()) else {
        return Ok(None);
    };
    dev.bind()?;
    let op = dir.op();
    let mut guard = slot.lock().unwrap_or_else(|e| e.into_inner());
    let Some(st) = bound(&mut guard, dev, op)? else {
        return Ok(None);
    };
    let key = Key {
        x,
        w,
        y,
        spec: *spec,
        dtype,
        math,
    };
    let handle = st.handle;
    let geo = match st.plans.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(v) => v.insert(Geometry::new(handle, &key)?),
    };
    if !geo.offered {
        if dir == Dir::Forward {
            return Ok(None);
        }
        return Err(Error::backend(
            op,
            format!("cuDNN has no algorithm for {key:?}"),
        ));
    }
    let out = alloc(
        dev,
        out_dims.iter().product::<usize>() * dtype.size_in_bytes(),
    )?;
    let gcall = graph::Call {
        dev,
        handle,
        key: &key,
        dir,
        ops: algo::Operands {
            a: a.device_ptr(),
            b: b.device_ptr(),
            out: out.device_ptr(),
        },
    };
    let call = pick::Call {
        dev,
        handle,
        key: &key,
        dir,
        a,
        b,
        out: &out,
    };
    let on_graph = match graph::cudnn_api().graph_for(math) {
        Some(g) => g,
        None => match st.api_pick.get(&(key, dir)) {
            Some(&g) => g,
            None if dev.capturing() => false,
            None => {
                // Both APIs measured on this call's operands; the faster kept.
                let legacy = call.best_nchw_ms(geo)?;
                let graph = gcall.best_ms(&mut st.graph)?;
                let g = matches!((graph, legacy), (Some(g), Some(l)) if g < l);
                if log_choices() {
                    eprintln!(
                        "kiln cudnn {op} {key:?}: fastest legacy {legacy:?} ms, graph {graph:?} ms: {}",
                        if g { "graph" } else { "legacy" }
                    );
                }
                st.api_pick.insert((key, dir), g);
                g
            }
        },
    };
    if on_graph && gcall.run(&mut st.graph)? {
        drop(guard);
        return finish(dev, op, out);
    }
    let format = call.choose(geo)?;
    match call.run(geo, format) {
        // NHWC's scratch (or its algorithms' workspaces) could not be had: NCHW needs none of
        // the former (its measured algorithms, or the heuristic ranking if not measured).
        Err(Error::OutOfMemory { .. }) if format == nhwc::Format::Nhwc => {
            call.run(geo, nhwc::Format::Nchw)?
        }
        r => r?,
    }
    drop(guard);
    finish(dev, op, out)
}

/// The end of a call that ran: with sync debugging on, waits for it (a capture records
/// instead of running: nothing to wait for, `graph.rs` of the crate).
fn finish(dev: &'static DeviceState, op: &'static str, out: Buffer) -> Result<Option<Buffer>> {
    if crate::device::sync_debug() && !dev.capturing() {
        dev.sync(op)?;
    }
    Ok(Some(out))
}
