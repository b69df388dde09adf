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
//! DAG becomes one kernel, generated as CUDA C (by `lazygen.rs`, which needs no device),
//! compiled by NVRTC once per distinct program (memoized per device and cached on disk like
//! `kernels/`), and launched once. A node nobody reads
//! never runs.
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

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::{BinaryOp, CmpOp, DType, Error, Layout, ReduceOp, Result, Shape, UnaryOp};

use crate::device::{DeviceState, KERNEL_EPOCH, set_capture, set_current_stream};
use crate::launch::{Args, collapse, fits_u32};
use crate::lazygen::{Ins, Program, source};
use crate::memory::{Buffer, alloc, duplicate, note_capture_use};
use crate::ops::{self, tname};

/// Most operations in one node's DAG (counted with repeats).
pub(crate) const MAX_OPS: u32 = 48;
/// Most leaf reads in one node's DAG (counted with repeats).
pub(crate) const MAX_LEAVES: u32 = 12;
/// Most strided leaves, and uniform leaves plus constants, in one generated kernel: bounds its
/// argument list (under 2 KiB, within `launch::Args`). The caps above keep every DAG under
/// these (a constant or uniform read stands for at least one counted op); a DAG that still
/// exceeds them is computed in parts rather than overflowing the argument buffer.
const KERNEL_LEAVES: usize = 16;
const KERNEL_SCALARS: usize = 48;

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

static FUSED_PROGRAMS: AtomicU64 = AtomicU64::new(0);
static FUSED_NANOS: AtomicU64 = AtomicU64::new(0);

/// Fused elementwise programs built so far in this process (every device), and the host
/// nanoseconds spent compiling them with NVRTC or loading them from the disk cache: the
/// one-time cost of kernel fusion (see `KILN_CUDA_FUSE`).
pub fn fused_program_stats() -> (u64, u64) {
    (
        FUSED_PROGRAMS.load(Ordering::Relaxed),
        FUSED_NANOS.load(Ordering::Relaxed),
    )
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

/// The program of a DAG and the arguments of one launch of it.
struct Gen<'a> {
    shape: &'a Shape,
    code: Vec<Ins>,
    leaves: Vec<(Arc<Buffer>, Layout, DType)>,
    unis: Vec<(Arc<Buffer>, u64, DType)>,
    consts: Vec<(f64, DType)>,
    /// Nodes already emitted (held, so that their addresses stay theirs).
    memo: Vec<(Arc<Node>, u16)>,
}

impl Gen<'_> {
    fn push(&mut self, ins: Ins) -> u16 {
        self.code.push(ins);
        (self.code.len() - 1) as u16
    }

    fn leaf(&mut self, buf: Arc<Buffer>, layout: Layout, dtype: DType) -> u16 {
        note_capture_use(&buf);
        if reads_one(&layout) {
            let ptr = buf.device_ptr() + (layout.offset() * dtype.size_in_bytes()) as u64;
            let k = match self.unis.iter().position(|(_, p, _)| *p == ptr) {
                Some(k) => k,
                None => {
                    self.unis.push((buf, ptr, dtype));
                    self.unis.len() - 1
                }
            };
            return self.push(Ins::Uni(k as u8));
        }
        let same = |(b, l, _): &(Arc<Buffer>, Layout, DType)| {
            b.device_ptr() == buf.device_ptr()
                && l.offset() == layout.offset()
                && l.strides() == layout.strides()
        };
        let k = match self.leaves.iter().position(same) {
            Some(k) => k,
            None => {
                self.leaves.push((buf, layout, dtype));
                self.leaves.len() - 1
            }
        };
        self.push(Ins::Leaf(k as u8))
    }

    fn constant(&mut self, v: f64, dtype: DType) -> u16 {
        self.consts.push((v, dtype));
        self.push(Ins::Const((self.consts.len() - 1) as u8))
    }

    fn operand(&mut self, a: &Operand) -> u16 {
        match a {
            Operand::Leaf { buf, layout, dtype } => self.leaf(buf.clone(), layout.clone(), *dtype),
            Operand::Node(n) => self.node(n),
        }
    }

    fn node(&mut self, n: &Arc<Node>) -> u16 {
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
                let regs: Vec<u16> = args.iter().map(|a| self.operand(a)).collect();
                match op {
                    Op::Unary(u) => self.push(Ins::Unary(u, regs[0])),
                    Op::Binary(b) => self.push(Ins::Binary(b, regs[0], regs[1])),
                    Op::Scalar { op, value, lhs } => {
                        let c = self.constant(value, n.dtype);
                        let (x, y) = if lhs { (c, regs[0]) } else { (regs[0], c) };
                        self.push(Ins::Binary(op, x, y))
                    }
                    Op::UnaryBwd(u) => self.push(Ins::Bwd(u, regs[0], regs[1])),
                    Op::Fill(v) => self.constant(v, n.dtype),
                    Op::Compare(c) => self.push(Ins::Cmp(c, regs[0], regs[1])),
                    Op::Cast(to) => self.push(Ins::Cast(to, regs[0])),
                    Op::Where => self.push(Ins::Where(regs[0], regs[1], regs[2])),
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
/// without writing its elements: one launch for a small chain (a loss), two (a partial result
/// per block, then their combination) for a large one. `None` when this does not apply (not a
/// pending node read in its own layout, fusion off, not sum/max/min) or the program budget is
/// spent; the caller then forces the node and reduces the buffer.
pub(crate) fn reduce_all(s: &Repr, l: &Layout, op: ReduceOp) -> Result<Option<Buffer>> {
    let Repr::Lazy(node) = s else {
        return Ok(None);
    };
    let plain = l.offset() == 0 && l.is_contiguous() && l.dims() == node.shape.dims();
    if !fusion_enabled()
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

/// Threads per block of the fused kernels (the block reduction needs a multiple of 32).
const FUSED_BLOCK: u32 = 256;

/// Blocks of a fused reduction over `n` elements: a function of `n` and the device alone, so
/// the order of the sum (and so its result) is the same every time. One block up to 4,096.
fn reduce_blocks(dev: &DeviceState, n: usize) -> usize {
    n.div_ceil(FUSED_BLOCK as usize * 16)
        .min(dev.sm_count as usize * 2)
        .max(1)
}

/// The kernel of `root`'s pending DAG: generated, compiled once per program, launched. With
/// `reduce`, the 1-element reduction of it instead of its elements.
fn run_program(root: &Arc<Node>, reduce: Option<ReduceOp>) -> Result<Option<Buffer>> {
    const OP: &str = "fused elementwise";
    let dev = root.dev;
    dev.bind()?;
    let dtype = root.dtype;
    let n = root.shape.elem_count();
    if n == 0 {
        return alloc(dev, 0).map(Some);
    }
    let mut g = Gen {
        shape: &root.shape,
        code: Vec::new(),
        leaves: Vec::new(),
        unis: Vec::new(),
        consts: Vec::new(),
        memo: Vec::new(),
    };
    g.node(root);
    if g.leaves.len() > KERNEL_LEAVES || g.unis.len() + g.consts.len() > KERNEL_SCALARS {
        // Too many arguments for one kernel (see KERNEL_LEAVES): the caller computes the
        // inputs first.
        return Ok(None);
    }
    let strides: Vec<&[usize]> = g.leaves.iter().map(|(_, l, _)| l.strides()).collect();
    let offsets: Vec<usize> = g.leaves.iter().map(|(_, l, _)| l.offset()).collect();
    let (d, ss) = collapse(OP, root.shape.dims(), &strides, &offsets)?;
    let contig = d.rank == 0 || (d.rank == 1 && ss.iter().all(|s| s.s[0] == 1));
    let at = |(b, l, d): &(Arc<Buffer>, Layout, DType)| {
        b.device_ptr() + (l.offset() * d.size_in_bytes()) as u64
    };
    let vec = contig
        && reduce.is_none()
        && g.leaves
            .iter()
            .all(|leaf| leaf.2 == dtype && at(leaf).is_multiple_of(16));
    let layouts: Vec<&Layout> = g.leaves.iter().map(|(_, l, _)| l).collect();
    let program = Program {
        dtype,
        wide: n >= (1 << 31) || !fits_u32(&layouts),
        contig,
        vec,
        leaves: g.leaves.iter().map(|(_, _, d)| *d).collect(),
        unis: g.unis.iter().map(|(_, _, d)| *d).collect(),
        consts: g.consts.iter().map(|(_, d)| *d).collect(),
        code: std::mem::take(&mut g.code),
        reduce,
    };
    let build = || {
        let t0 = std::time::Instant::now();
        let bin = crate::nvrtc::load_or_compile_source("fused.cu", &source(&program), dev.arch)
            .map_err(|e| Error::backend("nvrtc", format!("compiling a fused kernel: {e}")))?;
        FUSED_PROGRAMS.fetch_add(1, Ordering::Relaxed);
        FUSED_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok((bin, c"fused".to_owned()))
    };
    let Some(f) = dev.generated_func(&program, program_budget(), build)? else {
        return Ok(None);
    };
    let per_thread = if vec { 16 / dtype.size_in_bytes() } else { 1 };
    let (grid, outs) = match reduce {
        None => (dev.grid_1d(n.div_ceil(per_thread) as u64, FUSED_BLOCK), n),
        Some(_) => {
            let blocks = reduce_blocks(dev, n);
            ((blocks as u32, 1), blocks)
        }
    };
    let out = alloc(dev, outs * dtype.size_in_bytes())?;
    let mut a = Args::new();
    a.push(out.device_ptr()).push(n as u64);
    if !contig {
        a.push(d);
    }
    for (leaf, s) in g.leaves.iter().zip(&ss) {
        if contig {
            a.push(at(leaf));
        } else {
            a.push(leaf.0.device_ptr()).push(*s);
        }
    }
    for (_, p, _) in &g.unis {
        a.push(*p);
    }
    for &(c, d) in &g.consts {
        match d {
            DType::F32 => a.push(c as f32),
            DType::U8 => a.push(c as u8),
            _ => a.push(c),
        };
    }
    let p = a.ptrs();
    let kernel = (f.0 as usize, KERNEL_EPOCH.load(Ordering::SeqCst));
    crate::profile::fused_ops(kernel, || {
        crate::profile::lazy_op_names(&program.code, reduce)
    });
    dev.launch(OP, f, grid, FUSED_BLOCK, 0, p)?;
    match reduce {
        Some(op) if outs > 1 => {
            let total = alloc(dev, dtype.size_in_bytes())?;
            ops::combine_partials(dev, op.name(), tname(dtype), &out, &total, 1, outs, 1)?;
            Ok(Some(total))
        }
        _ => Ok(Some(out)),
    }
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
