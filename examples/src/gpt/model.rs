//! nanoGPT's model (`model.py`) with `bias=False`, built from kiln-nn's layers.
//!
//! Token and learned position embeddings, `n_layer` pre-LayerNorm blocks (LN → causal
//! self-attention with one fused QKV projection → residual; LN → MLP 4× with GELU → residual),
//! a final LayerNorm and an output layer tied to the token embedding. The attention is
//! [`MultiheadAttention`] with [`AttnMask::Causal`] (its `in_proj_weight` is nanoGPT's
//! `c_attn.weight`, its `out_proj` nanoGPT's `c_proj`), so kiln-autograd's attention does the
//! work (on the GPU one fused flash-style kernel a pass, reading the packed projection in
//! place; on the CPU two batched products around one masked-softmax node) and the example adds
//! no op of its own.
//!
//! Initialization is nanoGPT's `_init_weights`: every weight matrix and embedding `N(0, 0.02)`,
//! the two projections back into the residual stream `N(0, 0.02/√(2·n_layer))`, LayerNorm
//! weights ones. GELU is the exact (erf) form, as nanoGPT's `nn.GELU()`.

use kiln_autograd::{AttnMask, Var};
use kiln_core::{Backend, DType, Error, Generator, Result, Tensor};
use kiln_nn::{
    Dropout, Embedding, EmbeddingConfig, Gelu, Init, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, Module, MultiheadAttention, MultiheadAttentionConfig,
};

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// Context length (`block_size`).
    pub block: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// Width (`n_embd`).
    pub n_embd: usize,
    pub dropout: f64,
}

impl GptConfig {
    /// Errors for a zero size, a width that the heads do not divide, or a dropout outside
    /// `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("block", self.block),
            ("layers", self.n_layer),
            ("heads", self.n_head),
            ("width", self.n_embd),
        ];
        for (name, v) in sizes {
            if v == 0 {
                return Err(Error::invalid(
                    "GptConfig",
                    format!("{name} must be positive"),
                ));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Error::invalid(
                "GptConfig",
                format!(
                    "width {} must be a multiple of heads {}",
                    self.n_embd, self.n_head
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::invalid(
                "GptConfig",
                format!("dropout must be in [0, 1), got {}", self.dropout),
            ));
        }
        Ok(())
    }
}

fn normal(std: f64) -> Init {
    Init::Normal { mean: 0.0, std }
}

fn prefixed<B: Backend>(prefix: &str, v: Vec<(String, Var<B>)>) -> Vec<(String, Var<B>)> {
    v.into_iter()
        .map(|(n, p)| (format!("{prefix}.{n}"), p))
        .collect()
}

/// One transformer block.
pub struct Block<B: Backend> {
    ln_1: LayerNorm<B>,
    attn: MultiheadAttention<B>,
    attn_drop: Dropout,
    ln_2: LayerNorm<B>,
    c_fc: Linear<B>,
    c_proj: Linear<B>,
    mlp_drop: Dropout,
}

impl<B: Backend> Block<B> {
    fn new(c: &GptConfig, dev: &B::Device, g: &mut Generator) -> Result<Self> {
        let n = c.n_embd;
        let proj_std = 0.02 / ((2 * c.n_layer) as f64).sqrt();
        let ln = || LayerNormConfig::new([n]).with_bias(false).init::<B>(dev);
        let ln_1 = ln()?;
        let mut attn = MultiheadAttentionConfig::new(n, c.n_head)
            .with_bias(false)
            .with_dropout(c.dropout)
            .init::<B>(dev, g)?;
        attn.in_proj_weight = Var::param(normal(0.02).init::<B>([3 * n, n], g, DType::F32, dev)?);
        attn.out_proj = LinearConfig::new(n, n)
            .with_bias(false)
            .with_weight_init(normal(proj_std))
            .init::<B>(dev, g)?;
        Ok(Block {
            ln_1,
            attn,
            attn_drop: Dropout::new(c.dropout, g)?,
            ln_2: ln()?,
            c_fc: LinearConfig::new(n, 4 * n)
                .with_bias(false)
                .with_weight_init(normal(0.02))
                .init::<B>(dev, g)?,
            c_proj: LinearConfig::new(4 * n, n)
                .with_bias(false)
                .with_weight_init(normal(proj_std))
                .init::<B>(dev, g)?,
            mlp_drop: Dropout::new(c.dropout, g)?,
        })
    }
}

impl<B: Backend> Module<B> for Block<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        let h = self.ln_1.forward(x)?;
        let a = self.attn.forward_qkv(&h, &h, &h, &AttnMask::Causal)?;
        let x = x.add(&self.attn_drop.forward(&a)?)?;
        let h = Gelu.forward(&self.c_fc.forward(&self.ln_2.forward(&x)?)?)?;
        let m = self.mlp_drop.forward(&self.c_proj.forward(&h)?)?;
        x.add(&m)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed("ln_1", self.ln_1.named_parameters());
        v.extend(prefixed("attn", self.attn.named_parameters()));
        v.extend(prefixed("ln_2", self.ln_2.named_parameters()));
        v.extend(prefixed("mlp.c_fc", self.c_fc.named_parameters()));
        v.extend(prefixed("mlp.c_proj", self.c_proj.named_parameters()));
        v
    }
    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
        self.attn_drop.set_training(training);
        self.mlp_drop.set_training(training);
    }
    fn describe(&self) -> String {
        format!(
            "Block({}, {}, mlp {} -> {})",
            self.ln_1.describe(),
            self.attn.describe(),
            self.c_fc.out_features(),
            self.c_proj.out_features()
        )
    }
}

/// The GPT: token ids `[b, t]` in, logits `[b, t, vocab]` out.
pub struct Gpt<B: Backend> {
    config: GptConfig,
    wte: Embedding<B>,
    wpe: Embedding<B>,
    drop: Dropout,
    blocks: Vec<Block<B>>,
    ln_f: LayerNorm<B>,
    lm_head: Linear<B>,
}

impl<B: Backend> Gpt<B> {
    /// A model of shape `config` on `dev`, its parameters drawn from `g`.
    pub fn new(config: GptConfig, dev: &B::Device, g: &mut Generator) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let wte = EmbeddingConfig::new(c.vocab_size, c.n_embd)
            .with_init(normal(0.02))
            .init::<B>(dev, g)?;
        let wpe = EmbeddingConfig::new(c.block, c.n_embd)
            .with_init(normal(0.02))
            .init::<B>(dev, g)?;
        let drop = Dropout::new(c.dropout, g)?;
        let blocks = (0..c.n_layer)
            .map(|_| Block::new(c, dev, g))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNormConfig::new([c.n_embd])
            .with_bias(false)
            .init::<B>(dev)?;
        // nanoGPT's `self.transformer.wte.weight = self.lm_head.weight`: one parameter.
        let mut lm_head = LinearConfig::new(c.n_embd, c.vocab_size)
            .with_bias(false)
            .with_weight_init(Init::Zeros)
            .init::<B>(dev, g)?;
        lm_head.tie_weight(&wte.weight)?;
        Ok(Gpt {
            config,
            wte,
            wpe,
            drop,
            blocks,
            ln_f,
            lm_head,
        })
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Logits `[b, t, vocab]` for token ids `ids` (`i64 [b, t]`, `t` at most the context).
    pub fn logits(&self, ids: &Tensor<B>) -> Result<Var<B>> {
        let t = match ids.dims() {
            [_, t] if *t <= self.config.block => *t,
            d => {
                return Err(Error::invalid(
                    "Gpt::logits",
                    format!(
                        "expects ids [batch, t] with t at most {}, got {d:?}",
                        self.config.block
                    ),
                ));
            }
        };
        let pos = Tensor::<B>::from_vec((0..t as i64).collect::<Vec<_>>(), [t], ids.device())?;
        let x = self.wte.lookup(ids)?.add(&self.wpe.lookup(&pos)?)?;
        let mut x = self.drop.forward(&x)?;
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        self.lm_head.forward(&self.ln_f.forward(&x)?)
    }

    /// Mean cross-entropy of the logits for `ids` against `targets` (both `i64 [b, t]`).
    pub fn loss(&self, ids: &Tensor<B>, targets: &Tensor<B>) -> Result<Var<B>> {
        let logits = self.logits(ids)?;
        let v = self.config.vocab_size;
        let n = targets.elem_count();
        logits
            .reshape([n, v])?
            .cross_entropy(&targets.reshape([n])?, kiln_core::Reduction::Mean)
    }
}

impl<B: Backend> Module<B> for Gpt<B> {
    /// Logits of the ids in `x` (a constant `i64 [b, t]`); see [`Gpt::logits`].
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.logits(&x.tensor())
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed("transformer.wte", self.wte.named_parameters());
        v.extend(prefixed("transformer.wpe", self.wpe.named_parameters()));
        for (i, b) in self.blocks.iter().enumerate() {
            v.extend(prefixed(
                &format!("transformer.h.{i}"),
                b.named_parameters(),
            ));
        }
        v.extend(prefixed("transformer.ln_f", self.ln_f.named_parameters()));
        v.extend(prefixed("lm_head", self.lm_head.named_parameters()));
        v
    }
    fn set_training(&mut self, training: bool) {
        self.drop.set_training(training);
        for b in &mut self.blocks {
            b.set_training(training);
        }
    }
    fn describe(&self) -> String {
        format!(
            "Gpt({} layers, {} heads, width {}, context {}, vocab {}, dropout {})",
            self.config.n_layer,
            self.config.n_head,
            self.config.n_embd,
            self.config.block,
            self.config.vocab_size,
            self.config.dropout
        )
    }
}
