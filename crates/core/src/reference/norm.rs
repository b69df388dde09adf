//! The reference backend's [`Backend::layer_norm_forward`] and backward: plain loops over rows
//! in f64, in the fused kernels' order of work (two-pass row statistics; `dx` from the two row
//! means; column sums for `dw`, `db`). Offered for every float dtype, so that the callers' fused
//! path (kiln-autograd's `norm_fused`) is tested on the host against values derived by hand and
//! numerical gradients, as the CUDA kernels are on a GPU.

use super::values::{float_out, floats, gather};
use super::{RefStorage, new};
use crate::backend::{NormGrads, NormOutputs, NormSpec, Operand};
use crate::{DType, Error, Result};

const OP: &str = "layer_norm";

/// The operand's values in row-major order, checked to hold `len` of them.
fn values(what: &str, o: Operand<'_, RefStorage>, dtype: DType, len: usize) -> Result<Vec<f64>> {
    let v = floats(OP, &gather(OP, o.0, o.1, dtype)?)?;
    if v.len() != len {
        return Err(Error::invalid(
            OP,
            format!("{what} must have {len} elements, got shape {}", o.1.shape()),
        ));
    }
    Ok(v)
}

pub(super) fn forward(
    x: Operand<'_, RefStorage>,
    w: Option<Operand<'_, RefStorage>>,
    b: Option<Operand<'_, RefStorage>>,
    dtype: DType,
    spec: NormSpec,
) -> Result<Option<NormOutputs<RefStorage>>> {
    let (rows, n) = (spec.rows, spec.cols);
    if !dtype.is_float() || n == 0 {
        return Ok(None);
    }
    let xs = values("the input", x, dtype, rows * n)?;
    let ws = w.map(|w| values("weight", w, dtype, n)).transpose()?;
    let bs = b.map(|b| values("bias", b, dtype, n)).transpose()?;
    let (mut y, mut means, mut rstds) = (vec![0.0; rows * n], vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &xs[r * n..(r + 1) * n];
        let mean = if spec.centered {
            row.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + spec.eps).sqrt();
        (means[r], rstds[r]) = (mean, rstd);
        for c in 0..n {
            let mut v = (row[c] - mean) * rstd;
            if let Some(ws) = &ws {
                v *= ws[c];
            }
            if let Some(bs) = &bs {
                v += bs[c];
            }
            y[r * n + c] = v;
        }
    }
    let dev = x.0.device;
    let stat = dtype.compute_dtype();
    Ok(Some((
        new(dev, float_out(dtype, &y)),
        spec.centered.then(|| new(dev, float_out(stat, &means))),
        new(dev, float_out(stat, &rstds)),
    )))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    x: Operand<'_, RefStorage>,
    mean: Option<Operand<'_, RefStorage>>,
    rstd: Operand<'_, RefStorage>,
    w: Option<Operand<'_, RefStorage>>,
    g: Operand<'_, RefStorage>,
    dx_acc: Option<Operand<'_, RefStorage>>,
    dtype: DType,
    spec: NormSpec,
    needs: [bool; 3],
) -> Result<Option<NormGrads<RefStorage>>> {
    let (rows, n) = (spec.rows, spec.cols);
    if !dtype.is_float() || n == 0 {
        return Ok(None);
    }
    let stat = dtype.compute_dtype();
    let xs = values("the input", x, dtype, rows * n)?;
    let gs = values("the output gradient", g, dtype, rows * n)?;
    let means = match mean {
        Some(m) => values("mean", m, stat, rows)?,
        None => vec![0.0; rows],
    };
    let rstds = values("rstd", rstd, stat, rows)?;
    let ws = w.map(|w| values("weight", w, dtype, n)).transpose()?;
    // The gradient accumulated so far, added to dx before its one rounding.
    let mut dx = match dx_acc {
        Some(a) => values("the accumulated gradient", a, dtype, rows * n)?,
        None => vec![0.0; rows * n],
    };
    let (mut dw, mut db) = (vec![0.0; n], vec![0.0; n]);
    for r in 0..rows {
        let xhat = |c: usize| (xs[r * n + c] - means[r]) * rstds[r];
        let ghat = |c: usize| gs[r * n + c] * ws.as_ref().map_or(1.0, |w| w[c]);
        let a = if spec.centered {
            (0..n).map(ghat).sum::<f64>() / n as f64
        } else {
            0.0
        };
        let m = (0..n).map(|c| ghat(c) * xhat(c)).sum::<f64>() / n as f64;
        for c in 0..n {
            dx[r * n + c] += rstds[r] * (ghat(c) - a - xhat(c) * m);
            dw[c] += gs[r * n + c] * xhat(c);
            db[c] += gs[r * n + c];
        }
    }
    let dev = x.0.device;
    let out = |want: bool, v: &[f64]| want.then(|| new(dev, float_out(dtype, v)));
    Ok(Some((
        out(needs[0], &dx),
        out(needs[1], &dw),
        out(needs[2], &db),
    )))
}
