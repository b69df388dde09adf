//! Matrix products and `linear`.

use super::*;

/// Matrix products and `linear`.
pub(super) fn matmul_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- matmul ----
    c.push((
        "matmul".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                0usize..8,
                1usize..=4,
                1usize..=4,
                1usize..=4,
                1usize..=3,
                1usize..=3,
            );
            let s = (s, lay(), lay(), any::<u64>()).prop_map(
                |((kind, m, k, n, b, c), la, lb, seed)| {
                    let (a, bb): (Vec<usize>, Vec<usize>) = match kind {
                        0 => (vec![m, k], vec![k, n]),
                        1 => (vec![b, m, k], vec![b, k, n]),
                        2 => (vec![b, 1, m, k], vec![c, k, n]), // broadcast batch
                        3 => (vec![k], vec![k, n]),             // vector @ matrix
                        4 => (vec![m, k], vec![k]),             // matrix @ vector
                        5 => (vec![k], vec![k]),                // dot
                        6 => (vec![m, k], vec![b, k, n]),       // matrix @ batch
                        _ => (vec![b, m, k], vec![k]),          // batch @ vector
                    };
                    (
                        In {
                            dims: a,
                            lay: la,
                            seed,
                        },
                        In {
                            dims: bb,
                            lay: lb,
                            seed: seed.wrapping_add(1),
                        },
                    )
                },
            );
            prop(cfg, s, |(a, b)| {
                let ins = [
                    a.build::<B>(Vals::Normal, dev)?,
                    b.build::<B>(Vals::Normal, dev)?,
                ];
                check(cfg, &ins, |v| v[0].matmul(&v[1]))
            })
        }),
    ));

    // ---- linear: x · wᵀ + b with x of rank 1 to 3, with and without a bias ----
    c.push((
        "linear".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (0usize..3, 1usize..=3, 1usize..=4, 1usize..=4, any::<bool>());
            let s = (s, lay(), lay(), any::<u64>()).prop_map(
                |((lead, b, i, o, bias), lx, lw, seed)| {
                    let mut xd = vec![b; lead];
                    xd.push(i);
                    let x = In {
                        dims: xd,
                        lay: lx,
                        seed,
                    };
                    let w = In {
                        dims: vec![o, i],
                        lay: lw,
                        seed: seed.wrapping_add(1),
                    };
                    let bias = bias.then_some(In {
                        dims: vec![o],
                        lay: Lay::Contiguous,
                        seed: seed.wrapping_add(2),
                    });
                    (x, w, bias)
                },
            );
            prop(cfg, s, |(x, w, bias)| {
                let mut ins = vec![
                    x.build::<B>(Vals::Normal, dev)?,
                    w.build::<B>(Vals::Normal, dev)?,
                ];
                if let Some(b) = &bias {
                    ins.push(b.build::<B>(Vals::Normal, dev)?);
                }
                check(cfg, &ins, |v| v[0].linear(&v[1], v.get(2)))
            })
        }),
    ));
    c
}
