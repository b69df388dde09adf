//! [`Dims`]: a list of dimensions or strides that lives inline up to [`INLINE`] entries, and
//! [`Shape`], the tensor shape built on it.
//!
//! `Shape` is plain data here, below the error module (whose variants hold shapes); the checks
//! on shapes that return errors (axes, broadcasting) live in `shape`.
//!
//! Why inline: every tensor op makes a [`Shape`] and a [`Layout`](crate::Layout), and
//! every `Tensor` clone copies its layout. With `Vec`s that was four heap allocations and frees
//! per op (more with autograd, which clones tensors to save them), a sizeable part of the host
//! time of a small-op loop. Tensors of rank up to five, nearly all of them, now need none.
//! (Five, not more, keeps `Error`, which holds two shapes, within clippy's bound for error
//! types.)

use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};

/// Entries kept inline before spilling to the heap.
pub const INLINE: usize = 5;

#[derive(Clone)]
pub(crate) enum Dims {
    Inline { len: u8, buf: [usize; INLINE] },
    Heap(Vec<usize>),
}

impl Dims {
    pub fn new() -> Self {
        Dims::Inline {
            len: 0,
            buf: [0; INLINE],
        }
    }

    /// `n` zeros.
    pub fn zeros(n: usize) -> Self {
        if n <= INLINE {
            Dims::Inline {
                len: n as u8,
                buf: [0; INLINE],
            }
        } else {
            Dims::Heap(vec![0; n])
        }
    }

    pub fn push(&mut self, v: usize) {
        match self {
            Dims::Inline { len, buf } if (*len as usize) < INLINE => {
                buf[*len as usize] = v;
                *len += 1;
            }
            Dims::Inline { len, buf } => {
                let mut heap = buf[..*len as usize].to_vec();
                heap.push(v);
                *self = Dims::Heap(heap);
            }
            Dims::Heap(h) => h.push(v),
        }
    }
}

impl Default for Dims {
    fn default() -> Self {
        Dims::new()
    }
}

impl Deref for Dims {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        match self {
            Dims::Inline { len, buf } => &buf[..*len as usize],
            Dims::Heap(h) => h,
        }
    }
}

impl DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [usize] {
        match self {
            Dims::Inline { len, buf } => &mut buf[..*len as usize],
            Dims::Heap(h) => h,
        }
    }
}

impl From<&[usize]> for Dims {
    fn from(v: &[usize]) -> Self {
        if v.len() <= INLINE {
            let mut buf = [0; INLINE];
            buf[..v.len()].copy_from_slice(v);
            Dims::Inline {
                len: v.len() as u8,
                buf,
            }
        } else {
            Dims::Heap(v.to_vec())
        }
    }
}

impl From<Vec<usize>> for Dims {
    fn from(v: Vec<usize>) -> Self {
        if v.len() <= INLINE {
            Dims::from(&v[..])
        } else {
            Dims::Heap(v)
        }
    }
}

impl FromIterator<usize> for Dims {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        let mut d = Dims::new();
        for v in iter {
            d.push(v);
        }
        d
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a usize;
    type IntoIter = std::slice::Iter<'a, usize>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq for Dims {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Dims {}

impl Hash for Dims {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (**self).hash(state)
    }
}

impl std::fmt::Debug for Dims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

/// The extent of each dimension of a tensor, outermost first. A 0-d shape (`[]`) is a scalar.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Dims);

impl Shape {
    /// A shape of these dimensions (a slice, an array or a `Vec`); up to `INLINE` of them
    /// without a heap allocation.
    pub fn new(dims: impl AsRef<[usize]>) -> Self {
        Shape(Dims::from(dims.as_ref()))
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
        match &self.0[..] {
            // Most shapes, without the scan for a zero (it runs several times per op): one
            // product cannot overflow past a zero factor.
            [] => Some(1),
            [a] => Some(*a),
            [a, b] => a.checked_mul(*b),
            d if d.contains(&0) => Some(0),
            d => d.iter().try_fold(1usize, |acc, &x| acc.checked_mul(x)),
        }
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
    fn inline_and_heap_agree() {
        for n in [0, 1, INLINE, INLINE + 1, 20] {
            let v: Vec<usize> = (0..n).map(|i| i * 3 + 1).collect();
            let a = Dims::from(v.clone());
            let b: Dims = v.iter().copied().collect();
            let c = Dims::from(&v[..]);
            assert_eq!(&*a, &v[..]);
            assert_eq!(a, b);
            assert_eq!(b, c);
            assert_eq!(matches!(b, Dims::Heap(_)), n > INLINE);
            let mut z = Dims::zeros(n);
            z.copy_from_slice(&v);
            assert_eq!(z, a);
        }
    }
}
