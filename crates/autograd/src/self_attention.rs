//! Multi-head self-attention of a packed projection (`x · in_proj_weightᵀ`, `[.., T, 3E]`):
//! [`Var::packed_self_attention`].
//!
//! # Why an op of its own
//!
//! Composed from views, self-attention is `narrow` ×3 → reshape to `[.., T, H, d]` → transpose
//! to `[.., H, T, d]` → attention → transpose back → reshape to `[.., T, E]`. The views are
//! free in the forward, but in the backward each of dq, dk, dv goes back through its `narrow`
//! (a zero-filled `[.., T, 3E]` buffer and a slice assignment each) and the three meet in two
//! sums at the projection's fan-in: per layer, three `[.., T, 3E]` zero-fills, three slice
//! assignments and two additions, where PyTorch spends one `cat`.
//!
//! Here the three head views are *tensor* views inside one recorded node whose input is the
//! packed projection itself. On the fused path the backend writes the output heads-last
//! (`[.., T, H, d]` under the `[.., H, T, d]` view, so the result `[.., T, E]` is a free
//! reshape) and, seeing q, k, v as the head views of one buffer, writes dQ, dK, dV into one
//! `[.., T, 3E]` buffer in their own layouts (`kiln_core::attention_packed_layouts`): that buffer
//! is the projection's gradient as is. A backend that returns them apart costs one `cat`.
//!
//! Where the fused path does not apply (f64, the CPU, the reference backend,
//! [`composed_attention`](crate::composed_attention)) it runs the composed
//! views above with autograd through them: the same numbers, graph and dropout draws as
//! before this op existed.

use std::sync::Arc;

use kiln_core::{Backend, Error, Generator, Layout, Result, Tensor};

use crate::attention::{AttnMask, check_scalars, fusable_mask, fused_backward, fused_forward};
use crate::var::Var;

const OP: &str = "packed_self_attention";

impl<B: Backend> Var<B> {
    /// Multi-head self-attention of a packed projection `self` `[.., T, 3E]` (queries, keys and
    /// values side by side along the last axis, as `x · in_proj_weightᵀ` gives them; PyTorch's
    /// `in_proj` layout) with `num_heads` heads of `d = E / num_heads`: the attention of head
    /// `h` is [`Var::scaled_dot_product_attention`] of columns `h·d ..` of each third, and the
    /// heads' outputs are concatenated, `[.., T, E]` (before `out_proj`). `mask`, `dropout_p`,
    /// `scale` (default `1/√d`) and `generator` as in `scaled_dot_product_attention`, whose
    /// results and dropout draws this reproduces; the difference is the graph (module docs).
    ///
    /// Errors (naming `packed_self_attention`): rank < 2, a last axis that is not a positive
    /// multiple of `3·num_heads`, a non-float dtype, a bad `scale` or `dropout_p`; anything
    /// else as `scaled_dot_product_attention`.
    pub fn packed_self_attention(
        &self,
        num_heads: usize,
        mask: &AttnMask<B>,
        dropout_p: f64,
        scale: Option<f64>,
        generator: Option<&mut Generator>,
    ) -> Result<Self> {
        let dims = self.dims();
        let r = dims.len();
        if r < 2 || num_heads == 0 || dims[r - 1] == 0 || !dims[r - 1].is_multiple_of(3 * num_heads)
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "expects a packed projection [.., T, 3E] with E a positive multiple of \
                     num_heads, got shape {} and {num_heads} heads",
                    self.shape()
                ),
            ));
        }
        if !self.dtype().is_float() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: "a float dtype".into(),
                got: self.dtype(),
            });
        }
        let e = dims[r - 1] / 3;
        let heads = Heads {
            lead: dims[..r - 1].to_vec(),
            num: num_heads,
            e,
        };
        let scale = check_scalars(OP, e / num_heads, scale, dropout_p)?;
        let dropout = (dropout_p > 0.0).then_some(dropout_p);
        let mut generator = generator;
        if let Some(y) = fused(
            self,
            &heads,
            mask,
            (dropout, scale),
            generator.as_deref_mut(),
        )? {
            return Ok(y);
        }
        // The composed views, autograd through them.
        let view = |i: usize| {
            self.narrow(-1, i * e, e)?
                .reshape(heads.split())?
                .transpose(-3, -2)
        };
        let y = view(0)?.scaled_dot_product_attention(
            &view(1)?,
            &view(2)?,
            mask,
            dropout_p,
            Some(scale),
            generator,
        )?;
        y.transpose(-3, -2)?.reshape(heads.merged())
    }
}

/// The head split of a `[lead.., 3E]` projection.
struct Heads {
    /// `[.., T]`.
    lead: Vec<usize>,
    num: usize,
    e: usize,
}

impl Heads {
    /// `[.., T, H, d]`.
    fn split(&self) -> Vec<usize> {
        let mut d = self.lead.clone();
        d.extend([self.num, self.e / self.num]);
        d
    }
    /// `[.., T, E]`.
    fn merged(&self) -> Vec<usize> {
        let mut d = self.lead.clone();
        d.push(self.e);
        d
    }
    /// Third `i` of the packed tensor `x` as its `[.., H, T, d]` head view (no copy for a
    /// contiguous `x`).
    fn view<B: Backend>(&self, x: &Tensor<B>, i: usize) -> Result<Tensor<B>> {
        x.narrow(-1, i * self.e, self.e)?
            .reshape(self.split())?
            .transpose(-3, -2)
    }
    /// `[.., H, T, d]` back to `[.., T, E]` (free for a heads-last layout).
    fn merge<B: Backend>(&self, x: &Tensor<B>) -> Result<Tensor<B>> {
        x.transpose(-3, -2)?.reshape(self.merged())
    }
}

/// The fused path (module docs), or `None` when it does not apply.
fn fused<B: Backend>(
    x: &Var<B>,
    heads: &Heads,
    mask: &AttnMask<B>,
    (dropout, scale): (Option<f64>, f64),
    generator: Option<&mut Generator>,
) -> Result<Option<Var<B>>> {
    let Some(mask) = fusable_mask(mask) else {
        return Ok(None);
    };
    if dropout.is_some() && generator.is_none() {
        return Ok(None);
    }
    let x = if crate::autocast::autocast_dtype().is_some() {
        x.autocast_low()?
    } else {
        x.clone()
    };
    let xt = x.tensor();
    let (qt, kt, vt) = (
        heads.view(&xt, 0)?,
        heads.view(&xt, 1)?,
        heads.view(&xt, 2)?,
    );
    let Some(f) = fused_forward((&qt, &kt, &vt), mask, (dropout, scale), generator)? else {
        return Ok(None);
    };
    let y = heads.merge(&f.out)?;
    let shapes = (heads.split(), heads.merged());
    let saved = (xt, qt, kt, vt, f);
    Ok(Some(Var::from_op(OP, &[&x], y, move |g, _| {
        let (xt, qt, kt, vt, f) = &saved;
        let (split, merged) = &shapes;
        let g = g.reshape(split.clone())?.transpose(-3, -2)?;
        let [dq, dk, dv] = fused_backward((qt, kt, vt), f, &g)?;
        if let Some(dx) = one_buffer([&dq, &dk, &dv], xt, [qt, kt, vt]) {
            return Ok(vec![Some(dx)]);
        }
        let to_rows = |t: &Tensor<B>| t.transpose(-3, -2)?.reshape(merged.clone());
        let dx = Tensor::cat(&[to_rows(&dq)?, to_rows(&dk)?, to_rows(&dv)?], -1)?;
        Ok(vec![Some(dx)])
    })))
}

/// The packed gradient `[.., T, 3E]` when the backend wrote `dq`, `dk`, `dv` into one storage
/// that is exactly it: the projection `x` is row-major, and each gradient lies in the shared
/// storage as its operand view lies in `x` (shifted by the first view's offset); else `None`.
fn one_buffer<B: Backend>(
    grads: [&Tensor<B>; 3],
    x: &Tensor<B>,
    views: [&Tensor<B>; 3],
) -> Option<Tensor<B>> {
    let s = grads[0].storage_arc();
    if !x.is_contiguous() || !grads.iter().all(|t| Arc::ptr_eq(t.storage_arc(), s)) {
        return None;
    }
    let base = views[0].layout().offset();
    for (g, v) in grads.iter().zip(views) {
        let l = v.layout();
        let want = l
            .offset()
            .checked_sub(base)
            .map(|off| Layout::from_parts(l.shape().clone(), l.strides(), off));
        if want.as_ref() != Some(g.layout()) {
            return None;
        }
    }
    Some(Tensor::from_parts(
        s.clone(),
        Layout::contiguous(x.shape().clone()),
        grads[0].dtype(),
    ))
}
