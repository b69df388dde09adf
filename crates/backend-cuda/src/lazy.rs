//! Deferred elementwise ops and the fused kernels that run them.
//!
//! On a GPU a small elementwise op costs far more to launch (3–5 µs of driver time per
//! `cuLaunchKernel` on the H100/H200 we measure on) than to run, and a training step is full of
//! chains of them: a loss's tail, the chain rule of its gradient, an update. So `unary`, `binary`,
//! `binary_scalar`, `unary_backward` and small `fill`s (up to [`MAX_DEFERRED_FILL`] bytes) on
//! f32/f64, comparisons of floats, `where` with float branches and casts among f32, f64 and u8 (a
//! dropout mask, a ReLU written with `where`) do not launch anything: they record a node of the
//! deferral graph ([`kiln_core::expr::defer`], shared with the CPU backend) whose leaves are
//! computed buffers. The first op that needs the values — a matmul, a reduction, a copy to the
//! host, any op that is not elementwise — *forces* the node: its whole DAG becomes one
//! expression program ([`kiln_core::expr`], the IR users write programs in: constants become
//! parameters, a `unary_backward` the arithmetic of its single-op kernel), run by `expr_run.rs`
//! as one generated kernel, compiled by NVRTC once per distinct program (memoized per device
//! and cached on disk like `kernels/`). A node nobody reads never runs.
//!
//! What does not change: tensors stay immutable (an in-place write into a buffer that a pending
//! node still reads copies the buffer first: `Repr::buffer_mut`); every op computes with
//! the scalar functions of the single-op kernels (`kernels/scalar_ops.cuh`); shape, dtype and
//! device errors are raised by the op that caused them. What does: an out-of-memory or launch
//! failure of deferred work surfaces at the op that forces it (as with any asynchronous GPU
//! error), and `launch_stats` counts one launch for the chain.
//!
//! The graph's two rules (a pending operand is inlined only when read in its own shape or
//! when uniform; a DAG past `defer::MAX_OPS` operations or `defer::MAX_LEAVES` leaf reads
//! forces its operands first) keep the generated kernels and their argument lists bounded.
//! What this module adds: a node runs on the stream that was current when it was recorded,
//! and nodes recorded during a CUDA graph capture are forced before the capture ends.
//!
//! Programs are keyed by their code, so a chain that keeps changing shape keeps compiling: a
//! value updated in a loop and never read by anything but elementwise ops (`b = b - lr * g`)
//! grows by a few ops per step until the cap, and every length is a new program. State carried
//! across steps should therefore be realized ([`kiln_core::Tensor::realize`]; kiln-autograd's
//! `Var::set_tensor` does it), and each device compiles at most `KILN_CUDA_FUSE_PROGRAMS`
//! (default 256, [`set_fusion_program_budget`]) programs; past that, new chains run op by op on
//! the single-op kernels.
//!
//! `KILN_CUDA_FUSE=0` (or [`set_fusion`]`(false)`) runs every op eagerly instead.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use kiln_core::expr::defer::{self, Deferral};
use kiln_core::{DType, Error, Layout, ReduceOp, Result};

use crate::device::{DeviceState, set_capture, set_current_stream};
use crate::expr_run::{Caller, Parts, planned_parts, run_planned, run_planned_one};
use crate::memory::{Buffer, alloc, duplicate, note_capture_use};
use crate::ops;

pub(crate) use kiln_core::expr::defer::Op;

/// The CUDA backend's side of the deferral graph: nodes hold device buffers and remember the
/// device and the stream they were recorded on.
pub(crate) struct Gpu;

/// Where a node runs: its device, and the stream current when it was recorded.
#[derive(Clone, Copy)]
pub(crate) struct Home {
    dev: &'static DeviceState,
    stream: usize,
}

impl Deferral for Gpu {
    type Buf = Arc<Buffer>;
    type Ctx = Home;
    fn same_buf(a: &Arc<Buffer>, b: &Arc<Buffer>) -> bool {
        a.device_ptr() == b.device_ptr()
    }
    fn note_leaf(buf: &Arc<Buffer>) {
        note_capture_use(buf);
    }
}

pub(crate) type Node = defer::Node<Gpu>;
type Operand = defer::Operand<Gpu>;

fn home(dev: &'static DeviceState) -> Home {
    Home {
        dev,
        stream: dev.stream() as usize,
    }
}

static FUSION: AtomicU8 = AtomicU8::new(0);

/// Turns deferral and fusion of elementwise ops on or off for the whole process. Default on;
/// `KILN_CUDA_FUSE=0` starts with it off, and so does `KILN_CUDA_SYNC=1` (which promises that
/// a failure is reported by the op that caused it). Tensors already pending stay pending.
pub fn set_fusion(on: bool) {
    FUSION.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    crate::profile::note_fusion(on);
}

/// Whether elementwise ops are deferred and fused (see [`set_fusion`]).
pub fn fusion_enabled() -> bool {
    match FUSION.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_CUDA_FUSE").map_or(true, |v| v != "0")
                && !crate::device::sync_debug();
            set_fusion(on);
            on
        }
        v => v == 2,
    }
}

/// What a tensor's storage holds: a computed buffer, or deferred work (`CudaStorage` wraps
/// this; the deferral layer works on it directly, so it needs nothing from the storage type).
pub(crate) enum Repr {
    Ready(Arc<Buffer>),
    Lazy(Arc<Node>),
}

impl Repr {
    pub(crate) fn state(&self) -> &'static DeviceState {
        match self {
            Repr::Ready(b) => b.state(),
            Repr::Lazy(n) => n.ctx().dev,
        }
    }
    pub(crate) fn len_bytes(&self) -> usize {
        match self {
            Repr::Ready(b) => b.len_bytes(),
            Repr::Lazy(n) => n.len_bytes(),
        }
    }
    /// Whether this holds elementwise work that has not run yet.
    pub(crate) fn is_pending(&self) -> bool {
        match self {
            Repr::Ready(_) => false,
            Repr::Lazy(n) => !n.is_done(),
        }
    }
    /// The computed buffer, running pending work first, for work on the caller's current
    /// stream (noted on the buffer, so that it is not reused before that work has passed).
    pub(crate) fn buffer(&self) -> Result<Arc<Buffer>> {
        let b = match self {
            Repr::Ready(b) => b.clone(),
            Repr::Lazy(n) => force(n)?,
        };
        b.mark_used(b.state().stream())?;
        note_capture_use(&b);
        Ok(b)
    }
    /// The buffer for an in-place write: computed, and held by nothing else (a pending node
    /// that still reads it gets the old contents, in a copy made here).
    pub(crate) fn buffer_mut(&mut self) -> Result<&Buffer> {
        if let Repr::Lazy(n) = self {
            *self = Repr::Ready(force(n)?);
        }
        let Repr::Ready(b) = self else {
            unreachable!("made ready above")
        };
        if Arc::get_mut(b).is_none() {
            *b = Arc::new(duplicate(b)?);
        }
        b.contents_changed();
        b.mark_used(b.state().stream())?;
        note_capture_use(b);
        Ok(b)
    }
}

/// Fused elementwise programs built so far in this process (every device), and the host
/// nanoseconds spent compiling them with NVRTC or loading them from the disk cache: the
/// one-time cost of kernel fusion (see `KILN_CUDA_FUSE`).
pub fn fused_program_stats() -> (u64, u64) {
    crate::expr_run::lazy_program_stats()
}

/// `op` over `inputs` (each read through a layout of the output's shape, with its dtype) into
/// a result of dtype `out`: deferred when fusion is on and the op and dtypes allow it, else
/// run now.
pub(crate) fn record(op: Op, inputs: &[(&Repr, &Layout, DType)], out: DType) -> Result<Repr> {
    let (s0, l0, _) = inputs[0];
    for (s, _, _) in &inputs[1..] {
        if s.state().ordinal() != s0.state().ordinal() {
            return Err(Error::DeviceMismatch {
                op: op.name(),
                lhs: s0.state().device().to_string(),
                rhs: s.state().device().to_string(),
            });
        }
    }
    let mut ins = [out; 3]; // at most three operands (`where`)
    for (i, (_, _, d)) in inputs.iter().enumerate() {
        ins[i] = *d;
    }
    if !fusion_enabled() || !op.fusable(&ins[..inputs.len()], out) {
        let bufs = inputs
            .iter()
            .map(|(s, _, _)| s.buffer())
            .collect::<Result<Vec<_>>>()?;
        let args: Vec<(&Arc<Buffer>, &Layout, DType)> = bufs
            .iter()
            .zip(inputs)
            .map(|(b, (_, l, d))| (b, *l, *d))
            .collect();
        return eager(s0.state(), op, &args, out, l0.elem_count())
            .map(|b| Repr::Ready(Arc::new(b)));
    }
    let args = inputs
        .iter()
        .map(|(s, l, d)| operand(s, l, *d))
        .collect::<Result<Vec<_>>>()?;
    let node = defer::node(home(s0.state()), op, args, l0.shape(), out, force)?;
    Ok(Repr::Lazy(captured(node)))
}

thread_local! {
    /// Nodes recorded while this thread captures a CUDA graph: forced before the capture
    /// ends ([`force_captured`]), so that their kernels are part of the graph.
    static CAPTURED: std::cell::RefCell<Vec<std::sync::Weak<Node>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `node`, noted for [`force_captured`] when recorded during a capture.
fn captured(node: Arc<Node>) -> Arc<Node> {
    if node.ctx().dev.capturing() {
        CAPTURED.with(|c| c.borrow_mut().push(Arc::downgrade(&node)));
    }
    node
}

/// Runs every node recorded during the calling thread's capture that is still pending and
/// still held by someone (`graph.rs` calls it before ending the capture); with `run: false`
/// only forgets them (a failed capture).
pub(crate) fn force_captured(run: bool) -> Result<()> {
    let nodes = CAPTURED.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if !run {
        return Ok(());
    }
    for n in nodes.iter().filter_map(|w| w.upgrade()) {
        force(&n)?;
    }
    Ok(())
}

/// Fills up to this many bytes are deferred (a seed gradient, a scalar constant); larger ones
/// allocate at once, so that `zeros` of a big tensor reserves its memory (and fails with
/// out-of-memory) where it is called, as users expect.
pub(crate) const MAX_DEFERRED_FILL: usize = 4096;

/// A deferred fill of `len` elements (a leafless, uniform node) when small, or an eager one.
pub(crate) fn fill(
    dev: &'static DeviceState,
    dtype: DType,
    len: usize,
    value: f64,
) -> Result<Repr> {
    let small = len * dtype.size_in_bytes() <= MAX_DEFERRED_FILL;
    if !fusion_enabled() || !Op::Fill(value).fusable(&[], dtype) || !small {
        return ops::fill(dev, dtype, len, value).map(|b| Repr::Ready(Arc::new(b)));
    }
    Ok(Repr::Lazy(captured(defer::fill(
        home(dev),
        dtype,
        len,
        value,
    ))))
}

/// How a node reads `s` (of `dtype`) through `l` (see `kiln_core::expr::defer` for when a
/// pending input is inlined).
fn operand(s: &Repr, l: &Layout, dtype: DType) -> Result<Operand> {
    match s {
        Repr::Ready(buf) => {
            // The node launches on the current stream (where it is recorded).
            buf.mark_used(buf.state().stream())?;
            Ok(Operand::Leaf {
                buf: buf.clone(),
                layout: l.clone(),
                dtype,
            })
        }
        Repr::Lazy(node) => defer::operand(node, l, dtype, force),
    }
}

/// Runs `op` now with the single-op kernels; `out` is the result's dtype.
fn eager(
    dev: &'static DeviceState,
    op: Op,
    args: &[(&Arc<Buffer>, &Layout, DType)],
    out: DType,
    len: usize,
) -> Result<Buffer> {
    if let Op::Fill(v) = op {
        return ops::fill(dev, out, len, v);
    }
    let (a, la, da) = args[0];
    match op {
        Op::Unary(u) => ops::unary(u, a, la, out),
        Op::Binary(b) => ops::binary(b, a, la, args[1].0, args[1].1, out),
        Op::Scalar { op, value, lhs } => ops::binary_scalar(op, a, la, out, value, lhs),
        Op::UnaryBwd(u) => ops::unary_backward(u, a, la, args[1].0, args[1].1, out),
        Op::Compare(c) => ops::compare(c, a, la, args[1].0, args[1].1, da),
        Op::Cast(to) => ops::cast(a, la, da, to),
        Op::Where => ops::where_cond(a, la, args[1].0, args[1].1, args[2].0, args[2].1, out),
        Op::Fill(_) => unreachable!("handled above"),
    }
}

/// The node's values: computed now (one launch for its whole pending DAG) unless already.
///
/// The launch goes to the stream that was current when the node was recorded; when the caller
/// is on another stream, the caller's stream then waits for it, so a value read on stream B
/// never races with deferred work recorded on stream A.
pub(crate) fn force(node: &Arc<Node>) -> Result<Arc<Buffer>> {
    if let Some(b) = node.done() {
        return Ok(b.clone());
    }
    let Home { dev, stream } = node.ctx();
    let caller = dev.stream();
    let home = stream as cudarc::driver::sys::CUstream;
    if caller == home {
        return force_here(node);
    }
    if dev.capturing() {
        return force_outside_capture(node, home);
    }
    let prev = set_current_stream(dev.ordinal(), home);
    let r = force_here(node);
    set_current_stream(dev.ordinal(), prev);
    let b = r?;
    dev.order(home, caller, "force")?;
    b.mark_used(caller)?;
    Ok(b)
}

/// [`force`] of a node recorded before the calling thread began capturing a CUDA graph (on
/// another stream): it runs now, outside the graph, on its own stream, and the host waits for
/// it (a capturing stream cannot wait for work that is not captured; the wait is legal in the
/// relaxed capture mode `graph.rs` uses). Its value is then ready for every replay.
fn force_outside_capture(
    node: &Arc<Node>,
    home: cudarc::driver::sys::CUstream,
) -> Result<Arc<Buffer>> {
    let dev = node.ctx().dev;
    let pool = set_capture(None);
    let prev = set_current_stream(dev.ordinal(), home);
    let r = force_here(node);
    set_current_stream(dev.ordinal(), prev);
    set_capture(pool);
    let b = r?;
    // SAFETY: a live stream of this device, which is not capturing.
    crate::device::check(
        unsafe { cudarc::driver::sys::cuStreamSynchronize(home) },
        "force",
    )?;
    note_capture_use(&b);
    Ok(b)
}

/// [`force`] on the current stream: one fused launch, or the single-op kernel when every
/// operand is computed (`defer::force_with`).
fn force_here(node: &Arc<Node>) -> Result<Arc<Buffer>> {
    defer::force_with(
        node,
        run_op,
        |n| Ok(run_program(n, None)?.map(Arc::new)),
        force,
    )
}

/// `op` over `args`, every one of them computed, with the single-op kernels.
fn run_op(node: &Node, op: Op, args: &[Operand]) -> Result<Arc<Buffer>> {
    let dev = node.ctx().dev;
    if let Some(leaves) = leaves(args) {
        // A lone op on computed tensors (what a realized op is): read in place, nothing
        // allocated but its result.
        let leaves = &leaves[..args.len()];
        for (b, _, _) in leaves {
            note_capture_use(b);
        }
        let len = node.shape().elem_count();
        return eager(dev, op, leaves, node.dtype(), len).map(Arc::new);
    }
    let held = defer::computed_args(node, args);
    for (b, _, _) in &held {
        note_capture_use(b);
    }
    let refs: Vec<(&Arc<Buffer>, &Layout, DType)> =
        held.iter().map(|(b, l, d)| (b, l, *d)).collect();
    eager(dev, op, &refs, node.dtype(), node.shape().elem_count()).map(Arc::new)
}

/// The operands of a node whose operands are all leaves (at most three, `where`'s), as the
/// single-op kernels take them; `None` for any other node (one with no operand, or reading
/// another node's value: `defer::computed_args` lays those out).
fn leaves(args: &[Operand]) -> Option<[(&Arc<Buffer>, &Layout, DType); 3]> {
    let Some(Operand::Leaf { buf, layout, dtype }) = args.first() else {
        return None;
    };
    if args.len() > 3 {
        return None;
    }
    let mut out = [(buf, layout, *dtype); 3];
    for (o, a) in out.iter_mut().zip(args) {
        let Operand::Leaf { buf, layout, dtype } = a else {
            return None;
        };
        *o = (buf, layout, *dtype);
    }
    Some(out)
}

static PROGRAM_BUDGET: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets how many distinct fused programs a device compiles before new chains run op by op on
/// the single-op kernels instead (default 256, or `KILN_CUDA_FUSE_PROGRAMS`): a bound on
/// compile time (tens of ms per program) for code whose chains keep changing shape.
pub fn set_fusion_program_budget(programs: usize) {
    PROGRAM_BUDGET.store(programs + 1, Ordering::Relaxed);
}

fn program_budget() -> usize {
    match PROGRAM_BUDGET.load(Ordering::Relaxed) {
        0 => {
            let n = std::env::var("KILN_CUDA_FUSE_PROGRAMS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(256);
            set_fusion_program_budget(n);
            n
        }
        v => v - 1,
    }
}

/// Reduces all of pending `s` (read through `l`) with `op` in the kernel that computes it,
/// without writing its elements: one launch for a small chain (a loss), two (partial results
/// of many blocks, then their combination: `codegen`'s split strategy) from 128K elements.
/// `None` when this does not apply (not a pending node read in its own layout, a 0-d node,
/// fusion off, not sum/max/min) or the program budget is spent; the caller then forces the
/// node and reduces the buffer.
pub(crate) fn reduce_all(s: &Repr, l: &Layout, op: ReduceOp) -> Result<Option<Buffer>> {
    let Repr::Lazy(node) = s else {
        return Ok(None);
    };
    if !fusion_enabled() || !defer::fusable_reduction(node, l, op) {
        return Ok(None);
    }
    run_program(node, Some(op))
}

/// The kernel of `root`'s pending DAG, as an expression program (`expr_eval.rs` generates,
/// compiles once per program and launches it). With `reduce`, the 1-element reduction of it
/// over every axis instead of its elements. `None`: the program budget is spent, or the DAG
/// cannot run as one kernel (too many arguments or dimensions).
fn run_program(root: &Arc<Node>, reduce: Option<ReduceOp>) -> Result<Option<Buffer>> {
    let dev = root.ctx().dev;
    dev.bind()?;
    if root.shape().elem_count() == 0 {
        return alloc(dev, 0).map(Some);
    }
    // (Collected only when reducing: no allocation for a plain chain.)
    let every_axis: Vec<usize> = match reduce {
        Some(_) => (0..root.shape().rank()).collect(),
        None => Vec::new(),
    };
    let g = defer::build(root, reduce.map(|op| (op, &every_axis[..])));
    let dtypes: Vec<DType> = g.inputs.iter().map(|(_, _, d)| *d).collect();
    let param_dtypes: Vec<DType> = g.params.iter().map(|(_, d)| *d).collect();
    // The root's value first, then the shared values the program also stores.
    let mut outputs = vec![g.out];
    outputs.extend(g.extra.iter().map(|(_, v)| *v));
    let parts = Parts {
        inputs: &dtypes,
        params: &param_dtypes,
        code: &g.code,
        outputs: &outputs,
        axes: &g.axes,
    };
    let layouts: Vec<&Layout> = g.inputs.iter().map(|(_, l, _)| l).collect();
    let params: Vec<f64> = g.params.iter().map(|(v, _)| *v).collect();
    let planned = planned_parts(parts, root.shape(), &layouts, &params)?;
    // Every recorded op is a valid instruction (`Op::fusable` allows a subset of what the IR
    // does); should one not be, the chain still runs, op by op.
    debug_assert!(planned.is_some(), "an invalid program: {:?}", g.code);
    let Some(planned) = planned else {
        return Ok(None);
    };
    let bufs: Vec<&Buffer> = g.inputs.iter().map(|(b, _, _)| &**b).collect();
    let caller = Caller::Lazy {
        budget: program_budget(),
    };
    if g.extra.is_empty() {
        return run_planned_one(dev, &planned, &bufs, &layouts, &params, caller);
    }
    let Some(mut outs) = run_planned(dev, &planned, &bufs, &layouts, &params, caller)? else {
        return Ok(None);
    };
    for ((node, _), buf) in g.extra.iter().zip(outs.drain(1..)) {
        node.finish(Arc::new(buf));
    }
    Ok(outs.pop())
}
