//! Inverted dropout with masks from Philox.
//!
//! A layer takes one key from the [`Generator`] it is built with and keeps a generator of its
//! own under that key; the mask of its `k`-th training forward is `rand(shape) >= p` from that
//! generator's draw `k`, by the backend's Philox generator, which every backend implements bit
//! for bit: a model built from the same generator gives the same masks on the CPU and on the
//! GPU, so a GPU run can be checked against a CPU run step by step. The counter is per layer
//! and advances once per training forward (it can be read and set to resume exactly).

use std::sync::atomic::{AtomicU64, Ordering};

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Generator, RandDist, Result, Tensor};

use crate::module::Module;

/// Zeroes each element with probability `p` in training mode and scales the rest by
/// `1 / (1 - p)`; the identity in evaluation mode. Modules start in training mode.
pub struct Dropout {
    p: f64,
    /// The layer's own generator; the mask of forward `k` is its draw `k`.
    generator: Generator,
    step: AtomicU64,
    training: bool,
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1)`, its masks from a generator keyed by one
    /// draw of `generator` (the model's, or `&mut kiln_core::default_generator()`).
    pub fn new(p: f64, generator: &mut Generator) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid(
                "Dropout",
                format!("p must be in [0, 1), got {p}"),
            ));
        }
        Ok(Dropout {
            p,
            generator: Generator::new(generator.next_key()),
            step: AtomicU64::new(0),
            training: true,
        })
    }
    pub fn p(&self) -> f64 {
        self.p
    }
    /// How many masks have been drawn (the next forward uses this index).
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed)
    }
    pub fn is_training(&self) -> bool {
        self.training
    }
    /// Training mode (an inherent method: `Dropout` is a module for every backend, so the
    /// generic [`ModuleExt::train`](crate::ModuleExt::train) would need the backend named).
    pub fn train(&mut self) {
        self.training = true;
    }
    /// Evaluation mode: the identity.
    pub fn eval(&mut self) {
        self.training = false;
    }
    /// Training mode on or off: what a model's [`Module::set_training`] calls on its dropout
    /// fields (inherent for the same reason as [`Dropout::train`]).
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// The scaled keep-mask (`0` or `1/(1-p)`) for draw `step` of this layer, of `x`'s shape,
    /// dtype and device.
    ///
    /// The keep/drop bits are drawn as one byte an element ([`RandDist::Keep`]: `u >= p` for
    /// the f32 uniforms [`Generator::rand`] would draw, whatever `x`'s dtype) in one pass that
    /// never stores the uniforms. The scaling stays pending on that byte buffer, which is what
    /// the product's backward keeps (PyTorch keeps a bool mask too; keeping a draw in `x`'s
    /// dtype instead cost 245 MB of f32 across a GPT's 13 dropouts at batch 64).
    pub fn mask<B: Backend>(&self, x: &Tensor<B>, step: u64) -> Result<Tensor<B>> {
        let keep = self.generator.clone().set_draws(step).sample::<B>(
            x.shape().clone(),
            RandDist::Keep { p: self.p },
            DType::U8,
            x.device(),
        )?;
        keep.to_dtype(x.dtype())?.mul_scalar(1.0 / (1.0 - self.p))
    }
}

impl<B: Backend> Module<B> for Dropout {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        if !self.training || self.p == 0.0 {
            return Ok(x.clone());
        }
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        let m = self.mask(&x.tensor(), step)?;
        x.mul(&Var::constant(m))
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    fn describe(&self) -> String {
        format!("Dropout(p={})", self.p)
    }
}
