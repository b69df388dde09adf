//! [`Backend::linear_epilogue`] and its backward composed from a backend's own kernels (a
//! product, a bias add, the activation; in the backward the activation's derivative, two
//! products and a column sum). The reference backend offers the fused op this way, so that the
//! callers' fused path (kiln-autograd's `Var::linear_act`) is tested without a GPU; a GPU
//! backend's tests compare its library epilogues with it.

use crate::backend::{Backend, Operand};
use crate::epilogue::{Activation, EpilogueGrads, EpilogueOutputs};
use crate::{BinaryOp, DType, Error, GradFrom, Layout, ReduceOp, Result};

const OP: &str = "linear_epilogue";

/// `(m, k)` of a 2-d operand, or a typed error.
fn dims2(what: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.dims() {
        [a, b] => Ok((*a, *b)),
        _ => Err(Error::invalid(
            OP,
            format!("{what} must be 2-d, got {}", l.shape()),
        )),
    }
}

/// The operand contiguous (a copy when it is not).
fn contig<B: Backend>(o: Operand<'_, B::Storage>, dtype: DType) -> Result<B::Storage> {
    B::contiguous(o.0, o.1, dtype)
}

/// `[batch 1, rows, cols]` over a contiguous `[rows, cols]` matrix, or its transpose
/// (column-major) when `t`.
fn mat(rows: usize, cols: usize, t: bool) -> Layout {
    if t {
        Layout::from_parts([1, cols, rows].into(), vec![rows * cols, 1, cols], 0)
    } else {
        Layout::contiguous([1, rows, cols])
    }
}

/// The composed forward (module docs); `aux` is the activation's saved operand (its input or
/// its output, as its gradient reads).
pub fn linear_epilogue_composed<B: Backend>(
    x: Operand<'_, B::Storage>,
    w: Operand<'_, B::Storage>,
    bias: Option<(Operand<'_, B::Storage>, DType)>,
    dtype: DType,
    act: Activation,
    keep_aux: bool,
) -> Result<EpilogueOutputs<B::Storage>> {
    let ((m, k), (n, k2)) = (dims2("x", x.1)?, dims2("w", w.1)?);
    if k != k2 {
        return Err(Error::invalid(
            OP,
            format!("x [{m}, {k}] and w [{n}, {k2}] do not share k"),
        ));
    }
    let (xc, wc) = (contig::<B>(x, dtype)?, contig::<B>(w, dtype)?);
    let mut pre = B::matmul(&xc, &mat(m, k, false), &wc, &mat(n, k, true), dtype)?;
    let out_l = Layout::contiguous([m, n]);
    if let Some(((bs, bl), bd)) = bias {
        let b = if bd == dtype {
            contig::<B>((bs, bl), dtype)?
        } else {
            B::cast(bs, bl, bd, dtype)?
        };
        let bl = Layout::from_parts([m, n].into(), vec![0, 1], 0);
        pre = B::binary(BinaryOp::Add, &pre, &out_l, &b, &bl, dtype)?;
    }
    let Some(op) = act.unary() else {
        return Ok(EpilogueOutputs {
            out: pre,
            aux: None,
        });
    };
    let out = B::unary(op, &pre, &out_l, dtype)?;
    let aux = match (keep_aux, op.grad_reads()) {
        (false, _) => None,
        (true, Some(GradFrom::Output)) => Some(B::contiguous(&out, &out_l, dtype)?),
        (true, _) => Some(pre),
    };
    Ok(EpilogueOutputs { out, aux })
}

/// The composed backward (module docs) for a forward by [`linear_epilogue_composed`].
pub fn linear_epilogue_backward_composed<B: Backend>(
    x: Operand<'_, B::Storage>,
    w: Operand<'_, B::Storage>,
    aux: Option<&B::Storage>,
    g: Operand<'_, B::Storage>,
    dtype: DType,
    bias_dtype: Option<DType>,
    act: Activation,
) -> Result<EpilogueGrads<B::Storage>> {
    let ((m, k), (n, _)) = (dims2("x", x.1)?, dims2("w", w.1)?);
    let out_l = Layout::contiguous([m, n]);
    let gc = contig::<B>(g, dtype)?;
    let dpre = match act.unary() {
        None => gc,
        Some(op) => {
            let Some(aux) = aux else {
                return Err(Error::invalid(
                    OP,
                    "the backward of an activation needs the forward's aux (keep_aux)",
                ));
            };
            B::unary_backward(op, aux, &out_l, &gc, &out_l, dtype)?
        }
    };
    let (xc, wc) = (contig::<B>(x, dtype)?, contig::<B>(w, dtype)?);
    let dx = B::matmul(&dpre, &mat(m, n, false), &wc, &mat(n, k, false), dtype)?;
    let dw = B::matmul(&dpre, &mat(m, n, true), &xc, &mat(m, k, false), dtype)?;
    let db = match bias_dtype {
        None => None,
        Some(bd) => {
            let s = B::reduce(ReduceOp::Sum, &dpre, &out_l, dtype, &[0])?;
            Some(if bd == dtype {
                s
            } else {
                B::cast(&s, &Layout::contiguous([n]), dtype, bd)?
            })
        }
    };
    Ok(EpilogueGrads { dx, dw, db })
}
