//! A lookup table of learned vectors (`torch.nn.Embedding`).
//!
//! The forward picks rows with [`Var::embedding`] (one `index_select`); the table's gradient is
//! a `scatter_add` of the output's rows, never a dense one-hot product. The parameter is
//! PyTorch's `weight` `[num_embeddings, dim]`, initialized `N(0, 1)` as PyTorch does, with the
//! `padding_idx` row zeroed.

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Generator, Result, Tensor};

use crate::init::Init;
use crate::module::Module;

/// Configuration of an [`Embedding`]
/// (`EmbeddingConfig::new(65, 384).init::<B>(&dev, &mut generator)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingConfig {
    pub num_embeddings: usize,
    pub dim: usize,
    /// A row that reads as zeros at first and never gets a gradient.
    pub padding_idx: Option<usize>,
    /// Default `N(0, 1)`, as PyTorch.
    pub init: Init,
    pub dtype: DType,
}

impl EmbeddingConfig {
    pub fn new(num_embeddings: usize, dim: usize) -> Self {
        EmbeddingConfig {
            num_embeddings,
            dim,
            padding_idx: None,
            init: Init::Normal {
                mean: 0.0,
                std: 1.0,
            },
            dtype: DType::F32,
        }
    }
    pub fn with_padding_idx(mut self, padding_idx: Option<usize>) -> Self {
        self.padding_idx = padding_idx;
        self
    }
    pub fn with_init(mut self, init: Init) -> Self {
        self.init = init;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the table on `device`, drawn from `generator` (one draw).
    pub fn init<B: Backend>(
        self,
        device: &B::Device,
        generator: &mut Generator,
    ) -> Result<Embedding<B>> {
        const OP: &str = "EmbeddingConfig::init";
        if self.num_embeddings == 0 || self.dim == 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "sizes must be positive, got num_embeddings={} dim={}",
                    self.num_embeddings, self.dim
                ),
            ));
        }
        if let Some(p) = self.padding_idx.filter(|&p| p >= self.num_embeddings) {
            return Err(Error::IndexOutOfRange {
                op: OP,
                index: p as i64,
                size: self.num_embeddings,
            });
        }
        let shape = [self.num_embeddings, self.dim];
        let mut w = self.init.init::<B>(shape, generator, self.dtype, device)?;
        if let Some(p) = self.padding_idx {
            let zero = Tensor::zeros([1, self.dim], self.dtype, device)?;
            w = w.slice_assign(0, p, &zero)?;
        }
        Ok(Embedding {
            weight: Var::param(w),
            padding_idx: self.padding_idx,
        })
    }
}

/// Rows of [`Embedding::weight`] picked by `i64` ids of any shape: `[..ids, dim]`.
pub struct Embedding<B: Backend> {
    /// `[num_embeddings, dim]`.
    pub weight: Var<B>,
    padding_idx: Option<usize>,
}

impl<B: Backend> Embedding<B> {
    pub fn num_embeddings(&self) -> usize {
        self.weight.dims()[0]
    }
    pub fn dim(&self) -> usize {
        self.weight.dims()[1]
    }
    pub fn padding_idx(&self) -> Option<usize> {
        self.padding_idx
    }
    /// The rows at `ids` (what [`Module::forward`] does with a variable holding the ids).
    pub fn lookup(&self, ids: &Tensor<B>) -> Result<Var<B>> {
        self.weight.embedding(ids, self.padding_idx)
    }
}

impl<B: Backend> Module<B> for Embedding<B> {
    /// `x` holds the `i64` ids (e.g. `Var::constant(ids)`); ids need no gradient.
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.lookup(&x.tensor())
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
    fn describe(&self) -> String {
        format!(
            "Embedding({}, {}, padding_idx={:?})",
            self.num_embeddings(),
            self.dim(),
            self.padding_idx
        )
    }
}
