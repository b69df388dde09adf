//! The fused path of [`Var::layer_norm`] / [`Var::rms_norm`]: the backend's own one-pass
//! normalization ([`Backend::layer_norm_forward`]) and its backward
//! ([`Backend::layer_norm_backward`]), where the backend offers them (the CUDA backend: one
//! kernel forward, a per-row `dx` kernel and a two-stage column sum backward; the reference
//! backend: plain loops). Elsewhere (the CPU backend), and under [`composed_norm`], `norm.rs`
//! runs its composed expression programs.
//!
//! The node is recorded with [`Var::from_op_folding`]: where the input already has a gradient
//! from its other readers (a residual connection), the backward kernel adds it into `dx` in its
//! own pass instead of the engine adding the two afterwards.
//!
//! A separate module so that `norm.rs` keeps the composed programs and their docs, and this one
//! the plumbing: the operands in, the `[rows]` f32 statistics kept for the backward, the
//! gradients back in the shapes of the input and the parameters.

use std::cell::Cell;

use kiln_core::backend::Operand;
use kiln_core::{Backend, Error, NormSpec, Result, Tensor};

use crate::var::Var;

thread_local! {
    /// Whether [`composed_norm`] is in force on this thread.
    static COMPOSED: Cell<bool> = const { Cell::new(false) };
}

/// Restores the previous setting when dropped (see [`composed_norm`]).
pub struct ComposedNormGuard {
    prev: bool,
}

impl Drop for ComposedNormGuard {
    fn drop(&mut self) {
        COMPOSED.with(|c| c.set(self.prev));
    }
}

/// While the guard lives, [`Var::layer_norm`] and [`Var::rms_norm`] on the calling thread
/// never ask the backend for its fused kernels and run the composed expression programs: how
/// tests and benchmarks compare the two on one device.
pub fn composed_norm() -> ComposedNormGuard {
    ComposedNormGuard {
        prev: COMPOSED.with(|c| c.replace(true)),
    }
}

fn operand<B: Backend>(t: &Tensor<B>) -> Operand<'_, B::Storage> {
    (t.storage(), t.layout())
}

/// The arguments of a checked normalization call (`norm.rs` checked them).
pub(crate) struct NormCall<'a, B: Backend> {
    pub op: &'static str,
    pub x: &'a Var<B>,
    pub weight: Option<&'a Var<B>>,
    pub bias: Option<&'a Var<B>>,
    pub centered: bool,
    pub eps: f64,
    /// The number of normalized elements.
    pub n: usize,
    /// The number of normalized (trailing) axes.
    pub k: usize,
}

/// The fused normalization, or `None` when the backend does not offer it for these operands
/// (or [`composed_norm`] is in force).
pub(crate) fn fused<B: Backend>(call: NormCall<'_, B>) -> Result<Option<Var<B>>> {
    if COMPOSED.with(|c| c.get()) {
        return Ok(None);
    }
    let NormCall {
        op,
        x,
        weight,
        bias,
        centered,
        eps,
        n,
        k,
    } = call;
    let xt = x.tensor();
    if n == 0 || xt.elem_count() == 0 {
        return Ok(None);
    }
    let (wt, bt) = (weight.map(Var::tensor), bias.map(Var::tensor));
    let dtype = xt.dtype();
    let rows = xt.elem_count() / n;
    let spec = NormSpec {
        centered,
        eps,
        rows,
        cols: n,
    };
    let Some((y, mean, rstd)) = B::layer_norm_forward(
        operand(&xt),
        wt.as_ref().map(operand),
        bt.as_ref().map(operand),
        dtype,
        spec,
    )?
    else {
        return Ok(None);
    };
    let stat = |s| Tensor::<B>::from_storage(s, [rows], dtype.compute_dtype());
    let (mean, rstd) = (mean.map(stat), stat(rstd));
    let y = Tensor::<B>::from_storage(y, xt.shape().clone(), dtype);
    let mut inputs = vec![x];
    inputs.extend(weight);
    inputs.extend(bias);
    let (has_w, has_b) = (weight.is_some(), bias.is_some());
    Ok(Some(Var::from_op_folding(
        op,
        &inputs,
        y,
        move |g, needs, acc| {
            let g = if g.dtype() == dtype {
                g.clone()
            } else {
                g.to_dtype(dtype)?
            };
            let iw = has_w.then_some(1);
            let ib = has_b.then_some(1 + usize::from(has_w));
            let wanted = |i: Option<usize>| i.is_some_and(|i| needs[i]);
            let asks = [needs[0], wanted(iw), wanted(ib)];
            let grads = B::layer_norm_backward(
                operand(&xt),
                mean.as_ref().map(operand),
                operand(&rstd),
                wt.as_ref().map(operand),
                operand(&g),
                acc.as_ref().map(operand),
                dtype,
                spec,
                asks,
            )?;
            let Some((dx, dw, db)) = grads else {
                return Err(Error::backend(
                    op,
                    format!(
                        "the {} backend fused the forward but offers no fused backward",
                        B::NAME
                    ),
                ));
            };
            let pshape = &xt.dims()[xt.rank() - k..];
            let param = |s| Tensor::<B>::from_storage(s, pshape.to_vec(), dtype);
            let mut out = vec![None; needs.len()];
            out[0] = dx.map(|s| Tensor::<B>::from_storage(s, xt.shape().clone(), dtype));
            if let Some(i) = iw {
                out[i] = dw.map(param);
            }
            if let Some(i) = ib {
                out[i] = db.map(param);
            }
            Ok(out)
        },
    )))
}
