//! Multi-tensor optimizer updates: validation, then one [`Backend::fused_update`] call.

use super::Tensor;
use crate::backend::{Backend, UnscaleSlot, UpdateRule, UpdateSlot};
use crate::{DType, Error, Result, Shape};

/// The new parameter and state tensors of one parameter after [`Tensor::fused_update`].
pub type Updated<B> = (Tensor<B>, Vec<Tensor<B>>);

impl<B: Backend> Tensor<B> {
    /// Applies `rule` to every parameter at once (see [`UpdateRule`] for the formulas):
    /// `params[i]` with gradient `grads[i]` and state `states[i]` (`rule.state_count()` tensors
    /// each, of the parameter's shape). Returns the new parameters and states; inputs are not
    /// modified. All tensors must share one device and one float dtype.
    ///
    /// On the GPU this is a handful of launches for all parameters together, instead of one
    /// launch per parameter per term of the formula.
    pub fn fused_update(
        rule: &UpdateRule,
        params: &[Self],
        grads: &[Self],
        states: &[Vec<Self>],
    ) -> Result<Vec<Updated<B>>> {
        Self::fused_update_scaled(rule, params, grads, states, None)
    }

    /// [`Tensor::fused_update`] of the gradients multiplied by `grad_scale` (when given: a
    /// tensor of one element, of the parameters' dtype and device), the multiply done inside
    /// the update's own pass ([`UpdateRule::program_scaled`]), as PyTorch's fused optimizers
    /// take a `grad_scale`. Gradient clipping's coefficient arrives this way
    /// (`Var::scale_grad`): the same update as multiplying every gradient first, without a pass
    /// (and on the GPU a launch) per gradient.
    pub fn fused_update_scaled(
        rule: &UpdateRule,
        params: &[Self],
        grads: &[Self],
        states: &[Vec<Self>],
        grad_scale: Option<&Self>,
    ) -> Result<Vec<Updated<B>>> {
        const OP: &str = "fused_update";
        if params.len() != grads.len() || params.len() != states.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} params, {} grads and {} states: need one of each per parameter",
                    params.len(),
                    grads.len(),
                    states.len()
                ),
            ));
        }
        let Some(first) = params.first() else {
            return Ok(Vec::new());
        };
        let dtype = first.dtype();
        first.require_float(OP)?;
        // Contiguous copies where needed; kept alive while the slots borrow them.
        let mut owned: Vec<(Self, Self, Vec<Self>)> = Vec::with_capacity(params.len());
        for ((p, g), st) in params.iter().zip(grads).zip(states) {
            for t in std::iter::once(g).chain(st.iter()) {
                p.check_same_device(OP, t)?;
                if t.dtype() != dtype || p.dtype() != dtype {
                    return Err(Error::DTypeMismatch {
                        op: OP,
                        expected: dtype.to_string(),
                        got: if p.dtype() != dtype {
                            p.dtype()
                        } else {
                            t.dtype()
                        },
                    });
                }
                if t.shape() != p.shape() {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: p.shape().clone(),
                        rhs: t.shape().clone(),
                    });
                }
            }
            first.check_same_device(OP, p)?;
            if st.len() != rule.state_count() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{rule:?} needs {} state tensors per parameter, got {}",
                        rule.state_count(),
                        st.len()
                    ),
                ));
            }
            owned.push((
                p.contiguous()?,
                g.contiguous()?,
                st.iter().map(|t| t.contiguous()).collect::<Result<_>>()?,
            ));
        }
        if let Some(s) = grad_scale {
            first.check_factor(OP, "the gradients' scale", s)?;
        }
        let scale = grad_scale.map(|s| s.contiguous()).transpose()?;
        let slots: Vec<UpdateSlot<'_, B::Storage>> = owned
            .iter()
            .map(|(p, g, st)| UpdateSlot {
                param: p.storage(),
                grad: g.storage(),
                state: st.iter().map(|t| t.storage()).collect(),
                len: p.elem_count(),
            })
            .collect();
        let p = first.prof(OP, &[], false);
        let out = B::fused_update(rule, dtype, &slots, scale.as_ref().map(|s| s.storage()))?;
        drop(p);
        Ok(out
            .into_iter()
            .zip(params)
            .map(|((p, st), orig)| {
                let shape = orig.shape().clone();
                let st = st
                    .into_iter()
                    .map(|s| orig.fresh(s, shape.clone(), dtype))
                    .collect();
                (orig.fresh(p, shape.clone(), dtype), st)
            })
            .collect())
    }
}

impl<B: Backend> Tensor<B> {
    /// Unscales the gradients of dynamic loss scaling and checks them for inf/NaN at once:
    /// returns `grads[i] · inv_scale` (new tensors of the same shape and dtype, computed in f32
    /// for the 16-bit floats and rounded once) and a 0-d f32 flag on their device, `0` when
    /// every unscaled element is finite and [`FOUND_NON_FINITE`](crate::FOUND_NON_FINITE) (`1`) otherwise. Nothing is
    /// read back to the host. All gradients must share one device and one float dtype, and
    /// there must be at least one (the flag lives on their device).
    ///
    /// On the GPU this is one multi-tensor kernel (and a memset of the flag) for up to 128
    /// gradients per launch, where the composed form is a multiply and a reduction per gradient.
    pub fn unscale_check(grads: &[Self], inv_scale: f64) -> Result<(Vec<Self>, Self)> {
        const OP: &str = "unscale_check";
        let owned =
            Self::multi_operands(OP, grads, "no gradients: the flag lives on their device")?;
        if !inv_scale.is_finite() {
            return Err(Error::invalid(
                OP,
                format!("the inverse scale must be finite, got {inv_scale}"),
            ));
        }
        let (first, dtype) = (&owned[0], owned[0].dtype());
        let slots = Self::multi_slots(&owned);
        let p = first.prof(OP, &[], false);
        let (outs, flag) = B::unscale_check(dtype, inv_scale, &slots)?;
        drop(p);
        if outs.len() != grads.len() {
            return Err(Error::backend(
                OP,
                format!("{} outputs for {} gradients", outs.len(), grads.len()),
            ));
        }
        let outs = outs
            .into_iter()
            .zip(grads)
            .map(|(s, g)| g.fresh(s, g.shape().clone(), dtype))
            .collect();
        Ok((outs, first.fresh(flag, Shape::scalar(), DType::F32)))
    }

    /// The sum of the squares of every element of `tensors`, accumulated in f64, as a 0-d f64
    /// tensor on their device, with no synchronization: the square of their global L2 norm,
    /// as gradient clipping takes it. All tensors must share one device and one float dtype,
    /// and there must be at least one.
    ///
    /// On the GPU this is one multi-tensor kernel and one fold for up to 128 tensors per
    /// launch, where the composed form is a reduction (two launches) per tensor.
    pub fn sq_sum(tensors: &[Self]) -> Result<Self> {
        const OP: &str = "sq_sum";
        let owned = Self::multi_operands(OP, tensors, "no tensors: the sum lives on their device")?;
        let (first, dtype) = (&owned[0], owned[0].dtype());
        let slots = Self::multi_slots(&owned);
        let p = first.prof(OP, &[], false);
        let sum = B::sq_sum(dtype, &slots)?;
        drop(p);
        Ok(first.fresh(sum, Shape::scalar(), DType::F64))
    }

    /// The operands of a multi-tensor op `op` ([`Tensor::unscale_check`], [`Tensor::sq_sum`]):
    /// `tensors` made contiguous, after checking that there is at least one (`empty`: the
    /// error's text otherwise) and that all share the first one's float dtype and device.
    fn multi_operands(op: &'static str, tensors: &[Self], empty: &str) -> Result<Vec<Self>> {
        let Some(first) = tensors.first() else {
            return Err(Error::invalid(op, empty));
        };
        first.require_float(op)?;
        let dtype = first.dtype();
        tensors
            .iter()
            .map(|t| {
                first.check_same_device(op, t)?;
                if t.dtype() != dtype {
                    return Err(Error::DTypeMismatch {
                        op,
                        expected: dtype.to_string(),
                        got: t.dtype(),
                    });
                }
                t.contiguous()
            })
            .collect()
    }

    /// One [`UnscaleSlot`] per contiguous tensor of [`Tensor::multi_operands`].
    fn multi_slots(owned: &[Self]) -> Vec<UnscaleSlot<'_, B::Storage>> {
        owned
            .iter()
            .map(|t| UnscaleSlot {
                grad: t.storage(),
                len: t.elem_count(),
            })
            .collect()
    }
}
