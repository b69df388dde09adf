//! Ops over the rows of the last axis: softmax and cross-entropy.

use kiln_core::{DType, Error, Layout, Result};

use crate::launch::{Args, Dims, Strides, collapse};
use crate::memory::{Buffer, alloc};
use crate::ops::reduce::block_for;
use crate::ops::{Module, check_ids, run, same_device, tname};

// ---- rows: softmax and cross-entropy ---------------------------------------------------------

/// Leading dims of a row-major problem over the last axis: (rows, cols, row dims, row strides,
/// last stride).
fn rows_of(op: &'static str, l: &Layout) -> Result<(usize, usize, Dims, Strides, u64)> {
    let r = l.rank();
    let cols = l.dims()[r - 1];
    let rows: usize = l.dims()[..r - 1].iter().product();
    let (d, s) = collapse(
        op,
        &l.dims()[..r - 1],
        &[&l.strides()[..r - 1]],
        &[l.offset()],
    )?;
    Ok((rows, cols, d, s[0], l.strides()[r - 1] as u64))
}

pub(crate) fn softmax(s: &Buffer, l: &Layout, dtype: DType, log: bool) -> Result<Buffer> {
    let op = if log { "log_softmax" } else { "softmax" };
    let dev = s.state();
    dev.bind()?;
    let out = alloc(dev, l.elem_count() * dtype.size_in_bytes())?;
    if l.elem_count() == 0 {
        return Ok(out);
    }
    let (rows, cols, d, st, cs) = rows_of(op, l)?;
    // The row cache holds the compute type (f32 for the 16-bit floats).
    let row_bytes = cols * dtype.compute_dtype().size_in_bytes();
    let smem = row_bytes <= 48 * 1024;
    let block = block_for((cols / 32) as u64, 256);
    let mut a = Args::new();
    a.push(s.device_ptr())
        .push(out.device_ptr())
        .push(rows as u64)
        .push(cols as u64)
        .push(d)
        .push(st)
        .push(cs)
        .push(log as i32)
        .push(smem as i32);
    let grid = (rows.min(dev.sm_count() as usize * 32) as u32, 1);
    let shared = if smem { row_bytes as u32 } else { 0 };
    run(
        dev,
        op,
        Module::Softmax,
        &["softmax", tname(dtype)],
        grid,
        block,
        shared,
        &mut a,
    )?;
    Ok(out)
}

pub(crate) fn cross_entropy(
    x: &Buffer,
    lx: &Layout,
    labels: &Buffer,
    ll: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    const OP: &str = "cross_entropy";
    same_device(OP, x, labels)?;
    let dev = x.state();
    dev.bind()?;
    let (rows, cols, d, st, cs) = rows_of(OP, lx)?;
    let out = alloc(dev, rows * dtype.size_in_bytes())?;
    if rows == 0 {
        return Ok(out);
    }
    if cols == 0 {
        return Err(Error::invalid(OP, "logits have no classes"));
    }
    let mut a = Args::new();
    a.push(x.device_ptr())
        .push(labels.device_ptr())
        .push(out.device_ptr())
        .push(rows as u64)
        .push(cols as u64)
        .push(d)
        .push(st)
        .push(cs)
        .push(ll.offset() as u64)
        .push(ll.strides()[0] as u64)
        .push(dev.err_flag());
    let grid = (rows.min(dev.sm_count() as usize * 32) as u32, 1);
    run(
        dev,
        OP,
        Module::Softmax,
        &["xent", tname(dtype)],
        grid,
        block_for(cols as u64 / 4, 256),
        0,
        &mut a,
    )?;
    check_ids(dev, OP, labels, ll, cols)?;
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward(
    x: &Buffer,
    lx: &Layout,
    labels: &Buffer,
    ll: &Layout,
    g: &Buffer,
    lg: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    const OP: &str = "cross_entropy_backward";
    same_device(OP, x, labels)?;
    same_device(OP, x, g)?;
    let dev = x.state();
    dev.bind()?;
    let (rows, cols, d, st, cs) = rows_of(OP, lx)?;
    let out = alloc(dev, rows * cols * dtype.size_in_bytes())?;
    if rows == 0 || cols == 0 {
        return Ok(out);
    }
    let mut a = Args::new();
    a.push(x.device_ptr())
        .push(labels.device_ptr())
        .push(g.device_ptr())
        .push(out.device_ptr())
        .push(rows as u64)
        .push(cols as u64)
        .push(d)
        .push(st)
        .push(cs)
        .push(ll.offset() as u64)
        .push(ll.strides()[0] as u64)
        .push(lg.offset() as u64)
        .push(lg.strides()[0] as u64)
        .push(dev.err_flag());
    let grid = (rows.min(dev.sm_count() as usize * 32) as u32, 1);
    run(
        dev,
        OP,
        Module::Softmax,
        &["xent_bwd", tname(dtype)],
        grid,
        block_for(cols as u64 / 4, 256),
        0,
        &mut a,
    )?;
    check_ids(dev, OP, labels, ll, cols)?;
    Ok(out)
}
