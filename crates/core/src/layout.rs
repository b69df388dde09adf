//! Strided layouts: how a tensor's logical indices map into its storage.
//!
//! A layout is a shape, one stride per dimension (in elements, never negative) and an offset.
//! Every view (reshape where possible, transpose, permute, narrow, broadcast, squeeze, unsqueeze)
//! is a new layout over the same storage; no data moves. Broadcast dimensions have stride 0.

use crate::dims::Dims;
use crate::{Error, Result, Shape};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Shape,
    strides: Dims,
    offset: usize,
}

impl Layout {
    /// A row-major layout at offset 0.
    pub fn contiguous(shape: impl Into<Shape>) -> Self {
        let shape = shape.into();
        let strides = shape.contiguous_dims();
        Layout {
            shape,
            strides,
            offset: 0,
        }
    }

    /// A layout from raw parts (strides as a slice, an array or a `Vec`). The caller
    /// guarantees every index stays inside its storage.
    pub fn from_parts(shape: Shape, strides: impl AsRef<[usize]>, offset: usize) -> Self {
        let strides = strides.as_ref();
        assert_eq!(shape.rank(), strides.len(), "one stride per dimension");
        Layout {
            shape,
            strides: Dims::from(strides),
            offset,
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }

    /// Row-major with no gaps (strides of size-1 dimensions do not matter).
    pub fn is_contiguous(&self) -> bool {
        Self::strides_row_major(self.dims(), &self.strides)
    }

    /// Whether every index reads the same element (each dimension of size > 1 has stride 0).
    pub fn reads_one(&self) -> bool {
        Self::strides_read_one(self.dims(), &self.strides)
    }

    /// Whether `strides` are row-major with no gaps for `dims` (strides of size-1 dimensions do
    /// not matter): [`Layout::is_contiguous`] for dimensions and strides held apart, as the
    /// code generators simplify them.
    pub fn strides_row_major(dims: &[usize], strides: &[usize]) -> bool {
        let mut acc = 1usize;
        for (&d, &s) in dims.iter().zip(strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc = acc.saturating_mul(d);
        }
        true
    }

    /// Whether `dims`/`strides` address one element throughout: [`Layout::reads_one`] for
    /// dimensions and strides held apart.
    pub fn strides_read_one(dims: &[usize], strides: &[usize]) -> bool {
        dims.iter().zip(strides).all(|(&d, &s)| d <= 1 || s == 0)
    }

    /// `Some(offset..offset+len)` when the elements are one contiguous run in row-major order.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.elem_count())
    }

    /// One past the largest storage index this layout touches (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.elem_count() == 0 {
            return 0;
        }
        self.offset
            + self
                .dims()
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// A reshape that shares storage, or `None` when the strides make a copy necessary
    /// (numpy's rule: each new dimension must come from dimensions that are contiguous among
    /// themselves).
    pub fn reshape(&self, shape: &Shape) -> Result<Option<Layout>> {
        if shape.elem_count() != self.elem_count() {
            return Err(Error::BadReshape {
                op: "reshape",
                from: self.shape.clone(),
                to: shape.clone(),
            });
        }
        // An empty tensor has no elements to place: any strides will do (the stride-matching
        // loop below cannot group dims whose products are 0).
        if self.is_contiguous() || shape.elem_count() == 0 {
            return Ok(Some(Layout {
                shape: shape.clone(),
                strides: shape.contiguous_dims(),
                offset: self.offset,
            }));
        }
        // Drop size-1 dims of the source; they carry no stride information.
        let (od, os): (Vec<usize>, Vec<usize>) = self
            .dims()
            .iter()
            .zip(&self.strides)
            .filter(|(d, _)| **d != 1)
            .map(|(&d, &s)| (d, s))
            .unzip();
        let nd = shape.dims();
        let mut ns = vec![0usize; nd.len()];
        let (mut oi, mut ni) = (0, 0);
        while ni < nd.len() && oi < od.len() {
            if nd[ni] == 1 {
                ns[ni] = 0;
                ni += 1;
                continue;
            }
            // Grow a group of old dims [oi, oj) and new dims [ni, nj) with equal products.
            let (mut oj, mut nj) = (oi + 1, ni + 1);
            let (mut op, mut np) = (od[oi], nd[ni]);
            while op != np {
                if op < np {
                    op *= od[oj];
                    oj += 1;
                } else {
                    np *= nd[nj];
                    nj += 1;
                }
            }
            // The old dims of the group must be contiguous among themselves.
            for k in oi..oj - 1 {
                if os[k] != od[k + 1] * os[k + 1] {
                    return Ok(None);
                }
            }
            // New strides, innermost of the group first.
            ns[nj - 1] = os[oj - 1];
            for k in (ni..nj - 1).rev() {
                ns[k] = ns[k + 1] * nd[k + 1];
            }
            oi = oj;
            ni = nj;
        }
        for s in ns.iter_mut().skip(ni) {
            *s = 0; // trailing size-1 dims
        }
        Ok(Some(Layout {
            shape: shape.clone(),
            strides: Dims::from(ns),
            offset: self.offset,
        }))
    }

    /// Reorders dimensions: dimension `i` of the result is dimension `perm[i]` of `self`.
    pub fn permute(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        // A bit per axis seen (ranks past 64 take the slow check below).
        let mut seen = 0u64;
        let mut repeated = |p: usize| {
            if rank > 64 {
                return perm.iter().filter(|&&q| q == p).count() > 1;
            }
            let was = seen & (1 << p) != 0;
            seen |= 1 << p;
            was
        };
        if perm.len() != rank || perm.iter().any(|&p| p >= rank || repeated(p)) {
            return Err(Error::invalid(
                "permute",
                format!(
                    "{perm:?} is not a permutation of the {rank} axes of {}",
                    self.shape
                ),
            ));
        }
        Ok(Layout {
            shape: Shape::from_dims(perm.iter().map(|&p| self.dims()[p]).collect()),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// Swaps two (already normalized) axes.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Layout> {
        let mut perm: Dims = (0..self.rank()).collect();
        if a >= perm.len() || b >= perm.len() {
            return Err(Error::AxisOutOfRange {
                op: "transpose",
                axis: a.max(b) as isize,
                rank: self.rank(),
            });
        }
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Keeps `len` entries of `axis` starting at `start`.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Layout> {
        let dim = self.dims()[axis];
        if start.checked_add(len).is_none_or(|end| end > dim) {
            return Err(Error::invalid(
                "narrow",
                format!(
                    "range {start}..{} is outside axis {axis} of size {dim} (shape {})",
                    start.saturating_add(len),
                    self.shape
                ),
            ));
        }
        let mut dims = self.dims().to_vec();
        dims[axis] = len;
        let offset = if len == 0 {
            self.offset
        } else {
            self.offset + start * self.strides[axis]
        };
        Ok(Layout {
            shape: Shape::new(dims),
            strides: self.strides.clone(),
            offset,
        })
    }

    /// Broadcasts to `shape` (numpy rules) with stride 0 on the new or stretched dimensions.
    pub fn broadcast_to(&self, shape: &Shape) -> Result<Layout> {
        let err = || Error::ShapeMismatch {
            op: "broadcast_to",
            lhs: self.shape.clone(),
            rhs: shape.clone(),
        };
        if shape.rank() < self.rank() {
            return Err(err());
        }
        let extra = shape.rank() - self.rank();
        let mut strides = Dims::zeros(shape.rank());
        for (i, &d) in shape.dims().iter().enumerate() {
            if i < extra {
                continue;
            }
            let (od, os) = (self.dims()[i - extra], self.strides[i - extra]);
            strides[i] = if od == d {
                os
            } else if od == 1 {
                0
            } else {
                return Err(err());
            };
        }
        Ok(Layout {
            shape: shape.clone(),
            strides,
            offset: self.offset,
        })
    }

    /// Removes a size-1 axis.
    pub fn squeeze(&self, axis: usize) -> Result<Layout> {
        if self.dims()[axis] != 1 {
            return Err(Error::invalid(
                "squeeze",
                format!(
                    "axis {axis} of shape {} has size {}, not 1",
                    self.shape,
                    self.dims()[axis]
                ),
            ));
        }
        let keep = |v: &[usize]| -> Dims {
            v.iter()
                .enumerate()
                .filter(|&(i, _)| i != axis)
                .map(|(_, &x)| x)
                .collect()
        };
        Ok(Layout {
            shape: Shape::from_dims(keep(self.dims())),
            strides: keep(&self.strides),
            offset: self.offset,
        })
    }

    /// Inserts a size-1 axis at `axis` (in `0..=rank`).
    pub fn unsqueeze(&self, axis: usize) -> Result<Layout> {
        if axis > self.rank() {
            return Err(Error::AxisOutOfRange {
                op: "unsqueeze",
                axis: axis as isize,
                rank: self.rank(),
            });
        }
        let with = |v: &[usize], x: usize| -> Dims {
            let (a, b) = v.split_at(axis);
            a.iter()
                .copied()
                .chain([x])
                .chain(b.iter().copied())
                .collect()
        };
        Ok(Layout {
            shape: Shape::from_dims(with(self.dims(), 1)),
            strides: with(&self.strides, 0),
            offset: self.offset,
        })
    }

    /// Storage offsets of every element, in row-major order of the logical index.
    pub fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets {
            layout: self,
            index: vec![0; self.rank()],
            next: if self.elem_count() == 0 {
                None
            } else {
                Some(self.offset)
            },
        }
    }
}

/// Iterator over the storage offsets of a layout (see [`Layout::offsets`]).
pub struct StridedOffsets<'a> {
    layout: &'a Layout,
    index: Vec<usize>,
    next: Option<usize>,
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        let cur = self.next?;
        let dims = self.layout.dims();
        let strides = self.layout.strides();
        let mut off = cur;
        let mut done = true;
        for i in (0..dims.len()).rev() {
            if self.index[i] + 1 < dims[i] {
                self.index[i] += 1;
                off += strides[i];
                done = false;
                break;
            }
            off -= self.index[i] * strides[i];
            self.index[i] = 0;
        }
        self.next = if done { None } else { Some(off) };
        Some(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_element_reads_and_row_major_strides() {
        assert!(Layout::contiguous(Shape::scalar()).reads_one());
        assert!(Layout::from_parts(Shape::new([3, 4]), vec![0, 0], 5).reads_one());
        assert!(Layout::from_parts(Shape::new([1, 4]), vec![7, 0], 0).reads_one());
        assert!(!Layout::from_parts(Shape::new([3, 4]), vec![0, 1], 0).reads_one());
        assert!(Layout::strides_row_major(&[3, 1, 4], &[4, 99, 1]));
        assert!(!Layout::strides_row_major(&[3, 4], &[1, 3]));
    }

    #[test]
    fn offsets_of_transpose() {
        let l = Layout::contiguous([2, 3]).transpose(0, 1).unwrap();
        assert_eq!(l.offsets().collect::<Vec<_>>(), vec![0, 3, 1, 4, 2, 5]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn reshape_of_view_shares_when_possible() {
        let l = Layout::contiguous([4, 6]).narrow(0, 1, 2).unwrap(); // rows 1..3, contiguous
        let r = l.reshape(&Shape::new([12])).unwrap().unwrap();
        assert_eq!(r.offsets().collect::<Vec<_>>(), (6..18).collect::<Vec<_>>());
        let t = Layout::contiguous([4, 6]).transpose(0, 1).unwrap();
        assert!(t.reshape(&Shape::new([24])).unwrap().is_none());
        // splitting a transposed axis is fine
        let s = t.reshape(&Shape::new([2, 3, 4])).unwrap().unwrap();
        let want: Vec<usize> = t.offsets().collect();
        assert_eq!(s.offsets().collect::<Vec<_>>(), want);
        // an empty, non-contiguous view reshapes without a copy (it used to panic)
        let e = Layout::contiguous([2, 1]).narrow(1, 0, 0).unwrap();
        let e = Layout::from_parts(e.shape().clone(), vec![1, 1], 0);
        assert!(!e.is_contiguous());
        assert_eq!(
            e.reshape(&Shape::new([0])).unwrap().unwrap().elem_count(),
            0
        );
    }

    #[test]
    fn bad_reshape_names_shapes() {
        let e = Layout::contiguous([2, 3])
            .reshape(&Shape::new([4]))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "reshape: cannot reshape [2, 3] (6 elements) into [4] (4 elements)"
        );
    }

    #[test]
    fn broadcast_and_scalar() {
        let l = Layout::contiguous([3, 1])
            .broadcast_to(&Shape::new([2, 3, 4]))
            .unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
        let s = Layout::contiguous(Shape::scalar());
        assert_eq!(s.offsets().collect::<Vec<_>>(), vec![0]);
        let e = Layout::contiguous([2, 0]);
        assert_eq!(e.offsets().count(), 0);
    }
}
