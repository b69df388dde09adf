//! Indexing along an axis: `index_select`, `gather`, `scatter_add`.

use kiln_core::{DType, Layout, Result};

use crate::launch::{Args, collapse};
use crate::memory::{Buffer, alloc};
use crate::ops::{BLOCK, Module, check_ids, contiguous, run, same_device, tname};

/// The kernel type of a selection or gather of `dtype`: its own, or `u16` for the 16-bit
/// floats (their elements are moved, not computed on; a skipped element is 0 bits, +0.0).
fn moved(dtype: DType) -> &'static str {
    if dtype.is_half() { "u16" } else { tname(dtype) }
}

fn zero_axis(l: &Layout, axis: usize) -> Vec<usize> {
    let mut s = l.strides().to_vec();
    s[axis] = 0;
    s
}

pub(crate) fn index_select(
    x: &Buffer,
    l: &Layout,
    dtype: DType,
    ids: &Buffer,
    li: &Layout,
    axis: usize,
) -> Result<Buffer> {
    const OP: &str = "index_select";
    same_device(OP, x, ids)?;
    let dev = x.state();
    dev.bind()?;
    let nids = li.elem_count();
    let mut od = l.dims().to_vec();
    od[axis] = nids;
    let n: usize = od.iter().product();
    let out = alloc(dev, n * dtype.size_in_bytes())?;
    if n == 0 {
        return Ok(out);
    }
    let post: usize = od[axis + 1..].iter().product();
    let row_bytes = post * dtype.size_in_bytes();
    let src = x.device_ptr() + (l.offset() * dtype.size_in_bytes()) as u64;
    if l.is_contiguous() && row_bytes.is_multiple_of(16) && src.is_multiple_of(16) {
        // Whole rows of 16-byte vectors (an embedding lookup): a warp copies each.
        let rows = n / post;
        let mut a = Args::new();
        a.push(src)
            .push(ids.device_ptr())
            .push(out.device_ptr())
            .push(rows as u64)
            .push((row_bytes / 16) as u64)
            .push(l.dims()[axis] as u64)
            .push(nids as u64)
            .push(li.offset() as u64)
            .push(li.strides().first().copied().unwrap_or(0) as u64)
            .push(dev.err_flag());
        run(
            dev,
            OP,
            Module::Index,
            &["index_select_rows", moved(dtype)],
            dev.grid_1d(rows as u64 * 32, BLOCK),
            BLOCK,
            0,
            &mut a,
        )?;
    } else {
        index_select_elements(x, l, dtype, ids, li, axis, &od, &out)?;
    }
    check_ids(dev, OP, ids, li, l.dims()[axis])?;
    if let Some(bound) = x.known_id_bound(l) {
        out.mark_all_ids_below(bound);
    }
    Ok(out)
}

/// [`index_select`] element by element into `out` (dims `od`), for any layout.
#[allow(clippy::too_many_arguments)]
fn index_select_elements(
    x: &Buffer,
    l: &Layout,
    dtype: DType,
    ids: &Buffer,
    li: &Layout,
    axis: usize,
    od: &[usize],
    out: &Buffer,
) -> Result<()> {
    const OP: &str = "index_select";
    let dev = x.state();
    let n: usize = od.iter().product();
    let nids = od[axis];
    let post: usize = od[axis + 1..].iter().product();
    let sx = zero_axis(l, axis);
    let (d, sxs) = collapse(OP, od, &[&sx], &[l.offset()])?;
    let mut a = Args::new();
    a.push(x.device_ptr())
        .push(ids.device_ptr())
        .push(out.device_ptr())
        .push(n as u64)
        .push(d)
        .push(sxs[0])
        .push(l.strides()[axis] as u64)
        .push(l.dims()[axis] as u64)
        .push(post as u64)
        .push(nids as u64)
        .push(li.offset() as u64)
        .push(li.strides().first().copied().unwrap_or(0) as u64)
        .push(dev.err_flag());
    run(
        dev,
        OP,
        Module::Index,
        &["index_select", moved(dtype)],
        dev.grid_1d(n as u64, BLOCK),
        BLOCK,
        0,
        &mut a,
    )
}

pub(crate) fn gather(
    x: &Buffer,
    l: &Layout,
    dtype: DType,
    ids: &Buffer,
    li: &Layout,
    axis: usize,
) -> Result<Buffer> {
    const OP: &str = "gather";
    same_device(OP, x, ids)?;
    let dev = x.state();
    dev.bind()?;
    let n = li.elem_count();
    let out = alloc(dev, n * dtype.size_in_bytes())?;
    if n == 0 {
        return Ok(out);
    }
    let sx = zero_axis(l, axis);
    let (d, ss) = collapse(
        OP,
        li.dims(),
        &[&sx, li.strides()],
        &[l.offset(), li.offset()],
    )?;
    let mut a = Args::new();
    a.push(x.device_ptr())
        .push(ids.device_ptr())
        .push(out.device_ptr())
        .push(n as u64)
        .push(d)
        .push(ss[0])
        .push(ss[1])
        .push(l.strides()[axis] as u64)
        .push(l.dims()[axis] as u64)
        .push(dev.err_flag());
    run(
        dev,
        OP,
        Module::Index,
        &["gather", moved(dtype)],
        dev.grid_1d(n as u64, BLOCK),
        BLOCK,
        0,
        &mut a,
    )?;
    check_ids(dev, OP, ids, li, l.dims()[axis])?;
    if let Some(bound) = x.known_id_bound(l) {
        out.mark_all_ids_below(bound);
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_add(
    base: &Buffer,
    lb: &Layout,
    dtype: DType,
    ids: &Buffer,
    li: &Layout,
    src: &Buffer,
    ls: &Layout,
    axis: usize,
) -> Result<Buffer> {
    const OP: &str = "scatter_add";
    same_device(OP, base, ids)?;
    same_device(OP, base, src)?;
    let dev = base.state();
    dev.bind()?;
    let out = contiguous(base, lb, dtype)?;
    let n = li.elem_count();
    if n == 0 {
        return Ok(out);
    }
    let cols = lb.dims().get(1).copied().unwrap_or(0);
    let src_ptr = src.device_ptr() + (ls.offset() * dtype.size_in_bytes()) as u64;
    if dtype == DType::F32
        && axis == 0
        && lb.rank() == 2
        && li.rank() == 2
        && li.dims() == ls.dims()
        && li.dims()[1] == cols
        && li.strides()[1] == 0
        && ls.strides() == [cols, 1]
        && (cols * 4).is_multiple_of(16)
        && src_ptr.is_multiple_of(16)
    {
        // Whole f32 rows of 16-byte vectors, one id a row (an embedding's backward): a warp
        // adds each row.
        let rows = li.dims()[0];
        let mut a = Args::new();
        a.push(ids.device_ptr())
            .push(src_ptr)
            .push(out.device_ptr())
            .push(rows as u64)
            .push((cols / 4) as u64)
            .push(lb.dims()[0] as u64)
            .push(li.offset() as u64)
            .push(li.strides()[0] as u64)
            .push(dev.err_flag());
        run(
            dev,
            OP,
            Module::Index,
            &["scatter_add_rows", "float"],
            dev.grid_1d(rows as u64 * 32, BLOCK),
            BLOCK,
            0,
            &mut a,
        )?;
        check_ids(dev, OP, ids, li, lb.dims()[axis])?;
        return Ok(out);
    }
    let ol = Layout::contiguous(lb.shape().clone());
    let sy = zero_axis(&ol, axis);
    let (d, ss) = collapse(
        OP,
        li.dims(),
        &[&sy, li.strides(), ls.strides()],
        &[0, li.offset(), ls.offset()],
    )?;
    let mut a = Args::new();
    a.push(ids.device_ptr())
        .push(src.device_ptr())
        .push(out.device_ptr())
        .push(n as u64)
        .push(d)
        .push(ss[0])
        .push(ss[1])
        .push(ss[2])
        .push(ol.strides()[axis] as u64)
        .push(lb.dims()[axis] as u64)
        .push(dev.err_flag());
    run(
        dev,
        OP,
        Module::Index,
        &["scatter_add", tname(dtype)],
        dev.grid_1d(n as u64, BLOCK),
        BLOCK,
        0,
        &mut a,
    )?;
    check_ids(dev, OP, ids, li, lb.dims()[axis])?;
    Ok(out)
}
