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
//!
//! # Master weights for 16-bit parameters
//!
//! A parameter stored in f16 or bf16 is updated through an f32 *master copy* ([`Masters`],
//! PyTorch's `master_weights`, llm.c's fp32 copy): the update rule reads the master and the
//! gradient cast to f32, its state (momentum, Adam's moments) is f32, and the parameter
//! receives the new master rounded to its dtype. Without it, an update smaller than half an
//! ulp of the weight (bf16 has 8 significant bits: any `lr · g` below 0.4 % of the weight)
//! rounds away and training stalls. The master is created from the parameter at its first
//! step and used while the parameter still holds the very tensor the optimizer last wrote;
//! if anything else replaced it (`set_tensor`, a move to another device), the master is
//! taken again from the new value. f32 and f64 parameters have no master and cost nothing.
//!
//! Masters are part of the saved optimizer state, as `"{index}.master_weight"` (f32, the
//! parameter's shape; `state.rs`), so a resumed run continues from the f32 weights, not
//! from their 16-bit rounding. A loaded master is *pending* until the parameter's next step:
//! then it is used only if it rounds, bit for bit, to the parameter's current value (one
//! comparison on the device and one host read per step that settles pending masters, once
//! after a load). That check makes the order of loading the model and the optimizer state
//! irrelevant (loading a model replaces its tensors, which would otherwise look like a
//! foreign write) and drops, safely, a master that belongs to other weights. A state written
//! before masters were saved, or a dropped master, falls back to widening the parameter, as
//! at a first step.

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Result, Tensor};

/// One parameter of a group: its index, current value and gradient.
pub(crate) struct Member<B: Backend> {
    pub index: usize,
    pub value: Tensor<B>,
    pub grad: Tensor<B>,
}

/// A group under construction: (device, dtype, key), its gradients' scale and its members.
type Keyed<B, K> = (
    (<B as Backend>::Device, DType, K),
    Option<Tensor<B>>,
    Vec<Member<B>>,
);

/// The f32 master of one 16-bit parameter.
#[derive(Clone)]
enum Master<B: Backend> {
    /// Written by this optimizer: the master and the 16-bit tensor last written from it.
    Live {
        master: Tensor<B>,
        written: Tensor<B>,
    },
    /// Loaded from saved state and not yet matched against the parameter (module docs).
    Pending(Tensor<B>),
}

/// The f32 master copies of an optimizer's 16-bit parameters (module docs), by parameter
/// index.
pub(crate) struct Masters<B: Backend>(Vec<Option<Master<B>>>);

impl<B: Backend> Masters<B> {
    pub fn new(n: usize) -> Self {
        Masters(vec![None; n])
    }

    /// Parameter `index`'s live master, if the parameter still holds `t`, the very tensor this
    /// optimizer last wrote from it.
    fn live(&self, index: usize, t: &Tensor<B>) -> Option<&Tensor<B>> {
        match &self.0[index] {
            Some(Master::Live { master, written })
                if written.same_storage(t) && written.layout() == t.layout() =>
            {
                Some(master)
            }
            _ => None,
        }
    }

    /// The value the update reads for parameter `index`: its master (f32) when the parameter
    /// is 16-bit, the parameter itself otherwise. Pending masters must have been settled.
    fn value(&self, index: usize, p: &Var<B>) -> Result<Tensor<B>> {
        let t = p.tensor();
        if !t.dtype().is_half() {
            return Ok(t);
        }
        match self.live(index, &t) {
            Some(master) => Ok(master.clone()),
            None => t.to_dtype(DType::F32),
        }
    }

    /// Turns the pending masters of `indices` into live ones where they round to their
    /// parameter's current value bit for bit, and drops the others (module docs). One host
    /// read for all of them; nothing when none is pending.
    fn settle(&mut self, params: &[Var<B>], indices: &[usize]) -> Result<()> {
        let mut checked = Vec::new();
        let mut flags = Vec::new();
        for &i in indices {
            let Some(Master::Pending(m)) = &self.0[i] else {
                continue;
            };
            let t = params[i].tensor();
            if !t.dtype().is_half() || m.shape() != t.shape() {
                self.0[i] = None;
                continue;
            }
            let m = m.to_device(t.device())?;
            // 1 when some element differs (NaN included), else 0; on the first device, so the
            // flags of parameters on several devices are read back together.
            let differs = m
                .to_dtype(t.dtype())?
                .ne(&t)?
                .max_all()?
                .to_dtype(DType::F32)?;
            let first = flags.first().map(|f: &Tensor<B>| f.device().clone());
            flags.push(match first {
                Some(d) => differs.to_device(&d)?,
                None => differs,
            });
            checked.push((i, m, t));
        }
        if checked.is_empty() {
            return Ok(());
        }
        let differs = Tensor::stack(&flags, 0)?.to_f64_vec()?;
        for ((i, master, written), d) in checked.into_iter().zip(differs) {
            self.0[i] = (d == 0.0).then_some(Master::Live { master, written });
        }
        Ok(())
    }

    /// Writes the updated value `w` (in the master's dtype) to parameter `index`.
    pub fn write(&mut self, index: usize, p: &Var<B>, w: Tensor<B>) -> Result<()> {
        let dtype = p.dtype();
        if dtype == w.dtype() {
            return p.set_tensor(w);
        }
        let rounded = w.to_dtype(dtype)?;
        p.set_tensor(rounded.clone())?;
        w.realize()?;
        self.0[index] = Some(Master::Live {
            master: w,
            written: rounded,
        });
        Ok(())
    }

    /// The master to save for parameter `index`: a live one that still matches the
    /// parameter, or a pending one as it was loaded; `None` when the next step would widen
    /// the parameter anyway.
    pub fn saved(&self, index: usize, p: &Var<B>) -> Option<Tensor<B>> {
        match &self.0[index] {
            Some(Master::Pending(m)) => Some(m.clone()),
            _ => self.live(index, &p.tensor()).cloned(),
        }
    }

    /// Sets parameter `index`'s master from a loaded state: pending until its next step, or
    /// none (the parameter will be widened).
    pub fn load(&mut self, index: usize, master: Option<Tensor<B>>) {
        self.0[index] = master.map(Master::Pending);
    }
}

/// The parameters that have a gradient, grouped by device, dtype, `key(index)` and the factor
/// their gradient is still to be multiplied by ([`Var::scale_grad`], gradient clipping's
/// coefficient: the update applies it, [`Tensor::fused_update_scaled`]), in order of first
/// appearance. A 16-bit parameter's member holds its f32 master and its gradient cast to f32
/// (module docs), its group the factor cast to f32 (once per factor).
#[allow(clippy::type_complexity)]
pub(crate) fn groups<B: Backend, K: PartialEq + Copy>(
    params: &[Var<B>],
    masters: &mut Masters<B>,
    key: impl Fn(usize) -> K,
) -> Result<Vec<(K, Option<Tensor<B>>, Vec<Member<B>>)>> {
    let stepped: Vec<usize> = (0..params.len())
        .filter(|&i| params[i].has_grad())
        .collect();
    masters.settle(params, &stepped)?;
    let mut out: Vec<Keyed<B, K>> = Vec::new();
    // Each factor as given and in the dtype of the values it scales.
    let mut cast: Vec<(Tensor<B>, Tensor<B>)> = Vec::new();
    for (index, p) in params.iter().enumerate() {
        let Some((grad, factor)) = p.grad_parts() else {
            continue;
        };
        let value = masters.value(index, p)?;
        let grad = grad.to_dtype(value.dtype())?;
        let factor = factor
            .map(|f| in_dtype(&mut cast, f, value.dtype()))
            .transpose()?;
        let same = |g: &Option<Tensor<B>>| match (g, &factor) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same_storage(b),
            _ => false,
        };
        let k = (value.device().clone(), value.dtype(), key(index));
        let member = Member { index, value, grad };
        match out.iter_mut().find(|(gk, f, _)| *gk == k && same(f)) {
            Some((_, _, v)) => v.push(member),
            None => out.push((k, factor, vec![member])),
        }
    }
    Ok(out.into_iter().map(|((_, _, k), f, v)| (k, f, v)).collect())
}

/// Factor `f` in `dtype`, converted once per factor (`cast` holds the conversions made, each
/// with the factor it came from), so that parameters scaled by one factor stay one group.
fn in_dtype<B: Backend>(
    cast: &mut Vec<(Tensor<B>, Tensor<B>)>,
    f: Tensor<B>,
    dtype: DType,
) -> Result<Tensor<B>> {
    if let Some((_, b)) = cast
        .iter()
        .find(|(a, b)| a.same_storage(&f) && b.dtype() == dtype)
    {
        return Ok(b.clone());
    }
    let b = f.to_dtype(dtype)?;
    cast.push((f, b.clone()));
    Ok(b)
}
