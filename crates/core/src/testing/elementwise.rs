//! Binary, scalar, comparison, `where_cond` and cast ops: elementwise ops of more than one operand
//! or of a dtype change.

use super::*;

fn binary_doms(op: BinaryOp, dtype: DType) -> (Dom, Dom) {
    match dtype {
        DType::U8 => (
            Dom::range(0.0, 255.0).ties(1.0),
            Dom::range(0.0, 255.0).ties(1.0),
        ),
        DType::I64 => match op {
            // Zeros included: integer division by zero gives 0.
            BinaryOp::Div => (Dom::range(-1000.0, 1000.0), Dom::range(-20.0, 20.0)),
            _ => (Dom::range(-1000.0, 1000.0), Dom::range(-1000.0, 1000.0)),
        },
        _ => match op {
            BinaryOp::Div => (Dom::range(-8.0, 8.0), Dom::range(-8.0, 8.0).avoid(0.1)),
            BinaryOp::Pow => (Dom::range(0.05, 5.0), Dom::range(-3.0, 3.0).ties(0.3)),
            BinaryOp::Maximum | BinaryOp::Minimum => (
                Dom::range(-8.0, 8.0).ties(0.3).nan(0.05),
                Dom::range(-8.0, 8.0).ties(0.3).nan(0.05),
            ),
            _ => (Dom::range(-8.0, 8.0), Dom::range(-8.0, 8.0)),
        },
    }
}

pub(super) fn g_binary<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome, shard: Shard) {
    for op in shard.of(BinaryOp::ALL) {
        let strat = (
            broadcast_shapes(4),
            select(dtypes_where(|d| op.supports(d))),
            any::<bool>(),
        )
            .prop_flat_map(move |((da, db), dtype, swap)| {
                let (ma, mb) = binary_doms(op, dtype);
                let (da, db) = if swap { (db, da) } else { (da, db) };
                (spec(da, dtype, ma, true), spec(db, dtype, mb, true))
            });
        p.run(out, &format!("binary {}", op.name()), strat, |(sa, sb)| {
            let (a, b) = (p.build(&sa)?, p.build(&sb)?);
            let (g, w) = both!(a, b => a.binary(op, b));
            p.expect(
                &format!("binary {} {}", op.name(), sa.dtype),
                &[("lhs", &a.0), ("rhs", &b.0)],
                g,
                w,
                &p.elem(sa.dtype),
            )
        });
    }
}

pub(super) fn g_binary_scalar<X: Backend, Y: Backend>(
    p: &Pair<X, Y>,
    out: &mut Outcome,
    shard: Shard,
) {
    for op in shard.of(BinaryOp::ALL) {
        let strat = (
            shapes(0, 4, 6),
            select(dtypes_where(|d| op.supports(d))),
            any::<bool>(),
            -8.0..8.0f64,
            any::<bool>(),
        )
            .prop_flat_map(move |(dims, dtype, scalar_lhs, raw, int)| {
                let raw = if int { raw.round() } else { raw };
                let (c, dom) = match (dtype, op) {
                    (DType::U8, _) => (
                        (raw.abs() * 32.0).round().min(255.0),
                        binary_doms(op, dtype).0,
                    ),
                    (DType::I64, BinaryOp::Div) => (raw.round(), Dom::range(-1000.0, 1000.0)),
                    (DType::I64, _) => ((raw * 125.0).round(), Dom::range(-1000.0, 1000.0)),
                    (_, BinaryOp::Div) if scalar_lhs => (raw, Dom::range(-8.0, 8.0).avoid(0.1)),
                    (_, BinaryOp::Div) => (
                        if raw.abs() < 0.1 { 0.5 } else { raw },
                        Dom::range(-8.0, 8.0),
                    ),
                    (_, BinaryOp::Pow) if scalar_lhs => {
                        (raw.abs() * 0.6 + 0.05, Dom::range(-3.0, 3.0))
                    }
                    (_, BinaryOp::Pow) => (raw * 0.375, Dom::range(0.05, 5.0)),
                    (_, BinaryOp::Maximum | BinaryOp::Minimum) => {
                        (raw, Dom::range(-8.0, 8.0).ties(0.3).nan(0.05))
                    }
                    _ => (raw, Dom::range(-8.0, 8.0)),
                };
                (Just((c, scalar_lhs)), spec(dims, dtype, dom, true))
            });
        p.run(
            out,
            &format!("binary_scalar {}", op.name()),
            strat,
            |((c, lhs), s)| {
                let a = p.build(&s)?;
                let (g, w) =
                    both!(a => if lhs { a.scalar_binary(op, c) } else { a.binary_scalar(op, c) });
                let what = if lhs {
                    format!("binary_scalar {}({c:?}, x) {}", op.name(), s.dtype)
                } else {
                    format!("binary_scalar {}(x, {c:?}) {}", op.name(), s.dtype)
                };
                p.expect(&what, &[("x", &a.0)], g, w, &p.elem(s.dtype))
            },
        );
    }
}

fn cmp_dom(dtype: DType) -> Dom {
    match dtype {
        DType::U8 => Dom::range(0.0, 6.0),
        DType::I64 => Dom::range(-5.0, 5.0),
        _ => Dom::range(-3.0, 3.0).ties(0.5).nan(0.05),
    }
}

pub(super) fn g_compare<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome, shard: Shard) {
    for op in shard.of(CmpOp::ALL) {
        let strat = (broadcast_shapes(4), select(ALL.to_vec()), any::<bool>()).prop_flat_map(
            |((da, db), dtype, swap)| {
                let (da, db) = if swap { (db, da) } else { (da, db) };
                (
                    spec(da, dtype, cmp_dom(dtype), true),
                    spec(db, dtype, cmp_dom(dtype), true),
                )
            },
        );
        p.run(out, &format!("compare {}", op.name()), strat, |(sa, sb)| {
            let (a, b) = (p.build(&sa)?, p.build(&sb)?);
            let (g, w) = both!(a, b => a.compare(op, b));
            p.expect(
                &format!("compare {} {}", op.name(), sa.dtype),
                &[("lhs", &a.0), ("rhs", &b.0)],
                g,
                w,
                &Tol::Bits,
            )
        });
    }
}

pub(super) fn g_where<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        broadcast_shapes(4),
        0..=4usize,
        prop::collection::vec(prop::bool::weighted(0.2), 4),
        select(ALL.to_vec()),
    )
        .prop_flat_map(|((dt, df), drop, ones, dtype)| {
            let full = if dt.len() >= df.len() {
                dt.clone()
            } else {
                df.clone()
            };
            let ones: Vec<bool> = ones
                .into_iter()
                .chain(std::iter::repeat(false))
                .take(full.len())
                .collect();
            let dc = operand_dims(&full, drop.min(full.len()), &ones);
            (
                // Any nonzero byte selects on_true.
                spec(dc, DType::U8, Dom::range(0.0, 2.0).ties(1.0), true),
                spec(dt, dtype, Dom::any(dtype), true),
                spec(df, dtype, Dom::any(dtype), true),
            )
        });
    p.run(out, "where_cond", strat, |(sc, st, sf)| {
        let (c, t, f) = (p.build(&sc)?, p.build(&st)?, p.build(&sf)?);
        let (g, w) = both!(c, t, f => c.where_cond(t, f));
        p.expect(
            &format!("where_cond {}", st.dtype),
            &[("cond", &c.0), ("on_true", &t.0), ("on_false", &f.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

/// Values of `from` that every backend casts to `to` the same way (no NaN or out-of-range
/// values into integers, whose C conversions are undefined).
fn cast_dom(from: DType, to: DType) -> Dom {
    match (from, to) {
        (DType::U8, _) => Dom::range(0.0, 255.0).ties(1.0),
        (DType::I64, DType::U8) => Dom::range(0.0, 255.0),
        // Large integers: i64 -> f32/f64 rounds.
        (DType::I64, _) => Dom::range(-1.1e12, 1.1e12).ties(0.0).specials(),
        (_, DType::U8) => Dom::range(0.0, 255.5).ties(0.3),
        (_, DType::I64) => Dom::range(-1e6, 1e6).ties(0.2),
        _ => Dom::range(-1e6, 1e6).specials(),
    }
}

pub(super) fn g_cast<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome, shard: Shard) {
    for from in shard.of(ALL) {
        for to in ALL {
            let strat = shapes(0, 4, 6)
                .prop_flat_map(move |dims| spec(dims, from, cast_dom(from, to), true));
            p.run(out, &format!("cast {from} -> {to}"), strat, |s| {
                let a = p.build(&s)?;
                // to_dtype skips the kernel when nothing changes; call it directly then.
                let (g, w) = if from == to {
                    both!(a => B_cast(a, to))
                } else {
                    both!(a => a.to_dtype(to))
                };
                p.expect(
                    &format!("cast {from} -> {to}"),
                    &[("x", &a.0)],
                    g,
                    w,
                    &Tol::Bits,
                )
            });
        }
    }
}

/// The backend's `cast` kernel called directly (same-dtype casts).
#[allow(non_snake_case)]
fn B_cast<B: Backend>(t: &Tensor<B>, to: DType) -> Result<Tensor<B>> {
    let s = B::cast(t.storage(), t.layout(), t.dtype(), to)?;
    Ok(Tensor::from_storage(s, t.shape().clone(), to))
}
