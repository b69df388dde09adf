//! The elementwise and reduction op enums: the vocabulary shared by the [`Backend`] trait's
//! kernels and by the expression IR.
//!
//! # Why a module of its own
//!
//! Both `backend` (the kernels) and the expression IR (`ir`) name these ops, and `backend`
//! names the IR (`Backend::eval_expr` takes a program). With the enums here, at the bottom,
//! every module imports downward: `op` <- `ir` <- `backend` <- `expr` (the evaluators).
//! `backend` re-exports them, so `kiln_core::backend::UnaryOp` keeps working.
//!
//! [`Backend`]: crate::Backend

use crate::DType;

/// Elementwise functions of one argument.
///
/// Float dtypes support all of them; `i64` supports `Neg`, `Abs`, `Square`, `Sign`, `Relu`;
/// `u8` supports none (cast it first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Square,
    /// `1 / x`
    Recip,
    Sin,
    Cos,
    Tanh,
    /// `1 / (1 + exp(-x))`
    Sigmoid,
    Relu,
    /// The exact GELU, `x * Φ(x) = x/2 * (1 + erf(x/√2))` (PyTorch's default).
    Gelu,
    /// -1, 0 or 1.
    Sign,
    Floor,
    Ceil,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 16] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Square,
        UnaryOp::Recip,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::Sign,
        UnaryOp::Floor,
        UnaryOp::Ceil,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Square => "square",
            UnaryOp::Recip => "recip",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::Sign => "sign",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
        }
    }

    /// Whether the op is defined for `dtype`.
    pub fn supports(self, dtype: DType) -> bool {
        match dtype {
            DType::F32 | DType::F64 => true,
            DType::I64 => matches!(
                self,
                UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Square | UnaryOp::Sign | UnaryOp::Relu
            ),
            _ => false,
        }
    }

    /// Which tensor [`Backend::unary_backward`](crate::Backend::unary_backward) reads the derivative from: the input `x` or the
    /// output `y = op(x)`. `None` for the ops it does not cover (`Neg`, `Gelu`, and the
    /// piecewise-constant `Sign`, `Floor`, `Ceil`).
    pub fn grad_reads(self) -> Option<GradFrom> {
        match self {
            UnaryOp::Abs | UnaryOp::Log | UnaryOp::Square | UnaryOp::Sin | UnaryOp::Cos => {
                Some(GradFrom::Input)
            }
            UnaryOp::Exp
            | UnaryOp::Sqrt
            | UnaryOp::Recip
            | UnaryOp::Tanh
            | UnaryOp::Sigmoid
            | UnaryOp::Relu => Some(GradFrom::Output),
            UnaryOp::Neg | UnaryOp::Gelu | UnaryOp::Sign | UnaryOp::Floor | UnaryOp::Ceil => None,
        }
    }
}

/// The operand a unary op's derivative is computed from (see [`UnaryOp::grad_reads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradFrom {
    /// `x`, the op's input.
    Input,
    /// `y = op(x)`, the op's output.
    Output,
}

/// Elementwise functions of two arguments of the same dtype.
///
/// Float dtypes support all; `i64` supports all but `Pow` (`Div` truncates toward zero, as in
/// Rust and C, and an integer division by zero gives 0 on every backend, since a GPU kernel
/// cannot stop to report it); `u8` supports `Maximum` and `Minimum` only. On floats,
/// `Maximum`/`Minimum` propagate NaN (as `torch.maximum`), unlike `f32::max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }

    pub fn supports(self, dtype: DType) -> bool {
        match dtype {
            DType::F32 | DType::F64 => true,
            DType::I64 => self != BinaryOp::Pow,
            DType::U8 => matches!(self, BinaryOp::Maximum | BinaryOp::Minimum),
        }
    }
}

/// Comparisons; the result is a `u8` mask (1 where true). Defined for every dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub const ALL: [CmpOp; 6] = [
        CmpOp::Eq,
        CmpOp::Ne,
        CmpOp::Lt,
        CmpOp::Le,
        CmpOp::Gt,
        CmpOp::Ge,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
}

/// Reductions over a set of axes. The result keeps the reduced axes with size 1.
///
/// `Sum` is defined for f32/f64/i64 (an empty reduction gives 0); `Max`/`Min` for every dtype
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
