//! Fused scaled dot-product attention (`Backend::attention_forward` / `attention_backward`):
//! argument packing and launches of `kernels/attention.cu` (f32 FMAs) or
//! `kernels/attention_tc.cu` (tensor cores on sm_80+: f16/bf16, and f32 as 3xTF32 or 1xTF32;
//! `attention_kernels.rs` picks),
//! whose headers explain the algorithm (FlashAttention-2's tiles and online softmax; backward
//! by recomputation from the saved row log-sum-exps, in deterministic passes).
//!
//! # Why a module of its own
//!
//! Attention has an argument set no other kernel shares (four operands' batch strides, row
//! strides, the scale and the mask), kernels compiled per head size, and shared memory above
//! the default 48 KiB for the larger heads; keeping it here keeps `rows.rs` and `mod.rs` about
//! rows and elementwise ops.
//!
//! # What it offers, and what it leaves to the composed path
//!
//! Dropout on the weights runs inside the kernels (`AttentionSpec::dropout_p`): the FMA kernels
//! draw the mask from Philox in each of them; the tensor-core forward draws it once and keeps
//! one bit a weight for the backward (the third of `AttentionOutputs`, `tc_mask_word` in
//! `attention_tc.cu`), whose kernels read the bits and draw only when none are given.
//!
//! f16 and bf16 fuse where the tensor-core kernels run — sm_80+ at head sizes up to 128 —
//! and compose elsewhere, unless [`set_fused_attention_16bit`] says otherwise (the one switch
//! of whether 16-bit attention fuses). The tensor-core kernels (`kernels/attention_tc.cu`) are
//! the same algorithm and mask with `mma.sync` products; on an H100 (2026-11-27, GPT shape
//! B=64, H=6, T=256, d=64, causal, bf16 forward + backward) they took 0.328 ms against
//! 0.762 ms composed (cuBLAS's tensor-core GEMMs around a softmax), 0.915 ms on the FMA kernels
//! of `kernels/attention.cu`, and 0.515 ms for PyTorch's `scaled_dot_product_attention` in the
//! same run. Older GPUs (or [`set_attention_tensor_cores`]`(false)`, which the tests use to
//! compare the two) would run the FMA kernels, slower than composing, so there 16-bit
//! composes by default.
//!
//! On Hopper (sm_90+) f16 and bf16 go to cuDNN's fused attention engines first (with
//! dropout, cuDNN's generator draws the mask) (`cudnn/sdpa.rs`, joined to this module's layouts by `attention_cudnn.rs`; those
//! `wgmma` kernels take half the time of the `mma.sync` ones here at T = 2048), and reach
//! this module only where cuDNN does not serve the call.
//!
//! f32 runs the tensor-core kernels too on sm_80+ (where their shared memory fits: not head
//! size 128 on sm_86/sm_89), with TF32 products: 3xTF32 by default (each operand split into a
//! TF32 part and a TF32 remainder, three products per tile: near-f32 results, and the
//! arithmetic of PyTorch's f32 attention, whose memory-efficient kernel uses CUTLASS's
//! `OpMultiplyAddFastF32`), 1xTF32 while [`crate::allow_tf32`] is on.
//! [`set_attention_tensor_cores_f32`]`(false)` forces the f32-FMA kernels, which took 0.964 ms
//! fused against 1.285 composed at the GPT shape above (PyTorch 0.639); the tensor-core f32
//! kernels are not yet measured.
//!
//! `Ok(None)` ("not offered") for: f64 and non-float dtypes, head sizes (`d` or `dv`) above
//! 128, `Tq` or `Tk` of 0, batch axes that differ between the operands (broadcast `k`/`v`),
//! more than 65535 tiles of queries or keys. kiln-autograd then composes attention from
//! products and a softmax.
//!
//! A tensor mask in the scores' shape (any strides: a key-padding mask broadcast over heads
//! and queries has zero strides there) is read by the kernels where they test causality and
//! the matrix's edges: a boolean one (`u8`) by `att_keep`, an additive one (of the storage
//! type, `AttnShape::bias`) added by `att_bias` to the scaled scores before the exponential. A
//! tile that crosses the mask tests (and adds) its elements, and a row that sees no key gets
//! zeros and a log-sum-exp of `+inf`, as a causal row past `Tk` would. (16-bit calls with a
//! tensor mask go to cuDNN's engines first on sm_90+, `attention_cudnn.rs`.) The mask's kernel
//! instances are few (every group ships prebuilt in every binary): f32 with a mask runs 3xTF32
//! even under `allow_tf32` (or the FMA kernels where tensor cores do not run), and f16/bf16
//! with a mask run the tensor-core kernels or compose.
//! Operands whose head axis is strided (not unit stride) are copied first; any other layout
//! (a head view of a packed projection, transposed batch axes) is read in place.
//!
//! # Output layouts
//!
//! O, dQ, dK and dV are written through batch and row strides, laid out by
//! `kiln_core::attention_output_layout`: an operand viewed `[.., H, T, d]` over a `[.., T, H,
//! d]` buffer (multi-head attention's head views) gets its output or gradient in a fresh
//! `[.., T, H, d]` buffer (returned as the `[.., H, T, d]` view), so the caller's transpose
//! back and reshape to `[.., T, E]` cost nothing; other operands get contiguous outputs. The
//! row statistics (lse, Dr) stay contiguous `[.., T]`. When q, k and v are the three head
//! views of one packed `[.., T, 3E]` projection (self-attention), dQ, dK and dV are written
//! into one `[.., T, 3E]` buffer in the operands' own layouts: that buffer is the packed
//! projection's gradient as is. The backward reads the forward's O in
//! whatever layout it is given (unit head stride), in place.

use std::sync::atomic::{AtomicU8, Ordering};

use kiln_core::backend::Operand;
use kiln_core::{
    AttentionGrads, AttentionOutputs, AttentionSpec, DType, Layout, Result, Shape,
    attention_output_layout, attention_packed_layouts,
};

use crate::launch::{Args, Dims, Strides, collapse_dyn};
use crate::memory::{Buffer, alloc};
use crate::ops::attention_kernels::{Family, Stage, TILE, launch};
use crate::ops::{Module, contiguous, same_device, tname};

pub use crate::ops::attention_kernels::{
    set_attention_tensor_cores, set_attention_tensor_cores_f32,
};

/// The kernels' `AttnShape` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnShape {
    tq: u64,
    tk: u64,
    d: u64,
    dv: u64,
    q_rs: u64,
    k_rs: u64,
    v_rs: u64,
    g_rs: u64,
    o_rs: u64,
    dq_rs: u64,
    dk_rs: u64,
    dv_rs: u64,
    batch: u64,
    key: u64,
    /// Device address of the dropout bits (`attention_tc.cu`'s `tc_mask_word`), 0 for none.
    mask: u64,
    scale: f32,
    scale2: f32,
    drop_p: f32,
    drop_scale: f32,
    causal: i32,
    dropout: i32,
    /// Device address of the mask (boolean: nonzero where query i may see key j; or additive,
    /// of the storage type), 0 for none; batch entry `b` at `keep + offset1(b, bd, keep_bs)`,
    /// element (i, j) at `i keep_rs + j keep_cs`, all in bytes.
    keep: u64,
    keep_bs: Strides,
    keep_rs: u64,
    keep_cs: u64,
    /// Device address of the mask's summary per 16 x 16 block ([`keep_tiles`]), 0 for none.
    keep_tiles: u64,
    /// Nonzero: the mask at `keep` is additive.
    bias: u64,
}

/// A tensor mask of a call, in the scores' shape `[batch.., Tq, Tk]`: boolean (`u8`), or
/// `additive` (of the call's dtype, added to the scaled scores).
#[derive(Clone, Copy)]
pub(crate) struct MaskOperand<'a> {
    pub op: Operand<'a, Buffer>,
    pub additive: bool,
}

/// One operand as the kernels read it: a buffer (the caller's, or a copy with a unit head
/// stride), and its layout.
struct View<'a> {
    copy: Option<Buffer>,
    buf: &'a Buffer,
    layout: Layout,
}

impl<'a> View<'a> {
    fn new((s, l): (&'a Buffer, &Layout), dtype: DType) -> Result<Self> {
        let r = l.rank();
        if l.strides()[r - 1] == 1 || l.dims()[r - 1] <= 1 {
            return Ok(View {
                copy: None,
                buf: s,
                layout: l.clone(),
            });
        }
        Ok(View {
            copy: Some(contiguous(s, l, dtype)?),
            buf: s,
            layout: Layout::contiguous(l.shape().clone()),
        })
    }
    fn ptr(&self) -> u64 {
        self.copy.as_ref().unwrap_or(self.buf).device_ptr()
    }
    fn rows(&self) -> usize {
        self.layout.dims()[self.layout.rank() - 2]
    }
    fn cols(&self) -> usize {
        self.layout.dims()[self.layout.rank() - 1]
    }
    fn row_stride(&self) -> u64 {
        self.layout.strides()[self.layout.rank() - 2] as u64
    }
    fn batch_dims(&self) -> &[usize] {
        &self.layout.dims()[..self.layout.rank() - 2]
    }
    fn batch_strides(&self) -> &[usize] {
        &self.layout.strides()[..self.layout.rank() - 2]
    }
}

/// The compiled head size for heads of `d` and `dv`, or `None` above 128.
fn head_tile(d: usize, dv: usize) -> Option<(&'static str, usize)> {
    match d.max(dv) {
        0..=64 => Some(("64", 64)),
        65..=128 => Some(("128", 128)),
        _ => None,
    }
}

/// The problem of one call as the kernels take it.
struct Plan {
    shape: AttnShape,
    /// The batch dims, collapsed.
    bd: Dims,
    /// Per operand (q, k, v, and dO in the backward), then per output layout, its batch
    /// strides and offset.
    ss: Vec<Strides>,
    /// The compiled head size: its name in the kernels' names, and its value.
    tile: (&'static str, usize),
    /// The kernels that run it.
    family: Family,
}

/// Whether f16/bf16 attention takes the fused kernels: [`AUTO`] until
/// [`set_fused_attention_16bit`] is called, then [`ON`] or [`OFF`].
static HALF: AtomicU8 = AtomicU8::new(AUTO);
/// Fused where the tensor-core kernels run (sm_80+, tensor cores allowed), composed elsewhere.
const AUTO: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

/// Offers the fused kernels for f16 and bf16 operands on every device (`true`: on sm_80+ the
/// tensor-core kernels, else the f32-FMA ones), or on none (`false`: the composed path around
/// cuBLAS's GEMMs). Until it is called, 16-bit attention fuses exactly where the tensor-core
/// kernels run (module docs). Process-wide.
pub fn set_fused_attention_16bit(on: bool) {
    HALF.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Whether f16/bf16 attention fuses on a device of compute capability `arch` (see
/// [`set_fused_attention_16bit`]).
pub fn fused_attention_16bit(arch: u32) -> bool {
    match HALF.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => Family::of(DType::BF16, 64, (arch, usize::MAX), false) == Family::TensorCore,
    }
}

/// The [`Plan`] of one call, or `None` when the kernels do not take it. `mask`: the tensor
/// mask's layout in the scores' shape `[batch.., Tq, Tk]` (its batch strides join the operands'
/// in the collapse of the batch axes) and whether it is additive.
fn plan(
    views: &[&View<'_>],
    outs: &[&Layout],
    mask: Option<(&Layout, bool)>,
    dtype: DType,
    (spec, tf32): (AttentionSpec, bool),
    target: (u32, usize),
) -> Result<Option<Plan>> {
    let arch = target.0;
    const OP: &str = "scaled_dot_product_attention";
    let keep = mask.map(|m| m.0);
    let additive = mask.is_some_and(|m| m.1);
    // The mask's strides in bytes: an additive mask has the call's dtype.
    let esize = if additive { dtype.size_in_bytes() } else { 1 } as u64;
    let half = matches!(dtype, DType::F16 | DType::BF16);
    if !(dtype == DType::F32 || (half && fused_attention_16bit(arch))) {
        return Ok(None);
    }
    let (q, k, v) = (views[0], views[1], views[2]);
    let batch = q.batch_dims();
    if views.iter().any(|x| x.batch_dims() != batch) {
        return Ok(None);
    }
    let (tq, tk, d, dv) = (q.rows(), k.rows(), q.cols(), v.cols());
    if tq == 0 || tk == 0 || k.cols() != d || v.rows() != tk {
        return Ok(None);
    }
    let Some((tile_name, dt)) = head_tile(d, dv) else {
        return Ok(None);
    };
    if tq.div_ceil(TILE) > 65535 || tk.div_ceil(TILE) > 65535 {
        return Ok(None);
    }
    let nbatch: usize = batch.iter().product();
    if nbatch == 0 || nbatch >= 1 << 31 {
        return Ok(None);
    }
    if outs.iter().any(|l| l.dims()[..l.rank() - 2] != *batch) {
        return Ok(None);
    }
    if let Some(m) = keep
        && (m.rank() != batch.len() + 2
            || m.dims()[..batch.len()] != *batch
            || m.dims()[batch.len()..] != [tq, tk])
    {
        return Ok(None);
    }
    let strides: Vec<&[usize]> = views
        .iter()
        .map(|x| x.batch_strides())
        .chain(
            outs.iter()
                .chain(keep.as_slice())
                .map(|l| &l.strides()[..l.rank() - 2]),
        )
        .collect();
    let offsets: Vec<usize> = views
        .iter()
        .map(|x| x.layout.offset())
        .chain(outs.iter().chain(keep.as_slice()).map(|l| l.offset()))
        .collect();
    let (bd, ss) = collapse_dyn(OP, batch, &strides, &offsets)?;
    let keep_strides = |i: usize| keep.map_or(0, |m| m.strides()[m.rank() - 2 + i] as u64 * esize);
    let g_rs = views.get(3).map_or(0, |g| g.row_stride());
    let shape = AttnShape {
        tq: tq as u64,
        tk: tk as u64,
        d: d as u64,
        dv: dv as u64,
        q_rs: q.row_stride(),
        k_rs: k.row_stride(),
        v_rs: v.row_stride(),
        g_rs,
        o_rs: 0,
        dq_rs: 0,
        dk_rs: 0,
        dv_rs: 0,
        batch: nbatch as u64,
        key: spec.dropout_key,
        mask: 0,
        scale: spec.scale as f32,
        scale2: (spec.scale * std::f64::consts::LOG2_E) as f32,
        drop_p: spec.dropout_p as f32,
        drop_scale: (1.0 / (1.0 - spec.dropout_p)) as f32,
        causal: spec.causal as i32,
        dropout: (spec.dropout_p > 0.0) as i32,
        keep: 0, // the caller's buffer address, set by the caller
        keep_bs: if keep.is_some() {
            let mut s = ss[ss.len() - 1];
            s.s.iter_mut().for_each(|x| *x *= esize);
            s.offset *= esize;
            s
        } else {
            Strides::default()
        },
        keep_rs: keep_strides(0),
        keep_cs: keep_strides(1),
        keep_tiles: 0,
        bias: u64::from(additive),
    };
    // With a mask, f32 takes 3xTF32 even under `allow_tf32` and 16-bit only the tensor-core
    // kernels: the mask's instances exist for those (`attention_tc.cu`, `attention.cu`).
    let family = Family::of(dtype, dt, target, tf32 && keep.is_none());
    if keep.is_some() && family == Family::Fma && dtype != DType::F32 {
        return Ok(None);
    }
    Ok(Some(Plan {
        shape,
        bd,
        ss,
        tile: (tile_name, dt),
        family,
    }))
}

/// With a boolean mask at `keep` (`shape.keep` and its strides set), its summary per 16 x 16
/// block of the scores (`attn_keep_tiles` in `attention.cu`), which the tensor-core kernels
/// read to skip blocks that see nothing and to run unmasked through blocks that see all: into
/// a fresh buffer whose address goes to `shape.keep_tiles`, returned to live past the launches.
/// `None` without a mask or for the FMA kernels (which test every element).
fn keep_tiles(
    dev: &'static crate::device::DeviceState,
    shape: &mut AttnShape,
    bd: Dims,
    (family, dtype): (Family, DType),
    keep: bool,
) -> Result<Option<Buffer>> {
    if !keep || family == Family::Fma {
        return Ok(None);
    }
    let blocks =
        shape.batch as usize * (shape.tq as usize).div_ceil(16) * (shape.tk as usize).div_ceil(16);
    let tiles = alloc(dev, blocks)?;
    let mut a = Args::new();
    // An additive mask's element size and the bits of its -inf.
    let (nbytes, neg_inf): (u32, u32) = match (shape.bias != 0, dtype) {
        (false, _) => (0, 0),
        (true, DType::F16) => (2, 0xfc00),
        (true, DType::BF16) => (2, 0xff80),
        (true, _) => (4, 0xff80_0000),
    };
    a.push(shape.keep)
        .push(tiles.device_ptr())
        .push(*shape)
        .push(bd)
        .push(nbytes)
        .push(neg_inf);
    // One warp per block, eight warps per thread block.
    let grid = (
        blocks.div_ceil(8).min(dev.sm_count() as usize * 32) as u32,
        1,
    );
    let f = dev.func(Module::Attention, &["attn_keep_tiles", "u8"])?;
    dev.launch("scaled_dot_product_attention", f, grid, 256, 0, a.ptrs())?;
    shape.keep_tiles = tiles.device_ptr();
    Ok(Some(tiles))
}

/// The row stride of a layout of rank >= 2.
fn row_stride(l: &Layout) -> u64 {
    l.strides()[l.rank() - 2] as u64
}

/// The layout of an output of `dims` computed from the operand laid out as `like`.
pub(crate) fn out_layout(like: &Layout, dims: Vec<usize>) -> Layout {
    attention_output_layout(like, &Shape::new(dims))
}

/// `Backend::attention_forward` on the GPU: the output `[batch.., Tq, dv]` with its layout
/// (module docs) and the f32 row log-sum-exps `[batch.., Tq]`, or `None` when not offered
/// (module docs). `spec` comes with whether f32 may take 1xTF32 (`allow_tf32()`, read by the
/// caller: `blas` is not this module's to import).
pub(crate) fn forward(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
    keep: Option<MaskOperand<'_>>,
    dtype: DType,
    spec: (AttentionSpec, bool),
) -> Result<Option<AttentionOutputs<Buffer>>> {
    const OP: &str = "scaled_dot_product_attention";
    same_device(OP, q.0, k.0)?;
    same_device(OP, q.0, v.0)?;
    if let Some(m) = keep {
        same_device(OP, q.0, m.op.0)?;
    }
    let dev = q.0.state();
    dev.bind()?;
    let (qv, kv, vv) = (
        View::new(q, dtype)?,
        View::new(k, dtype)?,
        View::new(v, dtype)?,
    );
    let mut o_dims = q.1.dims().to_vec();
    *o_dims.last_mut().expect("rank >= 2") = vv.cols();
    let o_layout = out_layout(q.1, o_dims);
    let Some(Plan {
        mut shape,
        bd,
        ss,
        tile,
        family,
    }) = plan(
        &[&qv, &kv, &vv],
        &[&o_layout],
        keep.map(|m| (m.op.1, m.additive)),
        dtype,
        spec,
        (dev.arch(), dev.smem_optin()),
    )?
    else {
        return Ok(None);
    };
    shape.keep = keep.map_or(0, |m| m.op.0.device_ptr());
    let _tiles = keep_tiles(dev, &mut shape, bd, (family, dtype), keep.is_some())?;
    shape.o_rs = row_stride(&o_layout);
    let (nb, tq, dv) = (shape.batch as usize, shape.tq as usize, shape.dv as usize);
    let out = alloc(dev, nb * tq * dv * dtype.size_in_bytes())?;
    let lse = alloc(dev, nb * tq * 4)?;
    // With dropout the tensor-core forward keeps its bits for the backward (1 bit a weight).
    let mask = match family.mask_bytes(tile.1, (nb, tq, shape.tk as usize)) {
        Some(bytes) if spec.0.dropout_p > 0.0 => Some(alloc(dev, bytes)?),
        _ => None,
    };
    shape.mask = mask.as_ref().map_or(0, |m| m.device_ptr());
    let mut a = Args::new();
    a.push(qv.ptr())
        .push(kv.ptr())
        .push(vv.ptr())
        .push(out.device_ptr())
        .push(lse.device_ptr())
        .push(shape)
        .push(bd)
        .push(ss[0])
        .push(ss[1])
        .push(ss[2])
        .push(ss[3]);
    let grid = (nb as u32, tq.div_ceil(family.block_rows()) as u32);
    launch(
        dev,
        (family, Stage::Fwd, keep.is_some()),
        dtype,
        tile,
        grid,
        &mut a,
    )?;
    Ok(Some(((out, o_layout), lse, mask)))
}

/// `Backend::attention_backward` on the GPU: `(dq, dk, dv)` in the shapes of `q`, `k` and `v`,
/// each with its layout (module docs; one buffer for the three when `q`, `k`, `v` are the head
/// views of one packed projection), or `None` when not offered (the forward then was not
/// either).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
    out: Operand<'_, Buffer>,
    lse: Operand<'_, Buffer>,
    (mask, keep): (Option<&Buffer>, Option<MaskOperand<'_>>),
    g: Operand<'_, Buffer>,
    dtype: DType,
    spec: (AttentionSpec, bool),
) -> Result<Option<AttentionGrads<Buffer>>> {
    const OP: &str = "scaled_dot_product_attention_backward";
    for x in [k.0, v.0, out.0, lse.0, g.0]
        .into_iter()
        .chain(keep.map(|m| m.op.0))
    {
        same_device(OP, q.0, x)?;
    }
    let dev = q.0.state();
    dev.bind()?;
    let (qv, kv, vv) = (
        View::new(q, dtype)?,
        View::new(k, dtype)?,
        View::new(v, dtype)?,
    );
    let gv = View::new(g, dtype)?;
    // The forward's O, in the layout it returned (or any other with a unit head stride).
    let ov = View::new(out, dtype)?;
    if ov.layout.shape() != gv.layout.shape() {
        return Err(kiln_core::Error::invalid(
            OP,
            format!(
                "expects the forward's output in the output gradient's shape {}, got {}",
                gv.layout.shape(),
                ov.layout.shape()
            ),
        ));
    }
    let (packed, [dq_l, dk_l, dv_l]) = grad_layouts(q, k, v);
    let Some(Plan {
        mut shape,
        bd,
        ss,
        tile,
        family,
    }) = plan(
        &[&qv, &kv, &vv, &gv],
        &[&ov.layout, &dq_l, &dk_l, &dv_l],
        keep.map(|m| (m.op.1, m.additive)),
        dtype,
        spec,
        (dev.arch(), dev.smem_optin()),
    )?
    else {
        return Ok(None);
    };
    shape.keep = keep.map_or(0, |m| m.op.0.device_ptr());
    let _tiles = keep_tiles(dev, &mut shape, bd, (family, dtype), keep.is_some())?;
    shape.o_rs = ov.row_stride();
    shape.dq_rs = row_stride(&dq_l);
    shape.dk_rs = row_stride(&dk_l);
    shape.dv_rs = row_stride(&dv_l);
    let (so, sdq, sdk, sdv) = (ss[4], ss[5], ss[6], ss[7]);
    let (nb, tq, tk) = (shape.batch as usize, shape.tq as usize, shape.tk as usize);
    check_saved(&gv, lse.1, &shape)?;
    // The forward's dropout bits, where this family reads them and they are all there (else the
    // kernels draw the mask again).
    if let (Some(m), Some(bytes)) = (mask, family.mask_bytes(tile.1, (nb, tq, tk)))
        && spec.0.dropout_p > 0.0
        && m.len_bytes() >= bytes
    {
        same_device(OP, q.0, m)?;
        shape.mask = m.device_ptr();
    }
    // The log-sum-exps: contiguous as the forward made them, unless a caller re-laid them out.
    let lse_copy = if lse.1.is_contiguous() && lse.1.offset() == 0 {
        None
    } else {
        Some(contiguous(lse.0, lse.1, DType::F32)?)
    };
    let lse_ptr = lse_copy.as_ref().unwrap_or(lse.0).device_ptr();
    let dr = alloc(dev, nb * tq * 4)?;
    let mut a = Args::new();
    a.push(ov.ptr())
        .push(gv.ptr())
        .push(dr.device_ptr())
        .push(shape)
        .push(bd)
        .push(ss[3])
        .push(so);
    // One warp per chunk of 16 rows of a batch entry (ATT_PRE_ROWS), 8 warps a block.
    let chunks = nb as u64 * (tq as u64).div_ceil(16);
    let grid = (chunks.div_ceil(8).min(dev.sm_count() as u64 * 32) as u32, 1);
    let f = dev.func(Module::Attention, &["attn_bwd_pre", tname(dtype)])?;
    dev.launch(OP, f, grid, 256, 0, a.ptrs())?;

    let storages = grad_storages(dev, packed, [&dq_l, &dk_l, &dv_l], dtype)?;
    // One storage: the three gradients lie in it at their layouts' offsets (in `sdq` ...).
    let (dq, dk, dv) = match storages.as_slice() {
        [one] => (one, one, one),
        [a, b, c] => (a, b, c),
        _ => unreachable!("one or three storages"),
    };
    let operands = |a: &mut Args| {
        a.push(qv.ptr())
            .push(kv.ptr())
            .push(vv.ptr())
            .push(gv.ptr())
            .push(lse_ptr)
            .push(dr.device_ptr());
    };
    let mut a = Args::new();
    operands(&mut a);
    a.push(dk.device_ptr()).push(dv.device_ptr());
    a.push(shape)
        .push(bd)
        .push(ss[0])
        .push(ss[1])
        .push(ss[2])
        .push(ss[3])
        .push(sdk)
        .push(sdv);
    let grid = (nb as u32, tk.div_ceil(family.block_rows()) as u32);
    launch(
        dev,
        (family, Stage::DkDv, keep.is_some()),
        dtype,
        tile,
        grid,
        &mut a,
    )?;

    let mut a = Args::new();
    operands(&mut a);
    a.push(dq.device_ptr());
    a.push(shape)
        .push(bd)
        .push(ss[0])
        .push(ss[1])
        .push(ss[2])
        .push(ss[3])
        .push(sdq);
    let grid = (nb as u32, tq.div_ceil(family.block_rows()) as u32);
    launch(
        dev,
        (family, Stage::Dq, keep.is_some()),
        dtype,
        tile,
        grid,
        &mut a,
    )?;
    let which = |i: usize| if storages.len() == 1 { 0 } else { i };
    Ok(Some(AttentionGrads {
        grads: [(which(0), dq_l), (which(1), dk_l), (which(2), dv_l)],
        storages,
    }))
}

/// Checks the output gradient's rows and columns and the log-sum-exps' count against `shape`.
fn check_saved(gv: &View<'_>, lse: &Layout, shape: &AttnShape) -> Result<()> {
    const OP: &str = "scaled_dot_product_attention_backward";
    let (nb, tq, dvn) = (shape.batch as usize, shape.tq as usize, shape.dv as usize);
    if gv.rows() != tq || gv.cols() != dvn {
        return Err(kiln_core::Error::invalid(
            OP,
            format!(
                "expects an output gradient [.., {tq}, {dvn}], got {}",
                gv.layout.shape()
            ),
        ));
    }
    if lse.elem_count() != nb * tq {
        return Err(kiln_core::Error::invalid(
            OP,
            format!(
                "expects the forward's log-sum-exp [.., {tq}], got {}",
                lse.shape()
            ),
        ));
    }
    Ok(())
}

/// The layouts of `dq`, `dk`, `dv` for the operands `q`, `k`, `v` (module docs), with the
/// element count of their one buffer when they are the head views of one packed projection.
pub(crate) fn grad_layouts(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
) -> (Option<usize>, [Layout; 3]) {
    match packed_grads(q, k, v) {
        Some((n, ls)) => (Some(n), ls),
        None => (
            None,
            [
                out_layout(q.1, q.1.dims().to_vec()),
                out_layout(k.1, k.1.dims().to_vec()),
                out_layout(v.1, v.1.dims().to_vec()),
            ],
        ),
    }
}

/// The storages of the three gradients laid out as `layouts` (fresh, offset 0): one of `packed`
/// elements when [`grad_layouts`] found a packed projection, else one each.
pub(crate) fn grad_storages(
    dev: &'static crate::device::DeviceState,
    packed: Option<usize>,
    layouts: [&Layout; 3],
    dtype: DType,
) -> Result<Vec<Buffer>> {
    let size = dtype.size_in_bytes();
    match packed {
        Some(n) => Ok(vec![alloc(dev, n * size)?]),
        None => layouts
            .iter()
            .map(|l| alloc(dev, l.elem_count() * size))
            .collect(),
    }
}

/// When `q`, `k`, `v` are the three head views of one packed projection (one buffer,
/// `kiln_core::attention_packed_layouts`, unit head stride): the element count of one buffer
/// for their three gradients and the gradients' layouts in it.
fn packed_grads(
    q: Operand<'_, Buffer>,
    k: Operand<'_, Buffer>,
    v: Operand<'_, Buffer>,
) -> Option<(usize, [Layout; 3])> {
    let (p, l) = (q.0.device_ptr(), q.1);
    if p != k.0.device_ptr() || p != v.0.device_ptr() || l.strides()[l.rank() - 1] != 1 {
        return None;
    }
    attention_packed_layouts(q.1, k.1, v.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_struct_matches_the_kernel() {
        // 15 u64 + 4 f32 + 2 i32, then the mask's address, its batch strides (8 u64 and an
        // offset), its two strides and its summary's address.
        assert_eq!(std::mem::size_of::<AttnShape>(), 144 + 8 + 72 + 16 + 8 + 8);
    }
}
