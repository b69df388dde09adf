//! Multi-tensor optimizer updates: validation, then one [`Backend::fused_update`] call.

use super::Tensor;
use crate::backend::{Backend, UpdateRule, UpdateSlot};
use crate::{Error, Result};

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
        let out = B::fused_update(rule, dtype, &slots)?;
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
