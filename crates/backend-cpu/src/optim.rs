//! `Backend::fused_update` for the CPU: one pass over each parameter that reads the parameter,
//! its gradient and its state once and writes the new ones. The arithmetic is the default's
//! (`UpdateRule::program`), op for op, with the rule's constants computed in f64 and converted
//! to the dtype once, exactly as the program's parameters are.
//!
//! Why not the default (the rule's program through the fused evaluator, `eval_expr`), measured
//! with `benches/fuse.rs` on the busy 2-core VM: the two are within noise of each other on
//! two threads (Adam over 512K f32: 2.25 ms vs 2.24 ms; SGD with momentum over 78,400: 158 µs
//! vs 147 µs), but on one thread the program is 34% slower for Adam (3.12 vs 2.33 ms). Once
//! the evaluator's per-block costs are cut, this module (and the `fused_update` override in
//! `lib.rs`) can go.

use kiln_core::backend::{UpdateRule, UpdateSlot};
use kiln_core::{DType, Error, Result};
use rayon::prelude::*;

use crate::elementwise::{dtype_err, slice};
use crate::storage::{CpuElem, CpuStorage, alloc, storage};
use crate::strided::par_chunk;

/// The float operations an update needs.
trait UpdFloat:
    CpuElem
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    fn sqrt(self) -> Self;
}
impl UpdFloat for f32 {
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}
impl UpdFloat for f64 {
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

const OP: &str = "fused_update";

/// Parameters with at least this many elements are updated by several cores. An update is a
/// few flops per element, so a core does a 100x784 weight in about 15 µs, less than waking a
/// sleeping rayon worker costs (~70 µs measured on a 2-core VM); only large tensors gain.
const UPDATE_PAR_MIN: usize = 1 << 20;

/// One slot's parameter, gradient and state buffers as slices of its `len`.
type Parts<'a, T> = (&'a [T], &'a [T], Vec<&'a [T]>);

/// The [`Parts`] of one slot, after checking them.
fn parts<'a, T: UpdFloat>(
    slot: &UpdateSlot<'a, CpuStorage>,
    n_state: usize,
) -> Result<Parts<'a, T>> {
    let len = slot.len;
    let get = |s: &'a CpuStorage| -> Result<&'a [T]> {
        slice::<T>(OP, s)?.get(..len).ok_or_else(|| {
            Error::invalid(
                OP,
                format!("a buffer of {} elements is shorter than {len}", s.len()),
            )
        })
    };
    if slot.state.len() != n_state {
        return Err(Error::invalid(
            OP,
            format!("expected {n_state} state buffers, got {}", slot.state.len()),
        ));
    }
    let state = slot
        .state
        .iter()
        .map(|s| get(s))
        .collect::<Result<Vec<_>>>()?;
    Ok((get(slot.param)?, get(slot.grad)?, state))
}

/// Runs `f(range, p_out, state_outs)` over `0..len` in parallel chunks when large.
fn split<T: UpdFloat>(
    len: usize,
    p: &mut [T],
    st: &mut [Vec<T>],
    f: impl Fn(usize, &mut [T], &mut [&mut [T]]) + Sync,
) {
    let chunk = if len >= UPDATE_PAR_MIN {
        par_chunk(len)
    } else {
        len.max(1)
    };
    match st {
        [] => p
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, pc)| f(i * chunk, pc, &mut [])),
        [m] => p
            .par_chunks_mut(chunk)
            .zip(m.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(i, (pc, mc))| f(i * chunk, pc, &mut [mc])),
        [m, v] => p
            .par_chunks_mut(chunk)
            .zip(m.par_chunks_mut(chunk))
            .zip(v.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(i, ((pc, mc), vc))| f(i * chunk, pc, &mut [mc, vc])),
        _ => unreachable!("at most two state buffers"),
    }
}

fn update_t<T: UpdFloat>(
    rule: &UpdateRule,
    slot: &UpdateSlot<'_, CpuStorage>,
) -> Result<(CpuStorage, Vec<CpuStorage>)> {
    let c = T::from_f64;
    let n_state = rule.state_count();
    let (p, g, state) = parts::<T>(slot, n_state)?;
    let len = slot.len;
    let dev = slot.param.device();
    const OP: &str = "fused_update";
    let mut p_out = alloc::<T>(OP, dev, len)?;
    let mut st_out: Vec<Vec<T>> = (0..n_state)
        .map(|_| alloc::<T>(OP, dev, len))
        .collect::<Result<_>>()?;
    match *rule {
        UpdateRule::Sgd {
            lr,
            momentum,
            dampening,
            nesterov,
            weight_decay,
            first_step,
        } => {
            let (lr, mom, damp1, wd) = (c(lr), c(momentum), c(1.0 - dampening), c(weight_decay));
            let decay = weight_decay != 0.0;
            // Each case is its own loop over zipped slices (no indexing, no branch inside), so
            // the compiler vectorizes it; the arithmetic is the default's, op for op.
            split(len, &mut p_out, &mut st_out, |s, po, so| {
                let r = s..s + po.len();
                let (p, g) = (&p[r.clone()], &g[r.clone()]);
                match so {
                    [] if !decay => {
                        for ((pn, &p), &g) in po.iter_mut().zip(p).zip(g) {
                            *pn = p - g * lr;
                        }
                    }
                    [] => {
                        for ((pn, &p), &g) in po.iter_mut().zip(p).zip(g) {
                            *pn = p - (g + p * wd) * lr;
                        }
                    }
                    [m_out] => {
                        let m_old = &state[0][r];
                        for (((pn, mn), (&p, &g)), &m0) in po
                            .iter_mut()
                            .zip(m_out.iter_mut())
                            .zip(p.iter().zip(g))
                            .zip(m_old)
                        {
                            let gi = if decay { g + p * wd } else { g };
                            let m = if first_step {
                                gi
                            } else {
                                m0 * mom + gi * damp1
                            };
                            *mn = m;
                            let d = if nesterov { gi + m * mom } else { m };
                            *pn = p - d * lr;
                        }
                    }
                    _ => unreachable!("SGD keeps at most one state buffer"),
                }
            });
        }
        UpdateRule::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
            bias_correction1,
            bias_correction2,
        } => {
            let (b1, b1c, b2, b2c) = (c(beta1), c(1.0 - beta1), c(beta2), c(1.0 - beta2));
            let (wd, shrink) = (c(weight_decay), c(1.0 - lr * weight_decay));
            let (inv_bc2, eps, step) = (
                c(1.0 / bias_correction2.sqrt()),
                c(eps),
                c(lr / bias_correction1),
            );
            let (dec, cpl) = (
                weight_decay != 0.0 && decoupled,
                weight_decay != 0.0 && !decoupled,
            );
            split(len, &mut p_out, &mut st_out, |s, po, so| {
                let r = s..s + po.len();
                let (p, g, m_old, v_old) = (
                    &p[r.clone()],
                    &g[r.clone()],
                    &state[0][r.clone()],
                    &state[1][r],
                );
                let [m_out, v_out] = so else {
                    unreachable!("Adam keeps two state buffers")
                };
                let new_pv = po.iter_mut().zip(p.iter().zip(g));
                let state = m_out
                    .iter_mut()
                    .zip(v_out.iter_mut())
                    .zip(m_old.iter().zip(v_old));
                for ((pn, (&p, &g)), ((mn, vn), (&m0, &v0))) in new_pv.zip(state) {
                    let p0 = if dec { p * shrink } else { p };
                    let gi = if cpl { g + p * wd } else { g };
                    let m = m0 * b1 + gi * b1c;
                    let v = v0 * b2 + (gi * gi) * b2c;
                    *mn = m;
                    *vn = v;
                    let denom = v.sqrt() * inv_bc2 + eps;
                    *pn = p0 - (m / denom) * step;
                }
            });
        }
    }
    Ok((
        storage(dev, p_out),
        st_out.into_iter().map(|v| storage(dev, v)).collect(),
    ))
}

pub(crate) fn fused_update(
    rule: &UpdateRule,
    dtype: DType,
    slots: &[UpdateSlot<'_, CpuStorage>],
) -> Result<Vec<(CpuStorage, Vec<CpuStorage>)>> {
    slots
        .iter()
        .map(|slot| match dtype {
            DType::F32 => update_t::<f32>(rule, slot),
            DType::F64 => update_t::<f64>(rule, slot),
            _ => Err(dtype_err(OP, "f32 or f64", dtype)),
        })
        .collect()
}
