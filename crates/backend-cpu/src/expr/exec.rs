//! What the fused evaluator's drivers share (the general one in `mod.rs`, [`super::flat`] and
//! [`super::fold`]): the output buffers' handle ([`Outs`]), how each instruction is run
//! ([`Leaves`], [`Step`], the scalar tails), placing a block's inputs, running its
//! instructions, storing its outputs, and the accumulators of reductions. Kept apart from
//! `mod.rs` so that the drivers import it and `mod.rs` imports the drivers, without a circle.

use kiln_core::expr::{Instr, Phase, Program};
use kiln_core::{BinaryOp, DType, Result, bf16, f16};

use super::block::{self, Buf, Elt, Frame, Loc, Sv};
use super::walk::{Run, Walk};
use crate::storage::{CpuData, CpuStorage};

/// Output buffers written from several threads at disjoint positions.
pub(super) struct Outs {
    ptrs: Vec<(*mut u8, DType, usize)>,
}

// SAFETY: `Outs` is only used to write disjoint elements of buffers that outlive the parallel
// section (see `Outs::ptr`/`Outs::slice`); no two tasks touch the same element.
unsafe impl Sync for Outs {}
unsafe impl Send for Outs {}

impl Outs {
    pub(super) fn new(bufs: &mut [CpuStorage]) -> Result<Outs> {
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
    pub(super) fn ptr<T: Elt>(&self, j: usize) -> *mut T {
        let (p, dt, _) = self.ptrs[j];
        assert!(dt == T::DTYPE, "output of another dtype");
        p as *mut T
    }

    /// Elements `start..start + len` of output `j` as a slice of `T`.
    ///
    /// # Safety
    /// The caller's task must be the only one to access these elements while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice<T: Elt>(&self, j: usize, start: usize, len: usize) -> &mut [T] {
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

/// The values of constants and parameters, and how each instruction is run.
pub(super) struct Leaves {
    pub(super) uni: Vec<Option<Sv>>,
    pub(super) steps: Vec<Step>,
}

/// How an instruction is run for a block.
#[derive(Clone, Copy, Debug)]
pub(super) enum Step {
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
    pub(super) fn new(program: &Program, params: &[f64]) -> Leaves {
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
pub(super) fn place_input(
    f: &mut Frame<'_>,
    i: usize,
    k: usize,
    walk: &Walk,
    start: usize,
    dtype: DType,
) {
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
        DType::F16 => one::<f16>(s, off),
        DType::BF16 => one::<bf16>(s, off),
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
        DType::F16 => go::<f16>(f, i, k, walk, start),
        DType::BF16 => go::<bf16>(f, i, k, walk, start),
        _ => go::<u8>(f, i, k, walk, start),
    }
}

/// Copies value `v` of the current block to output `j` at `start`.
///
/// # Safety
/// As [`Outs::slice`]: this task alone writes those elements.
pub(super) unsafe fn store(
    f: &Frame<'_>,
    v: u32,
    dtype: DType,
    outs: &Outs,
    j: usize,
    start: usize,
) {
    // SAFETY: forwarded to the caller.
    unsafe { store_unfenced(f, v, dtype, outs, j, start) };
    block::store_fence();
}

/// As [`store`] without the fence: the task calls [`block::store_fence`] when it ends.
///
/// # Safety
/// As [`Outs::slice`]: this task alone writes those elements.
pub(super) unsafe fn store_unfenced(
    f: &Frame<'_>,
    v: u32,
    dtype: DType,
    outs: &Outs,
    j: usize,
    start: usize,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match dtype {
            DType::F32 => f.store_unfenced::<f32>(v, outs.slice(j, start, f.len)),
            DType::F64 => f.store_unfenced::<f64>(v, outs.slice(j, start, f.len)),
            DType::I64 => f.store_unfenced::<i64>(v, outs.slice(j, start, f.len)),
            DType::F16 => f.store_unfenced::<f16>(v, outs.slice(j, start, f.len)),
            DType::BF16 => f.store_unfenced::<bf16>(v, outs.slice(j, start, f.len)),
            _ => f.store_unfenced::<u8>(v, outs.slice(j, start, f.len)),
        }
    }
}

/// Evaluates the instructions flagged in `run` for the current block; leaves (inputs,
/// constants, parameters) are placed by `place`, the rest computed.
pub(super) fn exec_block(
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
pub(super) fn exec_op(f: &mut Frame<'_>, program: &Program, leaves: &Leaves, i: usize) {
    match leaves.steps[i] {
        Step::Plain => f.exec(i, &program.code()[i], program.dtypes()[i]),
        Step::Skip => {}
        Step::Tail { head, ops, n } => {
            let h = &program.code()[head as usize];
            f.exec_tail(i, h, program.dtypes()[i], &ops[..n]);
        }
    }
}

/// Elementwise programs run on several cores only when the elements times the instructions
/// reach this: a cheap program over a medium tensor (an SGD update of a 100x784 weight, ~9
/// instructions over 78,400 elements) is tens of µs of one core's work, about what waking a
/// sleeping rayon worker costs on a busy 2-core VM (~70 µs measured there; the same reasoning
/// as the hand-written update's threshold in `optim.rs`).
pub(super) const PAR_WORK: usize = 1 << 21;

/// The register dtype of an accumulator for `dtype` values folded with a sum or product.
pub(super) fn widen(dtype: DType) -> DType {
    if dtype == DType::F32 {
        DType::F64
    } else {
        dtype
    }
}

/// Converts accumulators (`acc`) into the register of a `Reduce` value of `dtype`.
pub(super) fn finish_acc(acc: &Buf, out: &mut Buf, len: usize) {
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
