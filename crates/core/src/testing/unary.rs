//! The op tables' ops: every unary op and its backward, every composite op, each sampled where
//! its table entry says.

use super::*;

/// Where the op table says `op` is sampled (i64: any moderate integer).
fn unary_dom(op: UnaryOp, dtype: DType) -> Dom {
    if dtype == DType::I64 {
        return Dom::range(-1000.0, 1000.0);
    }
    let d = op.domain();
    Dom::range(d.lo, d.hi).avoid(d.avoid)
}

pub(super) fn g_unary<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome, shard: Shard) {
    for op in shard.of(UnaryOp::ALL) {
        let strat = (shapes(0, 4, 6), select(dtypes_where(|d| op.supports(d))))
            .prop_flat_map(move |(dims, dtype)| spec(dims, dtype, unary_dom(op, dtype), true));
        p.run(out, &format!("unary {}", op.name()), strat, |s| {
            let a = p.build(&s)?;
            let (g, w) = both!(a => a.unary(op));
            p.expect(
                &format!("unary {} {}", op.name(), s.dtype),
                &[("x", &a.0)],
                g,
                w,
                &p.elem(s.dtype),
            )
        });
    }
}

pub(super) fn g_unary_backward<X: Backend, Y: Backend>(
    p: &Pair<X, Y>,
    out: &mut Outcome,
    shard: Shard,
) {
    for op in shard.of(UnaryOp::ALL) {
        let strat = (shapes(0, 4, 6), select(dtypes_where(|d| d.is_float()))).prop_flat_map(
            move |(dims, dtype)| {
                (
                    spec(dims.clone(), dtype, unary_dom(op, dtype), true),
                    spec(dims, dtype, Dom::range(-4.0, 4.0), true),
                )
            },
        );
        p.run(
            out,
            &format!("unary_backward {}", op.name()),
            strat,
            |(ss, sg)| {
                let (s, g) = (p.build(&ss)?, p.build(&sg)?);
                let (got, want) = both!(s, g => s.unary_backward(op, g));
                p.expect(
                    &format!("unary_backward {} {}", op.name(), ss.dtype),
                    &[("saved", &s.0), ("g", &g.0)],
                    got,
                    want,
                    &p.elem(ss.dtype),
                )
            },
        );
    }
}

pub(super) fn g_composite<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for &op in CompositeOp::ALL {
        let d = op.domain();
        let strat = (shapes(0, 4, 6), select(dtypes_where(|d| d.is_float())))
            .prop_flat_map(move |(dims, dtype)| spec(dims, dtype, Dom::range(d.lo, d.hi), true));
        p.run(out, &format!("composite {}", op.name()), strat, |s| {
            let a = p.build(&s)?;
            let (g, w) = both!(a => a.composite(op, op.test_params()));
            p.expect(
                &format!("composite {} {}", op.name(), s.dtype),
                &[("x", &a.0)],
                g,
                w,
                &p.elem(s.dtype),
            )
        });
    }
}
