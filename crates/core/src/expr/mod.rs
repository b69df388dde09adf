//! One expression IR for every backend: elementwise expressions and axis reductions, evaluated
//! fused.
//!
//! # Why
//!
//! A chain of elementwise ops run one kernel at a time reads and writes every intermediate
//! through main memory (CPU) or device memory (GPU), and on a GPU pays a launch per op. Fusing
//! the chain reads each input once and writes each output once. Several users want the same
//! fusion: the CUDA backend's lazy chains, optimizers' multi-tensor updates, activation and loss
//! tails, and users' own functions (`kiln_autograd::fuse`). So the expression is one small typed
//! IR here, in kiln-core, knowing no backend, and each backend evaluates it its own way
//! ([`Backend::eval_expr`](crate::Backend::eval_expr)); autograd differentiates it into another
//! program of the same IR ([`grad`]), so a fused function needs no hand-written backward.
//! Both backends also *defer* plain tensor ops into it: [`defer`] records elementwise ops as a
//! graph and turns a chain into one program when its values are read (every chain on a GPU, on
//! the CPU those over tensors larger than the caches).
//!
//! # The IR
//!
//! A [`Program`] is a typed SSA list of [`Instr`]uctions over
//! - tensor **inputs** (their dtypes are part of the program; at run time they come as storage +
//!   [`Layout`](crate::Layout), already broadcast to one *iteration shape*: transposed, sliced
//!   and broadcast (stride-0) views are read in place),
//! - scalar **parameters** (kernel arguments: a learning rate that changes every step does not
//!   make a new program), and **constants** (part of the program),
//! - the ops of [`UnaryOp`](crate::UnaryOp), [`BinaryOp`](crate::BinaryOp) and
//!   [`CmpOp`](crate::CmpOp) with the backends' semantics, `where`, casts,
//! - and **reductions** ([`Instr::Reduce`]) over one set of axes per program: the *map* is the
//!   elementwise value reduced, the *combine* a [`Combine`] (sum, prod, max, min), the
//!   *post-map* whatever instructions read the reduced values.
//!
//! Every value has a dtype and a [`Phase`]: uniform (constants and parameters), per element of
//! the iteration shape, or per element of the *kept* shape (the iteration shape with the
//! reduction axes set to 1). A program has one or more outputs, each in its value's shape:
//! elementwise outputs and reduced outputs may be mixed (`y = f(x)` and `sum(y)` in one pass).
//! Outputs are contiguous buffers.
//!
//! [`Program::new`] validates everything it can without shapes (operands defined before use,
//! dtypes each op accepts, phases); [`check_call`] validates one call (number of inputs and
//! parameters, layouts, axes). Mistakes are [`Error::Expr`](crate::Error::Expr) with an
//! [`ExprErrorKind`](crate::ExprErrorKind) and the op's name, never panics.
//!
//! Programs are plain data, `Eq + Hash` and shape-free, so a backend memoizes one compiled
//! kernel per distinct program; shapes and strides are arguments of each call.
//!
//! [`Expr`] writes programs as ordinary Rust (`x * x.sigmoid()`, `(x - m).exp().sum(&[-1])`)
//! and [`Program::from_exprs`] lowers them (with common subexpressions shared).
//!
//! # Evaluators
//!
//! - **Op by op** ([`eval_composed`]): one backend kernel per instruction, with exactly that
//!   backend's op-by-op semantics. The f64 reference backend's `eval_expr` is this evaluator
//!   (it is the oracle the fused evaluators are tested against), and fused evaluators fall back
//!   to it for what they do not fuse.
//! - **CPU** (kiln-backend-cpu `expr`): one pass over the data, block by block, as numexpr.
//! - **CUDA** (kiln-backend-cuda `expr_eval`): one generated kernel per program and variant.
//! - **As tensor ops** ([`Program::run_ops`]): one `Tensor` op per instruction, recorded like
//!   any other op by a backend that defers; autograd applies the binary ops' gradient rules so.
//!
//! # Module layers
//!
//! The IR's data (programs, [`Expr`], [`check_call`], [`grad`]) lives in a private module below
//! `backend` (it imports only the op enums, errors, dtypes, shapes and layouts), because
//! [`Backend::eval_expr`](crate::Backend::eval_expr) takes a [`Program`]. This module sits
//! above `backend` and `tensor` and re-exports the IR: it adds what needs a backend, the
//! op-by-op evaluator and [`Program::run`]. `eval_expr` therefore has no default (a default
//! calling `eval_composed` would make `backend` import this module, a circle): each backend
//! names its evaluator.
//!
//! # Generating a CUDA kernel from a program
//!
//! The IR is designed to map one-to-one onto a C-like kernel, as tinygrad's renderer or CuPy's
//! fusion do, in a pure code generator (program + dtypes → source, no device):
//! - one C variable per value, declared with the C type of [`Program::dtypes`], defined in
//!   instruction order (SSA needs no register allocation; NVRTC does it);
//! - `Input(k)`: a load `in_k[offset_k(i)]` where `offset_k` comes from the layout's strides
//!   passed by value (a contiguous specialization when every input is contiguous: the program is
//!   the cache key, the "contiguous" flag a variant of it); `Param(k)`: a kernel argument;
//!   `Const`: a literal from [`Scalar::bits`] (exact, e.g. a hex float);
//! - `Unary`/`Binary`/`Cmp`: the scalar device functions the single-op kernels already use,
//!   so fused and unfused results agree bit for bit; `Where`: `?:`; `Cast`: the `as` helper;
//! - without reductions, one thread per element (grid-stride loop) computes the values of
//!   [`Phase::Elem`] and stores each output;
//! - with reductions, one block (or warp) per kept element: each thread folds its share of the
//!   reduced elements with the [`Combine`] (identity from [`Combine::identity`], the first
//!   element for max/min), a tree reduction in shared memory combines the partials, then thread
//!   0 evaluates the [`Phase::Reduced`] instructions (the post-map) and stores the reduced
//!   outputs; elementwise outputs of the same program are stored during the fold. When the kept
//!   extent is large and the reduced one small, one thread per kept element instead.
//! - memoize compiled kernels by `(Program, contiguous, index width, device)`.
//!
//! # Not (yet) in the IR
//!
//! Index arithmetic (iota, argmax), gathers, matmul, and reductions over several different axis
//! sets in one program (split such a computation in several programs).

pub mod defer;
mod eval;
mod norm;
mod tensor_ops;

pub use crate::ir::{
    CallPlan, Combine, Expr, Instr, Operands, Phase, Program, Scalar, Val, check_call, fingerprint,
};
pub use crate::ir::{grad, rules};
pub use eval::eval_composed;
pub use tensor_ops::Arg;
