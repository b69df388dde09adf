//! Reading a strided layout by flat (row-major) element index, a block at a time.
//!
//! Each layout is simplified on its own (size-1 axes dropped, axes contiguous with each other
//! merged: that keeps the row-major order of its elements), so a block of consecutive elements
//! is usually one run of the last axis: read in place when its stride is 1, a single value when
//! it is 0 (broadcast), gathered with the stride otherwise; a block that crosses runs is
//! gathered run by run with an odometer.

use kiln_core::Layout;

/// A simplified layout (see the module docs).
#[derive(Clone, Debug)]
pub(super) struct Walk {
    /// Never empty (a scalar is `[1]`).
    dims: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Where the elements `start..start + len` of a layout are.
pub(super) enum Run {
    /// Contiguous, from this storage index.
    Contig(usize),
    /// One value at this storage index, repeated.
    Const(usize),
    /// Anything else: gather it.
    Strided,
}

impl Walk {
    pub(super) fn new(l: &Layout) -> Walk {
        let mut dims: Vec<usize> = Vec::new();
        let mut strides: Vec<usize> = Vec::new();
        for (&d, &s) in l.dims().iter().zip(l.strides()) {
            if d == 1 {
                continue;
            }
            match (dims.last_mut(), strides.last_mut()) {
                (Some(pd), Some(ps)) if *ps == s * d => {
                    *pd *= d;
                    *ps = s;
                }
                _ => {
                    dims.push(d);
                    strides.push(s);
                }
            }
        }
        if dims.is_empty() {
            dims.push(1);
            strides.push(1);
        }
        Walk {
            dims,
            strides,
            offset: l.offset(),
        }
    }

    /// The multi-index of flat element `f` and its storage index.
    fn locate(&self, mut f: usize) -> (Vec<usize>, usize) {
        let mut idx = vec![0; self.dims.len()];
        let mut off = self.offset;
        for d in (0..self.dims.len()).rev() {
            idx[d] = f % self.dims[d];
            f /= self.dims[d];
            off += idx[d] * self.strides[d];
        }
        (idx, off)
    }

    /// The storage index of flat element `f` (as [`Walk::locate`], without the multi-index:
    /// this runs once per block and input, so it allocates nothing).
    fn offset_of(&self, mut f: usize) -> usize {
        let mut off = self.offset;
        for (&d, &s) in self.dims.iter().zip(&self.strides).rev() {
            off += f % d * s;
            f /= d;
        }
        off
    }

    /// Where elements `start..start + len` are.
    pub(super) fn run(&self, start: usize, len: usize) -> Run {
        let last = self.dims.len() - 1;
        let (d, s) = (self.dims[last], self.strides[last]);
        if self.strides.iter().all(|&s| s == 0) {
            return Run::Const(self.offset);
        }
        let i = start % d;
        if i + len <= d {
            let off = self.offset_of(start);
            if s == 1 || len == 1 {
                return Run::Contig(off);
            }
            if s == 0 {
                return Run::Const(off);
            }
        }
        Run::Strided
    }

    /// Calls `f(storage index, position in the block)` for elements `start..start + len`, run
    /// by run: `f(first index, first position, run length, stride)`.
    fn for_runs(&self, start: usize, len: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
        let last = self.dims.len() - 1;
        let (mut idx, mut off) = self.locate(start);
        let mut done = 0;
        while done < len {
            let n = (self.dims[last] - idx[last]).min(len - done);
            f(off, done, n, self.strides[last]);
            done += n;
            // advance the odometer by n along the last axis, carrying
            idx[last] += n;
            off += n * self.strides[last];
            let mut d = last;
            while idx[d] == self.dims[d] && d > 0 {
                off -= idx[d] * self.strides[d];
                idx[d] = 0;
                d -= 1;
                idx[d] += 1;
                off += self.strides[d];
            }
        }
    }

    /// Copies elements `start..start + out.len()` of `src` into `out`.
    pub(super) fn gather<T: Copy>(&self, src: &[T], start: usize, out: &mut [T]) {
        self.for_runs(start, out.len(), |off, pos, n, s| {
            let o = &mut out[pos..pos + n];
            match s {
                1 => o.copy_from_slice(&src[off..off + n]),
                0 => o.fill(src[off]),
                _ => {
                    for (j, v) in o.iter_mut().enumerate() {
                        *v = src[off + j * s];
                    }
                }
            }
        });
    }

    /// Writes `vals` as elements `start..start + vals.len()` through `put(storage index, v)`.
    pub(super) fn scatter<T: Copy>(&self, start: usize, vals: &[T], mut put: impl FnMut(usize, T)) {
        self.for_runs(start, vals.len(), |off, pos, n, s| {
            for j in 0..n {
                put(off + j * s, vals[pos + j]);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::Shape;

    #[test]
    fn gathers_every_view_in_row_major_order() {
        let src: Vec<usize> = (0..64).collect();
        let views = [
            Layout::contiguous([4, 6]),
            Layout::contiguous([4, 6]).transpose(0, 1).unwrap(),
            Layout::contiguous([4, 6]).narrow(1, 1, 4).unwrap(),
            Layout::contiguous([3, 1])
                .broadcast_to(&Shape::new([2, 3, 5]))
                .unwrap(),
            Layout::contiguous([2, 3, 4]).permute(&[2, 0, 1]).unwrap(),
            Layout::contiguous(Shape::scalar()),
        ];
        for l in views {
            let want: Vec<usize> = l.offsets().collect();
            let w = Walk::new(&l);
            for start in 0..want.len() {
                for len in 1..=want.len() - start {
                    let mut got = vec![0; len];
                    w.gather(&src, start, &mut got);
                    assert_eq!(got, want[start..start + len], "{l:?} {start} {len}");
                    match w.run(start, len) {
                        Run::Contig(o) => assert_eq!(want[start..start + len], src[o..o + len]),
                        Run::Const(o) => assert!(want[start..start + len].iter().all(|&x| x == o)),
                        Run::Strided => {}
                    }
                    let mut seen = vec![];
                    w.scatter(start, &got, |i, v| seen.push((i, v)));
                    assert!(seen.iter().all(|&(i, v)| i == v), "{l:?}");
                }
            }
        }
    }
}
