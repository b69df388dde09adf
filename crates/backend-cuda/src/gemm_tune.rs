//! Matrix products timed once per shape: cuBLAS's default kernel or one of cuBLASLt's
//! algorithms, whichever runs fastest, as `cudnn.benchmark` does for convolutions.
//!
//! Why: for one shape `cublasSgemm`/`cublasGemmEx` run one kernel of cuBLAS's choosing;
//! cuBLASLt's heuristics offer several (split-K kernels with a workspace among them), and for
//! some of a transformer's products another is much faster. H200, 2026-11-28, the GPT's
//! products at 16384 tokens of width 384: the f32 weight gradient `[1152, 16384] · [16384,
//! 384]` 424 µs through `cublasSgemm`, 302 µs for Lt's first heuristic with a 32 MiB
//! workspace; TF32 `[1536, 16384] · [16384, 384]` 131 → 106 µs; bf16 `[16384, 384] ·
//! [384, 1152]` 31 → 25 µs; the iteration's 75 linear products 3.6% (f32), 5.3% (TF32) and
//! 8.5% (bf16) faster with each shape's fastest algorithm, and the GPT iteration with this
//! module 2.0% (f32), 2.2% (TF32) and 0.6% (bf16) faster (BENCHMARKS.md).
//!
//! - **Which products**: one matrix (batch 1) of f32 (TF32 or not), f16 or bf16 on
//!   `blas.rs`'s cuBLAS route; batched products and f64 keep cuBLAS.
//! - **First sight of a shape** (dtype, TF32, transposes, m, n, k, leading dimensions, the
//!   operands' address alignment): cuBLAS's product and up to [`CANDIDATES`] of Lt's
//!   heuristic algorithms (with at most [`MAX_WORKSPACE`] of workspace) are timed with CUDA
//!   events on the call's own buffers, back to back as training runs them, in turns
//!   (`time_all`; this synchronizes, once per shape); Lt's fastest is kept where it beats
//!   cuBLAS by [`MARGIN`]. The last run is the call's result, computed again by the choice.
//! - **Inside a CUDA graph capture** nothing is timed: an unseen shape runs cuBLAS and is
//!   measured at its next call outside a capture. A measured choice is captured like any
//!   launch (its workspace is a pool block, as cuDNN's are).
//! - **Switch**: `KILN_CUDA_GEMM_TUNE=0` (read once) or [`set_gemm_tuning`]`(GemmTuning::Off)`:
//!   every product through cuBLAS's default, as before; `lt` ([`GemmTuning::Lt`]) takes Lt's
//!   fastest wherever it has one (tests, comparisons). A tuned product's bits can differ from the
//!   default's (another kernel sums in another order), and between processes where timings
//!   choose differently, as with cuDNN's benchmark mode; within a process a shape keeps its
//!   choice. Lt's reductions for split-K are deterministic (sequenced by counters), so a choice
//!   gives the same bits on every call.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::sys as cb;
use cudarc::cublaslt::{result as lt, sys as lts};
use kiln_core::{DType, Error, Result};

use crate::device::{DeviceState, time_on};
use crate::memory::alloc;

const OP: &str = "matmul";

/// One product in cuBLAS's column-major terms: row-major `C = A·B` computed as column-major
/// `Cᵀ = Bᵀ·Aᵀ` (`blas.rs`'s module docs), so `b` comes first in every call. Built by
/// `blas.rs` (`Gemm::new`); here because the tuner below `blas.rs` reads it.
pub(crate) struct Gemm {
    pub(crate) op_a: cb::cublasOperation_t,
    pub(crate) op_b: cb::cublasOperation_t,
    /// Rows and columns of the row-major product, and the inner dimension.
    pub(crate) m: i32,
    pub(crate) n: i32,
    pub(crate) k: i32,
    pub(crate) lda: i32,
    pub(crate) ldb: i32,
    pub(crate) batch: usize,
    pub(crate) batch_i32: i32,
    /// Batch strides in elements (0 broadcasts), the output's included.
    pub(crate) sa: i64,
    pub(crate) sb: i64,
    pub(crate) sc: i64,
    /// Device addresses of the operands' first elements and of the output.
    pub(crate) pa: u64,
    pub(crate) pb: u64,
    pub(crate) pc: u64,
}

/// Lt's heuristic algorithms timed per shape.
const CANDIDATES: usize = 8;
/// Runs of a candidate between two timing events (after one untimed run), per round.
const TIMED_RUNS: usize = 4;
/// Rounds over all candidates; each keeps its fastest.
const ROUNDS: usize = 2;
/// The most workspace an Lt algorithm may ask for (PyTorch's cuBLAS workspace on Hopper).
const MAX_WORKSPACE: usize = 32 << 20;
/// Lt's algorithm is kept only when it takes at most this fraction of cuBLAS's time.
const MARGIN: f32 = 0.97;

/// How matrix products choose their kernel (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmTuning {
    /// cuBLAS's default kernel for every product (`KILN_CUDA_GEMM_TUNE=0`).
    Off,
    /// cuBLAS or cuBLASLt's fastest algorithm, measured once per shape: the default.
    Timed,
    /// cuBLASLt's fastest algorithm wherever Lt has one, however cuBLAS compares
    /// (`KILN_CUDA_GEMM_TUNE=lt`): for tests and comparisons.
    Lt,
}

static MODE: AtomicU8 = AtomicU8::new(0); // 0: read the environment; else 1 + GemmTuning

/// How products choose their kernel now: [`set_gemm_tuning`]'s last choice, else
/// `KILN_CUDA_GEMM_TUNE` (`0`, `lt`; anything else or unset: [`GemmTuning::Timed`]).
pub fn gemm_tuning() -> GemmTuning {
    const MODES: [GemmTuning; 3] = [GemmTuning::Off, GemmTuning::Timed, GemmTuning::Lt];
    match MODE.load(Ordering::Relaxed) {
        0 => {
            let mode = match std::env::var("KILN_CUDA_GEMM_TUNE").as_deref() {
                Ok("0") => GemmTuning::Off,
                Ok("lt") => GemmTuning::Lt,
                _ => GemmTuning::Timed,
            };
            set_gemm_tuning(mode);
            mode
        }
        v => MODES[(v - 1) as usize],
    }
}

/// Sets how products choose their kernel, for the whole process. A shape measured under
/// [`GemmTuning::Timed`] and one under [`GemmTuning::Lt`] are remembered apart.
pub fn set_gemm_tuning(mode: GemmTuning) {
    MODE.store(1 + mode as u8, Ordering::Relaxed);
}

/// Products that ran through a tuned Lt algorithm (for tests and benchmarks).
static LT_CALLS: AtomicU64 = AtomicU64::new(0);

/// Products this process ran through a tuned cuBLASLt algorithm.
pub fn tuned_gemm_calls() -> u64 {
    LT_CALLS.load(Ordering::Relaxed)
}

/// What a shape was measured to run fastest with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    dtype: DType,
    tf32: bool,
    ops: (i32, i32),
    mnk: (i32, i32, i32),
    ld: (i32, i32),
    /// Alignment of the two operands' and the output's addresses, bytes (at most 256).
    align: [u16; 3],
    /// Measured under [`GemmTuning::Lt`] (Lt kept whatever cuBLAS's time).
    lt_always: bool,
}

/// An Lt algorithm with the descriptors it runs with, kept for the process.
struct LtPlan {
    descs: Descs,
    algo: lts::cublasLtMatmulAlgo_t,
    workspace: usize,
}

/// The device's Lt handle (created on first use, with its context current; kept for the
/// process' lifetime); `blas_lt.rs`'s epilogues use it too.
pub(crate) fn lt_handle(dev: &DeviceState) -> Result<lts::cublasLtHandle_t> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    let map = HANDLES.get_or_init(Default::default);
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&h) = map.get(&dev.ordinal()) {
        return Ok(h as lts::cublasLtHandle_t);
    }
    dev.bind()?;
    let h = lt::create_handle().map_err(lt_err)?;
    map.insert(dev.ordinal(), h as usize);
    Ok(h)
}

/// Measured choices: `None` for cuBLAS's default.
type Cache = HashMap<Key, Option<Arc<LtPlan>>>;

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Runs `g` with the algorithm measured fastest for its shape (measuring it first where it is
/// new): `Ok(true)` when Lt ran it, `Ok(false)` when the caller should run cuBLAS (`cublas`,
/// which also serves the measurement).
pub(crate) fn run_tuned(
    dev: &'static DeviceState,
    g: &Gemm,
    dtype: DType,
    tf32: bool,
    cublas: &dyn Fn() -> Result<()>,
) -> Result<bool> {
    if g.batch != 1 || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Ok(false);
    }
    let key = Key {
        ordinal: dev.ordinal(),
        dtype,
        tf32: tf32 && dtype == DType::F32,
        ops: (g.op_a as i32, g.op_b as i32),
        mnk: (g.m, g.n, g.k),
        ld: (g.lda, g.ldb),
        align: [align(g.pa), align(g.pb), align(g.pc)],
        lt_always: gemm_tuning() == GemmTuning::Lt,
    };
    let known = cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .cloned();
    let plan = match known {
        Some(p) => p,
        None if dev.capturing() => return Ok(false),
        None => {
            // Measured outside the lock (it synchronizes); where another thread stored this
            // shape's choice meanwhile, that one is kept and this one dropped. On the side
            // stream the current stream's product may still be running: wait for the whole
            // device first, so that the candidates are timed alone.
            if dev.streams().is_side(dev.stream()) {
                dev.sync_all(OP)?;
            }
            let p = measure(dev, g, &key, cublas).unwrap_or(None).map(Arc::new);
            let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
            match c.entry(key) {
                Entry::Occupied(e) => e.get().clone(),
                Entry::Vacant(v) => v.insert(p).clone(),
            }
        }
    };
    let Some(plan) = plan else {
        return Ok(false);
    };
    let _prof = crate::profile::launch(dev, OP, true);
    run_lt(dev, g, &plan)?;
    LT_CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(true)
}

/// The largest power of two (at most 256) that divides a device address.
fn align(p: u64) -> u16 {
    1 << p.trailing_zeros().min(8)
}

/// Times cuBLAS and Lt's candidates on the call's buffers; `Some(plan)` where Lt's fastest
/// beats cuBLAS by [`MARGIN`] (under [`GemmTuning::Lt`], wherever Lt has a candidate). Errors
/// of Lt mean "cuBLAS" (`None`), never a failed product.
fn measure(
    dev: &'static DeviceState,
    g: &Gemm,
    key: &Key,
    cublas: &dyn Fn() -> Result<()>,
) -> Result<Option<LtPlan>> {
    // SAFETY: only dlopens libcublasLt by its candidate names.
    if !unsafe { lts::is_culib_present() } {
        return Ok(None);
    }
    let descs = new_descs(key)?;
    let algos = candidates(dev, key, &descs)?;
    let ws = algos.iter().map(|&(_, w)| w).max().unwrap_or(0);
    let buf = if ws > 0 { Some(alloc(dev, ws)?) } else { None };
    let wsp = buf.as_ref().map_or(0, |b| b.device_ptr());
    let lt_runs: Vec<_> = algos
        .iter()
        .map(|(algo, w)| {
            let descs = &descs;
            move || lt_call(dev, g, descs, algo, (wsp, *w))
        })
        .collect();
    // cuBLAS first (unless Lt is kept whatever it costs), then Lt's candidates.
    let mut runs: Vec<&dyn Fn() -> Result<()>> = Vec::with_capacity(1 + lt_runs.len());
    if !key.lt_always {
        runs.push(cublas);
    }
    runs.extend(lt_runs.iter().map(|r| r as &dyn Fn() -> Result<()>));
    let times = time_all(dev, &runs)?;
    drop(buf);
    let (base, lt_times) = match key.lt_always {
        true => (f32::INFINITY, &times[..]),
        false => (times[0].unwrap_or(f32::INFINITY), &times[1..]),
    };
    let best = lt_times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (t, i)))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    Ok(match best {
        Some((t, i)) if t <= MARGIN * base => Some(LtPlan {
            descs,
            algo: algos[i].0,
            workspace: algos[i].1,
        }),
        _ => None,
    })
}

/// Each of `runs`' time per run, ms (`None` where it failed: a candidate Lt refuses), measured
/// as training runs a product: back to back on a busy stream. A round times every candidate
/// in turn, [`TIMED_RUNS`] runs between two events after one untimed run that keeps the GPU
/// busy while the host enqueues them, so neither the host's launch cost (cuBLAS's is larger
/// than Lt's) nor an idle GPU's start counts; each candidate keeps its fastest of [`ROUNDS`]
/// rounds, taken in turn so that a clock still rising favours none. (Before, cuBLAS was timed
/// alone first and every figure was one synchronized run, launch cost included. Timed so, the
/// GPT's products measure alike in every process: cuBLAS and Lt's first candidate, the same
/// kernel, within 0.3 %, H200, 2026-11-29.)
fn time_all(
    dev: &'static DeviceState,
    runs: &[&dyn Fn() -> Result<()>],
) -> Result<Vec<Option<f32>>> {
    let mut best: Vec<Option<f32>> = vec![Some(f32::INFINITY); runs.len()];
    for _ in 0..ROUNDS {
        for (run, b) in runs.iter().zip(best.iter_mut()) {
            let Some(t) = *b else { continue };
            let timed = run().and_then(|()| {
                time_on(dev.stream(), OP, || (0..TIMED_RUNS).try_for_each(|_| run()))
            });
            *b = match timed {
                Ok(ms) => Some(t.min(ms / TIMED_RUNS as f32)),
                // A failure after a run that worked is the device's, not the candidate's.
                Err(e) if t.is_finite() => return Err(e),
                Err(_) => None,
            };
        }
    }
    Ok(best)
}

/// Lt's heuristic algorithms for `key`'s product described by `descs`, with their workspace
/// sizes (those asking for more than [`MAX_WORKSPACE`] left out).
fn candidates(
    dev: &'static DeviceState,
    key: &Key,
    descs: &Descs,
) -> Result<Vec<(lts::cublasLtMatmulAlgo_t, usize)>> {
    let h = lt_handle(dev)?;
    let mut results: [lts::cublasLtMatmulHeuristicResult_t; CANDIDATES] =
        // SAFETY: a plain C struct of integers and floats, for which all-zero is a valid value.
        unsafe { std::mem::zeroed() };
    let mut count = 0i32;
    let pref = Pref::new(key)?;
    let [a, b, c] = descs.layouts;
    // SAFETY: live descriptors of the caller's; `results` holds CANDIDATES entries and `count`
    // receives how many were written.
    let status = unsafe {
        lts::cublasLtMatmulAlgoGetHeuristic(
            h,
            descs.desc,
            a,
            b,
            c,
            c,
            pref.0,
            CANDIDATES as i32,
            results.as_mut_ptr(),
            &mut count,
        )
    };
    if status != lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(Vec::new());
    }
    Ok(results
        .iter()
        .take(count.max(0) as usize)
        .filter(|r| {
            r.state == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && r.workspaceSize <= MAX_WORKSPACE
        })
        .map(|r| (r.algo, r.workspaceSize))
        .collect())
}

/// An Lt matmul descriptor and layouts for one shape (destroyed on drop).
struct Descs {
    desc: lts::cublasLtMatmulDesc_t,
    /// A (kiln's `b`), B (kiln's `a`), C = D (the output), in Lt's column-major terms.
    layouts: [lts::cublasLtMatrixLayout_t; 3],
}

// SAFETY: host objects that Lt only reads once they are built; kiln never changes them after
// `new_descs`, and destroys them once, on drop (a kept plan's live as long as the process).
unsafe impl Send for Descs {}
// SAFETY: as above: shared reads only.
unsafe impl Sync for Descs {}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was created by Lt below and is destroyed once; null ones are skipped.
        unsafe {
            for &l in &self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

fn lt_err(e: lt::CublasError) -> Error {
    Error::backend(OP, format!("cuBLASLt: {e:?}"))
}

/// The descriptors of `key`'s product in Lt's column-major terms: kiln's row-major `C = A·B`
/// is `Cᵀ = Bᵀ·Aᵀ`, the same call `blas.rs` makes of cuBLAS (`b` first, output `[n, m]`).
fn new_descs(key: &Key) -> Result<Descs> {
    use lts::cublasComputeType_t as Ct;
    use lts::cudaDataType as Dt;
    let (data, compute) = match (key.dtype, key.tf32) {
        (DType::F32, true) => (Dt::CUDA_R_32F, Ct::CUBLAS_COMPUTE_32F_FAST_TF32),
        (DType::F32, false) => (Dt::CUDA_R_32F, Ct::CUBLAS_COMPUTE_32F),
        (DType::F16, _) => (Dt::CUDA_R_16F, Ct::CUBLAS_COMPUTE_32F),
        _ => (Dt::CUDA_R_16BF, Ct::CUBLAS_COMPUTE_32F),
    };
    let mut d = Descs {
        desc: std::ptr::null_mut(),
        layouts: [std::ptr::null_mut(); 3],
    };
    d.desc = lt::create_matmul_desc(compute, Dt::CUDA_R_32F).map_err(lt_err)?;
    let (op_a, op_b) = key.ops;
    let (m, n, k) = (key.mnk.0 as u64, key.mnk.1 as u64, key.mnk.2 as u64);
    let (lda, ldb) = (key.ld.0 as i64, key.ld.1 as i64);
    {
        use lts::cublasLtMatmulDescAttributes_t as A;
        let set = |a: A, v: &i32| {
            // SAFETY: `v` points at a live i32, the C type of the transpose attributes.
            unsafe { lt::set_matmul_desc_attribute(d.desc, a, v as *const i32 as *const c_void, 4) }
                .map_err(lt_err)
        };
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, &op_b)?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, &op_a)?;
    }
    let n_op = 0; // CUBLAS_OP_N
    // Lt's A is kiln's `b` (op(A) is [n, k]), B is kiln's `a` (op(B) is [k, m]), C is [n, m].
    let shapes = [
        if op_b == n_op {
            (n, k, ldb)
        } else {
            (k, n, ldb)
        },
        if op_a == n_op {
            (k, m, lda)
        } else {
            (m, k, lda)
        },
        (n, m, n as i64),
    ];
    for (slot, (r, c, ld)) in d.layouts.iter_mut().zip(shapes) {
        *slot = lt::create_matrix_layout(data, r, c, ld).map_err(lt_err)?;
    }
    Ok(d)
}

/// The search preference: workspace cap and the operands' actual alignment (Lt assumes 256
/// bytes unless told).
struct Pref(lts::cublasLtMatmulPreference_t);

impl Pref {
    fn new(key: &Key) -> Result<Pref> {
        use lts::cublasLtMatmulPreferenceAttributes_t as P;
        let p = Pref(lt::create_matmul_pref().map_err(lt_err)?);
        let set = |a: P, v: *const c_void, size: usize| {
            // SAFETY: `v` points at a live value of `size` bytes, the attribute's C type.
            unsafe { lt::set_matmul_pref_attribute(p.0, a, v, size) }.map_err(lt_err)
        };
        let ws = MAX_WORKSPACE as u64;
        set(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as _,
            8,
        )?;
        let [al_a, al_b, al_c] = key.align.map(u32::from);
        // Lt's A is kiln's `b`, B is kiln's `a`; C and D are the output.
        for (attr, v) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c),
        ] {
            set(attr, &v as *const u32 as _, 4)?;
        }
        Ok(p)
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by Lt in `new` and destroyed once, here.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.0);
        }
    }
}

/// Runs `g` with `plan`, its workspace a pool block freed stream-ordered after the call.
fn run_lt(dev: &'static DeviceState, g: &Gemm, plan: &LtPlan) -> Result<()> {
    let ws = if plan.workspace > 0 {
        Some(alloc(dev, plan.workspace)?)
    } else {
        None
    };
    let ptr = ws.as_ref().map_or(0, |b| b.device_ptr());
    lt_call(dev, g, &plan.descs, &plan.algo, (ptr, plan.workspace))
}

/// One `cublasLtMatmul` of `g` with `descs` and `algo`, and a workspace `(address, size)`
/// (address 0: none) of at least the algorithm's size, on the device's current stream.
fn lt_call(
    dev: &'static DeviceState,
    g: &Gemm,
    descs: &Descs,
    algo: &lts::cublasLtMatmulAlgo_t,
    (ws, size): (u64, usize),
) -> Result<()> {
    let h = lt_handle(dev)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let [a, b, c] = descs.layouts;
    // SAFETY: the descriptors describe `g`'s operands (the key matched their shapes, leading
    // dimensions, transposes and alignment), whose buffers are live device memory of this
    // context; the output is `g`'s fresh buffer of n·m elements; the workspace is a live block
    // of at least the algorithm's `size` bytes (or none when that is 0); alpha and beta are f32
    // host scalars alive for the call (scale type f32); queued on the caller's current stream.
    unsafe {
        lt::matmul(
            h,
            descs.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            g.pb as *const c_void,
            a,
            g.pa as *const c_void,
            b,
            g.pc as *const c_void,
            c,
            g.pc as *mut c_void,
            c,
            algo,
            ws as *mut c_void,
            if ws == 0 { 0 } else { size },
            dev.stream() as lts::cudaStream_t,
        )
    }
    .map_err(lt_err)
}
