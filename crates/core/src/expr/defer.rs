//! The deferral graph: elementwise ops recorded instead of run, and the expression program of
//! a recorded chain.
//!
//! A backend that fuses (the CUDA backend always, the CPU backend for large tensors) does not
//! run `unary`, `binary`, `binary_scalar`, `unary_backward`, comparisons, casts, `where` and
//! small fills when they are called: it records a [`Node`] whose operands are computed buffers
//! or other nodes. The first op that needs the values *forces* the node: [`build`] turns its
//! pending DAG into one program of this IR (constants become parameters, a `unary_backward`
//! the arithmetic of its single-op kernel, so the program needs no instruction of its own),
//! which the backend runs in one pass. Both backends share this module, so a chain is the same
//! program, with the same bits, on either.
//!
//! What stays with the backend ([`Deferral`]): its buffer type, the context a node runs in
//! (the CUDA backend's device and stream), its single-op kernels for a node whose inputs are
//! all computed, and how it runs a program.
//!
//! Two rules keep programs simple. A pending operand is inlined when it is read in its own
//! shape, contiguously, or when its value is the same at every element (a fill, a scalar, a
//! chain of those), through any view; any other view forces it first and reads it as a leaf
//! ([`operand`]). And a node that would exceed [`MAX_OPS`] operations or [`MAX_LEAVES`] leaf
//! reads forces its operands first ([`node`]), so that programs stay bounded.
//!
//! A pending value that several chains read is computed once: when the program of one of
//! them computes it, and another pending node outside that program also reads it, the
//! program stores it as an extra output ([`Built::extra`]), and the other chain later reads
//! the stored value instead of recomputing it from its leaves. Only values with two or more
//! leaf reads are stored so (recomputing one read costs no more than storing and reading
//! back), and only for pending readers: a tensor handle may be a temporary that nobody reads
//! again, and storing for it would cost a write that today's program does not pay.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::ir::{Combine, Instr, Val, rules};
use crate::{BinaryOp, CmpOp, DType, Layout, ReduceOp, Result, Shape, UnaryOp};

/// Most operations in one node's DAG (counted with repeats).
pub const MAX_OPS: u32 = 48;
/// Most leaf reads in one node's DAG (counted with repeats).
pub const MAX_LEAVES: u32 = 12;
/// Most values a program stores besides its root ([`Built::extra`]).
pub const MAX_EXTRA: usize = 4;

/// What a backend supplies to the deferral graph.
pub trait Deferral: Sized + 'static {
    /// A computed buffer (shared: a node and the tensors reading it hold it together).
    type Buf: Clone + Send + Sync;
    /// Where a node runs (the device, a stream): recorded with the node.
    type Ctx: Copy + Send + Sync;
    /// Whether two buffers are the same memory (equal reads of it share a program input).
    fn same_buf(a: &Self::Buf, b: &Self::Buf) -> bool;
    /// Called for every buffer a program reads (the CUDA backend notes reads during a graph
    /// capture).
    fn note_leaf(_buf: &Self::Buf) {}
}

/// One deferred elementwise op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
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

/// Whether `op`'s gradient rule can be recorded: one whose derivative is not zero (a zero
/// gradient is a fill, not a chain) and whose rule lowers at `dtype`.
fn has_backward(op: UnaryOp, dtype: DType) -> bool {
    matches!(rules::unary_vjp_program(op, dtype), Ok(Some(_)))
}

impl Op {
    /// The op's name, for errors.
    pub fn name(self) -> &'static str {
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
    /// among the floats and u8.
    pub fn fusable(self, ins: &[DType], out: DType) -> bool {
        let float = |d: DType| d.is_float();
        match self {
            Op::Unary(u) => float(out) && u.supports(out),
            Op::Binary(b) | Op::Scalar { op: b, .. } => float(out) && b.supports(out),
            Op::UnaryBwd(u) => float(out) && has_backward(u, out),
            Op::Fill(_) | Op::Where => float(out),
            Op::Compare(_) => float(ins[0]),
            Op::Cast(to) => [ins[0], to].iter().all(|d| d.is_float() || *d == DType::U8),
        }
    }
}

/// An input of a node: a computed buffer read through a layout of the node's shape, or another
/// node (read in its own shape, or uniform).
pub enum Operand<D: Deferral> {
    Leaf {
        buf: D::Buf,
        layout: Layout,
        dtype: DType,
    },
    Node(Arc<Node<D>>),
}

impl<D: Deferral> Clone for Operand<D> {
    fn clone(&self) -> Self {
        match self {
            Operand::Leaf { buf, layout, dtype } => Operand::Leaf {
                buf: buf.clone(),
                layout: layout.clone(),
                dtype: *dtype,
            },
            Operand::Node(n) => Operand::Node(n.clone()),
        }
    }
}

/// A deferred elementwise op, and its result once forced.
pub struct Node<D: Deferral> {
    ctx: D::Ctx,
    dtype: DType,
    shape: Shape,
    /// The value is the same at every element (no operand varies per element).
    uniform: bool,
    /// Operations and leaf reads in the DAG below, counted with repeats (for the caps).
    ops: u32,
    leaves: u32,
    /// The op and its operands until the node is computed (then `None`: the operands, and
    /// the buffers they hold, are released).
    pending: Mutex<Option<(Op, Vec<Operand<D>>)>>,
    done: OnceLock<D::Buf>,
    /// How many pending nodes read this one as an operand (they release it when computed
    /// or dropped): a program that computes this node stores it for them.
    readers: AtomicU32,
}

/// Gives up a node's pending work: its operands, and its place among their readers.
fn release<D: Deferral>(pending: &mut Option<(Op, Vec<Operand<D>>)>) {
    if let Some((_, args)) = pending.take() {
        for a in &args {
            if let Operand::Node(n) = a {
                n.readers.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl<D: Deferral> Drop for Node<D> {
    fn drop(&mut self) {
        release(self.pending.get_mut().unwrap_or_else(|e| e.into_inner()));
    }
}

impl<D: Deferral> Node<D> {
    /// A node of `op` over `args` (read through layouts of `shape`), of dtype `dtype`.
    /// `tally` is [`tally`]`(&args)`.
    fn new(
        ctx: D::Ctx,
        op: Op,
        args: Vec<Operand<D>>,
        (ops, leaves, uniform): (u32, u32, bool),
        shape: Shape,
        dtype: DType,
    ) -> Self {
        for a in &args {
            if let Operand::Node(n) = a {
                n.readers.fetch_add(1, Ordering::Relaxed);
            }
        }
        Node {
            ctx,
            dtype,
            uniform: uniform || shape.elem_count() <= 1,
            shape,
            ops: ops + 1,
            leaves,
            pending: Mutex::new(Some((op, args))),
            done: OnceLock::new(),
            readers: AtomicU32::new(0),
        }
    }
    pub fn ctx(&self) -> D::Ctx {
        self.ctx
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn len_bytes(&self) -> usize {
        self.shape.elem_count() * self.dtype.size_in_bytes()
    }
    /// The computed buffer, if the node was forced.
    pub fn done(&self) -> Option<&D::Buf> {
        self.done.get()
    }
    pub fn is_done(&self) -> bool {
        self.done.get().is_some()
    }
    /// The op and operands, while pending.
    /// Whether the node's result or one of its pending operands is f16 or bf16 (a backend
    /// whose 16-bit arithmetic runs only in its fused evaluator runs such a node there).
    pub fn involves_half(&self) -> bool {
        self.dtype.is_half()
            || self.pending().is_some_and(|(_, args)| {
                args.iter().any(|a| match a {
                    Operand::Leaf { dtype, .. } => dtype.is_half(),
                    Operand::Node(n) => n.dtype.is_half(),
                })
            })
    }

    fn pending(&self) -> Option<(Op, Vec<Operand<D>>)> {
        self.pending.lock().unwrap().clone()
    }

    /// Stores `buf` as the node's value and releases its operands; returns the value, which
    /// is another thread's when that one finished first.
    pub fn finish(&self, buf: D::Buf) -> D::Buf {
        let mut pending = self.pending.lock().unwrap();
        let value = self.done.get_or_init(|| buf).clone();
        release(&mut pending);
        value
    }
}

/// (operations, leaf reads, all uniform) of a node's operands.
fn tally<D: Deferral>(args: &[Operand<D>]) -> (u32, u32, bool) {
    args.iter().fold((0, 0, true), |(o, l, u), a| match a {
        Operand::Leaf { layout, .. } => (o, l + 1, u && layout.reads_one()),
        Operand::Node(n) => (o + n.ops, l + n.leaves, u && n.uniform),
    })
}

/// How a node reads pending-or-computed node `n` (of `dtype`) through `l`: inlined when read
/// in its own shape contiguously or when uniform, else as a leaf of its value (forced with
/// `force` if needed).
pub fn operand<D: Deferral>(
    n: &Arc<Node<D>>,
    l: &Layout,
    dtype: DType,
    force: impl Fn(&Arc<Node<D>>) -> Result<D::Buf>,
) -> Result<Operand<D>> {
    let inline = n.uniform || (l.offset() == 0 && l.is_contiguous() && l.dims() == n.shape.dims());
    Ok(match n.done() {
        None if inline => Operand::Node(n.clone()),
        done => Operand::Leaf {
            buf: match done {
                Some(b) => b.clone(),
                None => force(n)?,
            },
            layout: l.clone(),
            dtype,
        },
    })
}

/// A node of `op` over `args` (read through layouts of `shape`). When the DAG would exceed a
/// cap, pending operands are forced first with `force` and read as leaves.
pub fn node<D: Deferral>(
    ctx: D::Ctx,
    op: Op,
    mut args: Vec<Operand<D>>,
    shape: &Shape,
    dtype: DType,
    force: impl Fn(&Arc<Node<D>>) -> Result<D::Buf>,
) -> Result<Arc<Node<D>>> {
    let mut t = tally(&args);
    if t.0 + 1 > MAX_OPS || t.1 > MAX_LEAVES {
        for a in args.iter_mut() {
            if let Operand::Node(n) = a {
                // An inlined operand is read in its own (this) shape, or is uniform.
                *a = Operand::Leaf {
                    buf: force(n)?,
                    layout: done_layout(n, shape),
                    dtype: n.dtype,
                };
            }
        }
        t = tally(&args);
    }
    Ok(Arc::new(Node::new(ctx, op, args, t, shape.clone(), dtype)))
}

/// A deferred fill of `len` elements of `dtype` (a leafless, uniform node).
pub fn fill<D: Deferral>(ctx: D::Ctx, dtype: DType, len: usize, value: f64) -> Arc<Node<D>> {
    let leafless = (0, 0, true);
    Arc::new(Node::new(
        ctx,
        Op::Fill(value),
        Vec::new(),
        leafless,
        Shape::new([len]),
        dtype,
    ))
}

/// How a consumer of shape `out` reads computed node `n`: element 0 everywhere when uniform,
/// else contiguously in its own (equal) shape.
fn done_layout<D: Deferral>(n: &Node<D>, out: &Shape) -> Layout {
    if n.uniform {
        Layout::from_parts(out.clone(), vec![0; out.rank()], 0)
    } else {
        Layout::contiguous(out.clone())
    }
}

/// The operands of `node`, every one computed, as (buffer, layout, dtype) for its single-op
/// kernel.
///
/// # Panics
/// When an operand node was not forced first.
pub fn computed_args<D: Deferral>(
    node: &Node<D>,
    args: &[Operand<D>],
) -> Vec<(D::Buf, Layout, DType)> {
    args.iter()
        .map(|a| match a {
            Operand::Leaf { buf, layout, dtype } => (buf.clone(), layout.clone(), *dtype),
            Operand::Node(n) => (
                n.done().expect("operands are computed first").clone(),
                done_layout(n, &node.shape),
                n.dtype,
            ),
        })
        .collect()
}

/// Computes `node` (unless done) the way both backends do:
/// - every operand computed: `run_op` (the single-op kernel), under the node's lock, so that
///   a thread forcing the same node meanwhile waits for the result instead of recomputing it;
/// - else `fused`: one program for the whole pending DAG;
/// - when that declines (`None`: no program budget left, too many arguments), the pending
///   operands through `force`, then `run_op`.
pub fn force_with<D: Deferral>(
    node: &Arc<Node<D>>,
    run_op: impl Fn(&Node<D>, Op, &[Operand<D>]) -> Result<D::Buf>,
    fused: impl FnOnce(&Arc<Node<D>>) -> Result<Option<D::Buf>>,
    force: impl Fn(&Arc<Node<D>>) -> Result<D::Buf>,
) -> Result<D::Buf> {
    {
        let mut pending = node.pending.lock().unwrap();
        let Some((op, args)) = &*pending else {
            return Ok(node.done().expect("a node without work is done").clone());
        };
        if args.iter().all(|a| match a {
            Operand::Leaf { .. } => true,
            Operand::Node(n) => n.is_done(),
        }) {
            let buf = run_op(node, *op, args)?;
            let value = node.done.get_or_init(|| buf).clone();
            release(&mut pending);
            return Ok(value);
        }
    }
    let buf = match fused(node)? {
        Some(buf) => buf,
        None => {
            let Some((op, args)) = node.pending() else {
                return Ok(node.done().expect("a node without work is done").clone());
            };
            for a in &args {
                if let Operand::Node(n) = a {
                    force(n)?;
                }
            }
            run_op(node, op, &args)?
        }
    };
    Ok(node.finish(buf))
}

/// The expression program of a node's pending DAG and the arguments of one run of it.
pub struct Built<D: Deferral> {
    pub code: Vec<Instr>,
    /// The program's inputs: buffers read through layouts of the root's shape.
    pub inputs: Vec<(D::Buf, Layout, DType)>,
    /// Its parameters: the constants of scalar ops and fills (arguments, so that a chain that
    /// differs only in its constants is the same program).
    pub params: Vec<(f64, DType)>,
    /// The value computed: the root, or its reduction.
    pub out: Val,
    /// Pending nodes of the DAG that pending nodes outside it also read, with their values:
    /// the program stores each as an output after `out`, and the caller gives each its
    /// buffer with [`Node::finish`] (at most [`MAX_EXTRA`]; see the module docs).
    pub extra: Vec<(Arc<Node<D>>, Val)>,
    /// The reduced axes, if reducing, else empty.
    pub axes: Vec<isize>,
}

/// The program of `root`'s pending DAG; with `reduce`, of its reduction over the given axes
/// (of `root`'s shape) instead of its elements.
pub fn build<D: Deferral>(root: &Arc<Node<D>>, reduce: Option<(ReduceOp, &[usize])>) -> Built<D> {
    let mut g = Gen {
        shape: &root.shape,
        code: Vec::new(),
        inputs: Vec::new(),
        params: Vec::new(),
        memo: Vec::new(),
    };
    let mut out = g.node(root);
    let extra = if store_shared() {
        g.shared(root, reduce.is_some())
    } else {
        Vec::new()
    };
    let mut axes = Vec::new();
    if let Some((op, over)) = reduce {
        let combine = match op {
            ReduceOp::Max => Combine::Max,
            ReduceOp::Min => Combine::Min,
            _ => Combine::Sum,
        };
        out = g.push(Instr::Reduce(combine, out));
        axes = over.iter().map(|&a| a as isize).collect();
    }
    Built {
        code: g.code,
        inputs: g.inputs,
        params: g.params,
        out,
        extra,
        axes,
    }
}

/// Whether programs store the shared values of their DAG ([`Built::extra`]): yes, unless
/// `KILN_DEFER_SHARED=0` (read once; for measuring what storing them changes).
fn store_shared() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !std::env::var("KILN_DEFER_SHARED").is_ok_and(|v| v.trim() == "0"))
}

/// Whether a reduction `op` of pending `n`, read through `l`, can run in the program of `n`'s
/// chain: a sum, maximum or minimum of floats, over `n` read in its own shape, with elements.
pub fn fusable_reduction<D: Deferral>(n: &Node<D>, l: &Layout, op: ReduceOp) -> bool {
    let plain = l.offset() == 0 && l.is_contiguous() && l.dims() == n.shape.dims();
    plain
        && n.shape.rank() > 0
        && n.shape.elem_count() > 0
        && n.dtype.is_float()
        && matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min)
        && !n.is_done()
}

struct Gen<'a, D: Deferral> {
    /// The root's shape: the iteration shape.
    shape: &'a Shape,
    code: Vec<Instr>,
    inputs: Vec<(D::Buf, Layout, DType)>,
    params: Vec<(f64, DType)>,
    /// Nodes already emitted (held, so that their addresses stay theirs), with whether they
    /// were pending and how many reads of them the DAG holds.
    memo: Vec<Emitted<D>>,
}

struct Emitted<D: Deferral> {
    node: Arc<Node<D>>,
    val: Val,
    pending: bool,
    reads: u32,
}

impl<D: Deferral> Gen<'_, D> {
    fn push(&mut self, ins: Instr) -> Val {
        self.code.push(ins);
        (self.code.len() - 1) as Val
    }

    /// An input read through `layout`. A layout that reads one element (a uniform leaf, which
    /// may sit under a uniform node of another shape) becomes a broadcast of that element in
    /// the root's shape; equal reads share an input.
    fn leaf(&mut self, buf: D::Buf, layout: Layout, dtype: DType) -> Val {
        D::note_leaf(&buf);
        let layout = if layout.reads_one() {
            let rank = self.shape.rank();
            Layout::from_parts(self.shape.clone(), vec![0; rank], layout.offset())
        } else {
            layout
        };
        let same = |(b, l, _): &(D::Buf, Layout, DType)| {
            D::same_buf(b, &buf) && l.offset() == layout.offset() && l.strides() == layout.strides()
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

    fn operand(&mut self, a: &Operand<D>) -> Val {
        match a {
            Operand::Leaf { buf, layout, dtype } => self.leaf(buf.clone(), layout.clone(), *dtype),
            Operand::Node(n) => self.node(n),
        }
    }

    /// `g * op'(s)`: the op table's rule spliced in, the program every backend's
    /// `unary_backward` runs, so the same bits deferred or not.
    fn unary_backward(&mut self, op: UnaryOp, s: Val, g: Val, dtype: DType) -> Val {
        let rule = rules::unary_vjp_program(op, dtype)
            .ok()
            .flatten()
            .expect("only ops with a nonzero rule that lowers are recorded (Op::fusable)");
        rules::splice(&rule, &[s, g], |ins, _| self.push(ins))[0]
    }

    /// The pending nodes of the DAG below `root` that pending nodes outside it read too, and
    /// `root` itself when `reducing` (its elements are otherwise not stored) and any pending
    /// node reads it: elementwise values in the root's shape, of two or more leaf reads.
    fn shared(&self, root: &Arc<Node<D>>, reducing: bool) -> Vec<(Arc<Node<D>>, Val)> {
        let mut out = Vec::new();
        for e in &self.memo {
            let n = &e.node;
            let is_root = Arc::ptr_eq(n, root);
            // The root's one read is the build's own, not a reader's.
            let inside = if is_root { 0 } else { e.reads };
            let outside = n.readers.load(Ordering::Relaxed).saturating_sub(inside);
            if e.pending
                && (!is_root || reducing)
                && outside > 0
                && !n.uniform
                && n.leaves >= 2
                && n.shape.dims() == root.shape.dims()
                && out.len() < MAX_EXTRA
            {
                out.push((n.clone(), e.val));
            }
        }
        out
    }

    fn node(&mut self, n: &Arc<Node<D>>) -> Val {
        if let Some(e) = self.memo.iter_mut().find(|e| Arc::ptr_eq(&e.node, n)) {
            e.reads += 1;
            return e.val;
        }
        let pending = n.pending();
        let was_pending = pending.is_some();
        let r = match pending {
            None => {
                let buf = n.done().expect("a node without work is done").clone();
                self.leaf(buf, done_layout(n, self.shape), n.dtype)
            }
            Some((op, args)) => {
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
        self.memo.push(Emitted {
            node: n.clone(),
            val: r,
            pending: was_pending,
            reads: 1,
        });
        r
    }
}
