//! Convolutions through cuDNN's graph (backend) API, chosen by timing as PyTorch's
//! `cudnn.benchmark` does: the path to Hopper's NHWC tensor-core engines.
//!
//! Why: asked through the legacy API (`algo.rs`), cuDNN 9 on an H100 ends on NCHW kernels
//! for kiln's NCHW tensors, and staging NHWC copies around it (`nhwc.rs`) gained ~2%. PyTorch
//! asks through the backend API, whose engines for the same NCHW tensors include
//! `sm90_xmma_*_nhwc` kernels with cuDNN's own layout transforms; on ResNet-18 those took
//! ~7.6 ms a TF32 step against ~12 ms for the legacy path's kernels.
//!
//! - **One operation graph per geometry and direction**: three tensors (`x`, `w`, `y`, with
//!   their NCHW dimensions and packed strides; groups are implied by the filter's channel
//!   count), a cross-correlation descriptor (f32 compute for f32, bf16 and f16; f64 for f64),
//!   and one forward, backward-data or backward-filter operation with alpha 1 and beta 0 (the
//!   output is overwritten, as on the legacy path).
//! - **Selection**: engine configs from heuristic mode A, then mode FALLBACK (PyTorch joins
//!   the two lists the same way), each filtered by its numerical notes (below) and made into
//!   an execution plan (one that does not finalize, or wants more workspace than the legacy
//!   search offers, is skipped), up to [`MAX_CANDIDATES`]; each plan run once to warm up, then
//!   timed [`TIMED_RUNS`] times with CUDA events on the call's own buffers; the plans kept
//!   fastest first. Later calls run the first whose workspace kiln's pool can give.
//! - **Numerical notes**, mirroring the legacy path's math types: f32 with TF32 off
//!   (`blas.rs`'s switch; FMA math on the legacy path) refuses engines noted `TENSOR_CORE`, so
//!   f32 stays true f32; engines noted `DOWN_CONVERT_INPUTS` (which would convert f32 inputs
//!   to a 16-bit type) are refused always, as PyTorch does. Nondeterministic engines are kept,
//!   as the legacy path keeps nondeterministic algorithms.
//! - **Fallback**: a geometry whose graph cuDNN refuses (or where no plan ran) is remembered
//!   as such and takes the legacy path, as does one first seen inside a CUDA graph capture
//!   (timing synchronizes), or a call for which no plan's workspace can be had. A plan
//!   measured before a capture is captured like any kernel.
//! - **Switch**: `KILN_CUDNN_API=auto|graph|legacy` (read once) or [`set_cudnn_api`]; the
//!   default `auto` takes this path where the math may use tensor cores (TF32, bf16, f16), and
//!   for f32 without TF32 and f64 whichever API's fastest measured choice is faster, per
//!   geometry and direction, as measured on an H100 (see [`CudnnApi`]).
//!   [`cudnn_graph_calls`] counts calls that ran through it, for tests and benchmarks.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptorType_t as K,
};
use kiln_core::{DType, Error, Result};

use super::algo::{Dir, Operands};
use super::backend::{self, Desc, DevPtr};
use super::desc::{Key, types};
use super::log_choices;
use crate::device::{DeviceState, time_on};
use crate::memory::alloc;

/// Which cuDNN API convolutions go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudnnApi {
    /// The graph API where the math may use tensor cores (TF32, bf16, f16); for f32 with TF32
    /// off and f64, whichever API's fastest measured choice is faster, per geometry and
    /// direction: the default. Measured on an H100 (2026-11-27, ResNet-18 step at batch 256,
    /// BENCHMARKS.md): TF32 18.28 ms legacy against 14.42 graph, bf16 21.00 against 10.61; in
    /// f32 the graph heuristics' first ten engines lost the whole step (30.59 against 23.25:
    /// the legacy search's Winograd and FFT algorithms are not among them) but won single
    /// layers (a 3-channel stem, batch 32: 0.063 ms fwd+bwd against 0.258).
    Auto,
    /// `cudnnFind*AlgorithmEx` and `cudnnConvolution*` (`algo.rs`).
    Legacy,
    /// The backend (graph) API with engine configs timed per geometry (this module); a
    /// geometry it cannot serve takes the legacy path.
    Graph,
}

impl CudnnApi {
    /// Whether a call whose math is `math` goes through the graph API: `None` when both
    /// APIs' measurements decide (`Auto` with FMA math).
    pub(super) fn graph_for(self, math: sys::cudnnMathType_t) -> Option<bool> {
        match self {
            CudnnApi::Legacy => Some(false),
            CudnnApi::Graph => Some(true),
            CudnnApi::Auto if math == sys::cudnnMathType_t::CUDNN_FMA_MATH => None,
            CudnnApi::Auto => Some(true),
        }
    }
}

static API: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1: legacy; 2: graph; 3: auto

/// `KILN_CUDNN_API`'s value as an API, and a warning for a value that is neither.
fn parse_api(v: Option<&str>) -> (CudnnApi, Option<String>) {
    match v {
        None | Some("") | Some("auto") => (CudnnApi::Auto, None),
        Some("legacy") => (CudnnApi::Legacy, None),
        Some("graph") => (CudnnApi::Graph, None),
        Some(other) => (
            CudnnApi::Auto,
            Some(format!(
                "kiln: KILN_CUDNN_API={other:?} is not auto, graph or legacy; auto"
            )),
        ),
    }
}

/// The API switch: [`set_cudnn_api`], else `KILN_CUDNN_API=auto|graph|legacy` (default `auto`;
/// another value is reported once on stderr and taken as `auto`).
pub fn cudnn_api() -> CudnnApi {
    match API.load(Ordering::Relaxed) {
        0 => {
            let env = std::env::var("KILN_CUDNN_API").ok();
            let (api, warning) = parse_api(env.as_deref());
            if let Some(w) = warning {
                eprintln!("{w}");
            }
            set_cudnn_api(api);
            api
        }
        1 => CudnnApi::Legacy,
        2 => CudnnApi::Graph,
        _ => CudnnApi::Auto,
    }
}

/// Sets the cuDNN API of the convolutions from now on, overriding `KILN_CUDNN_API`. Each API's
/// measured choices stay cached, so switching back and forth measures nothing twice.
pub fn set_cudnn_api(api: CudnnApi) {
    let v = match api {
        CudnnApi::Legacy => 1,
        CudnnApi::Graph => 2,
        CudnnApi::Auto => 3,
    };
    API.store(v, Ordering::Relaxed);
}

static GRAPH_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many cuDNN convolution calls ran through the graph API since the process started
/// (timing runs not counted): lets tests and benchmarks see which API ran.
pub fn cudnn_graph_calls() -> u64 {
    GRAPH_CALLS.load(Ordering::Relaxed)
}

/// Whether the loaded cuDNN exports the backend API's functions (checked once; cuDNN itself
/// is known to be loadable when this is asked).
pub(super) fn graph_available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let missing: Vec<&str> = backend::SYMBOLS
            .iter()
            .copied()
            // SAFETY: looks symbols up in the opened library without calling them.
            .filter(|s| {
                unsafe { sys::culib().get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err()
            })
            .collect();
        if !missing.is_empty() {
            eprintln!(
                "kiln: cuDNN lacks {}; convolutions use its legacy API",
                missing.join(", ")
            );
        }
        missing.is_empty()
    })
}

/// Execution plans timed per geometry and direction at most (heuristic order), as PyTorch's
/// benchmark mode caps its candidates (`cudnn.benchmark_limit`, 10 by default): enough for the
/// fast engines, few enough that a geometry's first call stays short (a plan may compile
/// kernels when it is finalized).
pub(super) const MAX_CANDIDATES: usize = 10;

/// Timed runs per plan after one warm-up (the fastest counts).
pub(super) const TIMED_RUNS: usize = 2;

/// The unique ids of the three tensors in every graph.
pub(super) const UID_X: i64 = 1;
pub(super) const UID_W: i64 = 2;
pub(super) const UID_Y: i64 = 3;

/// The byte alignment declared for every tensor: kiln's operands are whole pool blocks
/// (256-byte aligned), and each call checks its pointers against it ([`aligned`]).
pub(super) const ALIGNMENT: i64 = 16;

/// One tensor of the graph: unique id, dimensions and strides (in elements, NCHW order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TensorSpec {
    pub uid: i64,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
}

/// The strides of a packed tensor of `dims`.
pub(super) fn packed_strides(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// `v` as the backend API's int64.
pub(super) fn i64_of(v: usize, op: &'static str) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(op, format!("{v} exceeds cuDNN's int64")))
}

/// `x`, `w` and `y` of `key`, packed NCHW (a filter `[k, c/groups, r, s]`).
pub(super) fn tensors(key: &Key, op: &'static str) -> Result<[TensorSpec; 3]> {
    let spec = |uid, d: [usize; 4]| -> Result<TensorSpec> {
        let dims = [
            i64_of(d[0], op)?,
            i64_of(d[1], op)?,
            i64_of(d[2], op)?,
            i64_of(d[3], op)?,
        ];
        Ok(TensorSpec {
            uid,
            dims,
            strides: packed_strides(dims),
        })
    };
    Ok([
        spec(UID_X, key.x)?,
        spec(UID_W, key.w)?,
        spec(UID_Y, key.y)?,
    ])
}

/// The unique ids of a call's operands in `Operands`' order for `dir` (forward: `x`, `w`,
/// `y`; data: `w`, `dy`, `dx`; filter: `x`, `dy`, `dw`).
fn operand_uids(dir: Dir) -> [i64; 3] {
    match dir {
        Dir::Forward => [UID_X, UID_W, UID_Y],
        Dir::Data => [UID_W, UID_Y, UID_X],
        Dir::Filter => [UID_X, UID_Y, UID_W],
    }
}

/// Whether an engine with numerical `notes` may run `dtype` with TF32 `tf32` (module docs).
pub(super) fn allowed(notes: &[u32], dtype: DType, tf32: bool) -> bool {
    use sys::cudnnBackendNumericalNote_t::*;
    let has = |n: sys::cudnnBackendNumericalNote_t| notes.contains(&(n as u32));
    if has(CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) {
        return false;
    }
    !(dtype == DType::F32 && !tf32 && has(CUDNN_NUMERICAL_NOTE_TENSOR_CORE))
}

/// Whether every pointer meets the alignment the tensors declare.
pub(super) fn aligned(ptrs: &[u64]) -> bool {
    ptrs.iter().all(|p| p % ALIGNMENT as u64 == 0)
}

/// One finalized execution plan and what was learned about it.
pub(super) struct Candidate {
    pub plan: Desc,
    /// The engine config the plan was made from, kept alive with it (as cudnn-frontend's
    /// plans hold theirs).
    pub _cfg: Desc,
    pub workspace: usize,
    /// cuDNN's global engine index, and its numerical notes (for the log).
    pub engine: i64,
    pub notes: Vec<u32>,
    /// The fastest timed run, ms.
    pub time: f32,
}

impl std::fmt::Display for Candidate {
    /// `engine 12 [tensor core] 0.123 ms, 4.0 MiB`, for `KILN_CUDNN_LOG=1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use sys::cudnnBackendNumericalNote_t::*;
        let names: Vec<&str> = [
            (CUDNN_NUMERICAL_NOTE_TENSOR_CORE, "tensor core"),
            (CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC, "nondeterministic"),
            (CUDNN_NUMERICAL_NOTE_FFT, "fft"),
            (CUDNN_NUMERICAL_NOTE_WINOGRAD, "winograd"),
            (
                CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION,
                "reduced-precision reduction",
            ),
        ]
        .into_iter()
        .filter(|(n, _)| self.notes.contains(&(*n as u32)))
        .map(|(_, s)| s)
        .collect();
        let mib = self.workspace as f64 / (1 << 20) as f64;
        write!(
            f,
            "engine {} [{}] {:.3} ms, {mib:.1} MiB",
            self.engine,
            names.join(", "),
            self.time
        )
    }
}

/// One geometry and direction on the graph path: the descriptors its plans were built from
/// (kept alive with them) and the plans that ran, fastest first; none when the graph API
/// cannot serve it (the legacy path runs it then).
pub(super) struct Entry {
    _graph: Vec<Desc>,
    plans: Vec<Candidate>,
}

/// Per device: each geometry and direction seen on the graph path.
pub(super) type Cache = HashMap<(Key, Dir), Entry>;

/// What one graph-path call needs.
pub(super) struct Call<'a> {
    pub dev: &'static DeviceState,
    pub handle: sys::cudnnHandle_t,
    pub key: &'a Key,
    pub dir: Dir,
    pub ops: Operands,
}

impl Call<'_> {
    /// This geometry and direction's entry, measured first if it was not; `None` when the
    /// graph API cannot serve these operands or nothing may be measured now (a capture).
    fn entry<'c>(&self, cache: &'c mut Cache) -> Result<Option<&'c Entry>> {
        let o = self.ops;
        if !graph_available() || !aligned(&[o.a, o.b, o.out]) {
            return Ok(None);
        }
        Ok(Some(match cache.entry((*self.key, self.dir)) {
            MapEntry::Occupied(e) => e.into_mut(),
            MapEntry::Vacant(_) if self.dev.capturing() => return Ok(None),
            MapEntry::Vacant(v) => v.insert(self.measure()?),
        }))
    }

    /// The fastest plan's time for this geometry and direction, ms (measured first if it was
    /// not); `None` when the graph API cannot serve it, or nothing may be measured now (a
    /// capture).
    pub fn best_ms(&self, cache: &mut Cache) -> Result<Option<f32>> {
        Ok(self
            .entry(cache)?
            .and_then(|e| e.plans.first())
            .map(|c| c.time))
    }

    /// Runs the call through the graph API: `Ok(false)` when this geometry takes the legacy
    /// path instead (module docs), with nothing run.
    pub fn run(&self, cache: &mut Cache) -> Result<bool> {
        let Some(entry) = self.entry(cache)? else {
            return Ok(false);
        };
        // No plan, or none whose workspace could be had: the legacy path, which takes the
        // first algorithm whose workspace can be (some need none).
        run_first(&entry.plans, &GRAPH_CALLS, |c| self.execute(c))
    }

    /// Builds, filters and times the plans of this geometry and direction (synchronizes):
    /// heuristic mode A's configs in order, then mode FALLBACK's (as PyTorch joins the two
    /// lists), until [`MAX_CANDIDATES`] plans ran. A graph cuDNN refuses gives an entry
    /// without plans, not an error.
    fn measure(&self) -> Result<Entry> {
        let op = self.dir.op();
        let (graph, mut parts) = match self.build() {
            Ok(v) => v,
            Err(e @ Error::OutOfMemory { .. }) => return Err(e),
            Err(e) => {
                self.log(&[], Some(&e));
                return Ok(Entry {
                    _graph: Vec::new(),
                    plans: Vec::new(),
                });
            }
        };
        let tf32 = self.key.math != sys::cudnnMathType_t::CUDNN_FMA_MATH;
        // The legacy search's workspace cap (`algo.rs`): a plan asking for more is not timed.
        let cap = (self.dev.device().total_memory()? / 4).min(super::algo::MEASURE_WORKSPACE_CAP);
        let plans = search(
            &graph,
            (self.key.dtype, tf32),
            (cap, MAX_CANDIDATES),
            op,
            |cfg| self.plan(cfg),
            |c| time_plan(self.dev, "conv2d graph timing", || self.execute(c)),
        );
        self.log(&plans, None);
        parts.push(graph);
        Ok(Entry {
            _graph: parts,
            plans,
        })
    }

    /// The finalized operation graph of this call, and the descriptors it was built from
    /// (kept alive with the plans).
    fn build(&self) -> Result<(Desc, Vec<Desc>)> {
        let op = self.dir.op();
        let key = self.key;
        let tf32 = key.math != sys::cudnnMathType_t::CUDNN_FMA_MATH;
        let (data, compute, _) = types(key.dtype, tf32).ok_or_else(|| Error::DTypeMismatch {
            op,
            expected: "f32, f64, f16 or bf16".into(),
            got: key.dtype,
        })?;
        let [tx, tw, ty] = tensors(key, op)?;
        let (x, w, y) = (
            tensor(&tx, data, op)?,
            tensor(&tw, data, op)?,
            tensor(&ty, data, op)?,
        );
        let conv = convolution(key, compute, op)?;
        let operation = operation(self.dir, [&x, &w, &y], &conv, key.dtype, op)?;
        let graph = Desc::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, op)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, &[self.handle], op)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[operation.raw()], op)?;
        graph.finalize(op)?;
        Ok((graph, vec![x, w, y, conv, operation]))
    }

    /// An execution plan of `cfg` (an error when it does not finalize).
    fn plan(&self, cfg: &Desc) -> Result<Desc> {
        plan(self.handle, cfg, self.dir.op())
    }

    /// Queues plan `c` on the handle's stream ([`execute`]).
    fn execute(&self, c: &Candidate) -> Result<()> {
        let o = self.ops;
        let io = (&operand_uids(self.dir)[..], &[o.a, o.b, o.out][..]);
        execute(self.dev, self.handle, c, io, self.dir.op())
    }

    /// `KILN_CUDNN_LOG=1`: the plans measured, fastest first (the first runs), or why the
    /// graph path refused the geometry.
    fn log(&self, plans: &[Candidate], err: Option<&Error>) {
        if !log_choices() {
            return;
        }
        let k = self.key;
        let what = match err {
            Some(e) => format!("not served ({e}), legacy path"),
            None if plans.is_empty() => "no plan ran, legacy path".into(),
            None => plans
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        };
        eprintln!(
            "kiln cudnn graph {} x {:?} w {:?} {:?} {:?}: {what}",
            self.dir.op(),
            k.x,
            k.w,
            k.dtype,
            k.math,
        );
    }
}

/// A finalized tensor descriptor of `t` in `data`.
pub(super) fn tensor(t: &TensorSpec, data: sys::cudnnDataType_t, op: &'static str) -> Result<Desc> {
    let d = Desc::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR, op)?;
    d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, &[data], op)?;
    d.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &t.dims, op)?;
    d.set(A::CUDNN_ATTR_TENSOR_STRIDES, &t.strides, op)?;
    d.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[t.uid], op)?;
    d.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT], op)?;
    d.finalize(op)?;
    Ok(d)
}

/// A finalized cross-correlation descriptor of `key`'s padding, stride and dilation (groups
/// are implied by the tensors' channel counts).
pub(super) fn convolution(
    key: &Key,
    compute: sys::cudnnDataType_t,
    op: &'static str,
) -> Result<Desc> {
    let s = &key.spec;
    let pair = |v: [usize; 2]| -> Result<[i64; 2]> { Ok([i64_of(v[0], op)?, i64_of(v[1], op)?]) };
    let (pad, stride, dil) = (pair(s.padding)?, pair(s.stride)?, pair(s.dilation)?);
    let d = Desc::new(K::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, op)?;
    d.set(A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, &[compute], op)?;
    d.set(
        A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
        op,
    )?;
    d.set(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2i64], op)?;
    d.set(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, &dil, op)?;
    d.set(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &stride, op)?;
    d.set(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &pad, op)?;
    d.set(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &pad, op)?;
    d.finalize(op)?;
    Ok(d)
}

/// The attribute names of `dir`'s operation: its descriptor kind, then the attributes of `x`,
/// `w`, `y` (or their gradients), the convolution, alpha and beta.
fn operation_attrs(dir: Dir) -> (K, [A; 6]) {
    match dir {
        Dir::Forward => (
            K::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ],
        ),
        Dir::Data => (
            K::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
            ],
        ),
        Dir::Filter => (
            K::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
            ],
        ),
    }
}

/// A finalized convolution operation for `dir` on tensors `[x, w, y]`: alpha 1, beta 0, as
/// doubles for f64 data and floats otherwise (cuDNN's scaling types).
pub(super) fn operation(
    dir: Dir,
    [x, w, y]: [&Desc; 3],
    conv: &Desc,
    dtype: DType,
    op: &'static str,
) -> Result<Desc> {
    let (kind, [ax, aw, ay, ac, aa, ab]) = operation_attrs(dir);
    let d = Desc::new(kind, op)?;
    d.set_desc(ax, x, op)?;
    d.set_desc(aw, w, op)?;
    d.set_desc(ay, y, op)?;
    d.set_desc(ac, conv, op)?;
    if dtype == DType::F64 {
        d.set(aa, &[1.0f64], op)?;
        d.set(ab, &[0.0f64], op)?;
    } else {
        d.set(aa, &[1.0f32], op)?;
        d.set(ab, &[0.0f32], op)?;
    }
    d.finalize(op)?;
    Ok(d)
}

/// Queues plan `c` on `handle`'s stream (bound by the caller, under the device's cuDNN lock)
/// with the operands `(uids, ptrs)` (device addresses of live buffers of the graph's shapes)
/// and a workspace of the plan's size from the pool, freed stream-ordered once queued. What
/// `graph.rs`'s convolutions and `fused.rs`'s fused graph both run.
pub(super) fn execute(
    dev: &'static DeviceState,
    handle: sys::cudnnHandle_t,
    c: &Candidate,
    (uids, ptrs): (&[i64], &[u64]),
    op: &'static str,
) -> Result<()> {
    // At most four operands (x, w, bias, y): no allocation per call.
    if ptrs.len() > 4 || ptrs.len() != uids.len() {
        return Err(Error::invalid(
            op,
            format!("{} operand ids for {} pointers", uids.len(), ptrs.len()),
        ));
    }
    let mut dev_ptrs = [DevPtr(std::ptr::null_mut()); 4];
    for (d, &p) in dev_ptrs.iter_mut().zip(ptrs) {
        *d = DevPtr(p as *mut c_void);
    }
    execute_pack(dev, handle, c, (uids, &dev_ptrs[..ptrs.len()]), op)
}

/// [`execute`] with the variant pack's pointers as given: device addresses, or host addresses
/// of by-value scalars (`sdpa.rs`), which must outlive the call (cuDNN reads them when the plan
/// is queued).
pub(super) fn execute_pack(
    dev: &'static DeviceState,
    handle: sys::cudnnHandle_t,
    c: &Candidate,
    (uids, ptrs): (&[i64], &[DevPtr]),
    op: &'static str,
) -> Result<()> {
    let ws = if c.workspace == 0 {
        None
    } else {
        Some(alloc(dev, c.workspace)?)
    };
    let wsp = DevPtr(ws.as_ref().map_or(0, |b| b.device_ptr()) as *mut c_void);
    let pack = Desc::new(K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, op)?;
    pack.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids, op)?;
    pack.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, ptrs, op)?;
    pack.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[wsp], op)?;
    pack.finalize(op)?;
    let _prof = crate::profile::launch(dev, op, true);
    // SAFETY: a live handle bound to the current stream and a finalized plan built on it,
    // under the device's cuDNN lock (the caller's); the variant pack names live device buffers
    // of the graph's shapes and host scalars that outlive the call (the caller's contract), and
    // a workspace of the plan's size, freed stream-ordered after the call is queued.
    let r = unsafe { sys::cudnnBackendExecute(handle, c.plan.raw(), pack.raw()) };
    super::status(r, op)
}

/// An execution plan of engine config `cfg` on `handle` (an error when it does not finalize).
pub(super) fn plan(handle: sys::cudnnHandle_t, cfg: &Desc, op: &'static str) -> Result<Desc> {
    let plan = Desc::new(K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, op)?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, &[handle], op)?;
    plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg, op)?;
    plan.finalize(op)?;
    Ok(plan)
}

/// Runs the first of `plans` (fastest first) whose workspace can be had, counting the call in
/// `calls`: `Ok(false)` when none could (nothing ran; the caller takes its other path).
pub(super) fn run_first(
    plans: &[Candidate],
    calls: &AtomicU64,
    execute: impl Fn(&Candidate) -> Result<()>,
) -> Result<bool> {
    for c in plans {
        match execute(c) {
            Ok(()) => {
                calls.fetch_add(1, Ordering::Relaxed);
                return Ok(true);
            }
            // Its workspace cannot be had now: the next (slower) plan may need less.
            Err(Error::OutOfMemory { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// One warm-up `run`, then the fastest of [`TIMED_RUNS`] timed ones on `dev`'s stream, ms.
pub(super) fn time_plan(
    dev: &'static DeviceState,
    what: &'static str,
    run: impl Fn() -> Result<()>,
) -> Result<f32> {
    run()?;
    let mut best = f32::INFINITY;
    for _ in 0..TIMED_RUNS {
        best = best.min(time_on(dev.stream(), what, &run)?);
    }
    Ok(best)
}

/// The plans of `graph`, filtered and timed, fastest first (synchronizes): heuristic mode A's
/// configs in order, then mode FALLBACK's (as PyTorch joins the two lists), until `max`
/// plans ran ([`MAX_CANDIDATES`] for convolutions). Configs whose numerical notes `dtype` and `tf32` do not allow
/// ([`allowed`]) are skipped, as are plans that `plan` does not finalize and plans asking for
/// more than `cap` bytes of workspace; a plan that `time` cannot run is dropped. What
/// `graph.rs`'s convolutions and `fused.rs`'s fused graph both search.
pub(super) fn search(
    graph: &Desc,
    (dtype, tf32): (DType, bool),
    (cap, max): (usize, usize),
    op: &'static str,
    plan: impl Fn(&Desc) -> Result<Desc>,
    time: impl Fn(&Candidate) -> Result<f32>,
) -> Vec<Candidate> {
    let mut plans = Vec::new();
    for mode in [
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        // A mode that fails leaves the next one to try.
        let Ok(configs) = heuristic(graph, mode, op) else {
            continue;
        };
        for cfg in configs {
            if plans.len() == max {
                break;
            }
            let Ok((engine, notes)) = engine_of(&cfg, op) else {
                continue;
            };
            if !allowed(&notes, dtype, tf32) {
                continue;
            }
            // A config that does not finalize here is skipped.
            let Ok(plan) = plan(&cfg) else { continue };
            let mut ws = [0i64];
            if plan
                .get(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, &mut ws, op)
                .is_err()
            {
                continue;
            }
            let workspace = ws[0].max(0) as usize;
            if workspace > cap {
                continue;
            }
            let mut c = Candidate {
                plan,
                _cfg: cfg,
                workspace,
                engine,
                notes,
                time: f32::INFINITY,
            };
            // A plan that does not run here (its workspace, or cuDNN refusing) is dropped.
            if let Ok(t) = time(&c) {
                c.time = t;
                plans.push(c);
            }
        }
        if plans.len() == max {
            break;
        }
    }
    plans.sort_by(|a, b| a.time.total_cmp(&b.time));
    plans
}

/// The engine configs heuristic `mode` lists for `graph`, best first.
pub(super) fn heuristic(
    graph: &Desc,
    mode: sys::cudnnBackendHeurMode_t,
    op: &'static str,
) -> Result<Vec<Desc>> {
    let heur = Desc::new(K::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, op)?;
    heur.set_desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, op)?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, &[mode], op)?;
    heur.finalize(op)?;
    let n = heur.count(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        op,
    )?;
    heur.get_descs(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
        n,
        op,
    )
}

/// The global index and numerical notes of `cfg`'s engine.
pub(super) fn engine_of(cfg: &Desc, op: &'static str) -> Result<(i64, Vec<u32>)> {
    let engine = cfg
        .get_descs(
            A::CUDNN_ATTR_ENGINECFG_ENGINE,
            K::CUDNN_BACKEND_ENGINE_DESCRIPTOR,
            1,
            op,
        )?
        .pop()
        .ok_or_else(|| Error::backend(op, "engine config without an engine"))?;
    let notes = engine.get_enums(
        A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        Ty::CUDNN_TYPE_NUMERICAL_NOTE,
        sys::cudnnBackendNumericalNote_t::CUDNN_NUMERICAL_NOTE_TYPE_COUNT as usize,
        op,
    )?;
    let mut index = [0i64];
    engine.get(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &mut index, op)?;
    Ok((index[0], notes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::Conv2dSpec;

    fn key(dtype: DType) -> Key {
        Key {
            x: [2, 4, 9, 8],
            w: [6, 2, 3, 3],
            y: [2, 6, 5, 4],
            spec: Conv2dSpec {
                stride: [2, 2],
                padding: [1, 1],
                dilation: [1, 1],
                groups: 2,
            },
            dtype,
            math: sys::cudnnMathType_t::CUDNN_FMA_MATH,
        }
    }

    #[test]
    fn the_switch_reads_auto_graph_and_legacy() {
        assert_eq!(parse_api(None), (CudnnApi::Auto, None));
        assert_eq!(parse_api(Some("")), (CudnnApi::Auto, None));
        assert_eq!(parse_api(Some("auto")), (CudnnApi::Auto, None));
        assert_eq!(parse_api(Some("legacy")), (CudnnApi::Legacy, None));
        assert_eq!(parse_api(Some("graph")), (CudnnApi::Graph, None));
        let (api, warning) = parse_api(Some("Graph"));
        assert_eq!(api, CudnnApi::Auto);
        assert!(warning.unwrap().contains("KILN_CUDNN_API"));
    }

    /// Packed NCHW strides, and a grouped filter's own channel count (cuDNN infers the groups
    /// from `x`'s channels over `w`'s).
    #[test]
    fn the_tensors_are_packed_nchw() {
        let [x, w, y] = tensors(&key(DType::F32), "conv2d").unwrap();
        assert_eq!(x.dims, [2, 4, 9, 8]);
        assert_eq!(x.strides, [288, 72, 8, 1]);
        assert_eq!(w.dims, [6, 2, 3, 3]);
        assert_eq!(w.strides, [18, 9, 3, 1]);
        assert_eq!(y.strides, [120, 20, 4, 1]);
        assert_eq!([x.uid, w.uid, y.uid], [UID_X, UID_W, UID_Y]);
    }

    /// The variant pack's ids follow the operand order of each direction (`algo::Operands`):
    /// a swap here would run, for instance, dgrad with `dy` read as the filter.
    #[test]
    fn the_operand_ids_follow_each_direction() {
        assert_eq!(operand_uids(Dir::Forward), [UID_X, UID_W, UID_Y]);
        assert_eq!(operand_uids(Dir::Data), [UID_W, UID_Y, UID_X]);
        assert_eq!(operand_uids(Dir::Filter), [UID_X, UID_Y, UID_W]);
        // And each operation names its tensors in the order `operation` passes them.
        use A::*;
        let (_, f) = operation_attrs(Dir::Forward);
        assert_eq!(
            f[..3],
            [
                CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y
            ]
        );
        let (_, d) = operation_attrs(Dir::Data);
        assert_eq!(
            d[..3],
            [
                CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY
            ]
        );
        let (_, w) = operation_attrs(Dir::Filter);
        assert_eq!(
            w[..3],
            [
                CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY
            ]
        );
    }

    /// Tensor-core engines only with TF32 on for f32; always for 16-bit data and f64;
    /// down-converting engines never.
    #[test]
    fn tensor_core_engines_need_tf32_for_f32() {
        use sys::cudnnBackendNumericalNote_t::*;
        let tc = [CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32];
        assert!(!allowed(&tc, DType::F32, false));
        assert!(allowed(&tc, DType::F32, true));
        assert!(allowed(&tc, DType::BF16, false));
        assert!(allowed(&tc, DType::F16, false));
        assert!(allowed(&tc, DType::F64, false));
        assert!(allowed(&[], DType::F32, false));
        let nd = [CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32];
        assert!(allowed(&nd, DType::F32, false));
        let down = [
            CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32,
            CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS as u32,
        ];
        assert!(!allowed(&down, DType::F32, true));
        assert!(!allowed(&down, DType::BF16, true));
    }

    #[test]
    fn misaligned_pointers_take_the_legacy_path() {
        assert!(aligned(&[0, 256, 4096]));
        assert!(!aligned(&[256, 260, 512]));
    }
}
