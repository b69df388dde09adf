//! Gradient clipping, as `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_`.
//!
//! # No host round trip
//!
//! [`clip_grad_norm`] never reads a value back: the global norm is summed on the device into a
//! 0-d tensor, the coefficient `min(1, max_norm / (norm + 1e-6))` is computed from it on the
//! device, and every gradient is multiplied by it (by 1 when no clipping is needed), so a GPU
//! training step that clips does not wait for the GPU. The multiply is lazy
//! ([`Var::scale_grad`]): `grad()` reads the clipped gradient, and kiln's optimizers apply the
//! coefficient inside their update instead of a pass (a launch on the GPU) per gradient.
//! Reading the returned norm (to log it) is the caller's choice, and the only
//! synchronization. [`grad_norm`] is that read: the same norm as an `f64`, one
//! synchronization per call (not one per parameter).
//!
//! The norm is accumulated in f64 whatever the gradients' dtype, with one [`Tensor::sq_sum`]
//! per device and dtype (on a GPU one multi-tensor kernel for all of them, not a reduction per
//! parameter: the GPT example's 39 gradients took ~80 launches). Parameters on several devices
//! (model parallelism) are summed onto the first one's device, and the coefficient is copied to
//! each other device (a device-to-device copy of one number).

use kiln_autograd::Var;
use kiln_core::{Backend, CmpOp, DType, Error, Result, Tensor};

/// The L2 norm of all gradients together, as if concatenated into one vector, as a 0-d f64
/// tensor on the first parameter's device (0 when no parameter has a gradient), with no
/// synchronization. `None` when `params` is empty and no device is known.
pub fn grad_norm_tensor<B: Backend>(params: &[Var<B>]) -> Result<Option<Tensor<B>>> {
    // Gradients grouped by device and dtype, in the order their groups first appear: one
    // `Tensor::sq_sum` per group (one multi-tensor pass on a GPU).
    let mut groups: Vec<Vec<Tensor<B>>> = Vec::new();
    for p in Var::unique(params.iter().cloned()) {
        let Some(g) = p.grad() else { continue };
        match groups
            .iter_mut()
            .find(|k| k[0].device() == g.device() && k[0].dtype() == g.dtype())
        {
            Some(k) => k.push(g),
            None => groups.push(vec![g]),
        }
    }
    let mut total: Option<Tensor<B>> = None;
    for grads in &groups {
        let sq = Tensor::sq_sum(grads)?;
        total = Some(match total {
            None => sq,
            Some(t) => t.add(&sq.to_device(t.device())?)?,
        });
    }
    let total = match (total, params.first()) {
        (Some(t), _) => t,
        (None, Some(p)) => Tensor::zeros([], DType::F64, &p.device())?,
        (None, None) => return Ok(None),
    };
    Ok(Some(total.sqrt()?))
}

/// The L2 norm of all gradients together, read back as an `f64` (0 when no parameter has a
/// gradient): [`grad_norm_tensor`] plus one synchronization. A parameter given twice (tied) is
/// counted once.
pub fn grad_norm<B: Backend>(params: &[Var<B>]) -> Result<f64> {
    match grad_norm_tensor(params)? {
        Some(t) => t.to_scalar(),
        None => Ok(0.0),
    }
}

/// Scales all gradients by `min(1, max_norm / (norm + 1e-6))` and returns the global norm
/// before clipping as a 0-d f64 tensor on the first parameter's device (log it: a jump says
/// training diverges), all on the device with no synchronization (see the module docs). A
/// non-finite norm leaves the gradients as they are (scaled by 1), so the caller can check the
/// returned norm and skip the step. A parameter given twice (tied) is counted and scaled once.
/// With no parameters, the norm is a 0-d zero on the backend's first device.
pub fn clip_grad_norm<B: Backend>(params: &[Var<B>], max_norm: f64) -> Result<Tensor<B>> {
    const OP: &str = "clip_grad_norm";
    crate::check_hyper(OP, "max_norm", max_norm, |v| v >= 0.0, ">= 0")?;
    let Some(norm) = grad_norm_tensor(params)? else {
        let dev = B::devices()
            .into_iter()
            .next()
            .ok_or_else(|| Error::invalid(OP, "no parameters and no device"))?;
        return Tensor::zeros([], DType::F64, &dev);
    };
    let one = Tensor::<B>::ones([], DType::F64, norm.device())?;
    // max_norm / (norm + 1e-6), at most 1; 1 where the norm is NaN or infinite.
    let coef = norm
        .add_scalar(1e-6)?
        .recip()?
        .mul_scalar(max_norm)?
        .minimum_scalar(1.0)?;
    let coef = norm
        .compare_scalar(CmpOp::Lt, f64::INFINITY)?
        .where_cond(&coef, &one)?;
    // The coefficient in the gradients' device and dtype, converted once for all of them
    // (again only where a parameter lives elsewhere), handed to each gradient as a factor the
    // optimizer's update applies (`Var::scale_grad`): no pass over the gradients here.
    let mut c = coef.clone();
    for p in Var::unique(params.iter().cloned()) {
        if let Some((g, _)) = p.grad_parts() {
            if c.device() != g.device() || c.dtype() != g.dtype() {
                c = coef.to_device(g.device())?.to_dtype(g.dtype())?;
            }
            p.scale_grad(&c)?;
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
