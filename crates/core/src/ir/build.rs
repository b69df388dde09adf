//! Lowering [`Expr`] trees to a [`Program`] (the tree type itself lives in `op`, beside the op
//! table that writes derivatives with it).
//!
//! An `Expr` carries no dtype of its own: inputs get theirs when the tree is lowered
//! ([`Program::from_exprs`]), and constants and parameters take the dtype of the values they meet
//! (a "weak" scalar, as a Python float meeting a float32 array in numpy/PyTorch). So one function
//! written over `Expr`s lowers to an f32 program or an f64 one. A subtree whose dtype nothing
//! fixes (constants and parameters only, e.g. both sides of a comparison) takes the dtype of
//! input 0, or f32, kiln's default, in a program without inputs. Lowering shares common subexpressions: the
//! same `Expr` used twice, or two equal instructions, become one value.

use std::collections::HashMap;
use std::sync::Arc;

use super::program::{Instr, Program, Scalar, Val, expr_err};
use crate::error::ExprErrorKind;
use crate::op::{Expr, Node};
use crate::{DType, Result};

// ---- lowering -------------------------------------------------------------------------------

/// Appends instructions, sharing equal ones (hash-consing): the common subexpression
/// elimination of lowering, and of the gradient programs built in `grad.rs`.
#[derive(Default)]
pub(crate) struct Emitter {
    pub(crate) code: Vec<Instr>,
    seen: HashMap<Instr, Val>,
}

impl Emitter {
    pub(crate) fn emit(&mut self, ins: Instr) -> Val {
        if let Some(&v) = self.seen.get(&ins) {
            return v;
        }
        let v = self.code.len() as Val;
        self.code.push(ins);
        self.seen.insert(ins, v);
        v
    }
}

struct Lower<'a> {
    inputs: &'a [DType],
    params: Vec<Option<DType>>,
    axes: Option<Vec<isize>>,
    em: Emitter,
    strong: HashMap<*const Node, Option<DType>>,
    done: HashMap<(*const Node, DType), Val>,
}

impl Lower<'_> {
    /// The dtype of a subtree nothing types (see the module docs).
    fn default_dtype(&self) -> DType {
        self.inputs.first().copied().unwrap_or(DType::F32)
    }

    /// The dtype a subtree has by itself (`None`: only weak scalars and parameters).
    fn strong(&mut self, e: &Expr) -> Result<Option<DType>> {
        let key = Arc::as_ptr(&e.0);
        if let Some(&d) = self.strong.get(&key) {
            return Ok(d);
        }
        let d = match &*e.0 {
            Node::Input(k) => match self.inputs.get(*k as usize) {
                Some(&d) => Some(d),
                None => {
                    return Err(expr_err(
                        "expr",
                        ExprErrorKind::Arity,
                        format!(
                            "the expression reads input {k}, but {} inputs were given",
                            self.inputs.len()
                        ),
                    ));
                }
            },
            Node::Param(_) => None,
            Node::Const(_, d) => *d,
            Node::Unary(_, a) | Node::Reduce(_, _, a) => self.strong(a)?,
            Node::Binary(_, a, b) | Node::Where(_, a, b) => {
                let (sa, sb) = (self.strong(a)?, self.strong(b)?);
                sa.or(sb)
            }
            Node::Cmp(..) => Some(DType::U8),
            Node::Cast(d, _) => Some(*d),
        };
        self.strong.insert(key, d);
        Ok(d)
    }

    fn lower(&mut self, e: &Expr, want: DType) -> Result<Val> {
        let d = self.strong(e)?.unwrap_or(want);
        let key = (Arc::as_ptr(&e.0), d);
        if let Some(&v) = self.done.get(&key) {
            return Ok(v);
        }
        let ins = match &*e.0 {
            Node::Input(k) => Instr::Input(*k),
            Node::Param(k) => {
                let k = *k as usize;
                if self.params.len() <= k {
                    self.params.resize(k + 1, None);
                }
                match self.params[k] {
                    Some(p) if p != d => {
                        return Err(expr_err(
                            "param",
                            ExprErrorKind::DType,
                            format!("parameter {k} is used both as {p} and as {d}"),
                        ));
                    }
                    _ => self.params[k] = Some(d),
                }
                Instr::Param(k as u32)
            }
            Node::Const(v, _) => Instr::Const(Scalar::new(*v, d)),
            Node::Unary(op, a) => Instr::Unary(*op, self.lower(a, d)?),
            Node::Binary(op, a, b) => Instr::Binary(*op, self.lower(a, d)?, self.lower(b, d)?),
            Node::Cmp(op, a, b) => {
                let sa = self.strong(a)?;
                let od = match sa {
                    Some(x) => x,
                    None => self.strong(b)?.unwrap_or(self.default_dtype()),
                };
                Instr::Cmp(*op, self.lower(a, od)?, self.lower(b, od)?)
            }
            Node::Where(c, a, b) => Instr::Where(
                self.lower(c, DType::U8)?,
                self.lower(a, d)?,
                self.lower(b, d)?,
            ),
            Node::Cast(to, a) => {
                let from = self.strong(a)?.unwrap_or(*to);
                Instr::Cast(*to, self.lower(a, from)?)
            }
            Node::Reduce(c, axes, a) => {
                match &self.axes {
                    Some(prev) if prev != axes => {
                        return Err(expr_err(
                            c.name(),
                            ExprErrorKind::Phase,
                            format!(
                                "one program reduces one set of axes: {prev:?} and {axes:?} \
                                 (split it in two programs)"
                            ),
                        ));
                    }
                    _ => self.axes = Some(axes.clone()),
                }
                Instr::Reduce(*c, self.lower(a, d)?)
            }
        };
        let v = self.em.emit(ins);
        self.done.insert(key, v);
        Ok(v)
    }
}

impl Program {
    /// Lowers expression trees over inputs of dtypes `inputs` to a validated program with one
    /// output per tree (see the module docs for how constants and parameters get their dtypes;
    /// a parameter that no tree reads is f64).
    pub fn from_exprs(inputs: &[DType], outputs: &[Expr]) -> Result<Program> {
        let mut l = Lower {
            inputs,
            params: Vec::new(),
            axes: None,
            em: Emitter::default(),
            strong: HashMap::new(),
            done: HashMap::new(),
        };
        let mut outs = Vec::with_capacity(outputs.len());
        for e in outputs {
            let d = l.strong(e)?.unwrap_or(l.default_dtype());
            outs.push(l.lower(e, d)?);
        }
        let params = l.params.iter().map(|p| p.unwrap_or(DType::F64)).collect();
        Program::new(
            inputs.to_vec(),
            params,
            l.em.code,
            outs,
            l.axes.unwrap_or_default(),
        )
    }
}
