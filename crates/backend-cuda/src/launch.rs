//! Kernel arguments: shapes and strides by value, and an argument list for `cuLaunchKernel`.
//!
//! Layouts reach kernels as two fixed-size structs ([`Dims`], [`Strides`], matching
//! `kernels/common.cuh`), never as a per-launch upload. Before that, [`collapse`] drops size-1
//! dimensions and merges neighbours that are contiguous among themselves in every operand, so
//! most views need one or two dimensions and the kernels' index arithmetic stays short.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use kiln_core::{Error, Layout, Result};

pub(crate) const MAX_DIMS: usize = 8;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Dims {
    pub d: [u64; MAX_DIMS],
    pub rank: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Strides {
    pub s: [u64; MAX_DIMS],
    pub offset: u64,
}

/// Merges the dims of a shape shared by several operands (`strides[k]` per operand): size-1
/// dims go, and dim `i` folds into `i+1` when every operand has `s[i] == s[i+1] * d[i+1]`.
pub(crate) fn collapse_raw(dims: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut od: Vec<usize> = Vec::new();
    let mut os: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for (i, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let merge = !od.is_empty()
            && strides
                .iter()
                .zip(&os)
                .all(|(s, o)| *o.last().unwrap() == s[i] * d);
        if merge {
            *od.last_mut().unwrap() *= d;
            for (s, o) in strides.iter().zip(os.iter_mut()) {
                *o.last_mut().unwrap() = s[i];
            }
        } else {
            od.push(d);
            for (s, o) in strides.iter().zip(os.iter_mut()) {
                o.push(s[i]);
            }
        }
    }
    (od, os)
}

/// [`collapse_raw`] packed into kernel arguments for `N` operands; `offsets[k]` is operand k's
/// offset. Writes straight into the fixed-size structs: no heap allocation per launch.
pub(crate) fn collapse<const N: usize>(
    op: &'static str,
    dims: &[usize],
    strides: &[&[usize]; N],
    offsets: &[usize; N],
) -> Result<(Dims, [Strides; N])> {
    collapse_where(op, dims, strides, offsets, |_| true)
}

/// [`collapse`] of the dims `i` for which `keep(i)` holds (a reduction's kept or reduced axes).
pub(crate) fn collapse_where<const N: usize>(
    op: &'static str,
    dims: &[usize],
    strides: &[&[usize]; N],
    offsets: &[usize; N],
    keep: impl Fn(usize) -> bool,
) -> Result<(Dims, [Strides; N])> {
    let mut ss = [Strides::default(); N];
    let d = collapse_into(op, dims, strides, offsets, &mut ss, keep)?;
    Ok((d, ss))
}

/// [`collapse`] for a number of operands known only at run time.
pub(crate) fn collapse_dyn(
    op: &'static str,
    dims: &[usize],
    strides: &[&[usize]],
    offsets: &[usize],
) -> Result<(Dims, Vec<Strides>)> {
    let mut ss = vec![Strides::default(); strides.len()];
    let d = collapse_into(op, dims, strides, offsets, &mut ss, |_| true)?;
    Ok((d, ss))
}

/// The merge of [`collapse_raw`] over the dims that `keep` selects, written into `out` (one
/// entry per operand).
fn collapse_into(
    op: &'static str,
    dims: &[usize],
    strides: &[&[usize]],
    offsets: &[usize],
    out: &mut [Strides],
    keep: impl Fn(usize) -> bool,
) -> Result<Dims> {
    let mut d = Dims::default();
    let mut rank = 0;
    for (o, &off) in out.iter_mut().zip(offsets) {
        o.offset = off as u64;
    }
    for (i, &n) in dims.iter().enumerate() {
        if n == 1 || !keep(i) {
            continue;
        }
        let merge = rank > 0
            && strides
                .iter()
                .zip(out.iter())
                .all(|(s, o)| o.s[rank - 1] == (s[i] * n) as u64);
        if merge {
            d.d[rank - 1] *= n as u64;
            for (s, o) in strides.iter().zip(out.iter_mut()) {
                o.s[rank - 1] = s[i] as u64;
            }
            continue;
        }
        if rank == MAX_DIMS {
            let kept: Vec<usize> = (0..dims.len()).filter(|&i| keep(i)).collect();
            let sel = |v: &[usize]| kept.iter().map(|&i| v[i]).collect::<Vec<_>>();
            let ss: Vec<Vec<usize>> = strides.iter().map(|s| sel(s)).collect();
            let refs: Vec<&[usize]> = ss.iter().map(|s| &s[..]).collect();
            let got = collapse_raw(&sel(dims), &refs).0.len();
            return Err(Error::invalid(
                op,
                format!(
                    "the CUDA backend supports up to {MAX_DIMS} non-mergeable dimensions, got {got} (shape {dims:?})"
                ),
            ));
        }
        d.d[rank] = n as u64;
        for (s, o) in strides.iter().zip(out.iter_mut()) {
            o.s[rank] = s[i] as u64;
        }
        rank += 1;
    }
    d.rank = rank as i32;
    Ok(d)
}

/// Whether 32-bit index arithmetic is exact for these layouts (every element count and storage
/// extent below 2^31).
pub(crate) fn fits_u32(layouts: &[&Layout]) -> bool {
    layouts
        .iter()
        .all(|l| l.elem_count() < (1 << 31) && l.storage_extent() < (1 << 31))
}

/// Arguments for one launch, each in its own 8-byte-aligned slot of an inline buffer (no
/// heap allocation per launch), and the pointers to them that `cuLaunchKernel` takes, written
/// only for the arguments there are (a launch used to zero and return a 1 KiB array of them).
/// A clone holds the same arguments (its pointers are rewritten by its own [`Args::ptrs`]).
#[derive(Clone)]
pub(crate) struct Args {
    buf: [MaybeUninit<u64>; ARG_WORDS],
    used: usize,
    offs: [u16; MAX_ARGS],
    n: usize,
    ptrs: [MaybeUninit<*mut c_void>; MAX_ARGS],
}

/// 4 KiB: the classic kernel-parameter limit.
const ARG_WORDS: usize = 512;
/// Enough for a fused kernel at its caps (`lazy.rs`).
const MAX_ARGS: usize = 128;

impl Args {
    #[inline]
    pub fn new() -> Self {
        Args {
            buf: [MaybeUninit::uninit(); ARG_WORDS],
            used: 0,
            offs: [0; MAX_ARGS],
            n: 0,
            ptrs: [MaybeUninit::uninit(); MAX_ARGS],
        }
    }
    /// Appends one argument with the exact C type the kernel declares.
    #[inline]
    pub fn push<T: Copy>(&mut self, v: T) -> &mut Self {
        assert!(std::mem::align_of::<T>() <= 8);
        let words = std::mem::size_of::<T>().div_ceil(8).max(1);
        assert!(
            self.used + words <= ARG_WORDS && self.n < MAX_ARGS,
            "too many kernel arguments"
        );
        // SAFETY: the slot holds `words * 8 >= size_of::<T>()` bytes, 8-byte aligned, in bounds.
        unsafe { std::ptr::write(self.buf[self.used..].as_mut_ptr() as *mut T, v) };
        self.offs[self.n] = self.used as u16; // below ARG_WORDS
        self.n += 1;
        self.used += words;
        self
    }
    /// Appends one argument that is a C struct of `u64` fields, given as its words (a
    /// by-value struct whose size is known at run time, as a generated kernel's `MtArgs`).
    pub fn push_words(&mut self, words: &[u64]) -> &mut Self {
        let n = words.len();
        assert!(n > 0, "a struct argument has at least one word");
        assert!(
            self.used + n <= ARG_WORDS && self.n < MAX_ARGS,
            "too many kernel arguments"
        );
        for (slot, &w) in self.buf[self.used..self.used + n].iter_mut().zip(words) {
            *slot = MaybeUninit::new(w);
        }
        self.offs[self.n] = self.used as u16; // below ARG_WORDS
        self.n += 1;
        self.used += n;
        self
    }
    /// Pointers to each argument, valid while `self` is neither moved nor changed.
    pub fn ptrs(&mut self) -> &mut [*mut c_void] {
        let base = self.buf.as_mut_ptr();
        for (dst, &o) in self.ptrs.iter_mut().zip(&self.offs[..self.n]) {
            // SAFETY: every offset is inside `buf`.
            *dst = MaybeUninit::new(unsafe { base.add(o as usize) } as *mut c_void);
        }
        // SAFETY: the first `n` entries were written just above; `MaybeUninit<T>` has `T`'s
        // layout.
        unsafe { std::slice::from_raw_parts_mut(self.ptrs.as_mut_ptr().cast(), self.n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapse_merges_contiguous_and_drops_ones() {
        let (d, s) = collapse_raw(&[2, 1, 3, 4], &[&[12, 12, 4, 1]]);
        assert_eq!(d, vec![24]);
        assert_eq!(s, vec![vec![1]]);
        // a transpose does not merge
        let (d, s) = collapse_raw(&[3, 2], &[&[1, 3]]);
        assert_eq!((d, s), (vec![3, 2], vec![vec![1, 3]]));
        // broadcast operand blocks merging where it differs
        let (d, s) = collapse_raw(&[2, 3, 4], &[&[12, 4, 1], &[0, 1, 0]]);
        assert_eq!(d, vec![2, 3, 4]);
        assert_eq!(s[1], vec![0, 1, 0]);
    }

    /// The packed forms (fixed-size structs, no heap) merge exactly as `collapse_raw` does,
    /// also over a selection of the dims, and fail past `MAX_DIMS` with the merged count.
    #[test]
    fn packed_collapse_agrees_with_collapse_raw() {
        let cases: [(&[usize], [&[usize]; 2]); 4] = [
            (&[2, 1, 3, 4], [&[12, 12, 4, 1], &[12, 12, 4, 1]]),
            (&[3, 2], [&[1, 3], &[2, 1]]),
            (&[2, 3, 4], [&[12, 4, 1], &[0, 1, 0]]),
            (
                &[5, 1, 6, 7, 1, 2],
                [&[84, 7, 14, 2, 1, 1], &[0, 0, 14, 2, 2, 1]],
            ),
        ];
        for (dims, strides) in cases {
            for mask in 0u32..1 << dims.len() {
                let keep = |i: usize| mask & (1 << i) != 0;
                let kept: Vec<usize> = (0..dims.len()).filter(|&i| keep(i)).collect();
                let sel = |v: &[usize]| kept.iter().map(|&i| v[i]).collect::<Vec<_>>();
                let (s0, s1) = (sel(strides[0]), sel(strides[1]));
                let (rd, rs) = collapse_raw(&sel(dims), &[&s0, &s1]);
                let (d, ss) = collapse_where("t", dims, &strides, &[3, 9], keep).unwrap();
                assert_eq!(d.rank as usize, rd.len(), "{dims:?} mask {mask:b}");
                let u = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<_>>();
                assert_eq!(d.d[..rd.len()], u(&rd)[..]);
                for k in 0..2 {
                    assert_eq!(ss[k].s[..rd.len()], u(&rs[k])[..]);
                }
                assert_eq!((ss[0].offset, ss[1].offset), (3, 9));
            }
        }
        let dims = [2; MAX_DIMS + 2];
        let strides: Vec<usize> = (0..dims.len()).map(|i| 3usize.pow(i as u32)).collect();
        let err = collapse("t", &dims, &[&strides], &[0]).unwrap_err();
        assert!(err.to_string().contains("got 10"), "{err}");
        let (d, _) = collapse_dyn("t", &dims[..3], &[&[4, 2, 1], &[8, 2, 1]], &[0, 0]).unwrap();
        assert_eq!(d.rank, 2);
    }

    #[test]
    fn c_struct_sizes_match_the_kernels() {
        assert_eq!(std::mem::size_of::<Dims>(), 72);
        assert_eq!(std::mem::size_of::<Strides>(), 72);
    }
}
