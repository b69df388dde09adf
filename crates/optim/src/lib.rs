//! # kiln-optim
//!
//! Optimizers ([`Sgd`] with momentum, Nesterov and weight decay; [`Adam`]; [`AdamW`]),
//! gradient clipping by global norm on the device ([`clip_grad_norm`], no host round trip) and
//! learning-rate schedules ([`StepLr`], [`CosineAnnealing`], [`LinearWarmup`]).
//!
//! An optimizer holds clones of the parameters' [`Var`]s (clones are the same variables), reads
//! each one's accumulated gradient and writes the new value with [`Var::set_tensor`], the
//! autograd crate's documented way to update a leaf in place: the model sees the new weights at
//! once and no graph is recorded. The update math follows PyTorch's `torch.optim` to the letter
//! (same defaults, same bias correction, same placement of `eps`), so hyperparameters carry
//! over and tests can check one step against the formula.
//!
//! Parameters with no gradient (frozen, or unused in this step) are skipped and keep their
//! state, as in PyTorch. Optimizer state (momentum buffers, Adam moments, step counts, and the
//! f32 master copies of 16-bit parameters) can be saved to and restored from safetensors, so
//! training resumes exactly (`state.rs` names the tensors).
//!
//! Updates are multi-tensor (PyTorch's `foreach`), on every backend: an optimizer states its
//! update as a [`UpdateRule`](kiln_core::UpdateRule), whose expression program in kiln-core is
//! the only place the formulas are written, and hands all parameters to
//! [`Tensor::fused_update`](kiln_core::Tensor::fused_update) in one call per group. The CUDA
//! backend runs it as one multi-tensor kernel per batch of parameters (a handful of launches
//! for a whole model instead of one per term per tensor); the CPU evaluates the program in one
//! fused pass per parameter, and the reference backend op by op.
//!
//! Mixed precision: [`GradScaler`] scales an f16 loss and skips steps whose gradients
//! overflowed (bf16 needs none); parameters stored in f16/bf16 are updated through f32 master
//! copies with f32 state (see `fused.rs`), so 16-bit weights still take small updates.
//!
//! Schedules are pure functions of the step (`lr(step)`), not stateful objects: resuming is
//! calling `set_lr(schedule.lr(step))` with the saved step, and a test is a table of values.

mod adam;
mod clip;
mod fused;
mod scaler;
mod schedule;
mod sgd;
mod state;

pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, clip_grad_value, grad_norm, grad_norm_tensor};
pub use scaler::{GradScaler, GradScalerConfig};
pub use schedule::{Constant, CosineAnnealing, LinearWarmup, LrSchedule, StepLr};
pub use sgd::{Sgd, SgdConfig};
pub use state::OptimizerState;

use std::path::Path;

use kiln_autograd::Var;
use kiln_core::{Backend, Result};

/// A first-order optimizer over a fixed list of parameters.
pub trait Optimizer<B: Backend> {
    /// A short name (`sgd`, `adam`, `adamw`), also written into saved state.
    fn name(&self) -> &'static str;
    /// The parameters, in the order given at construction (state is keyed by this index),
    /// each once: a variable given twice (a weight tied between two modules) is kept at its
    /// first place only ([`Var::unique`]), so it gets one state and one update per step.
    fn params(&self) -> &[Var<B>];
    /// One update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;
    /// Drops every parameter's gradient (PyTorch's `zero_grad(set_to_none=True)`).
    fn zero_grad(&self) {
        for p in self.params() {
            p.zero_grad();
        }
    }
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
    /// The state: tensors named `"{index}.{buffer}"` (step counts, the optimizer's buffers,
    /// `master_weight` for a 16-bit parameter) plus metadata (name, hyperparameters).
    fn state(&self) -> Result<OptimizerState<B>>;
    /// Restores a state from [`Optimizer::state`]. Everything is validated first: on error the
    /// optimizer is unchanged.
    fn load_state(&mut self, state: OptimizerState<B>) -> Result<()>;

    /// Writes [`Optimizer::state`] to a safetensors file.
    fn save_state(&self, path: impl AsRef<Path>) -> Result<()>
    where
        Self: Sized,
    {
        self.state()?.save(path)
    }
    /// Reads a file written by [`Optimizer::save_state`]; tensors go to each parameter's
    /// device.
    fn load_state_file(&mut self, path: impl AsRef<Path>) -> Result<()>
    where
        Self: Sized,
    {
        let st = OptimizerState::load(path, self.params())?;
        self.load_state(st)
    }
}

impl<B: Backend, O: Optimizer<B> + ?Sized> Optimizer<B> for Box<O> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn params(&self) -> &[Var<B>] {
        (**self).params()
    }
    fn step(&mut self) -> Result<()> {
        (**self).step()
    }
    fn zero_grad(&self) {
        (**self).zero_grad()
    }
    fn lr(&self) -> f64 {
        (**self).lr()
    }
    fn set_lr(&mut self, lr: f64) {
        (**self).set_lr(lr)
    }
    fn state(&self) -> Result<OptimizerState<B>> {
        (**self).state()
    }
    fn load_state(&mut self, state: OptimizerState<B>) -> Result<()> {
        (**self).load_state(state)
    }
}

/// Validates a hyperparameter: finite and in range, or a typed error naming it.
pub(crate) fn check_hyper(
    op: &'static str,
    name: &str,
    v: f64,
    ok: impl Fn(f64) -> bool,
    want: &str,
) -> Result<()> {
    if !v.is_finite() || !ok(v) {
        return Err(kiln_core::Error::invalid(
            op,
            format!("{name} must be {want}, got {v}"),
        ));
    }
    Ok(())
}
