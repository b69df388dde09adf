//! Batched matmul.

use super::*;

fn mat_dim() -> BoxedStrategy<usize> {
    prop_oneof![
        1 => Just(0usize),
        2 => Just(1usize),
        8 => 2..=9usize,
        2 => 10..=33usize,
        1 => 34..=130usize
    ]
    .boxed()
}

pub(super) fn g_matmul<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        select(FLOATS.to_vec()),
        (mat_dim(), mat_dim(), mat_dim()),
        prop::collection::vec(
            prop_oneof![1 => Just(1usize), 2 => 2..=3usize, 1 => Just(0usize)],
            0..=2,
        ),
        (0..=2usize, 0..=2usize),
        (
            prop::collection::vec(prop::bool::weighted(0.3), 2),
            prop::collection::vec(prop::bool::weighted(0.3), 2),
        ),
        (prop::bool::weighted(0.12), prop::bool::weighted(0.12)),
    )
        .prop_flat_map(
            |(dtype, (m, k, n), batch, (drop_a, drop_b), (ones_a, ones_b), (a1, b1))| {
                let mut ones_a = ones_a;
                let mut ones_b = ones_b;
                ones_a.truncate(batch.len());
                ones_b.truncate(batch.len());
                let mut da = if a1 {
                    vec![]
                } else {
                    operand_dims(&batch, drop_a, &ones_a)
                };
                let mut db = if b1 {
                    vec![]
                } else {
                    operand_dims(&batch, drop_b, &ones_b)
                };
                if a1 {
                    da.push(k)
                } else {
                    da.extend([m, k])
                }
                if b1 {
                    db.push(k)
                } else {
                    db.extend([k, n])
                }
                let dom = Dom::range(-2.0, 2.0);
                (
                    Just(k),
                    spec(da, dtype, dom, true),
                    spec(db, dtype, dom, true),
                )
            },
        );
    p.run(out, "matmul", strat, |(k, sa, sb)| {
        let (a, b) = (p.build(&sa)?, p.build(&sb)?);
        let (g, w) = both!(a, b => a.matmul(b));
        let mag =
            a.1.abs()
                .and_then(|x| x.matmul(&b.1.abs()?))
                .and_then(|t| t.to_f64_vec())
                .ok();
        p.expect(
            &format!("matmul {}", sa.dtype),
            &[("lhs", &a.0), ("rhs", &b.0)],
            g,
            w,
            &p.accum(sa.dtype, k as f64 + 1.0, mag),
        )
    });
}
