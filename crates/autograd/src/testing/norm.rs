//! Normalizations (`layer_norm`, `rms_norm`, `batch_norm` in both modes, `group_norm`) and the
//! embedding lookup.

use super::*;

/// `layer_norm` (each of weight and bias present or not), `rms_norm` (weight or not) over one
/// or two trailing axes, and `embedding` with repeated ids of any shape.
pub(super) fn norm_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    for centered in [true, false] {
        let name = if centered { "layer_norm" } else { "rms_norm" };
        c.push((
            format!("norm/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (
                    input_of(dims(1, 4)),
                    1usize..=2,
                    any::<bool>(),
                    any::<bool>(),
                    lay(),
                );
                prop(cfg, s, |(x, k, has_w, has_b, wl)| {
                    let k = k.min(x.dims.len());
                    let nshape = x.dims[x.dims.len() - k..].to_vec();
                    let param = |seed: u64| In {
                        dims: nshape.clone(),
                        lay: wl,
                        seed: x.seed.wrapping_add(seed),
                    };
                    let mut ins = vec![x.build::<B>(Vals::Normal, dev)?];
                    if has_w {
                        ins.push(param(1).build::<B>(Vals::Normal, dev)?);
                    }
                    let has_b = has_b && centered;
                    if has_b {
                        ins.push(param(2).build::<B>(Vals::Normal, dev)?);
                    }
                    // eps well above 0 keeps rows of nearly equal values well conditioned
                    // for the central difference; the formula is the same for any eps.
                    let eps = 0.05;
                    check(cfg, &ins, |v| {
                        let w = has_w.then(|| &v[1]);
                        let b = has_b.then(|| &v[1 + usize::from(has_w)]);
                        if centered {
                            v[0].layer_norm(&nshape, w, b, eps)
                        } else {
                            v[0].rms_norm(&nshape, w, eps)
                        }
                    })
                })
            }),
        ));
    }
    c.extend(channel_norm_cases::<B>());
    c.push((
        "norm/embedding".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(vec(1usize..=5, 2)), dims(0, 2));
            prop(cfg, s, |(table, id_dims)| {
                let idx = ids::<B>(&id_dims, table.dims[0], table.seed, dev)?;
                check(cfg, &[table.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].embedding(&idx, None)
                })
            })
        }),
    ));
    c
}

/// `batch_norm` in training mode (rank 2 to 4, at least two values per channel) and in
/// evaluation mode, and `group_norm`, each with weight and bias present or not.
fn channel_norm_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    for training in [true, false] {
        let name = if training {
            "norm/batch_norm_train"
        } else {
            "norm/batch_norm_eval"
        };
        c.push((
            name.into(),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (input_of(dims(2, 4)), any::<bool>(), any::<bool>(), lay());
                prop(cfg, s, |(mut x, has_w, has_b, wl)| {
                    if x.dims.iter().product::<usize>() / x.dims[1] < 2 {
                        x.dims[0] = 2;
                    }
                    let ch = x.dims[1];
                    let param = |seed: u64| In {
                        dims: vec![ch],
                        lay: wl,
                        seed: x.seed.wrapping_add(seed),
                    };
                    let mut ins = vec![x.build::<B>(Vals::Normal, dev)?];
                    if has_w {
                        ins.push(param(1).build::<B>(Vals::Normal, dev)?);
                    }
                    if has_b {
                        ins.push(param(2).build::<B>(Vals::Normal, dev)?);
                    }
                    let rm = param(3).build::<B>(Vals::Normal, dev)?;
                    let rv = param(4).build::<B>(Vals::Positive, dev)?;
                    // eps well above 0 for the central difference, as for layer_norm.
                    let eps = 0.05;
                    check(cfg, &ins, |v| {
                        let w = has_w.then(|| &v[1]);
                        let b = has_b.then(|| &v[1 + usize::from(has_w)]);
                        if training {
                            Ok(v[0].batch_norm_train(w, b, eps)?.0)
                        } else {
                            // The running statistics in the checked dtype.
                            let dt = v[0].dtype();
                            let (rm, rv) = (rm.to_dtype(dt)?, rv.to_dtype(dt)?);
                            v[0].batch_norm_eval(&rm, &rv, w, b, eps)
                        }
                    })
                })
            }),
        ));
    }
    c.push((
        "norm/group_norm".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                1usize..=3,
                1usize..=2,
                input_of(dims(1, 3)),
                any::<bool>(),
                any::<bool>(),
                lay(),
            );
            prop(cfg, s, |(groups, per_group, mut x, has_w, has_b, wl)| {
                // [n, groups * per_group, spatial...] from the drawn dims.
                let ch = groups * per_group;
                x.dims.insert(1, ch);
                let param = |seed: u64| In {
                    dims: vec![ch],
                    lay: wl,
                    seed: x.seed.wrapping_add(seed),
                };
                let mut ins = vec![x.build::<B>(Vals::Normal, dev)?];
                if has_w {
                    ins.push(param(1).build::<B>(Vals::Normal, dev)?);
                }
                if has_b {
                    ins.push(param(2).build::<B>(Vals::Normal, dev)?);
                }
                check(cfg, &ins, |v| {
                    let w = has_w.then(|| &v[1]);
                    let b = has_b.then(|| &v[1 + usize::from(has_w)]);
                    v[0].group_norm(groups, w, b, 0.05)
                })
            })
        }),
    ));
    c
}
