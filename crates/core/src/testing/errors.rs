//! Errors a backend alone can detect: indices and labels out of range.

use super::index::index_shapes;
use super::*;

/// The subject must reject an out-of-range index with `IndexOutOfRange` naming the op and the
/// index.
fn expect_index_error<X: Backend>(op: &str, bad: i64, r: Result<Tensor<X>>) -> Check {
    match r {
        Ok(t) => Err(format!(
            "{op} with index {bad} out of range returned a {} tensor instead of an error",
            t.shape()
        )),
        Err(Error::IndexOutOfRange { op: o, index, .. }) if o == op && index == bad => Ok(()),
        Err(e) => Err(format!(
            "{op} with index {bad} out of range: expected Error::IndexOutOfRange naming them, got {e:?} (\"{e}\")"
        )),
    }
}

pub(super) fn g_index_errors<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        index_shapes(),
        select(FLOATS.to_vec()),
        any::<prop::sample::Index>(),
        0..4usize,
        prop::bool::weighted(0.3),
    )
        .prop_filter("needs an index", |((_, ids, _), ..)| {
            ids.iter().product::<usize>() > 0
        })
        .prop_map(|((dims, ids, axis), dtype, at, beyond, negative)| {
            let d = dims[axis] as i64;
            let bad = if negative {
                -1 - beyond as i64
            } else {
                d + beyond as i64
            };
            (dims, ids, axis, dtype, at, bad)
        });
    p.run(
        out,
        "index errors",
        strat,
        |(dims, id_dims, axis, dtype, at, bad)| {
            let x = Tensor::<X>::zeros(dims.clone(), dtype, &p.dx).map_err(msg)?;
            let n: usize = id_dims.iter().product();
            let mut ids = vec![0i64; n];
            ids[at.index(n)] = bad;
            let idt = Tensor::<X>::from_vec(ids.clone(), id_dims.clone(), &p.dx).map_err(msg)?;
            let src = Tensor::<X>::ones(id_dims.clone(), dtype, &p.dx).map_err(msg)?;
            let ax = axis as isize;
            let sel = Tensor::<X>::from_vec(ids.clone(), n, &p.dx).map_err(msg)?;
            expect_index_error("index_select", bad, x.index_select(ax, &sel))?;
            expect_index_error("gather", bad, x.gather(ax, &idt))?;
            expect_index_error("scatter_add", bad, x.scatter_add(ax, &idt, &src))?;
            // Labels of cross_entropy (and its backward) outside 0..c.
            let c = dims[axis].clamp(1, 64);
            let n = n.min(64);
            let logits = Tensor::<X>::zeros([n, c], dtype, &p.dx).map_err(msg)?;
            let bad_label = if bad < 0 {
                bad
            } else {
                c as i64 + (bad - dims[axis] as i64)
            };
            // (`n` rows, one bad label.)
            let mut labels = vec![0i64; n];
            labels[at.index(n)] = bad_label;
            let labels = Tensor::<X>::from_vec(labels, n, &p.dx).map_err(msg)?;
            let grad = Tensor::<X>::ones(n, dtype, &p.dx).map_err(msg)?;
            expect_index_error(
                "cross_entropy",
                bad_label,
                logits.cross_entropy(&labels, Reduction::None),
            )?;
            expect_index_error(
                "cross_entropy_backward",
                bad_label,
                logits.cross_entropy_backward(&labels, &grad),
            )
        },
    );
}
