//! The optimizers' multi-tensor update over storage handles ([`kiln_core::Backend::fused_update`]):
//! forces each operand to a computed buffer, then runs `fused.rs`'s kernels — in place while a
//! CUDA graph is being captured (the graph updates the parameters where they are), into fresh
//! buffers otherwise.

use std::sync::Arc;

use kiln_core::{DType, Result, UpdateRule, UpdateSlot};

use crate::memory::Buffer;
use crate::{CudaStorage, fused, lazy};

pub(crate) fn fused_update(
    rule: &UpdateRule,
    dtype: DType,
    slots: &[UpdateSlot<'_, CudaStorage>],
    grad_scale: Option<&CudaStorage>,
) -> Result<Vec<(CudaStorage, Vec<CudaStorage>)>> {
    let scale = grad_scale.map(|s| s.buffer()).transpose()?;
    let scale = scale.as_deref();
    // Computed buffers for every operand, held while the kernel's slots borrow them.
    type Held = (Arc<Buffer>, Arc<Buffer>, Vec<Arc<Buffer>>);
    let held = slots
        .iter()
        .map(|s| -> Result<Held> {
            let st = s.state.iter().map(|x| x.buffer()).collect::<Result<_>>()?;
            Ok((s.param.buffer()?, s.grad.buffer()?, st))
        })
        .collect::<Result<Vec<_>>>()?;
    let bslots: Vec<UpdateSlot<'_, Buffer>> = held
        .iter()
        .zip(slots)
        .map(|((p, g, st), s)| UpdateSlot {
            param: &**p,
            grad: &**g,
            state: st.iter().map(|x| &**x).collect(),
            len: s.len,
        })
        .collect();
    if bslots.first().is_some_and(|s| s.param.state().capturing()) {
        // A captured graph updates the parameters where they are (see `graph.rs`).
        fused::fused_update_in_place(rule, dtype, &bslots, scale)?;
        return Ok(held
            .iter()
            .map(|(p, _, st)| {
                p.contents_changed();
                let st = st
                    .iter()
                    .map(|b| {
                        b.contents_changed();
                        CudaStorage::from(lazy::Repr::Ready(b.clone()))
                    })
                    .collect();
                (CudaStorage::from(lazy::Repr::Ready(p.clone())), st)
            })
            .collect());
    }
    let out = fused::fused_update(rule, dtype, &bslots, scale)?;
    Ok(out
        .into_iter()
        .map(|(p, st)| {
            let st = st.into_iter().map(CudaStorage::ready).collect();
            (CudaStorage::ready(p), st)
        })
        .collect())
}
