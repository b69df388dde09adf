//! The CPU's fused evaluator of expression programs (`Backend::eval_expr`).
//!
//! numexpr's model: the iteration is cut into blocks of [`BLOCK`] consecutive elements, and a
//! block goes through the whole program before the next one starts, each instruction a loop
//! over the block (vectorized by LLVM) into a register of `BLOCK` elements. Every register stays
//! in cache, so the data are read from memory once per input and written once per output, with
//! no full-size temporary per sub-expression, where op by op every intermediate makes a round
//! trip through memory. Contiguous runs of an input are read in place; broadcast runs are a
//! single value; other views are gathered per block ([`walk`]). Large iterations are split in
//! chunks of blocks across cores with rayon.
//!
//! The fast path ([`flat`]): an elementwise f32 program whose inputs are contiguous or a single
//! value (the common case: a chain of tensor ops, an optimizer update) is planned once per call
//! (a small call reuses the plan of an earlier call like it) and run in blocks of 256 elements
//! with registers reused once dead, so every decision above is taken once instead of per
//! block, and a block's values stay in L1 while the hardware prefetcher streams the inputs.
//! Everything else takes the general driver below.
//!
//! Reductions: the iteration axes are reordered kept-first, so that the elements folded into one
//! output (a "row") are consecutive; blocks run over rows (a block may span several short rows),
//! each block's values are folded into per-row accumulators (f32 sums and products in f64, as
//! `reduce.rs` does, then rounded once), and when a batch of rows is complete the post-map runs
//! over it as a block too. With few rows and many elements per row, the rows' ranges are split
//! across cores into partial accumulators, then merged. Elementwise outputs of a reducing
//! program are written during the same pass.
//!
//! Scalar tails: an op with a uniform operand (`x * 0.5`, `x + 1`, `c - x`) whose other operand
//! is used nowhere else runs inside the loop of the op that computes that operand, up to two
//! per loop, with the same bits as on its own (see `exec::plan_steps` and `block::Aff`).
//!
//! Writing out: outputs go to memory with streaming stores (see `Frame::store_unfenced`). The
//! program's last instruction, when it is an output, runs a piece of [`PIECE`] elements at a
//! time, each piece streamed out at once, so that its writes overlap its reads (one core, a
//! lone multiply over 32M f32: 22.7 -> 16.8 ms; see `elementwise`).
//!
//! Not done yet: reductions over leading axes (a column sum) read their input with the stride
//! of a row; a strategy that folds whole rows of accumulators at once would read it in order.

mod block;
mod exec;
mod flat;
mod fold;
mod walk;

use kiln_core::expr::{Instr, Program, check_call};
use kiln_core::{DType, Error, ExprErrorKind, Layout, Result, Shape};
use rayon::prelude::*;

use crate::device::CpuDevice;
use crate::storage::{CpuData, CpuStorage, alloc, storage};
use crate::strided::{PAR_MIN, par_chunk};
use block::{BLOCK, Frame};
use exec::{Leaves, Outs, PAR_WORK, Step, exec_block, exec_op, place_input, store_unfenced};
use walk::{Run, Walk};

/// Evaluates `program` fused (see the module docs).
pub(crate) fn eval_expr(
    device: &CpuDevice,
    program: &Program,
    shape: &Shape,
    inputs: &[(&CpuStorage, &Layout)],
    params: &[f64],
) -> Result<Vec<CpuStorage>> {
    // 16-bit arithmetic in f32, one rounding per instruction (see `Program::widened`).
    let widened;
    let program = if program.has_half() {
        widened = program.widened()?;
        &widened
    } else {
        program
    };
    let layouts: Vec<&Layout> = inputs.iter().map(|(_, l)| *l).collect();
    let plan = check_call(program, shape, &layouts, params)?;
    for (k, ((s, l), &dt)) in inputs.iter().zip(program.inputs()).enumerate() {
        if s.dtype() != dt {
            return Err(Error::Expr {
                op: "expr",
                kind: ExprErrorKind::DType,
                msg: format!("input {k} is {}, the program takes {dt}", s.dtype()),
            });
        }
        if l.storage_extent() > s.len() {
            return Err(Error::invalid(
                "expr",
                format!(
                    "input {k}: layout {:?} (offset {}) reaches past a storage of {} elements",
                    l.strides(),
                    l.offset(),
                    s.len()
                ),
            ));
        }
    }
    let n_kept = plan.kept.elem_count();
    let mut outs = program
        .outputs()
        .iter()
        .enumerate()
        .map(|(j, &o)| {
            let n = plan.output_len(program, j, shape);
            alloc_out(*device, program.dtype(o), n)
        })
        .collect::<Result<Vec<_>>>()?;
    if shape.elem_count() > 0 || (n_kept > 0 && program.reduces()) {
        let stores = inputs
            .iter()
            .map(|(s, _)| s.data())
            .collect::<Result<Vec<_>>>()?;
        let o = Outs::new(&mut outs)?;
        if program.reduces() {
            let leaves = Leaves::new(program, params);
            fold::run(program, shape, &plan.axes, &layouts, &stores, &leaves, &o);
        } else {
            elementwise(program, shape, &layouts, &stores, params, &o);
        }
    }
    Ok(outs)
}

fn alloc_out(device: CpuDevice, dtype: DType, n: usize) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => storage(device, alloc::<f32>("expr", device, n)?),
        DType::F64 => storage(device, alloc::<f64>("expr", device, n)?),
        DType::I64 => storage(device, alloc::<i64>("expr", device, n)?),
        DType::F16 => storage(device, alloc::<kiln_core::f16>("expr", device, n)?),
        DType::BF16 => storage(device, alloc::<kiln_core::bf16>("expr", device, n)?),
        _ => storage(device, alloc::<u8>("expr", device, n)?),
    })
}

/// Elements of the last instruction computed and written out at a time (see
/// [`elementwise`]).
const PIECE: usize = 1024;

/// Queues the contiguous inputs of the block at `next` (up to `end`) for prefetching, spread
/// over the current block's instructions (see `Frame::prefetch_some`).
///
/// On unless `KILN_CPU_PREFETCH=0` (the switch is for measuring it: on the 2-core EPYC VM,
/// alternating runs gave the five-op chain over 32M f32 47-70 ms with it and 74-76 ms without,
/// and a one-multiply program the same 44-45 ms either way).
fn schedule_prefetch(
    f: &mut Frame<'_>,
    program: &Program,
    walks: &[Walk],
    next: usize,
    end: usize,
    ops: usize,
) {
    f.prefetch.clear();
    if next >= end || !prefetch_on() {
        return;
    }
    let len = BLOCK.min(end - next);
    let mut lines = 0;
    for (k, w) in walks.iter().enumerate() {
        if let Run::Contig(off) = w.run(next, len) {
            let size = program.inputs()[k].size_in_bytes();
            let base = f.inputs[k].as_bytes().as_ptr() as usize;
            f.prefetch
                .push((base + off * size, base + (off + len) * size));
            lines += (len * size).div_ceil(64);
        }
    }
    f.prefetch_step = lines.div_ceil(ops);
}

/// The instructions of `program` that compute (not leaves nor skipped): how many times a
/// block calls [`Frame::prefetch_some`].
fn op_count(program: &Program, leaves: &Leaves) -> usize {
    program
        .code()
        .iter()
        .zip(&leaves.steps)
        .filter(|(i, s)| {
            !matches!(i, Instr::Input(_) | Instr::Param(_) | Instr::Const(_))
                && !matches!(s, Step::Skip)
        })
        .count()
        .max(1)
}

/// Whether software prefetching is on (`KILN_CPU_PREFETCH=0` turns it off; see
/// [`schedule_prefetch`]).
fn prefetch_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CPU_PREFETCH").map_or(true, |v| v != "0"))
}

/// Whether f32 programs over contiguous inputs take the fast path ([`flat`]); on unless
/// `KILN_CPU_FLAT=0` (the switch is for measuring the two drivers against each other).
fn flat_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CPU_FLAT").map_or(true, |v| v != "0"))
}

/// A program without reductions: flat blocks over the iteration, in parallel chunks.
fn elementwise(
    program: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    inputs: &[&CpuData],
    params: &[f64],
    outs: &Outs,
) {
    let n = shape.elem_count();
    let direct = flat::direct_writes(n, program.outputs().len());
    // Built only when a plan is made or the general driver runs (not for a remembered plan).
    let mut leaves = None;
    if flat_on()
        && let Some(plan) = flat::remembered(program, layouts, inputs, params, (n, direct), || {
            let leaves = leaves.insert(Leaves::new(program, params));
            flat::plan(program, layouts, inputs, leaves, n, direct)
        })
    {
        return flat::run(&plan, program, inputs, n, outs);
    }
    let leaves = leaves.unwrap_or_else(|| Leaves::new(program, params));
    general(program, shape, layouts, inputs, &leaves, outs)
}

/// [`elementwise`]'s general driver: any dtypes and layouts.
fn general(
    program: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    inputs: &[&CpuData],
    leaves: &Leaves,
    outs: &Outs,
) {
    let n = shape.elem_count();
    let walks: Vec<Walk> = layouts.iter().map(|l| Walk::new(l)).collect();
    let mut run = vec![true; program.code().len()];
    let chunk = if n < PAR_MIN || n.saturating_mul(program.code().len()) < PAR_WORK {
        n
    } else {
        par_chunk(n).div_ceil(BLOCK) * BLOCK
    };
    let ops = op_count(program, leaves);
    // The last instruction, when it is an op whose value is an output, runs a piece at a
    // time, each piece streamed into the output at once: the output's writes then overlap
    // the reads of that instruction's inputs, as in a single-op kernel, instead of following
    // the whole block's computation.
    let last = program.code().len().saturating_sub(1);
    let piecewise = program
        .code()
        .get(last)
        .is_some_and(|i| !matches!(i, Instr::Input(_) | Instr::Param(_) | Instr::Const(_)))
        && program.outputs().contains(&(last as u32));
    if piecewise {
        run[last] = false;
    }
    let task = |c: usize| {
        let mut f = Frame::new(program, inputs);
        let end = ((c + 1) * chunk).min(n);
        let mut start = c * chunk;
        while start < end {
            f.len = BLOCK.min(end - start);
            let next = start + f.len;
            schedule_prefetch(&mut f, program, &walks, next, end, ops);
            exec_block(&mut f, program, leaves, &run, |f, i, k| {
                let dt = program.inputs()[k as usize];
                place_input(f, i, k as usize, &walks[k as usize], start, dt);
            });
            let len = f.len;
            if piecewise {
                let step = f.prefetch_step;
                f.prefetch_step = step.div_ceil(len.div_ceil(PIECE));
                while f.base < len {
                    f.len = PIECE.min(len - f.base);
                    exec_op(&mut f, program, leaves, last);
                    for (j, &o) in program.outputs().iter().enumerate() {
                        if o as usize == last {
                            // SAFETY: as below, for elements `start + base ..` of `start ..`.
                            let at = start + f.base;
                            unsafe { store_unfenced(&f, o, program.dtype(o), outs, j, at) };
                        }
                    }
                    f.base += f.len;
                }
                (f.base, f.len, f.prefetch_step) = (0, len, step);
            }
            for (j, &o) in program.outputs().iter().enumerate() {
                if piecewise && o as usize == last {
                    continue;
                }
                // SAFETY: chunks are disjoint ranges of the flat index, and every output of
                // this program has the iteration shape, so this task alone writes
                // `start..start + len` of each output; the task fences before it ends.
                unsafe { store_unfenced(&f, o, program.dtype(o), outs, j, start) };
            }
            start += f.len;
        }
        block::store_fence();
    };
    let tasks = n.div_ceil(chunk.max(1));
    if tasks <= 1 {
        task(0);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn block_is_a_multiple_of_the_vector_width() {
        assert_eq!(super::BLOCK % 64, 0);
    }
}
