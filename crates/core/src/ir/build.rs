//! [`Expr`]: expression trees written as ordinary Rust (`x * x.sigmoid()`), lowered to a
//! [`Program`].
//!
//! An `Expr` carries no dtype of its own: inputs get theirs when the tree is lowered
//! ([`Program::from_exprs`]), and constants and parameters take the dtype of the values they meet
//! (a "weak" scalar, as a Python float meeting a float32 array in numpy/PyTorch). So one function
//! written over `Expr`s lowers to an f32 program or an f64 one. A subtree whose dtype nothing
//! fixes (constants and parameters only, e.g. both sides of a comparison) takes the dtype of
//! input 0, or f32, kiln's default, in a program without inputs. Lowering shares common subexpressions: the
//! same `Expr` used twice, or two equal instructions, become one value.

use std::collections::HashMap;
use std::ops;
use std::sync::Arc;

use super::program::{Combine, Instr, Program, Scalar, Val, expr_err};
use crate::error::ExprErrorKind;
use crate::op::{BinaryOp, CmpOp, UnaryOp};
use crate::{DType, Result};

/// An expression over tensor inputs and scalar parameters (see the module docs). Cheap to
/// clone (an `Arc`).
#[derive(Clone, Debug)]
pub struct Expr(Arc<Node>);

#[derive(Debug)]
enum Node {
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

macro_rules! unary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(
            #[doc = concat!("`", stringify!($name), "` of every element (`UnaryOp::", stringify!($op), "`).")]
            pub fn $name(&self) -> Expr {
                self.unary(UnaryOp::$op)
            }
        )*
    };
}

macro_rules! binary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(
            #[doc = concat!("`BinaryOp::", stringify!($op), "` with broadcasting.")]
            pub fn $name(&self, rhs: impl Into<Expr>) -> Expr {
                self.binary(BinaryOp::$op, rhs)
            }
        )*
    };
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

    unary_methods!(
        neg => Neg, abs => Abs, exp => Exp, log => Log, sqrt => Sqrt, square => Square,
        recip => Recip, sin => Sin, cos => Cos, tanh => Tanh, sigmoid => Sigmoid, relu => Relu,
        gelu => Gelu, sign => Sign, floor => Floor, ceil => Ceil,
    );
    binary_methods!(
        add => Add, sub => Sub, mul => Mul, div => Div, pow => Pow, maximum => Maximum,
        minimum => Minimum,
    );
    cmp_methods!(eq => Eq, ne => Ne, lt => Lt, le => Le, gt => Gt, ge => Ge);

    /// `min(max(self, lo), hi)`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Expr {
        self.maximum(lo).minimum(hi)
    }
}

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

// ---- lowering -------------------------------------------------------------------------------

/// Appends instructions, sharing equal ones (hash-consing): the common subexpression
/// elimination of lowering, and of the gradient programs built in `grad.rs`.
#[derive(Default)]
pub(crate) struct Emitter {
    pub(crate) code: Vec<Instr>,
    seen: HashMap<Instr, Val>,
}

impl Emitter {
    pub(crate) fn emit(&mut self, ins: Instr) -> Val {
        if let Some(&v) = self.seen.get(&ins) {
            return v;
        }
        let v = self.code.len() as Val;
        self.code.push(ins);
        self.seen.insert(ins, v);
        v
    }
}

struct Lower<'a> {
    inputs: &'a [DType],
    params: Vec<Option<DType>>,
    axes: Option<Vec<isize>>,
    em: Emitter,
    strong: HashMap<*const Node, Option<DType>>,
    done: HashMap<(*const Node, DType), Val>,
}

impl Lower<'_> {
    /// The dtype of a subtree nothing types (see the module docs).
    fn default_dtype(&self) -> DType {
        self.inputs.first().copied().unwrap_or(DType::F32)
    }

    /// The dtype a subtree has by itself (`None`: only weak scalars and parameters).
    fn strong(&mut self, e: &Expr) -> Result<Option<DType>> {
        let key = Arc::as_ptr(&e.0);
        if let Some(&d) = self.strong.get(&key) {
            return Ok(d);
        }
        let d = match &*e.0 {
            Node::Input(k) => match self.inputs.get(*k as usize) {
                Some(&d) => Some(d),
                None => {
                    return Err(expr_err(
                        "expr",
                        ExprErrorKind::Arity,
                        format!(
                            "the expression reads input {k}, but {} inputs were given",
                            self.inputs.len()
                        ),
                    ));
                }
            },
            Node::Param(_) => None,
            Node::Const(_, d) => *d,
            Node::Unary(_, a) | Node::Reduce(_, _, a) => self.strong(a)?,
            Node::Binary(_, a, b) | Node::Where(_, a, b) => {
                let (sa, sb) = (self.strong(a)?, self.strong(b)?);
                sa.or(sb)
            }
            Node::Cmp(..) => Some(DType::U8),
            Node::Cast(d, _) => Some(*d),
        };
        self.strong.insert(key, d);
        Ok(d)
    }

    fn lower(&mut self, e: &Expr, want: DType) -> Result<Val> {
        let d = self.strong(e)?.unwrap_or(want);
        let key = (Arc::as_ptr(&e.0), d);
        if let Some(&v) = self.done.get(&key) {
            return Ok(v);
        }
        let ins = match &*e.0 {
            Node::Input(k) => Instr::Input(*k),
            Node::Param(k) => {
                let k = *k as usize;
                if self.params.len() <= k {
                    self.params.resize(k + 1, None);
                }
                match self.params[k] {
                    Some(p) if p != d => {
                        return Err(expr_err(
                            "param",
                            ExprErrorKind::DType,
                            format!("parameter {k} is used both as {p} and as {d}"),
                        ));
                    }
                    _ => self.params[k] = Some(d),
                }
                Instr::Param(k as u32)
            }
            Node::Const(v, _) => Instr::Const(Scalar::new(*v, d)),
            Node::Unary(op, a) => Instr::Unary(*op, self.lower(a, d)?),
            Node::Binary(op, a, b) => Instr::Binary(*op, self.lower(a, d)?, self.lower(b, d)?),
            Node::Cmp(op, a, b) => {
                let sa = self.strong(a)?;
                let od = match sa {
                    Some(x) => x,
                    None => self.strong(b)?.unwrap_or(self.default_dtype()),
                };
                Instr::Cmp(*op, self.lower(a, od)?, self.lower(b, od)?)
            }
            Node::Where(c, a, b) => Instr::Where(
                self.lower(c, DType::U8)?,
                self.lower(a, d)?,
                self.lower(b, d)?,
            ),
            Node::Cast(to, a) => {
                let from = self.strong(a)?.unwrap_or(*to);
                Instr::Cast(*to, self.lower(a, from)?)
            }
            Node::Reduce(c, axes, a) => {
                match &self.axes {
                    Some(prev) if prev != axes => {
                        return Err(expr_err(
                            c.name(),
                            ExprErrorKind::Phase,
                            format!(
                                "one program reduces one set of axes: {prev:?} and {axes:?} \
                                 (split it in two programs)"
                            ),
                        ));
                    }
                    _ => self.axes = Some(axes.clone()),
                }
                Instr::Reduce(*c, self.lower(a, d)?)
            }
        };
        let v = self.em.emit(ins);
        self.done.insert(key, v);
        Ok(v)
    }
}

impl Program {
    /// Lowers expression trees over inputs of dtypes `inputs` to a validated program with one
    /// output per tree (see the module docs for how constants and parameters get their dtypes;
    /// a parameter that no tree reads is f64).
    pub fn from_exprs(inputs: &[DType], outputs: &[Expr]) -> Result<Program> {
        let mut l = Lower {
            inputs,
            params: Vec::new(),
            axes: None,
            em: Emitter::default(),
            strong: HashMap::new(),
            done: HashMap::new(),
        };
        let mut outs = Vec::with_capacity(outputs.len());
        for e in outputs {
            let d = l.strong(e)?.unwrap_or(l.default_dtype());
            outs.push(l.lower(e, d)?);
        }
        let params = l.params.iter().map(|p| p.unwrap_or(DType::F64)).collect();
        Program::new(
            inputs.to_vec(),
            params,
            l.em.code,
            outs,
            l.axes.unwrap_or_default(),
        )
    }
}
