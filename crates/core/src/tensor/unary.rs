//! One method per entry of the op tables (`op::unary`, `op::binary`, `op::composite`):
//! `x.exp()`, `x.add(&y)`, `x.add_scalar(1.0)`, `x.leaky_relu(0.2)`, ... Generated, so an op
//! added to a table is a `Tensor` method with no code here.

use super::Tensor;
use crate::ir::rules::composite_program;
use crate::{Backend, BinaryOp, CompositeOp, Error, Result, UnaryOp};

macro_rules! tensor_unary_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident $dt:ident { $($body:tt)* })*) => {
        impl<B: Backend> Tensor<B> {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self) -> Result<Self> {
                    self.unary(UnaryOp::$V)
                }
            )*
        }
    };
}
crate::unary_table!(tensor_unary_methods);

macro_rules! tensor_binary_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident $scalar:ident $dt:ident { $($body:tt)* })*) => {
        impl<B: Backend> Tensor<B> {
            $(
                $(#[doc = $doc])*
                ///
                /// With numpy broadcasting.
                pub fn $method(&self, rhs: &Self) -> Result<Self> {
                    self.binary(BinaryOp::$V, rhs)
                }
                #[doc = concat!("`", stringify!($method), "(self, c)` with a constant `c` (converted to the dtype by `as`, passed as a kernel argument).")]
                pub fn $scalar(&self, c: f64) -> Result<Self> {
                    self.binary_scalar(BinaryOp::$V, c)
                }
            )*
        }
    };
}
crate::binary_table!(tensor_binary_methods);

impl<B: Backend> Tensor<B> {
    /// Composite `op` of the op table with its scalar parameters (what its generated method,
    /// e.g. `leaky_relu(negative_slope)`, calls): one expression program, one pass or kernel.
    pub fn composite(&self, op: CompositeOp, params: &[f64]) -> Result<Self> {
        if params.len() != op.params().len() {
            return Err(Error::invalid(
                op.name(),
                format!(
                    "takes {} parameters ({}), {} were given",
                    op.params().len(),
                    op.params().join(", "),
                    params.len()
                ),
            ));
        }
        if !self.dtype().is_float() {
            return Err(Error::DTypeMismatch {
                op: op.name(),
                expected: "a float dtype (f32, f64, f16, bf16)".into(),
                got: self.dtype(),
            });
        }
        let program = composite_program(op, self.dtype())?;
        Ok(program.run(&[self], params)?.swap_remove(0))
    }
}

macro_rules! tensor_composite_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident($($param:ident),*) { $($body:tt)* })*) => {
        impl<B: Backend> Tensor<B> {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self, $($param: f64),*) -> Result<Self> {
                    self.composite(CompositeOp::$V, &[$($param),*])
                }
            )*
        }
    };
}
crate::composite_table!(tensor_composite_methods);
