//! The ops over 16-bit floats that are not elementwise: each converts its 16-bit operands to
//! f32 (exact), runs the f32 kernel (f32 accumulation in reductions, sgemm for products) and
//! rounds the result to the 16-bit type once. One path for f16 and bf16, around the f32
//! kernels, rather than a copy of each kernel per type. (Elementwise 16-bit ops run in the
//! fused evaluator instead: see `elementwise.rs`.)

use kiln_core::{DType, Layout, ReduceOp, Result};

use crate::elementwise::cast;
use crate::storage::CpuStorage;
use crate::{index, matmul, reduce, softmax};

/// `s` (of 16-bit `dtype`, read through `l`) as a contiguous f32 storage and its layout.
fn widen(s: &CpuStorage, l: &Layout, dtype: DType) -> Result<(CpuStorage, Layout)> {
    Ok((
        cast(s, l, dtype, DType::F32)?,
        Layout::contiguous(l.shape().clone()),
    ))
}

/// A contiguous f32 result of `shape` rounded to `dtype`.
fn round(s: CpuStorage, l: &Layout, dtype: DType) -> Result<CpuStorage> {
    cast(&s, l, DType::F32, dtype)
}

/// A reduction of 16-bit values: in f32, the sum accumulated as f32 sums are (in f64), the
/// result rounded once (indices of `argmax`/`argmin` as they are).
pub(crate) fn reduce(
    op: ReduceOp,
    s: &CpuStorage,
    l: &Layout,
    dtype: DType,
    axes: &[usize],
) -> Result<CpuStorage> {
    let (w, wl) = widen(s, l, dtype)?;
    let out = reduce::reduce(op, &w, &wl, DType::F32, axes)?;
    if op.is_arg() {
        return Ok(out);
    }
    let mut dims = l.dims().to_vec();
    for &a in axes {
        dims[a] = 1;
    }
    round(out, &Layout::contiguous(dims), dtype)
}

/// A batched product `[b, m, k] x [b, k, n]` of 16-bit matrices: sgemm, then one rounding.
pub(crate) fn matmul(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    let (wa, wla) = widen(a, la, dtype)?;
    let (wb, wlb) = widen(b, lb, dtype)?;
    let out = matmul::matmul(&wa, &wla, &wb, &wlb, DType::F32)?;
    let (da, db) = (la.dims(), lb.dims());
    let shape = [da[0], da[1], db.get(2).copied().unwrap_or(0)];
    round(out, &Layout::contiguous(shape), dtype)
}

/// `softmax` / `log_softmax` of 16-bit rows, in f32.
pub(crate) fn softmax(s: &CpuStorage, l: &Layout, dtype: DType, log: bool) -> Result<CpuStorage> {
    let (w, wl) = widen(s, l, dtype)?;
    let out = softmax::softmax(&w, &wl, DType::F32, log)?;
    round(out, &wl, dtype)
}

/// Cross-entropy of 16-bit logits (and its backward, given `grad`), in f32.
pub(crate) fn cross_entropy(
    logits: &CpuStorage,
    ll: &Layout,
    labels: &CpuStorage,
    yl: &Layout,
    grad: Option<(&CpuStorage, &Layout)>,
    dtype: DType,
) -> Result<CpuStorage> {
    let (w, wl) = widen(logits, ll, dtype)?;
    let g = grad.map(|(g, gl)| widen(g, gl, dtype)).transpose()?;
    let g = g.as_ref().map(|(g, gl)| (g, gl));
    let out = softmax::cross_entropy(&w, &wl, labels, yl, g, DType::F32)?;
    let shape = if grad.is_some() {
        ll.shape().clone()
    } else {
        ll.dims()[..1].to_vec().into()
    };
    round(out, &Layout::contiguous(shape), dtype)
}

/// `scatter_add` into 16-bit values: in f32, each output rounded once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_add(
    base: &CpuStorage,
    bl: &Layout,
    dtype: DType,
    ids: &CpuStorage,
    il: &Layout,
    src: &CpuStorage,
    sl: &Layout,
    axis: usize,
) -> Result<CpuStorage> {
    let (wb, wbl) = widen(base, bl, dtype)?;
    let (ws, wsl) = widen(src, sl, dtype)?;
    let out = index::scatter_add(&wb, &wbl, DType::F32, ids, il, &ws, &wsl, axis)?;
    round(out, &wbl, dtype)
}
