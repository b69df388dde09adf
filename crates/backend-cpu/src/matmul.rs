//! Batched matrix products through matrixmultiply (sgemm/dgemm).
//!
//! Each operand matrix is an ndarray view over the storage with the layout's own row and column
//! strides, and ndarray hands those strides straight to matrixmultiply's packing kernels: a
//! transposed (column-major) operand is read in place, never copied. Batches loop over the
//! batch stride (0 broadcasts one matrix to every batch). A single product from a few million
//! multiply-adds up is split into one part per core (rayon), each a single-threaded
//! matrixmultiply GEMM: on two cores that scales better than matrixmultiply's own threading
//! (1.5-1.75x), which is therefore off. The split is along whichever of rows, columns or depth
//! duplicates the least work (see [`Split`]), so the 100x784x100 products of a small MLP step
//! gain from the second core too. Many small products are spread across cores with rayon, one
//! product per task.
//!
//! Matrix-vector products (`n == 1` or `m == 1`) skip GEMM: its packing would copy the whole
//! matrix on every call to do one multiply-add per element. They run as dot products over
//! contiguous rows or as axpys over contiguous columns, whichever the matrix's layout makes
//! sequential, with sixteen accumulator lanes so that the loops vectorize.

use kiln_core::{DType, Error, Layout, Result};
use ndarray::linalg::general_mat_mul;
use std::ops::Range;

use ndarray::{ArrayView2, ArrayViewMut2, LinalgScalar, ShapeBuilder, s};
use rayon::prelude::*;

use crate::elementwise::{dtype_err, slice};
use crate::pool;
use crate::storage::{CpuData, CpuElem, CpuStorage, alloc, new_vec, storage};
use crate::strided::PAR_MIN;

/// Products smaller than this many multiply-adds run one per rayon task.
const SMALL_GEMM: usize = 1 << 18;
/// Single products with at least this many multiply-adds are split across cores (about 50 µs
/// of one core's work: below it the fork and the duplicated packing cost more than they save).
const SPLIT_GEMM: usize = 1 << 21;

/// How one product is shared among cores. Each part is a single-threaded GEMM that packs its
/// own panels of `a` and `b`, so every split duplicates some work: splitting the rows of the
/// output packs all of `b` (k·n) once per core, splitting its columns packs all of `a` (m·k)
/// once per core, and splitting the depth writes one m·n partial product per extra core and
/// sums them. [`Split::pick`] takes the cheapest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    Rows,
    Cols,
    Depth,
}

impl Split {
    fn pick(m: usize, k: usize, n: usize) -> Split {
        let (rows, cols, depth) = (k * n, m * k, 2 * m * n);
        if depth < rows.min(cols) && k >= 256 {
            Split::Depth
        } else if cols < rows && n >= 64 {
            Split::Cols
        } else {
            Split::Rows
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Mat {
    off: usize,
    bstride: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl Mat {
    fn new(l: &Layout) -> Result<Mat> {
        if l.rank() != 3 {
            return Err(Error::invalid(
                "matmul",
                format!(
                    "expects [batch, rows, cols] layouts, got shape {}",
                    l.shape()
                ),
            ));
        }
        let (d, s) = (l.dims(), l.strides());
        Ok(Mat {
            off: l.offset(),
            bstride: s[0],
            rows: d[1],
            cols: d[2],
            rs: s[1],
            cs: s[2],
        })
    }

    fn view<'a, T>(&self, x: &'a [T], b: usize) -> Result<ArrayView2<'a, T>> {
        let start = self.off + b * self.bstride;
        let x = x.get(start..).unwrap_or(&[]);
        // Size-1 axes may carry any stride; give them one that cannot alias.
        let rs = if self.rows <= 1 {
            self.cols.max(1) * self.cs.max(1)
        } else {
            self.rs
        };
        let cs = if self.cols <= 1 { 1 } else { self.cs };
        ArrayView2::from_shape((self.rows, self.cols).strides((rs, cs)), x)
            .map_err(|e| Error::invalid("matmul", format!("bad operand layout: {e}")))
    }
}

fn gemm<T: CpuElem + LinalgScalar>(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    let (x, y) = (slice::<T>("matmul", a)?, slice::<T>("matmul", b)?);
    let (ma, mb) = (Mat::new(la)?, Mat::new(lb)?);
    let batch = la.dims()[0];
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    if lb.dims()[0] != batch || mb.rows != k {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: la.shape().clone(),
            rhs: lb.shape().clone(),
        });
    }
    // Saturating: a product past usize is reported by `alloc` as an impossible size.
    let len = batch.saturating_mul(m).saturating_mul(n);
    let mut out = alloc::<T>("matmul", a.device(), len)?;
    if m * n == 0 || batch == 0 {
        return Ok(storage(a.device(), out));
    }
    if k == 0 {
        out.fill(T::zero());
        return Ok(storage(a.device(), out));
    }
    if n == 1 || m == 1 {
        for (bi, o) in out.chunks_mut(m * n).enumerate() {
            gemv(x, &ma, y, &mb, bi, o);
        }
        return Ok(storage(a.device(), out));
    }
    let one = |bi: usize, o: &mut [T]| -> Result<()> {
        let av = ma.view(x, bi)?;
        let bv = mb.view(y, bi)?;
        let mut cv = ArrayViewMut2::from_shape((m, n), o)
            .map_err(|e| Error::invalid("matmul", e.to_string()))?;
        general_mat_mul(T::one(), &av, &bv, T::zero(), &mut cv);
        Ok(())
    };
    if batch > 1 && m * n * k < SMALL_GEMM {
        out.par_chunks_mut(m * n)
            .enumerate()
            .try_for_each(|(bi, o)| one(bi, o))?;
    } else if batch == 1 && m * n * k >= SPLIT_GEMM && m.min(n) >= 16 && pool::parts() > 1 {
        split_gemm((a, &ma), (b, &mb), &mut out)?;
    } else {
        for (bi, o) in out.chunks_mut(m * n).enumerate() {
            one(bi, o)?;
        }
    }
    Ok(storage(a.device(), out))
}

impl Split {
    /// The operands of the part of `a · b` that `r` (a range of rows, columns or depth) selects.
    fn operands<'a, T>(
        self,
        a: ArrayView2<'a, T>,
        b: ArrayView2<'a, T>,
        r: Range<usize>,
    ) -> (ArrayView2<'a, T>, ArrayView2<'a, T>) {
        match self {
            Split::Rows => (a.slice_move(s![r, ..]), b),
            Split::Cols => (a, b.slice_move(s![.., r])),
            Split::Depth => (a.slice_move(s![.., r.clone()]), b.slice_move(s![r, ..])),
        }
    }
}

impl Split {
    /// Where the part for `r` goes in the output `c`.
    fn target<'c, T>(
        self,
        c: &'c mut ArrayViewMut2<'_, T>,
        r: Range<usize>,
    ) -> ArrayViewMut2<'c, T> {
        match self {
            Split::Rows => c.slice_mut(s![r, ..]),
            Split::Cols => c.slice_mut(s![.., r]),
            Split::Depth => c.view_mut(),
        }
    }
}

fn shape_err(e: ndarray::ShapeError) -> Error {
    Error::invalid("matmul", e.to_string())
}

/// One part of a split product, computed into a buffer of its own (on a helper thread).
fn part<T: CpuElem + LinalgScalar>(
    dev: crate::CpuDevice,
    (a, ma): (&CpuData, Mat),
    (b, mb): (&CpuData, Mat),
    split: Split,
    r: Range<usize>,
) -> Result<Vec<T>> {
    let x = T::slice(a).ok_or_else(|| dtype_err("matmul", T::DTYPE.as_str(), a.dtype()))?;
    let y = T::slice(b).ok_or_else(|| dtype_err("matmul", T::DTYPE.as_str(), b.dtype()))?;
    let (av, bv) = split.operands(ma.view(x, 0)?, mb.view(y, 0)?, r);
    if kiln_core::profile::enabled() {
        crate::storage::profile_alloc("matmul", dev, av.nrows() * bv.ncols() * size_of::<T>());
    }
    let mut out = new_vec::<T>("matmul", dev, av.nrows() * bv.ncols())?;
    let mut cv =
        ArrayViewMut2::from_shape((av.nrows(), bv.ncols()), &mut out[..]).map_err(shape_err)?;
    general_mat_mul(T::one(), &av, &bv, T::zero(), &mut cv);
    Ok(out)
}

/// `out = a · b` for one product (row-major `out`), split as [`Split::pick`] decides into one
/// part per core: this thread computes the first part straight into `out`, the
/// [`pool`](crate::pool) helpers the others into buffers of their own, which are then copied
/// (or, for a depth split, added) into place.
fn split_gemm<T: CpuElem + LinalgScalar>(
    (a, ma): (&CpuStorage, &Mat),
    (b, mb): (&CpuStorage, &Mat),
    out: &mut [T],
) -> Result<()> {
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    let split = Split::pick(m, k, n);
    let len = match split {
        Split::Rows => m,
        Split::Cols => n,
        Split::Depth => k,
    };
    let per = len.div_ceil(pool::parts());
    let ranges: Vec<Range<usize>> = (0..len)
        .step_by(per)
        .map(|s| s..(s + per).min(len))
        .collect();
    let (ma, mb) = (*ma, *mb);
    // Hand every part but the first to a helper; a part no helper takes comes back to run here.
    let others: Vec<_> = ranges[1..]
        .iter()
        .map(|r| {
            let (ad, bd, r2, dev) = (a.shared(), b.shared(), r.clone(), a.device());
            let job = move || part::<T>(dev, (&ad, ma), (&bd, mb), split, r2);
            (r.clone(), pool::submit(job))
        })
        .collect();
    let (x, y) = (slice::<T>("matmul", a)?, slice::<T>("matmul", b)?);
    let (av, bv) = (ma.view(x, 0)?, mb.view(y, 0)?);
    let mut c = ArrayViewMut2::from_shape((m, n), out).map_err(shape_err)?;
    let (a0, b0) = split.operands(av, bv, ranges[0].clone());
    general_mat_mul(
        T::one(),
        &a0,
        &b0,
        T::zero(),
        &mut split.target(&mut c, ranges[0].clone()),
    );
    // Every part is waited for before an error returns, so that no helper still holds the
    // operands once this kernel is done.
    let parts: Vec<_> = others
        .into_iter()
        .map(|(r, pending)| {
            let buf = match pending {
                Ok(p) => p
                    .wait()
                    .ok_or_else(|| Error::backend("matmul", "a GEMM helper thread panicked"))
                    .and_then(|r| r),
                Err(job) => job(),
            };
            (r, buf)
        })
        .collect();
    for (r, buf) in parts {
        let buf = buf?;
        let mut t = split.target(&mut c, r);
        let src = ArrayView2::from_shape(t.raw_dim(), &buf[..]).map_err(shape_err)?;
        match split {
            Split::Depth => t.zip_mut_with(&src, |o, &v| *o = *o + v),
            _ => t.assign(&src),
        }
    }
    Ok(())
}

/// Dot product of `a[i * sa]` and `b[i * sb]` over `len` (sixteen lanes when both contiguous).
#[inline]
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
        acc.iter().fold(t, |x, &y| x + y)
    } else {
        (0..len).fold(T::zero(), |s, i| s + a[i * sa] * b[i * sb])
    }
}

/// `out += c * x[i * sx]` over `out.len()`.
#[inline]
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

/// One matrix-vector product of batch `bi` into `o` (`m x 1` or `1 x n`).
fn gemv<T: CpuElem + LinalgScalar>(x: &[T], ma: &Mat, y: &[T], mb: &Mat, bi: usize, o: &mut [T]) {
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    let (a0, b0) = (ma.off + bi * ma.bstride, mb.off + bi * mb.bstride);
    if n == 1 {
        // o[i] = A[i, :] . b[:, 0]
        if ma.cs == 1 || k == 1 || ma.rs != 1 {
            let row = |i: usize| dot(&x[a0 + i * ma.rs..], ma.cs, &y[b0..], mb.rs, k);
            if m * k >= PAR_MIN {
                o.par_iter_mut().enumerate().for_each(|(i, v)| *v = row(i));
            } else {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = row(i);
                }
            }
        } else {
            // Column-major A: o = sum_k A[:, k] * b[k], reading columns in order.
            o.fill(T::zero());
            for kk in 0..k {
                axpy(o, y[b0 + kk * mb.rs], &x[a0 + kk * ma.cs..], 1);
            }
        }
    } else {
        // m == 1: o[j] = a[0, :] . B[:, j]
        if mb.cs == 1 || mb.rs != 1 || k == 1 {
            // Row-major B: o = sum_k a[k] * B[k, :], reading rows in order.
            o.fill(T::zero());
            for kk in 0..k {
                axpy(o, x[a0 + kk * ma.cs], &y[b0 + kk * mb.rs..], mb.cs);
            }
        } else {
            let col = |j: usize| dot(&x[a0..], ma.cs, &y[b0 + j * mb.cs..], 1, k);
            if n * k >= PAR_MIN {
                o.par_iter_mut().enumerate().for_each(|(j, v)| *v = col(j));
            } else {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = col(j);
                }
            }
        }
    }
}

pub(crate) fn matmul(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    match dtype {
        DType::F32 => gemm::<f32>(a, la, b, lb),
        DType::F64 => gemm::<f64>(a, la, b, lb),
        _ => Err(dtype_err("matmul", "f32 or f64", dtype)),
    }
}
