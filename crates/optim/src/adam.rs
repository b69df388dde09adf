//! Adam and AdamW, exactly as `torch.optim.Adam` / `torch.optim.AdamW` compute them
//! (no amsgrad):
//!
//! ```text
//! t = t + 1
//! p = p * (1 - lr * weight_decay)             AdamW (decoupled decay)
//! g = grad + weight_decay * p                  Adam (L2 penalty in the gradient)
//! m = beta1 * m + (1 - beta1) * g
//! v = beta2 * v + (1 - beta2) * g²
//! p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! The formulas are written once, as [`UpdateRule::Adam`]'s expression program in kiln-core;
//! every step hands all parameters to one multi-tensor [`Tensor::fused_update`] call per group
//! (`fused.rs`), on every backend.

use std::collections::BTreeMap;

use kiln_autograd::Var;
use kiln_core::{Backend, Result, Tensor, UpdateRule};

use crate::fused::{Masters, groups};
use crate::sgd::parse_lr;
use crate::state::{MASTER, OptimizerState, follow, step_tensor};
use crate::{Optimizer, check_hyper};

/// Hyperparameters of [`Adam`]; PyTorch's defaults (`lr 1e-3, betas (0.9, 0.999), eps 1e-8`,
/// no weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// L2 penalty added to the gradient (coupled, as `torch.optim.Adam`).
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig::new(1e-3)
    }
}

impl AdamConfig {
    pub fn new(lr: f64) -> Self {
        AdamConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
    pub fn with_betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    pub fn init<B: Backend>(self, params: Vec<Var<B>>) -> Result<Adam<B>> {
        Adam::build(self, false, params)
    }
}

/// Hyperparameters of [`AdamW`]: Adam with decoupled weight decay (PyTorch's default
/// `weight_decay = 1e-2`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig(pub AdamConfig);

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig::new(1e-3)
    }
}

impl AdamWConfig {
    pub fn new(lr: f64) -> Self {
        AdamWConfig(AdamConfig::new(lr).with_weight_decay(1e-2))
    }
    pub fn with_betas(self, beta1: f64, beta2: f64) -> Self {
        AdamWConfig(self.0.with_betas(beta1, beta2))
    }
    pub fn with_eps(self, eps: f64) -> Self {
        AdamWConfig(self.0.with_eps(eps))
    }
    pub fn with_weight_decay(self, weight_decay: f64) -> Self {
        AdamWConfig(self.0.with_weight_decay(weight_decay))
    }
    pub fn init<B: Backend>(self, params: Vec<Var<B>>) -> Result<AdamW<B>> {
        Adam::build(self.0, true, params)
    }
}

/// Adam, or AdamW when built from [`AdamWConfig`] (the only difference is where the weight
/// decay goes, so one type serves both).
pub struct Adam<B: Backend> {
    cfg: AdamConfig,
    decoupled: bool,
    params: Vec<Var<B>>,
    /// Per parameter: (first moment, second moment), created at its first step.
    moments: Vec<Option<(Tensor<B>, Tensor<B>)>>,
    steps: Vec<u64>,
    /// f32 master copies of 16-bit parameters (`fused.rs`).
    masters: Masters<B>,
}

/// AdamW is [`Adam`] with decoupled weight decay; build it with [`AdamWConfig`].
pub type AdamW<B> = Adam<B>;

const BUFFERS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

impl<B: Backend> Adam<B> {
    fn build(cfg: AdamConfig, decoupled: bool, params: Vec<Var<B>>) -> Result<Self> {
        const OP: &str = "AdamConfig::init";
        check_hyper(OP, "lr", cfg.lr, |v| v >= 0.0, ">= 0")?;
        check_hyper(
            OP,
            "beta1",
            cfg.beta1,
            |v| (0.0..1.0).contains(&v),
            "in [0, 1)",
        )?;
        check_hyper(
            OP,
            "beta2",
            cfg.beta2,
            |v| (0.0..1.0).contains(&v),
            "in [0, 1)",
        )?;
        check_hyper(OP, "eps", cfg.eps, |v| v >= 0.0, ">= 0")?;
        check_hyper(OP, "weight_decay", cfg.weight_decay, |v| v >= 0.0, ">= 0")?;
        let params = Var::unique(params);
        let n = params.len();
        Ok(Adam {
            cfg,
            decoupled,
            params,
            moments: vec![None; n],
            steps: vec![0; n],
            masters: Masters::new(n),
        })
    }

    pub fn config(&self) -> &AdamConfig {
        &self.cfg
    }
}

impl<B: Backend> Optimizer<B> for Adam<B> {
    fn name(&self) -> &'static str {
        if self.decoupled { "adamw" } else { "adam" }
    }
    fn params(&self) -> &[Var<B>] {
        &self.params
    }

    /// All parameters with gradients through [`Tensor::fused_update`], one call per group of
    /// parameters at the same step (see `fused.rs`).
    fn step(&mut self) -> Result<()> {
        let c = self.cfg;
        for (step, scale, members) in groups(&self.params, &mut self.masters, |i| self.steps[i])? {
            let t = (step + 1).min(i32::MAX as u64) as i32;
            let rule = UpdateRule::Adam {
                lr: c.lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
                decoupled: self.decoupled,
                bias_correction1: 1.0 - c.beta1.powi(t),
                bias_correction2: 1.0 - c.beta2.powi(t),
            };
            let mut states = Vec::with_capacity(members.len());
            for m in &members {
                states.push(match &self.moments[m.index] {
                    Some((mo, v)) => vec![follow(mo, &m.value)?, follow(v, &m.value)?],
                    None => vec![m.value.zeros_like()?, m.value.zeros_like()?],
                });
            }
            let values: Vec<Tensor<B>> = members.iter().map(|m| m.value.clone()).collect();
            let grads: Vec<Tensor<B>> = members.iter().map(|m| m.grad.clone()).collect();
            let out = Tensor::fused_update_scaled(&rule, &values, &grads, &states, scale.as_ref())?;
            for (m, (w, st)) in members.iter().zip(out) {
                self.masters.write(m.index, &self.params[m.index], w)?;
                let mut st = st.into_iter();
                self.moments[m.index] = st.next().zip(st.next());
                self.steps[m.index] = step + 1;
            }
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    fn state(&self) -> Result<OptimizerState<B>> {
        let mut tensors = BTreeMap::new();
        for (i, p) in self.params.iter().enumerate() {
            if let Some((m, v)) = &self.moments[i] {
                tensors.insert(
                    format!("{i}.step"),
                    step_tensor(self.steps[i], &p.tensor())?,
                );
                tensors.insert(format!("{i}.exp_avg"), m.clone());
                tensors.insert(format!("{i}.exp_avg_sq"), v.clone());
                if let Some(w) = self.masters.saved(i, p) {
                    tensors.insert(format!("{i}.{MASTER}"), w);
                }
            }
        }
        let c = self.cfg;
        let metadata: BTreeMap<String, String> = [
            ("optimizer", self.name().to_string()),
            ("lr", c.lr.to_string()),
            ("beta1", c.beta1.to_string()),
            ("beta2", c.beta2.to_string()),
            ("eps", c.eps.to_string()),
            ("weight_decay", c.weight_decay.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Ok(OptimizerState { tensors, metadata })
    }

    fn load_state(&mut self, state: OptimizerState<B>) -> Result<()> {
        const OP: &str = "Adam::load_state";
        let per = state.validate(OP, self.name(), &self.params, &BUFFERS)?;
        let lr = parse_lr(OP, &state)?;
        for (i, s) in per.into_iter().enumerate() {
            match s {
                None => {
                    self.moments[i] = None;
                    self.steps[i] = 0;
                    self.masters.load(i, None);
                }
                Some(s) => {
                    let mut it = s.buffers.into_iter();
                    let (m, v) = (it.next(), it.next());
                    self.moments[i] = m.zip(v);
                    self.steps[i] = s.step;
                    self.masters.load(i, s.master);
                }
            }
        }
        if let Some(lr) = lr {
            self.cfg.lr = lr;
        }
        Ok(())
    }
}
