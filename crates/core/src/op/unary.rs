//! The unary op table: every elementwise function of one argument, defined once.
//!
//! # Why a table
//!
//! An op used to be written in about thirteen places (the enum, the reference, two CPU
//! kernels, a CUDA device function, a backward kernel on each backend, the IR's derivative, the
//! deferral's lowering, autograd, the tests). Now one entry of [`unary_table!`] holds all of it,
//! and everything else is derived from it by `macro_rules!` (no build script, no generated file:
//! what the compiler sees is this file):
//!
//! | entry field | what is derived from it |
//! |---|---|
//! | variant, method name, doc | [`UnaryOp`], [`UnaryOp::ALL`], [`UnaryOp::name`]; the methods of `Expr`, `Tensor` and autograd's `Var` (through the callback [`unary_table!`]) |
//! | `dtypes` | [`UnaryOp::supports`]: `float` (f32, f64) or `int` (also i64) |
//! | `f` | the scalar function, generic over [`Real`]: the f64 reference backend ([`UnaryOp::eval`]), the CPU backend's kernels and fused evaluator ([`UnaryOp::visit`]) |
//! | `int` | the same for i64 |
//! | `cuda`, `cuda_int` | the CUDA device function `op_<name><T>(x)` every generated kernel calls ([`UnaryOp::cuda`]) |
//! | `grad` | the vector-Jacobian product as an IR expression ([`UnaryOp::vjp`]): the IR's derivative, the deferral's lowering, `Backend::unary_backward` on every backend, autograd |
//! | `domain` | where the conformance suite and the gradient checks sample inputs ([`UnaryOp::domain`]) |
//!
//! `grad` is one of `x(|x, g| ...)` (reads the input), `y(|y, g| ...)` (reads the output: the
//! graph keeps only that alive), `none(|g| ...)` (reads neither) or `zero` (piecewise
//! constant); `g` is the incoming gradient. The CUDA strings are C++ over `x` of type `T`, with
//! the `k_<fn>` math functions of `common.cuh`.
//!
//! Adding an op is one entry here; the README's "Adding an op" says what the tests then check
//! with no new test code. A name used by no entry cannot be half-added: every `match` over
//! `UnaryOp` is generated from this list.

use super::expr_tree::Expr;
use super::real::Real;
use crate::DType;

/// The operand the vector-Jacobian product of a unary op reads (see [`UnaryOp::grad_reads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradFrom {
    /// `x`, the op's input.
    Input,
    /// `y = op(x)`, the op's output.
    Output,
}

/// The gradient rule of a unary op, `g ↦ g · op'(x)`, as an expression over input 0 (the saved
/// operand) and input 1 (`g`).
#[derive(Clone, Debug)]
pub enum Vjp {
    /// Reads the input `x` (input 0).
    Input(Expr),
    /// Reads the output `y` (input 0).
    Output(Expr),
    /// Reads neither (input 0 is ignored).
    Neither(Expr),
    /// The derivative is zero wherever it exists (`sign`, `floor`, `ceil`).
    Zero,
}

/// Where the tests sample an op's inputs: `[lo, hi]`, keeping `avoid` away from 0 (a pole);
/// gradient checks also keep away from the `kinks`, where the derivative jumps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Domain {
    pub lo: f64,
    pub hi: f64,
    pub avoid: f64,
    pub kinks: &'static [f64],
}

/// A unary op as a type, for code monomorphized per op (the CPU backend's loops): see
/// [`UnaryOp::visit`].
pub trait UnaryFn {
    const OP: UnaryOp;
    /// The op on a float.
    fn f<T: Real>(x: T) -> T;
    /// The op on an i64 (0 for an op that is float-only: [`UnaryOp::supports`] rules it out).
    fn int(x: i64) -> i64;
}

/// Code generic over a [`UnaryFn`], run for a runtime [`UnaryOp`] by [`UnaryOp::visit`].
pub trait UnaryVisitor {
    type Output;
    fn visit<F: UnaryFn>(self) -> Self::Output;
}

/// The table. Invoked with the name of a macro in scope, it calls that macro with every entry:
/// that is how `Expr`, `Tensor` and `Var` generate one method per op without listing them.
#[macro_export]
#[doc(hidden)]
macro_rules! unary_table {
    ($m:ident) => { $m! {
        /// `-x`.
        Neg neg int {
            f: |x| -x, int: |x| x.wrapping_neg(),
            cuda: "-x", cuda_int: "(i64)(0ull - (u64)x)",
            grad: none(|g| -g),
            domain: [-6.0, 6.0],
        }
        /// `|x|` (`abs(-0) = +0`).
        Abs abs int {
            f: |x| x.abs(), int: |x| x.wrapping_abs(),
            cuda: "x < (T)0 ? -x : (x == (T)0 ? (T)0 : x)",
            cuda_int: "x < 0 ? (i64)(0ull - (u64)x) : x",
            grad: x(|x, g| g * x.sign()),
            domain: [-6.0, 6.0], kinks: [0.0],
        }
        /// `e^x`.
        Exp exp float {
            f: |x| x.exp(),
            cuda: "k_exp(x)",
            grad: y(|y, g| g * y),
            domain: [-20.0, 20.0],
        }
        /// The natural logarithm.
        Log log float {
            f: |x| x.ln(),
            cuda: "k_log(x)",
            grad: x(|x, g| g / x),
            domain: [1e-3, 50.0],
        }
        /// `√x`.
        Sqrt sqrt float {
            f: |x| x.sqrt(),
            cuda: "k_sqrt(x)",
            grad: y(|y, g| g / (y * 2.0)),
            domain: [1e-3, 50.0],
        }
        /// `x²`.
        Square square int {
            f: |x| x * x, int: |x| x.wrapping_mul(x),
            cuda: "x * x", cuda_int: "(i64)((u64)x * (u64)x)",
            grad: x(|x, g| g * (x * 2.0)),
            domain: [-6.0, 6.0],
        }
        /// `1 / x`.
        Recip recip float {
            f: |x| T::of(1.0) / x,
            cuda: "(T)1 / x",
            grad: y(|y, g| -(g * (&y * &y))),
            domain: [-8.0, 8.0], avoid: 0.05,
        }
        /// The sine.
        Sin sin float {
            f: |x| x.sin(),
            cuda: "k_sin(x)",
            grad: x(|x, g| g * x.cos()),
            domain: [-6.0, 6.0],
        }
        /// The cosine.
        Cos cos float {
            f: |x| x.cos(),
            cuda: "k_cos(x)",
            grad: x(|x, g| -(g * x.sin())),
            domain: [-6.0, 6.0],
        }
        /// The hyperbolic tangent.
        Tanh tanh float {
            f: |x| x.tanh(),
            cuda: "k_tanh(x)",
            grad: y(|y, g| g * (1.0 - &y * &y)),
            domain: [-10.0, 10.0],
        }
        /// The logistic function `1 / (1 + e^-x)`.
        Sigmoid sigmoid float {
            f: |x| T::of(1.0) / (T::of(1.0) + (-x).exp()),
            cuda: "(T)1 / ((T)1 + k_exp(-x))",
            grad: y(|y, g| g * (&y * (1.0 - &y))),
            domain: [-10.0, 10.0],
        }
        /// `max(x, 0)` (NaN stays NaN).
        Relu relu int {
            f: |x| if x > T::of(0.0) || x.is_nan() { x } else { T::of(0.0) },
            int: |x| x.max(0),
            cuda: "is_nan(x) ? x : (x > (T)0 ? x : (T)0)",
            grad: y(|y, g| g * y.sign()),
            domain: [-6.0, 6.0], kinks: [0.0],
        }
        /// The exact GELU, `x Φ(x) = x/2 (1 + erf(x/√2))` (PyTorch's default).
        Gelu gelu float {
            f: |x| T::of(0.5) * x * (T::of(1.0) + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf()),
            cuda: "(T)0.5 * x * ((T)1 + k_erf(x * (T)0.70710678118654752440))",
            // Φ(x) + x φ(x).
            grad: x(|x, g| {
                let cdf = ((&x * std::f64::consts::FRAC_1_SQRT_2).erf() + 1.0) * 0.5;
                let pdf = (x.square() * -0.5).exp() * (1.0 / (2.0 * std::f64::consts::PI).sqrt());
                g * (cdf + &x * pdf)
            }),
            domain: [-10.0, 10.0],
        }
        /// -1, 0 or 1 (`x` itself for ±0 and NaN).
        Sign sign int {
            f: |x| if x > T::of(0.0) { T::of(1.0) } else if x < T::of(0.0) { T::of(-1.0) } else { x },
            int: |x| x.signum(),
            cuda: "x > (T)0 ? (T)1 : (x < (T)0 ? (T)-1 : (is_nan(x) ? x : (T)0))",
            grad: zero,
            domain: [-6.0, 6.0],
        }
        /// Rounds down.
        Floor floor float {
            f: |x| x.floor(),
            cuda: "k_floor(x)",
            grad: zero,
            domain: [-6.0, 6.0],
        }
        /// Rounds up.
        Ceil ceil float {
            f: |x| x.ceil(),
            cuda: "k_ceil(x)",
            grad: zero,
            domain: [-6.0, 6.0],
        }
        /// `ln(1 + x)`, accurate near 0.
        Log1p log1p float {
            f: |x| x.ln_1p(),
            cuda: "k_log1p(x)",
            grad: x(|x, g| g / (1.0 + x)),
            domain: [-0.9, 10.0],
        }
        /// `e^x - 1`, accurate near 0.
        Expm1 expm1 float {
            f: |x| x.exp_m1(),
            cuda: "k_expm1(x)",
            grad: y(|y, g| g * (y + 1.0)),
            domain: [-10.0, 10.0],
        }
        /// The error function, `2/√π ∫₀ˣ e^(-t²) dt`.
        Erf erf float {
            f: |x| x.erf(),
            cuda: "k_erf(x)",
            grad: x(|x, g| g * ((-x.square()).exp() * std::f64::consts::FRAC_2_SQRT_PI)),
            domain: [-4.0, 4.0],
        }
        /// `1 / √x`.
        Rsqrt rsqrt float {
            f: |x| T::of(1.0) / x.sqrt(),
            cuda: "k_rsqrt(x)",
            grad: y(|y, g| g * (&y * &y * &y * -0.5)),
            domain: [1e-2, 50.0],
        }
        /// `ln(1 + e^x)`, computed as `max(x, 0) + ln(1 + e^-|x|)` so that it never overflows
        /// (PyTorch's `F.softplus` with `beta = 1`).
        Softplus softplus float {
            f: |x| (if x > T::of(0.0) { x } else { T::of(0.0) }) + (-x.abs()).exp().ln_1p(),
            cuda: "(x > (T)0 ? x : (T)0) + k_log1p(k_exp(-(x < (T)0 ? -x : x)))",
            grad: x(|x, g| g * x.sigmoid()),
            domain: [-15.0, 15.0],
        }
        /// SiLU (swish), `x · sigmoid(x)`.
        Silu silu float {
            f: |x| x / (T::of(1.0) + (-x).exp()),
            cuda: "x / ((T)1 + k_exp(-x))",
            grad: x(|x, g| {
                let s = x.sigmoid();
                g * (&s * (1.0 + x * (1.0 - &s)))
            }),
            domain: [-10.0, 10.0],
        }
        /// Mish, `x · tanh(softplus(x))`.
        Mish mish float {
            f: |x| x * ((if x > T::of(0.0) { x } else { T::of(0.0) }) + (-x.abs()).exp().ln_1p()).tanh(),
            cuda: "x * k_tanh((x > (T)0 ? x : (T)0) + k_log1p(k_exp(-(x < (T)0 ? -x : x))))",
            // tanh(sp) + x · sigmoid(x) · (1 - tanh²(sp)), sp = softplus(x).
            grad: x(|x, g| {
                let t = x.softplus().tanh();
                g * (&t + &x * x.sigmoid() * (1.0 - &t * &t))
            }),
            domain: [-10.0, 10.0],
        }
        /// Hard swish, `x · relu6(x + 3) / 6` (PyTorch's `F.hardswish`).
        Hardswish hardswish float {
            f: |x| {
                let r = x + T::of(3.0);
                let r6 = if r > T::of(6.0) { T::of(6.0) } else if r > T::of(0.0) || r.is_nan() { r } else { T::of(0.0) };
                x * r6 / T::of(6.0)
            },
            cuda: "x * (x + (T)3 > (T)6 ? (T)6 : (x + (T)3 > (T)0 || is_nan(x) ? x + (T)3 : (T)0)) / (T)6",
            // 0 below -3, 1 above 3, (2x + 3) / 6 between (PyTorch's hardswish_backward).
            grad: x(|x, g| x.lt(-3.0).where_cond(0.0, x.gt(3.0).where_cond(1.0, (&x * 2.0 + 3.0) / 6.0)) * g),
            domain: [-6.0, 6.0], kinks: [-3.0, 3.0],
        }
        /// Hard sigmoid, `relu6(x + 3) / 6` (PyTorch's `F.hardsigmoid`).
        Hardsigmoid hardsigmoid float {
            f: |x| {
                let r = x + T::of(3.0);
                let r6 = if r > T::of(6.0) { T::of(6.0) } else if r > T::of(0.0) || r.is_nan() { r } else { T::of(0.0) };
                r6 / T::of(6.0)
            },
            cuda: "(x + (T)3 > (T)6 ? (T)6 : (x + (T)3 > (T)0 || is_nan(x) ? x + (T)3 : (T)0)) / (T)6",
            // 1/6 strictly inside (-3, 3), else 0 (PyTorch's hardsigmoid_backward).
            grad: x(|x, g| x.gt(-3.0).minimum(x.lt(3.0)).where_cond(g / 6.0, 0.0)),
            domain: [-6.0, 6.0], kinks: [-3.0, 3.0],
        }
        /// GELU in its tanh form, `x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))` (PyTorch's
        /// `F.gelu(x, approximate="tanh")`, GPT-2's activation), computed as `x · sigmoid(2u)`:
        /// the same function without the cancellation of `1 + tanh(u)`.
        GeluTanh gelu_tanh float {
            f: |x| {
                let u2 = T::of(1.5957691216057308) * (x + T::of(0.044715) * x * x * x);
                x / (T::of(1.0) + (-u2).exp())
            },
            cuda: "x / ((T)1 + k_exp((T)-1.5957691216057308 * (x + (T)0.044715 * x * x * x)))",
            // s + x s (1 - s) 2u', s = sigmoid(2u): no `1 - tanh²` to cancel.
            grad: x(|x, g| {
                let xx = x.square();
                let s = ((&x + &xx * &x * 0.044715) * 1.5957691216057308).sigmoid();
                let du2 = (1.0 + xx * (3.0 * 0.044715)) * 1.5957691216057308;
                g * (&s + &x * &s * (1.0 - &s) * du2)
            }),
            domain: [-10.0, 10.0],
        }
    } };
}

/// Expands the table into [`UnaryOp`] and its derived functions.
macro_rules! define_unary_ops {
    ($(
        $(#[doc = $doc:literal])*
        $V:ident $method:ident $dtypes:ident {
            f: |$x:ident| $f:expr,
            $(int: |$xi:ident| $fi:expr,)?
            cuda: $cuda:literal,
            $(cuda_int: $cudai:literal,)?
            grad: $from:ident $(($($grad:tt)*))?,
            domain: [$lo:expr, $hi:expr] $(, avoid: $avoid:expr)? $(, kinks: [$($kink:expr),*])?,
        }
    )*) => {
        /// Elementwise functions of one argument: the entries of the op table (module
        /// `op::unary`, macro [`unary_table!`](crate::unary_table)).
        ///
        /// Float dtypes support all of them; `i64` supports those whose entry says `int`
        /// ([`UnaryOp::supports`]); `u8` none (cast it first).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum UnaryOp {
            $($(#[doc = $doc])* $V,)*
        }

        /// The ops as types, for [`UnaryOp::visit`].
        pub mod unary_fns {
            $(
                #[doc = concat!("`", stringify!($method), "` as a type.")]
                pub struct $V;
            )*
        }

        $(
            impl UnaryFn for unary_fns::$V {
                const OP: UnaryOp = UnaryOp::$V;
                #[inline(always)]
                #[allow(unused_parens)]
                fn f<T: Real>($x: T) -> T {
                    $f
                }
                #[inline(always)]
                fn int(x: i64) -> i64 {
                    int_body!(x $(, |$xi| $fi)?)
                }
            }
        )*

        impl UnaryOp {
            /// Every op of the table, in table order.
            pub const ALL: [UnaryOp; 0 $(+ { let _ = UnaryOp::$V; 1 })*] = [$(UnaryOp::$V),*];

            /// The op's name: its method's name on `Tensor`, `Var` and `Expr`.
            pub fn name(self) -> &'static str {
                match self { $(UnaryOp::$V => stringify!($method),)* }
            }

            /// Whether the op is defined for `dtype`.
            pub fn supports(self, dtype: DType) -> bool {
                match self { $(UnaryOp::$V => dtypes_allow!($dtypes, dtype),)* }
            }

            /// The op on one float: the reference backend's definition at `f64`.
            #[inline]
            pub fn eval<T: Real>(self, x: T) -> T {
                match self { $(UnaryOp::$V => <unary_fns::$V as UnaryFn>::f(x),)* }
            }

            /// The op on one i64, if defined for i64.
            pub fn eval_i64(self, x: i64) -> Option<i64> {
                if !self.supports(DType::I64) {
                    return None;
                }
                Some(match self { $(UnaryOp::$V => <unary_fns::$V as UnaryFn>::int(x),)* })
            }

            /// Runs `v.visit::<F>()` with `F` the type of this op: code monomorphized per op
            /// without a `match` of its own.
            #[inline(always)]
            pub fn visit<V: UnaryVisitor>(self, v: V) -> V::Output {
                match self { $(UnaryOp::$V => v.visit::<unary_fns::$V>(),)* }
            }

            /// The body of the CUDA device function `op_<name><T>(T x)`, and that of its `i64`
            /// specialization where the generic body does not fit i64.
            pub fn cuda(self) -> (&'static str, Option<&'static str>) {
                match self {
                    $(UnaryOp::$V => ($cuda, None $(.or(Some($cudai)))?),)*
                }
            }

            /// What the gradient rule reads and whether it is zero, without building the
            /// rule's expression (which [`UnaryOp::vjp`] allocates node by node): autograd
            /// asks this on every recorded unary op and its backward.
            fn vjp_kind(self) -> VjpKind {
                match self { $(UnaryOp::$V => vjp_kind_of!($from),)* }
            }

            /// The gradient rule (see [`Vjp`]).
            pub fn vjp(self) -> Vjp {
                match self { $(UnaryOp::$V => vjp_of!($from $(($($grad)*))?),)* }
            }

            /// Where the tests sample the op's inputs.
            pub fn domain(self) -> Domain {
                match self {
                    $(UnaryOp::$V => Domain {
                        lo: $lo,
                        hi: $hi,
                        avoid: 0.0 $(+ $avoid)?,
                        kinks: &[$($($kink),*)?],
                    },)*
                }
            }
        }
    };
}

macro_rules! int_body {
    ($x:ident) => {{
        let _ = $x;
        0
    }};
    ($x:ident, |$xi:ident| $fi:expr) => {{
        let $xi = $x;
        $fi
    }};
}

macro_rules! dtypes_allow {
    (float, $d:expr) => {
        $d.is_float()
    };
    (int, $d:expr) => {
        ($d.is_float() || $d == DType::I64)
    };
}

/// [`Vjp`]'s variant without its expression.
#[derive(Clone, Copy)]
enum VjpKind {
    Input,
    Output,
    Neither,
    Zero,
}

macro_rules! vjp_kind_of {
    (x) => {
        VjpKind::Input
    };
    (y) => {
        VjpKind::Output
    };
    (none) => {
        VjpKind::Neither
    };
    (zero) => {
        VjpKind::Zero
    };
}

macro_rules! vjp_of {
    (x(|$s:ident, $g:ident| $e:expr)) => {{
        let ($s, $g) = (Expr::input(0), Expr::input(1));
        Vjp::Input($e)
    }};
    (y(|$s:ident, $g:ident| $e:expr)) => {{
        let ($s, $g) = (Expr::input(0), Expr::input(1));
        Vjp::Output($e)
    }};
    (none(|$g:ident| $e:expr)) => {{
        let $g = Expr::input(1);
        Vjp::Neither($e)
    }};
    (zero) => {
        Vjp::Zero
    };
}

unary_table!(define_unary_ops);

impl UnaryOp {
    /// The operand [`Backend::unary_backward`](crate::Backend::unary_backward) reads: the
    /// input `x` or the output `y`; `None` for an op whose gradient reads neither.
    pub fn grad_reads(self) -> Option<GradFrom> {
        match self.vjp_kind() {
            VjpKind::Input => Some(GradFrom::Input),
            VjpKind::Output => Some(GradFrom::Output),
            VjpKind::Neither | VjpKind::Zero => None,
        }
    }

    /// Whether the op's derivative is identically zero ([`Vjp::Zero`]), without building the
    /// rule's expression.
    pub fn vjp_is_zero(self) -> bool {
        matches!(self.vjp_kind(), VjpKind::Zero)
    }
}
