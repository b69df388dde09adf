//! The program form of an expression: a typed SSA list of instructions, validated once.
//!
//! A [`Program`] is plain data (`Clone + Eq + Hash`): a backend keys its compiled kernels by it.
//! It fixes the inputs' dtypes, the parameters' dtypes, the instructions, the outputs and the
//! reduction axes, but no shape: one program runs on inputs of any (common) shape.

use std::fmt;

use crate::error::ExprErrorKind;
use crate::fasthash::{FNV64_OFFSET, mix_word};
pub use crate::op::Combine;
use crate::op::{BinaryOp, CmpOp, UnaryOp};
use crate::{DType, Error, Result, Shape};

/// A value of a program: the index of the instruction that defines it.
pub type Val = u32;

pub(crate) fn expr_err(op: &'static str, kind: ExprErrorKind, msg: impl Into<String>) -> Error {
    Error::Expr {
        op,
        kind,
        msg: msg.into(),
    }
}

/// A typed constant, held exactly (compared and hashed by its bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Scalar {
    dtype: DType,
    /// f32/f64: the `f64` bits of the (rounded) value; f16/bf16: the `f64` bits of the value
    /// rounded to f32, the type their arithmetic runs in (see `Program::widened`); i64: the
    /// value's two's complement; u8: the value.
    bits: u64,
}

impl Scalar {
    /// `value` converted to `dtype` with an `as` cast (what `binary_scalar` does).
    pub fn new(value: f64, dtype: DType) -> Scalar {
        let bits = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => ((value as f32) as f64).to_bits(),
            DType::I64 => (value as i64) as u64,
            DType::U8 => (value as u8) as u64,
            _ => value.to_bits(),
        };
        Scalar { dtype, bits }
    }
    pub fn dtype(self) -> DType {
        self.dtype
    }
    /// The value widened to f64 (exact but for i64 beyond 2^53).
    pub fn to_f64(self) -> f64 {
        match self.dtype {
            DType::I64 => self.bits as i64 as f64,
            DType::U8 => self.bits as f64,
            _ => f64::from_bits(self.bits),
        }
    }
    /// The raw bits (see the field docs): what a code generator prints as a literal.
    pub fn bits(self) -> u64 {
        self.bits
    }
}

/// One instruction; it defines the value with its own index. Operands are earlier values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Instr {
    /// Tensor input `k`, read at the current element.
    Input(u32),
    /// Scalar parameter `k` (a kernel argument: changing its value reuses the kernel).
    Param(u32),
    /// A constant (part of the program: a code generator may print it as a literal).
    Const(Scalar),
    Unary(UnaryOp, Val),
    Binary(BinaryOp, Val, Val),
    /// A comparison; the value is `u8` 0/1.
    Cmp(CmpOp, Val, Val),
    /// `cond != 0 ? a : b` with a `u8` condition.
    Where(Val, Val, Val),
    /// Rust `as` to the dtype.
    Cast(DType, Val),
    /// Folds an elementwise value over the program's reduction axes.
    Reduce(Combine, Val),
}

impl Instr {
    /// The op's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Instr::Input(_) => "input",
            Instr::Param(_) => "param",
            Instr::Const(_) => "const",
            Instr::Unary(op, _) => op.name(),
            Instr::Binary(op, _, _) => op.name(),
            Instr::Cmp(op, _, _) => op.name(),
            Instr::Where(..) => "where",
            Instr::Cast(..) => "cast",
            Instr::Reduce(c, _) => c.name(),
        }
    }

    /// The instruction with each operand `o` replaced by `f(o)`.
    pub fn map_operands(self, mut f: impl FnMut(Val) -> Val) -> Instr {
        match self {
            Instr::Input(_) | Instr::Param(_) | Instr::Const(_) => self,
            Instr::Unary(op, a) => Instr::Unary(op, f(a)),
            Instr::Cast(d, a) => Instr::Cast(d, f(a)),
            Instr::Reduce(c, a) => Instr::Reduce(c, f(a)),
            Instr::Binary(op, a, b) => Instr::Binary(op, f(a), f(b)),
            Instr::Cmp(op, a, b) => Instr::Cmp(op, f(a), f(b)),
            Instr::Where(c, a, b) => Instr::Where(f(c), f(a), f(b)),
        }
    }

    /// The values the instruction reads (no allocation: validation and the code generators
    /// call this per instruction on hot paths).
    pub fn operands(&self) -> Operands {
        let (vals, len) = match *self {
            Instr::Input(_) | Instr::Param(_) | Instr::Const(_) => ([0; 3], 0),
            Instr::Unary(_, a) | Instr::Cast(_, a) | Instr::Reduce(_, a) => ([a, 0, 0], 1),
            Instr::Binary(_, a, b) | Instr::Cmp(_, a, b) => ([a, b, 0], 2),
            Instr::Where(c, a, b) => ([c, a, b], 3),
        };
        Operands { vals, len }
    }
}

/// The operands of an [`Instr`] (at most three): a slice, and an iterator of values.
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    vals: [Val; 3],
    len: usize,
}

impl std::ops::Deref for Operands {
    type Target = [Val];
    fn deref(&self) -> &[Val] {
        &self.vals[..self.len]
    }
}

impl IntoIterator for Operands {
    type Item = Val;
    type IntoIter = std::iter::Take<std::array::IntoIter<Val, 3>>;
    fn into_iter(self) -> Self::IntoIter {
        self.vals.into_iter().take(self.len)
    }
}

impl std::hash::Hash for Program {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.fingerprint as u64);
    }
}

/// A 128-bit digest of a program's defining fields (what [`Program::new`] takes): two
/// independent multiply-xor lanes over the same words, each instruction packed into two
/// words. Equal programs have equal fingerprints; a caller that memoizes work per program can
/// look it up by the parts, before building (and validating) the program again, and take
/// equal fingerprints for equal programs (comparing the parts instead was 3 % of a small
/// training step's host time, measured against a stand-in driver).
pub fn fingerprint(
    inputs: &[DType],
    params: &[DType],
    code: &[Instr],
    outputs: &[Val],
    axes: &[isize],
) -> u128 {
    let (mut h, mut g) = (FNV64_OFFSET, 0x9e37_79b9_7f4a_7c15u64);
    let mut mix = |w: u64| {
        h = mix_word(h, w);
        g = (g ^ w.rotate_left(17))
            .wrapping_mul(0xff51_afd7_ed55_8ccd)
            .rotate_left(31);
    };
    mix(inputs.len() as u64 | (params.len() as u64) << 32);
    for &d in inputs.iter().chain(params) {
        mix(d as u64);
    }
    for ins in code {
        let (tag, op, extra) = match *ins {
            Instr::Input(_) => (0u64, 0u64, 0u64),
            Instr::Param(_) => (1, 0, 0),
            Instr::Const(c) => (2, c.dtype() as u64, c.bits()),
            Instr::Unary(u, _) => (3, u as u64, 0),
            Instr::Binary(b, _, _) => (4, b as u64, 0),
            Instr::Cmp(c, _, _) => (5, c as u64, 0),
            Instr::Where(..) => (6, 0, 0),
            Instr::Cast(d, _) => (7, d as u64, 0),
            Instr::Reduce(c, _) => (8, c as u64, 0),
        };
        let k = match *ins {
            Instr::Input(k) | Instr::Param(k) => k as u64,
            _ => 0,
        };
        let ops = ins.operands();
        let at = |j: usize| ops.get(j).copied().unwrap_or(0) as u64;
        mix(tag | op << 8 | k << 32);
        mix(extra ^ (at(0) | at(1) << 21 | at(2) << 42));
    }
    for &o in outputs {
        mix(o as u64 | 1 << 63);
    }
    for &a in axes {
        mix(a as u64 ^ 1 << 62);
    }
    (h as u128) << 64 | g as u128
}

/// Where a value lives in the iteration: the same for every element, per element of the
/// iteration shape, or per element of the reduced (kept) shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Constants, parameters and what is computed from them only.
    Uniform,
    /// Per element of the iteration shape (the inputs' broadcast shape).
    Elem,
    /// Per element of the kept shape (the iteration shape with the reduction axes set to 1):
    /// the results of reductions and what is computed from them (the post-map). A per-element
    /// value that the post-map reads is read at the kept position; the inputs it comes from
    /// must not vary along the reduced axes ([`Program::post_inputs`], checked at each call).
    Reduced,
}

/// A validated expression program (see the `kiln_core::expr` module docs).
///
/// Hashing reads only a fingerprint of the program computed once by [`Program::new`], and
/// equality compares it first: backends look their kernels up by program on every launch, and
/// the derived hash of every field cost a recorded chain's lookup more than the rest of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    /// A function of the fields below (so equal programs have equal fingerprints).
    fingerprint: u128,
    inputs: Vec<DType>,
    params: Vec<DType>,
    code: Vec<Instr>,
    outputs: Vec<Val>,
    axes: Vec<isize>,
    // Derived from the above (so `Eq`/`Hash` stay consistent).
    dtypes: Vec<DType>,
    phases: Vec<Phase>,
    post_inputs: Vec<u32>,
}

impl Program {
    /// Validates and builds a program.
    ///
    /// - `inputs`, `params`: the dtypes of the tensor inputs and scalar parameters;
    /// - `code`: the instructions, each reading only earlier values;
    /// - `outputs`: the values returned, in order (at least one; repeats allowed);
    /// - `axes`: the reduction axes of every [`Instr::Reduce`] (negative counts from the end;
    ///   resolved against the iteration shape's rank at evaluation); empty when nothing reduces.
    pub fn new(
        inputs: Vec<DType>,
        params: Vec<DType>,
        code: Vec<Instr>,
        outputs: Vec<Val>,
        axes: Vec<isize>,
    ) -> Result<Program> {
        if code.is_empty() || outputs.is_empty() {
            return Err(expr_err(
                "expr",
                ExprErrorKind::Structure,
                "a program needs at least one instruction and one output",
            ));
        }
        let mut dtypes: Vec<DType> = Vec::with_capacity(code.len());
        let mut phases: Vec<Phase> = Vec::with_capacity(code.len());
        for (i, ins) in code.iter().enumerate() {
            check_defined(i, ins)?;
            dtypes.push(value_dtype(i, ins, &inputs, &params, &dtypes)?);
            phases.push(value_phase(i, ins, &phases)?);
        }
        let reduces = code.iter().any(|ins| matches!(ins, Instr::Reduce(..)));
        check_outputs_and_axes(code.len(), &outputs, &axes, reduces)?;
        let post_inputs = post_inputs(&code, &phases);
        Ok(Program {
            fingerprint: fingerprint(&inputs, &params, &code, &outputs, &axes),
            inputs,
            params,
            code,
            outputs,
            axes,
            dtypes,
            phases,
            post_inputs,
        })
    }

    /// [`fingerprint`] of the program's parts, computed once.
    pub fn fingerprint(&self) -> u128 {
        self.fingerprint
    }
    /// The dtypes of the tensor inputs.
    pub fn inputs(&self) -> &[DType] {
        &self.inputs
    }
    /// The dtypes of the scalar parameters.
    /// Whether the program reads input `k` at all.
    pub fn reads(&self, k: usize) -> bool {
        self.code.contains(&Instr::Input(k as u32))
    }
    pub fn params(&self) -> &[DType] {
        &self.params
    }
    pub fn code(&self) -> &[Instr] {
        &self.code
    }
    pub fn outputs(&self) -> &[Val] {
        &self.outputs
    }
    /// The reduction axes as given (empty when nothing reduces).
    pub fn axes(&self) -> &[isize] {
        &self.axes
    }
    /// The dtype of every value.
    pub fn dtypes(&self) -> &[DType] {
        &self.dtypes
    }
    pub fn dtype(&self, v: Val) -> DType {
        self.dtypes[v as usize]
    }
    /// The phase of every value.
    pub fn phases(&self) -> &[Phase] {
        &self.phases
    }
    pub fn phase(&self, v: Val) -> Phase {
        self.phases[v as usize]
    }
    /// The inputs that the post-map reads directly (not through a reduction): at each call
    /// they must be constant along the reduced axes (broadcast, stride 0, or of size 1 there),
    /// and are read at the kept position.
    pub fn post_inputs(&self) -> &[u32] {
        &self.post_inputs
    }
    /// Whether any instruction reduces.
    pub fn reduces(&self) -> bool {
        !self.axes.is_empty()
    }
    /// The dtypes of the outputs.
    pub fn output_dtypes(&self) -> Vec<DType> {
        self.outputs.iter().map(|&o| self.dtype(o)).collect()
    }
    /// Whether output `k` has the kept shape (a reduced value) rather than the iteration shape.
    pub fn output_is_reduced(&self, k: usize) -> bool {
        self.phase(self.outputs[k]) == Phase::Reduced
    }

    /// The reduction axes resolved against `shape` (sorted, distinct), or an axis error.
    pub fn resolve_axes(&self, shape: &Shape) -> Result<Vec<usize>> {
        let rank = shape.rank() as isize;
        let mut out = Vec::with_capacity(self.axes.len());
        for &a in &self.axes {
            let r = if a < 0 { a + rank } else { a };
            if r < 0 || r >= rank {
                return Err(expr_err(
                    "expr",
                    ExprErrorKind::Axis,
                    format!("reduction axis {a} is out of range for shape {shape}"),
                ));
            }
            if out.contains(&(r as usize)) {
                return Err(expr_err(
                    "expr",
                    ExprErrorKind::Axis,
                    format!("reduction axis {a} given twice (shape {shape})"),
                ));
            }
            out.push(r as usize);
        }
        out.sort_unstable();
        Ok(out)
    }

    /// The shape of every output for the iteration shape `shape`: `shape` itself, or for a
    /// reduced output `shape` with the reduction axes set to 1.
    pub fn output_shapes(&self, shape: &Shape) -> Result<Vec<Shape>> {
        let kept = self.kept_shape(shape)?;
        Ok((0..self.outputs.len())
            .map(|k| {
                if self.output_is_reduced(k) {
                    kept.clone()
                } else {
                    shape.clone()
                }
            })
            .collect())
    }

    /// `shape` with the reduction axes set to 1 (`shape` itself when nothing reduces).
    pub fn kept_shape(&self, shape: &Shape) -> Result<Shape> {
        let mut dims = shape.dims().to_vec();
        for a in self.resolve_axes(shape)? {
            dims[a] = 1;
        }
        Ok(Shape::new(dims))
    }
}

/// Checks that instruction `i` reads only values defined before it.
fn check_defined(i: usize, ins: &Instr) -> Result<()> {
    for a in ins.operands() {
        if a as usize >= i {
            return Err(expr_err(
                ins.name(),
                ExprErrorKind::Structure,
                format!("%{i} reads %{a}, which is not defined before it"),
            ));
        }
    }
    Ok(())
}

/// The dtype of instruction `i`, given those before it (`dtypes`); an error where it reads an
/// input or parameter that does not exist or operands of dtypes its op does not take.
fn value_dtype(
    i: usize,
    ins: &Instr,
    inputs: &[DType],
    params: &[DType],
    dtypes: &[DType],
) -> Result<DType> {
    use ExprErrorKind as K;
    let op = ins.name();
    let dt = |v: Val| dtypes[v as usize];
    let bad_dtype = |what: String| expr_err(op, K::DType, format!("%{i}: {what}"));
    let d = match *ins {
        Instr::Input(k) => match inputs.get(k as usize) {
            Some(&d) => d,
            None => {
                return Err(expr_err(
                    op,
                    K::Arity,
                    format!("%{i} reads input {k} of {}", inputs.len()),
                ));
            }
        },
        Instr::Param(k) => match params.get(k as usize) {
            Some(&d) => d,
            None => {
                return Err(expr_err(
                    op,
                    K::Arity,
                    format!("%{i} reads parameter {k} of {}", params.len()),
                ));
            }
        },
        Instr::Const(s) => s.dtype(),
        Instr::Unary(u, a) => {
            if !u.supports(dt(a)) {
                return Err(bad_dtype(format!(
                    "{} of {} (see UnaryOp for the dtypes each op takes)",
                    u.name(),
                    dt(a)
                )));
            }
            dt(a)
        }
        Instr::Binary(b, x, y) => {
            if dt(x) != dt(y) {
                return Err(bad_dtype(format!(
                    "operands of {} and {} (cast one first)",
                    dt(x),
                    dt(y)
                )));
            }
            if !b.supports(dt(x)) {
                return Err(bad_dtype(format!(
                    "{} of {} (see BinaryOp for the dtypes each op takes)",
                    b.name(),
                    dt(x)
                )));
            }
            dt(x)
        }
        Instr::Cmp(_, x, y) => {
            if dt(x) != dt(y) {
                return Err(bad_dtype(format!(
                    "operands of {} and {} (cast one first)",
                    dt(x),
                    dt(y)
                )));
            }
            DType::U8
        }
        Instr::Where(c, x, y) => {
            if dt(c) != DType::U8 {
                return Err(bad_dtype(format!("a condition of {}, not u8", dt(c))));
            }
            if dt(x) != dt(y) {
                return Err(bad_dtype(format!(
                    "branches of {} and {} (cast one first)",
                    dt(x),
                    dt(y)
                )));
            }
            dt(x)
        }
        Instr::Cast(to, _) => to,
        Instr::Reduce(c, a) => {
            if !c.supports(dt(a)) {
                return Err(bad_dtype(format!("{} of {}", c.name(), dt(a))));
            }
            dt(a)
        }
    };
    Ok(d)
}

/// The phase of instruction `i`, given those before it (`phases`); an error where it reduces a
/// value that is already reduced.
fn value_phase(i: usize, ins: &Instr, phases: &[Phase]) -> Result<Phase> {
    let ph = |v: Val| phases[v as usize];
    if let Instr::Reduce(_, a) = *ins {
        if ph(a) == Phase::Reduced {
            return Err(expr_err(
                ins.name(),
                ExprErrorKind::Phase,
                format!("%{i} reduces %{a}, which is already reduced"),
            ));
        }
        return Ok(Phase::Reduced);
    }
    let mut p = match ins {
        Instr::Input(_) => Phase::Elem,
        _ => Phase::Uniform,
    };
    for v in ins.operands() {
        p = match (p, ph(v)) {
            (Phase::Uniform, q) | (q, Phase::Uniform) => q,
            // A per-element value read after the reduction is read at the kept position (see
            // `Program::post_inputs`).
            (Phase::Elem, Phase::Reduced) | (Phase::Reduced, Phase::Elem) => Phase::Reduced,
            (a, _) => a,
        }
    }
    Ok(p)
}

/// Checks that every output is a value of the program, and that it names reduction axes if and
/// only if it reduces.
fn check_outputs_and_axes(
    code_len: usize,
    outputs: &[Val],
    axes: &[isize],
    reduces: bool,
) -> Result<()> {
    use ExprErrorKind as K;
    for &o in outputs {
        if o as usize >= code_len {
            return Err(expr_err(
                "expr",
                K::Structure,
                format!("output %{o} of a program of {code_len} instructions"),
            ));
        }
    }
    if reduces && axes.is_empty() {
        return Err(expr_err(
            "expr",
            K::Axis,
            "the program reduces but names no reduction axes",
        ));
    }
    if !reduces && !axes.is_empty() {
        return Err(expr_err(
            "expr",
            K::Structure,
            format!("reduction axes {axes:?} given to a program that does not reduce"),
        ));
    }
    Ok(())
}

/// The inputs the post-map reads other than through a reduction ([`Program::post_inputs`]),
/// sorted, without repeats.
fn post_inputs(code: &[Instr], phases: &[Phase]) -> Vec<u32> {
    let mut post = vec![false; code.len()];
    for (i, ins) in code.iter().enumerate().rev() {
        if phases[i] == Phase::Reduced && !matches!(ins, Instr::Reduce(..)) {
            post[i] = true;
        }
        if post[i] && !matches!(ins, Instr::Reduce(..)) {
            for a in ins.operands() {
                post[a as usize] = true;
            }
        }
    }
    let mut post_inputs: Vec<u32> = code
        .iter()
        .zip(&post)
        .filter_map(|(ins, &p)| match ins {
            Instr::Input(k) if p => Some(*k),
            _ => None,
        })
        .collect();
    post_inputs.sort_unstable();
    post_inputs.dedup();
    post_inputs
}

impl fmt::Display for Program {
    /// One line per instruction, `%3 = mul %1 %2 : f32`, then the outputs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, ins) in self.code.iter().enumerate() {
            write!(f, "%{i} = ")?;
            match *ins {
                Instr::Input(k) => write!(f, "input {k}")?,
                Instr::Param(k) => write!(f, "param {k}")?,
                Instr::Const(s) => write!(f, "const {}", s.to_f64())?,
                Instr::Cast(to, a) => write!(f, "cast %{a} to {to}")?,
                _ => {
                    write!(f, "{}", ins.name())?;
                    for a in ins.operands() {
                        write!(f, " %{a}")?;
                    }
                }
            }
            writeln!(f, " : {}", self.dtypes[i])?;
        }
        write!(f, "outputs")?;
        for o in &self.outputs {
            write!(f, " %{o}")?;
        }
        if !self.axes.is_empty() {
            write!(f, " (reducing axes {:?})", self.axes)?;
        }
        Ok(())
    }
}
