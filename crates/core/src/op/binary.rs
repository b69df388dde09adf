//! The binary op table: every elementwise function of two arguments, defined once; and the
//! comparisons (macro `comparisons!`, each defined by its operator).
//!
//! As for the unary table (module `op::unary`), one entry of [`binary_table!`] holds all there
//! is to say about an op and `macro_rules!` derives the rest:
//!
//! | entry field | what is derived from it |
//! |---|---|
//! | variant, method names, doc | [`BinaryOp`], [`BinaryOp::ALL`], [`BinaryOp::name`]; the methods of `Expr`, `Tensor` and autograd's `Var`, with a tensor and with a constant (`add`, `add_scalar`), through the callback [`binary_table!`] |
//! | dtypes | [`BinaryOp::supports`]: `float` (f32, f64), `arith` (also i64), `any` (also u8) |
//! | `f`, `int`, `byte` | the scalar function on floats (generic over [`Real`]), on i64 and on u8: the reference backend ([`BinaryOp::eval`]), the CPU backend's loops and fused evaluator ([`BinaryOp::visit`]) |
//! | `cuda`, `cuda_int` | the CUDA device function `op_<name><T>(a, b)` every generated kernel calls ([`BinaryOp::cuda`]) |
//! | `da`, `db` | the vector-Jacobian products to `a` and to `b` as IR expressions over `a`, `b`, `y = op(a, b)` and the incoming gradient `g` ([`BinaryOp::vjp`]): the IR's derivative and autograd |
//! | `da_const`, `db_const` | the same where the *other* operand is a constant (a scalar), when that differs: `maximum(x, c)` is `clamp_min`, whose gradient passes at ties, where `maximum(x, y)` splits it |
//!
//! The expressions' inputs are numbered `a = 0, b = 1, y = 2, g = 3`
//! ([`Expr::input`]); an input a rule does not read need not be saved ([`BinaryOp::vjp`]'s
//! users ask [`Program::reads`](crate::ir::Program::reads)).

use super::expr_tree::Expr;
use super::real::Real;
use crate::DType;

/// The operand of a binary op a gradient is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// `a`, the left operand.
    A,
    /// `b`, the right operand.
    B,
}

/// A binary op as a type, for code monomorphized per op (the CPU backend's loops): see
/// [`BinaryOp::visit`].
pub trait BinaryFn {
    const OP: BinaryOp;
    /// The op on floats.
    fn f<T: Real>(a: T, b: T) -> T;
    /// The op on i64 (0 for an op that is float-only: [`BinaryOp::supports`] rules it out).
    fn int(a: i64, b: i64) -> i64;
    /// The op on u8 (0 for an op that u8 does not support).
    fn byte(a: u8, b: u8) -> u8;
}

/// Code generic over a [`BinaryFn`], run for a runtime [`BinaryOp`] by [`BinaryOp::visit`].
pub trait BinaryVisitor {
    type Output;
    fn visit<F: BinaryFn>(self) -> Self::Output;
}

/// The table (see the module docs). Invoked with the name of a macro in scope, it calls that
/// macro with every entry.
#[macro_export]
#[doc(hidden)]
macro_rules! binary_table {
    ($m:ident) => {
        $m! {
            /// `a + b` (i64 wraps).
            Add add add_scalar arith {
                f: |a, b| a + b, int: |a, b| a.wrapping_add(b),
                cuda: "a + b", cuda_int: "(i64)((u64)a + (u64)b)",
                da: |a, b, y, g| g,
                db: |a, b, y, g| g,
            }
            /// `a - b` (i64 wraps).
            Sub sub sub_scalar arith {
                f: |a, b| a - b, int: |a, b| a.wrapping_sub(b),
                cuda: "a - b", cuda_int: "(i64)((u64)a - (u64)b)",
                da: |a, b, y, g| g,
                db: |a, b, y, g| -g,
            }
            /// `a · b` (i64 wraps).
            Mul mul mul_scalar arith {
                f: |a, b| a * b, int: |a, b| a.wrapping_mul(b),
                cuda: "a * b", cuda_int: "(i64)((u64)a * (u64)b)",
                da: |a, b, y, g| g * b,
                db: |a, b, y, g| g * a,
            }
            /// `a / b`; on i64 it truncates toward zero, and a division by zero gives 0 (a GPU
            /// kernel cannot stop to report it).
            Div div div_scalar arith {
                f: |a, b| a / b, int: |a, b| if b == 0 { 0 } else { a.wrapping_div(b) },
                cuda: "a / b",
                cuda_int: "b == 0 ? (i64)0 : (b == -1 ? (i64)(0ull - (u64)a) : a / b)",
                da: |a, b, y, g| g / b,
                // d(a/b)/db = -a/b² = -y/b
                db: |a, b, y, g| -(g * y / b),
            }
            /// `a^b`. The gradients are PyTorch's: 0 to `a` where `b = 0`, and 0 to `b` where
            /// `a = 0` and `b ≥ 0`.
            Pow pow pow_scalar float {
                f: |a, b| a.powf(b),
                cuda: "k_pow(a, b)",
                da: |a, b, y, g| b.eq(0.0).where_cond(0.0, g * (&b * a.pow(&b - 1.0))),
                db: |a, b, y, g| a.eq(0.0).minimum(b.ge(0.0)).where_cond(0.0, g * (y * a.log())),
            }
            /// The larger of `a` and `b`; NaN propagates (as `torch.maximum`, unlike `f32::max`).
            /// At ties the gradient is split evenly; against a constant (`clamp_min`) it passes
            /// at ties.
            Maximum maximum maximum_scalar any {
                f: |a, b| if b > a || b.is_nan() { b } else { a },
                int: |a, b| a.max(b), byte: |a, b| a.max(b),
                cuda: "is_nan(a) ? a : (is_nan(b) ? b : (a > b ? a : b))",
                da: |a, b, y, g| a.gt(&b).where_cond(&g, a.eq(&b).where_cond(&g * 0.5, 0.0)),
                db: |a, b, y, g| b.gt(&a).where_cond(&g, a.eq(&b).where_cond(&g * 0.5, 0.0)),
                da_const: |a, b, y, g| a.ge(b).where_cond(g, 0.0),
                db_const: |a, b, y, g| b.ge(a).where_cond(g, 0.0),
            }
            /// The smaller of `a` and `b`; NaN propagates. Gradients as `maximum`'s.
            Minimum minimum minimum_scalar any {
                f: |a, b| if b < a || b.is_nan() { b } else { a },
                int: |a, b| a.min(b), byte: |a, b| a.min(b),
                cuda: "is_nan(a) ? a : (is_nan(b) ? b : (a < b ? a : b))",
                da: |a, b, y, g| a.lt(&b).where_cond(&g, a.eq(&b).where_cond(&g * 0.5, 0.0)),
                db: |a, b, y, g| b.lt(&a).where_cond(&g, a.eq(&b).where_cond(&g * 0.5, 0.0)),
                da_const: |a, b, y, g| a.le(b).where_cond(g, 0.0),
                db_const: |a, b, y, g| b.le(a).where_cond(g, 0.0),
            }
        }
    };
}

macro_rules! define_binary_ops {
    ($(
        $(#[doc = $doc:literal])*
        $V:ident $method:ident $scalar:ident $dtypes:ident {
            f: |$fa:ident, $fb:ident| $f:expr,
            $(int: |$ia:ident, $ib:ident| $fi:expr,)?
            $(byte: |$ba:ident, $bb:ident| $fbyte:expr,)?
            cuda: $cuda:literal,
            $(cuda_int: $cudai:literal,)?
            da: |$aa:ident, $ab:ident, $ay:ident, $ag:ident| $da:expr,
            db: |$ba2:ident, $bb2:ident, $by:ident, $bg:ident| $db:expr,
            $(da_const: |$ca:ident, $cb:ident, $cy:ident, $cg:ident| $dac:expr,)?
            $(db_const: |$da2:ident, $db2:ident, $dy:ident, $dg:ident| $dbc:expr,)?
        }
    )*) => {
        /// Elementwise functions of two arguments of the same dtype: the entries of the binary
        /// op table (module `op::binary`, macro [`binary_table!`](crate::binary_table)).
        ///
        /// Float dtypes support all; `i64` all but `Pow`; `u8` `Maximum` and `Minimum` only
        /// ([`BinaryOp::supports`]).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $($(#[doc = $doc])* $V,)*
        }

        /// The binary ops as types, for [`BinaryOp::visit`].
        pub mod binary_fns {
            $(
                #[doc = concat!("`", stringify!($method), "` as a type.")]
                pub struct $V;
            )*
        }

        $(
            impl BinaryFn for binary_fns::$V {
                const OP: BinaryOp = BinaryOp::$V;
                #[inline(always)]
                fn f<T: Real>($fa: T, $fb: T) -> T {
                    $f
                }
                #[inline(always)]
                fn int(a: i64, b: i64) -> i64 {
                    or_zero!(a, b $(, |$ia, $ib| $fi)?)
                }
                #[inline(always)]
                fn byte(a: u8, b: u8) -> u8 {
                    or_zero!(a, b $(, |$ba, $bb| $fbyte)?)
                }
            }
        )*

        impl BinaryOp {
            /// Every op of the table, in table order.
            pub const ALL: [BinaryOp; 0 $(+ { let _ = BinaryOp::$V; 1 })*] =
                [$(BinaryOp::$V),*];

            /// The op's name: its method's name on `Tensor`, `Var` and `Expr`.
            pub fn name(self) -> &'static str {
                match self { $(BinaryOp::$V => stringify!($method),)* }
            }

            /// Whether the op is defined for `dtype`.
            pub fn supports(self, dtype: DType) -> bool {
                match self { $(BinaryOp::$V => binary_dtypes!($dtypes, dtype),)* }
            }

            /// Runs `v.visit::<F>()` with `F` the type of this op: code monomorphized per op
            /// without a `match` of its own.
            #[inline(always)]
            pub fn visit<V: BinaryVisitor>(self, v: V) -> V::Output {
                match self { $(BinaryOp::$V => v.visit::<binary_fns::$V>(),)* }
            }

            /// The body of the CUDA device function `op_<name><T>(T a, T b)`, and that of its
            /// `i64` specialization where the generic body does not fit i64.
            pub fn cuda(self) -> (&'static str, Option<&'static str>) {
                match self {
                    $(BinaryOp::$V => ($cuda, None $(.or(Some($cudai)))?),)*
                }
            }

            /// The vector-Jacobian product to `side`, as an expression over `a` (input 0),
            /// `b` (1), `y` (2) and `g` (3). With `other_const`, the other operand is a
            /// constant (a scalar given by value), which changes the rule of some ops.
            #[allow(unused_variables)]
            pub fn vjp(self, side: Side, other_const: bool) -> Expr {
                let (a, b, y, g) = (Expr::input(0), Expr::input(1), Expr::input(2), Expr::input(3));
                match (self, side) {
                    $(
                        (BinaryOp::$V, Side::A) => {
                            $(if other_const {
                                let ($ca, $cb, $cy, $cg) = (a, b, y, g);
                                return $dac;
                            })?
                            let ($aa, $ab, $ay, $ag) = (a, b, y, g);
                            $da
                        }
                        (BinaryOp::$V, Side::B) => {
                            $(if other_const {
                                let ($da2, $db2, $dy, $dg) = (a, b, y, g);
                                return $dbc;
                            })?
                            let ($ba2, $bb2, $by, $bg) = (a, b, y, g);
                            $db
                        }
                    )*
                }
            }
        }
    };
}

/// The body of an entry's optional scalar function, or 0 where the entry has none.
macro_rules! or_zero {
    ($a:ident, $b:ident) => {{
        let _ = ($a, $b);
        0
    }};
    ($a:ident, $b:ident, |$x:ident, $y:ident| $e:expr) => {{
        let ($x, $y) = ($a, $b);
        $e
    }};
}

macro_rules! binary_dtypes {
    (float, $d:expr) => {
        $d.is_float()
    };
    (arith, $d:expr) => {
        ($d.is_float() || $d == DType::I64)
    };
    (any, $d:expr) => {
        ($d.is_float() || matches!($d, DType::I64 | DType::U8))
    };
}

binary_table!(define_binary_ops);

impl BinaryOp {
    /// The op on one float: the reference backend's definition at `f64`.
    #[inline]
    pub fn eval<T: Real>(self, a: T, b: T) -> T {
        struct Eval<T>(T, T);
        impl<T: Real> BinaryVisitor for Eval<T> {
            type Output = T;
            fn visit<F: BinaryFn>(self) -> T {
                F::f(self.0, self.1)
            }
        }
        self.visit(Eval(a, b))
    }

    /// The op on one i64, if defined for i64.
    pub fn eval_i64(self, a: i64, b: i64) -> Option<i64> {
        struct Eval(i64, i64);
        impl BinaryVisitor for Eval {
            type Output = i64;
            fn visit<F: BinaryFn>(self) -> i64 {
                F::int(self.0, self.1)
            }
        }
        self.supports(DType::I64).then(|| self.visit(Eval(a, b)))
    }

    /// The op on one u8, if defined for u8.
    pub fn eval_u8(self, a: u8, b: u8) -> Option<u8> {
        struct Eval(u8, u8);
        impl BinaryVisitor for Eval {
            type Output = u8;
            fn visit<F: BinaryFn>(self) -> u8 {
                F::byte(self.0, self.1)
            }
        }
        self.supports(DType::U8).then(|| self.visit(Eval(a, b)))
    }
}

/// A comparison as a type, for code monomorphized per comparison: see [`CmpOp::visit`].
pub trait CmpFn {
    const OP: CmpOp;
    /// The comparison, as every backend computes it (NaN compares unequal and unordered).
    fn f<T: PartialOrd>(a: T, b: T) -> bool;
}

/// Code generic over a [`CmpFn`], run for a runtime [`CmpOp`] by [`CmpOp::visit`].
pub trait CmpVisitor {
    type Output;
    fn visit<F: CmpFn>(self) -> Self::Output;
}

/// The comparisons, each defined by its Rust operator (which is also its C operator).
macro_rules! comparisons {
    ($($(#[doc = $doc:literal])* $V:ident $name:ident $op:tt,)*) => {
        /// Comparisons; the result is a `u8` mask (1 where true). Defined for every dtype.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum CmpOp {
            $($(#[doc = $doc])* $V,)*
        }

        /// The comparisons as types, for [`CmpOp::visit`].
        pub mod cmp_fns {
            $(
                #[doc = concat!("`", stringify!($op), "` as a type.")]
                pub struct $V;
            )*
        }

        $(
            impl CmpFn for cmp_fns::$V {
                const OP: CmpOp = CmpOp::$V;
                #[inline(always)]
                fn f<T: PartialOrd>(a: T, b: T) -> bool {
                    a $op b
                }
            }
        )*

        impl CmpOp {
            pub const ALL: [CmpOp; 0 $(+ { let _ = CmpOp::$V; 1 })*] = [$(CmpOp::$V),*];

            pub fn name(self) -> &'static str {
                match self { $(CmpOp::$V => stringify!($name),)* }
            }

            /// The operator, in Rust and in C (the CUDA device function `op_<name>`).
            pub fn operator(self) -> &'static str {
                match self { $(CmpOp::$V => stringify!($op),)* }
            }

            /// Runs `v.visit::<F>()` with `F` the type of this comparison.
            #[inline(always)]
            pub fn visit<V: CmpVisitor>(self, v: V) -> V::Output {
                match self { $(CmpOp::$V => v.visit::<cmp_fns::$V>(),)* }
            }

            /// The comparison of one pair: the reference backend's definition.
            #[inline(always)]
            pub fn eval<T: PartialOrd>(self, a: T, b: T) -> bool {
                match self { $(CmpOp::$V => a $op b,)* }
            }
        }
    };
}

comparisons! {
    /// `a == b`.
    Eq eq ==,
    /// `a != b`.
    Ne ne !=,
    /// `a < b`.
    Lt lt <,
    /// `a <= b`.
    Le le <=,
    /// `a > b`.
    Gt gt >,
    /// `a >= b`.
    Ge ge >=,
}

impl CmpOp {
    /// The comparison with its operands swapped: `a op b == b op.swapped() a`.
    pub fn swapped(self) -> CmpOp {
        match self {
            CmpOp::Eq => CmpOp::Eq,
            CmpOp::Ne => CmpOp::Ne,
            CmpOp::Lt => CmpOp::Gt,
            CmpOp::Le => CmpOp::Ge,
            CmpOp::Gt => CmpOp::Lt,
            CmpOp::Ge => CmpOp::Le,
        }
    }
}
