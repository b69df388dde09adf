//! Stochastic gradient descent with momentum, Nesterov momentum and L2 weight decay, exactly as
//! `torch.optim.SGD` computes it:
//!
//! ```text
//! g = grad + weight_decay * p
//! buf = g                                   (first step)
//! buf = momentum * buf + (1 - dampening) * g (later steps)
//! g = g + momentum * buf   if nesterov,  else  g = buf
//! p = p - lr * g
//! ```
//!
//! The formulas are written once, as [`UpdateRule::Sgd`]'s expression program in kiln-core;
//! every step hands all parameters to one multi-tensor [`Tensor::fused_update`] call per group
//! (`fused.rs`), on every backend.

use std::collections::BTreeMap;

use kiln_autograd::Var;
use kiln_core::{Backend, Error, Result, Tensor, UpdateRule};

use crate::fused::{Masters, groups};
use crate::state::{MASTER, OptimizerState, follow, step_tensor};
use crate::{Optimizer, check_hyper};

/// Hyperparameters of [`Sgd`] (Burn-style: `SgdConfig::new(0.1).with_momentum(0.9)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }
    pub fn with_dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }
    pub fn with_nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Validates the hyperparameters and builds the optimizer over `params`.
    pub fn init<B: Backend>(self, params: Vec<Var<B>>) -> Result<Sgd<B>> {
        const OP: &str = "SgdConfig::init";
        check_hyper(OP, "lr", self.lr, |v| v >= 0.0, ">= 0")?;
        check_hyper(OP, "momentum", self.momentum, |v| v >= 0.0, ">= 0")?;
        check_hyper(OP, "dampening", self.dampening, |_| true, "finite")?;
        check_hyper(OP, "weight_decay", self.weight_decay, |v| v >= 0.0, ">= 0")?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::invalid(
                OP,
                "Nesterov momentum requires momentum > 0 and dampening = 0",
            ));
        }
        let params = Var::unique(params);
        let n = params.len();
        Ok(Sgd {
            cfg: self,
            params,
            bufs: vec![None; n],
            steps: vec![0; n],
            masters: Masters::new(n),
        })
    }
}

/// SGD over a list of parameters; see the module docs for the update.
pub struct Sgd<B: Backend> {
    cfg: SgdConfig,
    params: Vec<Var<B>>,
    bufs: Vec<Option<Tensor<B>>>,
    steps: Vec<u64>,
    /// f32 master copies of 16-bit parameters (`fused.rs`).
    masters: Masters<B>,
}

impl<B: Backend> Sgd<B> {
    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }
}

impl<B: Backend> Optimizer<B> for Sgd<B> {
    fn name(&self) -> &'static str {
        "sgd"
    }
    fn params(&self) -> &[Var<B>] {
        &self.params
    }

    /// All parameters with gradients through [`Tensor::fused_update`], one call per group
    /// (with or without a momentum buffer yet; see `fused.rs`).
    fn step(&mut self) -> Result<()> {
        let c = self.cfg;
        let momentum = c.momentum != 0.0;
        for (first_step, scale, members) in
            groups(&self.params, &mut self.masters, |i| self.bufs[i].is_none())?
        {
            let rule = UpdateRule::Sgd {
                lr: c.lr,
                momentum: c.momentum,
                dampening: c.dampening,
                nesterov: c.nesterov,
                weight_decay: c.weight_decay,
                first_step,
            };
            let mut states = Vec::with_capacity(members.len());
            for m in &members {
                states.push(match (&self.bufs[m.index], momentum) {
                    (_, false) => vec![],
                    (Some(b), true) => vec![follow(b, &m.value)?],
                    // Ignored on a first step; any tensor of the right shape will do.
                    (None, true) => vec![m.grad.clone()],
                });
            }
            let values: Vec<Tensor<B>> = members.iter().map(|m| m.value.clone()).collect();
            let grads: Vec<Tensor<B>> = members.iter().map(|m| m.grad.clone()).collect();
            let out = Tensor::fused_update_scaled(&rule, &values, &grads, &states, scale.as_ref())?;
            for (m, (w, st)) in members.iter().zip(out) {
                self.masters.write(m.index, &self.params[m.index], w)?;
                if momentum {
                    self.bufs[m.index] = st.into_iter().next();
                }
                self.steps[m.index] += 1;
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
            if self.steps[i] == 0 {
                continue;
            }
            tensors.insert(
                format!("{i}.step"),
                step_tensor(self.steps[i], &p.tensor())?,
            );
            if let Some(b) = &self.bufs[i] {
                tensors.insert(format!("{i}.momentum_buffer"), b.clone());
            }
            if let Some(w) = self.masters.saved(i, p) {
                tensors.insert(format!("{i}.{MASTER}"), w);
            }
        }
        let c = self.cfg;
        let metadata: BTreeMap<String, String> = [
            ("optimizer", "sgd".to_string()),
            ("lr", c.lr.to_string()),
            ("momentum", c.momentum.to_string()),
            ("dampening", c.dampening.to_string()),
            ("nesterov", c.nesterov.to_string()),
            ("weight_decay", c.weight_decay.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Ok(OptimizerState { tensors, metadata })
    }

    fn load_state(&mut self, state: OptimizerState<B>) -> Result<()> {
        const OP: &str = "Sgd::load_state";
        let buffers: &[&str] = if self.cfg.momentum != 0.0 {
            &["momentum_buffer"]
        } else {
            &[]
        };
        let per = state.validate(OP, "sgd", &self.params, buffers)?;
        let lr = parse_lr(OP, &state)?;
        for (i, s) in per.into_iter().enumerate() {
            match s {
                None => {
                    self.bufs[i] = None;
                    self.steps[i] = 0;
                    self.masters.load(i, None);
                }
                Some(mut s) => {
                    self.bufs[i] = s.buffers.pop();
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

/// The saved learning rate (a schedule may have changed it), when present and valid.
pub(crate) fn parse_lr<B: Backend>(op: &'static str, s: &OptimizerState<B>) -> Result<Option<f64>> {
    match s.metadata.get("lr") {
        None => Ok(None),
        Some(v) => v
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .map(Some)
            .ok_or_else(|| Error::invalid(op, format!("saved lr `{v}` is not a valid number"))),
    }
}
