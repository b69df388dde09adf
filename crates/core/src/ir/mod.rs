//! The expression IR's data: programs, the [`Expr`] builder, the per-call checks, and autograd's
//! derivation of a backward program. Pure data and functions over it: no backend, no tensor.
//!
//! # Why it sits below `backend`
//!
//! [`Backend::eval_expr`](crate::Backend::eval_expr) takes a [`Program`], so the trait needs
//! the IR; the op-by-op evaluator (`eval_composed`, in the `expr` module) needs the trait. Keeping
//! the IR here, importing only `op`, `error`, `dtype`, `shape` and `layout`, makes every module
//! of kiln-core import downward. Users see it all through the public `expr` module, which re-exports it.

mod build;
mod call;
pub mod grad;
mod program;
pub mod rules;
mod widen;

pub use crate::op::Expr;
pub use call::{CallPlan, check_call};
pub(crate) use program::expr_err;
pub use program::{Combine, Instr, Operands, Phase, Program, Scalar, Val, fingerprint};
