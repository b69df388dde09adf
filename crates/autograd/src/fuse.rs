//! `fuse`: a user function written once over [`Expr`]s, run fused on any backend, on tensors
//! and on differentiable [`Var`]s.
//!
//! ```
//! use kiln_autograd::{Var, fuse};
//! use kiln_backend_cpu::Cpu;
//! use kiln_core::{DType, Generator, RandDist};
//!
//! let uniform = RandDist::Uniform { low: -1.0, high: 1.0 };
//! let t = Generator::new(0).sample::<Cpu>([4, 3], uniform, DType::F64, &Cpu::device(0))?;
//! let swish = fuse(|x| &x * x.sigmoid());          // defined once
//! let y = swish.tensor(&t)?;                        // a Tensor<B>: one fused pass
//! let p = Var::param(t);
//! let v = swish.var(&p)?;                           // a Var<B>: differentiable
//! v.sum_all()?.backward()?;                         // backward: another fused program
//! assert_eq!(p.grad().unwrap().dims(), y.dims());
//! # Ok::<(), kiln_core::Error>(())
//! ```
//!
//! The function is traced once per combination of input dtypes into a [`Program`] (memoized
//! here; the backend memoizes whatever it compiles from it), and run with
//! [`Backend::eval_expr`](kiln_core::Backend::eval_expr): one pass on the CPU, whatever the
//! backend does best elsewhere. Inputs broadcast against each other (numpy rules); reductions
//! (`x.sum(&[-1])`, ...) keep the reduced axes as size 1.
//!
//! On `Var`s, each output is one recorded op whose backward is derived from the program by
//! [`kiln_core::expr::grad`]: itself a program, run fused, which recomputes the forward values it
//! needs instead of saving them (the graph keeps only the inputs, and the reduced values of a
//! program that reduces). No backward is written by hand. Gradients are summed back to each
//! input's shape when it was broadcast. Scalar parameters (`Expr::param(k)`, given as `params`)
//! are constants to autograd; a `prod` reduction is not differentiable (a typed error at
//! backward).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_core::expr::grad::{self, Gradient};
use kiln_core::expr::{Expr, Program};
use kiln_core::{Backend, DType, Error, ExprErrorKind, Result, Tensor};

use crate::ops::reduce_to_shape;
use crate::var::{Var, is_grad_enabled};

type UserFn = dyn Fn(&[Expr]) -> Vec<Expr> + Send + Sync;
/// (output, inputs differentiated)
type GradKey = (usize, Vec<usize>);

/// A function of `Expr`s, compiled per input dtypes and run fused (see the module docs).
/// Cheap to clone (shared memo).
#[derive(Clone)]
pub struct Fused {
    inner: Arc<Inner>,
}

struct Inner {
    n_inputs: usize,
    f: Box<UserFn>,
    programs: Mutex<HashMap<Vec<DType>, Arc<Compiled>>>,
}

/// One trace of the function.
struct Compiled {
    forward: Program,
    /// The forward with the reduced values as extra outputs (programs that reduce), run when
    /// a backward will follow.
    saving: Option<Program>,
    grads: Mutex<HashMap<GradKey, Arc<Gradient>>>,
}

impl std::fmt::Debug for Fused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fused({} inputs)", self.inner.n_inputs)
    }
}

/// A fused function of one tensor.
pub fn fuse(f: impl Fn(Expr) -> Expr + Send + Sync + 'static) -> Fused {
    fuse_n(1, move |x| vec![f(x[0].clone())])
}

/// A fused function of two tensors (broadcast against each other).
pub fn fuse2(f: impl Fn(Expr, Expr) -> Expr + Send + Sync + 'static) -> Fused {
    fuse_n(2, move |x| vec![f(x[0].clone(), x[1].clone())])
}

/// A fused function of `n_inputs` tensors with any number of outputs.
pub fn fuse_n(n_inputs: usize, f: impl Fn(&[Expr]) -> Vec<Expr> + Send + Sync + 'static) -> Fused {
    Fused {
        inner: Arc::new(Inner {
            n_inputs,
            f: Box::new(f),
            programs: Mutex::new(HashMap::new()),
        }),
    }
}

fn arity(n: usize, got: usize) -> Error {
    Error::Expr {
        op: "fuse",
        kind: ExprErrorKind::Arity,
        msg: format!("the function takes {n} inputs, {got} were given"),
    }
}

impl Fused {
    /// The forward program for inputs of `dtypes` (traced on first use, then memoized).
    pub fn program(&self, dtypes: &[DType]) -> Result<Program> {
        Ok(self.compiled(dtypes)?.forward.clone())
    }

    fn compiled(&self, dtypes: &[DType]) -> Result<Arc<Compiled>> {
        if dtypes.len() != self.inner.n_inputs {
            return Err(arity(self.inner.n_inputs, dtypes.len()));
        }
        let mut memo = self
            .inner
            .programs
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(c) = memo.get(dtypes) {
            return Ok(c.clone());
        }
        let xs: Vec<Expr> = (0..dtypes.len()).map(Expr::input).collect();
        let outs = (self.inner.f)(&xs);
        let forward = Program::from_exprs(dtypes, &outs)?;
        let saving = if forward.reduces() {
            Some(grad::with_reduced_outputs(&forward)?)
        } else {
            None
        };
        let c = Arc::new(Compiled {
            forward,
            saving,
            grads: Mutex::new(HashMap::new()),
        });
        memo.insert(dtypes.to_vec(), c.clone());
        Ok(c)
    }

    /// Runs the function on tensors (all outputs), with the values of its parameters.
    pub fn tensors_with<B: Backend>(
        &self,
        xs: &[&Tensor<B>],
        params: &[f64],
    ) -> Result<Vec<Tensor<B>>> {
        let dtypes: Vec<DType> = xs.iter().map(|x| x.dtype()).collect();
        self.compiled(&dtypes)?.forward.run(xs, params)
    }

    /// Runs the function on tensors (all outputs).
    pub fn tensors<B: Backend>(&self, xs: &[&Tensor<B>]) -> Result<Vec<Tensor<B>>> {
        self.tensors_with(xs, &[])
    }

    /// Runs a one-input, one-output function on a tensor.
    pub fn tensor<B: Backend>(&self, x: &Tensor<B>) -> Result<Tensor<B>> {
        Ok(self.tensors(&[x])?.swap_remove(0))
    }

    /// Runs the function on variables: each output is a recorded op whose backward is a fused
    /// program derived from this one (see the module docs).
    pub fn vars_with<B: Backend>(&self, xs: &[&Var<B>], params: &[f64]) -> Result<Vec<Var<B>>> {
        let ts: Vec<Tensor<B>> = xs.iter().map(|v| v.tensor()).collect();
        let dtypes: Vec<DType> = ts.iter().map(|t| t.dtype()).collect();
        let c = self.compiled(&dtypes)?;
        let refs: Vec<&Tensor<B>> = ts.iter().collect();
        let record = is_grad_enabled() && xs.iter().any(|v| v.requires_grad());
        if !record {
            return Ok(c
                .forward
                .run(&refs, params)?
                .into_iter()
                .map(Var::constant)
                .collect());
        }
        let n_out = c.forward.outputs().len();
        let mut outs = c.saving.as_ref().unwrap_or(&c.forward).run(&refs, params)?;
        let reduced: Arc<Vec<Tensor<B>>> = Arc::new(outs.split_off(n_out));
        let ts = Arc::new(ts);
        let params: Arc<Vec<f64>> = Arc::new(params.to_vec());
        Ok(outs
            .into_iter()
            .enumerate()
            .map(|(j, y)| {
                if !y.dtype().is_float() {
                    return Var::constant(y);
                }
                let (c, ts, reduced, params) =
                    (c.clone(), ts.clone(), reduced.clone(), params.clone());
                Var::from_op("fused", xs, y, move |g, needs| {
                    backward(&c, j, &ts, &reduced, &params, g, needs)
                })
            })
            .collect())
    }

    /// [`Self::vars_with`] without parameters.
    pub fn vars<B: Backend>(&self, xs: &[&Var<B>]) -> Result<Vec<Var<B>>> {
        self.vars_with(xs, &[])
    }

    /// Runs a one-input, one-output function on a variable.
    pub fn var<B: Backend>(&self, x: &Var<B>) -> Result<Var<B>> {
        Ok(self.vars(&[x])?.swap_remove(0))
    }
}

/// The gradients of output `j` for the inputs that need one.
fn backward<B: Backend>(
    c: &Compiled,
    j: usize,
    ts: &[Tensor<B>],
    reduced: &[Tensor<B>],
    params: &[f64],
    g: &Tensor<B>,
    needs: &[bool],
) -> Result<Vec<Option<Tensor<B>>>> {
    let wrt: Vec<usize> = (0..ts.len())
        .filter(|&i| needs[i] && ts[i].dtype().is_float())
        .collect();
    if wrt.is_empty() {
        return Ok(vec![None; ts.len()]);
    }
    let gr = {
        let mut memo = c.grads.lock().unwrap_or_else(|e| e.into_inner());
        match memo.get(&(j, wrt.clone())) {
            Some(gr) => gr.clone(),
            None => {
                let gr = Arc::new(grad::derive(&c.forward, j, &wrt)?);
                memo.insert((j, wrt.clone()), gr.clone());
                gr
            }
        }
    };
    let mut args: Vec<Tensor<B>> = ts.iter().chain(reduced).cloned().collect();
    if let Some(ties) = &gr.ties {
        let refs: Vec<&Tensor<B>> = args.iter().collect();
        let counts = ties.run(&refs, params)?;
        args.extend(counts);
    }
    args.push(g.clone());
    let refs: Vec<&Tensor<B>> = args.iter().collect();
    let mut bparams = params.to_vec();
    if c.forward.reduces() {
        // the number of elements each reduction folds (see `Gradient::backward`)
        let mut shape = ts[0].shape().clone();
        for t in &ts[1..] {
            shape = shape.broadcast_with("fused", t.shape())?;
        }
        let folded: usize = c
            .forward
            .resolve_axes(&shape)?
            .iter()
            .map(|&a| shape.dims()[a])
            .product();
        bparams.push(folded as f64);
    }
    let grads = gr.backward.run(&refs, &bparams)?;
    let mut out = vec![None; ts.len()];
    for (&i, gi) in wrt.iter().zip(grads) {
        out[i] = Some(reduce_to_shape(&gi, ts[i].shape())?);
    }
    Ok(out)
}
