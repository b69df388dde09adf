//! `check_backward`: Chainer's numerical gradient check.
//!
//! For a function `f` of several tensors, pick a random output cotangent `gy` and, for each
//! input `x_i`, a random unit direction `d_i`. The autograd directional derivative is
//! `<grad_i, d_i>`, where `grad_i` is what `backward_with(gy)` left in input `i`; the numerical
//! one is the central difference `(<f(x_i + eps d_i), gy> - <f(x_i - eps d_i), gy>) / (2 eps)`.
//! They must agree within `atol + rtol * |numerical|`. Checking input by input (rather than
//! Chainer's single direction over all inputs) costs two extra forwards per input and lets a
//! failure name the input whose gradient is wrong.
//!
//! Inputs are cast to [`CheckOptions::dtype`] (f64 by default) before anything runs, so the
//! check measures the gradient formulas, not f32 rounding. A non-contiguous f64 input stays a
//! view: the check then also exercises the strided paths of forward and backward.

use kiln_core::{Backend, DType, Error, Generator, Result, Tensor};

use crate::var::{Var, no_grad};

/// Tolerances and settings for [`check_backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct CheckOptions {
    /// The dtype the inputs are cast to (f64 unless the backend lacks it).
    pub dtype: DType,
    /// The finite-difference step.
    pub eps: f64,
    pub atol: f64,
    pub rtol: f64,
    /// Seed of the random directions and cotangent (Philox: the same on every backend).
    pub seed: u64,
}

impl Default for CheckOptions {
    /// f64, eps 1e-3, atol 1e-5, rtol 1e-4 (Chainer's defaults).
    fn default() -> Self {
        CheckOptions {
            dtype: DType::F64,
            eps: 1e-3,
            atol: 1e-5,
            rtol: 1e-4,
            seed: 0,
        }
    }
}

impl CheckOptions {
    /// Checking in f32: eps 1e-3, atol 1e-3, rtol 1e-2. A central difference in f32 carries a
    /// rounding error of about `ulp(f) / eps ≈ 1e-4 |f|`, so the f64 tolerances would fail on
    /// correct gradients; these looser ones still catch wrong formulas (which are off by O(1)).
    pub fn f32() -> Self {
        CheckOptions {
            dtype: DType::F32,
            eps: 1e-3,
            atol: 1e-3,
            rtol: 1e-2,
            seed: 0,
        }
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn with_tolerances(mut self, atol: f64, rtol: f64) -> Self {
        self.atol = atol;
        self.rtol = rtol;
        self
    }
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
}

const OP: &str = "check_backward";

/// `<a, b>` summed over every element, read back to the host.
fn dot<B: Backend>(a: &Tensor<B>, b: &Tensor<B>) -> Result<f64> {
    if a.elem_count() == 0 {
        return Ok(0.0);
    }
    a.mul(b)?.sum_all()?.to_scalar()
}

/// Checks the gradients autograd computes for `f` at `inputs` against central differences
/// (see the module docs). `f` gets the inputs as `Var`s, cast to `opts.dtype`; integer
/// arguments (labels, indices) belong in its closure. Returns an error naming the first input
/// whose directional derivatives disagree, with both numbers.
pub fn check_backward<B, F>(f: F, inputs: &[Tensor<B>], opts: &CheckOptions) -> Result<()>
where
    B: Backend,
    F: Fn(&[Var<B>]) -> Result<Var<B>>,
{
    if !opts.dtype.is_float() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: "a float dtype in CheckOptions".into(),
            got: opts.dtype,
        });
    }
    let xs = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            if !x.dtype().is_float() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "input {i} has dtype {}; only float inputs are differentiated (pass \
                         indices and labels inside the closure)",
                        x.dtype()
                    ),
                ));
            }
            x.to_dtype(opts.dtype)
        })
        .collect::<Result<Vec<_>>>()?;

    // Autograd side.
    let vars: Vec<Var<B>> = xs.iter().map(|x| Var::param(x.clone())).collect();
    let y = f(&vars)?;
    let yt = y.tensor();
    if yt.dtype() != opts.dtype {
        return Err(Error::invalid(
            OP,
            format!(
                "f returned dtype {}, expected {} (the dtype its inputs were cast to)",
                yt.dtype(),
                opts.dtype
            ),
        ));
    }
    let gy = Generator::new(opts.seed).randn_like(&yt)?;
    if y.requires_grad() {
        y.backward_with(&gy)?;
    }

    for (i, x) in xs.iter().enumerate() {
        let d = Generator::new(opts.seed.wrapping_add(1 + i as u64)).randn_like(x)?;
        let norm = dot(&d, &d)?.sqrt();
        let d = if norm > 0.0 { d.div_scalar(norm)? } else { d };
        let analytic = match vars[i].grad() {
            Some(g) => dot(&g, &d)?,
            None => 0.0,
        };
        let eval = |sign: f64| -> Result<f64> {
            let xi = x.add(&d.mul_scalar(sign * opts.eps)?)?;
            let consts: Vec<Var<B>> = xs
                .iter()
                .enumerate()
                .map(|(j, xj)| Var::constant(if j == i { xi.clone() } else { xj.clone() }))
                .collect();
            let out = no_grad(|| f(&consts))?;
            dot(&out.tensor(), &gy)
        };
        let numeric = (eval(1.0)? - eval(-1.0)?) / (2.0 * opts.eps);
        let tol = opts.atol + opts.rtol * numeric.abs();
        let diff = (numeric - analytic).abs();
        if !numeric.is_finite() || !analytic.is_finite() || diff > tol {
            return Err(Error::invalid(
                OP,
                format!(
                    "gradient of input {i} (shape {}, {}{}) is wrong: along a random direction \
                     the numerical derivative is {numeric:.9e} but autograd gives \
                     {analytic:.9e} (|diff| {diff:.3e} > atol {} + rtol {} * |numerical|; \
                     eps {}, seed {})",
                    x.shape(),
                    x.dtype(),
                    if inputs[i].is_contiguous() {
                        ""
                    } else {
                        ", non-contiguous"
                    },
                    opts.atol,
                    opts.rtol,
                    opts.eps,
                    opts.seed
                ),
            ));
        }
    }
    Ok(())
}

/// [`check_backward`] that panics with its message (for tests).
#[track_caller]
pub fn assert_backward<B, F>(f: F, inputs: &[Tensor<B>], opts: &CheckOptions)
where
    B: Backend,
    F: Fn(&[Var<B>]) -> Result<Var<B>>,
{
    if let Err(e) = check_backward(f, inputs, opts) {
        panic!("{e}");
    }
}
