//! Multi-tensor updates through [`Tensor::fused_update`].
//!
//! Updating parameter by parameter costs one kernel launch per term of the formula per tensor
//! (Adam: about 13 ops, so about 80 launches for a 3-layer MLP), which dominates a small
//! model's step on a GPU. [`Tensor::fused_update`] takes every parameter, gradient and state
//! buffer of one device and dtype and applies the whole update in one backend call: the CUDA
//! backend runs it as one multi-tensor kernel per batch of parameters (a handful of launches
//! for the whole model); on other backends its default evaluates the rule's expression program
//! ([`kiln_core::UpdateRule::program`]) once per parameter, fused where the backend fuses
//! programs (the CPU). The formulas exist only there: the optimizers build an
//! [`kiln_core::UpdateRule`] and never compose the update from tensor ops themselves
//! (PyTorch's `foreach` / `fused` optimizers play the same role).
//!
//! One call covers parameters that share a device, a dtype and the scalars of the update rule,
//! so parameters are grouped: by step count for Adam (the bias correction depends on it), by
//! whether the momentum buffer exists yet for SGD. In ordinary training every parameter has a
//! gradient at every step and there is one group.

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Tensor};

/// One parameter of a group: its index, current value and gradient.
pub(crate) struct Member<B: Backend> {
    pub index: usize,
    pub value: Tensor<B>,
    pub grad: Tensor<B>,
}

/// A group under construction: (device, dtype, key) and its members.
type Keyed<B, K> = ((<B as Backend>::Device, DType, K), Vec<Member<B>>);

/// The parameters that have a gradient, grouped by device, dtype and `key(index)`, in order of
/// first appearance.
pub(crate) fn groups<B: Backend, K: PartialEq + Copy>(
    params: &[Var<B>],
    key: impl Fn(usize) -> K,
) -> Vec<(K, Vec<Member<B>>)> {
    let mut out: Vec<Keyed<B, K>> = Vec::new();
    for (index, p) in params.iter().enumerate() {
        let Some(grad) = p.grad() else { continue };
        let value = p.tensor();
        let k = (value.device().clone(), value.dtype(), key(index));
        let member = Member { index, value, grad };
        match out.iter_mut().find(|(gk, _)| *gk == k) {
            Some((_, v)) => v.push(member),
            None => out.push((k, vec![member])),
        }
    }
    out.into_iter().map(|((_, _, k), v)| (k, v)).collect()
}
