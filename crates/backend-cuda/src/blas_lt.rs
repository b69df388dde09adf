//! A linear layer's product with its bias and activation in cuBLASLt's epilogue
//! ([`kiln_core::Backend::linear_epilogue`]): `BIAS`, `RELU_BIAS`, `GELU_BIAS` (tanh GELU),
//! and `GELU_AUX_BIAS` when the backward needs the pre-activation.
//!
//! # Status: opt-in
//!
//! Off unless [`set_lt_epilogues`]`(true)` or `KILN_CUDA_LT_EPILOGUE=1`. Its GPU test
//! (`tests/linear_epilogue.rs`) passes; measured on an H100 (2026-11-27, MLP 784-4096×3-10 at
//! batch 4096, BENCHMARKS.md) it made the bf16 step 1.5 % faster and the f32 step 5 % slower
//! than the composed path (no Lt workspace is passed yet, which may limit Lt's algorithm
//! choice), so it stays opt-in. The backward is composed from kiln's
//! own kernels ([`kiln_core::epilogue_composed`]): the activation's derivative from the saved
//! output (ReLU) or pre-activation (GELU), two products and a column sum. Lt's backward
//! epilogues (`DRELU_BGRAD`, `DGELU_BGRAD`, `BGRADB`) are not used yet.
//!
//! # Layout
//!
//! Lt is column-major. The row-major `y [m, n] = x [m, k] · wᵀ` is the column-major
//! `yᵀ [n, m] = op(A) · B` with `A` = `w` read as a column-major `[k, n]` (op T) and `B` = `x`
//! read as a column-major `[k, m]` (op N); the bias runs along `yᵀ`'s rows, as Lt's bias does.
//! Declined (the caller composes): f64 and integer dtypes, the exact GELU, no bias, a bias of
//! another dtype, operands that are not row-contiguous, and `k` or `n` not a multiple of
//! 16 bytes of elements (Lt's alignment for vectorized epilogues), or pointers not 16-byte
//! aligned.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::cublaslt::{result as lt, sys as lts};
use kiln_core::backend::Operand;
use kiln_core::epilogue::{EpilogueGrads, EpilogueOutputs};
use kiln_core::epilogue_composed::linear_epilogue_backward_composed;
use kiln_core::{Activation, DType, Error, Layout, Result};

use crate::lazy::Repr;
use crate::memory::{Buffer, alloc};
use crate::storage::CudaStorage;
use crate::types::Cuda;

const OP: &str = "linear_epilogue";

static ON: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1: off; 2: on

/// Whether `Backend::linear_epilogue` is offered on CUDA (module docs; off by default).
pub fn lt_epilogues() -> bool {
    match ON.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_CUDA_LT_EPILOGUE").is_ok_and(|v| v == "1");
            ON.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Offers (or stops offering) the cuBLASLt epilogue path for the whole process.
pub fn set_lt_epilogues(on: bool) {
    ON.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// The epilogue for `act`, or `None` when Lt has none.
fn epilogue(act: Activation, aux: bool) -> Option<lts::cublasLtEpilogue_t> {
    use lts::cublasLtEpilogue_t as E;
    match (act, aux) {
        (Activation::Identity, _) => Some(E::CUBLASLT_EPILOGUE_BIAS),
        // ReLU's backward reads its output: no aux.
        (Activation::Relu, _) => Some(E::CUBLASLT_EPILOGUE_RELU_BIAS),
        (Activation::GeluTanh, false) => Some(E::CUBLASLT_EPILOGUE_GELU_BIAS),
        (Activation::GeluTanh, true) => Some(E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS),
        (Activation::Gelu, _) => None,
    }
}

/// The operand's buffer and first element's address when its rows are contiguous (`[r, c]`,
/// strides `[c, 1]`) and 16-byte aligned.
fn rows(o: Operand<'_, CudaStorage>, dtype: DType) -> Result<Option<(Arc<Buffer>, u64)>> {
    let l: &Layout = o.1;
    if !l.is_contiguous() {
        return Ok(None);
    }
    let buf = o.0.buffer()?;
    let ptr = buf.device_ptr() + (l.offset() * dtype.size_in_bytes()) as u64;
    Ok(ptr.is_multiple_of(16).then_some((buf, ptr)))
}

/// RAII for Lt descriptors: destroyed when the call returns, whatever happens.
struct Descs {
    desc: lts::cublasLtMatmulDesc_t,
    layouts: Vec<lts::cublasLtMatrixLayout_t>,
    pref: lts::cublasLtMatmulPreference_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each handle was created by Lt for this call and is destroyed once; a null
        // one (never created) is skipped.
        unsafe {
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
            if !self.pref.is_null() {
                let _ = lt::destroy_matmul_pref(self.pref);
            }
        }
    }
}

/// Sets one attribute of the matmul descriptor from a value.
fn set_desc<T>(
    d: lts::cublasLtMatmulDesc_t,
    a: lts::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `v` points at a live `T` of `size_of::<T>()` bytes, the attribute's C type.
    let r = unsafe {
        lt::set_matmul_desc_attribute(d, a, v as *const T as *const c_void, size_of::<T>())
    };
    r.map_err(|e| Error::backend(OP, format!("{e:?}")))
}

/// The fused forward, or `Ok(None)` where it is declined (module docs).
pub(crate) fn linear_epilogue(
    x: Operand<'_, CudaStorage>,
    w: Operand<'_, CudaStorage>,
    bias: Option<(Operand<'_, CudaStorage>, DType)>,
    dtype: DType,
    act: Activation,
    keep_aux: bool,
) -> Result<Option<EpilogueOutputs<CudaStorage>>> {
    use lts::cublasLtMatmulDescAttributes_t as A;
    if !lt_epilogues() {
        return Ok(None);
    }
    let (data, compute) = match dtype {
        DType::F32 if crate::blas::allow_tf32() => (
            lts::cudaDataType::CUDA_R_32F,
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        DType::F32 => (
            lts::cudaDataType::CUDA_R_32F,
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F16 => (
            lts::cudaDataType::CUDA_R_16F,
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::BF16 => (
            lts::cudaDataType::CUDA_R_16BF,
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        _ => return Ok(None),
    };
    let need_aux = keep_aux && act == Activation::GeluTanh;
    let Some(epi) = epilogue(act, need_aux) else {
        return Ok(None);
    };
    let Some(((bs, bl), bd)) = bias else {
        return Ok(None);
    };
    let ([m, k], [n, k2]) = (x.1.dims(), w.1.dims()) else {
        return Ok(None);
    };
    let (m, k, n) = (*m, *k, *n);
    let align = 16 / dtype.size_in_bytes();
    // The GELU aux matrix's leading dimension (n) must be a multiple of 8 as well.
    let aux_ok = !need_aux || n.is_multiple_of(8);
    if !aux_ok
        || *k2 != k
        || bd != dtype
        || !k.is_multiple_of(align)
        || !n.is_multiple_of(align)
        || m == 0
        || k == 0
    {
        return Ok(None);
    }
    // SAFETY: only dlopens libcublasLt by its candidate names.
    if !unsafe { lts::is_culib_present() } {
        return Ok(None);
    }
    let (Some((xb, xp)), Some((wb, wp)), Some((bb, bp))) =
        (rows(x, dtype)?, rows(w, dtype)?, rows((bs, bl), dtype)?)
    else {
        return Ok(None);
    };
    let dev = xb.state();
    let h = crate::gemm_tune::lt_handle(dev)?;
    dev.bind()?;
    let size = dtype.size_in_bytes();
    let out = alloc(dev, m * n * size)?;
    let aux = if need_aux {
        Some(alloc(dev, m * n * size)?)
    } else {
        None
    };
    let err = |e: lt::CublasError| Error::backend(OP, format!("{e:?}"));
    let mut d = Descs {
        desc: std::ptr::null_mut(),
        layouts: Vec::new(),
        pref: std::ptr::null_mut(),
    };
    d.desc = lt::create_matmul_desc(compute, lts::cudaDataType::CUDA_R_32F).map_err(err)?;
    let (op_t, op_n): (i32, i32) = (1, 0); // CUBLAS_OP_T, CUBLAS_OP_N
    set_desc(d.desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op_t)?;
    set_desc(d.desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op_n)?;
    set_desc(d.desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
    let bias_ptr = bp as *const c_void;
    set_desc(d.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr)?;
    if let Some(a) = &aux {
        let aux_ptr = a.device_ptr() as *mut c_void;
        set_desc(
            d.desc,
            A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &aux_ptr,
        )?;
        set_desc(d.desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(n as i64))?;
    }
    // A = w as column-major [k, n]; B = x as column-major [k, m]; C = D = yᵀ [n, m].
    for (r, c) in [(k, n), (k, m), (n, m)] {
        let l = lt::create_matrix_layout(data, r as u64, c as u64, r as i64).map_err(err)?;
        d.layouts.push(l);
    }
    d.pref = lt::create_matmul_pref().map_err(err)?;
    let (la, lb, lc) = (d.layouts[0], d.layouts[1], d.layouts[2]);
    // SAFETY: live descriptors of this call; the heuristic only reads them.
    let heur = unsafe { lt::get_matmul_algo_heuristic(h, d.desc, la, lb, lc, lc, d.pref) };
    let Ok(heur) = heur else {
        return Ok(None); // no algorithm for this epilogue and shape: compose
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the operands' buffers (`xb`, `wb`, `bb`) and the outputs are live device memory
    // of this context, of the sizes the layouts describe (checked above: row-contiguous
    // `[m, k]`, `[n, k]`, `[n]`; fresh `[m, n]`); no workspace is passed (size 0); the call is
    // queued on the caller's current stream, after the work that wrote the operands.
    unsafe {
        lt::matmul(
            h,
            d.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            wp as *const c_void,
            la,
            xp as *const c_void,
            lb,
            out.device_ptr() as *const c_void,
            lc,
            out.device_ptr() as *mut c_void,
            lc,
            &heur.algo,
            std::ptr::null_mut(),
            0,
            dev.stream() as lts::cudaStream_t,
        )
        .map_err(err)?;
    }
    drop((xb, wb, bb));
    let out = Arc::new(out);
    let aux = match (keep_aux, aux) {
        (_, Some(a)) => Some(CudaStorage::ready(a)),
        // ReLU's backward reads its output: the same buffer, shared as a tensor's clone is.
        (true, None) if act == Activation::Relu => {
            Some(CudaStorage::from(Repr::Ready(out.clone())))
        }
        _ => None,
    };
    let out = CudaStorage::from(Repr::Ready(out));
    Ok(Some(EpilogueOutputs { out, aux }))
}

/// The backward of [`linear_epilogue`], composed from kiln's kernels (module docs): Lt's
/// backward epilogues are not used yet.
pub(crate) fn linear_epilogue_backward(
    x: Operand<'_, CudaStorage>,
    w: Operand<'_, CudaStorage>,
    aux: Option<&CudaStorage>,
    g: Operand<'_, CudaStorage>,
    dtype: DType,
    bias_dtype: Option<DType>,
    act: Activation,
) -> Result<Option<EpilogueGrads<CudaStorage>>> {
    linear_epilogue_backward_composed::<Cuda>(x, w, aux, g, dtype, bias_dtype, act).map(Some)
}
