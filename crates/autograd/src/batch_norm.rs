//! Batch normalization and group normalization on variables (`F.batch_norm`, `F.group_norm`).
//!
//! # Why one recorded op each, and why programs
//!
//! As [`layer_norm`](crate::Var::layer_norm) (see `norm.rs`), each is one recorded node whose
//! forward and backward are programs of kiln's expression IR (`kiln_core::expr`): one pass each
//! on the CPU, one generated kernel each on a GPU, no kernel of their own on any backend. They
//! differ from layer norm only in *which* axes the statistics reduce and which the affine
//! parameters vary along, so one small engine here serves both:
//!
//! - **batch norm** over `[n, c, *]`: statistics per channel over every axis but 1, the weight
//!   and bias per channel. The statistics axes are the axes the weight gradient sums over, so
//!   the backward needs only two passes: the per-channel sums `Σ g` and `Σ g x̂` (which *are*
//!   `db` and `dw`), then `dx = rstd · w · (g - Σg/n - x̂ · Σgx̂/n)`.
//! - **group norm** over `[n, c, *]`, viewed as `[n, groups, c/groups, s]`: statistics per
//!   (sample, group) over the last two axes, the weight per channel (axes 1 and 2). With
//!   `ĝ = g · w` the backward is layer norm's closed form, `dx = rstd · (ĝ - mean(ĝ) - x̂ ·
//!   mean(ĝ x̂))`, the means over the group, and `dw`, `db` are sums over axes 0 and 3: three
//!   passes, because a program reduces over one set of axes.
//!
//! The forward is three programs (the mean; the two-pass variance with `rstd` and, for batch
//! norm, the biased and unbiased variances the running statistics need; the normalization with
//! the affine map). In evaluation mode batch norm normalizes with given running statistics:
//! one program forward, `dx = g · w · rstd` and the same per-channel sums backward.
//!
//! # Dtypes
//!
//! The programs compute in the input's compute dtype: for a 16-bit input (bf16, f16) they load
//! it and the output's gradient as 16 bits, widen them, do every sum and product in f32 and
//! round only `y` and `dx` to 16 bits when storing them. The statistics (`mean`, `rstd`, the
//! variances) are f32 outputs, so what backward reads and what the running statistics fold in
//! was never rounded; the weight and bias may be of the input's dtype or f32 (a 16-bit input
//! beside f32 parameters, as autocast leaves them and as cuDNN takes them), and their gradients
//! come in their own dtype, summed in f32. Nothing of the input's size exists in f32: that is
//! what makes batch norm cheap in memory under autocast (see `autocast.rs`). Group norm shares
//! the engine (autocast casts its input to f32 first, as PyTorch does).
//!
//! Running statistics are state, not part of the differentiable op: training mode returns the
//! batch statistics ([`BatchStats`]) and [`update_running_stats`] folds them into the running
//! ones with PyTorch's formula (one small program), so the layer in kiln-nn decides when.
//!
//! Programs are built once per (step, input dtype, rank, axes, which of weight and bias) and memoized
//! here; the backends memoize what they compile from them.

use std::sync::{Arc, OnceLock};

use kiln_core::expr::{Expr, Program};
use kiln_core::{Backend, DType, Error, Result, Tensor};

use crate::programs::{Inputs, Memo, memoized};
use crate::var::Var;

/// One program of the batch norm / group norm family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Step {
    /// `[x] (inv_n) -> mean` over the statistics axes.
    Mean,
    /// `[x, mean] (inv_n, inv_n1, eps) -> rstd, var, unbiased var` (`inv_n1 = 1/(n-1)`).
    Var,
    /// `[x, mean, rstd, w?, b?] -> y`.
    Normalize,
    /// `[g, x, mean, rstd] -> Σ g x̂, Σ g?` over the parameter-sum axes.
    ColSums,
    /// Batch norm's `[g, x, mean, rstd, w?, Σgx̂, Σg] (inv_n) -> dx`.
    FactoredDx,
    /// Group norm's `[g, x, mean, rstd, w?] (inv_n) -> mean(ĝ), mean(ĝ x̂)`.
    RowMeans,
    /// Group norm's `[g, x, mean, rstd, w?, mean(ĝ), mean(ĝ x̂)] -> dx`.
    Dx,
    /// Evaluation mode's `[g, rstd, w?] -> dx`.
    EvalDx,
    /// `[running_mean, running_var, mean, unbiased var] (momentum) -> running_mean,
    /// running_var`.
    Running,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    step: Step,
    dtype: DType,
    rank: usize,
    /// Bit `a` set: axis `a` is reduced for the statistics.
    stat: u32,
    /// Bit `a` set: axis `a` is summed for the weight and bias gradients.
    col: u32,
    weight: bool,
    bias: bool,
}

fn axes_of(mask: u32, rank: usize) -> Vec<isize> {
    (0..rank)
        .filter(|a| mask & (1 << a) != 0)
        .map(|a| a as isize)
        .collect()
}

/// The program of `key`, built on first use.
fn program(key: Key) -> Result<Arc<Program>> {
    static MEMO: Memo<Key> = OnceLock::new();
    memoized(&MEMO, key, build)
}

/// The inputs and the outputs of `key`'s program (see [`Step`] for the signatures).
///
/// `key.dtype` is the input's dtype (the running statistics' for [`Step::Running`]); the
/// arithmetic, the statistics and the affine parameters are in its compute dtype (f32 for a
/// 16-bit input): the input and the output's gradient are widened as they are loaded, and the
/// values of the input's shape (`y`, `dx`) rounded to its dtype once, when stored.
fn build(key: Key) -> (Inputs, Vec<Expr>) {
    let stat = axes_of(key.stat, key.rank);
    let col = axes_of(key.col, key.rank);
    let (xd, cd) = (key.dtype, key.dtype.compute_dtype());
    let mut ins = Inputs::new(cd);
    let store = |e: Expr| if xd == cd { e } else { e.to_dtype(xd) };
    let times_w = |e: Expr, ins: &mut Inputs| match ins.next_if(key.weight) {
        Some(w) => e * w,
        None => e,
    };
    let outs = match key.step {
        Step::Mean => vec![ins.next_of(xd).sum(&stat) * Expr::param(0)],
        Step::Var => {
            let (x, mean) = (ins.next_of(xd), ins.next());
            let d = x - mean;
            let ss = (&d * &d).sum(&stat);
            let var = &ss * Expr::param(0);
            vec![(&var + Expr::param(2)).rsqrt(), var, ss * Expr::param(1)]
        }
        Step::Normalize => {
            let (x, mean, rstd) = (ins.next_of(xd), ins.next(), ins.next());
            let y = times_w((x - mean) * rstd, &mut ins);
            vec![store(match ins.next_if(key.bias) {
                Some(b) => y + b,
                None => y,
            })]
        }
        Step::ColSums => {
            let (g, x) = (ins.next_of(xd), ins.next_of(xd));
            let (mean, rstd) = (ins.next(), ins.next());
            let xhat = (x - mean) * rstd;
            let mut outs = vec![(&g * xhat).sum(&col)];
            if key.bias {
                outs.push(g.sum(&col));
            }
            outs
        }
        Step::FactoredDx => {
            let (g, x) = (ins.next_of(xd), ins.next_of(xd));
            let (mean, rstd) = (ins.next(), ins.next());
            let scale = times_w(rstd.clone(), &mut ins);
            let (sgx, sg) = (ins.next(), ins.next());
            let inv_n = Expr::param(0);
            let xhat = (x - mean) * rstd;
            vec![store(scale * (g - sg * &inv_n - xhat * (sgx * inv_n)))]
        }
        Step::RowMeans | Step::Dx => {
            let (g, x) = (ins.next_of(xd), ins.next_of(xd));
            let (mean, rstd) = (ins.next(), ins.next());
            let xhat = (x - mean) * &rstd;
            let gy = times_w(g, &mut ins);
            if key.step == Step::RowMeans {
                let inv_n = Expr::param(0);
                vec![gy.sum(&stat) * &inv_n, (&gy * &xhat).sum(&stat) * inv_n]
            } else {
                let (a, c) = (ins.next(), ins.next());
                vec![store(rstd * (gy - a - xhat * c))]
            }
        }
        Step::EvalDx => {
            let (g, rstd) = (ins.next_of(xd), ins.next());
            vec![store(times_w(g * rstd, &mut ins))]
        }
        Step::Running => {
            let (rm, rv) = (ins.next_of(xd), ins.next_of(xd));
            let (mean, var) = (ins.next(), ins.next());
            let m = Expr::param(0);
            let keep = Expr::param(1);
            vec![store(&m * mean + &keep * rm), store(m * var + keep * rv)]
        }
    };
    (ins, outs)
}

fn run<B: Backend>(key: Key, inputs: &[&Tensor<B>], params: &[f64]) -> Result<Vec<Tensor<B>>> {
    program(key)?.run(inputs, params)
}

/// `1 / n`, and 0 for `n == 0` (whose outputs are empty anyway).
fn inv(n: usize) -> f64 {
    if n == 0 { 0.0 } else { 1.0 / n as f64 }
}

/// The statistics of one training-mode [`Var::batch_norm_train`] call, per channel (`[c]`):
/// what a layer folds into its running statistics ([`update_running_stats`]). In the input's
/// compute dtype (f32 for a 16-bit input).
#[derive(Clone, Debug)]
pub struct BatchStats<B: Backend> {
    /// The batch mean.
    pub mean: Tensor<B>,
    /// The biased variance (divided by `count`): what the output was normalized with.
    pub var: Tensor<B>,
    /// The unbiased variance (divided by `count - 1`): what PyTorch's running variance tracks.
    pub var_unbiased: Tensor<B>,
    /// The number of values each channel's statistics were taken over (`n · h · w`).
    pub count: usize,
}

/// PyTorch's running-statistics update, `momentum · batch + (1 - momentum) · running`, for the
/// mean and (with the unbiased batch variance) the variance; one program for both. Returns the
/// new `(running_mean, running_var)`. `momentum` in `[0, 1]`; PyTorch's cumulative average
/// (`momentum=None`) is `1 / num_batches_tracked` here. The running statistics are of the
/// statistics' dtype, or 16-bit beside f32 statistics (a model converted to bf16): they are
/// then read widened, updated in f32 and rounded once.
pub fn update_running_stats<B: Backend>(
    running_mean: &Tensor<B>,
    running_var: &Tensor<B>,
    stats: &BatchStats<B>,
    momentum: f64,
) -> Result<(Tensor<B>, Tensor<B>)> {
    const OP: &str = "update_running_stats";
    if !(0.0..=1.0).contains(&momentum) {
        return Err(Error::invalid(
            OP,
            format!("momentum must be in [0, 1], got {momentum}"),
        ));
    }
    let c = stats.mean.dims().to_vec();
    // The running statistics keep their dtype; the batch's are in its compute dtype (f32 for
    // 16-bit running statistics, which the update reads widened and rounds once).
    let rd = running_mean.dtype();
    for (name, t) in [("running_mean", running_mean), ("running_var", running_var)] {
        if t.dims() != c.as_slice() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name} must have the statistics' shape {c:?}, got {}",
                    t.shape()
                ),
            ));
        }
        if t.dtype() != rd || rd.compute_dtype() != stats.mean.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: format!(
                    "a {name} of the statistics' dtype {} (or 16 bits for f32 statistics)",
                    stats.mean.dtype()
                ),
                got: t.dtype(),
            });
        }
        t.check_same_device(OP, &stats.mean)?;
    }
    if stats.var_unbiased.dtype() != stats.mean.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: format!(
                "an unbiased variance of the mean's dtype {}",
                stats.mean.dtype()
            ),
            got: stats.var_unbiased.dtype(),
        });
    }
    let key = Key {
        step: Step::Running,
        dtype: rd,
        rank: c.len(),
        stat: 0,
        col: 0,
        weight: false,
        bias: false,
    };
    let mut outs = run(
        key,
        &[running_mean, running_var, &stats.mean, &stats.var_unbiased],
        &[momentum, 1.0 - momentum],
    )?;
    let rv = outs.pop().expect("two outputs");
    let rm = outs.pop().expect("two outputs");
    Ok((rm, rv))
}

/// Checks a `[n, c, *]` float input of `op`.
fn check_input<B: Backend>(op: &'static str, x: &Tensor<B>, eps: f64) -> Result<usize> {
    if !x.dtype().is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: "a float input".into(),
            got: x.dtype(),
        });
    }
    if x.rank() < 2 || x.rank() > 16 {
        return Err(Error::invalid(
            op,
            format!(
                "expects an input [n, c, *] of rank 2 to 16, got shape {}",
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
    Ok(x.dims()[1])
}

/// Checks that each given per-channel tensor is `[c]`, on `x`'s device, and of `x`'s dtype or
/// its compute dtype (f32 beside a 16-bit input, as PyTorch's and cuDNN's batch norm take it).
fn check_channel_params<B: Backend>(
    op: &'static str,
    x: &Tensor<B>,
    c: usize,
    params: &[(&str, Option<&Tensor<B>>)],
) -> Result<()> {
    for (name, p) in params {
        let Some(p) = p else { continue };
        if p.dims() != [c] {
            return Err(Error::invalid(
                op,
                format!(
                    "{name} must be [{c}] (one value per channel), got {}",
                    p.shape()
                ),
            ));
        }
        if p.dtype() != x.dtype() && p.dtype() != x.dtype().compute_dtype() {
            return Err(Error::DTypeMismatch {
                op,
                expected: format!(
                    "a {name} of the input's dtype {} or its compute dtype {}",
                    x.dtype(),
                    x.dtype().compute_dtype()
                ),
                got: p.dtype(),
            });
        }
        x.check_same_device(op, p)?;
    }
    Ok(())
}

/// What the backward of a normalization reads.
struct Saved<B: Backend> {
    /// Program key with `step` to be set; `stat`/`col` are the axes of `x`'s (possibly
    /// regrouped) view.
    key: Key,
    /// The number of values per statistic.
    n: usize,
    /// The input in its regrouped view.
    x: Tensor<B>,
    mean: Tensor<B>,
    rstd: Tensor<B>,
    /// The weight viewed to broadcast against `x`, in the compute dtype.
    w: Option<Tensor<B>>,
    /// The dtypes of the weight and the bias (their gradients'), where given.
    param_dtypes: [Option<DType>; 2],
    /// Batch norm's factored backward (statistics axes = parameter-sum axes).
    factored: bool,
    /// Evaluation mode: `mean` and `rstd` are constants (the running statistics).
    eval: bool,
    /// The input's own dims (the gradient's shape).
    dims: Vec<usize>,
    channels: usize,
}

impl<B: Backend> Saved<B> {
    fn run(&self, step: Step, inputs: &[&Tensor<B>], params: &[f64]) -> Result<Vec<Tensor<B>>> {
        run(Key { step, ..self.key }, inputs, params)
    }

    /// The gradients of `[x, w?, b?]` for the output's gradient `g` (in `x`'s own shape).
    fn backward(&self, g: &Tensor<B>, needs: &[bool]) -> Result<Vec<Option<Tensor<B>>>> {
        let g = g.reshape(self.x.dims().to_vec())?;
        let base = [&g, &self.x, &self.mean, &self.rstd];
        let mut grads = vec![None; needs.len()];
        let iw = self.key.weight.then_some(1);
        let ib = self.key.bias.then_some(1 + usize::from(self.key.weight));
        let wanted = |i: Option<usize>| i.filter(|&i| needs[i]);
        // Σ g x̂ and Σ g over the parameter-sum axes: dw and db, and batch norm's dx reads them.
        let factored_dx = needs[0] && self.factored && !self.eval;
        let sums_needed = wanted(iw).is_some() || wanted(ib).is_some() || factored_dx;
        let sums = if sums_needed {
            // The factored dx needs Σ g even without a bias.
            let key_bias = self.key.bias || factored_dx;
            let key = Key {
                step: Step::ColSums,
                bias: key_bias,
                ..self.key
            };
            run(key, &base, &[])?
        } else {
            Vec::new()
        };
        if needs[0] {
            let mut ins: Vec<&Tensor<B>> = Vec::new();
            let dx = if self.eval {
                ins.extend([&g, &self.rstd]);
                ins.extend(self.w.as_ref());
                self.run(Step::EvalDx, &ins, &[])?
            } else if self.factored {
                ins.extend(base);
                ins.extend(self.w.as_ref());
                ins.extend(sums.iter());
                let key = Key {
                    step: Step::FactoredDx,
                    ..self.key
                };
                run(key, &ins, &[inv(self.n)])?
            } else {
                ins.extend(base);
                ins.extend(self.w.as_ref());
                let means = self.run(Step::RowMeans, &ins, &[inv(self.n)])?;
                ins.extend(means.iter());
                self.run(Step::Dx, &ins, &[])?
            };
            grads[0] = Some(
                dx.into_iter()
                    .next()
                    .expect("one output")
                    .reshape(self.dims.clone())?,
            );
        }
        for ((i, d), s) in [wanted(iw), wanted(ib)]
            .into_iter()
            .zip(self.param_dtypes)
            .zip(sums)
        {
            if let (Some(i), Some(d)) = (i, d) {
                // Summed in the compute dtype; a 16-bit parameter's gradient is rounded once.
                grads[i] = Some(s.reshape([self.channels])?.to_dtype(d)?);
            }
        }
        Ok(grads)
    }
}

/// Runs the forward of the normalization `key` of the (regrouped) input `x` with given or
/// computed statistics; returns the output and the variances (empty when `stats` is given).
#[allow(clippy::type_complexity)]
fn forward<B: Backend>(
    key: Key,
    n: usize,
    x: &Tensor<B>,
    stats: Option<(Tensor<B>, Tensor<B>)>,
    w: Option<&Tensor<B>>,
    b: Option<&Tensor<B>>,
    eps: f64,
) -> Result<(Tensor<B>, Tensor<B>, Tensor<B>, Vec<Tensor<B>>)> {
    let one = |step, ins: &[&Tensor<B>], params: &[f64]| -> Result<Vec<Tensor<B>>> {
        run(Key { step, ..key }, ins, params)
    };
    let (mean, rstd, vars) = match stats {
        Some((mean, rstd)) => (mean, rstd, Vec::new()),
        None => {
            let mean = one(Step::Mean, &[x], &[inv(n)])?.swap_remove(0);
            let inv_n1 = if n > 1 {
                1.0 / (n - 1) as f64
            } else {
                f64::NAN
            };
            let mut v = one(Step::Var, &[x, &mean], &[inv(n), inv_n1, eps])?;
            let rstd = v.remove(0);
            (mean, rstd, v)
        }
    };
    let mut ins = vec![x, &mean, &rstd];
    ins.extend(w);
    ins.extend(b);
    let y = one(Step::Normalize, &ins, &[])?.swap_remove(0);
    Ok((y, mean, rstd, vars))
}

/// The input and affine parameters of a norm under autocast: cast up to f32 (the norms are on
/// autocast's f32 list).
type F32Args<B> = (Var<B>, Option<Var<B>>, Option<Var<B>>);
fn autocast_f32_all<B: Backend>(
    x: &Var<B>,
    weight: Option<&Var<B>>,
    bias: Option<&Var<B>>,
) -> Result<F32Args<B>> {
    Ok((
        x.autocast_f32()?,
        weight.map(Var::autocast_f32).transpose()?,
        bias.map(Var::autocast_f32).transpose()?,
    ))
}

/// Batch norm's affine parameters under autocast, where the input keeps its dtype (PyTorch's
/// CUDA autocast lists no batch norm: cuDNN reads a 16-bit input beside f32 parameters and
/// statistics): a parameter of neither the input's dtype nor its compute dtype is cast to f32.
/// Unchanged outside autocast.
type Params<B> = (Option<Var<B>>, Option<Var<B>>);
fn autocast_bn_params<B: Backend>(
    x: &Var<B>,
    weight: Option<&Var<B>>,
    bias: Option<&Var<B>>,
) -> Result<Params<B>> {
    let on = crate::autocast::autocast_dtype().is_some();
    let (xd, cd) = (x.dtype(), x.dtype().compute_dtype());
    let fit = |p: &Var<B>| {
        if on && p.dtype() != xd && p.dtype() != cd {
            p.autocast_f32()
        } else {
            Ok(p.clone())
        }
    };
    Ok((weight.map(fit).transpose()?, bias.map(fit).transpose()?))
}

impl<B: Backend> Var<B> {
    /// Batch normalization in training mode (PyTorch's `F.batch_norm(x, rm, rv, weight, bias,
    /// training=True, eps=eps)`) over `[n, c, *]` (`[n, c]`, `[n, c, l]`, `[n, c, h, w]`, ...):
    /// each channel normalized with its mean and biased variance over every other axis, then
    /// `· weight + bias` (each `[c]`) when given. Returns the output and the batch statistics,
    /// which [`update_running_stats`] folds into running ones; this op itself keeps no state.
    /// One recorded op with the closed-form backward (module docs). At least two values per
    /// channel are needed, as in PyTorch.
    ///
    /// A 16-bit input gives a 16-bit output and f32 statistics, computed in f32; `weight` and
    /// `bias` may be f32 beside it (module docs). Under [`crate::autocast`] nothing is cast:
    /// batch norm runs in its input's dtype, as in PyTorch.
    pub fn batch_norm_train(
        &self,
        weight: Option<&Self>,
        bias: Option<&Self>,
        eps: f64,
    ) -> Result<(Self, BatchStats<B>)> {
        const OP: &str = "batch_norm";
        let (weight, bias) = autocast_bn_params(self, weight, bias)?;
        let (weight, bias) = (weight.as_ref(), bias.as_ref());
        let x = self.tensor();
        let c = check_input(OP, &x, eps)?;
        let (wt, bt) = (weight.map(Var::tensor), bias.map(Var::tensor));
        check_channel_params(OP, &x, c, &[("weight", wt.as_ref()), ("bias", bt.as_ref())])?;
        let count = x.elem_count().checked_div(c).unwrap_or(0);
        if count < 2 {
            return Err(Error::invalid(
                OP,
                format!(
                    "expected more than 1 value per channel when training, got an input of \
                     shape {}",
                    x.shape()
                ),
            ));
        }
        let key = bn_key(&x, wt.is_some(), bt.is_some());
        let (wv, bv) = (
            channel_view(wt.as_ref(), &x)?,
            channel_view(bt.as_ref(), &x)?,
        );
        let (y, mean, rstd, mut vars) =
            forward(key, count, &x, None, wv.as_ref(), bv.as_ref(), eps)?;
        let var_unbiased = vars.pop().expect("two variances").reshape([c])?;
        let var = vars.pop().expect("two variances").reshape([c])?;
        let stats = BatchStats {
            mean: mean.reshape([c])?,
            var,
            var_unbiased,
            count,
        };
        let saved = Saved {
            key,
            n: count,
            dims: x.dims().to_vec(),
            x,
            mean,
            rstd,
            w: wv,
            param_dtypes: dtypes_of(wt.as_ref(), bt.as_ref()),
            factored: true,
            eval: false,
            channels: c,
        };
        let y = self.record(OP, weight, bias, y, saved);
        Ok((y, stats))
    }

    /// Batch normalization in evaluation mode (PyTorch's `F.batch_norm(x, running_mean,
    /// running_var, weight, bias, training=False, eps=eps)`) over `[n, c, *]`: each channel
    /// normalized with the given running mean and variance (`[c]` tensors, constants), then
    /// `· weight + bias` when given. One recorded op. Dtypes as
    /// [`Var::batch_norm_train`]: the running statistics, like the parameters, may be f32
    /// beside a 16-bit input.
    pub fn batch_norm_eval(
        &self,
        running_mean: &Tensor<B>,
        running_var: &Tensor<B>,
        weight: Option<&Self>,
        bias: Option<&Self>,
        eps: f64,
    ) -> Result<Self> {
        const OP: &str = "batch_norm";
        let (weight, bias) = autocast_bn_params(self, weight, bias)?;
        let (weight, bias) = (weight.as_ref(), bias.as_ref());
        let x = self.tensor();
        let c = check_input(OP, &x, eps)?;
        let (wt, bt) = (weight.map(Var::tensor), bias.map(Var::tensor));
        check_channel_params(
            OP,
            &x,
            c,
            &[
                ("weight", wt.as_ref()),
                ("bias", bt.as_ref()),
                ("running_mean", Some(running_mean)),
                ("running_var", Some(running_var)),
            ],
        )?;
        let key = bn_key(&x, wt.is_some(), bt.is_some());
        let (wv, bv) = (
            channel_view(wt.as_ref(), &x)?,
            channel_view(bt.as_ref(), &x)?,
        );
        let mean = channel_view(Some(running_mean), &x)?.expect("given");
        let rv = running_var.to_dtype(x.dtype().compute_dtype())?;
        let rstd = channel_view(Some(&rv.add_scalar(eps)?.rsqrt()?), &x)?.expect("given");
        let count = x.elem_count().checked_div(c).unwrap_or(0);
        let (y, mean, rstd, _) = forward(
            key,
            count,
            &x,
            Some((mean, rstd)),
            wv.as_ref(),
            bv.as_ref(),
            eps,
        )?;
        let saved = Saved {
            key,
            n: count,
            dims: x.dims().to_vec(),
            x,
            mean,
            rstd,
            w: wv,
            param_dtypes: dtypes_of(wt.as_ref(), bt.as_ref()),
            factored: true,
            eval: true,
            channels: c,
        };
        Ok(self.record(OP, weight, bias, y, saved))
    }

    /// Group normalization (PyTorch's `F.group_norm(x, groups, weight, bias, eps)`) over
    /// `[n, c, *]`: the channels split into `groups` consecutive groups, each (sample, group)
    /// normalized with its mean and biased variance over its channels and every spatial
    /// position, then `· weight + bias` (each `[c]`, per channel) when given. One recorded op
    /// with the closed-form backward (module docs).
    pub fn group_norm(
        &self,
        groups: usize,
        weight: Option<&Self>,
        bias: Option<&Self>,
        eps: f64,
    ) -> Result<Self> {
        const OP: &str = "group_norm";
        if crate::autocast::autocast_dtype().is_some() {
            let (x, w, b) = autocast_f32_all(self, weight, bias)?;
            let _off = crate::autocast::autocast_disabled();
            return x.group_norm(groups, w.as_ref(), b.as_ref(), eps);
        }
        let x = self.tensor();
        let c = check_input(OP, &x, eps)?;
        if groups == 0 || c % groups != 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "the number of channels {c} must be divisible by groups {groups} (> 0), \
                     input shape {}",
                    x.shape()
                ),
            ));
        }
        let (wt, bt) = (weight.map(Var::tensor), bias.map(Var::tensor));
        check_channel_params(OP, &x, c, &[("weight", wt.as_ref()), ("bias", bt.as_ref())])?;
        let (nb, cg) = (x.dims()[0], c / groups);
        let s: usize = x.dims()[2..].iter().product();
        let xg = x.reshape([nb, groups, cg, s])?;
        let cd = x.dtype().compute_dtype();
        let view = |t: Option<&Tensor<B>>| {
            t.map(|t| t.to_dtype(cd)?.reshape([1, groups, cg, 1]))
                .transpose()
        };
        let (wv, bv) = (view(wt.as_ref())?, view(bt.as_ref())?);
        let key = Key {
            step: Step::Mean,
            dtype: x.dtype(),
            rank: 4,
            stat: 0b1100,
            col: 0b1001,
            weight: wt.is_some(),
            bias: bt.is_some(),
        };
        let n = cg * s;
        let (y, mean, rstd, _) = forward(key, n, &xg, None, wv.as_ref(), bv.as_ref(), eps)?;
        let y = y.reshape(x.dims().to_vec())?;
        let saved = Saved {
            key,
            n,
            dims: x.dims().to_vec(),
            x: xg,
            mean,
            rstd,
            w: wv,
            param_dtypes: dtypes_of(wt.as_ref(), bt.as_ref()),
            factored: false,
            eval: false,
            channels: c,
        };
        Ok(self.record(OP, weight, bias, y, saved))
    }

    fn record(
        &self,
        op: &'static str,
        weight: Option<&Self>,
        bias: Option<&Self>,
        y: Tensor<B>,
        saved: Saved<B>,
    ) -> Self {
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        Var::from_op(op, &inputs, y, move |g, needs| saved.backward(g, needs))
    }
}

/// Batch norm's key over `x` `[n, c, *]`: statistics and parameter sums over every axis but 1.
fn bn_key<B: Backend>(x: &Tensor<B>, weight: bool, bias: bool) -> Key {
    let all = (1u32 << x.rank()) - 1;
    let stat = all & !0b10;
    Key {
        step: Step::Mean,
        dtype: x.dtype(),
        rank: x.rank(),
        stat,
        col: stat,
        weight,
        bias,
    }
}

/// A `[c]` tensor in `x`'s compute dtype (a no-op but for a 16-bit parameter beside a 16-bit
/// input), viewed as `[1, c, 1, ...]` to broadcast against `x` `[n, c, *]`.
fn channel_view<B: Backend>(t: Option<&Tensor<B>>, x: &Tensor<B>) -> Result<Option<Tensor<B>>> {
    let Some(t) = t else { return Ok(None) };
    let mut dims = vec![1; x.rank()];
    dims[1] = x.dims()[1];
    Ok(Some(t.to_dtype(x.dtype().compute_dtype())?.reshape(dims)?))
}

/// The dtypes of the given weight and bias.
fn dtypes_of<B: Backend>(w: Option<&Tensor<B>>, b: Option<&Tensor<B>>) -> [Option<DType>; 2] {
    [w.map(Tensor::dtype), b.map(Tensor::dtype)]
}
