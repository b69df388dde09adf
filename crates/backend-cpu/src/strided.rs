//! Walking strided layouts fast, and the drivers every elementwise kernel runs on.
//!
//! A [`Plan`] describes how N same-shaped operands are laid out, after dropping size-1 axes and
//! merging axes that are contiguous in every operand. Its last axis is the "run": the drivers
//! split the (contiguous, row-major) output into runs, find each operand's start by an odometer
//! over the outer axes, and hand contiguous slices to a *slice kernel*. An operand whose run is
//! strided (a transposed or broadcast view) is first gathered into a small block buffer, so a
//! kernel only ever sees plain slices and its loop autovectorizes. Fully contiguous operands skip
//! all of this. Large outputs are split across cores with rayon.

use std::ops::Range;

use kiln_core::Layout;
use rayon::prelude::*;

/// Outputs with at least this many elements are computed in parallel.
pub const PAR_MIN: usize = 1 << 15;
/// Strided runs are gathered in blocks of this many elements.
const BLOCK: usize = 1024;

/// How many elements one parallel task gets for an `n`-element job.
pub fn par_chunk(n: usize) -> usize {
    let tasks = 4 * rayon::current_num_threads().max(1);
    n.div_ceil(tasks).max(PAR_MIN / 2)
}

/// N same-shaped layouts, simplified (see the module docs).
#[derive(Clone, Debug)]
pub struct Plan<const N: usize> {
    /// Simplified axes, outermost first; never empty (a scalar is `[1]`).
    dims: Vec<usize>,
    strides: [Vec<usize>; N],
    base: [usize; N],
}

impl<const N: usize> Plan<N> {
    /// All layouts must have the same shape.
    pub fn new(layouts: [&Layout; N]) -> Self {
        let shape = layouts[0].dims();
        debug_assert!(layouts.iter().all(|l| l.dims() == shape));
        let mut dims: Vec<usize> = Vec::with_capacity(shape.len());
        let mut strides: [Vec<usize>; N] = std::array::from_fn(|_| Vec::new());
        for (i, &d) in shape.iter().enumerate() {
            if d == 1 {
                continue;
            }
            let mergeable = !dims.is_empty()
                && (0..N).all(|k| strides[k].last() == Some(&(layouts[k].strides()[i] * d)));
            if mergeable {
                *dims.last_mut().expect("non-empty") *= d;
                for k in 0..N {
                    *strides[k].last_mut().expect("non-empty") = layouts[k].strides()[i];
                }
            } else {
                dims.push(d);
                for k in 0..N {
                    strides[k].push(layouts[k].strides()[i]);
                }
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for s in strides.iter_mut() {
                s.push(1);
            }
        }
        Plan {
            dims,
            strides,
            base: std::array::from_fn(|k| layouts[k].offset()),
        }
    }

    /// Length of one run (the last simplified axis).
    pub fn run_len(&self) -> usize {
        *self.dims.last().expect("never empty")
    }

    /// Stride of operand `k` along the run.
    pub fn run_stride(&self, k: usize) -> usize {
        *self.strides[k].last().expect("never empty")
    }

    /// Number of runs.
    pub fn runs(&self) -> usize {
        self.dims[..self.dims.len() - 1].iter().product()
    }

    /// Calls `f(run, starts)` for every run in `runs`, with each operand's storage offset of
    /// the run's first element.
    pub fn for_runs(&self, runs: Range<usize>, mut f: impl FnMut(usize, [usize; N])) {
        let outer = &self.dims[..self.dims.len() - 1];
        let mut idx = vec![0usize; outer.len()];
        let mut rem = runs.start;
        for d in (0..outer.len()).rev() {
            idx[d] = rem % outer[d];
            rem /= outer[d];
        }
        let mut offs: [usize; N] = std::array::from_fn(|k| {
            self.base[k]
                + idx
                    .iter()
                    .zip(&self.strides[k])
                    .map(|(i, s)| i * s)
                    .sum::<usize>()
        });
        for r in runs {
            f(r, offs);
            for d in (0..outer.len()).rev() {
                idx[d] += 1;
                for (o, s) in offs.iter_mut().zip(&self.strides) {
                    *o += s[d];
                }
                if idx[d] < outer[d] {
                    break;
                }
                for (o, s) in offs.iter_mut().zip(&self.strides) {
                    *o -= s[d] * outer[d];
                }
                idx[d] = 0;
            }
        }
    }
}

/// A block of a strided operand gathered into contiguous memory, on the stack (filled on first
/// use): a heap buffer here was one `malloc` of a few KiB per broadcast operand per call, and
/// glibc consolidates its fast bins on every request of 1 KiB or more (~0.3 µs of a
/// 400-element add of a broadcast scalar, 2-core VM, 2026-11-28).
struct Gather<T>(Option<[T; BLOCK]>);

impl<T: Copy> Gather<T> {
    fn new() -> Self {
        Gather(None)
    }

    /// The `len` (at most [`BLOCK`]) elements of `src` from `start` with `stride`: borrowed
    /// when contiguous, otherwise gathered here.
    #[inline]
    fn run<'a>(&'a mut self, src: &'a [T], start: usize, stride: usize, len: usize) -> &'a [T] {
        if stride == 1 || len == 1 {
            return &src[start..start + len];
        }
        let buf = &mut self.0.get_or_insert([src[start]; BLOCK])[..len];
        if stride == 0 {
            buf.fill(src[start]);
        } else {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = src[start + i * stride];
            }
        }
        buf
    }
}

/// Splits `out` into chunks (in parallel when large) and calls `f(start, chunk)`;
/// `align` makes every chunk start a multiple of it.
pub fn par_out<U: Send>(out: &mut [U], align: usize, f: impl Fn(usize, &mut [U]) + Sync + Send) {
    let n = out.len();
    if n < PAR_MIN {
        f(0, out);
        return;
    }
    let align = align.max(1);
    let chunk = par_chunk(n).div_ceil(align) * align;
    out.par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(i, o)| f(i * chunk, o));
}

/// `out[i] = kern(a[i])` over a strided input; `out` is contiguous with `la`'s shape.
pub fn map1<A, U>(a: &[A], la: &Layout, out: &mut [U], kern: impl Fn(&[A], &mut [U]) + Sync)
where
    A: Copy + Send + Sync,
    U: Copy + Send + Sync,
{
    if out.is_empty() {
        return;
    }
    if let Some(ra) = la.contiguous_range() {
        let a = &a[ra];
        par_out(out, 1, |s, o| kern(&a[s..s + o.len()], o));
        return;
    }
    let plan = Plan::new([la]);
    let len = plan.run_len();
    let st = plan.run_stride(0);
    par_out(out, len, |s, o| {
        let mut buf = Gather::new();
        let r0 = s / len;
        plan.for_runs(r0..r0 + o.len() / len, |r, [oa]| {
            let orun = &mut o[(r - r0) * len..][..len];
            for b in (0..len).step_by(BLOCK) {
                let bl = BLOCK.min(len - b);
                kern(buf.run(a, oa + b * st, st, bl), &mut orun[b..b + bl]);
            }
        });
    });
}

/// `out[i] = kern(a[i], b[i])` over two strided inputs of the output's shape.
pub fn map2<A, B, U>(
    a: &[A],
    la: &Layout,
    b: &[B],
    lb: &Layout,
    out: &mut [U],
    kern: impl Fn(&[A], &[B], &mut [U]) + Sync,
) where
    A: Copy + Send + Sync,
    B: Copy + Send + Sync,
    U: Copy + Send + Sync,
{
    if out.is_empty() {
        return;
    }
    if let (Some(ra), Some(rb)) = (la.contiguous_range(), lb.contiguous_range()) {
        let (a, b) = (&a[ra], &b[rb]);
        par_out(out, 1, |s, o| {
            let e = s + o.len();
            kern(&a[s..e], &b[s..e], o)
        });
        return;
    }
    let plan = Plan::new([la, lb]);
    let len = plan.run_len();
    let (sa, sb) = (plan.run_stride(0), plan.run_stride(1));
    par_out(out, len, |s, o| {
        let (mut ba, mut bb) = (Gather::new(), Gather::new());
        let r0 = s / len;
        plan.for_runs(r0..r0 + o.len() / len, |r, [oa, ob]| {
            let orun = &mut o[(r - r0) * len..][..len];
            for k in (0..len).step_by(BLOCK) {
                let bl = BLOCK.min(len - k);
                kern(
                    ba.run(a, oa + k * sa, sa, bl),
                    bb.run(b, ob + k * sb, sb, bl),
                    &mut orun[k..k + bl],
                );
            }
        });
    });
}

/// `out[i] = kern(a[i], b[i], c[i])` over three strided inputs of the output's shape.
#[allow(clippy::too_many_arguments)]
pub fn map3<A, B, C, U>(
    a: &[A],
    la: &Layout,
    b: &[B],
    lb: &Layout,
    c: &[C],
    lc: &Layout,
    out: &mut [U],
    kern: impl Fn(&[A], &[B], &[C], &mut [U]) + Sync,
) where
    A: Copy + Send + Sync,
    B: Copy + Send + Sync,
    C: Copy + Send + Sync,
    U: Copy + Send + Sync,
{
    if out.is_empty() {
        return;
    }
    let plan = Plan::new([la, lb, lc]);
    let len = plan.run_len();
    let (sa, sb, sc) = (plan.run_stride(0), plan.run_stride(1), plan.run_stride(2));
    par_out(out, len, |s, o| {
        let (mut ba, mut bb, mut bc) = (Gather::new(), Gather::new(), Gather::new());
        let r0 = s / len;
        plan.for_runs(r0..r0 + o.len() / len, |r, [oa, ob, oc]| {
            let orun = &mut o[(r - r0) * len..][..len];
            for k in (0..len).step_by(BLOCK) {
                let bl = BLOCK.min(len - k);
                kern(
                    ba.run(a, oa + k * sa, sa, bl),
                    bb.run(b, ob + k * sb, sb, bl),
                    bc.run(c, oc + k * sc, sc, bl),
                    &mut orun[k..k + bl],
                );
            }
        });
    });
}

/// Copies the elements of `src` at `ls` into `dst` at `ld` (same shape), in place.
pub fn copy_strided<T: Copy + Send + Sync>(src: &[T], ls: &Layout, dst: &mut [T], ld: &Layout) {
    if ls.elem_count() == 0 {
        return;
    }
    if let (Some(rs), Some(rd)) = (ls.contiguous_range(), ld.contiguous_range()) {
        dst[rd].copy_from_slice(&src[rs]);
        return;
    }
    let plan = Plan::new([ls, ld]);
    let len = plan.run_len();
    let (ss, sd) = (plan.run_stride(0), plan.run_stride(1));
    plan.for_runs(0..plan.runs(), |_, [os, od]| {
        if ss == 1 && sd == 1 {
            dst[od..od + len].copy_from_slice(&src[os..os + len]);
        } else {
            for i in 0..len {
                dst[od + i * sd] = src[os + i * ss];
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::Shape;

    #[test]
    fn plan_merges_and_walks() {
        let l = Layout::contiguous([2, 3, 4]);
        let p = Plan::new([&l]);
        assert_eq!((p.runs(), p.run_len()), (1, 24));
        let t = Layout::contiguous([2, 3, 4]).permute(&[0, 2, 1]).unwrap();
        let p = Plan::new([&t]);
        let mut got = Vec::new();
        p.for_runs(0..p.runs(), |_, [o]| {
            for i in 0..p.run_len() {
                got.push(o + i * p.run_stride(0));
            }
        });
        assert_eq!(got, t.offsets().collect::<Vec<_>>());
        let b = Layout::contiguous([3, 1])
            .broadcast_to(&Shape::new([2, 3, 5]))
            .unwrap();
        let p = Plan::new([&b]);
        let mut got = Vec::new();
        p.for_runs(1..p.runs(), |_, [o]| {
            for i in 0..p.run_len() {
                got.push(o + i * p.run_stride(0));
            }
        });
        assert_eq!(got, b.offsets().skip(p.run_len()).collect::<Vec<_>>());
    }
}
