//! Optimizer update rules ([`UpdateRule`]) as data, and each rule as one expression program.
//!
//! # Why programs
//!
//! An update reads a parameter, its gradient and its state once and writes the new ones: a
//! textbook fusion. Written as a [`Program`] ([`UpdateRule::program`]), it needs no
//! hand-written kernel on a backend that evaluates programs fused: the default of
//! [`Backend::fused_update`](crate::Backend::fused_update) runs it through `eval_expr`, so the
//! CPU gets a one-pass update (vectorized, parallel for large tensors) from its expression
//! evaluator, and the reference backend the same arithmetic op by op. Only a backend that can
//! do better than one evaluation per parameter (CUDA: a multi-tensor kernel over all of them)
//! overrides it. This module sits below `backend` (it needs only the IR).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::ir::{Expr, Program};
use crate::{DType, Result};

/// An optimizer update applied to many parameters at once by [`Backend::fused_update`](crate::Backend::fused_update).
///
/// The formulas are PyTorch's (`torch.optim.SGD`, `Adam`, `AdamW`, no amsgrad):
///
/// ```text
/// SGD:   g = grad + weight_decay * p
///        m = g                                  (first_step)
///        m = momentum * m + (1 - dampening) * g  (later steps)      [only when momentum != 0]
///        d = g + momentum * m if nesterov, else m (or g without momentum)
///        p = p - lr * d
/// Adam:  p = p * (1 - lr * weight_decay)         (decoupled, AdamW)
///        g = grad + weight_decay * p             (not decoupled, Adam)
///        m = beta1 * m + (1 - beta1) * g
///        v = beta2 * v + (1 - beta2) * g^2
///        p = p - lr / bias_correction1 * m / (sqrt(v) / sqrt(bias_correction2) + eps)
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UpdateRule {
    /// State: `[m]` when `momentum != 0`, else none. With `first_step`, `m` is ignored on input.
    Sgd {
        lr: f64,
        momentum: f64,
        dampening: f64,
        nesterov: bool,
        weight_decay: f64,
        first_step: bool,
    },
    /// State: `[m, v]` (zeros before the first step). `bias_correction{1,2}` are
    /// `1 - beta^t` for the step `t` being taken.
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
        bias_correction1: f64,
        bias_correction2: f64,
    },
}

impl UpdateRule {
    /// How many state buffers each parameter carries under this rule.
    pub fn state_count(&self) -> usize {
        match self {
            UpdateRule::Sgd { momentum, .. } => usize::from(*momentum != 0.0),
            UpdateRule::Adam { .. } => 2,
        }
    }
}

/// One parameter of a [`Backend::fused_update`](crate::Backend::fused_update): contiguous buffers of `len` elements.
pub struct UpdateSlot<'a, S> {
    pub param: &'a S,
    pub grad: &'a S,
    /// `rule.state_count()` buffers.
    pub state: Vec<&'a S>,
    pub len: usize,
}

impl UpdateRule {
    /// The rule as one program for parameters of `dtype`, and the values of its parameters.
    ///
    /// Inputs: `[param, grad, state...]`; outputs: `[new param, new state...]`, in the order
    /// of `state` ([`UpdateRule::state_count`]). The arithmetic is the formulas above, op for
    /// op, with every constant (`lr`, `1 - beta1`, `lr / bias_correction1`, ...) computed in
    /// f64 and converted to `dtype` once, as a scalar kernel argument would be; the flags
    /// (`nesterov`, `first_step`, `decoupled`, a zero weight decay or momentum) choose which
    /// program, so no branch runs per element.
    ///
    /// Lowering the expressions into a program is most of the cost (15 µs for Adam, a fifth of
    /// a 40-parameter multi-tensor step's host time on the GPU), so the program is lowered once
    /// per structure (the variant, its flags, and which hyperparameters are zero) and dtype
    /// and memoized. The expressions carry no values: every hyperparameter is a parameter at a
    /// fixed slot (`UpdateRule::param_values`), so a step computes those values and builds
    /// nothing else. Debug builds check the memo against a fresh lowering. The program is
    /// shared (`Arc`): a step clones no vectors.
    pub fn program(&self, dtype: DType) -> Result<(Arc<Program>, Vec<f64>)> {
        self.program_scaled(dtype, false)
    }

    /// [`UpdateRule::program`], or with `scaled` the rule applied to the gradient times a
    /// factor: one more input after the state, `scale`, a single element (a backend reads it
    /// broadcast), and every use of the gradient reads `grad * scale`, computed as the rest of
    /// the rule (in `dtype`; in f32 for the 16-bit floats, whose programs are widened): for f32
    /// the bits of a multiply stored first. Gradient clipping's coefficient rides in the
    /// update this way instead of a pass over every gradient
    /// ([`crate::Tensor::fused_update_scaled`]).
    pub fn program_scaled(&self, dtype: DType, scaled: bool) -> Result<(Arc<Program>, Vec<f64>)> {
        // The program, and the slots of `param_values` it reads, in its parameters' order.
        type Memo = HashMap<([u64; 9], bool, DType), (Arc<Program>, Vec<usize>)>;
        static MEMO: OnceLock<Mutex<Memo>> = OnceLock::new();
        let values = self.param_values();
        let inputs = vec![dtype; 2 + self.state_count() + usize::from(scaled)];
        let key = (self.structure(), scaled, dtype);
        let memo = MEMO.get_or_init(Default::default);
        let hit = memo
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        let (p, slots) = match hit {
            Some((p, slots)) => {
                debug_assert!(
                    self.lower(&inputs)
                        .is_ok_and(|(q, s)| q == *p && s == slots),
                    "UpdateRule::structure misses a choice of the program: {self:?}"
                );
                (p, slots)
            }
            None => {
                let (p, slots) = self.lower(&inputs)?;
                let entry = (Arc::new(p), slots);
                memo.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, entry.clone());
                entry
            }
        };
        Ok((p, slots.iter().map(|&k| values[k]).collect()))
    }

    /// The rule's program over `inputs`, with one parameter per read of a constant, numbered
    /// in the order the formulas read them, and the slot of [`UpdateRule::param_values`] each
    /// parameter takes its value from.
    fn lower(&self, inputs: &[DType]) -> Result<(Program, Vec<usize>)> {
        let mut slots = Vec::new();
        // A scaled program's last input is the gradient's factor.
        let scale = (inputs.len() > 2 + self.state_count()).then(|| Expr::input(inputs.len() - 1));
        let outs = self.exprs(scale, &mut |slot| {
            slots.push(slot);
            Expr::param(slots.len() - 1)
        });
        Ok((Program::from_exprs(inputs, &outs)?, slots))
    }

    /// What the program's shape may depend on: the variant, its flags and, for each
    /// hyperparameter, only whether it is zero (a zero weight decay or momentum drops terms).
    /// Every field is named, so a new one must be placed here.
    fn structure(&self) -> [u64; 9] {
        let z = |v: f64| u64::from(v != 0.0);
        match *self {
            UpdateRule::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
                first_step,
            } => [
                0,
                z(lr),
                z(momentum),
                z(dampening),
                u64::from(nesterov),
                z(weight_decay),
                u64::from(first_step),
                0,
                0,
            ],
            UpdateRule::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
                bias_correction1,
                bias_correction2,
            } => [
                1,
                z(lr),
                z(beta1),
                z(beta2),
                z(eps),
                z(weight_decay),
                u64::from(decoupled),
                z(bias_correction1),
                z(bias_correction2),
            ],
        }
    }

    /// The values of the rule's parameters, by slot: every constant of the formulas above,
    /// computed in f64 from the hyperparameters. SGD: weight decay, momentum, `1 - dampening`,
    /// `lr`; Adam: weight decay, `1 - lr * weight_decay`, `beta1`, `1 - beta1`, `beta2`,
    /// `1 - beta2`, `1 / sqrt(bias_correction2)`, `eps`, `lr / bias_correction1`.
    fn param_values(&self) -> Vec<f64> {
        match *self {
            UpdateRule::Sgd {
                lr,
                momentum,
                dampening,
                weight_decay,
                ..
            } => vec![weight_decay, momentum, 1.0 - dampening, lr],
            UpdateRule::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                bias_correction1,
                bias_correction2,
                ..
            } => vec![
                weight_decay,
                1.0 - lr * weight_decay,
                beta1,
                1.0 - beta1,
                beta2,
                1.0 - beta2,
                1.0 / bias_correction2.sqrt(),
                eps,
                lr / bias_correction1,
            ],
        }
    }

    /// The update as expressions over `[param, grad, state...]` (and `scale`, by which the
    /// gradient is multiplied first, when given), reading the constant of slot `k` of
    /// [`UpdateRule::param_values`] as `param(k)`, called where the constant is used (so the
    /// program numbers its parameters in the order the formulas read them).
    fn exprs(&self, scale: Option<Expr>, param: &mut dyn FnMut(usize) -> Expr) -> Vec<Expr> {
        let p = Expr::input(0);
        let g = match scale {
            Some(s) => Expr::input(1) * s,
            None => Expr::input(1),
        };
        match *self {
            UpdateRule::Sgd {
                momentum,
                nesterov,
                weight_decay,
                first_step,
                ..
            } => {
                // Slots: 0 weight decay, 1 momentum, 2 `1 - dampening`, 3 lr.
                let g = if weight_decay != 0.0 {
                    &g + &p * param(0)
                } else {
                    g
                };
                if momentum != 0.0 {
                    let m = if first_step {
                        g.clone()
                    } else {
                        Expr::input(2) * param(1) + &g * param(2)
                    };
                    let d = if nesterov {
                        &g + &m * param(1)
                    } else {
                        m.clone()
                    };
                    vec![&p - d * param(3), m]
                } else {
                    vec![&p - g * param(3)]
                }
            }
            UpdateRule::Adam {
                weight_decay,
                decoupled,
                ..
            } => {
                // Slots: 0 weight decay, 1 `1 - lr * weight_decay`, 2 beta1, 3 `1 - beta1`,
                // 4 beta2, 5 `1 - beta2`, 6 `1 / sqrt(bias_correction2)`, 7 eps,
                // 8 `lr / bias_correction1`.
                let (mut p, mut g) = (p, g);
                if weight_decay != 0.0 {
                    if decoupled {
                        p = p * param(1);
                    } else {
                        g = &g + &p * param(0);
                    }
                }
                let m = Expr::input(2) * param(2) + &g * param(3);
                let v = Expr::input(3) * param(4) + g.square() * param(5);
                let denom = v.sqrt() * param(6) + param(7);
                let upd = (&m / denom) * param(8);
                vec![p - upd, m, v]
            }
        }
    }
}
