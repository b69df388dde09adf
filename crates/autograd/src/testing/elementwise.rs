//! Unary ops (each on its own domain from the op table), composite ops and binary ops.

use super::*;

/// Where the gradient check samples `op`, from the op table: away from the jumps of a
/// piecewise-constant op, from kinks, inside a domain that starts near or above 0 (log, sqrt,
/// log1p), away from a pole at 0 (recip); else standard normal values.
pub(super) fn unary_vals(op: UnaryOp) -> Vals {
    let d = op.domain();
    if matches!(op.vjp(), Vjp::Zero) {
        Vals::AwayFromInt
    } else if d.lo > -1.0 {
        Vals::Positive
    } else if d.avoid > 0.0 {
        Vals::AwayFromZero
    } else if !d.kinks.is_empty() {
        Vals::AwayFrom(d.kinks)
    } else {
        Vals::Normal
    }
}

/// The unary ops of [`UnaryOp::ALL`], each on its own input domain.
pub(super) fn unary_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- unary ----
    for op in UnaryOp::ALL {
        let vals = unary_vals(op);
        c.push((
            format!("unary/{}", op.name()),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                prop(cfg, input_of(dims(0, 3)), |x| {
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| v[0].unary(op))
                })
            }),
        ));
    }
    c
}

/// The composite ops of [`CompositeOp::ALL`], with the table's test parameters.
pub(super) fn composite_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- composite ops (scalar parameters) ----
    for &op in CompositeOp::ALL {
        let d = op.domain();
        let vals = if d.kinks.is_empty() {
            Vals::Normal
        } else {
            Vals::AwayFrom(d.kinks)
        };
        c.push((
            format!("composite/{}", op.name()),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                prop(cfg, input_of(dims(0, 3)), |x| {
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| {
                        v[0].composite(op, op.test_params())
                    })
                })
            }),
        ));
    }
    c
}

/// Elementwise binary ops: two variables broadcasting, a variable against a scalar on either side, and `clamp`.
pub(super) fn binary_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- binary with broadcasting ----
    for op in BinaryOp::ALL {
        let (va, vb) = match op {
            BinaryOp::Div => (Vals::Normal, Vals::AwayFromZero),
            BinaryOp::Pow => (Vals::Positive, Vals::Normal),
            BinaryOp::Maximum | BinaryOp::Minimum => {
                (Vals::Grid { odd: true }, Vals::Grid { odd: false })
            }
            _ => (Vals::Normal, Vals::Normal),
        };
        c.push((
            format!("binary/{}", op.name()),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s =
                    (bcast_pair(), lay(), lay(), any::<u64>()).prop_map(|((a, b), la, lb, s)| {
                        (
                            In {
                                dims: a,
                                lay: la,
                                seed: s,
                            },
                            In {
                                dims: b,
                                lay: lb,
                                seed: s.wrapping_add(1),
                            },
                        )
                    });
                prop(cfg, s, |(a, b)| {
                    let ins = [a.build::<B>(va, dev)?, b.build::<B>(vb, dev)?];
                    check(cfg, &ins, |v| v[0].binary(op, &v[1]))
                })
            }),
        ));
    }

    // ---- scalar ops, both sides ----
    for op in BinaryOp::ALL {
        for scalar_lhs in [false, true] {
            let (vals, k) = match (op, scalar_lhs) {
                (BinaryOp::Div, true) => (Vals::AwayFromZero, 1.7),
                (BinaryOp::Div, false) => (Vals::Normal, -1.7),
                (BinaryOp::Pow, false) => (Vals::Positive, 2.5),
                (BinaryOp::Pow, true) => (Vals::Normal, 1.7),
                (BinaryOp::Maximum | BinaryOp::Minimum, _) => (Vals::Grid { odd: true }, 0.1),
                (BinaryOp::Mul, _) => (Vals::Normal, -1.3),
                _ => (Vals::Normal, 0.7),
            };
            let side = if scalar_lhs { "c_op_x" } else { "x_op_c" };
            c.push((
                format!("scalar/{}/{side}", op.name()),
                Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                    prop(cfg, input_of(dims(0, 3)), |x| {
                        check(cfg, &[x.build::<B>(vals, dev)?], |v| {
                            if scalar_lhs {
                                v[0].scalar_binary(op, k)
                            } else {
                                v[0].binary_scalar(op, k)
                            }
                        })
                    })
                }),
            ));
        }
    }

    c.push((
        "clamp".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 3)), |x| {
                check(cfg, &[x.build::<B>(Vals::Grid { odd: true }, dev)?], |v| {
                    v[0].clamp(-0.3, 0.4)
                })
            })
        }),
    ));
    c
}
