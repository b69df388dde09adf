//! Normalizations over channels: [`BatchNorm`] (`torch.nn.BatchNorm1d` / `BatchNorm2d`) and
//! [`GroupNorm`] (`torch.nn.GroupNorm`), over `[n, c, *]` inputs.
//!
//! Names and defaults are PyTorch's, so a state dict moves between the two unchanged:
//! parameters `weight` (ones) and `bias` (zeros), and for a batch norm that tracks running
//! statistics the *buffers* `running_mean` (zeros), `running_var` (ones) and
//! `num_batches_tracked` (a 0-d `i64`), listed by [`Module::named_buffers`] and so saved and
//! loaded with the parameters but never handed to an optimizer.
//!
//! A batch norm's mode matters: in training mode ([`Module::set_training`], on by default) it
//! normalizes with the batch's statistics and folds them into the running ones
//! (`momentum · batch + (1 - momentum) · running`, the unbiased batch variance, as PyTorch);
//! in evaluation mode it normalizes with the running statistics. A model forwards
//! `set_training` to its batch norms as to its dropouts. The math is
//! [`Var::batch_norm_train`] / [`Var::batch_norm_eval`] / [`Var::group_norm`]: one recorded op
//! each, forward and backward as expression programs on every backend.
//!
//! Under autocast a batch norm runs in its input's dtype, as PyTorch's: a bf16 convolution's
//! output gives a bf16 output, with the statistics computed in f32 and the weight, bias and
//! running statistics left f32 (see `kiln_autograd::autocast`).

use kiln_autograd::{Var, update_running_stats};
use kiln_core::{Backend, DType, Error, Result, Tensor};

use crate::module::Module;
use crate::norm::{affine_param, check_config, named};

/// Configuration of a [`BatchNorm`] (`BatchNormConfig::new(64).init_2d::<B>(&dev)`), with
/// PyTorch's defaults: `eps = 1e-5`, `momentum = 0.1`, affine, tracking running statistics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    /// The number of channels `c` (axis 1 of the input).
    pub num_features: usize,
    pub eps: f64,
    /// The weight of the batch in the running statistics; `None` for PyTorch's cumulative
    /// average (`1 / num_batches_tracked`).
    pub momentum: Option<f64>,
    /// A learned weight and bias.
    pub affine: bool,
    /// Running statistics (buffers), used in evaluation mode; without them the batch's
    /// statistics are used in both modes.
    pub track_running_stats: bool,
    pub dtype: DType,
}

impl BatchNormConfig {
    pub fn new(num_features: usize) -> Self {
        BatchNormConfig {
            num_features,
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
            dtype: DType::F32,
        }
    }
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    pub fn with_momentum(mut self, momentum: Option<f64>) -> Self {
        self.momentum = momentum;
        self
    }
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }
    pub fn with_track_running_stats(mut self, track: bool) -> Self {
        self.track_running_stats = track;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// A `BatchNorm1d`: inputs `[n, c]` or `[n, c, l]`.
    pub fn init_1d<B: Backend>(self, device: &B::Device) -> Result<BatchNorm<B>> {
        self.build("BatchNorm1d", &[2, 3], device)
    }
    /// A `BatchNorm2d`: inputs `[n, c, h, w]`.
    pub fn init_2d<B: Backend>(self, device: &B::Device) -> Result<BatchNorm<B>> {
        self.build("BatchNorm2d", &[4], device)
    }
    /// A batch norm over `[n, c, *]` of any rank from 2 (nothing is drawn: the parameters and
    /// buffers start at PyTorch's constants).
    pub fn init<B: Backend>(self, device: &B::Device) -> Result<BatchNorm<B>> {
        self.build("BatchNorm", &[], device)
    }

    fn build<B: Backend>(
        self,
        name: &'static str,
        ranks: &'static [usize],
        device: &B::Device,
    ) -> Result<BatchNorm<B>> {
        let c = self.num_features;
        check_config("BatchNormConfig::init", &[c], self.eps, self.dtype)?;
        if let Some(m) = self.momentum
            && !(0.0..=1.0).contains(&m)
        {
            return Err(Error::invalid(
                "BatchNormConfig::init",
                format!("momentum must be in [0, 1], got {m}"),
            ));
        }
        let buffer = |t: Tensor<B>| self.track_running_stats.then(|| Var::constant(t));
        Ok(BatchNorm {
            cfg: self,
            name,
            ranks,
            weight: affine_param::<B>(self.affine, true, &[c], self.dtype, device)?,
            bias: affine_param::<B>(self.affine, false, &[c], self.dtype, device)?,
            running_mean: buffer(Tensor::zeros([c], self.dtype, device)?),
            running_var: buffer(Tensor::ones([c], self.dtype, device)?),
            num_batches_tracked: buffer(Tensor::scalar(0i64, device)?),
            training: true,
        })
    }
}

/// Batch normalization over the channels (axis 1) of `[n, c, *]`: PyTorch's `BatchNorm1d`
/// ([`BatchNormConfig::init_1d`]) and `BatchNorm2d` ([`BatchNormConfig::init_2d`]).
pub struct BatchNorm<B: Backend> {
    cfg: BatchNormConfig,
    name: &'static str,
    /// The input ranks accepted (any from 2 when empty).
    ranks: &'static [usize],
    /// `[c]`; `None` without `affine`.
    pub weight: Option<Var<B>>,
    /// `[c]`; `None` without `affine`.
    pub bias: Option<Var<B>>,
    /// `[c]` buffers; `None` without `track_running_stats`.
    pub running_mean: Option<Var<B>>,
    pub running_var: Option<Var<B>>,
    /// 0-d `i64` buffer: the training forwards seen.
    pub num_batches_tracked: Option<Var<B>>,
    training: bool,
}

/// PyTorch's name for a [`BatchNorm`] over `[n, c, h, w]` ([`BatchNormConfig::init_2d`]).
pub type BatchNorm2d<B> = BatchNorm<B>;
/// PyTorch's name for a [`BatchNorm`] over `[n, c]` or `[n, c, l]`
/// ([`BatchNormConfig::init_1d`]).
pub type BatchNorm1d<B> = BatchNorm<B>;

impl<B: Backend> BatchNorm<B> {
    pub fn config(&self) -> &BatchNormConfig {
        &self.cfg
    }
    pub fn is_training(&self) -> bool {
        self.training
    }

    fn check(&self, x: &Var<B>) -> Result<()> {
        let rank_ok = if self.ranks.is_empty() {
            x.rank() >= 2
        } else {
            self.ranks.contains(&x.rank())
        };
        if !rank_ok || x.dims()[1] != self.cfg.num_features {
            let want = match self.ranks {
                [4] => "[n, c, h, w]",
                [2, 3] => "[n, c] or [n, c, l]",
                _ => "[n, c, *]",
            };
            return Err(Error::invalid(
                self.name,
                format!(
                    "expects an input {want} with c = {}, got shape {}",
                    self.cfg.num_features,
                    x.shape()
                ),
            ));
        }
        Ok(())
    }

    /// Folds a training batch's statistics into the running ones.
    fn track(&self, stats: &kiln_autograd::BatchStats<B>) -> Result<()> {
        let (Some(rm), Some(rv), Some(nbt)) = (
            &self.running_mean,
            &self.running_var,
            &self.num_batches_tracked,
        ) else {
            return Ok(());
        };
        let count = nbt.tensor().add_scalar(1.0)?;
        let momentum = match self.cfg.momentum {
            Some(m) => m,
            // The cumulative average reads the count (one synchronization).
            None => 1.0 / count.to_scalar()?,
        };
        let (m, v) = update_running_stats(&rm.tensor(), &rv.tensor(), stats, momentum)?;
        rm.set_tensor(m)?;
        rv.set_tensor(v)?;
        nbt.set_tensor(count)
    }
}

impl<B: Backend> Module<B> for BatchNorm<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.check(x)?;
        let (w, b) = (self.weight.as_ref(), self.bias.as_ref());
        let eps = self.cfg.eps;
        match (&self.running_mean, &self.running_var) {
            (Some(rm), Some(rv)) if !self.training => {
                x.batch_norm_eval(&rm.tensor(), &rv.tensor(), w, b, eps)
            }
            _ => {
                let (y, stats) = x.batch_norm_train(w, b, eps)?;
                if self.training {
                    self.track(&stats)?;
                }
                Ok(y)
            }
        }
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        named(&self.weight, &self.bias)
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        [
            ("running_mean", &self.running_mean),
            ("running_var", &self.running_var),
            ("num_batches_tracked", &self.num_batches_tracked),
        ]
        .into_iter()
        .filter_map(|(n, v)| v.as_ref().map(|v| (n.to_string(), v.clone())))
        .collect()
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "{}({}, eps={}, momentum={}, affine={}, track_running_stats={})",
            self.name,
            c.num_features,
            c.eps,
            c.momentum.map_or("None".into(), |m| m.to_string()),
            c.affine,
            c.track_running_stats
        )
    }
}

/// Configuration of a [`GroupNorm`] (`GroupNormConfig::new(32, 256).init::<B>(&dev)`), with
/// PyTorch's defaults: `eps = 1e-5`, an affine weight and bias per channel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupNormConfig {
    pub num_groups: usize,
    pub num_channels: usize,
    pub eps: f64,
    pub affine: bool,
    pub dtype: DType,
}

impl GroupNormConfig {
    pub fn new(num_groups: usize, num_channels: usize) -> Self {
        GroupNormConfig {
            num_groups,
            num_channels,
            eps: 1e-5,
            affine: true,
            dtype: DType::F32,
        }
    }
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the weight (ones) and bias (zeros) on `device`.
    pub fn init<B: Backend>(self, device: &B::Device) -> Result<GroupNorm<B>> {
        const OP: &str = "GroupNormConfig::init";
        let c = self.num_channels;
        check_config(OP, &[c], self.eps, self.dtype)?;
        if self.num_groups == 0 || !c.is_multiple_of(self.num_groups) {
            return Err(Error::invalid(
                OP,
                format!(
                    "num_channels {c} must be divisible by num_groups {} (> 0)",
                    self.num_groups
                ),
            ));
        }
        Ok(GroupNorm {
            cfg: self,
            weight: affine_param::<B>(self.affine, true, &[c], self.dtype, device)?,
            bias: affine_param::<B>(self.affine, false, &[c], self.dtype, device)?,
        })
    }
}

/// Group normalization of `[n, c, *]`: the channels in `num_groups` groups, each (sample,
/// group) normalized over its channels and positions, then a per-channel affine map.
pub struct GroupNorm<B: Backend> {
    cfg: GroupNormConfig,
    /// `[c]`; `None` without `affine`.
    pub weight: Option<Var<B>>,
    /// `[c]`; `None` without `affine`.
    pub bias: Option<Var<B>>,
}

impl<B: Backend> GroupNorm<B> {
    pub fn config(&self) -> &GroupNormConfig {
        &self.cfg
    }
}

impl<B: Backend> Module<B> for GroupNorm<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        if x.rank() < 2 || x.dims()[1] != self.cfg.num_channels {
            return Err(Error::invalid(
                "GroupNorm",
                format!(
                    "expects an input [n, {}, *], got shape {}",
                    self.cfg.num_channels,
                    x.shape()
                ),
            ));
        }
        x.group_norm(
            self.cfg.num_groups,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.cfg.eps,
        )
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        named(&self.weight, &self.bias)
    }
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "GroupNorm({}, {}, eps={}, affine={})",
            c.num_groups, c.num_channels, c.eps, c.affine
        )
    }
}
