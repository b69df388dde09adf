//! Deferred elementwise ops and the fused kernels that run them.
//!
//! On a GPU a small elementwise op costs far more to launch (3–5 µs of driver time per
//! `cuLaunchKernel` on the H100/H200 we measure on) than to run, and a training step is full of
//! chains of them: a loss's tail, the chain rule of its gradient, an update. So `unary`, `binary`,
//! `binary_scalar`, `unary_backward` and small `fill`s (up to [`MAX_DEFERRED_FILL`] bytes) on
//! f32/f64, comparisons of floats, `where` with float branches and casts among f32, f64 and u8 (a
//! dropout mask, a ReLU written with `where`) do not launch anything: they record a [`Node`] of an
//! expression DAG whose leaves are computed buffers. The first op that needs the values — a matmul,
//! a reduction, a copy to the host, any op that is not elementwise — *forces* the node: its whole
//! DAG becomes one expression program ([`kiln_core::expr`], the IR users write programs in:
//! constants become parameters, a `unary_backward` the arithmetic of its single-op kernel), run
//! by `expr_run.rs` as one generated kernel, compiled by NVRTC once per distinct program
//! (memoized per device and cached on disk like `kernels/`). A node nobody reads never runs.
//!
//! What does not change: tensors stay immutable (an in-place write into a buffer that a pending
//! node still reads copies the buffer first: `Repr::buffer_mut`); every op computes with
//! the scalar functions of the single-op kernels (`kernels/scalar_ops.cuh`); shape, dtype and
//! device errors are raised by the op that caused them. What does: an out-of-memory or launch
//! failure of deferred work surfaces at the op that forces it (as with any asynchronous GPU
//! error), and `launch_stats` counts one launch for the chain.
//!
//! Two rules keep the generated kernels simple. A pending operand is inlined when it is read in
//! its own shape, contiguously — or when its value is the same at every element (a fill, a
//! scalar, a chain of those), through any view. Any other view of a pending tensor (transposed,
//! broadcast, narrowed) forces it first and reads it as a leaf. And a node that would exceed
//! [`MAX_OPS`] operations or [`MAX_LEAVES`] leaves forces its operands first, so programs and
//! their argument lists stay bounded.
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

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::expr::{Combine, Instr, Scalar, Val};
use kiln_core::{BinaryOp, CmpOp, DType, Error, Layout, ReduceOp, Result, Shape, UnaryOp};

use crate::device::{DeviceState, set_capture, set_current_stream};
use crate::expr_run::{Caller, Parts, planned_parts, run_planned};
use crate::memory::{Buffer, alloc, duplicate, note_capture_use};
use crate::ops;

/// Most operations in one node's DAG (counted with repeats).
pub(crate) const MAX_OPS: u32 = 48;
/// Most leaf reads in one node's DAG (counted with repeats).
pub(crate) const MAX_LEAVES: u32 = 12;
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
            Repr::Lazy(n) => n.state(),
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

/// One deferred elementwise op.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `op(x, value)`, or `op(value, x)` when `lhs`.
    Scalar {
        op: BinaryOp,
        value: f64,
        lhs: bool,
    },
    /// `g * op'(saved)` with operands `(saved, g)`.
    UnaryBwd(UnaryOp),
    Fill(f64),
    /// `op(a, b)` as u8 0/1.
    Compare(CmpOp),
    /// Rust `as` to this dtype.
    Cast(DType),
    /// `cond ? a : b` with operands `(cond, a, b)`.
    Where,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Unary(u) => u.name(),
            Op::Binary(b) | Op::Scalar { op: b, .. } => b.name(),
            Op::UnaryBwd(_) => "unary_backward",
            Op::Fill(_) => "fill",
            Op::Compare(c) => c.name(),
            Op::Cast(_) => "cast",
            Op::Where => "where",
        }
    }

    /// Whether this op, with inputs of dtypes `ins` and a result of dtype `out`, can be
    /// deferred: float arithmetic, comparisons of floats, `where` with float branches, casts
    /// among f32, f64 and u8.
    fn fusable(self, ins: &[DType], out: DType) -> bool {
        let float = |d: DType| matches!(d, DType::F32 | DType::F64);
        match self {
            Op::Unary(u) => float(out) && u.supports(out),
            Op::Binary(b) | Op::Scalar { op: b, .. } => float(out) && b.supports(out),
            Op::UnaryBwd(u) => float(out) && ops::bwd_name(u).is_some(),
            Op::Fill(_) | Op::Where => float(out),
            Op::Compare(_) => float(ins[0]),
            Op::Cast(to) => [ins[0], to]
                .iter()
                .all(|d| matches!(d, DType::F32 | DType::F64 | DType::U8)),
        }
    }
}

/// An input of a node: a computed buffer read through a layout of the node's shape, or another
/// node (read in its own shape, or uniform).
#[derive(Clone)]
pub(crate) enum Operand {
    Leaf {
        buf: Arc<Buffer>,
        layout: Layout,
        dtype: DType,
    },
    Node(Arc<Node>),
}

/// A deferred elementwise op and its result once forced.
pub(crate) struct Node {
    dev: &'static DeviceState,
    /// The stream that was current when the op was recorded: the node launches there.
    stream: usize,
    dtype: DType,
    shape: Shape,
    /// The value is the same at every element (no operand varies per element).
    uniform: bool,
    /// Operations and leaf reads in the DAG below, counted with repeats (for the caps).
    ops: u32,
    leaves: u32,
    state: Mutex<State>,
}

enum State {
    Pending { op: Op, args: Vec<Operand> },
    Done(Arc<Buffer>),
}

impl Node {
    pub(crate) fn state(&self) -> &'static DeviceState {
        self.dev
    }
    pub(crate) fn shape(&self) -> &Shape {
        &self.shape
    }
    pub(crate) fn len_bytes(&self) -> usize {
        self.shape.elem_count() * self.dtype.size_in_bytes()
    }
    pub(crate) fn is_done(&self) -> bool {
        self.done().is_some()
    }
    fn done(&self) -> Option<Arc<Buffer>> {
        match &*self.state.lock().unwrap() {
            State::Done(b) => Some(b.clone()),
            State::Pending { .. } => None,
        }
    }
}

/// Whether `l` reads a single element (every dimension of size > 1 has stride 0).
fn reads_one(l: &Layout) -> bool {
    l.dims()
        .iter()
        .zip(l.strides())
        .all(|(&d, &s)| d <= 1 || s == 0)
}

/// `op` over `inputs` (each read through a layout of the output's shape, with its dtype) into
/// a result of dtype `out`: deferred when fusion is on and the op and dtypes allow it, else
/// run now.
pub(crate) fn record(op: Op, inputs: &[(&Repr, &Layout, DType)], out: DType) -> Result<Repr> {
    let (s0, l0, _) = inputs[0];
    for (s, _, _) in &inputs[1..] {
        if s.state().ordinal != s0.state().ordinal {
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
        let args: Vec<(&Buffer, &Layout, DType)> = bufs
            .iter()
            .zip(inputs)
            .map(|(b, (_, l, d))| (&**b, *l, *d))
            .collect();
        return eager(s0.state(), op, &args, out, l0.elem_count())
            .map(|b| Repr::Ready(Arc::new(b)));
    }
    let mut args = inputs
        .iter()
        .map(|(s, l, d)| operand(s, l, *d))
        .collect::<Result<Vec<_>>>()?;
    let mut t = tally(&args);
    if t.0 + 1 > MAX_OPS || t.1 > MAX_LEAVES {
        for (a, (_, l, d)) in args.iter_mut().zip(inputs) {
            if let Operand::Node(n) = a {
                *a = Operand::Leaf {
                    buf: force(n)?,
                    layout: (*l).clone(),
                    dtype: *d,
                };
            }
        }
        t = tally(&args);
    }
    let (n_ops, n_leaves, uniform) = t;
    Ok(Repr::Lazy(captured(Node {
        dev: s0.state(),
        stream: s0.state().stream() as usize,
        dtype: out,
        shape: l0.shape().clone(),
        uniform: uniform || l0.elem_count() <= 1,
        ops: n_ops + 1,
        leaves: n_leaves,
        state: Mutex::new(State::Pending { op, args }),
    })))
}

thread_local! {
    /// Nodes recorded while this thread captures a CUDA graph: forced before the capture
    /// ends ([`force_captured`]), so that their kernels are part of the graph.
    static CAPTURED: std::cell::RefCell<Vec<std::sync::Weak<Node>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `node` in an `Arc`, noted for [`force_captured`] when recorded during a capture.
fn captured(node: Node) -> Arc<Node> {
    let capturing = node.dev.capturing();
    let node = Arc::new(node);
    if capturing {
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
    let op = Op::Fill(value);
    let small = len * dtype.size_in_bytes() <= MAX_DEFERRED_FILL;
    if !fusion_enabled() || !op.fusable(&[], dtype) || !small {
        return ops::fill(dev, dtype, len, value).map(|b| Repr::Ready(Arc::new(b)));
    }
    Ok(Repr::Lazy(captured(Node {
        dev,
        stream: dev.stream() as usize,
        dtype,
        shape: Shape::new([len]),
        uniform: true,
        ops: 1,
        leaves: 0,
        state: Mutex::new(State::Pending {
            op,
            args: Vec::new(),
        }),
    })))
}

/// (operations, leaf reads, all uniform) of a node's operands.
fn tally(args: &[Operand]) -> (u32, u32, bool) {
    args.iter().fold((0, 0, true), |(o, l, u), a| match a {
        Operand::Leaf { layout, .. } => (o, l + 1, u && reads_one(layout)),
        Operand::Node(n) => (o + n.ops, l + n.leaves, u && n.uniform),
    })
}

/// How a node reads `s` (of `dtype`) through `l` (see the module docs for when a pending input
/// is inlined).
fn operand(s: &Repr, l: &Layout, dtype: DType) -> Result<Operand> {
    let node = match s {
        Repr::Ready(buf) => {
            // The node launches on the current stream (where it is recorded).
            buf.mark_used(buf.state().stream())?;
            return Ok(Operand::Leaf {
                buf: buf.clone(),
                layout: l.clone(),
                dtype,
            });
        }
        Repr::Lazy(node) => node,
    };
    let inline =
        node.uniform || (l.offset() == 0 && l.is_contiguous() && l.dims() == node.shape.dims());
    Ok(match node.done() {
        None if inline => Operand::Node(node.clone()),
        done => Operand::Leaf {
            buf: match done {
                Some(b) => b,
                None => force(node)?,
            },
            layout: l.clone(),
            dtype,
        },
    })
}

/// Runs `op` now with the single-op kernels; `out` is the result's dtype.
fn eager(
    dev: &'static DeviceState,
    op: Op,
    args: &[(&Buffer, &Layout, DType)],
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
        return Ok(b);
    }
    let dev = node.dev;
    let caller = dev.stream();
    let home = node.stream as cudarc::driver::sys::CUstream;
    if caller == home {
        return force_here(node);
    }
    if dev.capturing() {
        return force_outside_capture(node, home);
    }
    let prev = set_current_stream(dev.ordinal, home);
    let r = force_here(node);
    set_current_stream(dev.ordinal, prev);
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
    let dev = node.dev;
    let pool = set_capture(None);
    let prev = set_current_stream(dev.ordinal, home);
    let r = force_here(node);
    set_current_stream(dev.ordinal, prev);
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

/// [`force`] on the current stream.
fn force_here(node: &Arc<Node>) -> Result<Arc<Buffer>> {
    {
        let mut st = node.state.lock().unwrap();
        let (op, args) = match &*st {
            State::Done(b) => return Ok(b.clone()),
            State::Pending { op, args } => (*op, args),
        };
        // Every input computed: the single-op kernel does it, under the lock (a thread that
        // forces this node meanwhile waits for the result instead of computing it again).
        if args.iter().all(|a| match a {
            Operand::Leaf { .. } => true,
            Operand::Node(n) => n.is_done(),
        }) {
            let buf = Arc::new(run_op(node, op, args)?);
            *st = State::Done(buf.clone());
            return Ok(buf);
        }
    }
    let buf = match fused(node)? {
        Some(buf) => buf,
        None => {
            // No program budget left, or too many arguments for one kernel: pending inputs
            // first, then this op alone.
            let (op, args) = match &*node.state.lock().unwrap() {
                State::Done(b) => return Ok(b.clone()),
                State::Pending { op, args } => (*op, args.clone()),
            };
            for a in &args {
                if let Operand::Node(n) = a {
                    force(n)?;
                }
            }
            run_op(node, op, &args)?
        }
    };
    let buf = Arc::new(buf);
    let mut st = node.state.lock().unwrap();
    if let State::Done(b) = &*st {
        return Ok(b.clone()); // another thread got there first
    }
    *st = State::Done(buf.clone());
    Ok(buf)
}

/// `op` over `args`, every one of them computed, with the single-op kernels.
fn run_op(node: &Node, op: Op, args: &[Operand]) -> Result<Buffer> {
    let input = |a: &Operand| -> (Arc<Buffer>, Layout, DType) {
        match a {
            Operand::Leaf { buf, layout, dtype } => (buf.clone(), layout.clone(), *dtype),
            Operand::Node(n) => (
                n.done().expect("inputs are computed first"),
                done_layout(n, &node.shape),
                n.dtype,
            ),
        }
    };
    let held: Vec<(Arc<Buffer>, Layout, DType)> = args.iter().map(input).collect();
    for (b, _, _) in &held {
        note_capture_use(b);
    }
    let refs: Vec<(&Buffer, &Layout, DType)> = held.iter().map(|(b, l, d)| (&**b, l, *d)).collect();
    eager(node.dev, op, &refs, node.dtype, node.shape.elem_count())
}

/// How a consumer of shape `out` reads computed node `n`: element 0 everywhere when uniform,
/// else contiguously in its own (equal) shape.
fn done_layout(n: &Node, out: &Shape) -> Layout {
    if n.uniform {
        Layout::from_parts(out.clone(), vec![0; out.rank()], 0)
    } else {
        Layout::contiguous(out.clone())
    }
}

/// The expression program of a DAG and the arguments of one launch of it.
struct Gen<'a> {
    /// The root's shape: the iteration shape.
    shape: &'a Shape,
    code: Vec<Instr>,
    /// The program's inputs: buffers read through layouts of `shape`.
    inputs: Vec<(Arc<Buffer>, Layout, DType)>,
    /// Its parameters: the constants of scalar ops and fills (kernel arguments, so a chain
    /// that differs only in its constants reuses the kernel).
    params: Vec<(f64, DType)>,
    /// Nodes already emitted (held, so that their addresses stay theirs).
    memo: Vec<(Arc<Node>, Val)>,
}

impl Gen<'_> {
    fn push(&mut self, ins: Instr) -> Val {
        self.code.push(ins);
        (self.code.len() - 1) as Val
    }

    /// An input read through `layout`. A layout that reads one element (a uniform leaf, which
    /// may sit under a uniform node of another shape) becomes a broadcast of that element in
    /// the root's shape; equal reads share an input.
    fn leaf(&mut self, buf: Arc<Buffer>, layout: Layout, dtype: DType) -> Val {
        note_capture_use(&buf);
        let layout = if reads_one(&layout) {
            let rank = self.shape.rank();
            Layout::from_parts(self.shape.clone(), vec![0; rank], layout.offset())
        } else {
            layout
        };
        let same = |(b, l, _): &(Arc<Buffer>, Layout, DType)| {
            b.device_ptr() == buf.device_ptr()
                && l.offset() == layout.offset()
                && l.strides() == layout.strides()
        };
        let k = match self.inputs.iter().position(same) {
            Some(k) => k,
            None => {
                self.inputs.push((buf, layout, dtype));
                self.inputs.len() - 1
            }
        };
        self.push(Instr::Input(k as u32))
    }

    fn param(&mut self, v: f64, dtype: DType) -> Val {
        self.params.push((v, dtype));
        self.push(Instr::Param((self.params.len() - 1) as u32))
    }

    fn constant(&mut self, v: f64, dtype: DType) -> Val {
        self.push(Instr::Const(Scalar::new(v, dtype)))
    }

    fn operand(&mut self, a: &Operand) -> Val {
        match a {
            Operand::Leaf { buf, layout, dtype } => self.leaf(buf.clone(), layout.clone(), *dtype),
            Operand::Node(n) => self.node(n),
        }
    }

    /// `g * op'(s)`, with the arithmetic of the single-op backward kernels (`op_bwd_<op>` of
    /// `kernels/scalar_ops.cuh`, the table of `kiln_core::composed_unary_backward`), so that
    /// the generated code is theirs inlined.
    fn unary_backward(&mut self, op: UnaryOp, s: Val, g: Val, dtype: DType) -> Val {
        use BinaryOp::{Div, Mul, Sub};
        let bin = |g_: &mut Self, op, a, b| g_.push(Instr::Binary(op, a, b));
        let un = |g_: &mut Self, op, a| g_.push(Instr::Unary(op, a));
        match op {
            UnaryOp::Exp => bin(self, Mul, g, s),
            UnaryOp::Log => bin(self, Div, g, s),
            UnaryOp::Sqrt | UnaryOp::Square => {
                let two = self.constant(2.0, dtype);
                let d = bin(self, Mul, s, two);
                bin(self, if op == UnaryOp::Sqrt { Div } else { Mul }, g, d)
            }
            UnaryOp::Recip => {
                let ss = bin(self, Mul, s, s);
                let d = bin(self, Mul, g, ss);
                un(self, UnaryOp::Neg, d)
            }
            UnaryOp::Sin => {
                let c = un(self, UnaryOp::Cos, s);
                bin(self, Mul, g, c)
            }
            UnaryOp::Cos => {
                let sn = un(self, UnaryOp::Sin, s);
                let d = bin(self, Mul, g, sn);
                un(self, UnaryOp::Neg, d)
            }
            UnaryOp::Tanh => {
                let one = self.constant(1.0, dtype);
                let ss = bin(self, Mul, s, s);
                let d = bin(self, Sub, one, ss);
                bin(self, Mul, g, d)
            }
            UnaryOp::Sigmoid => {
                let one = self.constant(1.0, dtype);
                let d = bin(self, Sub, one, s);
                let d = bin(self, Mul, s, d);
                bin(self, Mul, g, d)
            }
            UnaryOp::Relu | UnaryOp::Abs => {
                let d = un(self, UnaryOp::Sign, s);
                bin(self, Mul, g, d)
            }
            UnaryOp::Neg | UnaryOp::Gelu | UnaryOp::Sign | UnaryOp::Floor | UnaryOp::Ceil => {
                unreachable!("only ops with a backward kernel are recorded (Op::fusable)")
            }
        }
    }

    fn node(&mut self, n: &Arc<Node>) -> Val {
        if let Some(&(_, r)) = self.memo.iter().find(|(m, _)| Arc::ptr_eq(m, n)) {
            return r;
        }
        let pending = match &*n.state.lock().unwrap() {
            State::Done(b) => Err(b.clone()),
            State::Pending { op, args } => Ok((*op, args.clone())),
        };
        let r = match pending {
            Err(buf) => self.leaf(buf, done_layout(n, self.shape), n.dtype),
            Ok((op, args)) => {
                let regs: Vec<Val> = args.iter().map(|a| self.operand(a)).collect();
                match op {
                    Op::Unary(u) => self.push(Instr::Unary(u, regs[0])),
                    Op::Binary(b) => self.push(Instr::Binary(b, regs[0], regs[1])),
                    Op::Scalar { op, value, lhs } => {
                        let c = self.param(value, n.dtype);
                        let (x, y) = if lhs { (c, regs[0]) } else { (regs[0], c) };
                        self.push(Instr::Binary(op, x, y))
                    }
                    Op::UnaryBwd(u) => self.unary_backward(u, regs[0], regs[1], n.dtype),
                    Op::Fill(v) => self.param(v, n.dtype),
                    Op::Compare(c) => self.push(Instr::Cmp(c, regs[0], regs[1])),
                    Op::Cast(to) => self.push(Instr::Cast(to, regs[0])),
                    Op::Where => self.push(Instr::Where(regs[0], regs[1], regs[2])),
                }
            }
        };
        self.memo.push((n.clone(), r));
        r
    }
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

/// Generates, compiles (once per program) and launches the kernel of `root`'s pending DAG;
/// `None` when the program is new and the device's program budget is spent, or the DAG needs
/// more arguments than one kernel takes.
fn fused(root: &Arc<Node>) -> Result<Option<Buffer>> {
    run_program(root, None)
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
    let plain = l.offset() == 0 && l.is_contiguous() && l.dims() == node.shape.dims();
    if !fusion_enabled()
        || node.shape.rank() == 0
        || !matches!(node.dtype, DType::F32 | DType::F64)
        || !matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min)
        || !plain
        || node.shape.elem_count() == 0
        || node.is_done()
    {
        return Ok(None);
    }
    run_program(node, Some(op))
}

/// The kernel of `root`'s pending DAG, as an expression program (`expr_eval.rs` generates,
/// compiles once per program and launches it). With `reduce`, the 1-element reduction of it
/// over every axis instead of its elements. `None`: the program budget is spent, or the DAG
/// cannot run as one kernel (too many arguments or dimensions).
fn run_program(root: &Arc<Node>, reduce: Option<ReduceOp>) -> Result<Option<Buffer>> {
    let dev = root.dev;
    dev.bind()?;
    if root.shape.elem_count() == 0 {
        return alloc(dev, 0).map(Some);
    }
    let mut g = Gen {
        shape: &root.shape,
        code: Vec::new(),
        inputs: Vec::new(),
        params: Vec::new(),
        memo: Vec::new(),
    };
    let mut out = g.node(root);
    let mut axes = Vec::new();
    if let Some(op) = reduce {
        let combine = match op {
            ReduceOp::Max => Combine::Max,
            ReduceOp::Min => Combine::Min,
            _ => Combine::Sum,
        };
        out = g.push(Instr::Reduce(combine, out));
        axes = (0..root.shape.rank() as isize).collect();
    }
    let dtypes: Vec<DType> = g.inputs.iter().map(|(_, _, d)| *d).collect();
    let param_dtypes: Vec<DType> = g.params.iter().map(|(_, d)| *d).collect();
    let parts = Parts {
        inputs: &dtypes,
        params: &param_dtypes,
        code: &g.code,
        outputs: &[out],
        axes: &axes,
    };
    let layouts: Vec<&Layout> = g.inputs.iter().map(|(_, l, _)| l).collect();
    let params: Vec<f64> = g.params.iter().map(|(v, _)| *v).collect();
    let planned = planned_parts(parts, &root.shape, &layouts, &params)?;
    // Every recorded op is a valid instruction (`Op::fusable` allows a subset of what the IR
    // does); should one not be, the chain still runs, op by op.
    debug_assert!(planned.is_some(), "an invalid program: {:?}", g.code);
    let Some(planned) = planned else {
        return Ok(None);
    };
    let bufs: Vec<Arc<Buffer>> = g.inputs.iter().map(|(b, _, _)| b.clone()).collect();
    let caller = Caller::Lazy {
        budget: program_budget(),
    };
    let outs = run_planned(dev, &planned, &bufs, &layouts, &params, caller)?;
    Ok(outs.map(|mut o| o.remove(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_element_reads_are_uniform() {
        assert!(reads_one(&Layout::contiguous(Shape::scalar())));
        assert!(reads_one(&Layout::from_parts(
            Shape::new([3, 4]),
            vec![0, 0],
            5
        )));
        assert!(reads_one(&Layout::from_parts(
            Shape::new([1, 4]),
            vec![7, 0],
            0
        )));
        assert!(!reads_one(&Layout::from_parts(
            Shape::new([3, 4]),
            vec![0, 1],
            0
        )));
    }
}
