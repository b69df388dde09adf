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
use super::rules::{binary_vjp_program, splice, unary_vjp_program};
use crate::error::ExprErrorKind;
use crate::op::{BinaryOp, CmpOp, GradFrom, Side};
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
    fn bin(&mut self, op: BinaryOp, a: Val, b: Val) -> Val {
        let dt = self.dt(a);
        self.emit(Instr::Binary(op, a, b), dt)
    }
    fn mul(&mut self, a: Val, b: Val) -> Val {
        self.bin(BinaryOp::Mul, a, b)
    }
    /// `cmp(a, b)` as a 0/1 value of `dt`.
    fn mask(&mut self, op: CmpOp, a: Val, b: Val, dt: DType) -> Val {
        let m = self.emit(Instr::Cmp(op, a, b), DType::U8);
        self.emit(Instr::Cast(dt, m), dt)
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
    let (out, gdt) = check_request(program, output, wrt)?;
    let plan = Plan::new(program, wrt);
    let ties = ties_program(program, &plan)?;
    let mut em = Emitter::default();
    let (mut sweep, forward_len) = Sweep::prepare(program, &plan, &mut em, out, gdt);
    sweep.run(forward_len)?;
    let backward = sweep.finish(program, &plan, wrt, gdt)?;
    Ok(Gradient {
        reductions: plan.red_vals.len(),
        ties,
        backward,
    })
}

/// Checks that output `output` and the inputs `wrt` exist and are floats, and that the program
/// has no `prod` reduction. Returns the output's value and dtype.
fn check_request(program: &Program, output: usize, wrt: &[usize]) -> Result<(Val, DType)> {
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
    Ok((out, gdt))
}

/// What the backward needs to know of the forward before it emits anything.
struct Plan {
    /// Which forward values depend on a differentiated input (through reductions too).
    depends: Vec<bool>,
    /// The forward's reductions (see [`reductions`]).
    red_vals: Vec<Val>,
    /// Per reduction, the index of its tie count: float max/min ones that carry a gradient.
    tie_of: Vec<Option<usize>>,
    /// The number of tie counts.
    t_count: usize,
}

impl Plan {
    fn new(program: &Program, wrt: &[usize]) -> Plan {
        let mut depends = vec![false; program.code().len()];
        for (i, ins) in program.code().iter().enumerate() {
            depends[i] = match *ins {
                Instr::Input(k) => wrt.contains(&(k as usize)),
                _ => ins.operands().iter().any(|&a| depends[a as usize]),
            };
        }
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
        Plan {
            depends,
            red_vals,
            tie_of,
            t_count,
        }
    }
}

/// The tie-count program ([`Gradient::ties`]), if any reduction needs one.
fn ties_program(program: &Program, plan: &Plan) -> Result<Option<Program>> {
    if plan.t_count == 0 {
        return Ok(None);
    }
    let n = program.inputs().len();
    let mut em = Emitter::default();
    let (_, reds) = rewrite(program, &mut em, n as u32);
    let mut outs = Vec::new();
    for (r, &(_, mapped, rv)) in reds.iter().enumerate() {
        if plan.tie_of[r].is_some() {
            let dt = program.dtype(plan.red_vals[r]);
            let eq = em.emit(Instr::Cmp(CmpOp::Eq, mapped, rv));
            let m = em.emit(Instr::Cast(dt, eq));
            outs.push(em.emit(Instr::Reduce(Combine::Sum, m)));
        }
    }
    let (code, outs) = compact(&em.code, &outs);
    let mut inputs = program.inputs().to_vec();
    inputs.extend(plan.red_vals.iter().map(|&v| program.dtype(v)));
    Ok(Some(Program::new(
        inputs,
        program.params().to_vec(),
        code,
        outs,
        program.axes().to_vec(),
    )?))
}

/// The backward program while it is emitted: the adjoint arithmetic, the adjoints found so far,
/// and what the forward says of each of its (rewritten) values.
struct Sweep<'a> {
    a: Adj<'a>,
    /// The adjoint of each forward value reached so far.
    adj: HashMap<Val, Val>,
    /// Whether each rewritten forward value depends on a differentiated input.
    ndep: Vec<bool>,
    /// The dtype of each value emitted before the sweep.
    fwd_dt: Vec<DType>,
    /// Per reduction, `(combine, mapped value, the input standing for its result)`.
    reds: Vec<(Combine, Val, Val)>,
    /// The reduction that an input value stands for.
    red_at: HashMap<Val, usize>,
    tie_of: &'a [Option<usize>],
    /// The backward's input holding the first tie count.
    first_tie: u32,
}

impl<'a> Sweep<'a> {
    /// Emits the forward (reductions rewritten as inputs) and the cotangent input into `em`,
    /// seeds the output's adjoint with it. Returns the sweep and the forward's length in `em`.
    fn prepare(
        program: &Program,
        plan: &'a Plan,
        em: &'a mut Emitter,
        out: Val,
        gdt: DType,
    ) -> (Sweep<'a>, usize) {
        let n = program.inputs().len();
        let (map, reds) = rewrite(program, em, n as u32);
        let mut dtypes = vec![DType::F32; em.code.len()];
        for (i, &m) in map.iter().enumerate() {
            dtypes[m as usize] = program.dtypes()[i];
        }
        let mut ndep = vec![false; em.code.len()];
        for (i, &m) in map.iter().enumerate() {
            ndep[m as usize] |= plan.depends[i];
        }
        let first_tie = (n + plan.red_vals.len()) as u32;
        let g_input = first_tie + plan.t_count as u32;
        let mut fphase = vec![Phase::Uniform; em.code.len()];
        for (i, &m) in map.iter().enumerate() {
            fphase[m as usize] = program.phases()[i];
        }
        let count_param = program.params().len() as u32;
        let mut a = Adj {
            em,
            dtypes,
            fphase,
            count_param,
        };
        let g = a.emit(Instr::Input(g_input), gdt);
        let forward_len = map.iter().map(|&m| m as usize + 1).max().unwrap_or(0);
        let mut adj: HashMap<Val, Val> = HashMap::new();
        adj.insert(map[out as usize], g);
        let red_at: HashMap<Val, usize> = reds
            .iter()
            .enumerate()
            .map(|(r, &(_, _, rv))| (rv, r))
            .collect();
        let fwd_dt = a.dtypes.clone();
        let sweep = Sweep {
            a,
            adj,
            ndep,
            fwd_dt,
            reds,
            red_at,
            tie_of: &plan.tie_of,
            first_tie,
        };
        (sweep, forward_len)
    }

    /// Whether a gradient flows to `x`: it depends on a differentiated input and is a float.
    fn dep(&self, x: Val) -> bool {
        self.ndep[x as usize] && self.fwd_dt[x as usize].is_float()
    }

    /// The reverse sweep: every forward value with an adjoint, last first, passes it on to its
    /// operands.
    fn run(&mut self, forward_len: usize) -> Result<()> {
        for v in (0..forward_len as Val).rev() {
            let Some(&g) = self.adj.get(&v) else { continue };
            if !self.ndep[v as usize] {
                continue;
            }
            let ins = self.a.em.code[v as usize];
            let dt = self.a.dt(v);
            match ins {
                Instr::Input(_) => self.reduction_adjoint(v, g, dt),
                Instr::Param(_) | Instr::Const(_) | Instr::Cmp(..) => {}
                Instr::Unary(op, x) => {
                    if !self.dep(x) {
                        continue;
                    }
                    let a = &mut self.a;
                    // The op table's rule, spliced in with the saved operand and `g`.
                    let saved = match op.grad_reads() {
                        Some(GradFrom::Output) => v,
                        _ => x,
                    };
                    if let Some(rule) = unary_vjp_program(op, dt)? {
                        let d = splice(&rule, &[saved, g], |ins, dt| a.emit(ins, dt))[0];
                        add_to(a, &mut self.adj, v, x, d);
                    }
                }
                Instr::Binary(op, x, z) => self.binary_adjoints(op, v, x, z, g, dt)?,
                Instr::Where(c, x, z) => self.where_adjoints(c, v, x, z, g, dt),
                Instr::Cast(_, x) => self.cast_adjoint(v, x, g, dt),
                Instr::Reduce(..) => unreachable!("rewritten as inputs"),
            }
        }
        Ok(())
    }

    /// Input `v` with adjoint `g`: if it stands for a reduction, the adjoint flows to the
    /// reduction's mapped value (for max/min only to the elements equal to the result, shared
    /// among ties).
    fn reduction_adjoint(&mut self, v: Val, g: Val, dt: DType) {
        let Some(&r) = self.red_at.get(&v) else {
            return;
        };
        let (c, mapped, rv) = self.reds[r];
        if !self.dep(mapped) {
            return;
        }
        let first_tie = self.first_tie;
        let tie = self.tie_of[r];
        let a = &mut self.a;
        let d = match c {
            Combine::Sum => g,
            Combine::Max | Combine::Min => {
                let t = a.emit(Instr::Input(first_tie + tie.expect("counted") as u32), dt);
                let m = a.mask(CmpOp::Eq, mapped, rv, dt);
                let share = a.bin(BinaryOp::Div, g, t);
                a.mul(share, m)
            }
            Combine::Prod => unreachable!("rejected above"),
        };
        add_raw(a, &mut self.adj, mapped, d);
    }

    /// `v = op(x, z)` with adjoint `g`: the binary op table's rules, spliced in. An operand
    /// that is uniform (a constant or a parameter) counts as a constant, as autograd's
    /// `binary_scalar` does (`maximum(x, 0)` passes the gradient at ties).
    fn binary_adjoints(
        &mut self,
        op: BinaryOp,
        v: Val,
        x: Val,
        z: Val,
        g: Val,
        dt: DType,
    ) -> Result<()> {
        let uniform = |w: Val| self.a.fphase[w as usize] == Phase::Uniform;
        let sides = [(Side::A, x, uniform(z)), (Side::B, z, uniform(x))];
        for (side, w, other_const) in sides {
            if !self.dep(w) {
                continue;
            }
            let rule = binary_vjp_program(op, side, other_const, dt)?;
            let a = &mut self.a;
            let d = splice(&rule, &[x, z, v, g], |ins, dt| a.emit(ins, dt))[0];
            add_to(a, &mut self.adj, v, w, d);
        }
        Ok(())
    }

    /// `v = where(c, x, z)` with adjoint `g`.
    fn where_adjoints(&mut self, c: Val, v: Val, x: Val, z: Val, g: Val, dt: DType) {
        let (dx, dz) = (self.dep(x), self.dep(z));
        let a = &mut self.a;
        let zero = a.c(0.0, dt);
        if dx {
            let d = a.select(c, g, zero);
            add_to(a, &mut self.adj, v, x, d);
        }
        if dz {
            let d = a.select(c, zero, g);
            add_to(a, &mut self.adj, v, z, d);
        }
    }

    /// `v = cast(x)` with adjoint `g`: cast back to `x`'s dtype (none from a non-float `v`).
    fn cast_adjoint(&mut self, v: Val, x: Val, g: Val, dt: DType) {
        if self.dep(x) && dt.is_float() {
            let a = &mut self.a;
            let from = a.dt(x);
            let d = a.emit(Instr::Cast(from, g), from);
            add_to(a, &mut self.adj, v, x, d);
        }
    }

    /// The backward program: one output per requested input (a zero for an input the output
    /// does not depend on), dead code dropped, inputs and parameters as [`Gradient`] says.
    fn finish(self, program: &Program, plan: &Plan, wrt: &[usize], gdt: DType) -> Result<Program> {
        let Sweep { mut a, adj, .. } = self;
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
        inputs.extend(plan.red_vals.iter().map(|&v| program.dtype(v)));
        for (r, t) in plan.tie_of.iter().enumerate() {
            if t.is_some() {
                inputs.push(program.dtype(plan.red_vals[r]));
            }
        }
        inputs.push(gdt);
        let mut params = program.params().to_vec();
        if program.reduces() {
            params.push(DType::F64);
        }
        Program::new(inputs, params, code, outs, vec![])
    }
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
