//! Index ops: `index_select`, `gather`, `scatter_add`.

use super::*;

pub(super) fn g_index_select<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        shapes(1, 4, 6),
        select(ALL.to_vec()),
        any::<prop::sample::Index>(),
        prop_oneof![10 => 0..=8usize, 1 => 100..=2000usize],
        any::<bool>(),
    )
        .prop_flat_map(|(mut dims, dtype, ax, n_ids, neg)| {
            let axis = ax.index(dims.len());
            dims[axis] = dims[axis].max(1);
            // Keep the output below ~100k elements.
            let others: usize = dims.iter().product::<usize>() / dims[axis];
            let n_ids = n_ids.min(100_000 / others.max(1)).max(n_ids.min(1));
            let d = dims[axis] as f64;
            let axis_arg = if neg {
                axis as isize - dims.len() as isize
            } else {
                axis as isize
            };
            (
                Just(axis_arg),
                spec(dims, dtype, Dom::any(dtype), true),
                spec(
                    vec![n_ids],
                    DType::I64,
                    Dom::range(0.0, d - 1.0).ties(1.0),
                    true,
                ),
            )
        });
    p.run(out, "index_select", strat, |(axis, s, si)| {
        let (a, i) = (p.build(&s)?, p.build(&si)?);
        let (g, w) = both!(a, i => a.index_select(axis, i));
        p.expect(
            &format!("index_select axis {axis} {}", s.dtype),
            &[("x", &a.0), ("ids", &i.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

/// `(source dims, index dims, axis)` for gather/scatter_add: index dims no larger than the
/// source's off the axis, any length along it.
pub(super) fn index_shapes() -> BoxedStrategy<(Vec<usize>, Vec<usize>, usize)> {
    // Mostly small; sometimes a large source with a long index axis (other index dims capped
    // so the output stays below ~100k elements).
    let sizes = prop_oneof![
        12 => (shape(1, 4, 5), 0..=6usize, Just(usize::MAX)),
        1 => (big_shape(1), 100..=2000usize, Just(40usize)),
    ];
    (
        sizes,
        any::<prop::sample::Index>(),
        prop::collection::vec(0..=2usize, 4),
    )
        .prop_map(|((mut dims, along, cap), ax, shrink)| {
            let axis = ax.index(dims.len());
            dims[axis] = dims[axis].max(1);
            let ids: Vec<usize> = dims
                .iter()
                .enumerate()
                .map(|(i, &d)| {
                    if i == axis {
                        along
                    } else {
                        d.saturating_sub(shrink[i]).min(cap)
                    }
                })
                .collect();
            (dims, ids, axis)
        })
        .boxed()
}

pub(super) fn g_gather<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat =
        (index_shapes(), select(ALL.to_vec())).prop_flat_map(|((dims, ids, axis), dtype)| {
            let d = dims[axis] as f64;
            (
                Just(axis),
                spec(dims, dtype, Dom::any(dtype), true),
                spec(ids, DType::I64, Dom::range(0.0, d - 1.0).ties(1.0), true),
            )
        });
    p.run(out, "gather", strat, |(axis, s, si)| {
        let (a, i) = (p.build(&s)?, p.build(&si)?);
        let (g, w) = both!(a, i => a.gather(axis as isize, i));
        p.expect(
            &format!("gather axis {axis} {}", s.dtype),
            &[("x", &a.0), ("ids", &i.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

pub(super) fn g_scatter_add<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let dtypes = vec![DType::F32, DType::F64, DType::I64];
    let strat = (index_shapes(), select(dtypes)).prop_flat_map(|((dims, ids, axis), dtype)| {
        let d = dims[axis] as f64;
        let dom = if dtype == DType::I64 {
            Dom::range(-1000.0, 1000.0)
        } else {
            Dom::range(-8.0, 8.0)
        };
        (
            Just(axis),
            spec(dims, dtype, dom, true),
            spec(
                ids.clone(),
                DType::I64,
                Dom::range(0.0, d - 1.0).ties(1.0),
                true,
            ),
            // The source must not be broadcast in ways that differ from ids: any view is fine.
            spec(ids, dtype, dom, true),
        )
    });
    p.run(out, "scatter_add", strat, |(axis, sb, si, ss)| {
        let (b, i, s) = (p.build(&sb)?, p.build(&si)?, p.build(&ss)?);
        let (g, w) = both!(b, i, s => b.scatter_add(axis as isize, i, s));
        // Summation order is unspecified: bound by the count and sizes of the terms.
        let mag =
            b.1.abs()
                .and_then(|bb| bb.scatter_add(axis as isize, &i.1, &s.1.abs()?))
                .and_then(|t| t.to_f64_vec())
                .ok();
        let k = si.dims[axis] as f64 + 1.0;
        p.expect(
            &format!("scatter_add axis {axis} {}", sb.dtype),
            &[("base", &b.0), ("ids", &i.0), ("src", &s.0)],
            g,
            w,
            &p.accum(sb.dtype, k, mag),
        )
    });
}
