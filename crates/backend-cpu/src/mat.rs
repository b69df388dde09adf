//! One operand of a batched matrix product as the kernels read it: the offset, the batch
//! stride, the matrix's size and its row and column strides (any strides: a transposed operand
//! is a column-major view, read in place). Shared by the GEMM paths (`matmul`) and the
//! matrix-vector ones (`gemv`).

use kiln_core::{Error, Layout, Result};
use ndarray::{ArrayView2, ShapeBuilder};

/// A `[batch, rows, cols]` operand layout, unpacked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mat {
    pub off: usize,
    pub bstride: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl Mat {
    pub fn new(l: &Layout) -> Result<Mat> {
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

    pub fn view<'a, T>(&self, x: &'a [T], b: usize) -> Result<ArrayView2<'a, T>> {
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
