//! Batched matrix products through matrixmultiply (sgemm/dgemm).
//!
//! Each operand matrix is an ndarray view over the storage with the layout's own row and column
//! strides, and ndarray hands those strides straight to matrixmultiply's packing kernels: a
//! transposed (column-major) operand is read in place, never copied. Batches loop over the
//! batch stride (0 broadcasts one matrix to every batch). Large single products are threaded
//! inside matrixmultiply (its `threading` feature, `MATMUL_NUM_THREADS` to override); many small
//! products are spread across cores with rayon, one product per task.

use kiln_core::{DType, Error, Layout, Result};
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2, LinalgScalar, ShapeBuilder};
use rayon::prelude::*;

use crate::elementwise::{dtype_err, slice};
use crate::storage::{CpuElem, CpuStorage, alloc, storage};

/// Products smaller than this many multiply-adds run one per rayon task.
const SMALL_GEMM: usize = 1 << 18;

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
    let mut out = alloc::<T>(a.device(), batch * m * n);
    if m * n == 0 || batch == 0 {
        return Ok(storage(a.device(), out));
    }
    if k == 0 {
        out.fill(T::zero());
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
    } else {
        for (bi, o) in out.chunks_mut(m * n).enumerate() {
            one(bi, o)?;
        }
    }
    Ok(storage(a.device(), out))
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
