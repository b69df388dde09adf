//! [`Dims`]: a list of dimensions or strides that lives inline up to [`INLINE`] entries.
//!
//! Why: every tensor op makes a [`Shape`](crate::Shape) and a [`Layout`](crate::Layout), and
//! every `Tensor` clone copies its layout. With `Vec`s that was four heap allocations and frees
//! per op (more with autograd, which clones tensors to save them), a sizeable part of the host
//! time of a small-op loop. Tensors of rank up to five, nearly all of them, now need none.
//! (Five, not more, keeps `Error`, which holds two shapes, within clippy's bound for error
//! types.)

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
