//! [`Program::widened`]: a program's 16-bit arithmetic rewritten as f32 arithmetic, rounded to
//! 16 bits where a value leaves the program.
//!
//! f16 and bf16 are storage types: a kernel loads them, computes in f32 and rounds the result
//! to 16 bits on store. For a program that means: every instruction of a 16-bit dtype becomes
//! the same instruction on f32 operands, and its f32 value is what later instructions read;
//! a value is rounded to its 16-bit type only where it is stored (an output) or where the
//! program itself casts to a 16-bit type (a user's `to_dtype(bf16)` rounds, as it must). An
//! op run alone rounds once, as PyTorch's eager kernels do; a fused chain keeps its
//! intermediates in f32, as `torch.compile`'s generated kernels do: at least as accurate as
//! rounding after every op, and no rounding instructions per op and element in a chain's
//! kernel (on an H100 a six-op bf16 chain then runs at 0.97x copy bandwidth). So a fused 16-bit result
//! may differ from the op-by-op one in its last bits, as fused f32 results already may
//! (contracted multiply-adds). An evaluator of the widened program needs, for the 16-bit
//! types, only their loads (inputs), their stores (outputs) and two casts: any dtype to a
//! 16-bit one, and a 16-bit one to f32.
//!
//! Scalars (parameters and constants) of a 16-bit dtype become f32 (a parameter's value, or a
//! constant, rounded to f32, not to 16 bits): as PyTorch's `half_tensor * 0.1` multiplies by
//! the f32 value of 0.1 in its f32 "opmath" and rounds once.

use super::build::Emitter;
use super::program::{Instr, Program, Scalar, Val};
use crate::{DType, Result};

impl Program {
    /// Whether any input, parameter or value is f16 or bf16.
    pub fn has_half(&self) -> bool {
        self.dtypes()
            .iter()
            .chain(self.inputs())
            .chain(self.params())
            .any(|d| d.is_half())
    }

    /// The program with its 16-bit arithmetic done in f32 and rounded where values leave it
    /// (see the module docs): the same inputs and outputs (dtypes included), parameters of a
    /// 16-bit dtype typed f32, and no
    /// instruction of a 16-bit dtype but inputs and casts (to a 16-bit type from any dtype, and
    /// from a 16-bit type to f32). A program without 16-bit values comes back unchanged.
    pub fn widened(&self) -> Result<Program> {
        if !self.has_half() {
            return Ok(self.clone());
        }
        let mut w = Widen {
            em: Emitter::default(),
            wide: Vec::with_capacity(self.code().len()),
            narrow: Vec::with_capacity(self.code().len()),
        };
        for (i, &ins) in self.code().iter().enumerate() {
            let d = self.dtype(i as Val);
            let (wide, narrow) = w.instr(ins, d);
            w.wide.push(wide);
            w.narrow.push(narrow);
        }
        let outputs = self
            .outputs()
            .iter()
            .map(|&o| w.narrow(o, self.dtype(o)))
            .collect();
        let params = self.params().iter().map(|d| d.compute_dtype()).collect();
        Program::new(
            self.inputs().to_vec(),
            params,
            w.em.code,
            outputs,
            self.axes().to_vec(),
        )
    }
}

struct Widen {
    em: Emitter,
    /// Each original value in its compute dtype (f32 for a 16-bit value, else itself).
    wide: Vec<Val>,
    /// Each original value in its own dtype, where already emitted (`None`: a 16-bit scalar
    /// whose 16-bit form nothing has needed yet).
    narrow: Vec<Option<Val>>,
}

impl Widen {
    /// Original value `v` (of dtype `d`) in its own dtype, emitting the rounding cast once.
    fn narrow(&mut self, v: Val, d: DType) -> Val {
        if let Some(n) = self.narrow[v as usize] {
            return n;
        }
        let n = self.em.emit(Instr::Cast(d, self.wide[v as usize]));
        self.narrow[v as usize] = Some(n);
        n
    }

    /// The widened form of one instruction of dtype `d`: (its value in the compute dtype, its
    /// value in `d` if emitted).
    fn instr(&mut self, ins: Instr, d: DType) -> (Val, Option<Val>) {
        let w = |v: Val| self.wide[v as usize];
        match ins {
            Instr::Input(_) if d.is_half() => {
                let n = self.em.emit(ins);
                (self.em.emit(Instr::Cast(DType::F32, n)), Some(n))
            }
            Instr::Param(_) if d.is_half() => (self.em.emit(ins), None),
            Instr::Const(s) if d.is_half() => {
                let c = Scalar::new(s.to_f64(), DType::F32);
                (self.em.emit(Instr::Const(c)), None)
            }
            Instr::Input(_) | Instr::Param(_) | Instr::Const(_) => {
                let v = self.em.emit(ins);
                (v, Some(v))
            }
            // A cast reads its operand at full precision: a 16-bit operand's f32 value is exact.
            Instr::Cast(to, a) if to.is_half() => {
                let n = self.em.emit(Instr::Cast(to, w(a)));
                (self.em.emit(Instr::Cast(DType::F32, n)), Some(n))
            }
            _ => {
                let v = self.em.emit(ins.map_operands(w));
                if !d.is_half() {
                    return (v, Some(v));
                }
                // The op ran in f32 (its operands are the wide values): later instructions read
                // that f32 value; it is rounded only if stored (`narrow`, on demand).
                (v, None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{BinaryOp, UnaryOp};

    #[test]
    fn half_arithmetic_runs_in_f32_and_rounds_where_stored() {
        let code = vec![
            Instr::Input(0),
            Instr::Param(0),
            Instr::Binary(BinaryOp::Mul, 0, 1),
            Instr::Unary(UnaryOp::Exp, 2),
            Instr::Cast(DType::F64, 3),
        ];
        let p = Program::new(vec![DType::F16], vec![DType::F16], code, vec![3, 4], vec![]).unwrap();
        let w = p.widened().unwrap();
        assert_eq!(w.inputs(), &[DType::F16]);
        assert_eq!(w.params(), &[DType::F32]);
        assert_eq!(w.output_dtypes(), vec![DType::F16, DType::F64]);
        for (i, ins) in w.code().iter().enumerate() {
            let d = w.dtype(i as Val);
            match ins {
                Instr::Input(_) => {}
                Instr::Cast(to, a) if to.is_half() || w.dtype(*a).is_half() => {
                    assert!(to.is_half() || *to == DType::F32, "{w}");
                }
                _ => assert!(!d.is_half(), "%{i} of {d} in\n{w}"),
            }
        }
        // One rounding: the stored exp; the product is read by exp in f32, unrounded.
        let roundings = |w: &Program, d: DType| {
            w.code()
                .iter()
                .filter(|i| matches!(i, Instr::Cast(to, _) if *to == d))
                .count()
        };
        assert_eq!(roundings(&w, DType::F16), 1, "{w}");
        // A cast the program itself makes still rounds, where it stands.
        let code = vec![
            Instr::Input(0),
            Instr::Unary(UnaryOp::Exp, 0),
            Instr::Cast(DType::BF16, 1),
            Instr::Unary(UnaryOp::Exp, 2),
        ];
        let p = Program::new(vec![DType::F16], vec![], code, vec![3], vec![]).unwrap();
        let w = p.widened().unwrap();
        assert_eq!(
            roundings(&w, DType::BF16),
            2,
            "the cast and the stored result:\n{w}"
        );
        assert_eq!(roundings(&w, DType::F16), 0, "{w}");
        let f32_prog = Program::new(
            vec![DType::F32],
            vec![],
            vec![Instr::Input(0), Instr::Unary(UnaryOp::Exp, 0)],
            vec![1],
            vec![],
        )
        .unwrap();
        assert_eq!(f32_prog.widened().unwrap(), f32_prog);
    }
}
