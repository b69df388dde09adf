//! Automatic mixed precision: [`autocast`] picks the dtype of each op, as `torch.autocast` does.
//!
//! ```
//! use kiln_autograd::{Var, autocast};
//! use kiln_backend_cpu::Cpu;
//! use kiln_core::{DType, Generator, Reduction, Tensor};
//!
//! let dev = Cpu::device(0);
//! let w = Var::param(Generator::new(1).normal::<Cpu>([10, 784], 0.0, 0.01, &dev)?);
//! let x = Var::constant(Generator::new(2).rand::<Cpu>([32, 784], &dev)?);
//! let labels = Tensor::<Cpu>::zeros([32], DType::I64, &dev)?;
//! let loss = {
//!     let _amp = autocast(DType::BF16)?;          // until the end of this block
//!     let logits = x.linear(&w, None)?;            // bf16: a GEMM on tensor cores
//!     assert_eq!(logits.dtype(), DType::BF16);
//!     logits.cross_entropy(&labels, Reduction::Mean)? // f32: computed from f32 logits
//! };
//! assert_eq!(loss.dtype(), DType::F32);
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().dtype(), DType::F32); // the parameter stays f32
//! # Ok::<(), kiln_core::Error>(())
//! ```
//!
//! # Why
//!
//! GEMMs and convolutions run 2× (TF32) to 15× (f32) faster on tensor cores in 16 bits, and
//! they tolerate 16-bit inputs because they accumulate in f32. Softmax, losses, norms and
//! large reductions do not: their sums and exponentials lose the 8 (bf16) or 11 (f16)
//! significant bits that make a loss curve smooth. So the low type is used *per op*, on the
//! ops that gain from it, and everything else stays f32 — with the parameters themselves kept
//! in f32 (the optimizer updates f32 weights; only the GEMM operands are rounded).
//!
//! # The op lists (those of PyTorch's CUDA autocast, restricted to kiln's ops)
//!
//! | policy | ops |
//! |---|---|
//! | **low** (inputs cast to the autocast dtype) | [`Var::matmul`], [`Var::linear`], convolutions (kiln-nn's `conv2d` is im2col + `matmul`; its bias is cast too), [`Var::scaled_dot_product_attention`] (its products; see below) |
//! | **f32** (16-bit inputs cast up; output f32) | [`Var::softmax`], [`Var::log_softmax`], [`Var::cross_entropy`], kiln-nn's `mse` and `bce_with_logits`, [`Var::layer_norm`], [`Var::rms_norm`], [`Var::group_norm`], [`Var::sum`] / [`Var::mean`] (PyTorch's `sum` with `dtype=float32`), `exp`, `expm1`, `log`, `log1p`, `recip`, `rsqrt`, `softplus`, `pow` |
//! | **widest** (the narrower float operand cast to the wider) | binary elementwise ops ([`Var::binary`]: add, sub, mul, div, maximum, minimum), [`Var::cat`], [`Var::where_cond`] |
//! | **input dtype, f32 statistics** (the input not cast; f32 parameters read as they are) | [`Var::batch_norm_train`], [`Var::batch_norm_eval`]: output and `dx` in the input's dtype; mean, variance, running statistics, `dweight`, `dbias` in f32, computed in f32 (see below) |
//! | **input dtype** (no cast) | everything else: activations (`relu`, `gelu`, `tanh`, ...), views, indexing, embeddings, dropout, max/min reductions |
//!
//! Batch norm is not on PyTorch's fp32 list either: cuDNN's batch norm reads a 16-bit input
//! with f32 weight, bias and running statistics, accumulates the statistics in f32 and writes a
//! 16-bit output. kiln's does the same inside its fused programs (16-bit loads widened, f32
//! arithmetic, one rounding where `y` or `dx` is stored), so a conv → batch norm → relu chain
//! stays 16-bit end to end: no f32 copy of the activation is made, saved for backward, or cast
//! back for the next convolution (on the f32 list, each conv → batch norm → relu of ResNet-18
//! made an f32 copy of the convolution's output, an f32 output and relu output, and a bf16
//! copy of that for the next convolution). Layer norm, RMS norm and group norm stay f32, as on
//! PyTorch's list.
//!
//! Only f32, f16 and bf16 values are cast; f64 is never touched (gradient checks stay exact),
//! nor are integer tensors. Outside an autocast scope nothing is cast and mixing float dtypes
//! in one op remains an error, as everywhere in kiln (but for batch norm's f32 parameters
//! beside a 16-bit input, which PyTorch takes too): the widest rule exists only where
//! autocast itself made the dtypes differ (a bf16 linear's output added to an f32 residual).
//!
//! Attention: the products run in the low dtype, and the softmax between them in f32 (scores
//! cast up; an additive float mask cast to f32 with them), which is what a flash kernel does
//! internally.
//!
//! # Scopes
//!
//! [`autocast`] returns a guard; the dtype applies on this thread until the guard drops (the
//! flag is thread-local like [`crate::no_grad`]: each training thread of data parallelism
//! decides for itself). Scopes nest: an inner `autocast(F16)` inside `autocast(BF16)` uses f16
//! until it ends; [`autocast_disabled`] turns it off inside (e.g. for a part of the model that
//! must stay f32, whose inputs the user then casts with [`Var::to_dtype`]). Guards restore the
//! previous state when they drop, in any order the borrow checker allows; they are not `Send`.
//!
//! # Backward
//!
//! Casts are ordinary differentiable ops ([`Var::to_dtype`], whose backward casts the gradient
//! back), so the backward pass follows the forward's dtypes with no autocast scope around it:
//! a bf16 GEMM's gradient GEMMs run in bf16, and an f32 parameter receives an f32 gradient
//! (the sum of its bf16 contributions, each cast up). Call `backward` inside or outside the
//! scope; it is the same. Note one consequence for [`Var::linear`] under autocast: its
//! parameter inputs are the casts, so a parameter's gradient hook runs after the cast's
//! backward (one elementwise kernel later) rather than directly from the GEMM.
//!
//! # The cast cache
//!
//! Within one autocast scope (the outermost enabled one), the low-precision copy of a
//! *parameter* (a leaf that requires a gradient) is cached and reused by every op that needs
//! it, as PyTorch does: a weight used several times in one forward (tied embeddings, an
//! unrolled RNN, a layer applied twice) is cast once. The cache is keyed by the variable's
//! identity and the target dtype, and an entry is used only while it is still valid: the
//! parameter still holds the very tensor that was cast (an optimizer step or `set_tensor`
//! inside the scope makes the entry stale, and it is cast again), and the cast's graph has not
//! been freed by a `backward` (so a training loop entirely inside one scope works). Nothing is
//! cached under [`crate::no_grad`] (there a cast is a constant that must not leak into a
//! recorded graph later). The cache is dropped when the outermost enabled scope ends. Its cost:
//! the low copies of the parameters live until then — in the usual pattern (scope around the
//! forward and the loss) no longer than the graph holds them anyway.
//!
//! # What autocast does not do
//!
//! It does not scale the loss: f16's range (6e-5 .. 65504) loses small gradients, so f16
//! training needs `kiln_optim::GradScaler`; bf16 has f32's range and needs none.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

use kiln_core::fasthash::FastMap;
use kiln_core::{BinaryOp, DType, Error, Result, UnaryOp};

use crate::var::{Var, VarId, is_grad_enabled};
use kiln_core::Backend;

thread_local! {
    /// The autocast dtype of this thread, `None` outside any (enabled) scope.
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
    /// How many enabled autocast guards are alive on this thread; the cache is cleared when
    /// the count returns to 0.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// The cast cache: `(parameter, dtype)` to a type-erased [`CacheEntry`].
    static CACHE: RefCell<FastMap<(VarId, DType), Box<dyn Any>>> = RefCell::new(FastMap::default());
}

/// The autocast dtype in effect on this thread: `Some(F16 | BF16)` inside an [`autocast`]
/// scope, `None` outside or inside [`autocast_disabled`].
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// Enters an autocast scope on this thread (PyTorch's `torch.autocast(device, dtype)`): until
/// the guard drops, low-precision ops run in `dtype` and the f32 ops in f32 (module docs).
///
/// `dtype` must be [`DType::BF16`] or [`DType::F16`]; anything else is an
/// [`Error::DTypeMismatch`] (an "f32 autocast" is simply no scope).
pub fn autocast(dtype: DType) -> Result<AutocastGuard> {
    if !dtype.is_half() {
        return Err(Error::DTypeMismatch {
            op: "autocast",
            expected: "a 16-bit float dtype (bf16 or f16)".into(),
            got: dtype,
        });
    }
    Ok(AutocastGuard::enter(Some(dtype)))
}

/// Turns autocast off on this thread until the guard drops (PyTorch's
/// `torch.autocast(..., enabled=False)` inside an enabled region): ops run in their inputs'
/// dtypes again.
pub fn autocast_disabled() -> AutocastGuard {
    AutocastGuard::enter(None)
}

/// Restores the previous autocast state when dropped; see [`autocast`]. Not `Send`: the state
/// it restores belongs to the thread that created it.
#[must_use = "autocast applies only while the guard is alive: bind it with `let _amp = ...`"]
pub struct AutocastGuard {
    prev: Option<DType>,
    enabled: bool,
    _not_send: PhantomData<*const ()>,
}

impl AutocastGuard {
    fn enter(dtype: Option<DType>) -> Self {
        if dtype.is_some() {
            DEPTH.with(|d| d.set(d.get() + 1));
        }
        AutocastGuard {
            prev: AUTOCAST.with(|a| a.replace(dtype)),
            enabled: dtype.is_some(),
            _not_send: PhantomData,
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.prev));
        if self.enabled {
            let left = DEPTH.with(|d| {
                let n = d.get().saturating_sub(1);
                d.set(n);
                n
            });
            if left == 0 {
                // `take` then drop outside the borrow: dropping a cached Var never re-enters
                // the cache, but there is no reason to hold the borrow while it runs.
                let old = CACHE.with(|c| std::mem::take(&mut *c.borrow_mut()));
                drop(old);
            }
        }
    }
}

/// Whether autocast casts a value of `dtype` (f32, f16, bf16; never f64 or integers).
fn eligible(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// The unary ops autocast runs in f32 (PyTorch's fp32 list).
pub(crate) fn unary_in_f32(op: UnaryOp) -> bool {
    matches!(
        op,
        UnaryOp::Exp
            | UnaryOp::Expm1
            | UnaryOp::Log
            | UnaryOp::Log1p
            | UnaryOp::Recip
            | UnaryOp::Rsqrt
            | UnaryOp::Softplus
    )
}

/// The binary ops autocast runs in f32 (the rest follow the widest operand).
pub(crate) fn binary_in_f32(op: BinaryOp) -> bool {
    matches!(op, BinaryOp::Pow)
}

/// One cached cast of a parameter: the tensor that was cast and the cast variable.
struct CacheEntry<B: Backend> {
    src: kiln_core::Tensor<B>,
    cast: Var<B>,
}

impl<B: Backend> Var<B> {
    /// Under [`autocast`]: this variable in the autocast dtype, when it is an eligible float
    /// (f32/f16/bf16) of another dtype — the cast of the "low" op list. Itself otherwise, and
    /// always outside autocast. Parameters' casts are cached within the scope (module docs).
    /// For layers outside this crate that add a low-precision op (a convolution's bias).
    pub fn autocast_low(&self) -> Result<Self> {
        match autocast_dtype() {
            Some(low) if eligible(self.dtype()) && self.dtype() != low => self.cached_cast(low),
            _ => Ok(self.clone()),
        }
    }

    /// Under [`autocast`]: this variable in f32 when it is f16 or bf16 — the cast of the "f32"
    /// op list. Itself otherwise, and always outside autocast. For losses and norms outside
    /// this crate.
    pub fn autocast_f32(&self) -> Result<Self> {
        match autocast_dtype() {
            Some(_) if self.dtype().is_half() => self.to_dtype(DType::F32),
            _ => Ok(self.clone()),
        }
    }

    /// Under [`autocast`]: `(a, b)` with the narrower eligible float cast to the wider one
    /// (the "widest" list); unchanged otherwise (and outside autocast, where mixed dtypes stay
    /// the op's error).
    pub fn autocast_widest(a: &Self, b: &Self) -> Result<(Self, Self)> {
        let [a, b]: [Self; 2] = widest_all(&[a.clone(), b.clone()])?
            .try_into()
            .expect("two in, two out");
        Ok((a, b))
    }

    /// The cast to `dtype`, through the cache for parameters (leaves requiring a gradient)
    /// while recording.
    fn cached_cast(&self, dtype: DType) -> Result<Self> {
        if !(self.is_leaf() && self.requires_grad() && is_grad_enabled()) {
            return self.to_dtype(dtype);
        }
        let key = (self.id(), dtype);
        let src = self.tensor();
        let hit = CACHE.with(|c| {
            let c = c.borrow();
            let e = c.get(&key)?.downcast_ref::<CacheEntry<B>>()?;
            let valid =
                e.src.same_storage(&src) && e.src.layout() == src.layout() && e.cast.graph_alive();
            valid.then(|| e.cast.clone())
        });
        if let Some(v) = hit {
            return Ok(v);
        }
        let cast = self.to_dtype(dtype)?;
        let entry: Box<dyn Any> = Box::new(CacheEntry {
            src,
            cast: cast.clone(),
        });
        CACHE.with(|c| c.borrow_mut().insert(key, entry));
        Ok(cast)
    }
}

/// The wider of two eligible float dtypes (f32 over both 16-bit types; f16 and bf16 together
/// give f32, since neither holds the other).
fn widest(a: DType, b: DType) -> DType {
    if a == b { a } else { DType::F32 }
}

/// Casts every float input in `vars` to the widest float dtype among them, under autocast
/// (for `cat` and `where`); returns them unchanged otherwise.
pub(crate) fn widest_all<B: Backend>(vars: &[Var<B>]) -> Result<Vec<Var<B>>> {
    let first = vars.first().map(Var::dtype);
    let mixed = vars.iter().any(|v| Some(v.dtype()) != first);
    if autocast_dtype().is_none() || !mixed || !vars.iter().all(|v| eligible(v.dtype())) {
        return Ok(vars.to_vec());
    }
    let wide = vars
        .iter()
        .map(Var::dtype)
        .reduce(widest)
        .unwrap_or(DType::F32);
    vars.iter().map(|v| v.to_dtype(wide)).collect()
}

/// Number of entries in this thread's cast cache (tests).
#[doc(hidden)]
pub fn autocast_cache_len() -> usize {
    CACHE.with(|c| c.borrow().len())
}
