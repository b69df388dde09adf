//! A chain of modules applied in order (`torch.nn.Sequential`).
//!
//! Children are named by their index, parameterless ones included, so the parameters of
//! `[Linear, ReLU, Linear]` are `0.weight, 0.bias, 2.weight, 2.bias`, as in PyTorch.

use kiln_autograd::Var;
use kiln_core::{Backend, Result};

use crate::module::{Module, prefixed};

/// Modules applied one after the other.
pub struct Sequential<B: Backend> {
    layers: Vec<Box<dyn Module<B>>>,
}

impl<B: Backend> Default for Sequential<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Sequential<B> {
    pub fn new() -> Self {
        Sequential { layers: Vec::new() }
    }
    /// Appends a module (builder style: `Sequential::new().add(l1).add(Relu)`).
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, m: impl Module<B> + 'static) -> Self {
        self.layers.push(Box::new(m));
        self
    }
    /// Appends a boxed module.
    pub fn push(&mut self, m: Box<dyn Module<B>>) {
        self.layers.push(m);
    }
    pub fn len(&self) -> usize {
        self.layers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
    pub fn layers(&self) -> &[Box<dyn Module<B>>] {
        &self.layers
    }
}

impl<B: Backend> Module<B> for Sequential<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| prefixed(&i.to_string(), l.named_parameters()))
            .collect()
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| prefixed(&i.to_string(), l.named_buffers()))
            .collect()
    }
    fn set_training(&mut self, training: bool) {
        for l in &mut self.layers {
            l.set_training(training);
        }
    }
    fn describe(&self) -> String {
        let inner: Vec<String> = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| format!("({i}): {}", l.describe()))
            .collect();
        format!("Sequential({})", inner.join(", "))
    }
}
