//! Views, joins and `slice_assign`.

use super::*;

/// Views (reshape, transpose, narrow, broadcast, ...).
pub(super) fn view_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- views ----
    c.push((
        "view/reshape".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 4)), |x| {
                let mut to = x.dims.clone();
                to.reverse();
                to.insert(0, 1);
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].reshape(to.clone())
                })
            })
        }),
    ));
    c.push((
        "view/flatten".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, (input_of(dims(1, 4)), 0usize..4), |(x, start)| {
                let start = (start % x.dims.len()) as isize;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].flatten_from(start)?.flatten_all()
                })
            })
        }),
    ));
    c.push((
        "view/transpose".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(
                cfg,
                (input_of(dims(1, 4)), 0usize..4, 0usize..4),
                |(x, a, b)| {
                    let r = x.dims.len();
                    let (a, b) = ((a % r) as isize, -1 - (b % r) as isize);
                    check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                        v[0].transpose(a, b)
                    })
                },
            )
        }),
    ));
    c.push((
        "view/t".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(2, 4)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| v[0].t())
            })
        }),
    ));
    c.push((
        "view/permute".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = input_of(dims(1, 4)).prop_flat_map(|x| {
                let r = x.dims.len();
                (Just(x), Just((0..r).collect::<Vec<usize>>()).prop_shuffle())
            });
            prop(cfg, s, |(x, perm)| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].permute(&perm)
                })
            })
        }),
    ));
    c.push((
        "view/narrow".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 4)), 0usize..4, 0usize..4, 0usize..4);
            prop(cfg, s, |(x, axis, start, len)| {
                let axis = axis % x.dims.len();
                let d = x.dims[axis];
                let start = start % d;
                let len = 1 + len % (d - start);
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].narrow(axis as isize, start, len)
                })
            })
        }),
    ));
    c.push((
        "view/broadcast_to".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (bcast_pair(), lay(), any::<u64>());
            prop(cfg, s, |((a, b), l, seed)| {
                let (small, full) = if a.len() <= b.len()
                    && a.iter().product::<usize>() <= b.iter().product::<usize>()
                {
                    (a, b)
                } else {
                    (b, a)
                };
                let x = In {
                    dims: small,
                    lay: l,
                    seed,
                };
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].broadcast_to(full.clone())
                })
            })
        }),
    ));
    c.push((
        "view/squeeze_unsqueeze".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(0, 3)), 0usize..4);
            prop(cfg, s, |(x, axis)| {
                let axis = (axis % (x.dims.len() + 1)) as isize;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].unsqueeze(axis)?.exp()?.squeeze(axis)
                })
            })
        }),
    ));
    c.push((
        "view/contiguous".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 4)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].contiguous()
                })
            })
        }),
    ));
    c
}

/// Joins (cat, stack) and `slice_assign`.
pub(super) fn join_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- joins ----
    c.push((
        "cat".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                dims(1, 3),
                0usize..3,
                vec(1usize..=3, 2..=3),
                vec(lay(), 3),
                any::<u64>(),
            );
            prop(cfg, s, |(base, axis, sizes, lays, seed)| {
                let axis = axis % base.len();
                let ins = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &sz)| {
                        let mut d = base.clone();
                        d[axis] = sz;
                        In {
                            dims: d,
                            lay: lays[i],
                            seed: seed.wrapping_add(i as u64),
                        }
                        .build::<B>(Vals::Normal, dev)
                    })
                    .collect::<Result<Vec<_>>>()?;
                check(cfg, &ins, |v| Var::cat(v, axis as isize))
            })
        }),
    ));
    c.push((
        "stack".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                dims(0, 3),
                0usize..4,
                2usize..=3,
                vec(lay(), 3),
                any::<u64>(),
            );
            prop(cfg, s, |(base, axis, count, lays, seed)| {
                let axis = (axis % (base.len() + 1)) as isize;
                let ins = (0..count)
                    .map(|i| {
                        In {
                            dims: base.clone(),
                            lay: lays[i],
                            seed: seed.wrapping_add(i as u64),
                        }
                        .build::<B>(Vals::Normal, dev)
                    })
                    .collect::<Result<Vec<_>>>()?;
                check(cfg, &ins, |v| Var::stack(v, axis))
            })
        }),
    ));

    c.push((
        "slice_assign".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, 0usize..4, 0usize..4, lay());
            prop(cfg, s, |(x, axis, start, len, sl)| {
                let axis = axis % x.dims.len();
                let d = x.dims[axis];
                let start = start % d;
                let len = 1 + len % (d - start);
                let mut sdims = x.dims.clone();
                sdims[axis] = len;
                let src = In {
                    dims: sdims,
                    lay: sl,
                    seed: x.seed.wrapping_add(3),
                };
                let ins = [
                    x.build::<B>(Vals::Normal, dev)?,
                    src.build::<B>(Vals::Normal, dev)?,
                ];
                check(cfg, &ins, |v| {
                    v[0].slice_assign(axis as isize, start, &v[1])
                })
            })
        }),
    ));
    c
}
