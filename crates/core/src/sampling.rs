//! Sampling categories from probabilities: [`Generator::multinomial`] (`torch.multinomial`) and
//! [`sample_logits`], the temperature and top-k sampling of a language model's generation loop.
//!
//! # How
//!
//! With the Gumbel-max trick: `argmax_i(log p_i + G_i)`, with `G_i = -log(-log U_i)` independent
//! standard Gumbel noise, is distributed as `p / Σp`; and the `n` largest keys
//! `log p_i + G_i` of one draw are a sample of `n` categories *without* replacement, in the
//! order sequential drawing would pick them (the Gumbel-top-k theorem). So sampling is a
//! uniform draw of the generator (Philox: the same numbers on every backend, so a seed gives the
//! same tokens on the CPU and on a GPU), `log`, an add and `argmax` — ops every backend runs on
//! its device; nothing per category runs on the host. With replacement the `n` samples of a row
//! are `n` independent draws (`[rows, n, C]` noise at once); without, `n` rounds of `argmax`
//! that each retire the chosen category.
//!
//! The probabilities are checked as PyTorch checks them (no negative, NaN or infinite entry, no
//! row summing to 0, enough nonzero categories without replacement): one small reduction read
//! back to the host per call, the only synchronization, so a bad row is a typed error naming
//! the op rather than garbage. Rows need not sum to 1.

use crate::{Backend, CmpOp, DType, Error, Generator, Result, Shape, Tensor};

const OP: &str = "multinomial";

impl Generator {
    /// `num_samples` category indices (`i64`) per row of `probs` (`[C]` or `[rows, C]`, any float
    /// dtype, nonnegative weights that need not sum to 1), of shape `[num_samples]` or
    /// `[rows, num_samples]`, drawn with or without replacement as `torch.multinomial`, by the
    /// Gumbel-max trick on device ops (one small read back checks the probabilities).
    /// Deterministic for a given seed and draw count (one draw of the generator per call): the
    /// same samples on every backend.
    ///
    /// Errors (naming `multinomial`): `probs` not 1-d or 2-d or not float; `num_samples` 0, or
    /// above the number of categories (or of nonzero ones in some row) without replacement; a
    /// negative, NaN or infinite probability; a row summing to 0.
    pub fn multinomial<B: Backend>(
        &mut self,
        probs: &Tensor<B>,
        num_samples: usize,
        replacement: bool,
    ) -> Result<Tensor<B>> {
        multinomial_as(OP, self, probs, num_samples, replacement)
    }
}

/// [`Generator::multinomial`] with errors naming `op`.
fn multinomial_as<B: Backend>(
    op: &'static str,
    generator: &mut Generator,
    probs: &Tensor<B>,
    n: usize,
    replacement: bool,
) -> Result<Tensor<B>> {
    if !(1..=2).contains(&probs.rank()) {
        return Err(Error::invalid(
            op,
            format!(
                "probabilities must be [C] or [rows, C], got shape {}",
                probs.shape()
            ),
        ));
    }
    if !probs.dtype().is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: "float probabilities".into(),
            got: probs.dtype(),
        });
    }
    let c = probs.dims()[probs.rank() - 1];
    if c == 0 || n == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "needs at least one category and one sample, got {c} categories and {n} samples"
            ),
        ));
    }
    if !replacement && n > c {
        return Err(Error::invalid(
            op,
            format!("cannot draw {n} samples from {c} categories without replacement"),
        ));
    }
    let p2 = probs.reshape([probs.elem_count() / c, c])?;
    check_probabilities(op, &p2, if replacement { 1 } else { n })?;
    let logp = p2.log()?;
    let idx = if replacement {
        let rows = p2.dims()[0];
        let u = generator.sample::<B>(
            [rows, n, c],
            crate::RandDist::Uniform {
                low: 0.0,
                high: 1.0,
            },
            p2.dtype(),
            p2.device(),
        )?;
        logp.unsqueeze(1)?.add(&gumbel(&u)?)?.argmax(-1, false)?
    } else {
        let mut keys = logp.add(&gumbel(&generator.rand_like(&p2)?)?)?;
        let cols =
            Tensor::<B>::arange(0.0, c as f64, 1.0, DType::I64, p2.device())?.reshape([1, c])?;
        let neg_inf =
            Tensor::<B>::full(Shape::scalar(), f64::NEG_INFINITY, p2.dtype(), p2.device())?;
        let mut picked = Vec::with_capacity(n);
        for _ in 0..n {
            let i = keys.argmax(-1, true)?;
            keys = cols.eq(&i)?.where_cond(&neg_inf, &keys)?;
            picked.push(i);
        }
        Tensor::cat(&picked, 1)?
    };
    if probs.rank() == 1 {
        idx.reshape([n])
    } else {
        Ok(idx)
    }
}

/// Standard Gumbel noise `-log(-log u)` from uniforms `u` in `[0, 1)`.
fn gumbel<B: Backend>(u: &Tensor<B>) -> Result<Tensor<B>> {
    u.log()?.neg()?.log()?.neg()
}

/// Rejects what `torch.multinomial` rejects, with one value read back: a negative, NaN or
/// infinite entry, a row summing to 0, a row with fewer than `min_nonzero` nonzero entries.
fn check_probabilities<B: Backend>(
    op: &'static str,
    p: &Tensor<B>,
    min_nonzero: usize,
) -> Result<()> {
    let f = |t: Tensor<B>| t.to_dtype(DType::F64);
    let ok = f(p.compare_scalar(CmpOp::Ge, 0.0)?)?
        .mul(&f(p.compare_scalar(CmpOp::Lt, f64::INFINITY)?)?)?;
    let bad = ok.sum_all()?.neg()?.add_scalar(p.elem_count() as f64)?;
    let zero = Tensor::<B>::zeros(Shape::scalar(), p.dtype(), p.device())?;
    let sums = ok
        .compare_scalar(CmpOp::Gt, 0.0)?
        .where_cond(p, &zero)?
        .sum(&[-1], false)?;
    let empty_rows = f(sums.compare_scalar(CmpOp::Le, 0.0)?)?.sum_all()?;
    let fewest = f(p.compare_scalar(CmpOp::Gt, 0.0)?)?
        .sum(&[-1], false)?
        .min_all()?;
    let v = Tensor::stack(&[bad, empty_rows, fewest], 0)?.to_vec::<f64>()?;
    if v[0] > 0.0 {
        return Err(Error::invalid(
            op,
            format!("{} probabilities are negative, NaN or infinite", v[0]),
        ));
    }
    if v[1] > 0.0 {
        return Err(Error::invalid(op, format!("{} rows sum to 0", v[1])));
    }
    if (v[2] as usize) < min_nonzero {
        return Err(Error::invalid(
            op,
            format!(
                "a row has only {} nonzero probabilities, fewer than the {min_nonzero} samples asked without replacement",
                v[2]
            ),
        ));
    }
    Ok(())
}

/// One token per row of `logits` (`[.., C]`, float): a sample of `softmax(logits /
/// temperature)` restricted to each row's `top_k` largest logits when given (values tied with
/// the `k`-th largest stay in, as nanoGPT's `logits[logits < v[:, [-1]]] = -inf`; a `top_k`
/// above `C` means all). Returns `i64` of shape `[..]`. For greedy decoding use `argmax`.
///
/// Errors (naming `sample_logits`): a temperature that is not finite and positive, `top_k` 0,
/// logits of rank 0 or not float, a logit that is NaN or `+inf`, a row that is all `-inf`.
pub fn sample_logits<B: Backend>(
    logits: &Tensor<B>,
    temperature: f64,
    top_k: Option<usize>,
    generator: &mut Generator,
) -> Result<Tensor<B>> {
    const OP: &str = "sample_logits";
    if !temperature.is_finite() || temperature <= 0.0 {
        return Err(Error::invalid(
            OP,
            format!("temperature must be finite and positive, got {temperature}"),
        ));
    }
    if top_k == Some(0) {
        return Err(Error::invalid(OP, "top_k must be at least 1"));
    }
    if logits.rank() == 0 || !logits.dtype().is_float() {
        return Err(Error::invalid(
            OP,
            format!(
                "logits must be a float [.., C] tensor, got {} {}",
                logits.dtype(),
                logits.shape()
            ),
        ));
    }
    let c = logits.dims()[logits.rank() - 1];
    let lead = logits.dims()[..logits.rank() - 1].to_vec();
    let mut x = logits
        .reshape([logits.elem_count() / c.max(1), c])?
        .mul_scalar(1.0 / temperature)?;
    if let Some(k) = top_k.filter(|&k| k < c) {
        x = keep_top_k(&x, k)?;
    }
    let probs = x.softmax(-1)?;
    multinomial_as(OP, generator, &probs, 1, true)?.reshape(lead)
}

/// `x` `[rows, C]` with every entry below its row's `k`-th largest set to `-inf` (ties with the
/// `k`-th largest kept). The `k`-th largest is found by retiring the row maximum `k - 1` times,
/// one occurrence at a time (as `topk` counts ties), on the device.
fn keep_top_k<B: Backend>(x: &Tensor<B>, k: usize) -> Result<Tensor<B>> {
    let c = x.dims()[1];
    let cols = Tensor::<B>::arange(0.0, c as f64, 1.0, DType::I64, x.device())?.reshape([1, c])?;
    let neg_inf = Tensor::<B>::full(Shape::scalar(), f64::NEG_INFINITY, x.dtype(), x.device())?;
    let mut rest = x.clone();
    for _ in 1..k {
        let i = rest.argmax(-1, true)?;
        rest = cols.eq(&i)?.where_cond(&neg_inf, &rest)?;
    }
    let kth = rest.max(&[-1], true)?;
    x.compare(CmpOp::Lt, &kth)?.where_cond(&neg_inf, x)
}
