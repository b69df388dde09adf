//! Views (new layouts over the same storage) and the copies that assemble tensors.

use super::Tensor;
use crate::backend::Backend;
use crate::shape::normalize_axis;
use crate::{Error, Layout, Result, Shape};

impl<B: Backend> Tensor<B> {
    /// Same elements, new shape. Shares storage when the strides allow (always for contiguous
    /// tensors); otherwise copies, like `torch.reshape`.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        match self.layout().reshape(&shape)? {
            Some(l) => Ok(self.with_layout(l)),
            None => self.contiguous()?.reshape(shape),
        }
    }

    /// Collapses everything into one dimension.
    pub fn flatten_all(&self) -> Result<Self> {
        self.reshape(self.elem_count())
    }

    /// Collapses axes `start..` into one (`Flatten` in nn keeps the batch axis: `flatten_from(1)`).
    pub fn flatten_from(&self, start: isize) -> Result<Self> {
        let start = if self.rank() == 0 {
            0
        } else {
            normalize_axis("flatten", start, self.rank())?
        };
        let mut dims = self.dims()[..start].to_vec();
        dims.push(self.dims()[start..].iter().product());
        self.reshape(dims)
    }

    /// Swaps two axes (negative axes count from the end). No copy.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Self> {
        let a = normalize_axis("transpose", a, self.rank())?;
        let b = normalize_axis("transpose", b, self.rank())?;
        Ok(self.with_layout(self.layout().transpose(a, b)?))
    }

    /// Swaps the last two axes (a matrix transpose). No copy.
    pub fn t(&self) -> Result<Self> {
        if self.rank() < 2 {
            return Err(Error::invalid(
                "t",
                format!("needs rank >= 2, got shape {}", self.shape()),
            ));
        }
        self.transpose(-2, -1)
    }

    /// Reorders axes: axis `i` of the result is axis `perm[i]` of `self`. No copy.
    pub fn permute(&self, perm: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout().permute(perm)?))
    }

    /// Keeps `len` entries of `axis` from `start`. No copy.
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Self> {
        let axis = normalize_axis("narrow", axis, self.rank())?;
        Ok(self.with_layout(self.layout().narrow(axis, start, len)?))
    }

    /// Numpy-style broadcast to `shape` (stride 0 on stretched axes). No copy.
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Self> {
        Ok(self.with_layout(self.layout().broadcast_to(&shape.into())?))
    }

    /// Removes a size-1 axis.
    pub fn squeeze(&self, axis: isize) -> Result<Self> {
        let axis = normalize_axis("squeeze", axis, self.rank())?;
        Ok(self.with_layout(self.layout().squeeze(axis)?))
    }

    /// Inserts a size-1 axis; `-1` appends one at the end.
    pub fn unsqueeze(&self, axis: isize) -> Result<Self> {
        let axis = normalize_axis("unsqueeze", axis, self.rank() + 1)?;
        Ok(self.with_layout(self.layout().unsqueeze(axis)?))
    }

    /// A contiguous tensor with the same values: `self` when already contiguous at offset 0.
    pub fn contiguous(&self) -> Result<Self> {
        if self.is_contiguous() && self.layout().offset() == 0 {
            return Ok(self.clone());
        }
        let _p = self.prof("contiguous", &[], false);
        let s = B::contiguous(self.storage(), self.layout(), self.dtype())?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }

    /// Joins tensors along an existing axis.
    pub fn cat(tensors: &[Self], axis: isize) -> Result<Self> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("cat", "needs at least one tensor"))?;
        let axis = normalize_axis("cat", axis, first.rank())?;
        let mut dims = first.dims().to_vec();
        dims[axis] = 0;
        for t in tensors {
            first.check_same_device("cat", t)?;
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    expected: first.dtype().to_string(),
                    got: t.dtype(),
                });
            }
            let same_other_dims = t.rank() == first.rank()
                && (0..t.rank()).all(|i| i == axis || t.dims()[i] == first.dims()[i]);
            if !same_other_dims {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape().clone(),
                    rhs: t.shape().clone(),
                });
            }
            dims[axis] += t.dims()[axis];
        }
        let shape = Shape::new(dims);
        let _p = first.prof("cat", &[], false);
        let mut out = B::fill(first.device(), first.dtype(), shape.elem_count(), 0.0)?;
        let out_layout = Layout::contiguous(shape.clone());
        let mut start = 0;
        for t in tensors {
            let len = t.dims()[axis];
            let dst = out_layout.narrow(axis, start, len)?;
            B::copy_into(t.storage(), t.layout(), &mut out, &dst, t.dtype())?;
            start += len;
        }
        Ok(first.fresh(out, shape, first.dtype()))
    }

    /// Joins tensors of one shape along a new axis.
    pub fn stack(tensors: &[Self], axis: isize) -> Result<Self> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("stack", "needs at least one tensor"))?;
        let axis = normalize_axis("stack", axis, first.rank() + 1)? as isize;
        let parts = tensors
            .iter()
            .map(|t| {
                if t.shape() != first.shape() {
                    return Err(Error::ShapeMismatch {
                        op: "stack",
                        lhs: first.shape().clone(),
                        rhs: t.shape().clone(),
                    });
                }
                t.unsqueeze(axis)
            })
            .collect::<Result<Vec<_>>>()?;
        Self::cat(&parts, axis)
    }

    /// Writes `src` into the region of `self` at `axis`, `start..start+src.dims()[axis]`,
    /// returning the updated tensor. Copies `self` first unless it is the only handle to its
    /// storage (then the write is in place).
    pub fn slice_assign(self, axis: isize, start: usize, src: &Self) -> Result<Self> {
        self.check_same_device("slice_assign", src)?;
        let axis = normalize_axis("slice_assign", axis, self.rank())?;
        let len = src.dims().get(axis).copied().unwrap_or(0);
        let region = self.layout().narrow(axis, start, len)?;
        if region.shape() != src.shape() {
            return Err(Error::ShapeMismatch {
                op: "slice_assign",
                lhs: region.shape().clone(),
                rhs: src.shape().clone(),
            });
        }
        let mut me = self.contiguous()?;
        // `contiguous` hands back another handle on the same storage when nothing moves:
        // dropping ours leaves `me` the only one when the caller's was, so the write below
        // happens in place instead of copying the whole tensor first.
        drop(self);
        let region = me.layout().narrow(axis, start, len)?;
        let dtype = me.dtype();
        let storage = match std::sync::Arc::get_mut(&mut me.storage) {
            Some(s) => s,
            None => {
                me = me.copy_to(&me.device().clone())?;
                std::sync::Arc::get_mut(&mut me.storage).expect("fresh copy is unique")
            }
        };
        let _p = src.prof("slice_assign", &[], false);
        B::copy_into(src.storage(), src.layout(), storage, &region, dtype)?;
        Ok(me)
    }
}
