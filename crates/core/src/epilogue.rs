//! Linear layers with their bias and activation fused into the product's epilogue
//! ([`Backend::linear_epilogue`](crate::Backend::linear_epilogue)), as cuBLASLt's
//! `BIAS` / `RELU_BIAS` / `GELU_BIAS` epilogues (and their `*_AUX` variants for the backward).
//!
//! # Why
//!
//! Composed, `act(x · wᵀ + b)` is a product and then one elementwise kernel (the bias add and
//! the activation fused) that reads and writes the whole output again. A library GEMM that
//! applies them as it stores its tiles saves that pass, and in the backward the bias gradient
//! (a column sum of the output gradient) can ride on the weight-gradient product. A backend
//! offers it per call or not at all; kiln-autograd's `Var::linear_act` composes otherwise, so
//! every backend computes the same function. This module sits below `backend` (data only).

use crate::op::UnaryOp;

/// The activation applied after a linear layer's bias ([`Backend::linear_epilogue`](crate::Backend::linear_epilogue)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// None: `x · wᵀ + b`.
    Identity,
    /// `max(·, 0)`.
    Relu,
    /// The exact GELU (PyTorch's default). cuBLASLt has no epilogue for it.
    Gelu,
    /// GELU in its tanh form (cuBLASLt's `GELU` epilogue computes this one).
    GeluTanh,
}

impl Activation {
    /// The elementwise op applying it (`None` for [`Activation::Identity`]).
    pub fn unary(self) -> Option<UnaryOp> {
        match self {
            Activation::Identity => None,
            Activation::Relu => Some(UnaryOp::Relu),
            Activation::Gelu => Some(UnaryOp::Gelu),
            Activation::GeluTanh => Some(UnaryOp::GeluTanh),
        }
    }
}

/// What [`Backend::linear_epilogue`](crate::Backend::linear_epilogue) returns: the output
/// `[m, n]`, and (when asked for) what its backward needs of the activation, in a layout of the
/// backend's own choosing (a ReLU bit mask, the GELU input), opaque to the caller.
pub struct EpilogueOutputs<S> {
    pub out: S,
    pub aux: Option<S>,
}

/// What [`Backend::linear_epilogue_backward`](crate::Backend::linear_epilogue_backward)
/// returns: the gradients of `x` (`[m, k]`), `w` (`[n, k]`) and the bias (`[n]`), contiguous, in
/// the operands' dtype (the bias's in the bias's dtype).
pub struct EpilogueGrads<S> {
    pub dx: S,
    pub dw: S,
    pub db: Option<S>,
}
