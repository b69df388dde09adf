//! Matrix products: through cuBLAS (`sgemm`/`dgemm`, strided batched) or, where a shape was
//! measured faster that way, one of cuBLASLt's algorithms (`gemm_tune.rs`); for one output row
//! or column and for small products, through kiln's own kernels of `reduce.cu`.
//!
//! The trait hands us `[batch, m, k] x [batch, k, n]` with each matrix row- or column-major
//! and any batch stride (0 broadcasts). cuBLAS is column-major, so we compute the row-major
//! `C = A B` as the column-major `C^T = B^T A^T`: a row-major operand is, read column-major,
//! already its transpose (op N), and a column-major one needs op T. No operand is copied.
//!
//! TF32 is off by default, as in PyTorch: f32 products are full f32. Turn it on with
//! [`set_allow_tf32`] or `KILN_ALLOW_TF32=1`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::cublas::sys as cb;
use cudarc::driver::sys;
use kiln_core::{DType, Error, Layout, Result};

use crate::device::{Blas, DeviceState, check};
use crate::gemm_tune::Gemm;
use crate::launch::Args;
use crate::memory::{Buffer, alloc};
use crate::sources::Module;

static TF32: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1: off; 2: on

/// Whether f32 matmuls may use TF32 tensor cores (faster, ~10-bit mantissa products).
pub fn allow_tf32() -> bool {
    match TF32.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_ALLOW_TF32").is_ok_and(|v| v == "1");
            TF32.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Allows or forbids TF32 for f32 matmuls (default: forbidden, unless `KILN_ALLOW_TF32=1`).
pub fn set_allow_tf32(on: bool) {
    TF32.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

fn blas_check(r: cb::cublasStatus_t, op: &'static str) -> Result<()> {
    r.result().map_err(|e| Error::backend(op, format!("{e:?}")))
}

/// Whether matrix-vector products use our kernels (`KILN_CUDA_MATVEC=0`: always cuBLAS).
fn matvec_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    env_switch(&ON, "KILN_CUDA_MATVEC")
}

/// An on/off switch of the environment, read once into `cell`: on unless `var` is `0`.
fn env_switch(cell: &'static OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// The device address of an operand's first element (its buffer plus the layout's offset).
fn operand_ptr(buf: &Buffer, l: &Layout, dtype: DType) -> u64 {
    buf.device_ptr() + (l.offset() * dtype.size_in_bytes()) as u64
}

/// One product with a single output row or column (`m == 1` or `n == 1`, one batch), as one
/// `matvec_*` kernel of `reduce.cu`: `y[i] = Σ_j A[i, j] x[j]`, where for `n == 1` A is `a`
/// and x the column `b`, and for `m == 1` A is `bᵀ` and x the row `a`. Used for inner
/// dimensions up to 16K (or many outputs); longer sums go to cuBLAS, which splits them.
fn matvec(
    dev: &DeviceState,
    (a, la): (&Buffer, &Layout),
    (b, lb): (&Buffer, &Layout),
    out: &Buffer,
    dtype: DType,
) -> Result<()> {
    const OP: &str = "matmul";
    let (m, k, n) = (la.dims()[1], la.dims()[2], lb.dims()[2]);
    let (sa, sb) = (la.strides(), lb.strides());
    let at = |s: &Buffer, l: &Layout| operand_ptr(s, l, dtype);
    // (matrix pointer, row stride, column stride, vector pointer, vector stride, rows)
    let (pm, rs, cs, pv, vs, rows) = if n == 1 {
        (at(a, la), sa[1], sa[2], at(b, lb), sb[1], m)
    } else {
        (at(b, lb), sb[2], sb[1], at(a, la), sa[2], n)
    };
    let t = crate::ops::tname(dtype);
    let mut args = Args::new();
    args.push(pm).push(rs as u64).push(cs as u64);
    args.push(pv)
        .push(vs as u64)
        .push(out.device_ptr())
        .push(rows as u64)
        .push(k as u64);
    // A warp per output when A's rows are contiguous or there are few outputs; else columns.
    let (name, grid, block) = if cs == 1 || rows < 32 {
        (
            "matvec_rows",
            (rows as u64).div_ceil(8).min(1 << 20) as u32,
            256,
        )
    } else {
        ("matvec_cols", (rows as u64).div_ceil(32) as u32, 512)
    };
    crate::ops::run(
        dev,
        OP,
        Module::Reduce,
        &[name, t],
        (grid, 1),
        block,
        0,
        &mut args,
    )
}

/// Whether small products use our kernel (`KILN_CUDA_SMALL_GEMM=0`: always cuBLAS).
fn small_gemm_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    env_switch(&ON, "KILN_CUDA_SMALL_GEMM")
}

/// Products up to this many multiply-adds go to `gemm_small` (about 128³): there cuBLAS's
/// host work per call is several times the device time, and a loop of small products (d2l's
/// 100×100 matmul exercise, a small MLP's hidden layer) is bound by it.
const SMALL_GEMM_MACS: usize = 1 << 21;

/// One `gemm_small_*` launch of `reduce.cu` (see there): any operand strides, contiguous out.
fn gemm_small(
    dev: &DeviceState,
    (a, la): (&Buffer, &Layout),
    (b, lb): (&Buffer, &Layout),
    out: &Buffer,
    dtype: DType,
) -> Result<()> {
    let (batch, m, k, n) = (la.dims()[0], la.dims()[1], la.dims()[2], lb.dims()[2]);
    let (sa, sb) = (la.strides(), lb.strides());
    let tiles_m = m.div_ceil(16) as u64;
    let mut args = Args::new();
    args.push(operand_ptr(a, la, dtype))
        .push(sa[1] as u64)
        .push(sa[2] as u64)
        .push(sa[0] as u64);
    args.push(operand_ptr(b, lb, dtype))
        .push(sb[1] as u64)
        .push(sb[2] as u64)
        .push(sb[0] as u64);
    args.push(out.device_ptr())
        .push(m as u64)
        .push(n as u64)
        .push(k as u64)
        .push(tiles_m);
    let grid = (n.div_ceil(16) as u32, (batch as u64 * tiles_m) as u32);
    let t = crate::ops::tname(dtype);
    crate::ops::run(
        dev,
        "matmul",
        Module::Reduce,
        &["gemm_small", t],
        grid,
        256,
        0,
        &mut args,
    )
}

/// The device's cuBLAS handle in `guard` (created on first use), bound to `stream` and set to
/// the TF32 mode asked for.
fn ready_handle(guard: &mut Option<Blas>, stream: sys::CUstream, tf32: bool) -> Result<&mut Blas> {
    const OP: &str = "matmul";
    if guard.is_none() {
        // SAFETY: only dlopens libcublas by its candidate names.
        if !unsafe { cb::is_culib_present() } {
            return Err(Error::backend(OP, "libcublas not found"));
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle is kept for the process' lifetime and bound to
        // the caller's current stream below, before every call.
        unsafe {
            blas_check(cb::cublasCreate_v2(&mut h), OP)?;
            blas_check(
                cb::cublasSetMathMode(h, cb::cublasMath_t::CUBLAS_DEFAULT_MATH),
                OP,
            )?;
        }
        *guard = Some(Blas {
            handle: h,
            tf32: false,
            stream: 0,
        });
    }
    let blas = guard.as_mut().unwrap();
    if blas.stream != stream as usize {
        // SAFETY: a live handle, used under the lock; the stream belongs to its context.
        blas_check(
            unsafe { cb::cublasSetStream_v2(blas.handle, stream as _) },
            OP,
        )?;
        blas.stream = stream as usize;
    }
    if blas.tf32 != tf32 {
        let mode = if tf32 {
            cb::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cb::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: a live handle, used under the lock.
        blas_check(unsafe { cb::cublasSetMathMode(blas.handle, mode) }, OP)?;
        blas.tf32 = tf32;
    }
    Ok(blas)
}

fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(op, format!("dimension {v} exceeds cuBLAS's i32")))
}

/// `Backend::matmul` over computed buffers: `[batch, m, k] x [batch, k, n]` into a fresh
/// contiguous `[batch, m, n]`. Empty products are an empty or zeroed buffer; the rest goes to
/// the first route that takes it: [`matvec`], [`gemm_small`], else cuBLAS ([`cublas_gemm`]).
pub(crate) fn matmul(
    a: &Buffer,
    la: &Layout,
    b: &Buffer,
    lb: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    const OP: &str = "matmul";
    if a.state().ordinal() != b.state().ordinal() {
        return Err(Error::DeviceMismatch {
            op: OP,
            lhs: a.device().to_string(),
            rhs: b.device().to_string(),
        });
    }
    let dev: &'static DeviceState = a.state();
    dev.bind()?;
    let (batch, m, k) = (la.dims()[0], la.dims()[1], la.dims()[2]);
    let n = lb.dims()[2];
    let size = dtype.size_in_bytes();
    let out = alloc(dev, batch * m * n * size)?;
    if batch == 0 || m == 0 || n == 0 {
        return Ok(out);
    }
    if k == 0 {
        // SAFETY: the range is exactly `out`.
        check(
            unsafe {
                sys::cuMemsetD8Async(out.device_ptr(), 0, batch * m * n * size, dev.stream())
            },
            OP,
        )?;
        return Ok(out);
    }
    let tf32 = allow_tf32();
    match route(dtype, (batch, m, k, n), tf32) {
        Route::Matvec => matvec(dev, (a, la), (b, lb), &out, dtype)?,
        Route::Small => gemm_small(dev, (a, la), (b, lb), &out, dtype)?,
        Route::Cublas => {
            let g = Gemm::new((a, la), (b, lb), &out, dtype)?;
            cublas_gemm(dev, &g, dtype, tf32)?;
        }
    }
    Ok(out)
}

/// Which kernel computes a non-empty product.
enum Route {
    /// One output row or column: [`matvec`].
    Matvec,
    /// A small product: [`gemm_small`].
    Small,
    /// cuBLAS: [`cublas_gemm`].
    Cublas,
}

/// The route of a non-empty `[batch, m, k] x [batch, k, n]` product of `dtype`.
fn route(dtype: DType, (batch, m, k, n): (usize, usize, usize, usize), tf32: bool) -> Route {
    let vector = batch == 1 && (m == 1 || n == 1) && matvec_on();
    // (The 16-bit floats have no matvec kernel: cuBLAS's GemmEx does them.)
    if vector && !dtype.is_half() && (k <= 1 << 14 || m.max(n) >= 1 << 10) {
        return Route::Matvec;
    }
    // With TF32 allowed the product is cuBLAS's (tensor cores), whatever its size.
    let small = batch.saturating_mul(m).saturating_mul(n).saturating_mul(k) <= SMALL_GEMM_MACS
        && batch as u64 * m.div_ceil(16) as u64 <= 65_535
        && !tf32;
    if small && small_gemm_on() && matches!(dtype, DType::F32 | DType::F64) {
        return Route::Small;
    }
    Route::Cublas
}

impl Gemm {
    /// The layout decisions: a row-major operand (unit column stride) is op N with its row
    /// stride as leading dimension, any other op T with its column stride. Dimensions must
    /// fit cuBLAS's `i32`.
    fn new(
        (a, la): (&Buffer, &Layout),
        (b, lb): (&Buffer, &Layout),
        out: &Buffer,
        dtype: DType,
    ) -> Result<Gemm> {
        const OP: &str = "matmul";
        let (batch, m, k) = (la.dims()[0], la.dims()[1], la.dims()[2]);
        let n = lb.dims()[2];
        let layout = |l: &Layout| {
            let s = l.strides();
            if s[2] == 1 {
                (cb::cublasOperation_t::CUBLAS_OP_N, s[1].max(1))
            } else {
                (cb::cublasOperation_t::CUBLAS_OP_T, s[2].max(1))
            }
        };
        let (op_a, lda) = layout(la);
        let (op_b, ldb) = layout(lb);
        Ok(Gemm {
            op_a,
            op_b,
            m: int(OP, m)?,
            n: int(OP, n)?,
            k: int(OP, k)?,
            lda: int(OP, lda)?,
            ldb: int(OP, ldb)?,
            batch,
            batch_i32: int(OP, batch)?,
            sa: la.strides()[0] as i64,
            sb: lb.strides()[0] as i64,
            sc: (m * n) as i64,
            pa: operand_ptr(a, la, dtype),
            pb: operand_ptr(b, lb, dtype),
            pc: out.device_ptr(),
        })
    }
}

/// Runs `g` on the current stream: through the algorithm measured fastest for its shape where
/// that is one of cuBLASLt's ([`gemm_tune`](crate::gemm_tune)), else with the device's cuBLAS
/// handle: the f32/f64 entry points ([`gemm_float`]) or, for f16/bf16, `cublasGemmEx`
/// ([`gemm_half`]); other dtypes are an error. With `KILN_CUDA_SYNC=1`, waits for it.
fn cublas_gemm(dev: &'static DeviceState, g: &Gemm, dtype: DType, tf32: bool) -> Result<()> {
    const OP: &str = "matmul";
    let cublas = || -> Result<()> {
        let stream = dev.stream();
        let mut guard = dev.blas(stream);
        let blas = ready_handle(&mut guard, stream, tf32)?;
        let status = match dtype {
            DType::F32 | DType::F64 => gemm_float(blas.handle, g, dtype),
            DType::F16 | DType::BF16 => gemm_half(blas.handle, g, dtype),
            d => {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: "f32, f64, f16 or bf16".into(),
                    got: d,
                });
            }
        };
        blas_check(status, OP)
    };
    let tuned = crate::gemm_tune::gemm_tuning() != crate::gemm_tune::GemmTuning::Off
        && crate::gemm_tune::run_tuned(dev, g, dtype, tf32, &cublas)?;
    if !tuned {
        let _prof = crate::profile::launch(dev, OP, true);
        cublas()?;
    }
    // A capture records instead of running: nothing to wait for (graph.rs).
    if crate::device::sync_debug() && !dev.capturing() {
        dev.sync(OP)?;
    }
    Ok(())
}

/// One f32 or f64 GEMM: the plain entry point for one matrix (what PyTorch's `mm` calls;
/// cuBLAS's heuristics for the batched one can pick other kernels), strided batched otherwise.
fn gemm_float(h: cb::cublasHandle_t, g: &Gemm, dtype: DType) -> cb::cublasStatus_t {
    macro_rules! gemm {
        ($t:ty, $plain:ident, $batched:ident) => {{
            let (alpha, beta): ($t, $t) = (1.0, 0.0);
            let (pa, pb, pc) = (g.pa as *const $t, g.pb as *const $t, g.pc as *mut $t);
            // SAFETY: pointers and leading dimensions describe the operands' layouts (the
            // trait's contract); the output holds batch * m * n elements; the handle runs on
            // the caller's current stream, under the device's cuBLAS lock.
            unsafe {
                if g.batch == 1 {
                    cb::$plain(
                        h, g.op_b, g.op_a, g.n, g.m, g.k, &alpha, pb, g.ldb, pa, g.lda, &beta, pc,
                        g.n,
                    )
                } else {
                    cb::$batched(
                        h,
                        g.op_b,
                        g.op_a,
                        g.n,
                        g.m,
                        g.k,
                        &alpha,
                        pb,
                        g.ldb,
                        g.sb,
                        pa,
                        g.lda,
                        g.sa,
                        &beta,
                        pc,
                        g.n,
                        g.sc,
                        g.batch_i32,
                    )
                }
            }
        }};
    }
    match dtype {
        DType::F32 => gemm!(f32, cublasSgemm_v2, cublasSgemmStridedBatched),
        _ => gemm!(f64, cublasDgemm_v2, cublasDgemmStridedBatched),
    }
}

/// One f16 or bf16 GEMM through `cublasGemmEx` (strided batched for several matrices):
/// 16-bit operands and result, f32 accumulation and f32 alpha/beta (CUBLAS_COMPUTE_32F):
/// tensor cores, one rounding of each f32 dot product.
fn gemm_half(h: cb::cublasHandle_t, g: &Gemm, dtype: DType) -> cb::cublasStatus_t {
    use std::ffi::c_void;
    let t = if dtype == DType::F16 {
        cb::cudaDataType::CUDA_R_16F
    } else {
        cb::cudaDataType::CUDA_R_16BF
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let alpha = &alpha as *const f32 as *const c_void;
    let beta = &beta as *const f32 as *const c_void;
    let (pa, pb) = (g.pa as *const c_void, g.pb as *const c_void);
    let pc = g.pc as *mut c_void;
    let compute = cb::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    let algo = cb::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
    // SAFETY: as for `gemm_float`: the handle is bound to the current stream; the operand
    // ranges (offsets, leading dimensions, batch strides from the layouts) lie inside their
    // buffers, the output is a fresh buffer of batch·m·n elements of the 16-bit type `t`, and
    // alpha/beta are f32 host scalars alive for the call, as CUBLAS_COMPUTE_32F requires.
    unsafe {
        if g.batch == 1 {
            cb::cublasGemmEx(
                h, g.op_b, g.op_a, g.n, g.m, g.k, alpha, pb, t, g.ldb, pa, t, g.lda, beta, pc, t,
                g.n, compute, algo,
            )
        } else {
            cb::cublasGemmStridedBatchedEx(
                h,
                g.op_b,
                g.op_a,
                g.n,
                g.m,
                g.k,
                alpha,
                pb,
                t,
                g.ldb,
                g.sb,
                pa,
                t,
                g.lda,
                g.sa,
                beta,
                pc,
                t,
                g.n,
                g.sc,
                g.batch_i32,
                compute,
                algo,
            )
        }
    }
}
