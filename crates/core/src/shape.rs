//! Shapes, and the broadcasting rule between two of them.

use std::fmt;

use crate::dims::Dims;
use crate::{Error, Result};

/// The extent of each dimension of a tensor, outermost first. A 0-d shape (`[]`) is a scalar.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Dims);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(Dims::from(dims.into()))
    }

    pub(crate) fn from_dims(dims: Dims) -> Self {
        Shape(dims)
    }

    /// The 0-d shape of a scalar.
    pub fn scalar() -> Self {
        Shape(Dims::new())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar, 0 when any dimension is 0), saturating at
    /// `usize::MAX` when the product overflows.
    ///
    /// Why saturate: shapes are built from any user input (`zeros([usize::MAX / 2, 4])`), and a
    /// product that wrapped around would ask a backend for a small buffer behind a huge shape,
    /// while one that panicked would abort a program that asked a fair question. `usize::MAX`
    /// elements can never be allocated, so the backend's allocation reports such a shape as a
    /// typed error naming the op ([`Shape::checked_elem_count`] tells the case apart).
    pub fn elem_count(&self) -> usize {
        self.checked_elem_count().unwrap_or(usize::MAX)
    }

    /// Number of elements, or `None` when it does not fit in `usize` (no dimension is 0 and the
    /// product overflows).
    pub fn checked_elem_count(&self) -> Option<usize> {
        if self.0.contains(&0) {
            return Some(0);
        }
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// [`Shape::checked_elem_count`] as a typed error naming `op`.
    pub fn elem_count_for(&self, op: &'static str) -> Result<usize> {
        self.checked_elem_count().ok_or_else(|| {
            Error::invalid(
                op,
                format!("shape {self} has more elements than usize can count"),
            )
        })
    }

    /// Row-major (C order) strides, in elements.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        self.contiguous_dims().to_vec()
    }

    /// [`Shape::contiguous_strides`] without a heap allocation (rank up to five).
    pub(crate) fn contiguous_dims(&self) -> Dims {
        let mut strides = Dims::zeros(self.rank());
        let mut acc = 1;
        for (s, &d) in strides.iter_mut().zip(self.0.iter()).rev() {
            *s = acc;
            // Saturating: a shape past usize (see `elem_count`) never gets storage.
            acc = acc.saturating_mul(d);
        }
        strides
    }

    /// Resolves a possibly negative axis (`-1` is the last) into `0..rank`.
    pub fn axis(&self, op: &'static str, axis: isize) -> Result<usize> {
        normalize_axis(op, axis, self.rank())
    }

    /// Resolves a list of axes; rejects duplicates.
    pub fn axes(&self, op: &'static str, axes: &[isize]) -> Result<Vec<usize>> {
        let mut out = Vec::with_capacity(axes.len());
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
            let a = dim_from_right(&self.0, rank - 1 - i);
            let b = dim_from_right(&other.0, rank - 1 - i);
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
        Ok(Shape(dims))
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

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(Dims::from(v))
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(Dims::from(v))
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(Dims::from(&v[..]))
    }
}
impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape::scalar()
    }
}
impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(Dims::from(&[d][..]))
    }
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
        assert_eq!(Shape::new([3, 4]).elem_count_for("zeros").unwrap(), 12);
        assert_eq!(Shape::scalar().elem_count(), 1);
        // Strides of such a shape saturate instead of panicking.
        assert_eq!(
            Shape::new([2, usize::MAX / 2, 4]).contiguous_strides(),
            [usize::MAX, 4, 1]
        );
    }
}
