//! [`Expr`]: expression trees written as ordinary Rust (`x * x.sigmoid()`), lowered to a
//! `Program` by the IR (`ir/build.rs`).
//!
//! It lives beside the op enums, below the IR, because the op table writes each op's
//! derivative as an `Expr`.
//!
//! An `Expr` carries no dtype of its own: inputs get theirs when the tree is lowered
//! ([`Program::from_exprs`]), and constants and parameters take the dtype of the values they meet
//! (a "weak" scalar, as a Python float meeting a float32 array in numpy/PyTorch). So one function
//! written over `Expr`s lowers to an f32 program or an f64 one. A subtree whose dtype nothing
//! fixes (constants and parameters only, e.g. both sides of a comparison) takes the dtype of
//! input 0, or f32, kiln's default, in a program without inputs. Lowering shares common subexpressions: the
//! same `Expr` used twice, or two equal instructions, become one value.

use std::ops;
use std::sync::Arc;

use crate::DType;
use crate::op::{BinaryOp, CmpOp, Combine, UnaryOp};

/// An expression over tensor inputs and scalar parameters (see the module docs). Cheap to
/// clone (an `Arc`).
#[derive(Clone, Debug)]
pub struct Expr(pub(crate) Arc<Node>);

#[derive(Debug)]
pub(crate) enum Node {
    Input(u32),
    Param(u32),
    /// A constant, weak (`None`: takes its context's dtype) or of a fixed dtype.
    Const(f64, Option<DType>),
    Unary(UnaryOp, Expr),
    Binary(BinaryOp, Expr, Expr),
    Cmp(CmpOp, Expr, Expr),
    Where(Expr, Expr, Expr),
    Cast(DType, Expr),
    Reduce(Combine, Vec<isize>, Expr),
}

impl From<f64> for Expr {
    fn from(v: f64) -> Expr {
        Expr::constant(v)
    }
}

impl From<&Expr> for Expr {
    fn from(e: &Expr) -> Expr {
        e.clone()
    }
}

macro_rules! cmp_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(
            #[doc = concat!("`CmpOp::", stringify!($op), "`: a `u8` 0/1 mask.")]
            pub fn $name(&self, rhs: impl Into<Expr>) -> Expr {
                self.compare(CmpOp::$op, rhs)
            }
        )*
    };
}

impl Expr {
    fn node(n: Node) -> Expr {
        Expr(Arc::new(n))
    }

    /// Tensor input `k`.
    pub fn input(k: usize) -> Expr {
        Self::node(Node::Input(k as u32))
    }
    /// Scalar parameter `k`: a value given at each call, which does not change the program.
    pub fn param(k: usize) -> Expr {
        Self::node(Node::Param(k as u32))
    }
    /// A weak constant: it takes the dtype of what it meets.
    pub fn constant(v: f64) -> Expr {
        Self::node(Node::Const(v, None))
    }
    /// A constant of a fixed dtype.
    pub fn constant_of(v: f64, dtype: DType) -> Expr {
        Self::node(Node::Const(v, Some(dtype)))
    }

    pub fn unary(&self, op: UnaryOp) -> Expr {
        Self::node(Node::Unary(op, self.clone()))
    }
    pub fn binary(&self, op: BinaryOp, rhs: impl Into<Expr>) -> Expr {
        Self::node(Node::Binary(op, self.clone(), rhs.into()))
    }
    pub fn compare(&self, op: CmpOp, rhs: impl Into<Expr>) -> Expr {
        Self::node(Node::Cmp(op, self.clone(), rhs.into()))
    }
    /// `self != 0 ? on_true : on_false`, `self` being a `u8` mask (Tensor's `where_cond`).
    pub fn where_cond(&self, on_true: impl Into<Expr>, on_false: impl Into<Expr>) -> Expr {
        Self::node(Node::Where(self.clone(), on_true.into(), on_false.into()))
    }
    /// Converts to `dtype` (`as` semantics).
    pub fn to_dtype(&self, dtype: DType) -> Expr {
        Self::node(Node::Cast(dtype, self.clone()))
    }
    /// Folds over `axes` of the iteration shape (negative from the end); the result has the
    /// kept shape (those axes become 1). Every reduction of one program uses the same axes.
    pub fn reduce(&self, combine: Combine, axes: &[isize]) -> Expr {
        Self::node(Node::Reduce(combine, axes.to_vec(), self.clone()))
    }
    pub fn sum(&self, axes: &[isize]) -> Expr {
        self.reduce(Combine::Sum, axes)
    }
    pub fn prod(&self, axes: &[isize]) -> Expr {
        self.reduce(Combine::Prod, axes)
    }
    pub fn max(&self, axes: &[isize]) -> Expr {
        self.reduce(Combine::Max, axes)
    }
    pub fn min(&self, axes: &[isize]) -> Expr {
        self.reduce(Combine::Min, axes)
    }

    cmp_methods!(eq => Eq, ne => Ne, lt => Lt, le => Le, gt => Gt, ge => Ge);

    /// `min(max(self, lo), hi)`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Expr {
        self.maximum(lo).minimum(hi)
    }
}

/// One method per entry of the binary op table (`BinaryOp`), with broadcasting.
macro_rules! expr_binary_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident $scalar:ident $dt:ident { $($body:tt)* })*) => {
        impl Expr {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self, rhs: impl Into<Expr>) -> Expr {
                    self.binary(BinaryOp::$V, rhs)
                }
            )*
        }
    };
}
crate::binary_table!(expr_binary_methods);

/// One method per entry of the op table (`UnaryOp`).
macro_rules! expr_unary_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident $dt:ident { $($body:tt)* })*) => {
        impl Expr {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self) -> Expr {
                    self.unary(UnaryOp::$V)
                }
            )*
        }
    };
}
crate::unary_table!(expr_unary_methods);

macro_rules! binop_impl {
    ($tr:ident, $m:ident, $op:ident) => {
        impl ops::$tr<Expr> for Expr {
            type Output = Expr;
            fn $m(self, rhs: Expr) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<&Expr> for Expr {
            type Output = Expr;
            fn $m(self, rhs: &Expr) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<Expr> for &Expr {
            type Output = Expr;
            fn $m(self, rhs: Expr) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<&Expr> for &Expr {
            type Output = Expr;
            fn $m(self, rhs: &Expr) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<f64> for Expr {
            type Output = Expr;
            fn $m(self, rhs: f64) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<f64> for &Expr {
            type Output = Expr;
            fn $m(self, rhs: f64) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<Expr> for f64 {
            type Output = Expr;
            fn $m(self, rhs: Expr) -> Expr {
                Expr::constant(self).binary(BinaryOp::$op, rhs)
            }
        }
        impl ops::$tr<&Expr> for f64 {
            type Output = Expr;
            fn $m(self, rhs: &Expr) -> Expr {
                Expr::constant(self).binary(BinaryOp::$op, rhs)
            }
        }
    };
}
binop_impl!(Add, add, Add);
binop_impl!(Sub, sub, Sub);
binop_impl!(Mul, mul, Mul);
binop_impl!(Div, div, Div);

impl ops::Neg for Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        self.unary(UnaryOp::Neg)
    }
}
impl ops::Neg for &Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        self.unary(UnaryOp::Neg)
    }
}
