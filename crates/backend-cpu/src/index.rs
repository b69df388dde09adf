//! Indexing kernels: `index_select`, `gather`, `scatter_add`.
//!
//! An index outside its axis is an [`Error::IndexOutOfRange`] that names the op, the bad index
//! and the axis's size; no partial result escapes. `index_select` copies whole
//! sub-blocks (rows of an embedding table, say) and runs in parallel; `gather` and `scatter_add`
//! walk the indices with one strided plan over the indices, the source and the output.
//! `scatter_add` runs sequentially, so its sums are deterministic on the CPU.

use kiln_core::{DType, Error, Layout, Result, Shape};

use crate::elementwise::{dtype_err, slice};
use crate::storage::{CpuElem, CpuStorage, alloc, storage};
use crate::strided::{Plan, copy_strided, par_out};

fn out_of_range(op: &'static str, id: i64, size: usize) -> Error {
    Error::IndexOutOfRange {
        op,
        index: id,
        size,
    }
}

fn check_rank(op: &'static str, layout: &Layout, axis: usize) -> Result<()> {
    if axis >= layout.rank() {
        return Err(Error::AxisOutOfRange {
            op,
            axis: axis as isize,
            rank: layout.rank(),
        });
    }
    Ok(())
}

/// `ids` may differ from `shape` only along `axis`, and not exceed it elsewhere.
fn check_index_shape(op: &'static str, shape: &Shape, ids: &Shape, axis: usize) -> Result<()> {
    let ok = ids.rank() == shape.rank()
        && (0..shape.rank()).all(|i| i == axis || ids.dims()[i] <= shape.dims()[i]);
    if !ok {
        return Err(Error::ShapeMismatch {
            op,
            lhs: shape.clone(),
            rhs: ids.clone(),
        });
    }
    Ok(())
}

fn index_select_t<T: CpuElem>(
    s: &CpuStorage,
    layout: &Layout,
    ids: &[usize],
    axis: usize,
) -> Result<CpuStorage> {
    let x = slice::<T>("index_select", s)?;
    let (dims, strides) = (layout.dims(), layout.strides());
    let pre = Layout::from_parts(Shape::new(&dims[..axis]), &strides[..axis], layout.offset());
    let post = Layout::from_parts(Shape::new(&dims[axis + 1..]), &strides[axis + 1..], 0);
    let block = post.elem_count();
    let pre_n = pre.elem_count();
    // Saturating: a product past usize is reported by `alloc` as an impossible size.
    let n = pre_n.saturating_mul(ids.len()).saturating_mul(block);
    let mut out = alloc::<T>("index_select", s.device(), n)?;
    if out.is_empty() {
        return Ok(storage(s.device(), out));
    }
    let mut pre_offs = Vec::with_capacity(pre_n);
    let pre_plan = Plan::new([&pre]);
    pre_plan.for_runs(0..pre_plan.runs(), |_, [o]| {
        pre_offs.extend((0..pre_plan.run_len()).map(|i| o + i * pre_plan.run_stride(0)));
    });
    let post_plan = Plan::new([&post]);
    let (plen, pstride) = (post_plan.run_len(), post_plan.run_stride(0));
    let sa = strides[axis];
    par_out(&mut out, block, |s0, o| {
        for (k, ob) in o.chunks_mut(block).enumerate() {
            let b = s0 / block + k;
            let base = pre_offs[b / ids.len()] + ids[b % ids.len()] * sa;
            post_plan.for_runs(0..post_plan.runs(), |r, [po]| {
                let dst = &mut ob[r * plen..(r + 1) * plen];
                let st = base + po;
                if pstride == 1 {
                    dst.copy_from_slice(&x[st..st + plen]);
                } else {
                    for (i, d) in dst.iter_mut().enumerate() {
                        *d = x[st + i * pstride];
                    }
                }
            });
        }
    });
    Ok(storage(s.device(), out))
}

pub(crate) fn index_select(
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
    ids: &CpuStorage,
    ids_layout: &Layout,
    axis: usize,
) -> Result<CpuStorage> {
    const OP: &str = "index_select";
    check_rank(OP, layout, axis)?;
    if ids_layout.rank() != 1 {
        return Err(Error::invalid(
            OP,
            format!("indices must be 1-d, got shape {}", ids_layout.shape()),
        ));
    }
    let iv = slice::<i64>(OP, ids)?;
    let size = layout.dims()[axis];
    let mut checked = Vec::with_capacity(ids_layout.elem_count());
    for o in ids_layout.offsets() {
        let id = iv[o];
        if id < 0 || id as usize >= size {
            return Err(out_of_range(OP, id, size));
        }
        checked.push(id as usize);
    }
    match dtype {
        DType::F32 => index_select_t::<f32>(s, layout, &checked, axis),
        DType::F64 => index_select_t::<f64>(s, layout, &checked, axis),
        DType::I64 => index_select_t::<i64>(s, layout, &checked, axis),
        DType::U8 => index_select_t::<u8>(s, layout, &checked, axis),
        DType::F16 => index_select_t::<kiln_core::f16>(s, layout, &checked, axis),
        DType::BF16 => index_select_t::<kiln_core::bf16>(s, layout, &checked, axis),
        _ => Err(dtype_err(OP, "f32, f64, i64 or u8", dtype)),
    }
}

/// Calls `f(index position, id, ids-dims multi-index offset in other, ...)` for every index,
/// after checking it against `0..size`: walks `ids` jointly with `other` (a layout of `ids`'s
/// shape whose `axis` stride is 0) and `extra`.
#[allow(clippy::too_many_arguments)]
fn walk_ids(
    op: &'static str,
    iv: &[i64],
    ids_layout: &Layout,
    other: &Layout,
    extra: &Layout,
    size: usize,
    mut f: impl FnMut(usize, usize, usize),
) -> Result<()> {
    let plan = Plan::new([ids_layout, other, extra]);
    let len = plan.run_len();
    let st = [plan.run_stride(0), plan.run_stride(1), plan.run_stride(2)];
    let mut err = None;
    plan.for_runs(0..plan.runs(), |_, [oi, oo, oe]| {
        if err.is_some() {
            return;
        }
        for i in 0..len {
            let id = iv[oi + i * st[0]];
            if id < 0 || id as usize >= size {
                err = Some(out_of_range(op, id, size));
                return;
            }
            f(id as usize, oo + i * st[1], oe + i * st[2]);
        }
    });
    err.map_or(Ok(()), Err)
}

/// `layout`'s strides and offset over `shape`, with the `axis` stride zeroed.
fn along(layout_strides: &[usize], offset: usize, shape: &Shape, axis: usize) -> Layout {
    let mut st = layout_strides.to_vec();
    st[axis] = 0;
    Layout::from_parts(shape.clone(), st, offset)
}

fn gather_t<T: CpuElem>(
    s: &CpuStorage,
    layout: &Layout,
    iv: &[i64],
    ids_layout: &Layout,
    axis: usize,
) -> Result<CpuStorage> {
    const OP: &str = "gather";
    let x = slice::<T>(OP, s)?;
    let n = ids_layout.elem_count();
    let mut out = alloc::<T>(OP, s.device(), n)?;
    if n == 0 {
        return Ok(storage(s.device(), out));
    }
    let src = along(layout.strides(), layout.offset(), ids_layout.shape(), axis);
    let dst = Layout::contiguous(ids_layout.shape().clone());
    let sa = layout.strides()[axis];
    walk_ids(
        OP,
        iv,
        ids_layout,
        &src,
        &dst,
        layout.dims()[axis],
        |id, so, o| {
            out[o] = x[so + id * sa];
        },
    )?;
    Ok(storage(s.device(), out))
}

pub(crate) fn gather(
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
    ids: &CpuStorage,
    ids_layout: &Layout,
    axis: usize,
) -> Result<CpuStorage> {
    const OP: &str = "gather";
    check_rank(OP, layout, axis)?;
    check_index_shape(OP, layout.shape(), ids_layout.shape(), axis)?;
    let iv = slice::<i64>(OP, ids)?;
    match dtype {
        DType::F32 => gather_t::<f32>(s, layout, iv, ids_layout, axis),
        DType::F64 => gather_t::<f64>(s, layout, iv, ids_layout, axis),
        DType::I64 => gather_t::<i64>(s, layout, iv, ids_layout, axis),
        DType::U8 => gather_t::<u8>(s, layout, iv, ids_layout, axis),
        DType::F16 => gather_t::<kiln_core::f16>(s, layout, iv, ids_layout, axis),
        DType::BF16 => gather_t::<kiln_core::bf16>(s, layout, iv, ids_layout, axis),
        _ => Err(dtype_err(OP, crate::elementwise::ALL_DTYPES, dtype)),
    }
}

#[allow(clippy::too_many_arguments)]
fn scatter_add_t<T: CpuElem>(
    base: &CpuStorage,
    base_layout: &Layout,
    iv: &[i64],
    ids_layout: &Layout,
    src: &CpuStorage,
    src_layout: &Layout,
    axis: usize,
    add: impl Fn(T, T) -> T,
) -> Result<CpuStorage> {
    const OP: &str = "scatter_add";
    let b = slice::<T>(OP, base)?;
    let x = slice::<T>(OP, src)?;
    let mut out = alloc::<T>(OP, base.device(), base_layout.elem_count())?;
    copy_strided(
        b,
        base_layout,
        &mut out,
        &Layout::contiguous(base_layout.shape().clone()),
    );
    if ids_layout.elem_count() == 0 {
        return Ok(storage(base.device(), out));
    }
    let cstrides = base_layout.shape().contiguous_strides();
    let dst = along(&cstrides, 0, ids_layout.shape(), axis);
    let sa = cstrides[axis];
    walk_ids(
        OP,
        iv,
        ids_layout,
        &dst,
        src_layout,
        base_layout.dims()[axis],
        |id, o, so| {
            let t = o + id * sa;
            out[t] = add(out[t], x[so]);
        },
    )?;
    Ok(storage(base.device(), out))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_add(
    base: &CpuStorage,
    base_layout: &Layout,
    dtype: DType,
    ids: &CpuStorage,
    ids_layout: &Layout,
    src: &CpuStorage,
    src_layout: &Layout,
    axis: usize,
) -> Result<CpuStorage> {
    const OP: &str = "scatter_add";
    check_rank(OP, base_layout, axis)?;
    check_index_shape(OP, base_layout.shape(), ids_layout.shape(), axis)?;
    if ids_layout.shape() != src_layout.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: ids_layout.shape().clone(),
            rhs: src_layout.shape().clone(),
        });
    }
    let iv = slice::<i64>(OP, ids)?;
    let (bl, il, sl) = (base_layout, ids_layout, src_layout);
    match dtype {
        DType::F32 => scatter_add_t::<f32>(base, bl, iv, il, src, sl, axis, |a, b| a + b),
        DType::F64 => scatter_add_t::<f64>(base, bl, iv, il, src, sl, axis, |a, b| a + b),
        DType::I64 => scatter_add_t::<i64>(base, bl, iv, il, src, sl, axis, i64::wrapping_add),
        DType::U8 => scatter_add_t::<u8>(base, bl, iv, il, src, sl, axis, u8::wrapping_add),
        _ => Err(dtype_err(OP, "f32, f64, i64 or u8", dtype)),
    }
}
