//! Embedding lookup on variables (`F.embedding`): rows of a table picked by `i64` ids.
//!
//! The forward is one `index_select` of rows; the backward adds each output row's gradient into
//! its table row with one `scatter_add` (repeated ids accumulate), so the gradient never goes
//! through a dense one-hot matrix of `[ids, num_embeddings]`. With a `padding_idx`, the rows of
//! the gradient whose id is the padding id are zeroed before the scatter, so that table row gets
//! no gradient (PyTorch's semantics: the forward still reads it).

use kiln_core::{Backend, CmpOp, DType, Error, Result, Shape, Tensor};

use crate::var::Var;

const OP: &str = "embedding";

impl<B: Backend> Var<B> {
    /// `self` is an embedding table `[num_embeddings, dim]`; returns its rows at `ids` (`i64`,
    /// any shape), of shape `[..ids.shape, dim]` (PyTorch's `F.embedding(ids, weight,
    /// padding_idx)`). The table's gradient is accumulated by `scatter_add`; the row
    /// `padding_idx`, when given, gets none. An id outside `0..num_embeddings` is
    /// [`Error::IndexOutOfRange`] naming `embedding` (on a GPU, reported where the backend
    /// reports its index errors); ids of another dtype are [`Error::DTypeMismatch`].
    pub fn embedding(&self, ids: &Tensor<B>, padding_idx: Option<usize>) -> Result<Self> {
        let table = self.tensor();
        if table.rank() != 2 {
            return Err(Error::invalid(
                OP,
                format!(
                    "the table must be [num_embeddings, dim], got shape {}",
                    table.shape()
                ),
            ));
        }
        if ids.dtype() != DType::I64 {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: "i64 ids".into(),
                got: ids.dtype(),
            });
        }
        let (num, dim) = (table.dims()[0], table.dims()[1]);
        if let Some(p) = padding_idx.filter(|&p| p >= num) {
            return Err(Error::IndexOutOfRange {
                op: OP,
                index: p as i64,
                size: num,
            });
        }
        let n = ids.elem_count();
        let flat = ids.reshape([n])?;
        let rows = table.index_select(0, &flat).map_err(|e| match e {
            Error::IndexOutOfRange { index, size, .. } => Error::IndexOutOfRange {
                op: OP,
                index,
                size,
            },
            e => e,
        })?;
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(dim);
        let y = rows.reshape(out_dims)?;
        let table_shape = table.shape().clone();
        Ok(Var::from_op(OP, &[self], y, move |g, _| {
            Ok(vec![Some(table_grad(g, &flat, padding_idx, &table_shape)?)])
        }))
    }
}

/// The table's gradient: the rows of `g` (`[.., dim]`) added into `table_shape` at `ids` (1-d),
/// those of the padding id left out.
fn table_grad<B: Backend>(
    g: &Tensor<B>,
    ids: &Tensor<B>,
    padding_idx: Option<usize>,
    table_shape: &Shape,
) -> Result<Tensor<B>> {
    let (n, dim) = (ids.elem_count(), table_shape.dims()[1]);
    let mut g2 = g.reshape([n, dim])?;
    if let Some(p) = padding_idx {
        let keep = ids.compare_scalar(CmpOp::Ne, p as f64)?.reshape([n, 1])?;
        let zero = Tensor::zeros(Shape::scalar(), g.dtype(), g.device())?;
        g2 = keep.where_cond(&g2, &zero)?;
    }
    let ids_b = ids.reshape([n, 1])?.broadcast_to([n, dim])?;
    let z = Tensor::zeros(table_shape.clone(), g.dtype(), g.device())?;
    z.scatter_add(0, &ids_b, &g2)
}
