//! The composite op table: elementwise functions with scalar parameters (`leaky_relu(x,
//! negative_slope)`, `elu(x, alpha)`), each defined once as an expression over the unary table's
//! ops.
//!
//! # Why a second table
//!
//! A [`UnaryOp`](super::UnaryOp) is a plain enum (`Copy + Eq + Hash`, an instruction of the
//! IR): it has no room for a parameter. A composite op is an [`Expr`] of input 0 and parameters
//! `0..n`; it runs as one expression program on every backend (one pass on the CPU, one kernel on
//! the GPU, parameters as kernel arguments) and its derivative is the IR's derivative of that
//! program (`ir::grad`), so an entry needs no rule of its own.
//!
//! | entry field | what is derived from it |
//! |---|---|
//! | variant, method name, parameters, doc | [`CompositeOp`]; the methods of `Tensor` and `Var` (through the callback [`composite_table!`]) |
//! | `forward` | [`CompositeOp::expr`]: the program every backend runs, and its derivative |
//! | `domain`, `kinks`, `test_params` | where the conformance suite and the gradient checks sample |

use super::expr_tree::Expr;
use super::unary::Domain;

/// The table (see the module docs). Invoked with the name of a macro in scope, it calls that
/// macro with every entry.
#[macro_export]
#[doc(hidden)]
macro_rules! composite_table {
    ($m:ident) => {
        $m! {
            /// Leaky ReLU: `x` where `x > 0`, else `negative_slope · x` (PyTorch's
            /// `F.leaky_relu`; its default slope is 0.01).
            LeakyRelu leaky_relu(negative_slope) {
                forward: |x, negative_slope| x.gt(0.0).where_cond(&x, &x * negative_slope),
                domain: [-6.0, 6.0], kinks: [0.0],
                test_params: [0.2],
            }
            /// ELU: `x` where `x > 0`, else `alpha · (e^x - 1)` (PyTorch's `F.elu`; its default
            /// alpha is 1).
            Elu elu(alpha) {
                forward: |x, alpha| x.gt(0.0).where_cond(&x, x.expm1() * alpha),
                domain: [-6.0, 6.0], kinks: [0.0],
                test_params: [0.5],
            }
        }
    };
}

/// Expands the table into [`CompositeOp`] and its derived functions.
macro_rules! define_composite_ops {
    ($(
        $(#[doc = $doc:literal])*
        $V:ident $method:ident($($param:ident),*) {
            forward: |$x:ident $(, $p:ident)*| $f:expr,
            domain: [$lo:expr, $hi:expr] $(, kinks: [$($kink:expr),*])?,
            test_params: [$($tp:expr),*],
        }
    )*) => {
        /// Elementwise functions with scalar parameters: the entries of the composite op table
        /// (module `op::composite`, macro [`composite_table!`](crate::composite_table)).
        /// Float dtypes.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum CompositeOp {
            $($(#[doc = $doc])* $V,)*
        }

        impl CompositeOp {
            /// Every op of the table, in table order.
            pub const ALL: &'static [CompositeOp] = &[$(CompositeOp::$V),*];

            /// The op's name: its method's name on `Tensor` and `Var`.
            pub fn name(self) -> &'static str {
                match self { $(CompositeOp::$V => stringify!($method),)* }
            }

            /// The names of its scalar parameters, in order.
            pub fn params(self) -> &'static [&'static str] {
                match self { $(CompositeOp::$V => &[$(stringify!($param)),*],)* }
            }

            /// The op as an expression of input 0 and parameters `0..n`.
            #[allow(unused_mut, unused_variables)]
            pub fn expr(self) -> Expr {
                match self {
                    $(CompositeOp::$V => {
                        let mut k = 0;
                        let $x = Expr::input(0);
                        $(let $p = { k += 1; Expr::param(k - 1) };)*
                        $f
                    })*
                }
            }

            /// Where the tests sample the op's inputs.
            pub fn domain(self) -> Domain {
                match self {
                    $(CompositeOp::$V => Domain {
                        lo: $lo,
                        hi: $hi,
                        avoid: 0.0,
                        kinks: &[$($($kink),*)?],
                    },)*
                }
            }

            /// Parameter values the tests use.
            pub fn test_params(self) -> &'static [f64] {
                match self { $(CompositeOp::$V => &[$($tp),*],)* }
            }
        }
    };
}

composite_table!(define_composite_ops);
