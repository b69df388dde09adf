//! Multi-head attention (`torch.nn.MultiheadAttention` with `batch_first=True`).
//!
//! One fused input projection: `in_proj_weight` `[3E, E]` holds the query, key and value
//! projections stacked (PyTorch's layout and name, so a PyTorch state dict loads unchanged), and
//! self-attention (query, key and value the same variable) runs it as one product
//! `x · in_proj_weightᵀ` of width `3E` and attends over the packed result in one node
//! ([`Var::packed_self_attention`]: on a fused backend the output comes back `[.., L, E]` and
//! the gradient as one `[.., L, 3E]` buffer, with no head transposes or zero-padded slices).
//! Cross-attention projects the three apart; its heads are a reshape and a transpose
//! (`[.., L, E]` → `[.., H, L, E/H]`) into [`Var::scaled_dot_product_attention`]. `out_proj`
//! is a [`Linear`].
//!
//! Initialization is PyTorch's `_reset_parameters`: `in_proj_weight` Xavier uniform (fans
//! `E` and `3E`), `out_proj.weight` the Linear default (Kaiming uniform with `a = √5`), both
//! biases zeros. The numbers differ from PyTorch's (another generator), the distributions not.
//!
//! Masks are [`AttnMask`]s, broadcast to `[.., H, L, S]`: [`AttnMask::Keep`] is nonzero where
//! attention is *allowed*, as in `F.scaled_dot_product_attention` — the opposite of
//! `nn.MultiheadAttention`'s boolean `attn_mask`, where `True` forbids. Not supported (yet):
//! `key_padding_mask` (pass a `Keep` mask of shape `[N, 1, 1, S]` instead), `kdim`/`vdim`
//! different from `E`, `add_bias_kv`, `add_zero_attn`, returning the attention weights.
//!
//! Dropout on the attention weights works as [`Dropout`](crate::Dropout)'s masks do: the
//! layer keeps a generator keyed by one draw of the one it is built with, and its `k`-th
//! training forward draws mask `k` of it, the same numbers on every backend.

use std::sync::atomic::{AtomicU64, Ordering};

use kiln_autograd::{AttnMask, Var};
use kiln_core::{Backend, DType, Error, Generator, Result};

use crate::init::Init;
use crate::linear::{Linear, LinearConfig};
use crate::module::{Module, prefixed};

/// Configuration of a [`MultiheadAttention`]
/// (`MultiheadAttentionConfig::new(384, 6).init::<B>(&dev, &mut generator)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MultiheadAttentionConfig {
    pub embed_dim: usize,
    pub num_heads: usize,
    /// Biases on the input and output projections (PyTorch's default: true).
    pub bias: bool,
    /// Dropout on the attention weights in training mode.
    pub dropout: f64,
    /// Inputs are `[N, L, E]`; only `true` is supported (and unbatched `[L, E]` works too).
    pub batch_first: bool,
    pub dtype: DType,
}

impl MultiheadAttentionConfig {
    pub fn new(embed_dim: usize, num_heads: usize) -> Self {
        MultiheadAttentionConfig {
            embed_dim,
            num_heads,
            bias: true,
            dropout: 0.0,
            batch_first: true,
            dtype: DType::F32,
        }
    }
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }
    pub fn with_batch_first(mut self, batch_first: bool) -> Self {
        self.batch_first = batch_first;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the parameters on `device`: `in_proj_weight`, then `out_proj.weight` drawn from
    /// `generator`, then one key for the dropout masks.
    pub fn init<B: Backend>(
        self,
        device: &B::Device,
        generator: &mut Generator,
    ) -> Result<MultiheadAttention<B>> {
        const OP: &str = "MultiheadAttentionConfig::init";
        let (e, h) = (self.embed_dim, self.num_heads);
        if e == 0 || h == 0 || e % h != 0 {
            return Err(Error::invalid(
                OP,
                format!("embed_dim must be a positive multiple of num_heads, got {e} and {h}"),
            ));
        }
        if !self.batch_first {
            return Err(Error::invalid(
                OP,
                "only batch_first = true ([N, L, E] inputs) is supported",
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::invalid(
                OP,
                format!("dropout must be in [0, 1), got {}", self.dropout),
            ));
        }
        let in_w = Init::XavierUniform { gain: 1.0 }.init::<B>(
            [3 * e, e],
            generator,
            self.dtype,
            device,
        )?;
        let in_b = if self.bias {
            Some(Var::param(Init::Zeros.init::<B>(
                [3 * e],
                generator,
                self.dtype,
                device,
            )?))
        } else {
            None
        };
        let out_proj = LinearConfig::new(e, e)
            .with_bias(self.bias)
            .with_bias_init(Init::Zeros)
            .with_dtype(self.dtype)
            .init::<B>(device, generator)?;
        Ok(MultiheadAttention {
            in_proj_weight: Var::param(in_w),
            in_proj_bias: in_b,
            out_proj,
            num_heads: h,
            dropout: self.dropout,
            generator: Generator::new(generator.next_key()),
            step: AtomicU64::new(0),
            training: true,
        })
    }
}

/// The parameters of [`multi_head_attention`], borrowed.
#[derive(Clone, Copy)]
pub struct MhaWeights<'a, B: Backend> {
    /// `[3E, E]`: the query, key and value projections stacked.
    pub in_proj_weight: &'a Var<B>,
    /// `[3E]`.
    pub in_proj_bias: Option<&'a Var<B>>,
    /// `[E, E]`.
    pub out_weight: &'a Var<B>,
    /// `[E]`.
    pub out_bias: Option<&'a Var<B>>,
}

/// Multi-head attention as a function (PyTorch's `F.multi_head_attention_forward`, batch
/// first): `query` `[.., L, E]`, `key` and `value` `[.., S, E]`, `num_heads` dividing `E`;
/// returns `[.., L, E]`. When `query`, `key` and `value` are the same variable, the input
/// projection is one product. `dropout_p > 0` needs `generator`, as
/// [`Var::scaled_dot_product_attention`].
pub fn multi_head_attention<B: Backend>(
    (query, key, value): (&Var<B>, &Var<B>, &Var<B>),
    num_heads: usize,
    w: MhaWeights<'_, B>,
    mask: &AttnMask<B>,
    dropout_p: f64,
    generator: Option<&mut Generator>,
) -> Result<Var<B>> {
    const OP: &str = "multi_head_attention";
    let e = w.in_proj_weight.dims().get(1).copied().unwrap_or(0);
    if w.in_proj_weight.dims() != [3 * e, e] || num_heads == 0 || e % num_heads != 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "expects in_proj_weight [3E, E] with E a multiple of num_heads, got {} and {num_heads} heads",
                w.in_proj_weight.shape()
            ),
        ));
    }
    for (name, x) in [("query", query), ("key", key), ("value", value)] {
        if x.rank() < 2 || x.dims()[x.rank() - 1] != e {
            return Err(Error::invalid(
                OP,
                format!("{name} must be [.., L, {e}], got shape {}", x.shape()),
            ));
        }
    }
    if query.ptr_eq(key) && key.ptr_eq(value) {
        // Self-attention: one projection, one attention node over its packed result.
        let qkv = query.linear(w.in_proj_weight, w.in_proj_bias)?;
        let y = qkv.packed_self_attention(num_heads, mask, dropout_p, None, generator)?;
        return y.linear(w.out_weight, w.out_bias);
    }
    let third = |t: &Var<B>, i: usize| t.narrow(0, i * e, e);
    let mut proj = Vec::with_capacity(3);
    for (i, x) in [query, key, value].into_iter().enumerate() {
        let b = w.in_proj_bias.map(|b| third(b, i)).transpose()?;
        proj.push(x.linear(&third(w.in_proj_weight, i)?, b.as_ref())?);
    }
    // [.., T, E] -> [.., H, T, E/H].
    let heads = |x: &Var<B>| {
        let mut d = x.dims();
        let t = d.len() - 1;
        d[t] = num_heads;
        d.push(e / num_heads);
        x.reshape(d)?.transpose(-3, -2)
    };
    let y = heads(&proj[0])?.scaled_dot_product_attention(
        &heads(&proj[1])?,
        &heads(&proj[2])?,
        mask,
        dropout_p,
        None,
        generator,
    )?;
    // [.., H, L, E/H] -> [.., L, E] (free when the attention came back heads-last).
    let y = y.transpose(-3, -2)?;
    let mut d = y.dims();
    d.truncate(d.len() - 2);
    d.push(e);
    y.reshape(d)?.linear(w.out_weight, w.out_bias)
}

/// Multi-head attention with PyTorch's parameters (`in_proj_weight`, `in_proj_bias`,
/// `out_proj.weight`, `out_proj.bias`), initialized as PyTorch (`in_proj_weight` Xavier uniform,
/// `out_proj.weight` the Linear default, biases zeros). Masks are [`AttnMask`]s, whose `Keep`
/// is nonzero where attention is *allowed* (as in `F.scaled_dot_product_attention`; the
/// opposite of this PyTorch module's boolean `attn_mask`). PyTorch's `key_padding_mask` `[N, S]`
/// (`True` = padding) is [`AttnMask::key_padding`]; no `kdim`/`vdim`, no returned weights.
pub struct MultiheadAttention<B: Backend> {
    /// `[3E, E]`.
    pub in_proj_weight: Var<B>,
    /// `[3E]`.
    pub in_proj_bias: Option<Var<B>>,
    pub out_proj: Linear<B>,
    num_heads: usize,
    dropout: f64,
    /// The layer's own generator; the dropout mask of training forward `k` is its draw `k`.
    generator: Generator,
    step: AtomicU64,
    training: bool,
}

impl<B: Backend> MultiheadAttention<B> {
    pub fn embed_dim(&self) -> usize {
        self.in_proj_weight.dims()[1]
    }
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }
    pub fn dropout(&self) -> f64 {
        self.dropout
    }
    /// How many dropout masks have been drawn (the next training forward uses this index).
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed)
    }

    /// Attention of `query` `[.., L, E]` over `key` and `value` `[.., S, E]`, returning
    /// `[.., L, E]`. Pass the same variable three times for self-attention (one fused
    /// projection). Dropout applies in training mode only.
    pub fn forward_qkv(
        &self,
        query: &Var<B>,
        key: &Var<B>,
        value: &Var<B>,
        mask: &AttnMask<B>,
    ) -> Result<Var<B>> {
        let w = MhaWeights {
            in_proj_weight: &self.in_proj_weight,
            in_proj_bias: self.in_proj_bias.as_ref(),
            out_weight: &self.out_proj.weight,
            out_bias: self.out_proj.bias.as_ref(),
        };
        let qkv = (query, key, value);
        if self.training && self.dropout > 0.0 {
            let mut g = self.generator.clone();
            g.set_draws(self.step.fetch_add(1, Ordering::Relaxed));
            multi_head_attention(qkv, self.num_heads, w, mask, self.dropout, Some(&mut g))
        } else {
            multi_head_attention(qkv, self.num_heads, w, mask, 0.0, None)
        }
    }
}

impl<B: Backend> Module<B> for MultiheadAttention<B> {
    /// Self-attention of `x` with no mask (use [`MultiheadAttention::forward_qkv`] for masks
    /// and cross-attention).
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.forward_qkv(x, x, x, &AttnMask::None)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = vec![("in_proj_weight".to_string(), self.in_proj_weight.clone())];
        if let Some(b) = &self.in_proj_bias {
            v.push(("in_proj_bias".to_string(), b.clone()));
        }
        v.extend(prefixed("out_proj", self.out_proj.named_parameters()));
        v
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    fn describe(&self) -> String {
        format!(
            "MultiheadAttention(embed_dim={}, num_heads={}, bias={}, dropout={})",
            self.embed_dim(),
            self.num_heads,
            self.in_proj_bias.is_some(),
            self.dropout
        )
    }
}
