//! Tensor ops written as fused programs of the IR: one kernel on a GPU, one pass on the CPU.

use std::sync::{Arc, Mutex};

use crate::{Backend, DType, Error, Result, Tensor};

use super::{Expr, Program};

/// `sqrt(sum(x * x))` over every axis of a rank-`rank` tensor of `dtype`, built once per key.
fn norm_program(dtype: DType, rank: usize) -> Result<Arc<Program>> {
    type Cache = Mutex<Vec<((DType, usize), Arc<Program>)>>;
    static CACHE: Cache = Mutex::new(Vec::new());
    let key = (dtype, rank);
    if let Some((_, p)) = CACHE.lock().unwrap().iter().find(|(k, _)| *k == key) {
        return Ok(p.clone());
    }
    let x = Expr::input(0);
    let axes: Vec<isize> = (0..rank as isize).map(|a| a - rank as isize).collect();
    let p = Arc::new(Program::from_exprs(
        &[dtype],
        &[(&x * &x).sum(&axes).sqrt()],
    )?);
    CACHE.lock().unwrap().push((key, p.clone()));
    Ok(p)
}

impl<B: Backend> Tensor<B> {
    /// The Euclidean (Frobenius, for a matrix) norm of all elements, `sqrt(sum(x²))`, as a
    /// scalar tensor on the same device (`torch.linalg.norm(x)` of a flattened `x`). One fused
    /// program: on a GPU a single kernel, so the value can stay on the device in a loop without
    /// costing a launch per step for each of square, sum and square root.
    pub fn norm(&self) -> Result<Tensor<B>> {
        if !self.dtype().is_float() {
            return Err(Error::invalid(
                "norm",
                format!("needs a float tensor, got {}", self.dtype()),
            ));
        }
        let x = if self.rank() == 0 {
            self.reshape([1])?
        } else {
            self.clone()
        };
        let program = norm_program(x.dtype(), x.rank())?;
        let out = program.run(&[&x], &[])?;
        let out = out.into_iter().next().expect("one output");
        out.reshape(Vec::<usize>::new())
    }
}
