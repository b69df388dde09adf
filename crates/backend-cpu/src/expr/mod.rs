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
//! and run in blocks of 256 elements with registers reused once dead, so every decision above
//! is taken once instead of per block, and a block's values stay in L1 while the hardware
//! prefetcher streams the inputs. Everything else takes the general driver below.
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
//! per loop, with the same bits as on its own (see `plan_steps` and `block::Aff`).
//!
//! Writing out: outputs go to memory with streaming stores (see `Frame::store_unfenced`). The
//! program's last instruction, when it is an output, runs a piece of [`PIECE`] elements at a
//! time, each piece streamed out at once, so that its writes overlap its reads (one core, a
//! lone multiply over 32M f32: 22.7 -> 16.8 ms; see `elementwise`).
//!
//! Not done yet: reductions over leading axes (a column sum) read their input with the stride
//! of a row; a strategy that folds whole rows of accumulators at once would read it in order.

mod block;
mod flat;
mod fold;
mod walk;

use kiln_core::expr::{Instr, Phase, Program, check_call};
use kiln_core::{BinaryOp, DType, Error, ExprErrorKind, Layout, Result, Shape};
use rayon::prelude::*;

use crate::device::CpuDevice;
use crate::storage::{CpuData, CpuStorage, alloc, storage};
use crate::strided::{PAR_MIN, par_chunk};
use block::{BLOCK, Buf, Elt, Frame, Loc, Sv};
use walk::{Run, Walk};

/// Output buffers written from several threads at disjoint positions.
struct Outs {
    ptrs: Vec<(*mut u8, DType, usize)>,
}

// SAFETY: `Outs` is only used to write disjoint elements of buffers that outlive the parallel
// section (see `Outs::put`/`Outs::slice`); no two tasks touch the same element.
unsafe impl Sync for Outs {}
unsafe impl Send for Outs {}

impl Outs {
    fn new(bufs: &mut [CpuStorage]) -> Result<Outs> {
        let ptrs = bufs
            .iter_mut()
            .map(|s| {
                let (dt, len) = (s.dtype(), s.len());
                Ok((s.bytes_mut()?.as_mut_ptr(), dt, len))
            })
            .collect::<Result<_>>()?;
        Ok(Outs { ptrs })
    }

    /// A pointer to the first element of output `j`, of type `T`.
    fn ptr<T: Elt>(&self, j: usize) -> *mut T {
        let (p, dt, _) = self.ptrs[j];
        assert!(dt == T::DTYPE, "output of another dtype");
        p as *mut T
    }

    /// Elements `start..start + len` of output `j` as a slice of `T`.
    ///
    /// # Safety
    /// The caller's task must be the only one to access these elements while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice<T: Elt>(&self, j: usize, start: usize, len: usize) -> &mut [T] {
        let (p, dt, n) = self.ptrs[j];
        assert!(
            dt == T::DTYPE && start + len <= n,
            "output slice out of bounds"
        );
        // SAFETY: the buffer holds `n` elements of `T` (dtype checked above) and stays alive
        // and unmoved for the whole evaluation; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut((p as *mut T).add(start), len) }
    }
}

/// Evaluates `program` fused (see the module docs).
pub(crate) fn eval_expr(
    device: &CpuDevice,
    program: &Program,
    shape: &Shape,
    inputs: &[(&CpuStorage, &Layout)],
    params: &[f64],
) -> Result<Vec<CpuStorage>> {
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
        let leaves = Leaves::new(program, params);
        let o = Outs::new(&mut outs)?;
        if program.reduces() {
            fold::run(program, shape, &plan.axes, &layouts, &stores, &leaves, &o);
        } else {
            elementwise(program, shape, &layouts, &stores, &leaves, &o);
        }
    }
    Ok(outs)
}

fn alloc_out(device: CpuDevice, dtype: DType, n: usize) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => storage(device, alloc::<f32>("expr", device, n)?),
        DType::F64 => storage(device, alloc::<f64>("expr", device, n)?),
        DType::I64 => storage(device, alloc::<i64>("expr", device, n)?),
        _ => storage(device, alloc::<u8>("expr", device, n)?),
    })
}

/// The values of constants and parameters, and how each instruction is run.
struct Leaves {
    uni: Vec<Option<Sv>>,
    steps: Vec<Step>,
}

/// How an instruction is run for a block.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// On its own.
    Plain,
    /// Not at all: its only use is the next op of a scalar tail, which computes it.
    Skip,
    /// As instruction `head` followed by up to two ops with a uniform operand (op, operand,
    /// operand on the left), in one loop (see `block::Aff`).
    Tail {
        head: u32,
        ops: [(BinaryOp, u32, bool); 2],
        n: usize,
    },
}

/// Scalar tails: an f32 or f64 `x + c`, `x - c`, `c - x`, `x * c` or `c * x` whose `c` is
/// uniform (constants, parameters and what is computed from them) and whose `x` is a unary or
/// binary op used nowhere else (nor an output) is computed inside `x`'s loop, up to two such
/// ops per loop. `exp(a * b + 1) * 0.5 - b` then takes three passes over a block instead of
/// five: `a * b + 1`, `exp(..) * 0.5`, `.. - b`. The values are the same bits (see
/// `block::Aff`).
fn plan_steps(program: &Program) -> Vec<Step> {
    let code = program.code();
    let phase = |v: u32| program.phase(v);
    let mut uses = vec![0usize; code.len()];
    for ins in code {
        for a in ins.operands() {
            uses[a as usize] += 1;
        }
    }
    for &o in program.outputs() {
        uses[o as usize] += 1;
    }
    let mut steps = vec![Step::Plain; code.len()];
    for (c, ins) in code.iter().enumerate() {
        let Instr::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul), p, q) = *ins else {
            continue;
        };
        let dt = program.dtypes()[c];
        if !matches!(dt, DType::F32 | DType::F64) || phase(c as u32) == Phase::Uniform {
            continue;
        }
        let (x, u, lhs) = match (phase(p), phase(q)) {
            (Phase::Uniform, Phase::Uniform) => continue,
            (_, Phase::Uniform) => (p, q, false),
            (Phase::Uniform, _) => (q, p, true),
            _ => continue,
        };
        if uses[x as usize] != 1 || program.dtypes()[x as usize] != dt {
            continue;
        }
        let (head, mut ops, n) = match steps[x as usize] {
            Step::Tail { head, ops, n } if n < 2 => (head, ops, n),
            Step::Plain if matches!(code[x as usize], Instr::Unary(..) | Instr::Binary(..)) => {
                (x, [(op, u, lhs); 2], 0)
            }
            _ => continue,
        };
        ops[n] = (op, u, lhs);
        steps[x as usize] = Step::Skip;
        steps[c] = Step::Tail {
            head,
            ops,
            n: n + 1,
        };
    }
    steps
}

impl Leaves {
    fn new(program: &Program, params: &[f64]) -> Leaves {
        Leaves {
            steps: plan_steps(program),
            uni: program
                .code()
                .iter()
                .enumerate()
                .map(|(i, ins)| match *ins {
                    Instr::Const(c) => Some(Sv::new(c.to_f64(), c.dtype())),
                    Instr::Param(k) => Some(Sv::new(params[k as usize], program.dtypes()[i])),
                    _ => None,
                })
                .collect(),
        }
    }
}

/// Places input `k` for the block `start..start + len` read through `walk`.
fn place_input(f: &mut Frame<'_>, i: usize, k: usize, walk: &Walk, start: usize, dtype: DType) {
    let len = f.len;
    f.locs[i] = match walk.run(start, len) {
        Run::Contig(off) => Loc::In { k, start: off },
        Run::Const(off) => Loc::Uni(read_one(f.inputs[k], off, dtype)),
        Run::Strided => {
            gather_into(f, i, k, walk, start, dtype);
            Loc::Reg
        }
    };
}

fn read_one(s: &CpuData, off: usize, dtype: DType) -> Sv {
    fn one<T: Elt>(s: &CpuData, off: usize) -> Sv {
        T::slice(s).expect("input dtype checked")[off].to_sv()
    }
    match dtype {
        DType::F32 => one::<f32>(s, off),
        DType::F64 => one::<f64>(s, off),
        DType::I64 => one::<i64>(s, off),
        _ => one::<u8>(s, off),
    }
}

fn gather_into(f: &mut Frame<'_>, i: usize, k: usize, walk: &Walk, start: usize, dtype: DType) {
    fn go<T: Elt>(f: &mut Frame<'_>, i: usize, k: usize, walk: &Walk, start: usize) {
        let src = T::slice(f.inputs[k]).expect("input dtype checked");
        let len = f.len;
        walk.gather(src, start, &mut T::reg_mut(&mut f.regs[i])[..len]);
    }
    match dtype {
        DType::F32 => go::<f32>(f, i, k, walk, start),
        DType::F64 => go::<f64>(f, i, k, walk, start),
        DType::I64 => go::<i64>(f, i, k, walk, start),
        _ => go::<u8>(f, i, k, walk, start),
    }
}

/// Copies value `v` of the current block to output `j` at `start`.
///
/// # Safety
/// As [`Outs::slice`]: this task alone writes those elements.
unsafe fn store(f: &Frame<'_>, v: u32, dtype: DType, outs: &Outs, j: usize, start: usize) {
    // SAFETY: forwarded to the caller.
    unsafe { store_unfenced(f, v, dtype, outs, j, start) };
    block::store_fence();
}

/// As [`store`] without the fence: the task calls [`block::store_fence`] when it ends.
///
/// # Safety
/// As [`Outs::slice`]: this task alone writes those elements.
unsafe fn store_unfenced(f: &Frame<'_>, v: u32, dtype: DType, outs: &Outs, j: usize, start: usize) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match dtype {
            DType::F32 => f.store_unfenced::<f32>(v, outs.slice(j, start, f.len)),
            DType::F64 => f.store_unfenced::<f64>(v, outs.slice(j, start, f.len)),
            DType::I64 => f.store_unfenced::<i64>(v, outs.slice(j, start, f.len)),
            _ => f.store_unfenced::<u8>(v, outs.slice(j, start, f.len)),
        }
    }
}

/// Evaluates the instructions flagged in `run` for the current block; leaves (inputs,
/// constants, parameters) are placed by `place`, the rest computed.
fn exec_block(
    f: &mut Frame<'_>,
    program: &Program,
    leaves: &Leaves,
    run: &[bool],
    mut place: impl FnMut(&mut Frame<'_>, usize, u32),
) {
    for (i, ins) in program.code().iter().enumerate() {
        if !run[i] {
            continue;
        }
        match *ins {
            Instr::Input(k) => place(f, i, k),
            Instr::Const(_) | Instr::Param(_) => {
                f.locs[i] = Loc::Uni(leaves.uni[i].expect("leaf value"));
            }
            Instr::Reduce(..) => {} // placed by the reduction driver
            _ => exec_op(f, program, leaves, i),
        }
    }
}

/// Computes instruction `i`, an op (not a leaf), as its step says.
fn exec_op(f: &mut Frame<'_>, program: &Program, leaves: &Leaves, i: usize) {
    match leaves.steps[i] {
        Step::Plain => f.exec(i, &program.code()[i], program.dtypes()[i]),
        Step::Skip => {}
        Step::Tail { head, ops, n } => {
            let h = &program.code()[head as usize];
            f.exec_tail(i, h, program.dtypes()[i], &ops[..n]);
        }
    }
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

/// Elementwise programs run on several cores only when the elements times the instructions
/// reach this: a cheap program over a medium tensor (an SGD update of a 100x784 weight, ~9
/// instructions over 78,400 elements) is tens of µs of one core's work, about what waking a
/// sleeping rayon worker costs on a busy 2-core VM (~70 µs measured there; the same reasoning
/// as the hand-written update's threshold in `optim.rs`).
const PAR_WORK: usize = 1 << 21;

/// A program without reductions: flat blocks over the iteration, in parallel chunks.
fn elementwise(
    program: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    inputs: &[&CpuData],
    leaves: &Leaves,
    outs: &Outs,
) {
    let n = shape.elem_count();
    let direct = flat::direct_writes(n, program.outputs().len());
    if flat_on()
        && let Some(plan) = flat::plan(program, layouts, inputs, leaves, n, direct)
    {
        return flat::run(&plan, program, inputs, n, outs);
    }
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

/// The register dtype of an accumulator for `dtype` values folded with a sum or product.
fn widen(dtype: DType) -> DType {
    if dtype == DType::F32 {
        DType::F64
    } else {
        dtype
    }
}

/// Converts accumulators (`acc`) into the register of a `Reduce` value of `dtype`.
fn finish_acc(acc: &Buf, out: &mut Buf, len: usize) {
    match (acc, out) {
        (Buf::F64(a), Buf::F32(o)) => {
            for (o, &a) in o[..len].iter_mut().zip(&a[..len]) {
                *o = a as f32;
            }
        }
        (Buf::F64(a), Buf::F64(o)) => o[..len].copy_from_slice(&a[..len]),
        (Buf::F32(a), Buf::F32(o)) => o[..len].copy_from_slice(&a[..len]),
        (Buf::I64(a), Buf::I64(o)) => o[..len].copy_from_slice(&a[..len]),
        (Buf::U8(a), Buf::U8(o)) => o[..len].copy_from_slice(&a[..len]),
        _ => unreachable!("accumulator of another dtype"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn block_is_a_multiple_of_the_vector_width() {
        assert_eq!(super::BLOCK % 64, 0);
    }
}
