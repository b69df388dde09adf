//! Losses, as `torch.nn.functional`'s: each takes a [`Reduction`] (PyTorch's `reduction=`;
//! [`Reduction::Mean`], the default there, gives the 0-d [`Var`] ready for `backward`).
//! Targets are plain tensors: they never need a gradient.

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Reduction, Result, Tensor};

/// Softmax cross-entropy of logits `[n, c]` against `i64` class labels `[n]`
/// (`torch.nn.functional.cross_entropy`): [`Var::cross_entropy`]. Fused: log-softmax and the
/// loss are one kernel forward, and the backward is one kernel (`softmax - onehot`), never a
/// materialized probability matrix followed by a log. A label outside `0..c` is
/// [`Error::IndexOutOfRange`].
pub fn cross_entropy<B: Backend>(
    logits: &Var<B>,
    labels: &Tensor<B>,
    reduction: Reduction,
) -> Result<Var<B>> {
    logits.cross_entropy(labels, reduction)
}

/// Squared error `(pred - target)²`, reduced (`torch.nn.functional.mse_loss`).
/// Under autocast a 16-bit `pred` is cast to f32 first (PyTorch's `mse_loss` is on autocast's
/// f32 list), so an f32 target fits it.
pub fn mse<B: Backend>(pred: &Var<B>, target: &Tensor<B>, reduction: Reduction) -> Result<Var<B>> {
    let pred = &pred.autocast_f32()?;
    check_same_shape("mse", pred, target)?;
    let sq = pred.sub(&Var::constant(target.clone()))?.square()?;
    match reduction {
        Reduction::None => Ok(sq),
        Reduction::Mean => sq.mean_all(),
        Reduction::Sum => sq.sum_all(),
    }
}

/// Binary cross-entropy on logits, `max(x, 0) - x t + log(1 + exp(-|x|))` per element, reduced
/// (`torch.nn.functional.binary_cross_entropy_with_logits`): numerically stable for any `x`,
/// with the exact gradient `sigmoid(x) - t` (over `n` for the mean), including at `x = 0`.
/// Targets are probabilities in `[0, 1]` of the logits' shape and dtype (f32 under autocast,
/// where 16-bit logits are cast to f32).
pub fn bce_with_logits<B: Backend>(
    logits: &Var<B>,
    target: &Tensor<B>,
    reduction: Reduction,
) -> Result<Var<B>> {
    // Autocast's f32 list: 16-bit logits are cast up first (a no-op outside autocast).
    let logits = &logits.autocast_f32()?;
    check_same_shape("bce_with_logits", logits, target)?;
    let x = logits.tensor();
    let scale = reduction.grad_scale(x.elem_count().max(1));
    let per = x
        .relu()?
        .sub(&x.mul(target)?)?
        .add(&x.abs()?.neg()?.exp()?.add_scalar(1.0)?.log()?)?;
    let y = reduction.apply(&per)?;
    let t = target.clone();
    Ok(Var::from_op(
        "bce_with_logits",
        &[logits],
        y,
        move |g, _| {
            let gx = x
                .sigmoid()?
                .sub(&t)?
                .mul(&g.broadcast_to(x.shape().clone())?)?;
            Ok(vec![Some(gx.mul_scalar(scale)?)])
        },
    ))
}

fn check_same_shape<B: Backend>(op: &'static str, v: &Var<B>, t: &Tensor<B>) -> Result<()> {
    if &v.shape() != t.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: v.shape(),
            rhs: t.shape().clone(),
        });
    }
    if v.dtype() != t.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: v.dtype().to_string(),
            got: t.dtype(),
        });
    }
    Ok(())
}

/// How many rows of `logits` `[n, c]` have their arg-max equal to the `i64` label `[n]`.
/// One small read back from the device.
pub fn correct_count<B: Backend>(logits: &Tensor<B>, labels: &Tensor<B>) -> Result<usize> {
    if logits.rank() != 2 || labels.dims() != [logits.dims()[0]] || labels.dtype() != DType::I64 {
        return Err(Error::invalid(
            "accuracy",
            format!(
                "expects logits [n, c] and i64 labels [n], got {} and {} {}",
                logits.shape(),
                labels.dtype(),
                labels.shape()
            ),
        ));
    }
    if logits.dims()[0] == 0 {
        return Ok(0);
    }
    let hits = logits.argmax(-1, false)?.eq(labels)?.to_dtype(DType::I64)?;
    Ok(hits.sum_all()?.to_scalar()? as usize)
}

/// The fraction of rows whose arg-max equals the label (0 for an empty batch).
pub fn accuracy<B: Backend>(logits: &Tensor<B>, labels: &Tensor<B>) -> Result<f64> {
    let n = logits.dims().first().copied().unwrap_or(0);
    let c = correct_count(logits, labels)?;
    Ok(if n == 0 { 0.0 } else { c as f64 / n as f64 })
}
