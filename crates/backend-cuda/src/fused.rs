//! Multi-tensor optimizer updates ([`kiln_core::Backend::fused_update`]).
//!
//! The composed default runs several kernels per parameter per step; here one launch of
//! `kernels/optim.cu` updates up to [`MT_MAX`] parameters, so a model's whole update is a
//! handful of launches. Every pointer and offset travels by value in [`MtArgs`].

use kiln_core::{DType, Error, Result, UpdateRule, UpdateSlot};

use crate::launch::Args;
use crate::memory::{Buffer, alloc};
use crate::sources::Module;

/// Parameters per launch; matches `KILN_MT_MAX` in `kernels/optim.cu`.
pub(crate) const MT_MAX: usize = 24;
const BLOCK: u32 = 256;

/// Mirrors `struct MtArgs` in `kernels/optim.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MtArgs {
    param: [u64; MT_MAX],
    grad: [u64; MT_MAX],
    s0: [u64; MT_MAX],
    s1: [u64; MT_MAX],
    out_param: [u64; MT_MAX],
    out_s0: [u64; MT_MAX],
    out_s1: [u64; MT_MAX],
    start: [u64; MT_MAX + 1],
    count: i32,
}

type Updated = (Buffer, Vec<Buffer>);

pub(crate) fn fused_update(
    rule: &UpdateRule,
    dtype: DType,
    slots: &[UpdateSlot<'_, Buffer>],
) -> Result<Vec<Updated>> {
    const OP: &str = "fused_update";
    let suffix = suffix(OP, dtype)?;
    let Some(first) = slots.first() else {
        return Ok(Vec::new());
    };
    let dev = first.param.state();
    dev.bind()?;
    let nstate = rule.state_count();
    let size = dtype.size_in_bytes();
    let mut outs = Vec::with_capacity(slots.len());
    for s in slots {
        let st = (0..nstate)
            .map(|_| alloc(dev, s.len * size))
            .collect::<Result<Vec<_>>>()?;
        outs.push((alloc(dev, s.len * size)?, st));
    }
    let targets: Vec<(&Buffer, Vec<&Buffer>)> = outs
        .iter()
        .map(|(p, st)| (p, st.iter().collect()))
        .collect();
    launch(rule, suffix, slots, &targets)?;
    Ok(outs)
}

/// [`fused_update`] writing into each parameter's and state's own buffer (the kernels read an
/// element before writing it, so in place is exact): how a captured CUDA graph updates a
/// model, since each replay must start from the previous one's parameters (`graph.rs`).
/// Refuses what a graph would freeze: Adam's bias correction (a function of the step count)
/// and SGD's first momentum step.
pub(crate) fn fused_update_in_place(
    rule: &UpdateRule,
    dtype: DType,
    slots: &[UpdateSlot<'_, Buffer>],
) -> Result<()> {
    const OP: &str = "fused_update";
    let frozen = match *rule {
        UpdateRule::Adam { .. } => Some(
            "Adam's bias correction depends on the step count, which a graph would freeze: \
             capture SGD, or run Adam outside the graph",
        ),
        UpdateRule::Sgd {
            momentum,
            first_step: true,
            ..
        } if momentum != 0.0 => Some(
            "SGD's first momentum step initializes the buffer, which every replay would \
             repeat: take one step before capturing",
        ),
        UpdateRule::Sgd { .. } => None,
    };
    if let Some(why) = frozen {
        return Err(Error::invalid(
            OP,
            format!("under CUDA graph capture: {why}"),
        ));
    }
    let suffix = suffix(OP, dtype)?;
    let targets: Vec<(&Buffer, Vec<&Buffer>)> =
        slots.iter().map(|s| (s.param, s.state.clone())).collect();
    launch(rule, suffix, slots, &targets)
}

fn suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        _ => Err(Error::DTypeMismatch {
            op,
            expected: "f32 or f64".into(),
            got: dtype,
        }),
    }
}

/// Launches the update of `slots` into `outs` (new parameter, new states per slot).
fn launch(
    rule: &UpdateRule,
    suffix: &'static str,
    slots: &[UpdateSlot<'_, Buffer>],
    outs: &[(&Buffer, Vec<&Buffer>)],
) -> Result<()> {
    const OP: &str = "fused_update";
    let Some(first) = slots.first() else {
        return Ok(());
    };
    let dev = first.param.state();
    dev.bind()?;
    let nstate = rule.state_count();
    let kernel: &[&'static str] = match rule {
        UpdateRule::Sgd { .. } => &["sgd", suffix],
        UpdateRule::Adam { .. } => &["adam", suffix],
    };
    let f = dev.func(Module::Optim, kernel)?;
    for (chunk, out_chunk) in slots.chunks(MT_MAX).zip(outs.chunks(MT_MAX)) {
        let mut a = MtArgs {
            param: [0; MT_MAX],
            grad: [0; MT_MAX],
            s0: [0; MT_MAX],
            s1: [0; MT_MAX],
            out_param: [0; MT_MAX],
            out_s0: [0; MT_MAX],
            out_s1: [0; MT_MAX],
            start: [0; MT_MAX + 1],
            count: chunk.len() as i32,
        };
        for (k, (s, (p, st))) in chunk.iter().zip(out_chunk).enumerate() {
            if s.param.device() != first.param.device() {
                return Err(Error::DeviceMismatch {
                    op: OP,
                    lhs: first.param.device().to_string(),
                    rhs: s.param.device().to_string(),
                });
            }
            a.param[k] = s.param.device_ptr();
            a.grad[k] = s.grad.device_ptr();
            a.out_param[k] = p.device_ptr();
            if nstate > 0 {
                a.s0[k] = s.state[0].device_ptr();
                a.out_s0[k] = st[0].device_ptr();
            }
            if nstate > 1 {
                a.s1[k] = s.state[1].device_ptr();
                a.out_s1[k] = st[1].device_ptr();
            }
            a.start[k + 1] = a.start[k] + s.len as u64;
        }
        let total = a.start[chunk.len()];
        let mut args = Args::new();
        args.push(a);
        match *rule {
            UpdateRule::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
                first_step,
            } => {
                args.push(lr)
                    .push(momentum)
                    .push(dampening)
                    .push(nesterov as i32)
                    .push(weight_decay)
                    .push(first_step as i32);
            }
            UpdateRule::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
                bias_correction1,
                bias_correction2,
            } => {
                args.push(lr)
                    .push(beta1)
                    .push(beta2)
                    .push(eps)
                    .push(weight_decay)
                    .push(decoupled as i32)
                    .push(bias_correction1)
                    .push(bias_correction2);
            }
        }
        dev.launch(OP, f, dev.grid_1d(total, BLOCK), BLOCK, 0, args.ptrs())?;
    }
    Ok(())
}
