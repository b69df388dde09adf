//! Learning-rate schedules as pure functions of the step.
//!
//! `lr(step)` is the rate for step (or epoch: the caller decides the unit) `step`, counted
//! from 0. Apply it with `opt.set_lr(schedule.lr(step))` before the step. Being stateless,
//! a schedule resumes from a checkpoint by construction and composes by wrapping.

use std::f64::consts::PI;

/// A learning rate for each step.
pub trait LrSchedule {
    fn lr(&self, step: usize) -> f64;
}

impl<S: LrSchedule + ?Sized> LrSchedule for Box<S> {
    fn lr(&self, step: usize) -> f64 {
        (**self).lr(step)
    }
}

/// The same rate forever.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Constant(pub f64);

impl LrSchedule for Constant {
    fn lr(&self, _: usize) -> f64 {
        self.0
    }
}

/// `base * gamma^(step / step_size)` (`torch.optim.lr_scheduler.StepLR`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLr {
    pub base: f64,
    pub step_size: usize,
    pub gamma: f64,
}

impl LrSchedule for StepLr {
    fn lr(&self, step: usize) -> f64 {
        let k = step / self.step_size.max(1);
        self.base * self.gamma.powi(k.min(i32::MAX as usize) as i32)
    }
}

/// `eta_min + (base - eta_min) * (1 + cos(pi * step / t_max)) / 2`, held at `eta_min` after
/// `t_max` (`CosineAnnealingLR` without restarts).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineAnnealing {
    pub base: f64,
    pub t_max: usize,
    pub eta_min: f64,
}

impl LrSchedule for CosineAnnealing {
    fn lr(&self, step: usize) -> f64 {
        if self.t_max == 0 {
            return self.eta_min;
        }
        let s = step.min(self.t_max) as f64 / self.t_max as f64;
        self.eta_min + (self.base - self.eta_min) * (1.0 + (PI * s).cos()) / 2.0
    }
}

/// A linear ramp from `start_factor * after.lr(0)` to `after.lr(0)` over `warmup` steps, then
/// `after` shifted by `warmup` (PyTorch's `SequentialLR(LinearLR, after)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearWarmup<S> {
    pub warmup: usize,
    pub start_factor: f64,
    pub after: S,
}

impl<S: LrSchedule> LrSchedule for LinearWarmup<S> {
    fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            let f =
                self.start_factor + (1.0 - self.start_factor) * step as f64 / self.warmup as f64;
            f * self.after.lr(0)
        } else {
            self.after.lr(step - self.warmup)
        }
    }
}
