//! Reverse-mode differentiation of a program into programs of the same IR.
//!
//! The backward of a fused function is itself fused: [`derive()`] turns a program and one of its
//! outputs into a backward program that recomputes whatever forward values it needs from the
//! inputs (recomputing an elementwise value is cheaper than storing and reloading it) and
//! returns the gradient of every requested input, in the iteration shape. The caller sums each
//! gradient back to its input's shape (broadcast inputs; kiln-autograd's `reduce_to_shape`).
//!
//! Reductions need their results in the backward pass, which is elementwise. So the forward
//! is run as [`with_reduced_outputs`] (the forward outputs plus the value of every reduction,
//! in kept shape), and the backward program reads those values as inputs: inside it each
//! `Reduce` becomes an input broadcast along the reduced axes, and its adjoint flows to the
//! mapped value: unchanged for `sum`; for `max`/`min` only to the elements equal to the result,
//! shared evenly among ties (as `torch.amax` and kiln's `Var::max`), which needs the number of
//! ties, counted by a third program ([`Gradient::ties`]) before the backward runs. `prod` is not
//! differentiated (its gradient at zero factors needs more than this IR says); it is an error.
//!
//! Gradients at kinks follow kiln-autograd (and PyTorch): `relu`/`abs` have derivative 0 at 0,
//! `sign`/`floor`/`ceil` a zero gradient; `maximum`/`minimum` of two differentiated values split
//! ties evenly, against a value that is not differentiated (a constant, a parameter, an input
//! not asked for) they pass the gradient where the differentiated side is inside the closed
//! range (`clamp`); `pow(a, b)` gives `a` nothing where `b == 0`, and `b` nothing where `a == 0`
//! and `b >= 0`.

use std::collections::HashMap;

use super::build::Emitter;
use super::program::{Combine, Instr, Phase, Program, Scalar, Val, expr_err};
use super::rules::{splice, unary_vjp_program};
use crate::error::ExprErrorKind;
use crate::op::{BinaryOp, CmpOp, GradFrom, UnaryOp};
use crate::{DType, Result};

/// `program` with one more output per reduction (each `Reduce` value, in instruction order,
/// kept shape): the forward to run when a backward will follow.
pub fn with_reduced_outputs(program: &Program) -> Result<Program> {
    let mut outs = program.outputs().to_vec();
    outs.extend(reductions(program));
    Program::new(
        program.inputs().to_vec(),
        program.params().to_vec(),
        program.code().to_vec(),
        outs,
        program.axes().to_vec(),
    )
}

/// The values of the program's `Reduce` instructions, in order.
pub fn reductions(program: &Program) -> Vec<Val> {
    (0..program.code().len() as Val)
        .filter(|&v| matches!(program.code()[v as usize], Instr::Reduce(..)))
        .collect()
}

/// The programs that compute the gradient of one output (see [`derive()`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gradient {
    /// The number of reductions of the forward program (`R`).
    pub reductions: usize,
    /// For forward programs with float `max`/`min` reductions (`T` of them): inputs are the
    /// forward inputs then the `R` reduced values; outputs are, per such reduction, how many
    /// elements equal its result (in the reduction's dtype). Run it before [`Self::backward`].
    pub ties: Option<Program>,
    /// Inputs: the forward inputs, the `R` reduced values, the `T` tie counts, then the
    /// cotangent of the output (its shape). Parameters: the forward's, and for a forward that
    /// reduces one more (f64): the number of elements each reduction folds (the product of
    /// the reduced extents). Outputs: one gradient per requested input, in the iteration shape.
    pub backward: Program,
}

/// Remaps the forward into `em` with every `Reduce` replaced by an input (`first_acc + r`).
/// Returns the value map and, per reduction, `(combine, mapped value, value of its input)`.
#[allow(clippy::type_complexity)]
fn rewrite(
    program: &Program,
    em: &mut Emitter,
    first_acc: u32,
) -> (Vec<Val>, Vec<(Combine, Val, Val)>) {
    let mut map: Vec<Val> = Vec::with_capacity(program.code().len());
    let mut reds = Vec::new();
    for ins in program.code() {
        let m = |v: Val| map[v as usize];
        let new = match *ins {
            Instr::Reduce(c, a) => {
                let r = em.emit(Instr::Input(first_acc + reds.len() as u32));
                reds.push((c, m(a), r));
                r
            }
            Instr::Input(k) => em.emit(Instr::Input(k)),
            Instr::Param(k) => em.emit(Instr::Param(k)),
            Instr::Const(s) => em.emit(Instr::Const(s)),
            Instr::Unary(op, a) => em.emit(Instr::Unary(op, m(a))),
            Instr::Binary(op, a, b) => em.emit(Instr::Binary(op, m(a), m(b))),
            Instr::Cmp(op, a, b) => em.emit(Instr::Cmp(op, m(a), m(b))),
            Instr::Where(c, a, b) => em.emit(Instr::Where(m(c), m(a), m(b))),
            Instr::Cast(to, a) => em.emit(Instr::Cast(to, m(a))),
        };
        map.push(new);
    }
    (map, reds)
}

/// Drops the instructions no output needs and renumbers the rest.
fn compact(code: &[Instr], outputs: &[Val]) -> (Vec<Instr>, Vec<Val>) {
    let mut live = vec![false; code.len()];
    for &o in outputs {
        live[o as usize] = true;
    }
    for i in (0..code.len()).rev() {
        if live[i] {
            for a in code[i].operands() {
                live[a as usize] = true;
            }
        }
    }
    let mut new_index = vec![0 as Val; code.len()];
    let mut out = Vec::new();
    for (i, ins) in code.iter().enumerate() {
        if !live[i] {
            continue;
        }
        let m = |v: Val| new_index[v as usize];
        let ins = match *ins {
            Instr::Unary(op, a) => Instr::Unary(op, m(a)),
            Instr::Binary(op, a, b) => Instr::Binary(op, m(a), m(b)),
            Instr::Cmp(op, a, b) => Instr::Cmp(op, m(a), m(b)),
            Instr::Where(c, a, b) => Instr::Where(m(c), m(a), m(b)),
            Instr::Cast(to, a) => Instr::Cast(to, m(a)),
            Instr::Reduce(c, a) => Instr::Reduce(c, m(a)),
            other => other,
        };
        new_index[i] = out.len() as Val;
        out.push(ins);
    }
    (
        out,
        outputs.iter().map(|&o| new_index[o as usize]).collect(),
    )
}

/// Emits the arithmetic of the adjoints, typed by the forward's dtypes.
struct Adj<'a> {
    em: &'a mut Emitter,
    dtypes: Vec<DType>,
    /// The forward phase of each forward value (rewritten numbering).
    fphase: Vec<Phase>,
    /// The index of the parameter holding the number of elements each reduction folds.
    count_param: u32,
}

impl Adj<'_> {
    fn dt(&self, v: Val) -> DType {
        self.dtypes[v as usize]
    }
    fn emit(&mut self, ins: Instr, dt: DType) -> Val {
        let v = self.em.emit(ins);
        if v as usize == self.dtypes.len() {
            self.dtypes.push(dt);
        }
        v
    }
    fn c(&mut self, x: f64, dt: DType) -> Val {
        self.emit(Instr::Const(Scalar::new(x, dt)), dt)
    }
    fn un(&mut self, op: UnaryOp, a: Val) -> Val {
        let dt = self.dt(a);
        self.emit(Instr::Unary(op, a), dt)
    }
    fn bin(&mut self, op: BinaryOp, a: Val, b: Val) -> Val {
        let dt = self.dt(a);
        self.emit(Instr::Binary(op, a, b), dt)
    }
    fn mul(&mut self, a: Val, b: Val) -> Val {
        self.bin(BinaryOp::Mul, a, b)
    }
    fn mulc(&mut self, a: Val, x: f64) -> Val {
        let c = self.c(x, self.dt(a));
        self.mul(a, c)
    }
    /// `cmp(a, b)` as a 0/1 value of `dt`.
    fn mask(&mut self, op: CmpOp, a: Val, b: Val, dt: DType) -> Val {
        let m = self.emit(Instr::Cmp(op, a, b), DType::U8);
        self.emit(Instr::Cast(dt, m), dt)
    }
    fn cmp(&mut self, op: CmpOp, a: Val, b: Val) -> Val {
        self.emit(Instr::Cmp(op, a, b), DType::U8)
    }
    fn select(&mut self, c: Val, a: Val, b: Val) -> Val {
        let dt = self.dt(a);
        self.emit(Instr::Where(c, a, b), dt)
    }
}

/// Derives the gradient of output `output` of `program` with respect to the inputs `wrt` (see
/// the module docs and [`Gradient`] for the programs' conventions). Inputs in `wrt` and the
/// output must be floats.
pub fn derive(program: &Program, output: usize, wrt: &[usize]) -> Result<Gradient> {
    use ExprErrorKind as K;
    let n = program.inputs().len();
    let Some(&out) = program.outputs().get(output) else {
        return Err(expr_err(
            "grad",
            K::Arity,
            format!(
                "output {output} of a program with {}",
                program.outputs().len()
            ),
        ));
    };
    let gdt = program.dtype(out);
    if !gdt.is_float() {
        return Err(expr_err(
            "grad",
            K::DType,
            format!("output {output} is {gdt}; only float outputs are differentiated"),
        ));
    }
    for &k in wrt {
        match program.inputs().get(k) {
            Some(d) if d.is_float() => {}
            Some(d) => {
                return Err(expr_err(
                    "grad",
                    K::DType,
                    format!("input {k} is {d}; only float inputs are differentiated"),
                ));
            }
            None => {
                return Err(expr_err(
                    "grad",
                    K::Arity,
                    format!("input {k} of a program with {n}"),
                ));
            }
        }
    }
    for ins in program.code() {
        if let Instr::Reduce(Combine::Prod, _) = ins {
            return Err(expr_err(
                "prod",
                K::Structure,
                "a fused prod reduction is not differentiable (write it with log/exp, or use \
                 separate ops)",
            ));
        }
    }

    // Which values depend on a differentiated input (through reductions too).
    let r_count = reductions(program).len();
    let mut depends = vec![false; program.code().len()];
    for (i, ins) in program.code().iter().enumerate() {
        depends[i] = match *ins {
            Instr::Input(k) => wrt.contains(&(k as usize)),
            _ => ins.operands().iter().any(|&a| depends[a as usize]),
        };
    }

    // Which reductions need tie counts: float max/min ones that carry a gradient.
    let red_vals = reductions(program);
    let tie_of: Vec<Option<usize>> = {
        let mut t = 0;
        red_vals
            .iter()
            .map(|&v| match program.code()[v as usize] {
                Instr::Reduce(Combine::Max | Combine::Min, a)
                    if program.dtype(a).is_float() && depends[v as usize] =>
                {
                    t += 1;
                    Some(t - 1)
                }
                _ => None,
            })
            .collect()
    };
    let t_count = tie_of.iter().flatten().count();

    // The tie-count program.
    let ties = if t_count > 0 {
        let mut em = Emitter::default();
        let (_, reds) = rewrite(program, &mut em, n as u32);
        let mut outs = Vec::new();
        for (r, &(_, mapped, rv)) in reds.iter().enumerate() {
            if tie_of[r].is_some() {
                let dt = program.dtype(red_vals[r]);
                let eq = em.emit(Instr::Cmp(CmpOp::Eq, mapped, rv));
                let m = em.emit(Instr::Cast(dt, eq));
                outs.push(em.emit(Instr::Reduce(Combine::Sum, m)));
            }
        }
        let (code, outs) = compact(&em.code, &outs);
        let mut inputs = program.inputs().to_vec();
        inputs.extend(red_vals.iter().map(|&v| program.dtype(v)));
        Some(Program::new(
            inputs,
            program.params().to_vec(),
            code,
            outs,
            program.axes().to_vec(),
        )?)
    } else {
        None
    };

    // The backward program.
    let mut em = Emitter::default();
    let (map, reds) = rewrite(program, &mut em, n as u32);
    let mut dtypes = vec![DType::F32; em.code.len()];
    for (i, &m) in map.iter().enumerate() {
        dtypes[m as usize] = program.dtypes()[i];
    }
    let mut ndep = vec![false; em.code.len()];
    for (i, &m) in map.iter().enumerate() {
        ndep[m as usize] |= depends[i];
    }
    let first_tie = (n + r_count) as u32;
    let g_input = first_tie + t_count as u32;
    let mut fphase = vec![Phase::Uniform; em.code.len()];
    for (i, &m) in map.iter().enumerate() {
        fphase[m as usize] = program.phases()[i];
    }
    let count_param = program.params().len() as u32;
    let mut a = Adj {
        em: &mut em,
        dtypes,
        fphase,
        count_param,
    };
    let g = a.emit(Instr::Input(g_input), gdt);
    let forward_len = map.iter().map(|&m| m as usize + 1).max().unwrap_or(0);
    let mut adj: HashMap<Val, Val> = HashMap::new();
    adj.insert(map[out as usize], g);
    // The reduction that an input value stands for.
    let red_at: HashMap<Val, usize> = reds
        .iter()
        .enumerate()
        .map(|(r, &(_, _, rv))| (rv, r))
        .collect();
    let fwd_dt = a.dtypes.clone();
    let dep = |x: Val| ndep[x as usize] && fwd_dt[x as usize].is_float();
    for v in (0..forward_len as Val).rev() {
        let Some(&g) = adj.get(&v) else { continue };
        if !ndep[v as usize] {
            continue;
        }
        let ins = a.em.code[v as usize];
        let dt = a.dt(v);
        match ins {
            Instr::Input(_) => {
                if let Some(&r) = red_at.get(&v) {
                    let (c, mapped, rv) = reds[r];
                    if !dep(mapped) {
                        continue;
                    }
                    let d = match c {
                        Combine::Sum => g,
                        Combine::Max | Combine::Min => {
                            let t = a.emit(
                                Instr::Input(first_tie + tie_of[r].expect("counted") as u32),
                                dt,
                            );
                            let m = a.mask(CmpOp::Eq, mapped, rv, dt);
                            let share = a.bin(BinaryOp::Div, g, t);
                            a.mul(share, m)
                        }
                        Combine::Prod => unreachable!("rejected above"),
                    };
                    add_raw(&mut a, &mut adj, mapped, d);
                }
            }
            Instr::Param(_) | Instr::Const(_) | Instr::Cmp(..) => {}
            Instr::Unary(op, x) => {
                if !dep(x) {
                    continue;
                }
                // The op table's rule, spliced in with the saved operand and `g`.
                let saved = match op.grad_reads() {
                    Some(GradFrom::Output) => v,
                    _ => x,
                };
                if let Some(rule) = unary_vjp_program(op, dt)? {
                    let d = splice(&rule, &[saved, g], |ins, dt| a.emit(ins, dt))[0];
                    add_to(&mut a, &mut adj, v, x, d);
                }
            }
            Instr::Binary(op, x, z) => {
                let (dx, dz) = (dep(x), dep(z));
                let zero = a.c(0.0, dt);
                let (gx, gz) = match op {
                    BinaryOp::Add => (g, g),
                    BinaryOp::Sub => (g, a.un(UnaryOp::Neg, g)),
                    BinaryOp::Mul => (a.mul(g, z), a.mul(g, x)),
                    BinaryOp::Div => {
                        let gx = a.bin(BinaryOp::Div, g, z);
                        // d/dz x/z = -y/z
                        let q = a.bin(BinaryOp::Div, v, z);
                        let p = a.mul(g, q);
                        (gx, a.un(UnaryOp::Neg, p))
                    }
                    BinaryOp::Pow => {
                        // to x: g * z * x^(z-1), 0 where z == 0
                        let one = a.c(1.0, dt);
                        let zm1 = a.bin(BinaryOp::Sub, z, one);
                        let pw = a.bin(BinaryOp::Pow, x, zm1);
                        let t = a.mul(z, pw);
                        let t = a.mul(g, t);
                        let z0 = a.cmp(CmpOp::Eq, z, zero);
                        let gx = a.select(z0, zero, t);
                        // to z: g * y * log(x), 0 where x == 0 and z >= 0
                        let l = a.un(UnaryOp::Log, x);
                        let t = a.mul(v, l);
                        let t = a.mul(g, t);
                        let x0 = a.cmp(CmpOp::Eq, x, zero);
                        let zp = a.cmp(CmpOp::Ge, z, zero);
                        let both = a.emit(Instr::Binary(BinaryOp::Minimum, x0, zp), DType::U8);
                        (gx, a.select(both, zero, t))
                    }
                    BinaryOp::Maximum | BinaryOp::Minimum => {
                        let (win, tie_ok) = if op == BinaryOp::Maximum {
                            (CmpOp::Gt, CmpOp::Ge)
                        } else {
                            (CmpOp::Lt, CmpOp::Le)
                        };
                        if dx && dz {
                            let eq = a.mask(CmpOp::Eq, x, z, dt);
                            let half = a.mulc(eq, 0.5);
                            let wx = a.mask(win, x, z, dt);
                            let wz = a.mask(win, z, x, dt);
                            let fx = a.bin(BinaryOp::Add, wx, half);
                            let fz = a.bin(BinaryOp::Add, wz, half);
                            (a.mul(g, fx), a.mul(g, fz))
                        } else {
                            // clamp: the differentiated side passes where it is the result,
                            // ties included
                            let fx = a.mask(tie_ok, x, z, dt);
                            let fz = a.mask(tie_ok, z, x, dt);
                            (a.mul(g, fx), a.mul(g, fz))
                        }
                    }
                };
                if dx {
                    add_to(&mut a, &mut adj, v, x, gx);
                }
                if dz {
                    add_to(&mut a, &mut adj, v, z, gz);
                }
            }
            Instr::Where(c, x, z) => {
                let zero = a.c(0.0, dt);
                if dep(x) {
                    let d = a.select(c, g, zero);
                    add_to(&mut a, &mut adj, v, x, d);
                }
                if dep(z) {
                    let d = a.select(c, zero, g);
                    add_to(&mut a, &mut adj, v, z, d);
                }
            }
            Instr::Cast(_, x) => {
                if dep(x) && dt.is_float() {
                    let from = a.dt(x);
                    let d = a.emit(Instr::Cast(from, g), from);
                    add_to(&mut a, &mut adj, v, x, d);
                }
            }
            Instr::Reduce(..) => unreachable!("rewritten as inputs"),
        }
    }
    let mut outs = Vec::with_capacity(wrt.len());
    for &k in wrt {
        let iv = a.em.code.iter().position(|i| *i == Instr::Input(k as u32));
        let d = iv.and_then(|iv| adj.get(&(iv as Val)).copied());
        outs.push(match d {
            Some(d) => d,
            None => a.c(0.0, program.inputs()[k]),
        });
    }
    let (code, outs) = compact(&a.em.code, &outs);
    let mut inputs = program.inputs().to_vec();
    inputs.extend(red_vals.iter().map(|&v| program.dtype(v)));
    for (r, t) in tie_of.iter().enumerate() {
        if t.is_some() {
            inputs.push(program.dtype(red_vals[r]));
        }
    }
    inputs.push(gdt);
    let mut params = program.params().to_vec();
    if program.reduces() {
        params.push(DType::F64);
    }
    let backward = Program::new(inputs, params, code, outs, vec![])?;
    Ok(Gradient {
        reductions: r_count,
        ties,
        backward,
    })
}

/// `adj[v] += d`, for a contribution from value `from`. A post-map value (kept shape) that
/// reads a per-element value is evaluated once per kept element, but the backward program runs
/// per element of the iteration: its contribution is divided by the number of elements each
/// reduction folds (the backward's last parameter), so that summing the gradient back to the
/// input's shape counts it once.
fn add_to(a: &mut Adj<'_>, adj: &mut HashMap<Val, Val>, from: Val, v: Val, d: Val) {
    let d = if a.fphase.get(from as usize) == Some(&Phase::Reduced)
        && a.fphase.get(v as usize) == Some(&Phase::Elem)
    {
        let dt = a.dt(d);
        let r = a.emit(Instr::Param(a.count_param), DType::F64);
        let r = if dt == DType::F64 {
            r
        } else {
            a.emit(Instr::Cast(dt, r), dt)
        };
        a.bin(BinaryOp::Div, d, r)
    } else {
        d
    };
    add_raw(a, adj, v, d)
}

/// `adj[v] += d`.
fn add_raw(a: &mut Adj<'_>, adj: &mut HashMap<Val, Val>, v: Val, d: Val) {
    let new = match adj.get(&v) {
        Some(&prev) => a.bin(BinaryOp::Add, prev, d),
        None => d,
    };
    adj.insert(v, new);
}
