//! 16-bit fused attention on cuDNN's engines (`cudnn/sdpa.rs`) with kiln's own output layouts
//! (`ops/attention.rs`): what `Backend::attention_forward` and `attention_backward` try first
//! for f16 and bf16, before kiln's kernels.
//!
//! Why a module of its own: it joins the two without either importing the other (`cudnn`
//! copies operands through `ops`, so `ops` may not import `cudnn`). The outputs are laid out
//! exactly as kiln's kernels lay them out (O mirroring q's axis order, the three gradients in
//! one buffer for the head views of one packed projection), and the log-sum-exps mean the same,
//! so a forward here and a backward there (or the reverse) agree.
//!
//! With dropout the mask is cuDNN's: its Philox generator seeded with the call's
//! `dropout_key`, the same in the forward and the backward, distributed as kiln's own kernels'
//! mask (each weight kept with probability `1 - p`) but not the same draws. The forward then
//! returns an empty buffer as the mask it kept (kiln's kernels keep at least a word of bits),
//! and a backward given that marker runs here or fails: kiln's kernels would draw another
//! mask.

use kiln_core::backend::Operand;
use kiln_core::{AttentionGrads, AttentionOutputs, AttentionSpec, DType, Layout, Result};

use crate::cudnn::{SdpaCall, sdpa_run, sdpa_wanted};
use crate::memory::{Buffer, alloc};
use crate::ops::attention::{grad_layouts, grad_storages, out_layout};

/// The device address of `l`'s first element in `b`.
fn addr(b: &Buffer, l: &Layout, dtype: DType) -> u64 {
    b.device_ptr() + (l.offset() * dtype.size_in_bytes()) as u64
}

/// The cuDNN call of `spec` on `tensors` (see `SdpaCall`) and the log-sum-exps at `lse`.
fn sdpa_call<'a>(
    dtype: DType,
    spec: &AttentionSpec,
    tensors: &'a [(u64, &'a Layout)],
    lse: u64,
) -> SdpaCall<'a> {
    SdpaCall {
        dtype,
        causal: spec.causal,
        scale: spec.scale as f32,
        dropout: (spec.dropout_p, spec.dropout_key),
        tensors,
        lse,
    }
}

/// Whether the call may go to cuDNN at all: 16-bit, one device, cuDNN wanted there.
fn asked(bufs: &[&Buffer], dtype: DType) -> bool {
    let dev = bufs[0].state();
    bufs.iter().all(|b| b.state().ordinal() == dev.ordinal()) && sdpa_wanted(dev.arch(), dtype)
}

/// The forward on cuDNN, or `None` (nothing run) when not served.
pub(crate) fn forward(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
    dtype: DType,
    spec: AttentionSpec,
) -> Result<Option<AttentionOutputs<Buffer>>> {
    if !asked(&[q.0, k.0, v.0], dtype) || q.1.rank() < 3 {
        return Ok(None);
    }
    let dev = q.0.state();
    let mut o_dims = q.1.dims().to_vec();
    let r = o_dims.len();
    o_dims[r - 1] = v.1.dims()[v.1.rank() - 1];
    let o_layout = out_layout(q.1, o_dims);
    let rows = q.1.elem_count() / q.1.dims()[r - 1].max(1);
    let out = alloc(dev, o_layout.elem_count() * dtype.size_in_bytes())?;
    let lse = alloc(dev, rows * 4)?;
    let tensors = [
        (addr(q.0, q.1, dtype), q.1),
        (addr(k.0, k.1, dtype), k.1),
        (addr(v.0, v.1, dtype), v.1),
        (out.device_ptr(), &o_layout),
    ];
    let call = sdpa_call(dtype, &spec, &tensors, lse.device_ptr());
    if !sdpa_run(dev, &call, (false, false))? {
        return Ok(None);
    }
    // The marker: an empty buffer (no memory is allocated for it).
    let marker = (spec.dropout_p > 0.0).then(|| alloc(dev, 0)).transpose()?;
    Ok(Some(((out, o_layout), lse, marker)))
}

/// The backward on cuDNN, or `None` (nothing run) when not served; an error when the forward
/// drew its dropout mask on cuDNN (`mask` is the marker) and cuDNN does not serve the backward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
    out: Operand<'_, Buffer>,
    lse: Operand<'_, Buffer>,
    mask: Option<&Buffer>,
    g: Operand<'_, Buffer>,
    dtype: DType,
    spec: AttentionSpec,
) -> Result<Option<AttentionGrads<Buffer>>> {
    const OP: &str = "scaled_dot_product_attention_backward";
    let bufs = [q.0, k.0, v.0, out.0, lse.0, g.0];
    let must = spec.dropout_p > 0.0 && mask.is_some_and(|m| m.len_bytes() == 0);
    if spec.dropout_p > 0.0 && !must {
        // kiln's kernels drew this mask (or none was kept): they draw it again.
        return Ok(None);
    }
    let refuse = || {
        Err(kiln_core::Error::invalid(
            OP,
            "the forward drew its dropout mask on cuDNN, which does not serve this backward",
        ))
    };
    if !(must || asked(&bufs, dtype)) || q.1.rank() < 3 {
        return if must { refuse() } else { Ok(None) };
    }
    // The shapes the forward gave: anything else is left to kiln's kernels, which say what
    // is wrong.
    let rows = q.1.elem_count() / q.1.dims()[q.1.rank() - 1].max(1);
    let lse_ok = lse.1.is_contiguous() && lse.1.offset() == 0 && lse.1.elem_count() == rows;
    if !lse_ok
        || out.1.shape() != g.1.shape()
        || out.1.dims()[..out.1.rank() - 1] != q.1.dims()[..q.1.rank() - 1]
    {
        return if must { refuse() } else { Ok(None) };
    }
    let dev = q.0.state();
    let (packed, [dq_l, dk_l, dv_l]) = grad_layouts(q, k, v);
    let storages = grad_storages(dev, packed, [&dq_l, &dk_l, &dv_l], dtype)?;
    let which = |i: usize| if storages.len() == 1 { 0 } else { i };
    let tensors = [
        (addr(q.0, q.1, dtype), q.1),
        (addr(k.0, k.1, dtype), k.1),
        (addr(v.0, v.1, dtype), v.1),
        (addr(out.0, out.1, dtype), out.1),
        (addr(g.0, g.1, dtype), g.1),
        (addr(&storages[which(0)], &dq_l, dtype), &dq_l),
        (addr(&storages[which(1)], &dk_l, dtype), &dk_l),
        (addr(&storages[which(2)], &dv_l, dtype), &dv_l),
    ];
    let call = sdpa_call(dtype, &spec, &tensors, lse.0.device_ptr());
    if !sdpa_run(dev, &call, (true, must))? {
        return if must { refuse() } else { Ok(None) };
    }
    Ok(Some(AttentionGrads {
        grads: [(which(0), dq_l), (which(1), dk_l), (which(2), dv_l)],
        storages,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::Shape;

    #[test]
    fn output_layouts_are_kiln_kernels() {
        // The forward's O of a head view: the same layout kiln's kernels return.
        let q = Layout::from_parts(Shape::new([2, 3, 5, 8]), [360, 8, 72, 1], 0);
        let o = out_layout(&q, vec![2, 3, 5, 8]);
        assert_eq!(o.dims(), &[2, 3, 5, 8]);
        assert_eq!(o.offset(), 0);
    }
}
