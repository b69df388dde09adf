//! A chain of modules applied in order (`torch.nn.Sequential`).
//!
//! Children are named by their index, parameterless ones included, so the parameters of
//! `[Linear, ReLU, Linear]` are `0.weight, 0.bias, 2.weight, 2.bias`, as in PyTorch.
//!
//! A layer followed by an activation module that the layer can fuse (`Linear` then `Relu`,
//! `Gelu` or `GeluTanh`: [`Module::forward_then`]) runs as one op, `Var::linear_act`, which a
//! GPU computes with the bias and the activation in the product's epilogue (cuBLASLt) instead
//! of a separate elementwise pass; elsewhere it is the same ops as the two modules in turn.
//! [`Sequential::with_fused_epilogues`] turns this off for one model, and
//! `kiln_autograd::set_linear_epilogues` the library path for the whole process.

use kiln_autograd::Var;
use kiln_core::{Backend, Result};

use crate::module::{Module, prefixed};

/// Modules applied one after the other.
pub struct Sequential<B: Backend> {
    layers: Vec<Box<dyn Module<B>>>,
    fuse: bool,
}

impl<B: Backend> Default for Sequential<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Sequential<B> {
    pub fn new() -> Self {
        Sequential {
            layers: Vec::new(),
            fuse: true,
        }
    }
    /// Whether a layer and the activation module after it run as one fused op (module docs;
    /// on by default).
    pub fn with_fused_epilogues(mut self, on: bool) -> Self {
        self.fuse = on;
        self
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
        let mut i = 0;
        while i < self.layers.len() {
            let next = self.layers.get(i + 1).filter(|_| self.fuse);
            if let Some(act) = next.and_then(|n| n.as_activation())
                && let Some(y) = self.layers[i].forward_then(&h, act)
            {
                h = y?;
                i += 2;
                continue;
            }
            h = self.layers[i].forward(&h)?;
            i += 1;
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
