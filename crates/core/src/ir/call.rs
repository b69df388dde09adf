//! The checks every evaluator runs on one call of a program (inputs, parameters, layouts,
//! axes), kept beside the IR so that a backend's fused evaluator needs nothing above it.

use super::program::{Instr, Program, expr_err};
use crate::error::ExprErrorKind;
use crate::{Layout, Result, Shape};

/// What [`check_call`] resolved for one evaluation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallPlan {
    /// The reduction axes, resolved against the iteration shape (sorted, distinct).
    pub axes: Vec<usize>,
    /// The iteration shape with the reduction axes set to 1.
    pub kept: Shape,
}

impl CallPlan {
    /// The element count of output `j` of `program` over the iteration shape `shape`: the
    /// kept shape's for a reduced output, else the iteration shape's.
    pub fn output_len(&self, program: &Program, j: usize, shape: &Shape) -> usize {
        if program.output_is_reduced(j) {
            self.kept.elem_count()
        } else {
            shape.elem_count()
        }
    }
}

/// Checks one evaluation of `program` over the iteration shape `shape`: the number of inputs
/// and parameters, every input layout's shape, the reduction axes, and that no `max`/`min` folds
/// an empty axis. Backends call it first; it is what makes a bad call an [`Error::Expr`]
/// instead of a panic.
///
/// [`Error::Expr`]: crate::Error::Expr
pub fn check_call(
    program: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    params: &[f64],
) -> Result<CallPlan> {
    use ExprErrorKind as K;
    if layouts.len() != program.inputs().len() {
        return Err(expr_err(
            "expr",
            K::Arity,
            format!(
                "the program takes {} inputs, {} were given",
                program.inputs().len(),
                layouts.len()
            ),
        ));
    }
    if params.len() != program.params().len() {
        return Err(expr_err(
            "expr",
            K::Arity,
            format!(
                "the program takes {} parameters, {} were given",
                program.params().len(),
                params.len()
            ),
        ));
    }
    for (k, l) in layouts.iter().enumerate() {
        if l.shape() != shape {
            return Err(expr_err(
                "expr",
                K::Shape,
                format!(
                    "input {k} is laid out as {}, not as the iteration shape {shape} \
                     (broadcast it first)",
                    l.shape()
                ),
            ));
        }
    }
    if !program.reduces() {
        // Nothing folds (most calls): no axes to resolve, the kept shape is the iteration's.
        return Ok(CallPlan {
            axes: Vec::new(),
            kept: shape.clone(),
        });
    }
    let axes = program.resolve_axes(shape)?;
    let kept = program.kept_shape(shape)?;
    for &k in program.post_inputs() {
        let l = layouts[k as usize];
        for &a in &axes {
            if l.dims()[a] != 1 && l.strides()[a] != 0 {
                return Err(expr_err(
                    "expr",
                    K::Shape,
                    format!(
                        "input {k} is read after the reduction but varies along reduced axis \
                         {a} (shape {shape}); only values constant along the reduced axes can \
                         be combined with reduced ones"
                    ),
                ));
            }
        }
    }
    if !program.post_inputs().is_empty() && axes.iter().any(|&a| shape.dims()[a] == 0) {
        return Err(expr_err(
            "expr",
            K::Shape,
            format!("the post-map reads inputs, but a reduced axis of {shape} is empty"),
        ));
    }
    let reduced_empty = axes.iter().any(|&a| shape.dims()[a] == 0);
    if reduced_empty && kept.elem_count() > 0 {
        for ins in program.code() {
            let Instr::Reduce(c, _) = ins else { continue };
            if c.identity().is_none() {
                return Err(expr_err(
                    c.name(),
                    K::Structure,
                    format!("cannot fold an empty axis of shape {shape} (no identity)"),
                ));
            }
        }
    }
    Ok(CallPlan { axes, kept })
}
