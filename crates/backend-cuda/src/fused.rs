//! Multi-tensor optimizer updates ([`kiln_core::Backend::fused_update`]).
//!
//! The composed default runs one evaluation per parameter per step; here one launch updates up
//! to [`MT_MAX`] parameters, so a model's whole update is a handful of launches. The
//! per-element arithmetic is not written here: it is the rule's own program
//! ([`UpdateRule::program`], the one the CPU and the reference evaluate), generated into a
//! multi-tensor kernel by [`codegen::multi_tensor_source`], compiled once per program (the
//! rule's flags and the dtype choose it; its hyperparameters are kernel arguments) and
//! memoized per device. Every pointer and offset travels by value in `MtArgs`. Against the
//! hand-written `optim.cu` it replaced (H200, 40 × 2.5M f32, BENCHMARKS.md 2026-11-27): SGD
//! with Nesterov 1.21× the GB/s, AdamW equal.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kiln_core::expr::Program;
use kiln_core::{DType, Error, Result, UpdateRule, UpdateSlot};

use crate::codegen::{self, KERNEL, MT_MAX};
use crate::device::{DeviceState, Func, KERNEL_EPOCH};
use crate::launch::Args;
use crate::memory::{Buffer, alloc};

const BLOCK: u32 = 256;

type Updated = (Buffer, Vec<Buffer>);

pub(crate) fn fused_update(
    rule: &UpdateRule,
    dtype: DType,
    slots: &[UpdateSlot<'_, Buffer>],
    grad_scale: Option<&Buffer>,
) -> Result<Vec<Updated>> {
    const OP: &str = "fused_update";
    check_dtype(OP, dtype)?;
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
    launch(rule, dtype, slots, grad_scale, &targets)?;
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
    grad_scale: Option<&Buffer>,
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
    check_dtype(OP, dtype)?;
    let targets: Vec<(&Buffer, Vec<&Buffer>)> =
        slots.iter().map(|s| (s.param, s.state.clone())).collect();
    launch(rule, dtype, slots, grad_scale, &targets)
}

/// The dtypes an update runs in (its parameters'). 16-bit parameters update in f32 inside the
/// kernel (the rule's widened program: 16-bit loads, f32 arithmetic, each stored value rounded
/// once), with their state in the parameters' dtype; f32 master weights and state are the
/// optimizer's choice above this (kiln-optim's master weights).
fn check_dtype(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(()),
        _ => Err(Error::DTypeMismatch {
            op,
            expected: "f32, f64, f16 or bf16".into(),
            got: dtype,
        }),
    }
}

/// The memo key of a multi-tensor kernel on a device (`DeviceState::generated_func`): the
/// program, and how many of its last inputs are single elements (a gradient scale).
#[derive(Clone, PartialEq, Eq, Hash)]
struct MtKey(Program, usize);

/// The program the multi-tensor kernel of rule program `rule` runs (16-bit parameters: f32
/// arithmetic, one rounding per stored value; the rule's program otherwise) and that kernel on
/// `dev`, whose last `scalars` inputs are single elements: memoized, else generated and
/// compiled (or loaded from the disk cache).
fn kernel(dev: &DeviceState, rule: &Arc<Program>, scalars: usize) -> Result<(Arc<Program>, Func)> {
    let epoch = KERNEL_EPOCH.load(Ordering::SeqCst);
    let recent = RECENT.with(|r| {
        (r.borrow().iter())
            .find(|e| e.0 == dev.ordinal() && e.1 == epoch && Arc::ptr_eq(&e.2, rule))
            .map(|e| (e.3.clone(), e.4))
    });
    if let Some(hit) = recent {
        return Ok(hit);
    }
    let program = Arc::new(rule.widened()?);
    // A handful of programs at most (the rules' flags times the dtypes): no budget.
    let key = MtKey((*program).clone(), scalars);
    let f = dev.generated_func(&key, usize::MAX, || {
        let src = codegen::multi_tensor_source(&program, scalars)?;
        let bin = crate::expr_run::build(&src, dev.arch(), crate::nvrtc::Flavor::Generated)?;
        let name = std::ffi::CString::new(KERNEL).map_err(|e| Error::backend("fused_update", e))?;
        Ok((bin, name))
    })?;
    let f =
        f.ok_or_else(|| Error::backend("fused_update", "internal: no kernel under no budget"))?;
    RECENT.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() == 4 {
            r.remove(0);
        }
        r.push((dev.ordinal(), epoch, rule.clone(), program.clone(), f));
    });
    Ok((program, f))
}

thread_local! {
    /// The kernels this thread used last, by (device, kernel-cache epoch, the rule's memoized
    /// program, compared by address), with the program each runs: a step finds its kernel
    /// without widening, cloning or comparing programs.
    #[allow(clippy::type_complexity)]
    static RECENT: RefCell<Vec<(usize, u64, Arc<Program>, Arc<Program>, Func)>> =
        const { RefCell::new(Vec::new()) };
}

/// Launches the update of `slots`, their gradients multiplied by `grad_scale`'s one element
/// when given, into `outs` (new parameter, new states per slot).
fn launch(
    rule: &UpdateRule,
    dtype: DType,
    slots: &[UpdateSlot<'_, Buffer>],
    grad_scale: Option<&Buffer>,
    outs: &[(&Buffer, Vec<&Buffer>)],
) -> Result<()> {
    const OP: &str = "fused_update";
    let Some(first) = slots.first() else {
        return Ok(());
    };
    let dev = first.param.state();
    dev.bind()?;
    let nstate = rule.state_count();
    let scalars = usize::from(grad_scale.is_some());
    let (program, params) = rule.program_scaled(dtype, grad_scale.is_some())?;
    let (program, f) = kernel(dev, &program, scalars)?;
    if let Some(s) = grad_scale
        && s.device() != first.param.device()
    {
        return Err(Error::DeviceMismatch {
            op: OP,
            lhs: first.param.device().to_string(),
            rhs: s.device().to_string(),
        });
    }
    // The inputs: [param, grad, state..., scale?].
    let n_in = 2 + nstate + scalars;
    for (chunk, out_chunk) in slots.chunks(MT_MAX).zip(outs.chunks(MT_MAX)) {
        for s in chunk {
            if s.param.device() != first.param.device() {
                return Err(Error::DeviceMismatch {
                    op: OP,
                    lhs: first.param.device().to_string(),
                    rhs: s.param.device().to_string(),
                });
            }
            if s.state.len() != nstate {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{} state buffers for a rule that keeps {nstate}",
                        s.state.len()
                    ),
                ));
            }
        }
        let lens: Vec<usize> = chunk.iter().map(|s| s.len).collect();
        // Operands: the inputs [param, grad, state..., scale?], then the outputs [param,
        // state...].
        let words = codegen::multi_tensor_args(&program, &lens, |m, t| {
            let (s, (p, st)) = (&chunk[t], &out_chunk[t]);
            match m {
                0 => s.param.device_ptr(),
                1 => s.grad.device_ptr(),
                m if m < 2 + nstate => s.state[m - 2].device_ptr(),
                m if m < n_in => grad_scale.map_or(0, |b| b.device_ptr()),
                m if m == n_in => p.device_ptr(),
                m => st[m - n_in - 1].device_ptr(),
            }
        });
        let total: usize = lens.iter().sum();
        let mut args = Args::new();
        args.push_words(&words);
        for (&v, &d) in params.iter().zip(program.params()) {
            match d {
                DType::F32 => args.push(v as f32),
                _ => args.push(v),
            };
        }
        dev.launch(
            OP,
            f,
            dev.grid_1d(total as u64, BLOCK),
            BLOCK,
            0,
            args.ptrs(),
        )?;
    }
    Ok(())
}
