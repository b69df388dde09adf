//! Reductions, and the row-wise ops built on them: `softmax`, `log_softmax`, `cross_entropy`.

use super::*;

pub(super) fn g_reduce<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in ReduceOp::ALL {
        let dtypes = match op {
            ReduceOp::Sum => dtypes_where(|d| d != DType::U8),
            _ => ALL.to_vec(),
        };
        let min_rank = if op.is_arg() { 1 } else { 0 };
        let strat = (
            prop_oneof![
                8 => shape(min_rank, 4, 6),
                2 => shape(min_rank.max(1), 2, 40),
                1 => big_shape(min_rank)
            ],
            select(dtypes),
            prop::collection::vec(any::<bool>(), 4),
            prop::collection::vec(any::<bool>(), 4),
            any::<prop::sample::Index>(),
            any::<bool>(),
            select(vec![0.0, 0.0, 0.0, 0.05]),
        )
            .prop_flat_map(move |(mut dims, dtype, pick, neg, one, keepdim, nan)| {
                let r = dims.len();
                let mut axes: Vec<usize> = if op.is_arg() {
                    vec![one.index(r)]
                } else {
                    (0..r).filter(|&i| pick[i]).collect()
                };
                if op != ReduceOp::Sum {
                    // Max/Min/Arg* reject empty reductions: keep reduced axes non-empty.
                    for &a in &axes {
                        dims[a] = dims[a].max(1);
                    }
                }
                axes.sort_unstable();
                let axes: Vec<isize> = axes
                    .iter()
                    .map(|&a| {
                        if neg[a] {
                            a as isize - r as isize
                        } else {
                            a as isize
                        }
                    })
                    .collect();
                let dom = match dtype {
                    DType::U8 => Dom::range(0.0, 255.0).ties(1.0),
                    DType::I64 => Dom::range(-1000.0, 1000.0),
                    _ => Dom::range(-8.0, 8.0).ties(0.3).nan(nan),
                };
                (Just((axes, keepdim)), spec(dims, dtype, dom, true))
            });
        p.run(
            out,
            &format!("reduce {}", op.name()),
            strat,
            |((axes, keepdim), s)| {
                let a = p.build(&s)?;
                let (g, w) = both!(a => a.reduce(op, &axes, keepdim));
                let tol = if op == ReduceOp::Sum && s.dtype.is_float() {
                    let k: usize = axes
                        .iter()
                        .map(|&ax| s.dims[ax.rem_euclid(s.dims.len().max(1) as isize) as usize])
                        .product();
                    let mag =
                        a.1.abs()
                            .and_then(|t| t.reduce(op, &axes, keepdim))
                            .and_then(|t| t.to_f64_vec())
                            .ok();
                    p.accum(s.dtype, k as f64, mag)
                } else {
                    Tol::Bits
                };
                p.expect(
                    &format!(
                        "reduce {} axes {axes:?} keepdim {keepdim} {}",
                        op.name(),
                        s.dtype
                    ),
                    &[("x", &a.0)],
                    g,
                    w,
                    &tol,
                )
            },
        );
    }
}

/// Per-row `(max |x|, row length)` of the last axis, broadcast to every element of the row.
fn row_scale<B: Backend>(t: &Tensor<B>) -> Option<(Vec<f64>, usize)> {
    let c = *t.dims().last()?;
    let v = t.to_f64_vec().ok()?;
    let mut out = Vec::with_capacity(v.len());
    for row in v.chunks(c.max(1)) {
        let m = row.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        out.extend(std::iter::repeat_n(m, row.len()));
    }
    Some((out, c))
}

pub(super) fn g_softmax<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for log in [false, true] {
        let name = if log { "log_softmax" } else { "softmax" };
        let dims = prop_oneof![
            19 => (shape(1, 4, 6), 0..=13usize).prop_map(|(mut dims, last)| {
                *dims.last_mut().expect("rank >= 1") = last;
                dims
            }),
            1 => big_shape(1),
        ];
        let strat = (dims, select(FLOATS.to_vec()), prop::bool::weighted(0.2)).prop_flat_map(
            |(dims, dtype, big)| {
                // Large logits check the max subtraction (exp overflows f32 beyond 88).
                let dom = if big {
                    Dom::range(-300.0, 300.0)
                } else {
                    Dom::range(-10.0, 10.0)
                };
                spec(dims, dtype, dom, true)
            },
        );
        p.run(out, name, strat, |s| {
            let a = p.build(&s)?;
            let (g, w) = both!(a => if log { a.log_softmax(-1) } else { a.softmax(-1) });
            let tol = match (&w, row_scale(&a.1)) {
                (Ok(w), Some((scale, c))) => {
                    let wv = w.to_f64_vec().map_err(msg)?;
                    // softmax: relative error ~ row length; log_softmax: absolute, of the logits'
                    // magnitude.
                    let mag: Vec<f64> = if log {
                        scale
                            .iter()
                            .zip(&wv)
                            .map(|(m, w)| 2.0 * m + w.abs() + 1.0)
                            .collect()
                    } else {
                        wv.iter().map(|w| w.abs()).collect()
                    };
                    p.accum(s.dtype, c as f64 + 2.0, Some(mag))
                }
                _ => p.elem(s.dtype),
            };
            p.expect(&format!("{name} {}", s.dtype), &[("x", &a.0)], g, w, &tol)
        });
    }
}

pub(super) fn g_xent<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        0..=9usize,
        1..=13usize,
        select(FLOATS.to_vec()),
        prop::bool::weighted(0.2),
    )
        .prop_flat_map(|(n, c, dtype, big)| {
            let dom = if big {
                Dom::range(-300.0, 300.0)
            } else {
                Dom::range(-10.0, 10.0)
            };
            (
                spec(vec![n, c], dtype, dom, true),
                spec(
                    vec![n],
                    DType::I64,
                    Dom::range(0.0, c as f64 - 1.0).ties(1.0),
                    true,
                ),
                spec(vec![n], dtype, Dom::range(-2.0, 2.0), true),
            )
        });
    p.run(out, "cross_entropy", strat, |(sl, sy, sg)| {
        let (x, y, gr) = (p.build(&sl)?, p.build(&sy)?, p.build(&sg)?);
        let c = sl.dims[1];
        let (scale, _) = row_scale(&x.1).unwrap_or_default();
        let per_row: Vec<f64> = scale.iter().step_by(c).map(|m| 2.0 * m + 2.0).collect();
        let (g, w) = both!(x, y => x.cross_entropy(y, Reduction::None));
        let wv = w
            .as_ref()
            .ok()
            .and_then(|w| w.to_f64_vec().ok())
            .unwrap_or_default();
        let mag = per_row
            .iter()
            .zip(wv.iter().chain(std::iter::repeat(&0.0)))
            .map(|(m, w)| m + w.abs())
            .collect();
        p.expect(
            &format!("cross_entropy {}", sl.dtype),
            &[("logits", &x.0), ("labels", &y.0)],
            g,
            w,
            &p.accum(sl.dtype, c as f64 + 2.0, Some(mag)),
        )?;
        let (g, w) = both!(x, y, gr => x.cross_entropy_backward(y, gr));
        let gv = gr.1.to_f64_vec().map_err(msg)?;
        let mag: Vec<f64> = (0..sl.dims[0] * c).map(|i| 2.0 * gv[i / c].abs()).collect();
        p.expect(
            &format!("cross_entropy_backward {}", sl.dtype),
            &[("logits", &x.0), ("labels", &y.0), ("grad", &gr.0)],
            g,
            w,
            &p.accum(sl.dtype, c as f64 + 2.0, Some(mag)),
        )
    });
}
