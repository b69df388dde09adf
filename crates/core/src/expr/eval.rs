//! Running a program: the checks every evaluator shares, the op-by-op evaluator that is
//! [`Backend::eval_expr`]'s default, and the tensor-level entry point [`Program::run`].

use crate::backend::{Backend, HostBuffer};
use crate::error::ExprErrorKind;
use crate::ir::{Combine, Instr, Phase, Program, check_call, expr_err};
use crate::{DType, Layout, Result, Shape, Tensor};

/// One value of the op-by-op evaluation.
enum V<S> {
    /// Input `k`, read through its own layout.
    Input(usize),
    /// A contiguous buffer in the shape of its phase.
    Own(S),
    /// A one-element buffer, broadcast to whatever shape reads it.
    Uni(S),
}

/// A layout of `shape` reading one element everywhere.
fn broadcast1(shape: &Shape) -> Layout {
    Layout::from_parts(shape.clone(), vec![0; shape.rank()], 0)
}

/// [`Backend::eval_expr`] op by op: every instruction is one call of the backend's own kernels
/// (`unary`, `binary`, `compare`, `where_cond`, `cast`, `reduce`), so any backend evaluates any
/// program with exactly its op-by-op semantics. `prod`, which has no backend kernel, folds on
/// the host. Uniform values (constants, parameters) are one-element buffers read with stride 0.
/// A program with 16-bit values runs in its widened form ([`Program::widened`]: f32 inside,
/// rounded where stored), as the fused evaluators run it.
pub fn eval_composed<B: Backend>(
    device: &B::Device,
    program: &Program,
    shape: &Shape,
    inputs: &[(&B::Storage, &Layout)],
    params: &[f64],
) -> Result<Vec<B::Storage>> {
    let widened;
    let program = if program.has_half() {
        widened = program.widened()?;
        &widened
    } else {
        program
    };
    let layouts: Vec<&Layout> = inputs.iter().map(|(_, l)| *l).collect();
    let plan = check_call(program, shape, &layouts, params)?;
    let shape_of = |p: Phase| match p {
        Phase::Reduced => &plan.kept,
        _ => shape,
    };
    let mut vals: Vec<V<B::Storage>> = Vec::with_capacity(program.code().len());
    for (i, ins) in program.code().iter().enumerate() {
        let dt = program.dtypes()[i];
        let phase = program.phases()[i];
        let sh = shape_of(phase);
        // (storage, layout in `sh`) of an operand; a per-element value read in the kept shape
        // is read at index 0 of the reduced axes (`check_call` made sure it is constant there).
        let get = |v: u32, sh: &Shape| -> (&B::Storage, Layout) {
            let at_kept = |l: Layout| -> Layout {
                if sh != shape {
                    plan.axes
                        .iter()
                        .fold(l, |l, &a| l.narrow(a, 0, 1).expect("checked non-empty"))
                } else {
                    l
                }
            };
            match &vals[v as usize] {
                V::Input(k) => (inputs[*k].0, at_kept(inputs[*k].1.clone())),
                V::Own(s) if program.phase(v) == Phase::Elem => {
                    (s, at_kept(Layout::contiguous(shape.clone())))
                }
                V::Own(s) => (s, Layout::contiguous(sh.clone())),
                V::Uni(s) => (s, broadcast1(sh)),
            }
        };
        let is_uni = |v: u32| program.phase(v) == Phase::Uniform;
        // Uniform instructions run on one element.
        let osh = if phase == Phase::Uniform {
            Shape::new([1])
        } else {
            sh.clone()
        };
        let wrap = |s: B::Storage| {
            if phase == Phase::Uniform {
                V::Uni(s)
            } else {
                V::Own(s)
            }
        };
        let v = match *ins {
            Instr::Input(k) => V::Input(k as usize),
            Instr::Param(k) => V::Uni(B::fill(device, dt, 1, params[k as usize])?),
            Instr::Const(s) => V::Uni(B::fill(device, dt, 1, s.to_f64())?),
            Instr::Unary(op, a) => {
                let (s, l) = get(a, &osh);
                wrap(B::unary(op, s, &l, dt)?)
            }
            Instr::Binary(op, a, b) => {
                // A constant or parameter operand travels as a kernel argument.
                let scalar = |v: u32| match program.code()[v as usize] {
                    Instr::Const(c) => Some(c.to_f64()),
                    Instr::Param(k) => Some(params[k as usize]),
                    _ => None,
                };
                match (scalar(a), scalar(b)) {
                    (None, Some(c)) if !is_uni(a) => {
                        let (s, l) = get(a, &osh);
                        wrap(B::binary_scalar(op, s, &l, dt, c, false)?)
                    }
                    (Some(c), None) if !is_uni(b) => {
                        let (s, l) = get(b, &osh);
                        wrap(B::binary_scalar(op, s, &l, dt, c, true)?)
                    }
                    _ => {
                        let ((sa, la), (sb, lb)) = (get(a, &osh), get(b, &osh));
                        wrap(B::binary(op, sa, &la, sb, &lb, dt)?)
                    }
                }
            }
            Instr::Cmp(op, a, b) => {
                let ((sa, la), (sb, lb)) = (get(a, &osh), get(b, &osh));
                wrap(B::compare(op, sa, &la, sb, &lb, program.dtype(a))?)
            }
            Instr::Where(c, a, b) => {
                let ((sc, lc), (sa, la), (sb, lb)) = (get(c, &osh), get(a, &osh), get(b, &osh));
                wrap(B::where_cond(sc, &lc, sa, &la, sb, &lb, dt)?)
            }
            Instr::Cast(to, a) => {
                let (s, l) = get(a, &osh);
                let from = program.dtype(a);
                wrap(if from == to {
                    B::contiguous(s, &l, dt)?
                } else {
                    B::cast(s, &l, from, to)?
                })
            }
            Instr::Reduce(c, a) => {
                let (s, l) = get(a, shape);
                V::Own(match c.reduce_op() {
                    Some(op) => B::reduce(op, s, &l, dt, &plan.axes)?,
                    None => {
                        let h = B::to_host(s, &l, dt)?;
                        let out = host_fold(c, &h, shape, &plan.axes);
                        B::from_host(device, &out)?
                    }
                })
            }
        };
        vals.push(v);
    }
    program
        .outputs()
        .iter()
        .map(|&o| {
            let sh = shape_of(program.phase(o));
            let (s, l) = match &vals[o as usize] {
                V::Input(k) => (inputs[*k].0, inputs[*k].1.clone()),
                V::Own(s) => (s, Layout::contiguous(sh.clone())),
                V::Uni(s) => (s, broadcast1(sh)),
            };
            B::contiguous(s, &l, program.dtype(o))
        })
        .collect()
}

/// Folds the row-major values `h` of `shape` over `axes` with `c` on the host (f32 in f64,
/// rounded once; i64 wraps). The result is contiguous in the kept shape.
fn host_fold(c: Combine, h: &HostBuffer, shape: &Shape, axes: &[usize]) -> HostBuffer {
    let dims = shape.dims();
    let mut kept = dims.to_vec();
    for &a in axes {
        kept[a] = 1;
    }
    let kept_n: usize = kept.iter().product();
    let mut kstride = vec![1usize; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        kstride[d] = kstride[d + 1] * kept[d + 1];
    }
    // The kept flat index of input element `flat`.
    let target = |mut flat: usize| -> usize {
        let mut out = 0;
        for d in (0..dims.len()).rev() {
            let i = flat % dims[d];
            flat /= dims[d];
            if !axes.contains(&d) {
                out += i * kstride[d];
            }
        }
        out
    };
    fn fold_f(c: Combine, a: f64, b: f64) -> f64 {
        match c {
            Combine::Sum => a + b,
            Combine::Prod => a * b,
            Combine::Max => {
                if a.is_nan() || b > a {
                    b
                } else {
                    a
                }
            }
            Combine::Min => {
                if a.is_nan() || b < a {
                    b
                } else {
                    a
                }
            }
        }
    }
    match h {
        HostBuffer::I64(v) => {
            let mut acc: Vec<Option<i64>> = vec![None; kept_n];
            for (i, &x) in v.iter().enumerate() {
                let t = &mut acc[target(i)];
                *t = Some(match (*t, c) {
                    (None, _) => x,
                    (Some(a), Combine::Sum) => a.wrapping_add(x),
                    (Some(a), Combine::Prod) => a.wrapping_mul(x),
                    (Some(a), Combine::Max) => a.max(x),
                    (Some(a), Combine::Min) => a.min(x),
                });
            }
            let id = c.identity().unwrap_or(0.0) as i64;
            HostBuffer::I64(acc.into_iter().map(|a| a.unwrap_or(id)).collect())
        }
        _ => {
            let v = h.to_f64_vec();
            let mut acc: Vec<Option<f64>> = vec![None; kept_n];
            for (i, &x) in v.iter().enumerate() {
                let t = &mut acc[target(i)];
                *t = Some(match *t {
                    None => x,
                    Some(a) => fold_f(c, a, x),
                });
            }
            let id = c.identity().unwrap_or(0.0);
            let out: Vec<f64> = acc.into_iter().map(|a| a.unwrap_or(id)).collect();
            HostBuffer::from_f64(h.dtype(), &out)
        }
    }
}

impl Program {
    /// Runs the program on tensors: checks their number, dtypes and devices, broadcasts them
    /// to one iteration shape (numpy rules), and calls the backend's [`Backend::eval_expr`].
    /// Elementwise outputs have the iteration shape; reduced ones the kept shape (reduced axes
    /// kept as size 1, as `keepdim`). `params` are converted to each parameter's dtype.
    pub fn run<B: Backend>(&self, inputs: &[&Tensor<B>], params: &[f64]) -> Result<Vec<Tensor<B>>> {
        use ExprErrorKind as K;
        if inputs.len() != self.inputs().len() {
            return Err(expr_err(
                "expr",
                K::Arity,
                format!(
                    "the program takes {} inputs, {} were given",
                    self.inputs().len(),
                    inputs.len()
                ),
            ));
        }
        let Some(first) = inputs.first() else {
            return Err(expr_err(
                "expr",
                K::Arity,
                "a program run on tensors needs at least one input (for its shape and device)",
            ));
        };
        let mut shape = first.shape().clone();
        for (k, t) in inputs.iter().enumerate() {
            if t.dtype() != self.inputs()[k] {
                return Err(expr_err(
                    "expr",
                    K::DType,
                    format!(
                        "input {k} is {}, the program takes {}",
                        t.dtype(),
                        self.inputs()[k]
                    ),
                ));
            }
            if t.device() != first.device() {
                return Err(crate::Error::DeviceMismatch {
                    op: "expr",
                    lhs: first.device().to_string(),
                    rhs: t.device().to_string(),
                });
            }
            shape = shape.broadcast_with("expr", t.shape()).map_err(|_| {
                expr_err(
                    "expr",
                    K::Shape,
                    format!(
                        "input {k} of shape {} does not broadcast with {shape}",
                        t.shape()
                    ),
                )
            })?;
        }
        let layouts = inputs
            .iter()
            .map(|t| t.layout().broadcast_to(&shape))
            .collect::<Result<Vec<_>>>()?;
        let args: Vec<(&B::Storage, &Layout)> = inputs
            .iter()
            .zip(&layouts)
            .map(|(t, l)| (t.storage(), l))
            .collect();
        let p = first.prof("expr", &[], false);
        let outs = B::eval_expr(first.device(), self, &shape, &args, params)?;
        drop(p);
        let shapes = self.output_shapes(&shape)?;
        if outs.len() != shapes.len() {
            return Err(crate::Error::backend(
                "expr",
                format!(
                    "the {} backend returned {} outputs for a program of {}",
                    B::NAME,
                    outs.len(),
                    shapes.len()
                ),
            ));
        }
        Ok(outs
            .into_iter()
            .zip(shapes)
            .zip(self.output_dtypes())
            .map(|((s, sh), dt): ((B::Storage, Shape), DType)| Tensor::from_storage(s, sh, dt))
            .collect())
    }
}
