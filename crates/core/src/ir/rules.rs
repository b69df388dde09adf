//! The op tables' programs: a lone unary op, a unary op's gradient rule, a binary op's gradient
//! rules, a composite op, each built once per dtype from its table entry, and how a rule joins a larger program
//! ([`splice`]). Every backend runs or splices these, so an op computes the same bits alone,
//! in a fused chain, forward and backward.

use std::sync::{Arc, Mutex, OnceLock};

use super::program::{Instr, Program, Val};
use crate::fasthash::FastMap;
use crate::op::{BinaryOp, CompositeOp, Expr, Side, UnaryOp, Vjp};
use crate::{DType, Result};

/// Programs per op and dtype, made once per process and shared (`Arc`): a backward or a lone
/// op asks for its rule on every call, and a copy of a program is several allocations. Keys
/// are hashed with FNV ([`FastMap`]): SipHash of the key was most of a lookup, about a
/// tenth of a realized lone op's host time.
type Memo<K, V> = OnceLock<Mutex<FastMap<(K, DType), V>>>;

fn memoized<K: Copy + Eq + std::hash::Hash, V: Clone>(
    memo: &Memo<K, V>,
    key: (K, DType),
    make: impl FnOnce() -> Result<V>,
) -> Result<V> {
    let m = memo.get_or_init(Default::default);
    if let Some(v) = m.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(v.clone());
    }
    let v = make()?;
    m.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, v.clone());
    Ok(v)
}

/// The program `op(x)` at `dtype` (one input): how a backend that generates its kernels runs a
/// lone unary op.
pub fn unary_program(op: UnaryOp, dtype: DType) -> Result<Arc<Program>> {
    static MEMO: Memo<UnaryOp, Arc<Program>> = OnceLock::new();
    memoized(&MEMO, (op, dtype), || {
        Program::from_exprs(&[dtype], &[Expr::input(0).unary(op)]).map(Arc::new)
    })
}

/// The program of composite `op` at `dtype` (one input, the op's parameters).
pub fn composite_program(op: CompositeOp, dtype: DType) -> Result<Arc<Program>> {
    static MEMO: Memo<CompositeOp, Arc<Program>> = OnceLock::new();
    memoized(&MEMO, (op, dtype), || {
        Program::from_exprs(&[dtype], &[op.expr()]).map(Arc::new)
    })
}

/// The gradient rule of `op` at `dtype` as a program: inputs (the saved operand, `g`), one
/// output, `g · op'(x)` (see [`UnaryOp::vjp`]); `None` for an op whose derivative is zero.
/// Every backward of a unary op on every backend runs this program or splices it.
pub fn unary_vjp_program(op: UnaryOp, dtype: DType) -> Result<Option<Arc<Program>>> {
    static MEMO: Memo<UnaryOp, Option<Arc<Program>>> = OnceLock::new();
    memoized(&MEMO, (op, dtype), || match op.vjp() {
        Vjp::Input(e) | Vjp::Output(e) | Vjp::Neither(e) => {
            Program::from_exprs(&[dtype, dtype], &[e]).map(|p| Some(Arc::new(p)))
        }
        Vjp::Zero => Ok(None),
    })
}

/// The program every `Backend::unary_backward` runs for `op` at `dtype`: the rule of
/// [`unary_vjp_program`], or `0` (in `g`'s shape) for an op whose derivative is zero.
pub fn unary_backward_program(op: UnaryOp, dtype: DType) -> Result<Arc<Program>> {
    static MEMO: Memo<UnaryOp, Arc<Program>> = OnceLock::new();
    memoized(&MEMO, (op, dtype), || match unary_vjp_program(op, dtype)? {
        Some(p) => Ok(p),
        None => Program::from_exprs(&[dtype, dtype], &[Expr::constant(0.0)]).map(Arc::new),
    })
}

/// The gradient rule of binary `op` to `side` at `dtype` (see [`BinaryOp::vjp`]): inputs
/// `(a, b, y, g)`, one output. With `other_const`, the other operand is a constant.
/// [`Program::reads`] tells which of `a`, `b`, `y` the rule needs saved.
pub fn binary_vjp_program(
    op: BinaryOp,
    side: Side,
    other_const: bool,
    dtype: DType,
) -> Result<Arc<Program>> {
    static MEMO: Memo<(BinaryOp, Side, bool), Arc<Program>> = OnceLock::new();
    memoized(&MEMO, ((op, side, other_const), dtype), || {
        Program::from_exprs(&[dtype; 4], &[op.vjp(side, other_const)]).map(Arc::new)
    })
}

/// Emits the instructions of `program` (elementwise, without parameters) through `emit`,
/// reading value `args[k]` wherever it reads input `k`; returns the values of its outputs.
/// How a rule of the op table joins a larger program (the IR's derivatives, the deferral's
/// chains).
pub fn splice(
    program: &Program,
    args: &[Val],
    mut emit: impl FnMut(Instr, DType) -> Val,
) -> Vec<Val> {
    let mut at: Vec<Val> = Vec::with_capacity(program.code().len());
    for (i, ins) in program.code().iter().enumerate() {
        let v = match *ins {
            Instr::Input(k) => args[k as usize],
            ins => emit(ins.map_operands(|o| at[o as usize]), program.dtypes()[i]),
        };
        at.push(v);
    }
    program.outputs().iter().map(|&o| at[o as usize]).collect()
}
