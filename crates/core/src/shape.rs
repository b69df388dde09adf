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

    /// Number of elements (1 for a scalar, 0 when any dimension is 0).
    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
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
            acc *= d;
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
