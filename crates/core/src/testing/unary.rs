//! Unary elementwise ops and their backward: each op's input domain, and the two checks.

use super::*;

fn unary_dom(op: UnaryOp, dtype: DType) -> Dom {
    if dtype == DType::I64 {
        return Dom::range(-1000.0, 1000.0);
    }
    match op {
        UnaryOp::Log | UnaryOp::Sqrt => Dom::range(1e-3, 50.0),
        UnaryOp::Recip => Dom::range(-8.0, 8.0).avoid(0.05),
        UnaryOp::Exp => Dom::range(-20.0, 20.0),
        UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Gelu => Dom::range(-10.0, 10.0),
        _ => Dom::range(-6.0, 6.0),
    }
}

pub(super) fn g_unary<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in UnaryOp::ALL {
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

pub(super) fn g_unary_backward<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in UnaryOp::ALL
        .into_iter()
        .filter(|op| op.grad_reads().is_some())
    {
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
