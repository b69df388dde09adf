//! Matrix-vector products (`n == 1` or `m == 1` in a batched product) without GEMM: its
//! packing would copy the whole matrix on every call to do one multiply-add per element. They
//! run as dot products over contiguous rows or as axpys over contiguous columns, whichever the
//! matrix's layout makes sequential, with sixteen accumulator lanes so that the loops vectorize
//! (dot products four rows at a time, see `Dots::rows_body`), and from [`SPLIT_GEMV`]
//! multiply-adds up on the [`pool`](crate::pool) helpers too.

use std::ops::Range;

use kiln_core::{Error, Result};
use ndarray::LinalgScalar;
use rayon::prelude::*;

use crate::elementwise::dtype_err;
use crate::mat::Mat;
use crate::pool::{self, cut};
use crate::storage::{CpuElem, CpuStorage};

/// Matrix-vector products (a row- or column-major matrix times a column) with at least this
/// many multiply-adds are shared with the [`pool`](crate::pool) helpers. A sleeping helper
/// takes about 30 µs to join (2-core VM, 2026-11-27), longer than the whole of a smaller
/// product: Theano's logistic regression (400x784, 0.3 M, about 10 µs per product) stays on one
/// core.
pub(crate) const SPLIT_GEMV: usize = 1 << 21;
/// The smallest part of a split matrix-vector product, in multiply-adds.
const GEMV_PART: usize = 1 << 16;

/// `out = a · b` for a row- or column-major `a` (`m x k`) and a column `b`, in parts claimed
/// by this thread and the helpers, each computed into a buffer of its own.
///
/// - Row-major `a`: parts are blocks of rows, each row one dot product, copied into place:
///   the same bits as on one core.
/// - Column-major `a` (a transposed row-major matrix, `xᵀ · g`): parts are blocks of `k`,
///   i.e. of the row-major matrix's rows, each summed into a whole-length partial result, and
///   the partials are added in part order. Each core then reads the same rows of `x` as for
///   the row-major product `x · w` just before, which stay in its cache: a logistic-regression
///   step's two products took 20.4–21.7 µs this way against 22.7–25.9 µs split by outputs. The
///   bits depend on the number of parts (fixed per process), not on which thread computes
///   which part.
pub(crate) fn split_gemv<T: CpuElem + LinalgScalar>(
    (a, ma): (&CpuStorage, &Mat),
    (b, mb): (&CpuStorage, &Mat),
    out: &mut [T],
) -> Result<()> {
    let (m, k) = (ma.rows, ma.cols);
    let by_rows = ma.cs == 1;
    let len = if by_rows { m } else { k };
    // Parts of whole 16-element vectors, so that every part's loops vectorize the same way.
    let ranges = cut(len, pool::parts(m * k, GEMV_PART), 16);
    let (ma, mb) = (*ma, *mb);
    // Part `r` into `o`: rows `r` of `out`, or the whole of `out` summed over `k` in `r`.
    let part = move |x: &[T], y: &[T], r: Range<usize>, o: &mut [T]| {
        if by_rows {
            let dots = Dots {
                mat: x,
                start: ma.off,
                rstride: ma.rs,
                estride: 1,
                vec: &y[mb.off..],
                vstride: mb.rs,
                k,
            };
            dots.rows(r.start, o)
        } else {
            let cols = Mat {
                cols: r.len(),
                off: ma.off + r.start * ma.cs,
                ..ma
            };
            let vec = Mat {
                rows: r.len(),
                off: mb.off + r.start * mb.rs,
                ..mb
            };
            gemv(x, &cols, y, &vec, 0, o)
        }
    };
    let (ad, bd) = (a.shared()?, b.shared()?);
    let jobs = ranges.clone();
    let parts = pool::run(ranges.len(), move |i| -> Result<Vec<T>> {
        let r = jobs[i].clone();
        let x = T::slice(&ad).ok_or_else(|| dtype_err("matmul", T::DTYPE.as_str(), ad.dtype()))?;
        let y = T::slice(&bd).ok_or_else(|| dtype_err("matmul", T::DTYPE.as_str(), bd.dtype()))?;
        let mut o = vec![T::zero(); if by_rows { r.len() } else { m }];
        part(x, y, r, &mut o);
        Ok(o)
    })
    .ok_or_else(|| Error::backend("matmul", "a part of the product panicked"))?;
    for (i, (r, buf)) in ranges.into_iter().zip(parts).enumerate() {
        let buf = buf?;
        if by_rows {
            out[r].copy_from_slice(&buf);
        } else if i == 0 {
            out.copy_from_slice(&buf);
        } else {
            for (o, v) in out.iter_mut().zip(buf) {
                *o = *o + v;
            }
        }
    }
    Ok(())
}

/// Dot product of `a[i * sa]` and `b[i * sb]` over `len` (sixteen lanes when both contiguous).
#[inline(always)]
fn dot<T: CpuElem + LinalgScalar>(a: &[T], sa: usize, b: &[T], sb: usize, len: usize) -> T {
    if sa == 1 && sb == 1 {
        let (a, b) = (&a[..len], &b[..len]);
        let mut acc = [T::zero(); 16];
        let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (xa, xb) in ca.zip(cb) {
            for ((s, &u), &v) in acc.iter_mut().zip(xa).zip(xb) {
                *s = *s + u * v;
            }
        }
        let mut t = T::zero();
        for (&u, &v) in ra.iter().zip(rb) {
            t = t + u * v;
        }
        fold16(acc) + t
    } else {
        (0..len).fold(T::zero(), |s, i| s + a[i * sa] * b[i * sb])
    }
}

/// `out += c * x[i * sx]` over `out.len()`.
#[inline(always)]
fn axpy<T: CpuElem + LinalgScalar>(out: &mut [T], c: T, x: &[T], sx: usize) {
    if sx == 1 {
        let n = out.len();
        for (o, &v) in out.iter_mut().zip(&x[..n]) {
            *o = *o + c * v;
        }
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            *o = *o + c * x[i * sx];
        }
    }
}

/// `out += Σ_j c[j] * x[j * step ..]` for the `k` contiguous vectors `x[j * step ..][..n]`,
/// four at a time: `out` is loaded and stored once per four vectors instead of once per
/// vector (the loop is bound by those loads and stores, not by the multiply-adds). The sum is
/// `(((out + c0 x0) + c1 x1) + c2 x2) + c3 x3`, the order of four single axpys, so the result
/// is the same bits as [`axpy`] one vector at a time.
#[inline(always)]
fn axpy_rows<T: CpuElem + LinalgScalar>(
    out: &mut [T],
    c: impl Fn(usize) -> T,
    x: &[T],
    step: usize,
    k: usize,
) {
    let n = out.len();
    let mut j = 0;
    while j + 4 <= k {
        let (c0, c1, c2, c3) = (c(j), c(j + 1), c(j + 2), c(j + 3));
        let x0 = &x[j * step..][..n];
        let x1 = &x[(j + 1) * step..][..n];
        let x2 = &x[(j + 2) * step..][..n];
        let x3 = &x[(j + 3) * step..][..n];
        for ((((o, &v0), &v1), &v2), &v3) in out.iter_mut().zip(x0).zip(x1).zip(x2).zip(x3) {
            *o = *o + c0 * v0 + c1 * v1 + c2 * v2 + c3 * v3;
        }
        j += 4;
    }
    for j in j..k {
        axpy(out, c(j), &x[j * step..], 1);
    }
}

/// Matrix-vector products that reach [`Dots::run`] split across rayon's workers only from this
/// many multiply-adds: a GEMV streams its matrix once, so it is bound by memory, and on two
/// cores the rayon fork and the wake-up of a sleeping worker (several µs on a busy VM) cost
/// more than the second core saves below ~4 MB of matrix. (A row- or column-major matrix times
/// a column from [`SPLIT_GEMV`] up goes to the pool helpers instead.)
const GEMV_PAR_MIN: usize = 1 << 20;

/// One matrix-vector product of batch `bi` into `o` (`m x 1` or `1 x n`), compiled for the
/// widest vector unit the processor has (AVX-512 or AVX2, detected at run time, as
/// `fastmath` does): the loops are then 16 or 8 lanes wide instead of SSE's 4. No FMA
/// contraction, the same operations in the same order on every path, so the same bits.
pub(crate) fn gemv<T: CpuElem + LinalgScalar>(
    x: &[T],
    ma: &Mat,
    y: &[T],
    mb: &Mat,
    bi: usize,
    o: &mut [T],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn avx512<T: CpuElem + LinalgScalar>(
            x: &[T],
            ma: &Mat,
            y: &[T],
            mb: &Mat,
            bi: usize,
            o: &mut [T],
        ) {
            gemv_body(x, ma, y, mb, bi, o)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<T: CpuElem + LinalgScalar>(
            x: &[T],
            ma: &Mat,
            y: &[T],
            mb: &Mat,
            bi: usize,
            o: &mut [T],
        ) {
            gemv_body(x, ma, y, mb, bi, o)
        }
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx2") && has!("fma") {
            // SAFETY: the processor has every feature `avx512` is compiled for (checked just
            // above); the function itself is safe Rust.
            return unsafe { avx512(x, ma, y, mb, bi, o) };
        }
        if has!("avx2") && has!("fma") {
            // SAFETY: as above, for AVX2 and FMA.
            return unsafe { avx2(x, ma, y, mb, bi, o) };
        }
    }
    gemv_body(x, ma, y, mb, bi, o)
}

/// `out[i] = mat[start + i * rstride ..] · vec` (elements `estride` and `vstride` apart, `k`
/// of them): the dot-product form of a matrix-vector product.
struct Dots<'a, T> {
    mat: &'a [T],
    start: usize,
    rstride: usize,
    estride: usize,
    vec: &'a [T],
    vstride: usize,
    k: usize,
}

impl<T: CpuElem + LinalgScalar> Dots<'_, T> {
    /// All of `out`, on several cores when `work` (multiply-adds) reaches [`GEMV_PAR_MIN`].
    fn run(&self, out: &mut [T], work: usize) {
        if work >= GEMV_PAR_MIN && out.len() > 1 {
            let per = out.len().div_ceil(4 * rayon::current_num_threads().max(1));
            out.par_chunks_mut(per)
                .enumerate()
                .for_each(|(c, o)| self.rows(c * per, o));
        } else {
            self.rows(0, out);
        }
    }

    /// `out[j]` for rows `first + j`, compiled for the widest vector unit (see [`gemv`]). No
    /// closure in between: a closure would be compiled without the wider instruction set.
    fn rows(&self, first: usize, out: &mut [T]) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512<T: CpuElem + LinalgScalar>(d: &Dots<'_, T>, f: usize, o: &mut [T]) {
                d.rows_body(f, o)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<T: CpuElem + LinalgScalar>(d: &Dots<'_, T>, f: usize, o: &mut [T]) {
                d.rows_body(f, o)
            }
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx2") && has!("fma") {
                // SAFETY: the processor has every feature `avx512` is compiled for (checked
                // just above); the function itself is safe Rust.
                return unsafe { avx512(self, first, out) };
            }
            if has!("avx2") && has!("fma") {
                // SAFETY: as above, for AVX2 and FMA.
                return unsafe { avx2(self, first, out) };
            }
        }
        self.rows_body(first, out)
    }

    /// Contiguous rows and vector go four rows at a time ([`dot4`]: the vector is loaded once
    /// per four rows and eight accumulator chains run at once instead of two), and the blocks
    /// run from the last row to the first. The order does not change a bit (each row is its own
    /// sum), but a matrix larger than L2 then ends its pass with its *first* rows cached, which
    /// is where the next pass over it starts: the column-major product `xᵀ · g` of a
    /// logistic-regression step reads `x` from row 0 up ([`axpy_rows`]) right after `x · w`.
    /// 400x784 f32 (1.25 MB; 2-core EPYC VM, 512 KB L2, load 5-6), CPU µs per call of
    /// `x · w` then `xᵀ · g`, three runs each: 48-52 one row at a time, 44-51 four at a time,
    /// 40-47 four at a time from the last row.
    #[inline(always)]
    fn rows_body(&self, first: usize, out: &mut [T]) {
        let row = |j: usize| &self.mat[self.start + (first + j) * self.rstride..];
        if self.estride != 1 || self.vstride != 1 {
            for (j, v) in out.iter_mut().enumerate() {
                *v = dot(row(j), self.estride, self.vec, self.vstride, self.k);
            }
            return;
        }
        let (blocks, tail) = out.as_chunks_mut::<4>();
        let done = blocks.len() * 4;
        for (j, v) in tail.iter_mut().enumerate().rev() {
            *v = dot(row(done + j), 1, self.vec, 1, self.k);
        }
        for (b, o) in blocks.iter_mut().enumerate().rev() {
            let j = b * 4;
            *o = dot4(
                [row(j), row(j + 1), row(j + 2), row(j + 3)],
                self.vec,
                self.k,
            );
        }
    }
}

/// The dot products of four contiguous rows with one contiguous vector over `len`: each row's
/// sum in exactly [`dot`]'s order (sixteen lanes, folded by [`fold16`], plus the remainder),
/// so the same bits as four calls of it.
#[inline(always)]
fn dot4<T: CpuElem + LinalgScalar>(rows: [&[T]; 4], v: &[T], len: usize) -> [T; 4] {
    let v = &v[..len];
    let rows = rows.map(|r| &r[..len]);
    let (vc, vr) = v.as_chunks::<16>();
    let [c0, c1, c2, c3] = rows.map(|r| r.as_chunks::<16>().0);
    // One named accumulator per row and the chunks zipped: written with an array of rows
    // indexed in a loop, LLVM kept the accumulators in memory and did not vectorize.
    let (mut a0, mut a1, mut a2, mut a3) = (
        [T::zero(); 16],
        [T::zero(); 16],
        [T::zero(); 16],
        [T::zero(); 16],
    );
    for ((((vb, x0), x1), x2), x3) in vc.iter().zip(c0).zip(c1).zip(c2).zip(c3) {
        for l in 0..16 {
            a0[l] = a0[l] + x0[l] * vb[l];
            a1[l] = a1[l] + x1[l] * vb[l];
            a2[l] = a2[l] + x2[l] * vb[l];
            a3[l] = a3[l] + x3[l] * vb[l];
        }
    }
    let acc = [a0, a1, a2, a3];
    let full = vc.len() * 16;
    let mut res = [T::zero(); 4];
    for (q, r) in res.iter_mut().enumerate() {
        let mut t = T::zero();
        for (&u, &w) in rows[q][full..].iter().zip(vr) {
            t = t + u * w;
        }
        *r = fold16(acc[q]) + t;
    }
    res
}

/// The sixteen lanes of an accumulator summed as a tree (eight, four, two, one), the order
/// every dot product here uses: its four levels vectorize and four rows' folds overlap, where
/// sixteen dependent scalar adds per row took a sixth of a 400x784 product's time.
#[inline(always)]
fn fold16<T: CpuElem + LinalgScalar>(a: [T; 16]) -> T {
    let mut h = [T::zero(); 8];
    for l in 0..8 {
        h[l] = a[l] + a[l + 8];
    }
    let q = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

#[inline(always)]
fn gemv_body<T: CpuElem + LinalgScalar>(
    x: &[T],
    ma: &Mat,
    y: &[T],
    mb: &Mat,
    bi: usize,
    o: &mut [T],
) {
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    let (a0, b0) = (ma.off + bi * ma.bstride, mb.off + bi * mb.bstride);
    if n == 1 {
        // o[i] = A[i, :] . b[:, 0]
        if ma.cs == 1 || k == 1 || ma.rs != 1 {
            let dv = Dots {
                mat: x,
                start: a0,
                rstride: ma.rs,
                estride: ma.cs,
                vec: &y[b0..],
                vstride: mb.rs,
                k,
            };
            dv.run(o, m * k);
        } else {
            // Column-major A: o = sum_k A[:, k] * b[k], reading columns in order.
            o.fill(T::zero());
            axpy_rows(o, |kk| y[b0 + kk * mb.rs], &x[a0..], ma.cs, k);
        }
    } else {
        // m == 1: o[j] = a[0, :] . B[:, j]
        if mb.cs == 1 {
            // Row-major B: o = sum_k a[k] * B[k, :], reading rows in order.
            o.fill(T::zero());
            axpy_rows(o, |kk| x[a0 + kk * ma.cs], &y[b0..], mb.rs, k);
        } else if mb.rs != 1 || k == 1 {
            o.fill(T::zero());
            for kk in 0..k {
                axpy(o, x[a0 + kk * ma.cs], &y[b0 + kk * mb.rs..], mb.cs);
            }
        } else {
            let dv = Dots {
                mat: y,
                start: b0,
                rstride: mb.cs,
                estride: 1,
                vec: &x[a0..],
                vstride: ma.cs,
                k,
            };
            dv.run(o, n * k);
        }
    }
}
