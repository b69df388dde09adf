//! Softmax, log-softmax and the fused softmax cross-entropy (forward and backward).
//!
//! One pass per row, rows in parallel: the row is brought into the output (or a scratch
//! buffer), its maximum subtracted before `exp` so that no finite input overflows, then
//! normalized. Cross-entropy never materializes the softmax: a row gives
//! `logsumexp(row) - row[label]`, and its backward `(softmax(row) - onehot(label)) * grad[row]`
//! in the same pass. Labels are checked before any work: one outside `0..c` is an
//! `Error::IndexOutOfRange` naming the op, the label and `c`.

use kiln_core::{DType, Error, Layout, Result, Shape};

use crate::elementwise::{dtype_err, slice};
use crate::fastmath;
use crate::storage::{CpuElem, CpuStorage, alloc, storage};
use rayon::prelude::*;

use crate::strided::{PAR_MIN, Plan, par_out};

/// What softmax needs from a float type.
trait SoftFloat:
    CpuElem + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self> + std::ops::Mul<Output = Self>
{
    const NEG_INF: Self;
    const ONE: Self;
    /// `x[i] = exp(x[i] - m)`; returns the sum of the new values.
    fn exp_sub_sum(x: &mut [Self], m: Self) -> Self;
    fn ln(self) -> Self;
    fn div(self, o: Self) -> Self;
}

impl SoftFloat for f32 {
    const NEG_INF: f32 = f32::NEG_INFINITY;
    const ONE: f32 = 1.0;
    fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        fastmath::exp_sub_sum_f32(x, m)
    }
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    fn div(self, o: f32) -> f32 {
        self / o
    }
}

impl SoftFloat for f64 {
    const NEG_INF: f64 = f64::NEG_INFINITY;
    const ONE: f64 = 1.0;
    fn exp_sub_sum(x: &mut [f64], m: f64) -> f64 {
        let mut s = 0.0;
        for v in x.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        s
    }
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    fn div(self, o: f64) -> f64 {
        self / o
    }
}

/// Row maximum; NaN propagates.
#[inline]
fn row_max<T: SoftFloat>(x: &[T]) -> T {
    if x.is_empty() {
        return T::NEG_INF;
    }
    crate::reduce::slice_extreme::<T, true>(x)
}

fn gather_row<T: Copy>(src: &[T], start: usize, stride: usize, dst: &mut [T]) {
    if stride == 1 {
        dst.copy_from_slice(&src[start..start + dst.len()]);
    } else {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = src[start + i * stride];
        }
    }
}

fn softmax_t<T: SoftFloat>(s: &CpuStorage, layout: &Layout, log: bool) -> Result<CpuStorage> {
    let op = if log { "log_softmax" } else { "softmax" };
    let x = slice::<T>(op, s)?;
    let r = layout.rank();
    if r == 0 {
        return Err(Error::invalid(op, "needs rank >= 1, got a scalar"));
    }
    let c = layout.dims()[r - 1];
    let cs = layout.strides()[r - 1];
    let mut out = alloc::<T>(op, s.device(), layout.elem_count())?;
    if out.is_empty() {
        return Ok(storage(s.device(), out));
    }
    let rows = Layout::from_parts(
        Shape::new(&layout.dims()[..r - 1]),
        &layout.strides()[..r - 1],
        layout.offset(),
    );
    let plan = Plan::new([&rows]);
    let (klen, kstride) = (plan.run_len(), plan.run_stride(0));
    par_out(&mut out, c, |s0, o| {
        let mut tmp = Vec::new();
        let first_row = s0 / c;
        let n_rows = o.len() / c;
        let (r0, j0) = (first_row / klen, first_row % klen);
        let mut i = 0;
        plan.for_runs(r0..r0 + (j0 + n_rows).div_ceil(klen), |_, [base]| {
            let lo = if i == 0 { j0 } else { 0 };
            for j in lo..klen {
                if i == n_rows {
                    return;
                }
                let row = &mut o[i * c..(i + 1) * c];
                gather_row(x, base + j * kstride, cs, row);
                let m = row_max(row);
                if log {
                    tmp.clear();
                    tmp.extend_from_slice(row);
                    // (x - m) - ln(sum): adding m back first would round away small values.
                    let ls = T::exp_sub_sum(&mut tmp, m).ln();
                    for v in row.iter_mut() {
                        *v = (*v - m) - ls;
                    }
                } else {
                    let inv = T::ONE.div(T::exp_sub_sum(row, m));
                    for v in row.iter_mut() {
                        *v = *v * inv;
                    }
                }
                i += 1;
            }
        });
    });
    Ok(storage(s.device(), out))
}

pub(crate) fn softmax(
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
    log: bool,
) -> Result<CpuStorage> {
    match dtype {
        DType::F32 => softmax_t::<f32>(s, layout, log),
        DType::F64 => softmax_t::<f64>(s, layout, log),
        _ => Err(dtype_err(
            if log { "log_softmax" } else { "softmax" },
            "f32 or f64",
            dtype,
        )),
    }
}

fn xent_t<T: SoftFloat>(
    logits: &CpuStorage,
    ll: &Layout,
    labels: &CpuStorage,
    lab: &Layout,
    grad: Option<(&CpuStorage, &Layout)>,
) -> Result<CpuStorage> {
    let op = if grad.is_some() {
        "cross_entropy_backward"
    } else {
        "cross_entropy"
    };
    let x = slice::<T>(op, logits)?;
    let labels_v = slice::<i64>(op, labels)?;
    if ll.rank() != 2 || lab.rank() != 1 || lab.dims()[0] != ll.dims()[0] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: ll.shape().clone(),
            rhs: lab.shape().clone(),
        });
    }
    let (n, c) = (ll.dims()[0], ll.dims()[1]);
    let (rs, cs) = (ll.strides()[0], ll.strides()[1]);
    // Labels first: an error must come before any work.
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let l = labels_v[lab.offset() + i * lab.strides()[0]];
        if l < 0 || l as usize >= c {
            return Err(Error::IndexOutOfRange {
                op,
                index: l,
                size: c,
            });
        }
        ids.push(l as usize);
    }
    let g: Option<Vec<T>> = match grad {
        Some((gs, gl)) => {
            let gv = slice::<T>(op, gs)?;
            if gl.dims() != [n] {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: ll.shape().clone(),
                    rhs: gl.shape().clone(),
                });
            }
            Some(
                (0..n)
                    .map(|i| gv[gl.offset() + i * gl.strides()[0]])
                    .collect(),
            )
        }
        None => None,
    };
    let row_len = if g.is_some() { c } else { 1 };
    let mut out = alloc::<T>(op, logits.device(), n * row_len)?;
    if out.is_empty() {
        return Ok(storage(logits.device(), out));
    }
    // Rows in parallel once the work (not the output) is large.
    let rows_per_task = if n * c >= PAR_MIN {
        n.div_ceil(4 * rayon::current_num_threads().max(1)).max(1)
    } else {
        n
    };
    out.par_chunks_mut(rows_per_task * row_len)
        .enumerate()
        .for_each(|(t, o)| {
            let mut tmp = vec![T::default(); c];
            for (k, orow) in o.chunks_mut(row_len).enumerate() {
                let i = t * rows_per_task + k;
                gather_row(x, ll.offset() + i * rs, cs, &mut tmp);
                let picked = tmp[ids[i]];
                let m = row_max(&tmp);
                let sum = T::exp_sub_sum(&mut tmp, m);
                match &g {
                    None => orow[0] = (m - picked) + sum.ln(),
                    Some(g) => {
                        let scale = g[i].div(sum);
                        for (ov, &e) in orow.iter_mut().zip(&tmp) {
                            *ov = e * scale;
                        }
                        orow[ids[i]] = orow[ids[i]] - g[i];
                    }
                }
            }
        });
    Ok(storage(logits.device(), out))
}

pub(crate) fn cross_entropy(
    logits: &CpuStorage,
    ll: &Layout,
    labels: &CpuStorage,
    lab: &Layout,
    grad: Option<(&CpuStorage, &Layout)>,
    dtype: DType,
) -> Result<CpuStorage> {
    match dtype {
        DType::F32 => xent_t::<f32>(logits, ll, labels, lab, grad),
        DType::F64 => xent_t::<f64>(logits, ll, labels, lab, grad),
        _ => Err(dtype_err("cross_entropy", "f32 or f64", dtype)),
    }
}
