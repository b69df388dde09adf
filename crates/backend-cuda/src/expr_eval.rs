//! `Backend::eval_expr` on CUDA: a user's expression program over tensors, run as one
//! generated kernel by `expr_run.rs` (pending lazy inputs are computed first).
//!
//! What cannot run as one kernel runs op by op ([`eval_composed`], kiln-core's composed
//! evaluator), so results are always those of the op-by-op semantics: layouts with more than 8
//! non-mergeable dimensions, argument lists beyond what a launch takes, and programs past
//! `expr_run::MAX_KERNELS` per device (a bound on compile time).

use std::sync::Arc;

use kiln_core::expr::{Combine, Expr, Program, eval_composed};
use kiln_core::{DType, Error, Layout, ReduceOp, Result, Shape};

use crate::device::state;
use crate::expr_run::{Caller, planned, run_planned};
use crate::memory::Buffer;
use crate::storage::CudaStorage;
use crate::types::Cuda;
use crate::types::CudaDevice;

/// Evaluates `program` fused (see the module docs).
pub(crate) fn eval_expr(
    device: &CudaDevice,
    program: &Program,
    shape: &Shape,
    inputs: &[(&CudaStorage, &Layout)],
    params: &[f64],
) -> Result<Vec<CudaStorage>> {
    let layouts: Vec<&Layout> = inputs.iter().map(|(_, l)| *l).collect();
    let planned = planned(program, shape, &layouts, params)?;
    for (s, _) in inputs {
        if s.device() != *device {
            return Err(Error::DeviceMismatch {
                op: "expr",
                lhs: device.to_string(),
                rhs: s.device().to_string(),
            });
        }
    }
    let dev = state(device)?;
    if planned.geo.is_none() {
        return eval_composed::<Cuda>(device, program, shape, inputs, params);
    }
    // Computed input buffers, held until the launch is enqueued.
    let held = inputs
        .iter()
        .map(|(s, _)| s.buffer())
        .collect::<Result<Vec<Arc<Buffer>>>>()?;
    let bufs: Vec<&Buffer> = held.iter().map(|b| &**b).collect();
    match run_planned(dev, &planned, &bufs, &layouts, params, Caller::User)? {
        Some(outs) => Ok(outs.into_iter().map(CudaStorage::ready).collect()),
        None => eval_composed::<Cuda>(device, program, shape, inputs, params),
    }
}

/// `Backend::reduce` of `s` as a generated one-reduction program (`x.sum(axes)`, max, min) on
/// the expression evaluator, instead of `kernels/reduce.cu`'s hand-written kernels: what
/// [`crate::ops::reduce::reduce_path`] selects. `None` for what the program form does
/// not cover (arg reductions, non-float dtypes, empty tensors, no axes); the caller then runs
/// the hand kernels.
pub(crate) fn reduce(
    op: ReduceOp,
    s: &CudaStorage,
    l: &Layout,
    dtype: DType,
    axes: &[usize],
) -> Result<Option<CudaStorage>> {
    let combine = match op {
        ReduceOp::Sum => Combine::Sum,
        ReduceOp::Max => Combine::Max,
        ReduceOp::Min => Combine::Min,
        ReduceOp::ArgMax | ReduceOp::ArgMin => return Ok(None),
    };
    if !dtype.is_float() || l.elem_count() == 0 || axes.is_empty() {
        return Ok(None);
    }
    let axes: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
    let Ok(p) = Program::from_exprs(&[dtype], &[Expr::input(0).reduce(combine, &axes)]) else {
        return Ok(None);
    };
    let out = eval_expr(&s.device(), &p, l.shape(), &[(s, l)], &[])?;
    Ok(out.into_iter().next())
}
