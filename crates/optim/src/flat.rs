//! Multi-tensor ("foreach") updates: all parameters as one flat buffer.
//!
//! Updating parameter by parameter costs one kernel launch per op per tensor (Adam: ~13 ops, so
//! ~80 launches for a 3-layer MLP), which dominates a small model's step on a GPU. Instead, when
//! every parameter has a gradient and all share one dtype and device, the optimizer:
//!
//! 1. concatenates the gradients into one flat tensor (one copy per parameter);
//! 2. runs the update math once over flat tensors (the parameters, already packed, and the
//!    optimizer state, kept flat);
//! 3. points each parameter's `Var` at its slice of the new flat buffer with
//!    [`Var::set_tensor`] (a view: no copy, no launch).
//!
//! The parameters stay views of the packed buffer between steps, so packing happens once; if
//! something replaces a parameter's tensor (loading weights, `to_device`), the next step sees
//! that the views no longer match and packs again from the current values. The arithmetic is
//! the same elementwise math as the per-parameter path, so both give identical results (a test
//! checks it). What remains per parameter is the gradient copy; a fused kernel over a list of
//! buffers (one launch for everything) would need a backend op and is not done.

use kiln_autograd::Var;
use kiln_core::{Backend, Result, Shape, Tensor};

/// Where each parameter lives in a flat buffer.
pub(crate) struct Spans {
    pub offsets: Vec<usize>,
    pub shapes: Vec<Shape>,
}

impl Spans {
    fn of(ts: &[Tensor<impl Backend>]) -> Self {
        let mut offsets = Vec::with_capacity(ts.len());
        let mut at = 0;
        for t in ts {
            offsets.push(at);
            at += t.elem_count();
        }
        Spans {
            offsets,
            shapes: ts.iter().map(|t| t.shape().clone()).collect(),
        }
    }

    /// Piece `i` of `buf`, as a view with parameter `i`'s shape.
    pub fn piece<B: Backend>(&self, buf: &Tensor<B>, i: usize) -> Result<Tensor<B>> {
        buf.narrow(0, self.offsets[i], self.shapes[i].elem_count())?
            .reshape(self.shapes[i].clone())
    }

    /// All pieces of `buf`.
    pub fn split<B: Backend>(&self, buf: &Tensor<B>) -> Result<Vec<Tensor<B>>> {
        (0..self.offsets.len())
            .map(|i| self.piece(buf, i))
            .collect()
    }

    /// Whether every `ts[i]` is exactly piece `i` of `buf` (so `buf` can be used as is).
    pub fn is_split_of<B: Backend>(&self, buf: &Tensor<B>, ts: &[&Tensor<B>]) -> bool {
        buf.rank() == 1
            && ts.len() == self.offsets.len()
            && ts.iter().enumerate().all(|(i, t)| {
                t.same_storage(buf)
                    && t.is_contiguous()
                    && t.layout().offset() == buf.layout().offset() + self.offsets[i]
                    && t.shape() == &self.shapes[i]
            })
    }
}

/// Concatenates tensors, flattened, into one 1-d tensor.
pub(crate) fn cat_flat<B: Backend>(ts: &[&Tensor<B>]) -> Result<Tensor<B>> {
    let flat = ts
        .iter()
        .map(|t| t.flatten_all())
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&flat, 0)
}

/// The inputs of a flat step: parameter values, their gradient concatenated, and the layout.
/// `None` when a flat step is not possible (a parameter without gradient, mixed dtypes or
/// devices, no parameters): the caller then updates parameter by parameter.
pub(crate) struct FlatStep<B: Backend> {
    pub values: Vec<Tensor<B>>,
    pub grad: Tensor<B>,
    pub spans: Spans,
}

impl<B: Backend> FlatStep<B> {
    pub fn prepare(params: &[Var<B>]) -> Result<Option<Self>> {
        let Some(first) = params.first() else {
            return Ok(None);
        };
        let first = first.tensor();
        let mut values = Vec::with_capacity(params.len());
        let mut grads = Vec::with_capacity(params.len());
        for p in params {
            let (Some(g), t) = (p.grad(), p.tensor()) else {
                return Ok(None);
            };
            if t.dtype() != first.dtype() || t.device() != first.device() {
                return Ok(None);
            }
            values.push(t);
            grads.push(g);
        }
        let spans = Spans::of(&values);
        let grad = cat_flat(&grads.iter().collect::<Vec<_>>())?;
        Ok(Some(FlatStep {
            values,
            grad,
            spans,
        }))
    }

    /// The packed parameters: `packed` itself when the parameters are still its views,
    /// otherwise a fresh concatenation of their current values.
    pub fn packed_values(&self, packed: Option<&Tensor<B>>) -> Result<Tensor<B>> {
        let refs: Vec<&Tensor<B>> = self.values.iter().collect();
        match packed {
            Some(buf) if self.spans.is_split_of(buf, &refs) => Ok(buf.clone()),
            _ => cat_flat(&refs),
        }
    }

    /// Per-parameter state (one tensor per parameter) as one flat tensor: `flat` itself when
    /// the pieces are its views, otherwise a concatenation (moved to the gradient's device).
    pub fn packed_state(
        &self,
        flat: Option<&Tensor<B>>,
        pieces: &[&Tensor<B>],
    ) -> Result<Tensor<B>> {
        match flat {
            Some(buf)
                if buf.device() == self.grad.device() && self.spans.is_split_of(buf, pieces) =>
            {
                Ok(buf.clone())
            }
            _ => cat_flat(pieces)?.to_device(self.grad.device()),
        }
    }

    /// Points every parameter at its piece of `new` (views: no copy).
    pub fn assign(&self, params: &[Var<B>], new: &Tensor<B>) -> Result<()> {
        for (i, p) in params.iter().enumerate() {
            p.set_tensor(self.spans.piece(new, i)?)?;
        }
        Ok(())
    }
}
