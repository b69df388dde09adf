//! One method per entry of the op tables (`op::unary`, `op::composite`): `x.exp()`,
//! `x.relu()`, `x.leaky_relu(0.2)`, ... Generated, so an op added to a table is a `Tensor`
//! method with no code here.

use super::Tensor;
use crate::ir::rules::composite_program;
use crate::{Backend, CompositeOp, Error, Result, UnaryOp};

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
                expected: "f32 or f64".into(),
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
