//! Reductions, softmax and the losses.

use super::*;

/// Reductions over chosen axes and over all axes.
pub(super) fn reduction_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- reductions ----
    for name in ["sum", "mean", "max", "min"] {
        let vals = if matches!(name, "max" | "min") {
            Vals::Distinct
        } else {
            Vals::Normal
        };
        c.push((
            format!("reduce/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (input_of(dims(1, 4)), vec(any::<bool>(), 4), any::<bool>());
                prop(cfg, s, |(x, mask, keepdim)| {
                    let axes = axes_of(x.dims.len(), &mask);
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| match name {
                        "sum" => v[0].sum(&axes, keepdim),
                        "mean" => v[0].mean(&axes, keepdim),
                        "max" => v[0].max(&axes, keepdim),
                        _ => v[0].min(&axes, keepdim),
                    })
                })
            }),
        ));
        c.push((
            format!("reduce/{name}_all"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                prop(cfg, input_of(dims(0, 3)), |x| {
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| match name {
                        "sum" => v[0].sum_all(),
                        "mean" => v[0].mean_all(),
                        "max" => v[0].max_all(),
                        _ => v[0].min_all(),
                    })
                })
            }),
        ));
    }
    for name in ["max_dim", "min_dim"] {
        c.push((
            format!("reduce/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (input_of(dims(1, 3)), 0usize..3, any::<bool>());
                prop(cfg, s, |(x, axis, keepdim)| {
                    let dim = (axis % x.dims.len()) as isize;
                    check(cfg, &[x.build::<B>(Vals::Distinct, dev)?], |v| {
                        let (y, _) = if name == "max_dim" {
                            v[0].max_dim(dim, keepdim)?
                        } else {
                            v[0].min_dim(dim, keepdim)?
                        };
                        Ok(y)
                    })
                })
            }),
        ));
    }
    c
}

/// Softmax, log-softmax and the cross-entropy losses.
pub(super) fn loss_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- softmax and losses ----
    for log in [false, true] {
        c.push((
            if log { "log_softmax" } else { "softmax" }.into(),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                // Any axis, counted from either end (`dim` in `-rank..rank`).
                let s = (input_of(dims(1, 3)), 0usize..3, any::<bool>());
                prop(cfg, s, |(x, axis, negative)| {
                    let r = x.dims.len() as isize;
                    let dim = (axis as isize % r) - if negative { r } else { 0 };
                    check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                        if log {
                            v[0].log_softmax(dim)
                        } else {
                            v[0].softmax(dim)
                        }
                    })
                })
            }),
        ));
    }
    for (name, reduction) in [
        ("none", Reduction::None),
        ("mean", Reduction::Mean),
        ("sum", Reduction::Sum),
    ] {
        c.push((
            format!("cross_entropy/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = input_of(vec(1usize..=5, 2..=2));
                prop(cfg, s, |x| {
                    let labels = ids::<B>(&x.dims[..1], x.dims[1], x.seed, dev)?;
                    check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                        v[0].cross_entropy(&labels, reduction)
                    })
                })
            }),
        ));
    }
    c
}
