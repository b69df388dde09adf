//! # kiln-autograd
//!
//! Define-by-run automatic differentiation over any backend (Chainer's and PyTorch's model):
//! ops on [`Var<B>`](Var) run immediately *and* record how to differentiate themselves, so the
//! graph is whatever the Rust code did — loops, branches and early returns included — and
//! [`Var::backward`] walks it back from a scalar loss.
//!
//! ```
//! use kiln_autograd::Var;
//! use kiln_backend_cpu::Cpu;
//! use kiln_core::{Generator, Tensor};
//!
//! let dev = Cpu::device(0);
//! let w = Var::param(Generator::new(1).normal::<Cpu>([784, 1], 0.0, 0.01, &dev)?);
//! let x = Var::constant(Generator::new(2).rand::<Cpu>([32, 784], &dev)?);
//! let loss = x.matmul(&w)?.sigmoid()?.mean_all()?;
//! loss.backward()?;                                  // fills w.grad()
//! let g = w.grad().unwrap();
//! w.update_data(|t| t.sub(&g.mul_scalar(0.01)?))?;   // what an optimizer does
//! w.zero_grad();
//! # Ok::<(), kiln_core::Error>(())
//! ```
//!
//! ## Design
//!
//! - A [`Var`] is an `Arc` handle (`Send + Sync`, no `Rc`/`RefCell`), so one thread per GPU can
//!   train its own replica. Clones are the same variable.
//! - Leaves: [`Var::param`] / [`Var::leaf`] (require a gradient) and [`Var::constant`]. Op outputs
//!   hold a node: their inputs and a backward closure over the tensors the op saved. An op whose
//!   inputs need no gradient, or one run inside [`no_grad`], records nothing.
//! - `backward` orders the reachable nodes topologically (iteratively: deep graphs are fine),
//!   sums the gradients of a variable used several times, adds the result to each leaf's
//!   [`Var::grad`] (accumulating across calls until [`Var::zero_grad`], as in PyTorch), and then
//!   frees the graph unless asked to keep it ([`Var::backward_retain`]).
//! - Gradients of broadcast operands are summed back to the operand's shape
//!   ([`reduce_to_shape`]).
//! - Each op saves only the tensors its gradient reads (a `relu` keeps its output, an `add`
//!   nothing, a `mul` the other operand only when that side needs a gradient), so the graph
//!   holds no more activation memory than PyTorch's.
//! - Moving a variable to another device ([`Var::to_device`], [`Var::copy_to`]) is an op whose
//!   backward copies the gradient back (Chainer's `F.copy`), so a model split over two GPUs
//!   backpropagates across them. Mixing devices in any other op is an error naming both.
//! - Layers' ops with a closed-form backward are one node each, as softmax and cross-entropy:
//!   [`Var::layer_norm`] and [`Var::rms_norm`] (forward and backward as expression programs,
//!   saving the row statistics as PyTorch does), [`Var::embedding`] (gradient by `scatter_add`).
//! - Convolutional networks' ops: [`Var::batch_norm_train`] / [`Var::batch_norm_eval`] (the
//!   batch statistics returned for [`update_running_stats`], the op itself stateless) and
//!   [`Var::group_norm`], one node each with programs forward and backward;
//!   [`Var::avg_pool2d`] and [`Var::adaptive_avg_pool2d`], separable averages written with
//!   `matmul` (or one mean for non-overlapping windows) and differentiated through them; their
//!   constant matrices are uploaded once per geometry, dtype and device and cached.
//! - [`Var::conv2d_native`]: a convolution by the backend's own library (cuDNN), one node whose
//!   backward calls the library's two gradients; `None` where the backend offers none (the
//!   CPU), and kiln-nn then keeps its im2col path.
//! - [`Var::scaled_dot_product_attention`] (causal, boolean or additive masks, dropout) is one
//!   node of the backend's fused flash-style kernel where it offers one (CUDA; every mask,
//!   dropout inside the kernel), else two batched products around one masked-softmax
//!   node; fully masked rows give zeros, not NaN. [`Var::packed_self_attention`] is multi-head
//!   self-attention of a packed `[.., T, 3E]` projection as one node: on the fused path its
//!   gradient is one buffer the kernels write, with no zero-fill, slice assignment or sum.
//! - Mixed precision: inside an [`autocast`] scope, GEMMs run in bf16/f16 and softmax,
//!   losses, norms and reductions in f32, op by op as `torch.autocast` does (the op lists are
//!   in the [`autocast`] docs); the backward follows through differentiable casts.
//! - Custom ops (e.g. around a hand-written kernel) are one call: [`Var::from_op`].
//! - Fused user functions ([`fuse`]): written once over `Expr`s, run as one pass on any
//!   backend, differentiated through the expression IR (no hand-written backward).
//! - [`check_backward`] is Chainer's numerical gradient check; the generic gradient test suite
//!   every backend runs is `testing::run_gradient_suite` (feature `testing`).
//!
//! ## Gradients at kinks and ties
//!
//! They follow PyTorch, so results can be compared with it:
//! - `relu`, `abs`: the derivative at 0 is 0; `sign`, `floor`, `ceil` have a zero gradient.
//! - [`Var::maximum`] / [`Var::minimum`] of two variables: on ties the gradient is split evenly.
//! - [`Var::maximum_scalar`] / [`Var::minimum_scalar`] / [`Var::clamp`] (against constants): as
//!   `torch.clamp`, the gradient passes where the value is inside the closed range, ties
//!   included.
//! - [`Var::max`] / [`Var::min`] reductions: as `torch.amax`/`amin`, the gradient is shared
//!   evenly among all the elements equal to the extreme.
//! - [`Var::pow`]: where the exponent is 0 the base gets 0; where the base is 0 and the exponent
//!   is `>= 0` the exponent gets 0 (not `0 * log 0 = NaN`).
//!
//! ## For optimizers
//!
//! Parameters are `Var`s made with [`Var::param`]. After `backward`, read [`Var::grad`]; write the
//! new value with [`Var::set_tensor`] or [`Var::update_data`] (the tensor is replaced in place
//! for every clone of the variable; graphs already recorded keep the old value); rewrite or drop
//! gradients with [`Var::set_grad`] / [`Var::zero_grad`]; key per-parameter state by [`Var::id`].
//!
//! ## Not supported
//!
//! Higher-order gradients: backward closures compute with plain tensors, so a gradient is never
//! itself a recorded `Var` and cannot be differentiated again (no `create_graph`). In-place ops
//! on `Var`s do not exist; `set_tensor` is the only mutation and is for leaves.

mod attention;
mod autocast;
mod batch_norm;
mod check;
mod composite;
mod conv;
mod embedding;
mod fuse;
mod linear_act;
mod norm;
mod norm_fused;
mod ops;
mod pool;
mod programs;
mod self_attention;
#[cfg(feature = "testing")]
pub mod testing;
mod var;

pub use attention::{AttnMask, ComposedAttentionGuard, composed_attention};
pub use autocast::{
    AutocastGuard, autocast, autocast_cache_len, autocast_disabled, autocast_dtype,
};
pub use batch_norm::{BatchStats, update_running_stats};
pub use check::{CheckOptions, assert_backward, check_backward};
pub use fuse::{Fused, fuse, fuse_n, fuse2};
pub use linear_act::{linear_epilogues_enabled, set_linear_epilogues};
pub use norm_fused::{ComposedNormGuard, composed_norm};
pub use ops::reduce_to_shape;
pub use pool::AvgPoolOptions;
pub use var::{BackwardFn, GradHook, HookHandle, InputGrads, Var, VarId, is_grad_enabled, no_grad};
