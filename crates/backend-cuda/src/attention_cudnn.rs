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
//! A tensor mask (boolean or additive) goes to cuDNN's graph as a bias added to the scaled
//! scores ([`Bias`]): a boolean mask is first written as one of the call's dtype, 0 where kept
//! and `-inf` where masked (PyTorch's cuDNN path does the same). Over the axes it broadcasts
//! along, the bias has only its own elements (a `[n, 1, 1, s]` padding mask stays `n · s`), and
//! cuDNN reads it with zero strides. The rows no key remains in come back with zeros, as kiln's
//! kernels give them, but a log-sum-exp of `-inf`, which is set to kiln's `+inf` after the
//! forward (`attn_lse_inf`).
//!
//! With dropout the mask is cuDNN's: its Philox generator seeded with the call's
//! `dropout_key`, the same in the forward and the backward, distributed as kiln's own kernels'
//! mask (each weight kept with probability `1 - p`) but not the same draws. The forward then
//! returns an empty buffer as the mask it kept (kiln's kernels keep at least a word of bits),
//! and a backward given that marker runs here or fails: kiln's kernels would draw another
//! mask.

use kiln_core::backend::Operand;
use kiln_core::{AttentionGrads, AttentionOutputs, AttentionSpec, DType, Layout, Result, Shape};

use crate::cudnn::{SdpaCall, sdpa_run, sdpa_too_small, sdpa_wanted};
use crate::launch::Args;
use crate::memory::{Buffer, alloc};
use crate::ops::attention::{grad_layouts, grad_storages, out_layout};
use crate::ops::{BLOCK, contiguous, copy_strided};
use crate::sources::Module;

/// A tensor mask of a call, in the scores' shape `[batch.., Tq, Tk]`: a boolean (`u8`) one
/// when `additive` is false, else one of the call's dtype.
#[derive(Clone, Copy)]
pub(crate) struct MaskOperand<'a> {
    pub buf: &'a Buffer,
    pub layout: &'a Layout,
    pub additive: bool,
}

/// A tensor mask as cuDNN's graph takes it: an additive bias of the call's dtype at `addr`,
/// described over `[b, h, Tq, Tk]` by `dims` and `strides` (see the module docs), in `_owned`
/// when it had to be written.
pub(crate) struct Bias {
    _owned: Option<Buffer>,
    addr: u64,
    dims: [i64; 4],
    strides: [i64; 4],
}

impl Bias {
    /// The bias of `m` for a call of `dtype`, or `None` when cuDNN cannot read it as one
    /// (scores of rank other than 3 or 4, a mask broadcast along the keys).
    fn of(m: MaskOperand<'_>, dtype: DType) -> Result<Option<Bias>> {
        const OP: &str = "scaled_dot_product_attention";
        let l = m.layout;
        let r = l.rank();
        if !(r == 3 || r == 4) || l.strides()[r - 1] == 0 && l.dims()[r - 1] > 1 {
            return Ok(None);
        }
        // The mask's own elements: the broadcast axes (stride 0) at extent 1.
        let own: Vec<usize> = l
            .dims()
            .iter()
            .zip(l.strides())
            .map(|(&d, &s)| if s == 0 { 1 } else { d })
            .collect();
        let own = Layout::from_parts(Shape::new(own), l.strides(), l.offset());
        // Written out, rows of keys start 16 bytes apart (8 elements), as cuDNN's tensors do.
        let tk = own.dims()[r - 1];
        let tk8 = tk.next_multiple_of(8);
        let mut padded = vec![1usize; r];
        for i in (0..r - 1).rev() {
            padded[i] = if i == r - 2 {
                tk8
            } else {
                padded[i + 1] * own.dims()[i + 1]
            };
        }
        let padded = Layout::from_parts(own.shape().clone(), padded, 0);
        let size = dtype.size_in_bytes();
        let dev = m.buf.state();
        let write = || alloc(dev, own.elem_count() / tk.max(1) * tk8 * size);
        let (owned, view) = if m.additive {
            let aligned = own.strides()[r - 1] == 1
                && (own.offset() * size).is_multiple_of(16)
                && own.dims()[..r - 1]
                    .iter()
                    .zip(own.strides())
                    .all(|(&d, &s)| d == 1 || s.is_multiple_of(8));
            if aligned {
                (None, own.clone())
            } else {
                let b = write()?;
                copy_strided(m.buf, &own, &b, &padded, dtype)?;
                (Some(b), padded)
            }
        } else {
            let keep;
            let (kb, koff) = if own.is_contiguous() {
                (m.buf, own.offset() as u64)
            } else {
                keep = contiguous(m.buf, &own, DType::U8)?;
                (&keep, 0)
            };
            let bias = write()?;
            let rows = own.elem_count() / tk.max(1);
            let neg_inf: u16 = if dtype == DType::F16 { 0xfc00 } else { 0xff80 };
            let mut a = Args::new();
            a.push(kb.device_ptr() + koff)
                .push(bias.device_ptr())
                .push(rows as u64)
                .push(tk as u64)
                .push(tk8 as u64)
                .push(neg_inf);
            let n = rows * tk;
            let grid = (n.div_ceil(BLOCK as usize).clamp(1, 4096) as u32, 1);
            let f = dev.func(Module::Attention, &["attn_keep_bias", "u8"])?;
            dev.launch(OP, f, grid, BLOCK, 0, a.ptrs())?;
            (Some(bias), padded)
        };
        let addr = match &owned {
            Some(b) => b.device_ptr(),
            None => m.buf.device_ptr() + (own.offset() * size) as u64,
        };
        let (d, s) = (view.dims(), view.strides());
        let full = l.dims();
        // [b, h, Tq, Tk] with the head axis of a rank-3 call at 1.
        let at = |i: usize| {
            if r == 4 {
                Some(i)
            } else {
                [Some(0), None, Some(1), Some(2)][i]
            }
        };
        let mut dims = [1i64; 4];
        let mut strides = [0i64; 4];
        for i in 0..4 {
            let Some(j) = at(i) else { continue };
            let own_axis = d[j] > 1 || full[j] == 1;
            // The head axis keeps extent 1 where it broadcasts (as PyTorch's cuDNN path
            // describes it); the batch and query axes take their full extent at stride 0.
            dims[i] = if i == 1 && !own_axis {
                1
            } else {
                full[j] as i64
            };
            strides[i] = if own_axis { s[j] as i64 } else { 0 };
        }
        strides[3] = 1;
        if dims.iter().chain(&strides).any(|&x| x > i32::MAX as i64) {
            return Ok(None);
        }
        Ok(Some(Bias {
            _owned: owned,
            addr,
            dims,
            strides,
        }))
    }
}

/// Sets the `-inf` log-sum-exps cuDNN writes for rows no key remains in to `+inf`.
fn lse_inf_to_pos(lse: &Buffer, rows: usize) -> Result<()> {
    let dev = lse.state();
    let mut a = Args::new();
    a.push(lse.device_ptr()).push(rows as u64);
    let grid = (rows.div_ceil(BLOCK as usize).clamp(1, 4096) as u32, 1);
    let f = dev.func(Module::Attention, &["attn_lse_inf", "u8"])?;
    dev.launch("scaled_dot_product_attention", f, grid, BLOCK, 0, a.ptrs())
}

/// The device address of `l`'s first element in `b`.
fn addr(b: &Buffer, l: &Layout, dtype: DType) -> u64 {
    b.device_ptr() + (l.offset() * dtype.size_in_bytes()) as u64
}

/// The cuDNN call of `spec` on `tensors` (see `SdpaCall`) with the log-sum-exps at `lse`.
fn sdpa_call<'a>(
    dtype: DType,
    spec: &AttentionSpec,
    tensors: &'a [(u64, &'a Layout)],
    lse: u64,
    bias: Option<&Bias>,
) -> SdpaCall<'a> {
    SdpaCall {
        dtype,
        causal: spec.causal,
        scale: spec.scale as f32,
        dropout: (spec.dropout_p, spec.dropout_key),
        tensors,
        lse,
        bias: bias.map(|b| (b.addr, b.dims, b.strides)),
    }
}

/// Whether the call may go to cuDNN at all: 16-bit, one device (that of `bufs` and of the
/// mask, if any), cuDNN wanted there.
fn asked(bufs: &[&Buffer], mask: Option<MaskOperand<'_>>, dtype: DType) -> bool {
    let dev = bufs[0].state();
    bufs.iter()
        .copied()
        .chain(mask.map(|m| m.buf))
        .all(|b| b.state().ordinal() == dev.ordinal())
        && sdpa_wanted(dev.arch(), dtype)
}

/// The forward on cuDNN, or `None` (nothing run) when not served.
pub(crate) fn forward(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
    attn_mask: Option<MaskOperand<'_>>,
    dtype: DType,
    spec: AttentionSpec,
) -> Result<Option<AttentionOutputs<Buffer>>> {
    if !asked(&[q.0, k.0, v.0], attn_mask, dtype) || q.1.rank() < 3 {
        return Ok(None);
    }
    let bias = match attn_mask {
        None => None,
        // Not written out for a call cuDNN would decline for its size anyway.
        Some(_) if sdpa_too_small(q.1, k.1) => return Ok(None),
        Some(m) => match Bias::of(m, dtype)? {
            Some(b) => Some(b),
            None => return Ok(None),
        },
    };
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
    let call = sdpa_call(dtype, &spec, &tensors, lse.device_ptr(), bias.as_ref());
    if !sdpa_run(dev, &call, (false, false))? {
        return Ok(None);
    }
    if bias.is_some() {
        lse_inf_to_pos(&lse, rows)?;
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
    attn_mask: Option<MaskOperand<'_>>,
    out: Operand<'_, Buffer>,
    lse: Operand<'_, Buffer>,
    mask: Option<&Buffer>,
    g: Operand<'_, Buffer>,
    dtype: DType,
    spec: AttentionSpec,
) -> Result<Option<AttentionGrads<Buffer>>> {
    const OP: &str = "scaled_dot_product_attention_backward";
    let bufs = [q.0, k.0, v.0, out.0, lse.0, g.0];
    let cudnn_dropout = spec.dropout_p > 0.0 && mask.is_some_and(|m| m.len_bytes() == 0);
    if spec.dropout_p > 0.0 && !cudnn_dropout {
        // kiln's kernels drew this mask (or none was kept): they draw it again.
        return Ok(None);
    }
    let must = cudnn_dropout;
    let refuse = || {
        Err(kiln_core::Error::invalid(
            OP,
            "the forward drew its dropout mask on cuDNN, which does not serve this backward",
        ))
    };
    if !(must || asked(&bufs, attn_mask, dtype)) || q.1.rank() < 3 {
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
    let bias = match attn_mask {
        None => None,
        Some(_) if !must && sdpa_too_small(q.1, k.1) => return Ok(None),
        Some(m) => match Bias::of(m, dtype)? {
            Some(b) => Some(b),
            None if must => return refuse(),
            None => return Ok(None),
        },
    };
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
    let call = sdpa_call(dtype, &spec, &tensors, lse.0.device_ptr(), bias.as_ref());
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
