//! The gradient unscale and inf/NaN check of dynamic loss scaling
//! ([`Backend::unscale_check`](crate::Backend::unscale_check)), as data and as one program;
//! and the squared global norm that gradient clipping takes
//! ([`Backend::sq_sum`](crate::Backend::sq_sum), [`sq_sum_program`]), over the same slots.
//!
//! # Why one op
//!
//! A loss scaler divides every gradient by the scale and must know whether any element of any
//! gradient is inf or NaN (then the step is skipped). Composed from tensor ops that is a
//! multiply and a reduction per gradient plus the sum of the per-gradient flags: two or three
//! launches per parameter on a GPU, 120-190 for a ResNet-18. As one backend op (PyTorch's
//! `_amp_foreach_non_finite_check_and_unscale_`) a GPU does it in one multi-tensor kernel per
//! dtype that writes the unscaled gradients and raises one flag. The default implementation
//! evaluates [`unscale_program`] once per gradient through `eval_expr` (one fused pass per
//! gradient on the CPU), so backends without a kernel of their own need nothing.
//!
//! # The flag
//!
//! One f32 element: `0` when every unscaled element is finite, [`FOUND_NON_FINITE`] (`1`)
//! when at least one is inf or NaN. The check is on the stored unscaled value, so an element
//! that overflows only when rounded back to its 16-bit dtype also counts. This module sits
//! below `backend` (it needs only the IR).

use crate::ir::Program;
use crate::op::Expr;
use crate::{DType, Result};

/// The flag's value when some gradient holds an inf or a NaN (module docs); `0.0` otherwise.
pub const FOUND_NON_FINITE: f32 = 1.0;

/// One gradient of a [`Backend::unscale_check`](crate::Backend::unscale_check): a contiguous
/// buffer of `len` elements.
pub struct UnscaleSlot<'a, S> {
    pub grad: &'a S,
    pub len: usize,
}

/// The dtype `g · inv` is computed in for gradients of `dtype`: f32 for the 16-bit floats
/// (loaded exactly, rounded once on store), the dtype itself otherwise. The inverse scale is
/// a parameter of this dtype.
pub fn unscale_compute_dtype(dtype: DType) -> DType {
    if dtype.is_half() { DType::F32 } else { dtype }
}

/// The program of one gradient of `dtype` (a float dtype) over a 1-d iteration shape.
///
/// Input: `[g]`; parameter 0: the inverse scale (of [`unscale_compute_dtype`]); outputs:
/// `[y, flag]` with `y = g · inv` computed in the compute dtype and rounded once to `dtype`,
/// and `flag` (f32, the reduced shape `[1]`) `(Σ y · 0) != 0`: `inf · 0` and `NaN · 0` are
/// NaN, which propagates through the sum, so the flag is 1 exactly when some `y` is not finite
/// (the module docs' convention).
pub fn unscale_program(dtype: DType) -> Result<Program> {
    let acc = unscale_compute_dtype(dtype);
    let g = Expr::input(0);
    let g = if acc != dtype { g.to_dtype(acc) } else { g };
    let w = g * Expr::param(0);
    let (y, wide) = if acc != dtype {
        let y = w.to_dtype(dtype);
        // Widening a 16-bit value to f32 is exact: the check sees the stored value.
        let wide = y.to_dtype(acc);
        (y, wide)
    } else {
        (w.clone(), w)
    };
    let flag = (wide * 0.0).sum(&[0]).ne(0.0).to_dtype(DType::F32);
    Program::from_exprs(&[dtype], &[y, flag])
}

/// The program combining two flags (f32 `[1]` each) into one: their maximum, so the result
/// keeps the 0/1 convention.
pub fn flag_union_program() -> Result<Program> {
    Program::from_exprs(
        &[DType::F32, DType::F32],
        &[Expr::input(0).maximum(Expr::input(1))],
    )
}

/// The program of one tensor of `dtype` (a float dtype) of [`Backend::sq_sum`](crate::Backend::sq_sum)
/// over a 1-d iteration shape: input `[x]`, output the f64 `Σ x²` (the reduced shape `[1]`),
/// every element widened to f64 first (exact) and squared and summed in f64.
pub fn sq_sum_program(dtype: DType) -> Result<Program> {
    let x = Expr::input(0);
    let x = if dtype != DType::F64 {
        x.to_dtype(DType::F64)
    } else {
        x
    };
    Program::from_exprs(&[dtype], &[(x.clone() * x).sum(&[0])])
}

/// The program adding two f64 sums (`[1]` each) of [`sq_sum_program`].
pub fn sum_pair_program() -> Result<Program> {
    Program::from_exprs(
        &[DType::F64, DType::F64],
        &[Expr::input(0) + Expr::input(1)],
    )
}
