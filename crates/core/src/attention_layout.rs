//! The layouts a fused attention backend gives its outputs ([`Backend::attention_forward`],
//! [`Backend::attention_backward`]): shared by the backends that write them and the tests
//! that check them.
//!
//! [`Backend::attention_forward`]: crate::Backend::attention_forward
//! [`Backend::attention_backward`]: crate::Backend::attention_backward

use crate::{Layout, Shape};

/// The layout of a fused attention output of shape `shape` (`[batch.., H, T, c]`) computed
/// from an operand laid out as `like` (same rank): when `like`'s head axis (rank-3) has a
/// smaller stride than its `T` axis — the `[.., T, H, d]` projection viewed as `[.., H, T, d]`,
/// as multi-head attention makes it — the output is the `[.., H, T, c]` view of a fresh
/// row-major `[.., T, H, c]` buffer, so that the caller's transpose back to `[.., T, H, c]`
/// (and the reshape to `[.., T, H·c]`) is free; otherwise it is contiguous. Offset 0 and no
/// gaps either way: the storage holds exactly `shape`'s elements.
///
/// Why: attention between per-head projections is where a transformer's copies come from
/// (kernels that write `[.., H, T, d]` force one copy per operand and gradient around them);
/// PyTorch's fused kernels write the caller's `[B, T, H, d]` in place the same way.
pub fn attention_output_layout(like: &Layout, shape: &Shape) -> Layout {
    let r = shape.rank();
    let heads_last = r >= 3
        && like.rank() == r
        && shape.dims()[r - 3] > 1
        && like.strides()[r - 3] < like.strides()[r - 2];
    if !heads_last {
        return Layout::contiguous(shape.clone());
    }
    let mut phys = shape.dims().to_vec();
    phys.swap(r - 3, r - 2);
    Layout::contiguous(Shape::new(phys))
        .transpose(r - 3, r - 2)
        .expect("axes in range")
}

/// When `q`, `k` and `v` are views of one storage with the same shape and strides, offset by
/// `base`, `base + δ` and `base + 2δ`, such that together they cover `3n` elements with no gap
/// and no overlap (the three `[.., H, T, d]` head views of a `[.., T, 3E]` projection, or of a
/// `[.., T, 3, H, d]` one): the element count `3n` of a buffer that holds their three
/// gradients and the three layouts in it (theirs, less `base`). `None` otherwise (the caller
/// must also check that the three share a storage).
pub fn attention_packed_layouts(
    q: &Layout,
    k: &Layout,
    v: &Layout,
) -> Option<(usize, [Layout; 3])> {
    if q.shape() != k.shape() || q.shape() != v.shape() || q.strides() != k.strides() {
        return None;
    }
    if q.strides() != v.strides() || k.offset() < q.offset() {
        return None;
    }
    let (base, delta) = (q.offset(), k.offset() - q.offset());
    if delta == 0 || v.offset() != k.offset() + delta {
        return None;
    }
    // With an axis of size 3 and stride δ added, the elements must tile [base, base + 3n).
    let mut axes: Vec<(usize, usize)> = q
        .dims()
        .iter()
        .zip(q.strides())
        .filter(|(d, _)| **d > 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    axes.push((3, delta));
    axes.sort_by_key(|&(_, s)| std::cmp::Reverse(s));
    let mut expect = 1;
    for &(d, s) in axes.iter().rev() {
        if s != expect {
            return None;
        }
        expect *= d;
    }
    let rebase = |l: &Layout| Layout::from_parts(l.shape().clone(), l.strides(), l.offset() - base);
    Some((expect, [rebase(q), rebase(k), rebase(v)]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[b, h, t, d]` head view `i` of a row-major `[b, t, 3·h·d + pad]` projection.
    fn head_view(b: usize, t: usize, h: usize, d: usize, pad: usize, i: usize) -> Layout {
        let w = 3 * h * d + pad;
        Layout::from_parts(
            Shape::new(vec![b, h, t, d]),
            vec![t * w, d, w, 1],
            i * h * d,
        )
    }

    #[test]
    fn head_views_get_heads_last_outputs() {
        let q = head_view(2, 5, 3, 4, 0, 0);
        let o = attention_output_layout(&q, &Shape::new(vec![2, 3, 5, 8]));
        assert_eq!(o.strides(), [5 * 3 * 8, 8, 3 * 8, 1]);
        assert_eq!(o.offset(), 0);
        let c = Layout::contiguous(Shape::new(vec![2, 3, 5, 4]));
        let o = attention_output_layout(&c, c.shape());
        assert!(o.is_contiguous());
        // Rank 2: nothing to mirror.
        let r2 = Layout::contiguous(Shape::new(vec![5, 4]));
        assert!(attention_output_layout(&r2, r2.shape()).is_contiguous());
    }

    #[test]
    fn packed_head_views_share_one_gradient_buffer() {
        let (b, t, h, d) = (2, 5, 3, 4);
        let v = |pad, i| head_view(b, t, h, d, pad, i);
        let (n, ls) = attention_packed_layouts(&v(0, 0), &v(0, 1), &v(0, 2)).expect("packed");
        assert_eq!(n, b * t * 3 * h * d);
        for (i, l) in ls.iter().enumerate() {
            assert_eq!(l.offset(), i * h * d);
            assert_eq!(l.strides(), v(0, i).strides());
        }
        // A gap between rows, the same view three times, another order: not packed.
        assert!(attention_packed_layouts(&v(4, 0), &v(4, 1), &v(4, 2)).is_none());
        assert!(attention_packed_layouts(&v(0, 0), &v(0, 0), &v(0, 0)).is_none());
        assert!(attention_packed_layouts(&v(0, 1), &v(0, 0), &v(0, 2)).is_none());
        // Contiguous [3, b, h, t, d] slices tile too (offset by one operand each).
        let c = |i: usize| {
            let l = Layout::contiguous(Shape::new(vec![b, h, t, d]));
            Layout::from_parts(l.shape().clone(), l.strides(), i * b * h * t * d)
        };
        assert!(attention_packed_layouts(&c(0), &c(1), &c(2)).is_some());
    }
}
