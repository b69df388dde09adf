//! Dynamic loss scaling for f16 training: [`GradScaler`], as `torch.amp.GradScaler`.
//!
//! # Why
//!
//! f16 holds magnitudes from 6e-8 (subnormal) to 65504. Gradients of a loss are often far
//! smaller than that range's bottom and underflow to zero in an f16 backward. Multiplying the
//! loss by a large factor `S` before `backward` shifts every gradient up by `S` (the chain rule
//! is linear); the optimizer then sees `grad / S`. Too large an `S` overflows to inf, so `S`
//! is dynamic: it starts at 2^16, halves whenever some gradient is inf or NaN (and that step is
//! skipped, the parameters untouched), and doubles after 2000 steps in a row without one.
//!
//! **bf16 needs no scaler**: it has f32's exponent range, so its gradients neither underflow
//! nor overflow where f32's would not. Build the scaler disabled
//! ([`GradScalerConfig::enabled`] false) to keep one training loop for every precision: it
//! then passes the loss and the step through untouched.
//!
//! # A step
//!
//! ```text
//! let loss = { let _amp = autocast(DType::F16)?; model.loss(...)? };
//! scaler.scale(&loss)?.backward()?;
//! scaler.unscale_(&opt)?;                  // optional: before clipping, so it sees true norms
//! clip_grad_norm(opt.params(), 1.0)?;
//! scaler.step(&mut opt)?;                  // skipped when a gradient is inf/NaN
//! scaler.update()?;
//! opt.zero_grad();
//! ```
//!
//! # Device work and the one host read
//!
//! The scale is a host `f64`: [`GradScaler::scale`] is one scalar multiply (the scalar is a
//! kernel argument, no upload). Unscaling and the inf/NaN check are one op,
//! [`Tensor::unscale_check`], per group of gradients sharing a device and a dtype: it returns
//! `g · (1 / S)` for each gradient and a 0-d f32 flag, 1 when some unscaled element is inf or
//! NaN and 0 otherwise. On a GPU that is one multi-tensor kernel and a memset for up to 128
//! gradients (PyTorch's `_amp_foreach_non_finite_check_and_unscale_`), not a multiply and a
//! reduction per gradient; elsewhere one fused pass per gradient. The groups' flags are added
//! on the device into one (moved to the first group's device, as gradient clipping does).
//! [`GradScaler::step`] reads that flag back once — the only synchronization the
//! scaler adds, once per step, as PyTorch's `found_inf.item()` in its `step`. Everything before
//! it (backward, unscale, clipping) stays asynchronous.

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Result, Tensor};

use crate::{Optimizer, check_hyper};

/// Hyperparameters of a [`GradScaler`]; PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale (2^16).
    pub init_scale: f64,
    /// Factor applied after `growth_interval` clean steps (2).
    pub growth_factor: f64,
    /// Factor applied after a step with an inf/NaN gradient (0.5).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (2000).
    pub growth_interval: u64,
    /// When false the scaler does nothing: `scale` returns the loss, `step` always steps (for
    /// f32 and bf16 runs sharing the f16 loop).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with_init_scale(mut self, s: f64) -> Self {
        self.init_scale = s;
        self
    }
    pub fn with_growth_factor(mut self, f: f64) -> Self {
        self.growth_factor = f;
        self
    }
    pub fn with_backoff_factor(mut self, f: f64) -> Self {
        self.backoff_factor = f;
        self
    }
    pub fn with_growth_interval(mut self, n: u64) -> Self {
        self.growth_interval = n;
        self
    }
    pub fn with_enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }
    /// Validates the hyperparameters (typed errors naming the bad one) and builds the scaler.
    pub fn init<B: Backend>(self) -> Result<GradScaler<B>> {
        const OP: &str = "GradScalerConfig::init";
        check_hyper(OP, "init_scale", self.init_scale, |v| v > 0.0, "> 0")?;
        check_hyper(OP, "growth_factor", self.growth_factor, |v| v > 1.0, "> 1")?;
        check_hyper(
            OP,
            "backoff_factor",
            self.backoff_factor,
            |v| v > 0.0 && v < 1.0,
            "in (0, 1)",
        )?;
        if self.growth_interval == 0 {
            return Err(Error::invalid(OP, "growth_interval must be >= 1, got 0"));
        }
        Ok(GradScaler {
            cfg: self,
            scale: self.init_scale,
            clean_steps: 0,
            stage: Stage::Ready,
            flag: None,
        })
    }
}

/// Gradients sharing a device and a dtype (one [`Tensor::unscale_check`]), with their
/// parameters.
type Group<B> = (<B as Backend>::Device, DType, Vec<(Var<B>, Tensor<B>)>);

/// Where the scaler is within one step.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    /// No unscale yet this step.
    Ready,
    /// Gradients unscaled; the inf/NaN flag (if any gradient) is in `GradScaler::flag`.
    Unscaled,
    /// `step` ran (or skipped) with this outcome; `update` comes next.
    Stepped(bool),
}

/// Dynamic loss scaler for f16 training (module docs). Its state is host-side and cheap; it
/// does not hold the optimizer, so one scaler can serve one or several optimizers in turn as
/// PyTorch's does (unscale and step each, then one `update`) — here with one optimizer per
/// step for simplicity: a second `unscale_` before `update` is an error.
pub struct GradScaler<B: Backend> {
    cfg: GradScalerConfig,
    scale: f64,
    clean_steps: u64,
    stage: Stage,
    /// The device flag of the current step between `unscale_` and `step` (0: all finite).
    flag: Option<Tensor<B>>,
}

impl<B: Backend> GradScaler<B> {
    /// PyTorch's defaults: 2^16, ×2 after 2000 clean steps, ×0.5 on overflow.
    pub fn new() -> Result<Self> {
        GradScalerConfig::default().init()
    }

    /// A scaler that does nothing (bf16 and f32 runs): see [`GradScalerConfig::enabled`].
    pub fn disabled() -> Self {
        GradScaler {
            cfg: GradScalerConfig::default().with_enabled(false),
            scale: 1.0,
            clean_steps: 0,
            stage: Stage::Ready,
            flag: None,
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// The current scale (1 when disabled).
    pub fn get_scale(&self) -> f64 {
        if self.cfg.enabled { self.scale } else { 1.0 }
    }

    /// Clean steps since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.clean_steps
    }

    pub fn config(&self) -> &GradScalerConfig {
        &self.cfg
    }

    /// `loss · scale` (the loss itself when disabled), to call `backward` on.
    pub fn scale(&self, loss: &Var<B>) -> Result<Var<B>> {
        if !self.cfg.enabled {
            return Ok(loss.clone());
        }
        loss.mul_scalar(self.scale)
    }

    /// Divides the gradients of `opt`'s parameters by the scale, in place, and records on the
    /// device whether any is inf or NaN (module docs; no synchronization). Call it before
    /// anything that must see true gradients (clipping); [`GradScaler::step`] calls it when
    /// you did not. Twice in one step is an error (the gradients would be divided twice).
    pub fn unscale_<O: Optimizer<B> + ?Sized>(&mut self, opt: &O) -> Result<()> {
        self.flag = self.unscale_params(opt.params())?;
        Ok(())
    }

    fn unscale_params(&mut self, params: &[Var<B>]) -> Result<Option<Tensor<B>>> {
        const OP: &str = "GradScaler::unscale_";
        if !self.cfg.enabled {
            return Ok(None);
        }
        match self.stage {
            Stage::Ready => {}
            Stage::Unscaled => {
                return Err(Error::invalid(
                    OP,
                    "unscale_ was already called since the last update(): the gradients are \
                     already unscaled",
                ));
            }
            Stage::Stepped(_) => {
                return Err(Error::invalid(
                    OP,
                    "step() already ran for this step; call update() first",
                ));
            }
        }
        let inv = 1.0 / self.scale;
        // One multi-tensor unscale-and-check per (device, dtype) group of gradients.
        let mut groups: Vec<Group<B>> = Vec::new();
        for p in Var::unique(params.iter().cloned()) {
            let Some(g) = p.grad() else { continue };
            let (dev, dtype) = (g.device().clone(), g.dtype());
            match groups.iter_mut().find(|e| e.0 == dev && e.1 == dtype) {
                Some(e) => e.2.push((p, g)),
                None => groups.push((dev, dtype, vec![(p, g)])),
            }
        }
        let mut flag: Option<Tensor<B>> = None;
        for (_, _, members) in groups {
            let grads: Vec<Tensor<B>> = members.iter().map(|(_, g)| g.clone()).collect();
            let (unscaled, part) = Tensor::unscale_check(&grads, inv)?;
            for ((p, _), g) in members.iter().zip(unscaled) {
                p.set_grad(Some(g))?;
            }
            // 0 or 1 per group; a sum of them is nonzero exactly when some group found one.
            flag = Some(match flag {
                None => part,
                Some(f) => f.add(&part.to_device(f.device())?)?,
            });
        }
        self.stage = Stage::Unscaled;
        Ok(flag)
    }

    /// Unscales if [`GradScaler::unscale_`] was not called, reads the inf/NaN flag (the one
    /// host read of the step), and runs `opt.step()` only when every gradient is finite.
    /// Returns whether the optimizer stepped. When disabled, it is `opt.step()`.
    pub fn step<O: Optimizer<B> + ?Sized>(&mut self, opt: &mut O) -> Result<bool> {
        if !self.cfg.enabled {
            opt.step()?;
            return Ok(true);
        }
        let flag: Option<Tensor<B>> = match self.stage {
            Stage::Ready => self.unscale_params(opt.params())?,
            Stage::Unscaled => self.flag.take(),
            Stage::Stepped(_) => {
                return Err(Error::invalid(
                    "GradScaler::step",
                    "step() already ran for this step; call update() first",
                ));
            }
        };
        // No flag: no parameter had a gradient, so nothing overflowed.
        let found_inf = match flag {
            Some(f) => f.to_scalar()? != 0.0,
            None => false,
        };
        if !found_inf {
            opt.step()?;
        }
        self.stage = Stage::Stepped(found_inf);
        Ok(!found_inf)
    }

    /// Adjusts the scale after a step: ×`backoff_factor` if it found an inf/NaN (and the clean
    /// count restarts), else one more clean step, ×`growth_factor` at `growth_interval` of
    /// them. An error when no `step` ran since the last update.
    pub fn update(&mut self) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        let Stage::Stepped(found_inf) = self.stage else {
            return Err(Error::invalid(
                "GradScaler::update",
                "no step() since the last update(): nothing to adjust the scale by",
            ));
        };
        if found_inf {
            self.scale *= self.cfg.backoff_factor;
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= self.cfg.growth_interval {
                self.scale *= self.cfg.growth_factor;
                self.clean_steps = 0;
            }
        }
        self.stage = Stage::Ready;
        Ok(())
    }
}
