//! The reference's building blocks: gathering strided storage into row-major values, typed
//! conversions, multi-indices, and the scalar functions of the op tables at f64.

use super::RefStorage;
use crate::backend::{BinaryOp, HostBuffer, UnaryOp};
use crate::{DType, Error, Layout, Result};

/// The elements of `buf` at `pos`, in order, as a new buffer of the same dtype.
pub(super) fn take(buf: &HostBuffer, pos: impl Iterator<Item = usize>) -> HostBuffer {
    match buf {
        HostBuffer::F32(v) => HostBuffer::F32(pos.map(|i| v[i]).collect()),
        HostBuffer::F64(v) => HostBuffer::F64(pos.map(|i| v[i]).collect()),
        HostBuffer::I64(v) => HostBuffer::I64(pos.map(|i| v[i]).collect()),
        HostBuffer::U8(v) => HostBuffer::U8(pos.map(|i| v[i]).collect()),
        HostBuffer::F16(v) => HostBuffer::F16(pos.map(|i| v[i]).collect()),
        HostBuffer::BF16(v) => HostBuffer::BF16(pos.map(|i| v[i]).collect()),
    }
}

/// `on_true[i]` where `cond[i] != 0`, else `on_false[i]` (buffers of one dtype and length).
pub(super) fn select(cond: &[u8], on_true: &HostBuffer, on_false: &HostBuffer) -> HostBuffer {
    // Positions into `on_true` followed by `on_false`.
    let n = cond.len();
    let both = concat(on_true, on_false);
    take(&both, (0..n).map(|i| if cond[i] != 0 { i } else { n + i }))
}

/// `a` followed by `b` (one dtype).
fn concat(a: &HostBuffer, b: &HostBuffer) -> HostBuffer {
    fn cat<T: Clone>(a: &[T], b: &[T]) -> Vec<T> {
        a.iter().chain(b).cloned().collect()
    }
    match (a, b) {
        (HostBuffer::F32(a), HostBuffer::F32(b)) => HostBuffer::F32(cat(a, b)),
        (HostBuffer::F64(a), HostBuffer::F64(b)) => HostBuffer::F64(cat(a, b)),
        (HostBuffer::I64(a), HostBuffer::I64(b)) => HostBuffer::I64(cat(a, b)),
        (HostBuffer::U8(a), HostBuffer::U8(b)) => HostBuffer::U8(cat(a, b)),
        (HostBuffer::F16(a), HostBuffer::F16(b)) => HostBuffer::F16(cat(a, b)),
        (HostBuffer::BF16(a), HostBuffer::BF16(b)) => HostBuffer::BF16(cat(a, b)),
        _ => unreachable!("one dtype (checked by gather)"),
    }
}

/// The elements of `layout` in row-major order, checked against the storage's dtype and size.
pub(super) fn gather(
    op: &'static str,
    s: &RefStorage,
    layout: &Layout,
    dtype: DType,
) -> Result<HostBuffer> {
    if s.data.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op,
            expected: format!("the storage's dtype {}", s.data.dtype()),
            got: dtype,
        });
    }
    if layout.storage_extent() > s.data.len() {
        return Err(Error::invalid(
            op,
            format!(
                "layout (shape {}, strides {:?}, offset {}) reaches past a storage of {} elements",
                layout.shape(),
                layout.strides(),
                layout.offset(),
                s.data.len()
            ),
        ));
    }
    Ok(take(&s.data, layout.offsets()))
}

/// Float values widened to f64 (exact).
pub(super) fn floats(op: &'static str, b: &HostBuffer) -> Result<Vec<f64>> {
    match b {
        HostBuffer::F32(_) | HostBuffer::F64(_) | HostBuffer::F16(_) | HostBuffer::BF16(_) => {
            Ok(b.to_f64_vec())
        }
        _ => Err(unsupported(op, b.dtype())),
    }
}

/// Integer values widened to i64 (exact).
pub(super) fn ints(b: &HostBuffer) -> Vec<i64> {
    match b {
        HostBuffer::I64(v) => v.clone(),
        HostBuffer::U8(v) => v.iter().map(|&x| x as i64).collect(),
        HostBuffer::F32(v) => v.iter().map(|&x| x as i64).collect(),
        HostBuffer::F64(v) => v.iter().map(|&x| x as i64).collect(),
        HostBuffer::F16(v) => v.iter().map(|x| x.to_f64() as i64).collect(),
        HostBuffer::BF16(v) => v.iter().map(|x| x.to_f64() as i64).collect(),
    }
}

/// f64 results stored as `dtype`: rounded once for f32, f16 and bf16 (the reference states what
/// the type can hold).
pub(super) fn float_out(dtype: DType, v: &[f64]) -> HostBuffer {
    HostBuffer::from_f64(dtype, v)
}

/// Exact i64 results stored as `dtype` (`I64` or `U8`; values already in range).
pub(super) fn int_out(dtype: DType, v: Vec<i64>) -> HostBuffer {
    match dtype {
        DType::U8 => HostBuffer::U8(v.into_iter().map(|x| x as u8).collect()),
        _ => HostBuffer::I64(v),
    }
}

pub(super) fn unsupported(op: &'static str, dtype: DType) -> Error {
    Error::DTypeMismatch {
        op,
        expected: "a dtype the op supports".into(),
        got: dtype,
    }
}

/// Row-major multi-index of flat position `flat` in `dims`.
pub(super) fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        idx[i] = flat % dims[i];
        flat /= dims[i];
    }
    idx
}

/// Row-major flat position of `idx` in `dims`.
pub(super) fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// The larger of two values, NaN propagating: the binary op table's `maximum`.
pub(super) fn nan_max(a: f64, b: f64) -> f64 {
    BinaryOp::Maximum.eval(a, b)
}

/// The smaller of two values, NaN propagating: the binary op table's `minimum`.
pub(super) fn nan_min(a: f64, b: f64) -> f64 {
    BinaryOp::Minimum.eval(a, b)
}

/// The op table's definition at f64.
pub(super) fn unary_f(op: UnaryOp, x: f64) -> f64 {
    op.eval(x)
}

pub(super) fn unary_i(op: UnaryOp, x: i64) -> Option<i64> {
    op.eval_i64(x)
}

pub(super) fn binary_f(op: BinaryOp, a: f64, b: f64) -> f64 {
    op.eval(a, b)
}

pub(super) fn binary_i(op: BinaryOp, a: i64, b: i64) -> Option<i64> {
    op.eval_i64(a, b)
}

/// `op` over two gathered buffers of one dtype (elementwise, same length).
pub(super) fn binary_bufs(
    op: BinaryOp,
    a: &HostBuffer,
    b: &HostBuffer,
    dtype: DType,
) -> Result<HostBuffer> {
    let name = op.name();
    if !op.supports(dtype) {
        return Err(unsupported(name, dtype));
    }
    if dtype.is_float() {
        let (a, b) = (floats(name, a)?, floats(name, b)?);
        let v: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| binary_f(op, x, y))
            .collect();
        return Ok(float_out(dtype, &v));
    }
    let (a, b) = (ints(a), ints(b));
    let v = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| binary_i(op, x, y).ok_or_else(|| unsupported(name, dtype)))
        .collect::<Result<Vec<_>>>()?;
    Ok(int_out(dtype, v))
}

/// Checks an index read from an `i64` tensor against an axis of size `dim`.
pub(super) fn check_index(op: &'static str, id: i64, dim: usize) -> Result<usize> {
    if id < 0 || id as u64 >= dim as u64 {
        return Err(Error::IndexOutOfRange {
            op,
            index: id,
            size: dim,
        });
    }
    Ok(id as usize)
}
