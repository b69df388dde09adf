//! Layer normalization and RMS normalization on variables (`F.layer_norm`, `F.rms_norm`).
//!
//! # Why not a tape of small ops
//!
//! Written as `(x - mean) / sqrt(var + eps) * w + b` with `Var` ops, a layer norm records about
//! ten nodes, keeps as many intermediates alive and runs as many kernels again backward. Here it
//! is one recorded node, as softmax and cross-entropy are: the forward saves what PyTorch's
//! saves (the input, the row statistics `mean` and `rstd`, the weight) and the backward is
//! PyTorch's closed form. Writing `x̂ = (x - mean) · rstd` and `ĝ = g · w` (or `g`), with the
//! means over the normalized elements,
//!
//! - layer norm: `dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ x̂))`, `dw = Σ_batch g x̂`, `db = Σ_batch g`;
//! - RMS norm (`x̂ = x · rstd`, `rstd = 1/√(mean(x²) + eps)`): `dx = rstd · (ĝ - x̂ · mean(ĝ x̂))`,
//!   `dw = Σ_batch g x̂`.
//!
//! # How it runs
//!
//! Each step is a program of kiln's expression IR (`kiln_core::expr`), so it runs on every
//! backend with no kernel of its own: one pass on the CPU, one generated kernel on a GPU. A
//! program reduces over one set of axes and cannot feed a reduced value back into an
//! elementwise output, so the forward is three programs (the mean; the biased variance two-pass
//! and `rstd`; the normalization with the affine map) and the backward three (the two row means;
//! `dx`; the column sums `dw`, `db`). A backend may run the whole normalization natively
//! instead ([`Backend::layer_norm_forward`], module `norm_fused`): the CUDA backend does, with
//! one kernel for statistics and normalization, as PyTorch's fused GPU kernels do; the
//! programs here are the path of the CPU and the reference backend, of f64, and of rows the
//! kernels do not take.
//!
//! Programs are built once per (step, dtype, rank, normalized rank, which of weight and bias)
//! and memoized here; the backends memoize what they compile from them.

use std::sync::{Arc, OnceLock};

use kiln_core::expr::{Expr, Program};
use kiln_core::{Backend, DType, Error, Result, Tensor};

use crate::norm_fused::{NormCall, fused};
use crate::programs::{Inputs, Memo, memoized};
use crate::var::Var;

/// One program of the layer norm / RMS norm family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Step {
    /// `[x] (inv_n) -> mean`.
    Mean,
    /// `[x, mean?] (inv_n, eps) -> rstd`: the biased variance of `x - mean`, or the mean square
    /// of `x` when not `centered`.
    Rstd,
    /// `[x, mean?, rstd, w?, b?] -> y`.
    Normalize,
    /// `[g, x, mean?, rstd, w?] (inv_n) -> mean(ĝ)?, mean(ĝ x̂)`.
    RowMeans,
    /// `[g, x, mean?, rstd, w?, mean(ĝ)?, mean(ĝ x̂)] -> dx`.
    Dx,
    /// `[g, x, mean?, rstd] -> Σ_batch g x̂, Σ_batch g?`.
    ColSums,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    step: Step,
    dtype: DType,
    /// Layer norm (subtracts the mean) or RMS norm.
    centered: bool,
    rank: usize,
    /// The number of normalized (trailing) axes.
    k: usize,
    weight: bool,
    bias: bool,
}

/// The program of `key`, built on first use.
fn program(key: Key) -> Result<Arc<Program>> {
    static MEMO: Memo<Key> = OnceLock::new();
    memoized(&MEMO, key, build)
}

/// The inputs and the outputs of `key`'s program (see [`Step`] for the signatures).
fn build(key: Key) -> (Inputs, Vec<Expr>) {
    let last: Vec<isize> = (-(key.k as isize)..0).collect();
    let lead: Vec<isize> = (0..(key.rank - key.k) as isize).collect();
    let (inv_n, eps) = (Expr::param(0), Expr::param(1));
    let mut ins = Inputs::new(key.dtype);
    // `g` comes first in the backward programs.
    let g = matches!(key.step, Step::RowMeans | Step::Dx | Step::ColSums).then(|| ins.next());
    let x = ins.next();
    let outs = match key.step {
        Step::Mean => vec![x.sum(&last) * &inv_n],
        Step::Rstd => {
            let d = match ins.next_if(key.centered) {
                Some(mean) => &x - mean,
                None => x,
            };
            vec![((&d * &d).sum(&last) * inv_n + eps).rsqrt()]
        }
        Step::Normalize => {
            let xhat = normalized(&mut ins, x, key.centered);
            let y = match ins.next_if(key.weight) {
                Some(w) => xhat * w,
                None => xhat,
            };
            vec![match ins.next_if(key.bias) {
                Some(b) => y + b,
                None => y,
            }]
        }
        Step::RowMeans | Step::Dx => {
            let mean = ins.next_if(key.centered);
            let rstd = ins.next();
            let xhat = match &mean {
                Some(m) => (&x - m) * &rstd,
                None => &x * &rstd,
            };
            let g = g.expect("a gradient input");
            let gy = match ins.next_if(key.weight) {
                Some(w) => g * w,
                None => g,
            };
            if key.step == Step::RowMeans {
                let mut outs = Vec::new();
                if key.centered {
                    outs.push(gy.sum(&last) * &inv_n);
                }
                outs.push((&gy * &xhat).sum(&last) * &inv_n);
                outs
            } else {
                let mut inner = gy;
                if let Some(a) = ins.next_if(key.centered) {
                    inner = inner - a;
                }
                let c = ins.next();
                vec![rstd * (inner - xhat * c)]
            }
        }
        Step::ColSums => {
            let xhat = normalized(&mut ins, x, key.centered);
            let g = g.expect("a gradient input");
            let over_batch = |e: Expr| if lead.is_empty() { e } else { e.sum(&lead) };
            let mut outs = vec![over_batch(&g * xhat)];
            if key.bias {
                outs.push(over_batch(g));
            }
            outs
        }
    };
    (ins, outs)
}

/// `x̂` from `x` and the next inputs (`mean` when centered, then `rstd`).
fn normalized(ins: &mut Inputs, x: Expr, centered: bool) -> Expr {
    let mean = ins.next_if(centered);
    let rstd = ins.next();
    match mean {
        Some(m) => (x - m) * rstd,
        None => x * rstd,
    }
}

/// Checks the arguments of a normalization `op` and returns the number of normalized elements.
fn check_args<B: Backend>(
    op: &'static str,
    x: &Tensor<B>,
    normalized_shape: &[usize],
    params: &[(&str, Option<&Tensor<B>>)],
    eps: f64,
) -> Result<usize> {
    if !x.dtype().is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: "a float input".into(),
            got: x.dtype(),
        });
    }
    let k = normalized_shape.len();
    if k == 0 || x.rank() < k || x.dims()[x.rank() - k..] != *normalized_shape {
        return Err(Error::invalid(
            op,
            format!(
                "normalized_shape {normalized_shape:?} must be non-empty and equal the last \
                 dims of the input, got an input of shape {}",
                x.shape()
            ),
        ));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::invalid(
            op,
            format!("eps must be finite and >= 0, got {eps}"),
        ));
    }
    for (name, p) in params {
        let Some(p) = p else { continue };
        if p.dims() != normalized_shape {
            return Err(Error::invalid(
                op,
                format!(
                    "{name} must have the normalized shape {normalized_shape:?}, got {}",
                    p.shape()
                ),
            ));
        }
        if p.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                expected: format!("a {name} of the input's dtype {}", x.dtype()),
                got: p.dtype(),
            });
        }
        x.check_same_device(op, p)?;
    }
    Ok(normalized_shape.iter().product())
}

/// `1 / n`, and 0 for an empty normalized shape (whose outputs are empty anyway).
fn inv(n: usize) -> f64 {
    if n == 0 { 0.0 } else { 1.0 / n as f64 }
}

/// What a normalization's backward reads: the forward's input, statistics and weight.
struct Saved<B: Backend> {
    key: Key,
    n: usize,
    x: Tensor<B>,
    mean: Option<Tensor<B>>,
    rstd: Tensor<B>,
    w: Option<Tensor<B>>,
}

impl<B: Backend> Saved<B> {
    fn run(&self, step: Step, inputs: &[&Tensor<B>], params: &[f64]) -> Result<Vec<Tensor<B>>> {
        program(Key { step, ..self.key })?.run(inputs, params)
    }

    /// Runs the forward of `key` on `x`: the output and what the backward reads.
    fn forward(
        key: Key,
        n: usize,
        x: Tensor<B>,
        w: Option<Tensor<B>>,
        b: Option<&Tensor<B>>,
        eps: f64,
    ) -> Result<(Tensor<B>, Self)> {
        let one = |step, ins: &[&Tensor<B>], params: &[f64]| -> Result<Tensor<B>> {
            let mut outs = program(Key { step, ..key })?.run(ins, params)?;
            Ok(outs.swap_remove(0))
        };
        let mean = if key.centered {
            Some(one(Step::Mean, &[&x], &[inv(n)])?)
        } else {
            None
        };
        let mut ins = vec![&x];
        ins.extend(mean.as_ref());
        let rstd = one(Step::Rstd, &ins, &[inv(n), eps])?;
        ins.push(&rstd);
        ins.extend(w.as_ref());
        ins.extend(b);
        let y = one(Step::Normalize, &ins, &[])?;
        let saved = Saved {
            key,
            n,
            x,
            mean,
            rstd,
            w,
        };
        Ok((y, saved))
    }

    /// The gradients of `[x, w?, b?]` (the weight and the bias that were given) for the
    /// output's gradient `g`.
    fn backward(&self, g: &Tensor<B>, needs: &[bool]) -> Result<Vec<Option<Tensor<B>>>> {
        let mut base = vec![g, &self.x];
        base.extend(self.mean.as_ref());
        base.push(&self.rstd);
        let mut grads = vec![None; needs.len()];
        if needs[0] {
            let mut ins = base.clone();
            ins.extend(self.w.as_ref());
            let means = self.run(Step::RowMeans, &ins, &[inv(self.n)])?;
            ins.extend(means.iter());
            grads[0] = Some(self.run(Step::Dx, &ins, &[])?.swap_remove(0));
        }
        let iw = self.key.weight.then_some(1);
        let ib = self.key.bias.then_some(1 + usize::from(self.key.weight));
        let wanted = |i: Option<usize>| i.filter(|&i| needs[i]);
        if wanted(iw).is_some() || wanted(ib).is_some() {
            // (Σ g x̂, Σ g if there is a bias), summed over the batch axes.
            let sums = self.run(Step::ColSums, &base, &[])?;
            let shape = self.x.dims()[self.key.rank - self.key.k..].to_vec();
            for (i, s) in [wanted(iw), wanted(ib)].into_iter().zip(sums) {
                if let Some(i) = i {
                    grads[i] = Some(s.reshape(shape.clone())?);
                }
            }
        }
        Ok(grads)
    }
}

impl<B: Backend> Var<B> {
    /// Layer normalization over the trailing `normalized_shape` dims (PyTorch's
    /// `F.layer_norm(x, normalized_shape, weight, bias, eps)`): `(x - mean) / √(var + eps)`,
    /// with the biased variance, then `· weight` and `+ bias` when given (each of the
    /// normalized shape). One recorded op with PyTorch's closed-form backward (module docs);
    /// runs on every backend through kiln's expression IR.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Self>,
        bias: Option<&Self>,
        eps: f64,
    ) -> Result<Self> {
        self.normalize("layer_norm", true, normalized_shape, weight, bias, eps)
    }

    /// RMS normalization over the trailing `normalized_shape` dims (PyTorch's
    /// `F.rms_norm(x, normalized_shape, weight, eps)`): `x / √(mean(x²) + eps)`, then
    /// `· weight` when given. One recorded op with a closed-form backward (module docs).
    pub fn rms_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Self>,
        eps: f64,
    ) -> Result<Self> {
        self.normalize("rms_norm", false, normalized_shape, weight, None, eps)
    }

    fn normalize(
        &self,
        op: &'static str,
        centered: bool,
        normalized_shape: &[usize],
        weight: Option<&Self>,
        bias: Option<&Self>,
        eps: f64,
    ) -> Result<Self> {
        if crate::autocast::autocast_dtype().is_some() {
            // Autocast's f32 list: a 16-bit input (and 16-bit affine parameters) cast up, so
            // the statistics are f32 and the output is f32.
            let (x, w, b) = (
                self.autocast_f32()?,
                weight.map(Var::autocast_f32).transpose()?,
                bias.map(Var::autocast_f32).transpose()?,
            );
            let _off = crate::autocast::autocast_disabled();
            return x.normalize(op, centered, normalized_shape, w.as_ref(), b.as_ref(), eps);
        }
        let x = self.tensor();
        let (wt, bt) = (weight.map(Var::tensor), bias.map(Var::tensor));
        let params = [("weight", wt.as_ref()), ("bias", bt.as_ref())];
        let n = check_args(op, &x, normalized_shape, &params, eps)?;
        let call = NormCall {
            op,
            x: self,
            weight,
            bias,
            centered,
            eps,
            n,
            k: normalized_shape.len(),
        };
        if let Some(y) = fused(call)? {
            return Ok(y);
        }
        let key = Key {
            step: Step::Mean,
            dtype: x.dtype(),
            centered,
            rank: x.rank(),
            k: normalized_shape.len(),
            weight: weight.is_some(),
            bias: bias.is_some(),
        };
        let (y, saved) = Saved::forward(key, n, x, wt, bt.as_ref(), eps)?;
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        Ok(Var::from_op(op, &inputs, y, move |g, needs| {
            saved.backward(g, needs)
        }))
    }
}
