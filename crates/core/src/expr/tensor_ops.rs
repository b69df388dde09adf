//! Running an elementwise program with `Tensor` methods ([`Program::run_ops`]): how autograd
//! applies the op table's gradient rules.
//!
//! # Why not `eval_expr`
//!
//! [`Program::run`] hands the program to the backend's evaluator, which computes it at once.
//! A gradient rule is a handful of ops in the middle of a backward pass whose neighbours (the
//! sum back to a broadcast operand's shape, the accumulation into a gradient) a deferring
//! backend wants to fuse with it. Run as `Tensor` ops, each instruction is recorded like any
//! other op and the chain stays whole. Scalars (constants, parameters, operands given by value)
//! stay scalars: `op(tensor, scalar)` is `binary_scalar`, and ops of scalars only are folded on
//! the host, so `pow(x, c)`'s rule with `c = 0` costs one fill, not a pass over `x`.

use crate::error::ExprErrorKind;
use crate::ir::{Instr, Program, Scalar, expr_err};
use crate::{Backend, DType, Result, Shape, Tensor};

/// An argument of [`Program::run_ops`]: a tensor or a scalar given by value.
pub enum Arg<'a, B: Backend> {
    Tensor(&'a Tensor<B>),
    Scalar(f64),
}

/// A value during the evaluation.
enum Tv<'a, B: Backend> {
    T(Tensor<B>),
    /// A tensor argument, read in place (no handle cloned per instruction that reads it).
    A(&'a Tensor<B>),
    /// A uniform value, already converted to its dtype (`Scalar::new`).
    S(f64),
}

/// A value as an operand: a tensor (computed or an argument) or a uniform value.
enum V<'t, B: Backend> {
    T(&'t Tensor<B>),
    S(f64),
}

impl<B: Backend> Tv<'_, B> {
    fn view(&self) -> V<'_, B> {
        match self {
            Tv::T(t) => V::T(t),
            Tv::A(t) => V::T(t),
            Tv::S(s) => V::S(*s),
        }
    }
}

fn fold(v: f64, dtype: DType) -> f64 {
    Scalar::new(v, dtype).to_f64()
}

impl Program {
    /// Evaluates this elementwise program with `Tensor` methods, one op per instruction (see
    /// the module docs). Tensor arguments broadcast together (numpy rules); an output that is
    /// a scalar is filled into that shape. Programs with reductions are rejected.
    pub fn run_ops<B: Backend>(
        &self,
        args: &[Arg<'_, B>],
        params: &[f64],
    ) -> Result<Vec<Tensor<B>>> {
        use ExprErrorKind as K;
        if self.reduces() {
            return Err(expr_err(
                "expr",
                K::Phase,
                "run_ops evaluates elementwise programs only",
            ));
        }
        if args.len() != self.inputs().len() || params.len() != self.params().len() {
            return Err(expr_err(
                "expr",
                K::Arity,
                format!(
                    "the program takes {} inputs and {} parameters, {} and {} were given",
                    self.inputs().len(),
                    self.params().len(),
                    args.len(),
                    params.len()
                ),
            ));
        }
        let mut tensors = args.iter().filter_map(|a| match a {
            Arg::Tensor(t) => Some(*t),
            Arg::Scalar(_) => None,
        });
        let Some(first) = tensors.next() else {
            return Err(expr_err(
                "expr",
                K::Arity,
                "run_ops needs at least one tensor argument",
            ));
        };
        let mut vals: Vec<Tv<B>> = Vec::with_capacity(self.code().len());
        for (i, ins) in self.code().iter().enumerate() {
            let dt = self.dtypes()[i];
            let v = self.step(*ins, dt, &vals, args, params, first)?;
            vals.push(v);
        }
        // The arguments' common shape (a gradient rule's are usually all one shape).
        let mut shape = None::<Shape>;
        for t in tensors {
            let s = shape.as_ref().unwrap_or(first.shape());
            if t.shape() != s {
                shape = Some(s.broadcast_with("expr", t.shape())?);
            }
        }
        let shape = shape.as_ref().unwrap_or(first.shape());
        let outputs = self.outputs();
        outputs
            .iter()
            .enumerate()
            .map(|(j, &o)| {
                let once = !outputs[..j].contains(&o) && !outputs[j + 1..].contains(&o);
                let v = &mut vals[o as usize];
                let t = match v {
                    Tv::S(c) => {
                        return Tensor::full(shape.clone(), *c, self.dtype(o), first.device());
                    }
                    Tv::A(t) => (*t).clone(),
                    Tv::T(t) if !once => t.clone(),
                    // Named once: nothing reads the value after this, so it is moved out.
                    Tv::T(_) => match std::mem::replace(v, Tv::S(0.0)) {
                        Tv::T(t) => t,
                        _ => unreachable!("matched as a computed tensor just above"),
                    },
                };
                // An output that read only some arguments is broadcast (a view) to the shape.
                if t.shape() != shape {
                    t.broadcast_to(shape.clone())
                } else {
                    Ok(t)
                }
            })
            .collect()
    }

    /// One instruction of [`Program::run_ops`].
    fn step<'a, B: Backend>(
        &self,
        ins: Instr,
        dt: DType,
        vals: &[Tv<'a, B>],
        args: &[Arg<'a, B>],
        params: &[f64],
        first: &Tensor<B>,
    ) -> Result<Tv<'a, B>> {
        use Tv::{A, S, T};
        // A scalar as a one-element tensor, for the ops that take tensors only (`where`).
        let tensor = |v: &Tv<B>, dt: DType| -> Result<Tensor<B>> {
            match v {
                T(t) => Ok(t.clone()),
                A(t) => Ok((*t).clone()),
                S(s) => Tensor::full(Shape::scalar(), *s, dt, first.device()),
            }
        };
        let val = |v: u32| vals[v as usize].view();
        Ok(match ins {
            Instr::Input(k) => match &args[k as usize] {
                Arg::Tensor(t) => A(t),
                Arg::Scalar(s) => S(fold(*s, dt)),
            },
            Instr::Param(k) => S(fold(params[k as usize], dt)),
            Instr::Const(c) => S(c.to_f64()),
            Instr::Unary(op, a) => match val(a) {
                V::T(t) => T(t.unary(op)?),
                V::S(s) => S(match dt {
                    DType::I64 => op.eval_i64(s as i64).unwrap_or(0) as f64,
                    _ => fold(op.eval(s), dt),
                }),
            },
            Instr::Binary(op, a, b) => match (val(a), val(b)) {
                (V::T(x), V::T(y)) => T(x.binary(op, y)?),
                (V::T(x), V::S(c)) => T(x.binary_scalar(op, c)?),
                (V::S(c), V::T(y)) => T(y.scalar_binary(op, c)?),
                (V::S(x), V::S(y)) => S(match dt {
                    DType::I64 => op.eval_i64(x as i64, y as i64).unwrap_or(0) as f64,
                    DType::U8 => op.eval_u8(x as u8, y as u8).unwrap_or(0) as f64,
                    _ => fold(op.eval(x, y), dt),
                }),
            },
            Instr::Cmp(op, a, b) => match (val(a), val(b)) {
                (V::T(x), V::T(y)) => T(x.compare(op, y)?),
                (V::T(x), V::S(c)) => T(x.compare_scalar(op, c)?),
                (V::S(c), V::T(y)) => T(y.compare_scalar(op.swapped(), c)?),
                (V::S(x), V::S(y)) => S(f64::from(u8::from(op.eval(x, y)))),
            },
            Instr::Where(c, a, b) => match val(c) {
                V::S(m) => match &vals[if m != 0.0 { a } else { b } as usize] {
                    T(t) => T(t.clone()),
                    A(t) => A(t),
                    S(s) => S(*s),
                },
                V::T(m) => T(m.where_cond(
                    &tensor(&vals[a as usize], dt)?,
                    &tensor(&vals[b as usize], dt)?,
                )?),
            },
            Instr::Cast(to, a) => match val(a) {
                V::T(t) => T(t.to_dtype(to)?),
                V::S(s) => S(fold(s, to)),
            },
            Instr::Reduce(..) => unreachable!("rejected by run_ops"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Arg;
    use crate::expr::{Expr, Program};
    use crate::reference::{RefDevice, Reference};
    use crate::{DType, Tensor};

    type T = Tensor<Reference>;
    const D: RefDevice = RefDevice(0);

    #[test]
    fn run_ops_matches_run_with_scalars_folded_and_outputs_broadcast() {
        let (x, c) = (Expr::input(0), Expr::input(1));
        let outs = [
            // a scalar branch picked by a scalar condition: a fill of the broadcast shape
            c.gt(0.0).where_cond(1.5, &x),
            // tensor op scalar, scalar op tensor
            (&x * &c) + (2.0 - x.clone()).exp(),
            // reads only `x` ([3]) while another argument is [2, 3]
            x.neg(),
        ];
        let p = Program::from_exprs(&[DType::F64; 3], &outs).unwrap();
        let xs = T::from_vec(vec![0.5, -1.0, 2.0], [3], &D).unwrap();
        let wide = T::zeros([2, 3], DType::F64, &D).unwrap();
        let got = p
            .run_ops(
                &[Arg::Tensor(&xs), Arg::Scalar(3.0), Arg::Tensor(&wide)],
                &[],
            )
            .unwrap();
        let cs = T::full([1], 3.0, DType::F64, &D).unwrap();
        let want = p.run(&[&xs, &cs, &wide], &[]).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.shape().dims(), &[2, 3]);
            assert_eq!(g.to_vec::<f64>().unwrap(), w.to_vec::<f64>().unwrap());
        }
    }

    /// An output named twice, and an output that is an argument, are each returned whole
    /// (`run_ops` moves an output named once out of its values and clones the others).
    #[test]
    fn run_ops_returns_repeated_outputs_and_arguments() {
        let x = Expr::input(0);
        let twice = &x * 2.0;
        let p = Program::from_exprs(&[DType::F64], &[twice.clone(), x.clone(), twice]).unwrap();
        assert_eq!(p.outputs()[0], p.outputs()[2], "the outputs share a value");
        let xs = T::from_vec(vec![0.5, -1.0, 2.0], [3], &D).unwrap();
        let got = p.run_ops(&[Arg::Tensor(&xs)], &[]).unwrap();
        let want = [
            vec![1.0, -2.0, 4.0],
            vec![0.5, -1.0, 2.0],
            vec![1.0, -2.0, 4.0],
        ];
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(&g.to_vec::<f64>().unwrap(), w);
        }
    }
}
