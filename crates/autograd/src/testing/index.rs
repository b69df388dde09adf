//! Index ops and `where`.

use super::*;

/// Index ops (`index_select`, `gather`, `scatter_add`) and `where`.
pub(super) fn index_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- indexing ----
    c.push((
        "index_select".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, 1usize..=6);
            prop(cfg, s, |(x, axis, n)| {
                let axis = axis % x.dims.len();
                let idx = ids::<B>(&[n], x.dims[axis], x.seed, dev)?;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].index_select(axis as isize, &idx)
                })
            })
        }),
    ));
    c.push((
        "gather".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, vec(1usize..=4, 3));
            prop(cfg, s, |(x, axis, want)| {
                let axis = axis % x.dims.len();
                let idims: Vec<usize> = (0..x.dims.len())
                    .map(|i| {
                        if i == axis {
                            want[i]
                        } else {
                            want[i].min(x.dims[i])
                        }
                    })
                    .collect();
                let idx = ids::<B>(&idims, x.dims[axis], x.seed, dev)?;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].gather(axis as isize, &idx)
                })
            })
        }),
    ));
    c.push((
        "scatter_add".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, vec(1usize..=4, 3), lay());
            prop(cfg, s, |(x, axis, want, sl)| {
                let axis = axis % x.dims.len();
                let sdims: Vec<usize> = (0..x.dims.len())
                    .map(|i| {
                        if i == axis {
                            want[i]
                        } else {
                            want[i].min(x.dims[i])
                        }
                    })
                    .collect();
                let idx = ids::<B>(&sdims, x.dims[axis], x.seed, dev)?;
                let src = In {
                    dims: sdims,
                    lay: sl,
                    seed: x.seed.wrapping_add(7),
                };
                let ins = [
                    x.build::<B>(Vals::Normal, dev)?,
                    src.build::<B>(Vals::Normal, dev)?,
                ];
                check(cfg, &ins, |v| v[0].scatter_add(axis as isize, &idx, &v[1]))
            })
        }),
    ));
    c.push((
        "where".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (bcast_pair(), lay(), lay(), any::<u64>());
            prop(cfg, s, |((a, b), la, lb, seed)| {
                let ta = In {
                    dims: a.clone(),
                    lay: la,
                    seed,
                }
                .build::<B>(Vals::Normal, dev)?;
                let tb = In {
                    dims: b,
                    lay: lb,
                    seed: seed.wrapping_add(1),
                }
                .build::<B>(Vals::Normal, dev)?;
                // A condition of a's shape (which broadcasts with b's).
                let cond = ids::<B>(&a, 2, seed, dev)?.to_dtype(DType::U8)?;
                check(cfg, &[ta, tb], |v| Var::where_cond(&cond, &v[0], &v[1]))
            })
        }),
    ));
    c
}
