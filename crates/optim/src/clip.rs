//! Gradient clipping, as `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_`.
//!
//! The global norm is summed on the device(s) and read back once (one synchronization per
//! call, not one per parameter).

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Result, Tensor};

/// The L2 norm of all gradients together, as if concatenated into one vector (0 when no
/// parameter has a gradient). Computed in f64.
pub fn grad_norm<B: Backend>(params: &[Var<B>]) -> Result<f64> {
    let mut total: Option<Tensor<B>> = None;
    for p in params {
        let Some(g) = p.grad() else { continue };
        let sq = g.to_dtype(DType::F64)?.square()?.sum_all()?;
        total = Some(match total {
            None => sq,
            // Parameters may live on several devices (model parallelism): gather onto the
            // first one; these are single numbers.
            Some(t) => t.add(&sq.to_device(t.device())?)?,
        });
    }
    match total {
        None => Ok(0.0),
        Some(t) => Ok(t.to_scalar()?.sqrt()),
    }
}

/// Scales all gradients by `max_norm / (norm + 1e-6)` when the global norm exceeds `max_norm`,
/// and returns the norm before clipping (log it: a jump says training diverges). A non-finite
/// norm is returned as is and the gradients are left alone, so the caller can skip the step.
pub fn clip_grad_norm<B: Backend>(params: &[Var<B>], max_norm: f64) -> Result<f64> {
    crate::check_hyper("clip_grad_norm", "max_norm", max_norm, |v| v >= 0.0, ">= 0")?;
    let norm = grad_norm(params)?;
    let coef = max_norm / (norm + 1e-6);
    if norm.is_finite() && coef < 1.0 {
        for p in params {
            if let Some(g) = p.grad() {
                p.set_grad(Some(g.mul_scalar(coef)?))?;
            }
        }
    }
    Ok(norm)
}

/// Clamps every gradient element into `[-clip, clip]`.
pub fn clip_grad_value<B: Backend>(params: &[Var<B>], clip: f64) -> Result<()> {
    crate::check_hyper("clip_grad_value", "clip", clip, |v| v >= 0.0, ">= 0")?;
    for p in params {
        if let Some(g) = p.grad() {
            p.set_grad(Some(g.clamp(-clip, clip)?))?;
        }
    }
    Ok(())
}
