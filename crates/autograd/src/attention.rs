//! Scaled dot-product attention on variables (PyTorch's `F.scaled_dot_product_attention`).
//!
//! # How it runs today
//!
//! `softmax(q kᵀ · scale + mask) · v`, built from ops every backend already has: two batched
//! `matmul`s (cuBLAS on a GPU), and between them one recorded node, the *masked softmax*, whose
//! forward and backward are a handful of tensor ops (a row max, `exp`, a row sum, `where`), so
//! it runs on the CPU and on CUDA with no kernel of its own and fuses on the GPU where the
//! recorder fuses elementwise chains. Its backward is softmax's closed form,
//! `ds = p · (g - Σ_row g·p)`.
//!
//! # Masks and fully masked rows
//!
//! A mask is [`AttnMask::Causal`] (PyTorch's `is_causal`: query `i` sees keys `j <= i`, aligned
//! top-left as PyTorch's), a boolean mask ([`AttnMask::Keep`], a `u8` tensor, nonzero where
//! attention is allowed, PyTorch's `attn_mask` of dtype `bool`) or an additive one
//! ([`AttnMask::Additive`], added to the scores, `-inf` to forbid). Either tensor broadcasts to
//! `[.., Tq, Tk]`. A row in which every key is masked has attention weights of 0 and an output
//! of 0 (PyTorch's math path since 2.5, `_safe_softmax`), not NaN: its row max is taken as 0,
//! so `exp(-inf - 0) = 0` everywhere and the division uses a row sum of 1. Its gradient is 0,
//! so it cannot poison the gradients of the unmasked rows (a NaN row would reach every key and
//! value through the products' backward).
//!
//! # The fused path (a backend's flash-attention kernel)
//!
//! Before composing, attention asks the backend for a fused kernel
//! ([`Backend::attention_forward`]): the CUDA backend runs FlashAttention-2's algorithm (tiles
//! of `q`, `k`, `v` in shared memory, an online softmax, the `T × T` matrix never stored) and
//! returns the output and each row's log-sum-exp. The result is ONE recorded node that saves
//! `q`, `k`, `v`, the output and the log-sum-exps; its backward is the backend's
//! [`Backend::attention_backward`], which recomputes the weights tile by tile from them. The
//! fused path is taken for no mask, the causal mask, a boolean mask (`u8`) or an additive one
//! (of the inputs' dtype; under autocast cast to the kernels' dtype), each viewed in the
//! scores' shape with zero strides where it broadcasts (a key-padding mask `[n, 1, 1, s]` is
//! read in place), with or without dropout, for q, k, v with the same batch axes, where the
//! backend offers the call (on CUDA: f32, and f16/bf16 on sm_80+, on cuDNN's engines first on
//! sm_90+, a tensor mask there as a bias added to the scores; head sizes up to 128; see
//! `kiln-backend-cuda/src/ops/attention.rs`). Dropout runs inside the kernels: the mask of
//! weight `n` comes from word `n % 4` of Philox counter `n / 4` under the key of the
//! generator's next draw — the very mask the composed path draws as a keep mask
//! (`RandDist::Keep`: the f32 uniforms `>= p`, whatever the dtype), so the two paths agree
//! with the same generator state. Everything else —
//! f64, the CPU and the reference backend — runs composed, as below, and that
//! composition is the reference the fused kernel is tested against. Under [`autocast`] the
//! fused path runs in the low dtype (PyTorch's autocast does the same for SDPA), with f32 math
//! inside the kernel. [`composed_attention`] turns the fused path off for the calling thread
//! (tests and benchmarks compare both on one device).
//!
//! The backend picks its outputs' layouts ([`kiln_core::attention_output_layout`]): for head
//! views of a `[.., T, H, d]` projection (multi-head attention's) the output and the gradients
//! come back heads-last, so the caller's transpose back and reshape to `[.., T, E]` are free;
//! for the three head views of one packed `[.., T, 3E]` projection the three gradients share
//! one buffer, which [`Var::packed_self_attention`] (`self_attention.rs`) hands on as the
//! projection's gradient.
//!
//! [`autocast`]: crate::autocast()
//!
//! # The composed path
//!
//! It materializes the `[.., Tq, Tk]` scores and weights (and keeps the weights for the
//! backward).

use std::cell::Cell;
use std::sync::Arc;

use kiln_core::backend::Operand;
use kiln_core::{
    AttentionGrads, AttentionSpec, AttnMaskOperand, Backend, CmpOp, DType, Error, Generator,
    RandDist, Result, Shape, Tensor, philox,
};

use crate::ops::softmax_backward;
use crate::var::Var;

const OP: &str = "scaled_dot_product_attention";

/// The mask of [`Var::scaled_dot_product_attention`].
pub enum AttnMask<B: Backend> {
    /// Every query sees every key.
    None,
    /// Query `i` sees keys `0..=i` (PyTorch's `is_causal=True`, top-left aligned when
    /// `Tq != Tk`).
    Causal,
    /// A `u8` tensor broadcastable to `[.., Tq, Tk]`: nonzero where the query may attend to the
    /// key (PyTorch's boolean `attn_mask`, `True` = take part).
    Keep(Tensor<B>),
    /// A float tensor of the inputs' dtype broadcastable to `[.., Tq, Tk]`, added to the scaled
    /// scores (`-inf` forbids a pair). It gets no gradient.
    Additive(Tensor<B>),
}

// Not derived: `#[derive(Default)]` would require `B: Default`, which backends are not.
#[allow(clippy::derivable_impls)]
impl<B: Backend> Default for AttnMask<B> {
    fn default() -> Self {
        AttnMask::None
    }
}

impl<B: Backend> AttnMask<B> {
    /// PyTorch's `key_padding_mask`: `padding` is `[n, s]` (any dtype), nonzero where key `s`
    /// of sequence `n` is padding and must be ignored (PyTorch's `True`). Returns the `Keep`
    /// mask `[n, 1, 1, s]`, which broadcasts over heads and queries of `[n, h, t, s]` scores.
    /// A query of a sequence that is all padding gets zeros (see
    /// [`Var::scaled_dot_product_attention`]). An error naming `key_padding` unless `padding`
    /// has rank 2.
    pub fn key_padding(padding: &Tensor<B>) -> Result<Self> {
        let &[n, s] = padding.dims() else {
            return Err(Error::invalid(
                "key_padding",
                format!(
                    "expects a padding mask [batch, keys], got shape {}",
                    padding.shape()
                ),
            ));
        };
        let keep = padding.compare_scalar(CmpOp::Eq, 0.0)?;
        Ok(AttnMask::Keep(keep.reshape([n, 1, 1, s])?))
    }
}

impl<B: Backend> Clone for AttnMask<B> {
    fn clone(&self) -> Self {
        match self {
            AttnMask::None => AttnMask::None,
            AttnMask::Causal => AttnMask::Causal,
            AttnMask::Keep(m) => AttnMask::Keep(m.clone()),
            AttnMask::Additive(m) => AttnMask::Additive(m.clone()),
        }
    }
}

impl<B: Backend> Var<B> {
    /// Attention of queries `self` `[.., Tq, d]` over keys `k` `[.., Tk, d]` and values `v`
    /// `[.., Tk, dv]` (batch and head axes leading, broadcast as `matmul` broadcasts):
    /// `softmax(q kᵀ · scale + mask) · v`, of shape `[.., Tq, dv]`, as PyTorch's
    /// `F.scaled_dot_product_attention`. `scale` defaults to `1/√d`. With `dropout_p > 0` the
    /// attention weights are dropped with probability `dropout_p` and the rest scaled by
    /// `1/(1 - dropout_p)`, the mask drawn from `generator` (required then); pass 0 outside
    /// training (a module does this in evaluation mode).
    ///
    /// A query row whose keys are all masked gets weights and output 0 (PyTorch's math path),
    /// never NaN, and a zero gradient. Without a mask, with the causal one or a boolean one
    /// (dropout or not), a backend with a fused kernel (CUDA) runs it in the flash-attention
    /// manner as one node (the `[.., Tq, Tk]` weights never stored); otherwise this runs as two
    /// batched products around one masked-softmax node (see `attention.rs`).
    ///
    /// Errors (each naming `scaled_dot_product_attention`): inputs of rank < 2, non-float or
    /// mixed dtypes, mismatched `d`, `Tk` or batch axes, a mask of the wrong dtype or shape, a
    /// `dropout_p` outside `[0, 1)`, a non-finite or non-positive `scale`, dropout without a
    /// generator; different devices are the products' `DeviceMismatch`.
    pub fn scaled_dot_product_attention(
        &self,
        k: &Self,
        v: &Self,
        mask: &AttnMask<B>,
        dropout_p: f64,
        scale: Option<f64>,
        generator: Option<&mut Generator>,
    ) -> Result<Self> {
        let (tq, tk, d) = check_inputs(self, k, v)?;
        let scale = check_scalars(OP, d, scale, dropout_p)?;
        let mut generator = generator;
        let dropout = (dropout_p > 0.0).then_some(dropout_p);
        if let Some(y) = fused(self, k, v, mask, dropout, scale, generator.as_deref_mut())? {
            return Ok(y);
        }
        let scores = self.matmul(&k.transpose(-2, -1)?)?.mul_scalar(scale)?;
        // Under autocast the products are low-precision and the softmax between them f32
        // (see `crate::autocast`); `p.matmul(v)` below casts the weights back down.
        let scores = scores.autocast_f32()?;
        let (keep, bias) = mask_tensors(mask, &scores, tq, tk)?;
        // A causal row keeps at least its first key: no row can be empty.
        let rows_nonempty = matches!(mask, AttnMask::Causal);
        let mut p = if keep.is_none() && bias.is_none() {
            scores.softmax(-1)?
        } else {
            masked_softmax(&scores, keep, bias, rows_nonempty)?
        };
        if dropout_p > 0.0 {
            let Some(generator) = generator else {
                return Err(Error::invalid(
                    OP,
                    format!("dropout_p = {dropout_p} needs a generator to draw its mask"),
                ));
            };
            // The keep mask `rand_like(p) >= dropout_p` drawn as bytes (`RandDist::Keep`).
            let t = p.tensor();
            let keep = RandDist::Keep { p: dropout_p };
            let m = generator
                .sample::<B>(t.shape().clone(), keep, DType::U8, t.device())?
                .to_dtype(p.dtype())?
                .mul_scalar(1.0 / (1.0 - dropout_p))?;
            p = p.mul(&Var::constant(m))?;
        }
        p.matmul(v)
    }
}

thread_local! {
    /// Whether [`composed_attention`] is in force on this thread.
    static COMPOSED: Cell<bool> = const { Cell::new(false) };
}

/// Restores the previous setting when dropped (see [`composed_attention`]).
pub struct ComposedAttentionGuard {
    prev: bool,
}

impl Drop for ComposedAttentionGuard {
    fn drop(&mut self) {
        COMPOSED.with(|c| c.set(self.prev));
    }
}

/// While the guard lives, [`Var::scaled_dot_product_attention`] on the calling thread never
/// asks the backend for its fused kernel and runs the composed path (two products and a
/// softmax): how tests and benchmarks compare the two on one device.
pub fn composed_attention() -> ComposedAttentionGuard {
    ComposedAttentionGuard {
        prev: COMPOSED.with(|c| c.replace(true)),
    }
}

/// A tensor as an operand of a backend's fused call.
fn operand<B: Backend>(t: &Tensor<B>) -> Operand<'_, B::Storage> {
    (t.storage(), t.layout())
}

/// What a fused kernel may be asked for `mask`: `Some((causal, tensor mask))` (a boolean or an
/// additive mask, which [`fused_forward`] passes on where its dtype and shape fit), or `None`
/// ([`composed_attention`] in force).
pub(crate) fn fusable_mask<B: Backend>(mask: &AttnMask<B>) -> Option<FusableMask<'_, B>> {
    let m = match mask {
        AttnMask::None => (false, None),
        AttnMask::Causal => (true, None),
        AttnMask::Keep(t) => (false, Some((MaskKind::Keep, t))),
        AttnMask::Additive(t) => (false, Some((MaskKind::Additive, t))),
    };
    (!COMPOSED.with(|c| c.get())).then_some(m)
}

/// Which tensor mask a fused call carries ([`AttnMaskOperand`]'s variants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MaskKind {
    Keep,
    Additive,
}

/// Whether the mask is causal, and the tensor mask (see [`fusable_mask`]).
pub(crate) type FusableMask<'a, B> = (bool, Option<(MaskKind, &'a Tensor<B>)>);

/// A tensor mask as an operand of the backend's call.
fn mask_operand<B: Backend>(
    m: &Option<(MaskKind, Tensor<B>)>,
) -> Option<AttnMaskOperand<'_, B::Storage>> {
    m.as_ref().map(|(kind, t)| match kind {
        MaskKind::Keep => AttnMaskOperand::Keep(operand(t)),
        MaskKind::Additive => AttnMaskOperand::Additive(operand(t)),
    })
}

/// The backend's fused forward on tensors, as [`fused`] and the packed self-attention run it.
pub(crate) struct FusedForward<B: Backend> {
    /// The output `[.., Tq, dv]` in the layout the backend chose.
    pub out: Tensor<B>,
    /// The row log-sum-exps `[.., Tq]`, f32.
    pub lse: Tensor<B>,
    /// What the backend kept of the dropout mask for its backward.
    pub mask: Option<B::Storage>,
    /// The tensor mask, viewed in the scores' shape `[.., Tq, Tk]`.
    pub attn_mask: Option<(MaskKind, Tensor<B>)>,
    pub spec: AttentionSpec,
}

/// Asks the backend for the fused forward of `q`, `k`, `v` (one dtype); `None` when it
/// declines. With dropout the mask's key is the generator's next draw, as the composed path's
/// `rand_like` would take it; the generator advances only when the backend accepts the call,
/// so a declined call leaves the composed path the same draw. Dropout without a generator is
/// the composed path's error (`None` here), and so is a boolean mask that is not `u8`, an
/// additive mask of another dtype (outside autocast, which casts it as the composed path does),
/// or a mask that does not broadcast to the scores' shape.
pub(crate) fn fused_forward<B: Backend>(
    (qt, kt, vt): (&Tensor<B>, &Tensor<B>, &Tensor<B>),
    (causal, attn_mask): FusableMask<'_, B>,
    (dropout, scale): (Option<f64>, f64),
    generator: Option<&mut Generator>,
) -> Result<Option<FusedForward<B>>> {
    let (dropout_p, dropout_key, generator) = match (dropout, generator) {
        (None, g) => (0.0, 0, g),
        (Some(_), None) => return Ok(None),
        (Some(p), Some(g)) => (p, philox::draw_key(g.initial_seed(), g.draws()), Some(g)),
    };
    let dtype = qt.dtype();
    if kt.dtype() != dtype || vt.dtype() != dtype {
        return Ok(None);
    }
    let attn_mask = match attn_mask {
        None => None,
        Some((kind, m)) => {
            let m = match kind {
                MaskKind::Keep if m.dtype() == DType::U8 => m.clone(),
                MaskKind::Additive if m.dtype() == dtype => m.clone(),
                // Under autocast a float mask follows the kernels' dtype (cast before it is
                // broadcast, so only its own elements are converted).
                MaskKind::Additive
                    if crate::autocast::autocast_dtype().is_some()
                        && m.dtype().is_float()
                        && m.dtype() != DType::F64 =>
                {
                    m.to_dtype(dtype)?
                }
                _ => return Ok(None),
            };
            // [.., Tq, Tk] (both callers checked q and k of rank >= 2).
            let mut scores = qt.dims().to_vec();
            *scores.last_mut().expect("rank >= 2") = kt.dims()[kt.rank() - 2];
            match m.broadcast_to(scores) {
                Ok(m) => Some((kind, m)),
                Err(_) => return Ok(None),
            }
        }
    };
    let spec = AttentionSpec {
        scale,
        causal,
        dropout_p,
        dropout_key,
    };
    let Some(((o, o_layout), lse, mask)) = B::attention_forward(
        operand(qt),
        operand(kt),
        operand(vt),
        mask_operand(&attn_mask),
        dtype,
        spec,
    )?
    else {
        return Ok(None);
    };
    if dropout_p > 0.0
        && let Some(g) = generator
    {
        g.next_key(); // the draw the kernels used
    }
    let mut dims = qt.dims().to_vec();
    dims.pop();
    let lse = Tensor::<B>::from_storage(lse, dims.clone(), DType::F32);
    dims.push(vt.dims()[vt.rank() - 1]);
    if o_layout.dims() != dims.as_slice() || o_layout.offset() != 0 {
        return Err(Error::backend(
            OP,
            format!(
                "the {} backend returned an output laid out as {:?}, expected shape {dims:?} at offset 0",
                B::NAME,
                o_layout
            ),
        ));
    }
    let out = Tensor::<B>::from_parts(Arc::new(o), o_layout, dtype);
    Ok(Some(FusedForward {
        out,
        lse,
        mask,
        attn_mask,
        spec,
    }))
}

/// The backend's fused backward for the forward `f` of `q`, `k`, `v` and the output gradient
/// `g`: `(dq, dk, dv)` in the layouts the backend chose (possibly views of one storage).
pub(crate) fn fused_backward<B: Backend>(
    (qt, kt, vt): (&Tensor<B>, &Tensor<B>, &Tensor<B>),
    f: &FusedForward<B>,
    g: &Tensor<B>,
) -> Result<[Tensor<B>; 3]> {
    let dtype = qt.dtype();
    let g = if g.dtype() == dtype {
        g.clone()
    } else {
        g.to_dtype(dtype)?
    };
    let grads = B::attention_backward(
        operand(qt),
        operand(kt),
        operand(vt),
        mask_operand(&f.attn_mask),
        operand(&f.out),
        operand(&f.lse),
        f.mask.as_ref(),
        operand(&g),
        dtype,
        f.spec,
    )?;
    let Some(AttentionGrads { storages, grads }) = grads else {
        return Err(Error::backend(
            OP,
            format!(
                "the {} backend fused the forward but offers no fused backward",
                B::NAME
            ),
        ));
    };
    let storages: Vec<Arc<B::Storage>> = storages.into_iter().map(Arc::new).collect();
    let mut out = Vec::with_capacity(3);
    for ((i, layout), t) in grads.into_iter().zip([qt, kt, vt]) {
        let Some(s) = storages.get(i) else {
            return Err(Error::backend(
                OP,
                format!(
                    "the {} backend's gradient names storage {i} of {}",
                    B::NAME,
                    storages.len()
                ),
            ));
        };
        if layout.shape() != t.shape() {
            return Err(Error::backend(
                OP,
                format!(
                    "the {} backend returned a gradient of shape {} for an operand of shape {}",
                    B::NAME,
                    layout.shape(),
                    t.shape()
                ),
            ));
        }
        out.push(Tensor::<B>::from_parts(s.clone(), layout, dtype));
    }
    let [dq, dk, dv]: [Tensor<B>; 3] = out
        .try_into()
        .map_err(|_| Error::backend(OP, "three gradients"))?;
    Ok([dq, dk, dv])
}

/// The fused path (module docs), or `None` when it does not apply or the backend does not
/// offer it for these operands. One node; its output and gradients come in the layouts the
/// backend chose (heads-last for head views of a `[.., T, H, d]` projection).
fn fused<B: Backend>(
    q: &Var<B>,
    k: &Var<B>,
    v: &Var<B>,
    mask: &AttnMask<B>,
    dropout: Option<f64>,
    scale: f64,
    generator: Option<&mut Generator>,
) -> Result<Option<Var<B>>> {
    let Some(mask) = fusable_mask(mask) else {
        return Ok(None);
    };
    if dropout.is_some() && generator.is_none() {
        return Ok(None);
    }
    let (q, k, v) = if crate::autocast::autocast_dtype().is_some() {
        (q.autocast_low()?, k.autocast_low()?, v.autocast_low()?)
    } else {
        (q.clone(), k.clone(), v.clone())
    };
    let (qt, kt, vt) = (q.tensor(), k.tensor(), v.tensor());
    let Some(f) = fused_forward((&qt, &kt, &vt), mask, (dropout, scale), generator)? else {
        return Ok(None);
    };
    let out = f.out.clone();
    let saved = (qt, kt, vt, f);
    Ok(Some(Var::from_op(OP, &[&q, &k, &v], out, move |g, _| {
        let (qt, kt, vt, f) = &saved;
        let [dq, dk, dv] = fused_backward((qt, kt, vt), f, g)?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    })))
}

/// The scale (default `1/√d`), checked finite and positive, and `dropout_p` checked in
/// `[0, 1)`; errors name `op`.
pub(crate) fn check_scalars(
    op: &'static str,
    d: usize,
    scale: Option<f64>,
    dropout_p: f64,
) -> Result<f64> {
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    if !scale.is_finite() || scale <= 0.0 {
        return Err(Error::invalid(
            op,
            format!("scale must be finite and positive, got {scale}"),
        ));
    }
    if !(0.0..1.0).contains(&dropout_p) {
        return Err(Error::invalid(
            op,
            format!("dropout_p must be in [0, 1), got {dropout_p}"),
        ));
    }
    Ok(scale)
}

/// Checks ranks, dtypes and the sizes that must agree; returns `(Tq, Tk, d)`.
fn check_inputs<B: Backend>(q: &Var<B>, k: &Var<B>, v: &Var<B>) -> Result<(usize, usize, usize)> {
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        if x.rank() < 2 {
            return Err(Error::invalid(
                OP,
                format!("{name} must be [.., T, d], got shape {}", x.shape()),
            ));
        }
        if !x.dtype().is_float() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: format!("a float dtype for {name}"),
                got: x.dtype(),
            });
        }
    }
    for x in [k, v] {
        if x.dtype() != q.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: format!("q's dtype {} for k and v", q.dtype()),
                got: x.dtype(),
            });
        }
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    let last2 = |d: &[usize]| (d[d.len() - 2], d[d.len() - 1]);
    let ((tq, d), (tk, dk), (tv, _)) = (last2(&qd), last2(&kd), last2(&vd));
    if d != dk || tk != tv {
        return Err(Error::invalid(
            OP,
            format!(
                "expects q [.., Tq, d], k [.., Tk, d], v [.., Tk, dv], got {}, {} and {}",
                q.shape(),
                k.shape(),
                v.shape()
            ),
        ));
    }
    let batch = |s: &[usize]| Shape::from(s[..s.len() - 2].to_vec());
    batch(&qd)
        .broadcast_with(OP, &batch(&kd))?
        .broadcast_with(OP, &batch(&vd))?;
    Ok((tq, tk, d))
}

/// A mask as a `u8` keep-mask and an additive tensor, each optional.
type MaskParts<B> = (Option<Tensor<B>>, Option<Tensor<B>>);

/// The mask as `(keep, bias)`: a `u8` keep-mask and/or an additive tensor, checked to
/// broadcast to the scores' shape.
fn mask_tensors<B: Backend>(
    mask: &AttnMask<B>,
    scores: &Var<B>,
    tq: usize,
    tk: usize,
) -> Result<MaskParts<B>> {
    let fits = |m: &Tensor<B>| -> Result<()> {
        let s = scores.shape();
        if m.rank() > s.rank() || s.broadcast_with(OP, m.shape())? != s {
            return Err(Error::invalid(
                OP,
                format!(
                    "the mask's shape {} does not broadcast to the scores' shape {s}",
                    m.shape()
                ),
            ));
        }
        if *m.device() != scores.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: scores.device().to_string(),
                rhs: m.device().to_string(),
            });
        }
        Ok(())
    };
    match mask {
        AttnMask::None => Ok((None, None)),
        AttnMask::Causal => {
            let dev = scores.device();
            let rows =
                Tensor::<B>::arange(0.0, tq as f64, 1.0, DType::I64, &dev)?.reshape([tq, 1])?;
            let cols =
                Tensor::<B>::arange(0.0, tk as f64, 1.0, DType::I64, &dev)?.reshape([1, tk])?;
            Ok((Some(cols.compare(CmpOp::Le, &rows)?), None))
        }
        AttnMask::Keep(m) => {
            if m.dtype() != DType::U8 {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: "a u8 (boolean) keep-mask".into(),
                    got: m.dtype(),
                });
            }
            fits(m)?;
            Ok((Some(m.clone()), None))
        }
        AttnMask::Additive(m) => {
            // Under autocast the scores' dtype is autocast's choice, not the user's: a float
            // mask follows it.
            let cast;
            let m = if crate::autocast::autocast_dtype().is_some()
                && m.dtype().is_float()
                && m.dtype() != DType::F64
                && m.dtype() != scores.dtype()
            {
                cast = m.to_dtype(scores.dtype())?;
                &cast
            } else {
                m
            };
            if m.dtype() != scores.dtype() {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: format!("an additive mask of the inputs' dtype {}", scores.dtype()),
                    got: m.dtype(),
                });
            }
            fits(m)?;
            Ok((None, Some(m.clone())))
        }
    }
}

/// Softmax over the last axis of `scores + bias`, restricted to the entries where `keep` is
/// nonzero; rows with no entry left are all zeros (and get a zero gradient). With
/// `rows_nonempty` (the caller knows every row keeps an entry) it is the backend's fused
/// softmax of the masked scores. One recorded node: it saves the weights only, and its backward
/// is softmax's.
fn masked_softmax<B: Backend>(
    scores: &Var<B>,
    keep: Option<Tensor<B>>,
    bias: Option<Tensor<B>>,
    rows_nonempty: bool,
) -> Result<Var<B>> {
    let mut s = scores.tensor();
    if let Some(b) = &bias {
        s = s.add(b)?;
    }
    let (dtype, dev) = (s.dtype(), s.device().clone());
    if let Some(k) = &keep {
        let neg_inf = Tensor::<B>::full(Shape::scalar(), f64::NEG_INFINITY, dtype, &dev)?;
        s = k.where_cond(&s, &neg_inf)?;
    }
    let p = if rows_nonempty {
        s.softmax(-1)?
    } else {
        // A row whose max is -inf has nothing left: shift it by 0 instead, so exp gives zeros.
        let zero = Tensor::<B>::zeros(Shape::scalar(), dtype, &dev)?;
        let one = Tensor::<B>::ones(Shape::scalar(), dtype, &dev)?;
        let m = s.max(&[-1], true)?;
        let m = m
            .compare_scalar(CmpOp::Gt, f64::NEG_INFINITY)?
            .where_cond(&m, &zero)?;
        let e = s.sub(&m)?.exp()?;
        let sum = e.sum(&[-1], true)?;
        let sum = sum.compare_scalar(CmpOp::Gt, 0.0)?.where_cond(&sum, &one)?;
        e.div(&sum)?
    };
    let pc = p.clone();
    Ok(Var::from_op("masked_softmax", &[scores], p, move |g, _| {
        Ok(vec![Some(softmax_backward(&pc, g, -1)?)])
    }))
}
