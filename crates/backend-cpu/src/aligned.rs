//! [`AlignedVec`]: a `Vec` whose elements start on a cache line.
//!
//! Why: the vector kernels load 64 bytes at a time (AVX-512), and a load that straddles two
//! cache lines costs two. A `Vec` from glibc starts 16 bytes past a 64-byte boundary (a large
//! one right after its `mmap` chunk's header), so every load of a contiguous kernel straddled:
//! on a 2-core Xeon VM (2026-11-29) the two 400x784 matrix-vector products of a
//! logistic-regression step took 35–41 µs on such a matrix and 24–28 µs on the same matrix
//! starting on a line (BENCHMARKS.md). The elements are therefore placed `start` elements into
//! a vector a little longer than they are, where the first lands on a 64-byte boundary; no
//! allocator of our own and no `unsafe`.

use std::ops::{Deref, DerefMut};

/// The boundary the elements start on: one cache line, one AVX-512 vector.
pub const ALIGN: usize = 64;

/// Below this many bytes the elements stay where the allocator put them: a vector that small
/// is a few loads, and its padding would be a large share of it.
const ALIGN_MIN_BYTES: usize = 256;

/// `len` elements of `vec` from `start`, the first on an [`ALIGN`]-byte boundary when the
/// buffer holds at least [`ALIGN_MIN_BYTES`] (and the allocator's placement allows it).
/// Dereferences to those elements only.
#[derive(Debug)]
pub struct AlignedVec<T> {
    vec: Vec<T>,
    start: usize,
    len: usize,
}

impl<T> AlignedVec<T> {
    /// No elements (no allocation).
    pub const fn empty() -> AlignedVec<T> {
        AlignedVec {
            vec: Vec::new(),
            start: 0,
            len: 0,
        }
    }
}

impl<T: bytemuck::Pod> AlignedVec<T> {
    /// Whether `len` elements are worth a padded buffer.
    fn wants_alignment(len: usize) -> bool {
        len.saturating_mul(size_of::<T>()) >= ALIGN_MIN_BYTES
    }

    /// The elements to allocate for `len` aligned ones: room for the padding.
    pub(crate) fn padded_len(len: usize) -> usize {
        if Self::wants_alignment(len) {
            len.saturating_add(ALIGN / size_of::<T>().max(1))
        } else {
            len
        }
    }

    /// The first `len` elements of `vec` from the first aligned position: `vec` must hold
    /// [`padded_len`](Self::padded_len)`(len)` elements (a zeroed allocation).
    pub(crate) fn in_padded(vec: Vec<T>, len: usize) -> AlignedVec<T> {
        debug_assert_eq!(vec.len(), Self::padded_len(len));
        let start = if Self::wants_alignment(len) {
            Self::offset_to_line(vec.as_ptr())
        } else {
            0
        };
        AlignedVec { vec, start, len }
    }

    /// The elements from `p` to the next [`ALIGN`]-byte boundary (0 when `p` is on one, or
    /// when no whole number of elements reaches one).
    fn offset_to_line(p: *const T) -> usize {
        let bytes = (ALIGN - p as usize % ALIGN) % ALIGN;
        if bytes.is_multiple_of(size_of::<T>().max(1)) {
            bytes / size_of::<T>().max(1)
        } else {
            0
        }
    }

    /// A caller's vector, moved within its own allocation to start on a line when it is large
    /// enough to care: the allocation grows by at most one line (`realloc`; glibc grows a
    /// large, separately mapped one with `mremap`, moving pages rather than bytes), then the
    /// elements move up once, in place. kiln makes no second buffer of its own; if even that
    /// line is refused, the elements stay where they are.
    pub fn from_vec(mut vec: Vec<T>) -> AlignedVec<T> {
        let len = vec.len();
        if !Self::wants_alignment(len) || Self::offset_to_line(vec.as_ptr()) == 0 {
            return AlignedVec { vec, start: 0, len };
        }
        if vec.try_reserve_exact(Self::padded_len(len) - len).is_err() {
            // No room for one more line: the elements stay where they are (slower loads,
            // the same values), never an abort.
            return AlignedVec { vec, start: 0, len };
        }
        let start = Self::offset_to_line(vec.as_ptr());
        vec.resize(start + len, T::zeroed());
        vec.copy_within(0..len, start);
        AlignedVec { vec, start, len }
    }

    /// A copy of `data` in a fresh padded buffer.
    pub fn from_slice(data: &[T]) -> AlignedVec<T> {
        let len = data.len();
        let mut v = Self::in_padded(vec![T::zeroed(); Self::padded_len(len)], len);
        v.copy_from_slice(data);
        v
    }

    /// The elements as a plain `Vec` (moved down to its start when they were not there).
    pub fn into_vec(mut self) -> Vec<T> {
        if self.start > 0 {
            self.vec.copy_within(self.start..self.start + self.len, 0);
        }
        self.vec.truncate(self.len);
        self.vec
    }
}

/// A copy in a fresh padded buffer (a copy of the `Vec` would keep `start` at another
/// address, off the line).
impl<T: bytemuck::Pod> Clone for AlignedVec<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T> Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.vec[self.start..self.start + self.len]
    }
}

impl<T> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_line<T>(s: &[T]) -> bool {
        (s.as_ptr() as usize).is_multiple_of(ALIGN)
    }

    #[test]
    fn padded_buffers_start_on_a_line() {
        for len in [64usize, 100, 400, 784, 313_600] {
            let v =
                AlignedVec::<f32>::in_padded(vec![0.0; AlignedVec::<f32>::padded_len(len)], len);
            assert_eq!(v.len(), len);
            assert!(on_line(&v), "{len} f32 at {:p}", v.as_ptr());
            let c = v.clone();
            assert!(on_line(&c), "a clone of {len} f32 at {:p}", c.as_ptr());
            let n = len * 4;
            let b = AlignedVec::<u8>::in_padded(vec![0; AlignedVec::<u8>::padded_len(n)], n);
            assert!(on_line(&b), "{n} u8 at {:p}", b.as_ptr());
        }
        // Too small to pad: exactly what was asked for.
        assert_eq!(AlignedVec::<f32>::padded_len(8), 8);
    }

    #[test]
    fn a_callers_vector_moves_onto_a_line_with_its_values() {
        for len in [64usize, 1000, 313_600] {
            // A vector the allocator placed off a line (most are: glibc aligns to 16 bytes).
            let mut held = Vec::new();
            let v = loop {
                let v: Vec<f32> = (0..len).map(|i| i as f32 - 0.5).collect();
                if !on_line(&v) {
                    break v;
                }
                held.push(v);
                assert!(
                    held.len() < 64,
                    "every vector of {len} f32 started on a line"
                );
            };
            let want = v.clone();
            let a = AlignedVec::from_vec(v);
            assert!(on_line(&a), "{len} at {:p}", a.as_ptr());
            assert_eq!(&a[..], &want[..]);
            assert_eq!(a.into_vec(), want);
        }
        // What a storage holds: an op's output, and a caller's vector handed over.
        let dev = crate::CpuDevice::new(0).unwrap();
        let out = crate::storage::alloc::<f32>("test", dev, 1000).unwrap();
        assert!(on_line(&out), "an op's output at {:p}", out.as_ptr());
        let v: Vec<f32> = (0..1001).map(|i| i as f32).collect();
        let data = crate::CpuData::from_host_owned(kiln_core::HostBuffer::F32(v[1..].to_vec()));
        let crate::CpuData::F32(h) = &data else {
            panic!("{data:?}")
        };
        assert!(on_line(h), "a caller's vector at {:p}", h.as_ptr());
        assert_eq!(&h[..], &v[1..]);

        let small = AlignedVec::from_vec(vec![1.0f32, 2.0]);
        assert_eq!(&small[..], &[1.0, 2.0]);
    }
}
