//! Deferred elementwise ops: a chain over large tensors runs as one fused pass.
//!
//! Op by op, every elementwise op over a tensor larger than the caches reads its inputs from
//! memory and writes its result back: `exp(a * b + 1) * 0.5 - b` over 32M f32 moves about
//! 1.4 GiB in five passes, where one pass moves 384 MiB. So, as on the GPU, `unary`, `binary`,
//! `binary_scalar`, `unary_backward`, comparisons of floats, `where` with float branches and
//! casts among f32, f64 and u8 whose result has at least [`fusion_min_elements`] elements do not
//! run when called: they record a node of the deferral graph ([`kiln_core::expr::defer`], the
//! CUDA backend's too). The first op that reads the values (a matmul, a reduction, a copy to
//! the host, `Tensor::realize`, any op that is not elementwise) computes the node: its pending
//! DAG becomes one expression program that the fused evaluator (`expr`) runs block by block,
//! with the per-element functions of the single-op kernels, so the bits are the op-by-op ones.
//!
//! Smaller tensors run op by op, as before: their intermediates stay in cache, and a recorded
//! node costs host time that a kernel over a few thousand elements does not repay. Results
//! larger than the machine's memory run at once too, so that their error names the op.
//!
//! What changes for users: a deferred op's out-of-memory error surfaces at the op that computes
//! the chain (as on a GPU), and a tensor read through a pending view is computed first.
//!
//! `KILN_CPU_FUSE=0` (or [`set_fusion`]`(false)`) runs every op at once; `KILN_CPU_FUSE_MIN`
//! (or [`set_fusion_min_elements`]) moves the size threshold.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use kiln_core::expr::Program;
use kiln_core::expr::defer::{self, Op};
use kiln_core::profile;
use kiln_core::{DType, Layout, ReduceOp, Result};

use crate::elementwise;
use crate::expr::eval_expr;
use crate::storage::{Block, CpuDeferral, CpuStorage, Node};

type Operand = defer::Operand<CpuDeferral>;

/// The default of [`fusion_min_elements`]: 256K elements (1 MiB of f32, a core's L2).
pub const DEFAULT_FUSION_MIN_ELEMENTS: usize = 1 << 18;

static FUSION: AtomicU8 = AtomicU8::new(0);
static MIN_ELEMENTS: AtomicUsize = AtomicUsize::new(0);

/// Turns deferral and fusion of large elementwise ops on or off for the whole process.
/// Default on; `KILN_CPU_FUSE=0` starts with it off. Tensors already pending stay pending.
pub fn set_fusion(on: bool) {
    FUSION.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether large elementwise ops are deferred and fused (see [`set_fusion`]).
pub fn fusion_enabled() -> bool {
    match FUSION.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_CPU_FUSE").map_or(true, |v| v != "0");
            set_fusion(on);
            on
        }
        v => v == 2,
    }
}

/// Sets the fewest result elements an elementwise op needs to be deferred (0 defers every
/// fusable op, which the tests use to run the conformance suite fused).
pub fn set_fusion_min_elements(n: usize) {
    MIN_ELEMENTS.store(n.saturating_add(1), Ordering::Relaxed);
}

/// The fewest result elements of a deferred op: `KILN_CPU_FUSE_MIN`, default
/// [`DEFAULT_FUSION_MIN_ELEMENTS`].
pub fn fusion_min_elements() -> usize {
    match MIN_ELEMENTS.load(Ordering::Relaxed) {
        0 => {
            let n = std::env::var("KILN_CPU_FUSE_MIN")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_FUSION_MIN_ELEMENTS);
            set_fusion_min_elements(n);
            n
        }
        v => v - 1,
    }
}

/// `op` over `inputs` (each read through a layout of the output's shape, with its dtype) into
/// a result of dtype `out`: deferred when fusion is on, the op and dtypes allow it and the
/// result is large enough; else run now.
pub(crate) fn record(
    op: Op,
    inputs: &[(&CpuStorage, &Layout, DType)],
    out: DType,
) -> Result<CpuStorage> {
    let (s0, l0, _) = inputs[0];
    let mut ins = [out; 3]; // at most three operands (`where`)
    for (i, (_, _, d)) in inputs.iter().enumerate() {
        ins[i] = *d;
    }
    let big = fusion_enabled() && l0.elem_count() >= fusion_min_elements();
    // 16-bit arithmetic runs only in the fused evaluator (see `elementwise.rs`): such an op is
    // recorded and computed at once, as a program of one op, when it is not deferred.
    let half = out.is_half() || ins[..inputs.len()].iter().any(|d| d.is_half());
    // Asked only when the answer matters: a gradient rule's check looks it up in a memo behind
    // a lock, which a small f32 op (most of a small step's ops) does not need.
    let fusable = (big || half)
        && op.fusable(&ins[..inputs.len()], out)
        && inputs.iter().all(|(s, _, d)| s.dtype() == *d)
        && fits_in_memory(l0.elem_count(), out);
    let deferred = fusable && big;
    let record_now = deferred || (half && fusable);
    if !record_now {
        for (s, _, _) in inputs {
            compute(s)?;
        }
        return eager(op, inputs, out);
    }
    let args = inputs
        .iter()
        .map(|(s, l, d)| operand(s, l, *d))
        .collect::<Result<Vec<_>>>()?;
    let node = defer::node(s0.device(), op, args, l0.shape(), out, force)?;
    let s = CpuStorage::pending(node);
    if !deferred {
        compute(&s)?;
    }
    Ok(s)
}

/// Whether `n` elements of `dtype` fit in the machine's memory. A larger result (a computation
/// on a huge broadcast view) runs at once, so that its out-of-memory or invalid-size error
/// names the op that asked for it; a deferred op's allocation fails, if at all, where the chain
/// is computed.
fn fits_in_memory(n: usize, dtype: DType) -> bool {
    static TOTAL: OnceLock<usize> = OnceLock::new();
    let total = *TOTAL.get_or_init(|| {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
            .map_or(usize::MAX, |kb| kb.saturating_mul(1024))
    });
    n.checked_mul(dtype.size_in_bytes())
        .is_some_and(|b| b <= total)
}

/// Computes `s` if it holds pending work (every op that reads elements calls this first).
pub(crate) fn compute(s: &CpuStorage) -> Result<()> {
    if let Some(n) = s.node()
        && !n.is_done()
    {
        force(n)?;
    }
    Ok(())
}

/// How a node reads `s` (of `dtype`) through `l`.
fn operand(s: &CpuStorage, l: &Layout, dtype: DType) -> Result<Operand> {
    match (s.block(), s.node()) {
        (Some(b), _) => Ok(Operand::Leaf {
            buf: b.clone(),
            layout: l.clone(),
            dtype,
        }),
        (None, Some(n)) => defer::operand(n, l, dtype, force),
        (None, None) => unreachable!("a storage is computed or pending"),
    }
}

/// Runs `op` now with the single-op kernels; `out` is the result's dtype.
fn eager(op: Op, args: &[(&CpuStorage, &Layout, DType)], out: DType) -> Result<CpuStorage> {
    let (a, la, da) = args[0];
    match op {
        Op::Unary(u) => elementwise::unary(u, a, la, out),
        Op::Binary(b) => elementwise::binary(b, a, la, args[1].0, args[1].1, out),
        Op::Scalar { op, value, lhs } => elementwise::binary_scalar(op, a, la, out, value, lhs),
        Op::UnaryBwd(u) => elementwise::unary_backward(u, a, la, args[1].0, args[1].1, out),
        Op::Compare(c) => elementwise::compare(c, a, la, args[1].0, args[1].1, da),
        Op::Cast(to) => elementwise::cast(a, la, da, to),
        Op::Where => {
            let (t, f) = (args[1], args[2]);
            elementwise::where_cond(a, la, t.0, t.1, f.0, f.1, out)
        }
        Op::Fill(_) => unreachable!("the CPU backend does not defer fills"),
    }
}

/// The node's values: computed now (one fused pass over its pending DAG) unless already.
fn force(node: &Arc<Node>) -> Result<Arc<Block>> {
    if let Some(b) = node.done() {
        return Ok(b.clone());
    }
    // 16-bit arithmetic runs in the fused evaluator only (see `elementwise.rs`), even for a
    // node of one op over computed inputs, which `force_with` would run op by op.
    if node.involves_half()
        && let Some(b) = run_program(node, None)?
    {
        return Ok(node.finish(b));
    }
    defer::force_with(node, run_op, fused, force)
}

/// `op` over `args`, every one of them computed, with the single-op kernels.
fn run_op(node: &Node, op: Op, args: &[Operand]) -> Result<Arc<Block>> {
    let held: Vec<(CpuStorage, Layout, DType)> = defer::computed_args(node, args)
        .into_iter()
        .map(|(b, l, d)| (CpuStorage::from_block(b), l, d))
        .collect();
    let refs: Vec<(&CpuStorage, &Layout, DType)> =
        held.iter().map(|(s, l, d)| (s, l, *d)).collect();
    eager(op, &refs, node.dtype())?.shared()
}

/// `root`'s pending DAG as one program, run by the fused evaluator. `None` should the program
/// be invalid (every recorded op is a valid instruction: then the chain runs op by op).
fn fused(root: &Arc<Node>) -> Result<Option<Arc<Block>>> {
    run_program(root, None)
}

/// The reduction `op` over `axes` of pending `s` (read through `l`), computed in the pass of
/// its chain, without writing the chain's elements (`log(sum(exp(x - m)))`'s sum reads `x`
/// once). `None` when this does not apply (see `defer::fusable_reduction`): the caller
/// computes `s`, then reduces it.
pub(crate) fn reduce(
    s: &CpuStorage,
    l: &Layout,
    op: ReduceOp,
    dtype: DType,
    axes: &[usize],
) -> Result<Option<CpuStorage>> {
    // Axes the plain reduction would refuse stay with it, so that its error is the one raised.
    let valid = !axes.is_empty()
        && axes.iter().all(|&a| a < l.rank())
        && axes.iter().enumerate().all(|(i, a)| !axes[..i].contains(a));
    match (s.node(), s.block()) {
        (Some(n), None)
            if valid
                && fusion_enabled()
                && n.dtype() == dtype
                && defer::fusable_reduction(n, l, op) =>
        {
            Ok(run_program(n, Some((op, axes)))?.map(CpuStorage::from_block))
        }
        _ => Ok(None),
    }
}

/// Runs `root`'s pending DAG (or its reduction) as one program of the fused evaluator.
fn run_program(
    root: &Arc<Node>,
    reduce: Option<(ReduceOp, &[usize])>,
) -> Result<Option<Arc<Block>>> {
    // The profiler shows the pass as an op of its own inside the op that needed its values.
    let _span = profile::enabled().then(|| {
        let mut detail = profile::OpDetail::new(root.dtype());
        detail.push(root.shape().dims());
        let label = profile::device_label(&root.ctx());
        profile::op(
            "fused elementwise",
            label,
            detail,
            root.len_bytes() as u64,
            true,
        )
    });
    let g = defer::build(root, reduce);
    let dtypes: Vec<DType> = g.inputs.iter().map(|(_, _, d)| *d).collect();
    let param_dtypes: Vec<DType> = g.params.iter().map(|(_, d)| *d).collect();
    // The root's value first, then the shared values the program also stores.
    let mut outputs = vec![g.out];
    outputs.extend(g.extra.iter().map(|(_, v)| *v));
    let program = Program::new(dtypes, param_dtypes, g.code, outputs, g.axes);
    debug_assert!(program.is_ok(), "an invalid program: {program:?}");
    let Ok(program) = program else {
        return Ok(None);
    };
    let stores: Vec<(CpuStorage, &Layout)> = g
        .inputs
        .iter()
        .map(|(b, l, _)| (CpuStorage::from_block(b.clone()), l))
        .collect();
    let inputs: Vec<(&CpuStorage, &Layout)> = stores.iter().map(|(s, l)| (s, *l)).collect();
    let params: Vec<f64> = g.params.iter().map(|(v, _)| *v).collect();
    let mut outs = eval_expr(&root.ctx(), &program, root.shape(), &inputs, &params)?;
    for ((node, _), out) in g.extra.iter().zip(outs.drain(1..)) {
        node.finish(out.shared()?);
    }
    outs.swap_remove(0).shared().map(Some)
}
