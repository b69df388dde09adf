//! The ops: the vocabulary shared by the [`Backend`] trait's kernels and by the expression IR.
//!
//! - `unary`: the op table, one entry per elementwise function of one argument, from which
//!   every backend, the IR, autograd and the tests derive what they do with it;
//! - `binary`: the table of elementwise functions of two arguments (with their gradients), and
//!   the comparisons;
//! - `composite`: the table of elementwise functions with scalar parameters, each an
//!   expression over the unary ops;
//! - the reduction enums (below) and the reductions' [`Combine`];
//! - `expr_tree`: [`Expr`], the expression tree the table writes derivatives with;
//! - `real`: [`Real`], the float arithmetic the table writes scalar functions with.
//!
//! # Why a module of its own
//!
//! Both `backend` (the kernels) and the expression IR (`ir`) name these ops, and `backend`
//! names the IR (`Backend::eval_expr` takes a program). With the ops here, at the bottom,
//! every module imports downward: `op` <- `ir` <- `backend` <- `expr` (the evaluators).
//! `backend` re-exports them, so `kiln_core::backend::UnaryOp` keeps working.
//!
//! [`Backend`]: crate::Backend

mod binary;
mod composite;
mod expr_tree;
mod real;
mod unary;

pub use binary::{
    BinaryFn, BinaryOp, BinaryVisitor, CmpFn, CmpOp, CmpVisitor, Side, binary_fns, cmp_fns,
};
pub use composite::CompositeOp;
pub use expr_tree::Expr;
pub(crate) use expr_tree::Node;
pub use real::Real;
pub use unary::{Domain, GradFrom, UnaryFn, UnaryOp, UnaryVisitor, Vjp, unary_fns};

use crate::DType;

/// Reductions over a set of axes. The result keeps the reduced axes with size 1.
///
/// `Sum` is defined for the floats and i64 (an empty reduction gives 0); `Max`/`Min` for every dtype
/// (never called on an empty reduction: `Tensor` rejects it; NaN propagates);
/// `ArgMax`/`ArgMin` reduce exactly one axis, return `i64` indices and pick the first occurrence
/// on ties (NaN counts as the largest for `ArgMax` and the smallest for `ArgMin`, as in numpy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    ArgMax,
    ArgMin,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::ArgMax,
        ReduceOp::ArgMin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }

    pub fn is_arg(self) -> bool {
        matches!(self, ReduceOp::ArgMax | ReduceOp::ArgMin)
    }
}

/// How a reduction folds the values it maps: the "combine" of map / combine / post-map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Combine {
    /// Identity 0; the floats and i64 (i64 wraps).
    Sum,
    /// Identity 1; the floats and i64 (i64 wraps).
    Prod,
    /// No identity (an empty reduction is an error); every dtype; NaN propagates.
    Max,
    /// As `Max`.
    Min,
}

impl Combine {
    pub const ALL: [Combine; 4] = [Combine::Sum, Combine::Prod, Combine::Max, Combine::Min];

    pub fn name(self) -> &'static str {
        match self {
            Combine::Sum => "sum",
            Combine::Prod => "prod",
            Combine::Max => "max",
            Combine::Min => "min",
        }
    }
    pub fn supports(self, dtype: DType) -> bool {
        match self {
            Combine::Sum | Combine::Prod => dtype.is_float() || dtype == DType::I64,
            Combine::Max | Combine::Min => true,
        }
    }
    /// The `Backend::reduce` op that computes the same fold, where there is one.
    pub fn reduce_op(self) -> Option<ReduceOp> {
        match self {
            Combine::Sum => Some(ReduceOp::Sum),
            Combine::Max => Some(ReduceOp::Max),
            Combine::Min => Some(ReduceOp::Min),
            Combine::Prod => None,
        }
    }
    /// The value an empty reduction gives, if any.
    pub fn identity(self) -> Option<f64> {
        match self {
            Combine::Sum => Some(0.0),
            Combine::Prod => Some(1.0),
            Combine::Max | Combine::Min => None,
        }
    }
}
