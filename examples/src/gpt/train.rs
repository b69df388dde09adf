//! nanoGPT's `train.py` loop: AdamW with weight decay on the matrices only, gradient clipping
//! by global norm on the device, warmup then cosine decay, periodic evaluation of both splits.
//!
//! nanoGPT puts every parameter of rank ≥ 2 (weight matrices, embeddings) in a group with
//! weight decay and the rest (LayerNorm weights) in one without. kiln's optimizers have no
//! parameter groups, so the two groups are two [`AdamW`]s stepped together. The schedule is
//! nanoGPT's `get_lr` written with kiln-optim's pieces: [`LinearWarmup`] with start factor
//! `1/(warmup+1)` gives `lr·(it+1)/(warmup+1)` over the warmup, and [`CosineAnnealing`] over
//! `lr_decay_iters − warmup` steps decays to `min_lr` and stays there.
//!
//! Losses are read from the device only at evaluations (reading one every step would make
//! the host wait for the GPU every step), and the time per iteration is measured between
//! evaluations, after a synchronization, so it excludes them.

use std::time::Instant;

use kiln_autograd::{autocast, no_grad};
use kiln_core::{Backend, DType, Generator, Result, sample_logits};
use kiln_nn::{Module, ModuleExt};
use kiln_optim::{AdamW, AdamWConfig, CosineAnnealing, LinearWarmup, LrSchedule, Optimizer};

use super::data::{CharData, Split};
use super::model::{Gpt, GptConfig};

/// What a training run does besides the model's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    pub model: GptConfig,
    pub batch: usize,
    pub iters: usize,
    pub eval_interval: usize,
    pub eval_iters: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: usize,
    pub weight_decay: f64,
    pub betas: (f64, f64),
    pub grad_clip: f64,
    pub seed: u64,
    /// Mixed precision: the forward and the loss run under `autocast(dtype)` (bf16, as
    /// nanoGPT's `dtype = 'bfloat16'`); `None` is f32. The parameters and AdamW stay f32.
    pub autocast: Option<DType>,
}

impl TrainConfig {
    /// nanoGPT's `shakespeare_char` hyperparameters around a model of shape `model`.
    pub fn nanogpt(model: GptConfig, batch: usize, iters: usize) -> Self {
        TrainConfig {
            model,
            batch,
            iters,
            eval_interval: 250,
            eval_iters: 200,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup: 100,
            weight_decay: 0.1,
            betas: (0.9, 0.99),
            grad_clip: 1.0,
            autocast: None,
            seed: 1337,
        }
    }

    /// nanoGPT's `get_lr` (`lr_decay_iters` = `iters`).
    pub fn schedule(&self) -> impl LrSchedule {
        LinearWarmup {
            warmup: self.warmup,
            start_factor: 1.0 / (self.warmup as f64 + 1.0),
            after: CosineAnnealing {
                base: self.lr,
                t_max: self.iters.saturating_sub(self.warmup),
                eta_min: self.min_lr,
            },
        }
    }
}

/// One evaluation: mean losses of both splits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalPoint {
    pub iter: usize,
    pub train_loss: f64,
    pub val_loss: f64,
    /// Mean milliseconds per training iteration since the previous evaluation (`None` at 0).
    pub ms_per_iter: Option<f64>,
}

/// The model's two AdamWs: decayed matrices and undecayed vectors.
struct Optimizers<B: Backend>(AdamW<B>, AdamW<B>);

impl<B: Backend> Optimizers<B> {
    fn new(model: &Gpt<B>, c: &TrainConfig) -> Result<Self> {
        let (decay, no_decay): (Vec<_>, Vec<_>) =
            model.parameters().into_iter().partition(|p| p.rank() >= 2);
        let cfg = AdamWConfig::new(c.lr).with_betas(c.betas.0, c.betas.1);
        Ok(Optimizers(
            cfg.with_weight_decay(c.weight_decay).init(decay)?,
            cfg.with_weight_decay(0.0).init(no_decay)?,
        ))
    }
    fn set_lr(&mut self, lr: f64) {
        self.0.set_lr(lr);
        self.1.set_lr(lr);
    }
    fn zero_grad(&self) {
        self.0.zero_grad();
        self.1.zero_grad();
    }
    fn step(&mut self) -> Result<()> {
        self.0.step()?;
        self.1.step()
    }
}

/// Mean loss over `c.eval_iters` batches of each split, in evaluation mode (no dropout) and
/// without a graph; the model is back in training mode afterwards.
pub fn estimate_loss<B: Backend>(
    model: &mut Gpt<B>,
    data: &CharData,
    c: &TrainConfig,
    g: &mut Generator,
    dev: &B::Device,
) -> Result<(f64, f64)> {
    model.eval();
    let r = no_grad(|| {
        let mut out = [0.0; 2];
        for (k, split) in [Split::Train, Split::Val].into_iter().enumerate() {
            let mut sum = None;
            for _ in 0..c.eval_iters.max(1) {
                let (x, y) = data.batch::<B>(split, c.batch, c.model.block, g, dev)?;
                let _amp = c.autocast.map(autocast).transpose()?;
                let l = model.loss(&x, &y)?.tensor();
                sum = Some(match sum {
                    None => l,
                    Some(s) => l.add(&s)?,
                });
            }
            if let Some(s) = sum {
                out[k] = s.to_scalar()? / c.eval_iters.max(1) as f64;
            }
        }
        Ok::<_, kiln_core::Error>((out[0], out[1]))
    });
    model.train();
    r
}

/// Trains `model` for `c.iters` iterations, evaluating at 0, every `c.eval_interval` and at
/// the end; `report` sees each evaluation as it happens. Returns them all.
pub fn train<B: Backend>(
    model: &mut Gpt<B>,
    data: &CharData,
    c: &TrainConfig,
    dev: &B::Device,
    mut report: impl FnMut(&EvalPoint),
) -> Result<Vec<EvalPoint>> {
    let mut g = Generator::new(c.seed);
    let mut opt = Optimizers::new(model, c)?;
    let params = model.parameters();
    let schedule = c.schedule();
    let mut points = Vec::new();
    model.train();
    let (mut t0, mut since) = (Instant::now(), 0usize);
    for iter in 0..=c.iters {
        if iter.is_multiple_of(c.eval_interval.max(1)) || iter == c.iters {
            B::synchronize(dev)?;
            let ms = (since > 0).then(|| t0.elapsed().as_secs_f64() * 1e3 / since as f64);
            let (train_loss, val_loss) = estimate_loss(model, data, c, &mut g, dev)?;
            let p = EvalPoint {
                iter,
                train_loss,
                val_loss,
                ms_per_iter: ms,
            };
            report(&p);
            points.push(p);
            B::synchronize(dev)?;
            (t0, since) = (Instant::now(), 0);
        }
        if iter == c.iters {
            break;
        }
        opt.set_lr(schedule.lr(iter));
        let (x, y) = data.batch::<B>(Split::Train, c.batch, c.model.block, &mut g, dev)?;
        let loss = {
            let _amp = c.autocast.map(autocast).transpose()?;
            model.loss(&x, &y)?
        };
        loss.backward()?;
        kiln_optim::clip_grad_norm(&params, c.grad_clip)?;
        opt.step()?;
        opt.zero_grad();
        since += 1;
    }
    Ok(points)
}

/// Generates `n` characters after `prompt` (nanoGPT's `generate`: the context cropped to the
/// last `block` tokens, logits of the last position, a sample at `temperature` among the
/// `top_k` likeliest), in evaluation mode. Characters of `prompt` outside the vocabulary are
/// skipped; an empty prompt starts from token 0.
pub fn generate<B: Backend>(
    model: &mut Gpt<B>,
    data: &CharData,
    prompt: &str,
    n: usize,
    (temperature, top_k): (f64, Option<usize>),
    g: &mut Generator,
    dev: &B::Device,
) -> Result<String> {
    model.eval();
    let mut ids: Vec<i64> = prompt
        .chars()
        .filter_map(|c| data.encode_char(c).map(i64::from))
        .collect();
    if ids.is_empty() {
        ids.push(0);
    }
    let start = ids.len();
    let (block, v) = (model.config().block, model.config().vocab_size);
    let r = no_grad(|| {
        for _ in 0..n {
            let ctx = &ids[ids.len().saturating_sub(block)..];
            let t = ctx.len();
            let x = kiln_core::Tensor::<B>::from_slice(ctx, [1, t], dev)?;
            let logits = model.logits(&x)?.tensor();
            let last = logits.narrow(1, t - 1, 1)?.contiguous()?.reshape([1, v])?;
            let next = sample_logits(&last, temperature, top_k, g)?.to_vec::<i64>()?;
            ids.extend(next);
        }
        Ok::<_, kiln_core::Error>(())
    });
    model.train();
    r?;
    Ok(data.decode(&ids[start..]))
}
