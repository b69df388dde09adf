//! `Var<B>`: a tensor plus its place in the recorded graph, and the backward pass.
//!
//! Each `Var` is an `Arc` to shared state, so clones are cheap handles to the same variable and a
//! `Var` can be sent to another thread (`Send + Sync`: data parallelism runs one thread per GPU).
//! Interior mutability is `RwLock`/`Mutex` only; there is no `Rc`/`RefCell` anywhere.
//!
//! A `Var` is one of:
//! - a **leaf**: created by the user ([`Var::param`], [`Var::leaf`], [`Var::constant`]); if it
//!   requires a gradient, `backward` accumulates into its [`Var::grad`];
//! - an **op output**: created by an op on `Var`s while gradient recording is on and at least
//!   one input requires a gradient; it holds the node (the inputs and the backward closure);
//! - a **freed** op output: `backward` (without `retain`) drops each node as soon as its own
//!   backward has run, so the tensors it saved are released during the pass, as PyTorch does.
//!
//! # What the graph keeps alive
//!
//! Only what the backward closures saved. A node refers to its inputs through [`Edge`]s, which
//! hold the inputs' graph state (identity, creator, gradient slot) but not an op output's
//! value: that lives as long as some `Var` handle does. So `relu(batch_norm(conv(x)))` keeps
//! the convolution's output (batch norm saved it) and relu's output (relu saved it), and frees
//! batch norm's output as soon as the caller drops its handle, as PyTorch frees a tensor no
//! backward saved. (Before, every op output reachable from the loss stayed allocated until the
//! end of `backward`: in ResNet-18 about one more activation per layer than PyTorch keeps.)
//! Leaves keep their values (parameters and inputs belong to the user).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use kiln_core::fasthash::{FastMap, FastSet};
use kiln_core::{Backend, DType, Error, Result, Shape, Tensor};

/// What a backward closure returns: one entry per input, `None` where the input needs no
/// gradient (or the gradient is identically zero).
pub type InputGrads<B> = Vec<Option<Tensor<B>>>;

/// The backward function of one recorded op: given the gradient of the op's output (same shape
/// and dtype as the output) and which inputs need a gradient, returns one gradient per input,
/// each with that input's shape, dtype and device.
pub type BackwardFn<B> =
    Box<dyn Fn(&Tensor<B>, &[bool]) -> Result<InputGrads<B>> + Send + Sync + 'static>;

/// A gradient hook (see [`Var::register_grad_hook`]): called with the leaf whose gradient
/// `backward` has just finished accumulating.
pub type GradHook<B> = Arc<dyn Fn(&Var<B>) -> Result<()> + Send + Sync + 'static>;

/// Identifies a registered gradient hook, for [`Var::remove_grad_hook`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HookHandle(u64);

/// A unique, never reused identity of a [`Var`] (optimizers key their per-parameter state by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VarId(u64);

impl VarId {
    fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        VarId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
    /// The raw number (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

pub(crate) struct Node<B: Backend> {
    pub(crate) name: &'static str,
    /// Every input.
    pub(crate) inputs: Vec<Edge<B>>,
    /// Whether `inputs[i]` needed a gradient when the op ran: the flags `backward` is called
    /// with.
    pub(crate) needs: Vec<bool>,
    pub(crate) backward: Backward<B>,
}

/// A node's backward function: a [`BackwardFn`], or one that also adds a gradient already
/// accumulated for the first input into that input's gradient ([`Var::from_op_folding`]).
pub(crate) enum Backward<B: Backend> {
    Plain(BackwardFn<B>),
    /// Called with `Some(acc)` (the first input's gradient so far, from its other readers) when
    /// the engine has one; the first input's gradient it returns then includes `acc`.
    FoldsFirst(FoldFn<B>),
}

/// The backward function of [`Backward::FoldsFirst`].
pub(crate) type FoldFn<B> = Box<
    dyn Fn(&Tensor<B>, &[bool], Option<Tensor<B>>) -> Result<InputGrads<B>> + Send + Sync + 'static,
>;

impl<B: Backend> Node<B> {
    /// Runs the backward for the inputs marked in `needs`; `acc` (only for
    /// [`Backward::FoldsFirst`]) is added into the first input's gradient.
    fn run(&self, g: &Tensor<B>, needs: &[bool], acc: Option<Tensor<B>>) -> Result<InputGrads<B>> {
        match &self.backward {
            Backward::Plain(f) => f(g, needs),
            Backward::FoldsFirst(f) => f(g, needs, acc),
        }
    }
}

/// A node's reference to one input: its graph state (not an op output's value, see the module
/// docs) and the shape, dtype and device the gradient returned for it must have (whether it
/// needs one is [`Node::needs`]).
pub(crate) struct Edge<B: Backend> {
    pub(crate) var: VarRef<B>,
    shape: Shape,
    dtype: DType,
    device: B::Device,
}

/// A handle on a variable's graph state that does not keep an op output's value alive (the
/// graph's own references: edges and the backward pass's order). A [`Var`] is made from it
/// only for leaves, whose values are never dropped.
pub(crate) struct VarRef<B: Backend>(Arc<Inner<B>>);

impl<B: Backend> Clone for VarRef<B> {
    fn clone(&self) -> Self {
        VarRef(self.0.clone())
    }
}

impl<B: Backend> std::ops::Deref for VarRef<B> {
    type Target = Inner<B>;
    fn deref(&self) -> &Inner<B> {
        &self.0
    }
}

impl<B: Backend> Edge<B> {
    /// `Ok` when `g` can be this input's gradient: of its shape, dtype and device (a leaf's
    /// current ones, an op output's as recorded); else the input, described. `leaf`: whether
    /// the input is a leaf (the caller read it).
    fn fits(&self, g: &Tensor<B>, leaf: bool) -> std::result::Result<(), String> {
        // A leaf's current value, read in place (no clone of the tensor per gradient).
        let data = leaf.then(|| self.var.data.read().unwrap_or_else(|e| e.into_inner()));
        let (shape, dtype, device) = match data.as_deref().and_then(Option::as_ref) {
            Some(t) => (t.shape(), t.dtype(), t.device()),
            None => (&self.shape, self.dtype, &self.device),
        };
        if g.shape() == shape && g.dtype() == dtype && g.device() == device {
            Ok(())
        } else {
            Err(format!("an input of shape {shape} ({dtype}, {device})"))
        }
    }
}

impl<B: Backend> VarRef<B> {
    /// A `Var` handle on this leaf (for its gradient hooks and its `.grad()`).
    fn leaf_var(&self) -> Var<B> {
        debug_assert!(self.node().is_none(), "leaf_var on an op output");
        Var::from_inner(self.0.clone())
    }
}

/// What an input of a node was when `backward` started ([`Inner::was`]): read once per edge
/// in [`topo_order`], since every read of a creator takes a lock (a logistic-regression step's
/// backward took ~200 of them).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Was {
    Leaf,
    Op,
    Freed(&'static str),
}

enum Creator<B: Backend> {
    Leaf,
    Op(Arc<Node<B>>),
    /// An op output whose graph a `backward` released.
    Freed(&'static str),
}

/// An accumulated gradient. After [`Var::scale_grad`], `parts` holds the sum and the factor it
/// is still to be multiplied by, and `value` their product: pending on a backend that defers
/// elementwise work, so nothing runs unless it is read, while an optimizer that applies the
/// factor inside its update reads the parts instead ([`Var::grad_parts`]).
#[derive(Clone)]
struct Grad<B: Backend> {
    value: Tensor<B>,
    parts: Option<(Tensor<B>, Tensor<B>)>,
}

impl<B: Backend> Grad<B> {
    fn new(value: Tensor<B>) -> Self {
        Grad { value, parts: None }
    }
}

pub(crate) struct Inner<B: Backend> {
    id: VarId,
    /// The value; `None` once no `Var` handle on an op output is left (module docs).
    data: RwLock<Option<Tensor<B>>>,
    /// How many `Var` handles exist (edges and [`VarRef`]s do not count).
    handles: AtomicUsize,
    requires_grad: AtomicBool,
    retain_grad: AtomicBool,
    grad: Mutex<Option<Grad<B>>>,
    /// Whether `creator` is [`Creator::Leaf`]: fixed at construction (an op output becomes
    /// `Freed`, never a leaf), so it is read without the lock.
    leaf: bool,
    creator: Mutex<Creator<B>>,
    hooks: Mutex<Vec<(HookHandle, GradHook<B>)>>,
}

impl<B: Backend> Inner<B> {
    pub(crate) fn id(&self) -> VarId {
        self.id
    }

    pub(crate) fn node(&self) -> Option<Arc<Node<B>>> {
        match &*lock(&self.creator) {
            Creator::Op(n) => Some(n.clone()),
            _ => None,
        }
    }

    /// What this variable is now (one lock; `node` would also clone the node).
    fn was(&self) -> Was {
        if self.leaf {
            return Was::Leaf;
        }
        match &*lock(&self.creator) {
            Creator::Leaf => Was::Leaf,
            Creator::Op(_) => Was::Op,
            Creator::Freed(n) => Was::Freed(n),
        }
    }

    fn freed_name(&self) -> Option<&'static str> {
        match &*lock(&self.creator) {
            Creator::Freed(n) => Some(n),
            _ => None,
        }
    }

    /// Drops this op output's node (its saved tensors and its edges).
    fn free_graph(&self) {
        let mut c = lock(&self.creator);
        if let Creator::Op(n) = &*c {
            let name = n.name;
            *c = Creator::Freed(name);
        }
    }

    fn accumulate_grad(&self, g: Tensor<B>) -> Result<()> {
        let g = g.contiguous()?;
        let mut slot = lock(&self.grad);
        *slot = Some(Grad::new(match slot.take() {
            None => g,
            Some(old) => old.value.add(&g)?,
        }));
        Ok(())
    }

    fn has_grad_hooks(&self) -> bool {
        !lock(&self.hooks).is_empty()
    }
}

/// Dismantles a dropped graph iteratively: the default recursive drop (variable → node → input
/// variable → ...) would overflow the stack on a graph tens of thousands of ops deep (a long
/// unrolled loop dropped without `backward`). Only parts nobody else holds are taken apart.
impl<B: Backend> Drop for Inner<B> {
    fn drop(&mut self) {
        let creator = self.creator.get_mut().unwrap_or_else(|e| e.into_inner());
        let Creator::Op(node) = std::mem::replace(creator, Creator::Leaf) else {
            return;
        };
        let mut stack = vec![node];
        while let Some(node) = stack.pop() {
            let Ok(mut node) = Arc::try_unwrap(node) else {
                continue;
            };
            for edge in node.inputs.drain(..) {
                if let Ok(mut inner) = Arc::try_unwrap(edge.var.0) {
                    let c = inner.creator.get_mut().unwrap_or_else(|e| e.into_inner());
                    if let Creator::Op(n) = std::mem::replace(c, Creator::Leaf) {
                        stack.push(n);
                    }
                }
            }
        }
    }
}

/// A tensor plus its place in a define-by-run graph.
///
/// Clone is cheap (an `Arc`); clones are the *same* variable (same gradient, same data).
pub struct Var<B: Backend>(Arc<Inner<B>>);

impl<B: Backend> Clone for Var<B> {
    fn clone(&self) -> Self {
        Var::from_inner(self.0.clone())
    }
}

/// The last handle on an op output drops its value (module docs): what the graph needs of it
/// was saved by the backward closures themselves.
impl<B: Backend> Drop for Var<B> {
    fn drop(&mut self) {
        if self.0.handles.fetch_sub(1, Ordering::AcqRel) == 1 && !self.0.leaf {
            *self.0.data.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

impl<B: Backend> std::fmt::Debug for Var<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.tensor();
        let kind = match &*lock(&self.0.creator) {
            Creator::Leaf => "leaf".to_string(),
            Creator::Op(n) => format!("op {}", n.name),
            Creator::Freed(n) => format!("op {} (graph freed)", n),
        };
        write!(
            f,
            "Var#{}{{{kind}, requires_grad: {}, shape: {}, dtype: {}, device: {}}}",
            self.0.id.0,
            self.requires_grad(),
            t.shape(),
            t.dtype(),
            t.device()
        )
    }
}

impl<B: Backend> std::fmt::Display for Var<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.tensor(), f)
    }
}

/// Locks a mutex, recovering from poisoning: the guarded values stay consistent on their own
/// (each update is a single assignment), so a panic in another thread must not wedge training.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- no_grad --------------------------------------------------------------------------------

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the graph (true unless inside [`no_grad`]).
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Runs `f` with graph recording off on this thread (PyTorch's `torch.no_grad()`): ops return
/// constants, nothing is saved for backward. Use it for evaluation and for parameter updates.
/// The flag is thread-local (each training thread decides for itself) and restored even if `f`
/// panics.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GRAD_ENABLED.with(|g| g.set(self.0));
        }
    }
    let _restore = Restore(GRAD_ENABLED.with(|g| g.replace(false)));
    f()
}

// ---- construction and accessors --------------------------------------------------------------

impl<B: Backend> Var<B> {
    fn new(t: Tensor<B>, requires_grad: bool, creator: Creator<B>) -> Self {
        Var(Arc::new(Inner {
            id: VarId::next(),
            data: RwLock::new(Some(t)),
            handles: AtomicUsize::new(1),
            requires_grad: AtomicBool::new(requires_grad),
            retain_grad: AtomicBool::new(false),
            grad: Mutex::new(None),
            leaf: matches!(creator, Creator::Leaf),
            creator: Mutex::new(creator),
            hooks: Mutex::new(Vec::new()),
        }))
    }

    /// One more handle on `inner`.
    fn from_inner(inner: Arc<Inner<B>>) -> Self {
        inner.handles.fetch_add(1, Ordering::Relaxed);
        Var(inner)
    }

    /// A leaf that requires a gradient (a trainable parameter). Same as [`Var::leaf`].
    pub fn param(t: Tensor<B>) -> Self {
        Self::new(t, true, Creator::Leaf)
    }

    /// A leaf that requires a gradient: `backward` accumulates into its [`Var::grad`].
    pub fn leaf(t: Tensor<B>) -> Self {
        Self::param(t)
    }

    /// A leaf that needs no gradient (inputs, labels, frozen weights). Ops on constants only
    /// record nothing.
    pub fn constant(t: Tensor<B>) -> Self {
        Self::new(t, false, Creator::Leaf)
    }

    /// Records an op: `output` was computed from `inputs`, and `backward` maps the output's
    /// gradient to the inputs' gradients (see [`BackwardFn`]).
    ///
    /// This is how every built-in op is defined, and how a user adds one (e.g. around a custom
    /// kernel): compute the output with tensors, then wrap it here. When recording is off
    /// ([`no_grad`]) or no input requires a gradient, the result is a constant and `backward` is
    /// dropped unused.
    pub fn from_op<F>(
        name: &'static str,
        inputs: &[&Var<B>],
        output: Tensor<B>,
        backward: F,
    ) -> Self
    where
        F: Fn(&Tensor<B>, &[bool]) -> Result<InputGrads<B>> + Send + Sync + 'static,
    {
        Self::record_op(name, inputs, output, Backward::Plain(Box::new(backward)))
    }

    /// [`Var::from_op`] for an op whose backward can add a gradient into its first input's in
    /// the same pass: when the first input is an op output that other readers already gave a
    /// gradient (a residual connection's fan-in), the engine hands that sum to `backward`
    /// (`Some(acc)`) instead of adding the two by a pass of its own, and the first gradient
    /// `backward` returns must then include it.
    pub(crate) fn from_op_folding<F>(
        name: &'static str,
        inputs: &[&Var<B>],
        output: Tensor<B>,
        backward: F,
    ) -> Self
    where
        F: Fn(&Tensor<B>, &[bool], Option<Tensor<B>>) -> Result<InputGrads<B>>
            + Send
            + Sync
            + 'static,
    {
        Self::record_op(
            name,
            inputs,
            output,
            Backward::FoldsFirst(Box::new(backward)),
        )
    }

    fn record_op(
        name: &'static str,
        inputs: &[&Var<B>],
        output: Tensor<B>,
        backward: Backward<B>,
    ) -> Self {
        let needs: Vec<bool> = inputs.iter().map(|v| v.requires_grad()).collect();
        if !is_grad_enabled() || !needs.iter().any(|&n| n) {
            return Self::constant(output);
        }
        let node = Node {
            name,
            inputs: inputs
                .iter()
                .map(|v| {
                    v.with_tensor(|t| Edge {
                        var: VarRef(v.0.clone()),
                        shape: t.shape().clone(),
                        dtype: t.dtype(),
                        device: t.device().clone(),
                    })
                })
                .collect(),
            needs,
            backward,
        };
        Self::new(output, true, Creator::Op(Arc::new(node)))
    }

    /// This variable's identity (stable for its lifetime, shared by clones).
    pub fn id(&self) -> VarId {
        self.0.id
    }

    /// True when both handles are the same variable.
    pub fn ptr_eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// `vars` with repeats of one variable (clones, e.g. a weight tied between two modules)
    /// dropped, keeping the first occurrence and the order: what optimizers, gradient norms and
    /// parameter counts must see, so a tied parameter is counted and stepped once.
    pub fn unique(vars: impl IntoIterator<Item = Self>) -> Vec<Self> {
        let mut seen = std::collections::HashSet::new();
        vars.into_iter().filter(|v| seen.insert(v.id())).collect()
    }

    /// The current value (a cheap handle; later [`Var::set_tensor`] calls do not change it).
    pub fn tensor(&self) -> Tensor<B> {
        self.0
            .data
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .expect("a Var handle keeps its value")
    }

    /// `f` of the value, borrowed under the read lock (no clone of the tensor: the accessors
    /// below run several times per op).
    fn with_tensor<R>(&self, f: impl FnOnce(&Tensor<B>) -> R) -> R {
        let data = self.0.data.read().unwrap_or_else(|e| e.into_inner());
        f(data.as_ref().expect("a Var handle keeps its value"))
    }

    pub fn shape(&self) -> Shape {
        self.with_tensor(|t| t.shape().clone())
    }
    pub fn dims(&self) -> Vec<usize> {
        self.with_tensor(|t| t.dims().to_vec())
    }
    /// The extent of `axis` (like PyTorch's `size(dim)`), without copying the shape.
    /// Panics when `axis` is out of range, as indexing `dims()` would.
    pub fn dim(&self, axis: usize) -> usize {
        self.with_tensor(|t| t.dims()[axis])
    }
    pub fn rank(&self) -> usize {
        self.with_tensor(|t| t.rank())
    }
    pub fn elem_count(&self) -> usize {
        self.with_tensor(|t| t.elem_count())
    }
    pub fn dtype(&self) -> DType {
        self.with_tensor(|t| t.dtype())
    }
    pub fn device(&self) -> B::Device {
        self.with_tensor(|t| t.device().clone())
    }

    /// Whether a gradient flows to (leaf) or through (op output) this variable.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// True for user-created variables (params and constants), false for op outputs.
    pub fn is_leaf(&self) -> bool {
        self.0.leaf
    }

    /// Turns gradient tracking of a leaf on or off (freezing a parameter). Ops already recorded
    /// are not affected. An error on op outputs (use [`Var::detach`]).
    pub fn set_requires_grad(&self, requires_grad: bool) -> Result<()> {
        if !self.is_leaf() {
            return Err(Error::invalid(
                "set_requires_grad",
                "only leaves can change requires_grad; detach() the op output instead",
            ));
        }
        self.0.requires_grad.store(requires_grad, Ordering::Relaxed);
        Ok(())
    }

    /// Asks `backward` to also keep this op output's gradient in [`Var::grad`] (PyTorch's
    /// `retain_grad`); leaves that require a gradient always keep theirs.
    pub fn retain_grad(&self) {
        self.0.retain_grad.store(true, Ordering::Relaxed);
    }

    /// The accumulated gradient: same shape, dtype and device as the tensor, contiguous.
    /// `None` before the first `backward` that reached it, and after [`Var::zero_grad`].
    ///
    /// Gradients accumulate over `backward` calls (`grad += new`) until `zero_grad`, as in
    /// PyTorch: call `zero_grad` (or let the optimizer do it) once per step.
    pub fn grad(&self) -> Option<Tensor<B>> {
        lock(&self.0.grad).as_ref().map(|g| g.value.clone())
    }

    /// Multiplies the gradient by `factor` (one element, of the gradient's dtype and device)
    /// without a pass of its own: [`Var::grad`] then reads the product, computed when read,
    /// and an optimizer applies the factor inside its update ([`Var::grad_parts`]; kiln-optim's
    /// optimizers do). Gradient clipping scales this way, as PyTorch's fused optimizers take a
    /// `grad_scale`. Factors given one after another multiply; setting, accumulating or moving
    /// the gradient applies them first. Nothing when there is no gradient.
    pub fn scale_grad(&self, factor: &Tensor<B>) -> Result<()> {
        const OP: &str = "scale_grad";
        let mut slot = lock(&self.0.grad);
        let Some(g) = slot.as_mut() else {
            return Ok(());
        };
        g.value.check_factor(OP, "the factor", factor)?;
        let factor = factor.reshape(kiln_core::Shape::scalar())?;
        let (sum, factor) = match g.parts.take() {
            Some((sum, old)) => (sum, old.mul(&factor)?),
            None => (g.value.clone(), factor),
        };
        *g = Grad {
            value: sum.mul(&factor)?,
            parts: Some((sum, factor)),
        };
        Ok(())
    }

    /// The gradient as its sum and the factor [`Var::scale_grad`] left to apply (`None` when
    /// there is none): for optimizers that apply the factor inside their update. The product of
    /// the two is [`Var::grad`].
    pub fn grad_parts(&self) -> Option<(Tensor<B>, Option<Tensor<B>>)> {
        lock(&self.0.grad).as_ref().map(|g| match &g.parts {
            Some((sum, factor)) => (sum.clone(), Some(factor.clone())),
            None => (g.value.clone(), None),
        })
    }

    /// Whether a gradient is accumulated (`grad().is_some()` without cloning it).
    pub fn has_grad(&self) -> bool {
        lock(&self.0.grad).is_some()
    }

    /// Drops the accumulated gradient (`.grad()` becomes `None`; PyTorch's `set_to_none`).
    pub fn zero_grad(&self) {
        *lock(&self.0.grad) = None;
    }

    /// Replaces the gradient (gradient clipping, all-reduce in data parallelism). The new
    /// gradient must have the tensor's shape, dtype and device.
    pub fn set_grad(&self, grad: Option<Tensor<B>>) -> Result<()> {
        if let Some(g) = &grad {
            check_like("set_grad", &self.tensor(), g, true)?;
        }
        *lock(&self.0.grad) = grad.map(Grad::new);
        Ok(())
    }

    /// Registers `hook` to run each time a `backward` has finished accumulating this leaf's
    /// gradient (PyTorch's `register_post_accumulate_grad_hook`). It runs on the thread doing
    /// the backward pass, as soon as every contribution of that pass to this leaf is summed —
    /// before the rest of the pass, which is what lets data parallelism start communicating a
    /// gradient while backward goes on. An error from a hook ends the backward pass with it.
    /// Only leaves that require a gradient have gradients, so only their hooks ever run.
    pub fn register_grad_hook(&self, hook: GradHook<B>) -> HookHandle {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let h = HookHandle(NEXT.fetch_add(1, Ordering::Relaxed));
        lock(&self.0.hooks).push((h, hook));
        h
    }

    /// Removes a hook registered with [`Var::register_grad_hook`]; false if it was not there.
    pub fn remove_grad_hook(&self, handle: HookHandle) -> bool {
        let mut hooks = lock(&self.0.hooks);
        let n = hooks.len();
        hooks.retain(|(h, _)| *h != handle);
        hooks.len() != n
    }

    fn run_grad_hooks(&self) -> Result<()> {
        let hooks: Vec<GradHook<B>> = lock(&self.0.hooks).iter().map(|(_, f)| f.clone()).collect();
        for f in hooks {
            f(self)?;
        }
        Ok(())
    }

    /// Takes the gradient out, leaving `None`.
    pub fn take_grad(&self) -> Option<Tensor<B>> {
        lock(&self.0.grad).take().map(|g| g.value)
    }

    /// A new constant leaf sharing this variable's tensor: the gradient stops here.
    pub fn detach(&self) -> Self {
        Self::constant(self.tensor())
    }

    // ---- in-place updates (for optimizers) ---------------------------------------------------

    /// Replaces the tensor of a leaf in place, e.g. with the result of an optimizer step; every
    /// clone of this `Var` (the model's, the optimizer's) sees the new value.
    ///
    /// `t` must have the same shape and dtype. It may live on another device (moving a model
    /// with `to_device` in place); the accumulated gradient is then moved along with it.
    /// Graphs recorded before the update keep the old tensor (they saved their own handle), so
    /// updating between `forward` and `backward` does not corrupt the backward pass.
    /// An error on op outputs: their value is defined by the graph. The new tensor is
    /// [realized](Tensor::realize) here.
    pub fn set_tensor(&self, t: Tensor<B>) -> Result<()> {
        const OP: &str = "set_tensor";
        if !self.is_leaf() {
            return Err(Error::invalid(
                OP,
                "only leaves (params, constants) can be updated",
            ));
        }
        let old = self.tensor();
        check_like(OP, &old, &t, false)?;
        if old.device() != t.device() {
            let mut g = lock(&self.0.grad);
            if let Some(gr) = g.take() {
                *g = Some(Grad::new(gr.value.to_device(t.device())?));
            }
        }
        // State carried from step to step must not carry deferred work (a backend that fuses
        // elementwise ops would otherwise grow `w - lr * g` into a longer chain every step).
        t.realize()?;
        *self.0.data.write().unwrap_or_else(|e| e.into_inner()) = Some(t);
        Ok(())
    }

    /// `set_tensor(f(&current)?)`: the update form optimizers use, e.g.
    /// `p.update_data(|w| w.sub(&g.mul_scalar(lr)?))`. Call it outside recording, or inside
    /// [`no_grad`] when `f` uses `Var` ops.
    pub fn update_data(&self, f: impl FnOnce(&Tensor<B>) -> Result<Tensor<B>>) -> Result<()> {
        let new = f(&self.tensor())?;
        self.set_tensor(new)
    }

    /// False once a `backward` freed the graph this op output belonged to (true for leaves).
    pub(crate) fn graph_alive(&self) -> bool {
        self.0.freed_name().is_none()
    }

    // ---- backward -----------------------------------------------------------------------------

    /// Backpropagates from this scalar (0-d, or any shape with one element) with seed 1, then
    /// frees the graph. Leaves that require a gradient get it added to their [`Var::grad`].
    pub fn backward(&self) -> Result<()> {
        self.backward_opts(None, false)
    }

    /// [`Var::backward`], keeping the graph so `backward` can run through it again.
    pub fn backward_retain(&self) -> Result<()> {
        self.backward_opts(None, true)
    }

    /// Backpropagates from a variable of any shape with an explicit output gradient `seed`
    /// (same shape and dtype; a vector–Jacobian product), then frees the graph.
    pub fn backward_with(&self, seed: &Tensor<B>) -> Result<()> {
        self.backward_opts(Some(seed), false)
    }

    /// The general form: optional seed (`None` = ones for a one-element output), and whether to
    /// keep the graph.
    pub fn backward_opts(&self, seed: Option<&Tensor<B>>, retain_graph: bool) -> Result<()> {
        const OP: &str = "backward";
        let out = self.tensor();
        let seed = match seed {
            Some(s) => {
                check_like(OP, &out, s, true)?;
                s.clone()
            }
            None => {
                if out.elem_count() != 1 {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "backward() needs a one-element output, got shape {}; use \
                             backward_with(seed) for other shapes",
                            out.shape()
                        ),
                    ));
                }
                out.ones_like()?
            }
        };
        if let Some(name) = self.0.freed_name() {
            return Err(Error::invalid(
                OP,
                format!(
                    "the graph through `{name}` was already freed by a previous backward; \
                     use backward_retain() to backpropagate through it twice"
                ),
            ));
        }
        if !self.requires_grad() {
            return Err(Error::invalid(
                OP,
                "this Var does not require a gradient (no parameter in its graph, or it was \
                 computed under no_grad)",
            ));
        }
        let Order { steps, inputs } = topo_order(self);
        // Where each leaf gets its last contribution: the earliest position (in post-order)
        // of a node that consumes it. Walking backwards, the leaf's gradient is complete
        // once that node has run, so it is accumulated and its hooks run right then.
        let mut last_use: FastMap<VarId, usize> = FastMap::default();
        for (pos, step) in steps.iter().enumerate() {
            if let Some(node) = &step.node {
                let was = &inputs[step.inputs..];
                for ((e, &need), &w) in node.inputs.iter().zip(&node.needs).zip(was) {
                    if need && w == Was::Leaf {
                        last_use.entry(e.var.id()).or_insert(pos);
                    }
                }
            }
        }
        let mut pass = Pass {
            grads: FastMap::default(),
            last_use,
            flush_at: FastMap::default(),
        };
        pass.grads.reserve(steps.len());
        pass.grads.insert(self.id(), seed);
        // `steps` is post-order (inputs first): walk it from the output back. Every consumer of
        // a node comes later in the order, so once the node has run nothing reads it again:
        // without `retain_graph` it is freed right away, and the tensors it saved with it (the
        // step holds the node too: dropped before the leaves' hooks run).
        for (pos, step) in steps.into_iter().enumerate().rev() {
            let was = step
                .node
                .as_ref()
                .map_or(&[][..], |_| &inputs[step.inputs..]);
            pass.node(&step, was, pos)?;
            if !retain_graph {
                step.var.free_graph();
            }
            drop(step);
            for leaf in pass.flush_at.remove(&pos).unwrap_or_default() {
                leaf.flush_grad(&mut pass.grads)?;
            }
        }
        Ok(())
    }

    /// Moves this leaf's complete gradient out of `grads` into its `.grad()` (while it still
    /// requires one) and runs its hooks.
    fn flush_grad(&self, grads: &mut FastMap<VarId, Tensor<B>>) -> Result<()> {
        if let Some(g) = grads.remove(&self.id())
            && self.requires_grad()
        {
            self.0.accumulate_grad(g)?;
            self.run_grad_hooks()?;
        }
        Ok(())
    }
}

/// The state of one backward pass ([`Var::backward_opts`]).
struct Pass<B: Backend> {
    /// Gradients so far, of the op outputs not yet run and of the leaves not yet flushed.
    grads: FastMap<VarId, Tensor<B>>,
    /// Each leaf's last consumer's position in the order.
    last_use: FastMap<VarId, usize>,
    /// The leaves whose gradients are complete after the node at a position.
    flush_at: FastMap<usize, Vec<Var<B>>>,
}

impl<B: Backend> Pass<B> {
    /// Runs the backward of `step` (the node at `pos` of the order; `was`: its inputs' kinds)
    /// with its gradient from `grads` and adds the input gradients there; leaves seen for the
    /// first time are queued in `flush_at` at their last use.
    ///
    /// Leaves with gradient hooks whose last use is this node come first: when the node also
    /// has other inputs to differentiate, its backward runs twice with disjoint `needs` (hooked
    /// leaves, then the rest) and those leaves are accumulated and their hooks run in between,
    /// so that a hook's work (DDP's all-reduce) is queued before the rest of the node's (the
    /// input's gradient) and overlaps it.
    fn node(&mut self, step: &Step<B>, was: &[Was], pos: usize) -> Result<()> {
        let v = &step.var;
        let Some(g) = self.grads.remove(&v.id()) else {
            return Ok(());
        };
        let Some(node) = &step.node else {
            // A leaf (only the output itself can be a leaf here).
            v.accumulate_grad(g)?;
            v.leaf_var().run_grad_hooks()?;
            return Ok(());
        };
        if v.retain_grad.load(Ordering::Relaxed) {
            v.accumulate_grad(g.clone())?;
        }
        let needs = &node.needs;
        // Leaf inputs with gradient hooks whose last use this is: their gradients are
        // complete once this node's backward for them ran, so they go first (and their hooks
        // run) before the other inputs' (rare: built only when there is one).
        let last_use = &self.last_use;
        let first_of = |((e, &need), &w): ((&Edge<B>, &bool), &Was)| {
            need && w == Was::Leaf
                && last_use.get(&e.var.id()) == Some(&pos)
                && e.var.has_grad_hooks()
        };
        let inputs = || node.inputs.iter().zip(needs).zip(was);
        if inputs().any(first_of) {
            let first: Vec<bool> = inputs().map(first_of).collect();
            let rest: Vec<bool> = needs.iter().zip(&first).map(|(n, f)| *n && !f).collect();
            if rest.iter().any(|&r| r) {
                let early = node.run(&g, &first, None)?;
                self.add_input_grads(node, was, early, &first)?;
                for (e, _) in node.inputs.iter().zip(&first).filter(|(_, f)| **f) {
                    e.var.leaf_var().flush_grad(&mut self.grads)?;
                }
                let late = node.run(&g, &rest, None)?;
                return self.add_input_grads(node, was, late, &rest);
            }
        }
        // A gradient already accumulated for a folding node's first input (an op output, not a
        // leaf: leaves keep their own accumulation and flush order) goes into its backward.
        let acc = match node.backward {
            Backward::FoldsFirst(_) if needs[0] && was[0] == Was::Op => {
                self.grads.remove(&node.inputs[0].var.id())
            }
            _ => None,
        };
        let input_grads = node.run(&g, needs, acc)?;
        drop(g);
        self.add_input_grads(node, was, input_grads, needs)
    }

    /// Adds the gradients a node's backward returned for the inputs marked in `wanted` to
    /// `grads`, checking each against its input (`was`: the inputs' kinds).
    fn add_input_grads(
        &mut self,
        node: &Node<B>,
        was: &[Was],
        input_grads: InputGrads<B>,
        wanted: &[bool],
    ) -> Result<()> {
        const OP: &str = "backward";
        if input_grads.len() != node.inputs.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "internal: backward of `{}` returned {} gradients for {} inputs",
                    node.name,
                    input_grads.len(),
                    node.inputs.len()
                ),
            ));
        }
        for (((e, gi), need), &w) in node.inputs.iter().zip(input_grads).zip(wanted).zip(was) {
            let Some(gi) = gi else { continue };
            if !need {
                continue;
            }
            let is_leaf = w == Was::Leaf;
            if let Err(input) = e.fits(&gi, is_leaf) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "internal: backward of `{}` returned a {} {} gradient on {} for {input}",
                        node.name,
                        gi.shape(),
                        gi.dtype(),
                        gi.device(),
                    ),
                ));
            }
            if let Was::Freed(name) = w {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "the graph through `{name}` (an input of `{}`) was already freed by a \
                         previous backward; use backward_retain() to backpropagate through \
                         it twice",
                        node.name
                    ),
                ));
            }
            let input = &e.var;
            match self.grads.remove(&input.id()) {
                Some(acc) => {
                    let sum = acc.add(&gi)?;
                    if !is_leaf {
                        // A fan-in (a residual connection): the sum is the gradient a whole
                        // branch of backward ops reads, several of them (each operand of the
                        // forward op that made `input`). Left pending, a fusing backend would
                        // inline it into each reader's program and recompute it, chain and
                        // all, in every one: a GPT's residual-stream gradient grew by one
                        // read a layer. Stored once, each reader reads it.
                        sum.realize()?;
                    }
                    self.grads.insert(input.id(), sum);
                }
                None => {
                    if is_leaf && let Some(pos) = self.last_use.get(&input.id()) {
                        self.flush_at
                            .entry(*pos)
                            .or_default()
                            .push(input.leaf_var());
                    }
                    self.grads.insert(input.id(), gi);
                }
            }
        }
        Ok(())
    }
}

/// Errors unless `t` matches `like` in shape and dtype (and device when `same_device`).
fn check_like<B: Backend>(
    op: &'static str,
    like: &Tensor<B>,
    t: &Tensor<B>,
    same_device: bool,
) -> Result<()> {
    if t.shape() != like.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: like.shape().clone(),
            rhs: t.shape().clone(),
        });
    }
    if t.dtype() != like.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: like.dtype().to_string(),
            got: t.dtype(),
        });
    }
    if same_device {
        like.check_same_device(op, t)?;
    }
    Ok(())
}

/// The backward pass's order ([`topo_order`]): its steps, and the kinds of their nodes'
/// inputs.
struct Order<B: Backend> {
    steps: Vec<Step<B>>,
    /// What each step's node's inputs were, from `Step::inputs` on, one per edge.
    inputs: Vec<Was>,
}

/// One variable of the backward pass: an op output (or the root, which may be a leaf) with its
/// node, read once.
struct Step<B: Backend> {
    var: VarRef<B>,
    node: Option<Arc<Node<B>>>,
    /// Where its inputs' kinds start in [`Order::inputs`].
    inputs: usize,
}

/// The op outputs reachable from `root` through inputs that need a gradient, in post-order
/// (every variable after all of its inputs), with what every input of theirs is. Iterative, so
/// deep graphs (long RNN unrolls) do not overflow the stack.
fn topo_order<B: Backend>(root: &Var<B>) -> Order<B> {
    enum Visit<B: Backend> {
        Enter(VarRef<B>),
        Leave(Step<B>),
    }
    // Sized for a small step's graph (a few dozen ops): growing these one doubling at a time
    // was ten reallocations a logistic-regression step.
    let mut order = Order {
        steps: Vec::with_capacity(64),
        inputs: Vec::with_capacity(128),
    };
    let mut seen = FastSet::default();
    seen.reserve(64);
    let mut stack = Vec::with_capacity(64);
    stack.push(Visit::Enter(VarRef(root.0.clone())));
    while let Some(visit) = stack.pop() {
        let v = match visit {
            Visit::Leave(step) => {
                order.steps.push(step);
                continue;
            }
            Visit::Enter(v) => v,
        };
        if !seen.insert(v.id()) {
            continue;
        }
        let node = v.node();
        let inputs = order.inputs.len();
        // Left after its inputs (pushed after it, so popped first).
        stack.push(Visit::Leave(Step {
            var: v,
            node: node.clone(),
            inputs,
        }));
        if let Some(node) = node {
            for (e, &need) in node.inputs.iter().zip(&node.needs) {
                let was = e.var.was();
                order.inputs.push(was);
                if need && was == Was::Op && !seen.contains(&e.var.id()) {
                    stack.push(Visit::Enter(e.var.clone()));
                }
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    /// Compile-time proof that `Var<B>` is `Send + Sync` for every backend.
    #[allow(dead_code)]
    fn var_is_send_sync<B: Backend>() {
        assert_send_sync::<Var<B>>();
    }
}
