//! What a shape must satisfy, each failure a typed [`Error`]: axes in range and not repeated,
//! two shapes that broadcast, an element count that fits in `usize`.
//!
//! Why apart from [`Shape`] itself (in `dims`): [`Error`] holds shapes, so the plain type sits
//! below the error module and these checks, which return errors, above it.

use crate::dims::Dims;
use crate::{Error, Result, Shape};

impl Shape {
    /// [`Shape::checked_elem_count`] as a typed error naming `op`.
    pub fn elem_count_for(&self, op: &'static str) -> Result<usize> {
        self.checked_elem_count().ok_or_else(|| {
            Error::invalid(
                op,
                format!("shape {self} has more elements than usize can count"),
            )
        })
    }

    /// Resolves a possibly negative axis (`-1` is the last) into `0..rank`.
    pub fn axis(&self, op: &'static str, axis: isize) -> Result<usize> {
        normalize_axis(op, axis, self.rank())
    }

    /// Resolves a list of axes; rejects duplicates. Sorted.
    pub fn axes(&self, op: &'static str, axes: &[isize]) -> Result<Vec<usize>> {
        Ok(self.axis_set(op, axes)?.to_vec())
    }

    /// [`Shape::axes`] without a heap allocation (up to five axes).
    pub(crate) fn axis_set(&self, op: &'static str, axes: &[isize]) -> Result<Dims> {
        let mut out = Dims::new();
        for &a in axes {
            let a = self.axis(op, a)?;
            if out.contains(&a) {
                return Err(Error::invalid(op, format!("axis {a} given twice")));
            }
            out.push(a);
        }
        out.sort_unstable();
        Ok(out)
    }

    /// The shape both `self` and `other` broadcast to (numpy rules), or a `ShapeMismatch`.
    pub fn broadcast_with(&self, op: &'static str, other: &Shape) -> Result<Shape> {
        let rank = self.rank().max(other.rank());
        let mut dims = Dims::zeros(rank);
        for (i, d) in dims.iter_mut().enumerate() {
            let a = dim_from_right(self.dims(), rank - 1 - i);
            let b = dim_from_right(other.dims(), rank - 1 - i);
            *d = match (a, b) {
                (a, b) if a == b => a,
                (1, b) => b,
                (a, 1) => a,
                _ => {
                    return Err(Error::ShapeMismatch {
                        op,
                        lhs: self.clone(),
                        rhs: other.clone(),
                    });
                }
            };
        }
        Ok(Shape::from_dims(dims))
    }
}

fn dim_from_right(dims: &[usize], i: usize) -> usize {
    if i < dims.len() {
        dims[dims.len() - 1 - i]
    } else {
        1
    }
}

/// Resolves a possibly negative axis against `rank`.
pub fn normalize_axis(op: &'static str, axis: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(Error::AxisOutOfRange { op, axis, rank });
    }
    Ok(a as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_counts_past_usize_saturate_and_are_reported() {
        let huge = Shape::new([usize::MAX / 2, 4]);
        assert_eq!(huge.checked_elem_count(), None);
        assert_eq!(huge.elem_count(), usize::MAX);
        let e = huge.elem_count_for("zeros").unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { op: "zeros", msg } if msg.contains("usize")),
            "{e}"
        );
        // Wrapping would have given 0 here.
        assert_eq!(Shape::new([1 << 32, 1 << 32]).elem_count(), usize::MAX);
        // A zero dimension empties the shape whatever comes before it.
        assert_eq!(Shape::new([usize::MAX, 2, 0]).checked_elem_count(), Some(0));
        assert_eq!(Shape::new([usize::MAX, 0]).checked_elem_count(), Some(0));
        assert_eq!(Shape::new([0, usize::MAX]).checked_elem_count(), Some(0));
        assert_eq!(Shape::new([7]).checked_elem_count(), Some(7));
        assert_eq!(Shape::new([2, 3, 4, 5]).checked_elem_count(), Some(120));
        assert_eq!(Shape::new([3, 4]).elem_count_for("zeros").unwrap(), 12);
        assert_eq!(Shape::scalar().elem_count(), 1);
        // Strides of such a shape saturate instead of panicking.
        assert_eq!(
            Shape::new([2, usize::MAX / 2, 4]).contiguous_strides(),
            [usize::MAX, 4, 1]
        );
    }
}
