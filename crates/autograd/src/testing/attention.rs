//! Scaled dot-product attention: no mask, causal (square or not) and a random keep-mask (which
//! may leave a query row with no key), over batch axes, with strided inputs; packed multi-head
//! self-attention (`packed_self_attention`) without a mask and causal.

use super::*;
use crate::AttnMask;

pub(super) fn attention_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    for mask in ["none", "causal", "keep"] {
        c.push((
            format!("attention/sdpa_{mask}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (
                    dims(0, 2),
                    (1usize..=4, 1usize..=4, 1usize..=3, 1usize..=3),
                    (lay(), lay(), lay()),
                    any::<u64>(),
                );
                prop(cfg, s, |(batch, (tq, tk, d, dv), (lq, lk, lv), seed)| {
                    let tk = if mask == "causal" { tk.max(tq) } else { tk };
                    let input = |t: usize, e: usize, lay: Lay, n: u64| {
                        let mut d = batch.clone();
                        d.extend([t, e]);
                        In {
                            dims: d,
                            lay,
                            seed: seed.wrapping_add(n),
                        }
                        .build::<B>(Vals::Normal, dev)
                    };
                    let ins = [
                        input(tq, d, lq, 0)?,
                        input(tk, d, lk, 1)?,
                        input(tk, dv, lv, 2)?,
                    ];
                    let m = match mask {
                        "none" => AttnMask::None,
                        "causal" => AttnMask::Causal,
                        _ => {
                            let keep: Vec<u8> = host_values(Vals::Normal, tq * tk, seed ^ 7)
                                .iter()
                                .map(|x| u8::from(*x > -0.5))
                                .collect();
                            AttnMask::Keep(Tensor::from_vec(keep, [tq, tk], dev)?)
                        }
                    };
                    check(cfg, &ins, |v| {
                        v[0].scaled_dot_product_attention(&v[1], &v[2], &m, 0.0, None, None)
                    })
                })
            }),
        ));
    }
    for mask in ["none", "causal"] {
        c.push((
            format!("attention/packed_self_{mask}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (
                    dims(0, 2),
                    1usize..=4,
                    (1usize..=3, 1usize..=3),
                    lay(),
                    any::<u64>(),
                );
                prop(cfg, s, |(batch, t, (h, d), lay, seed)| {
                    let mut dims = batch.clone();
                    dims.extend([t, 3 * h * d]);
                    let x = In { dims, lay, seed }.build::<B>(Vals::Normal, dev)?;
                    let m = if mask == "causal" {
                        AttnMask::Causal
                    } else {
                        AttnMask::None
                    };
                    check(cfg, &[x], |v| {
                        v[0].packed_self_attention(h, &m, 0.0, None, None)
                    })
                })
            }),
        ));
    }
    c
}
