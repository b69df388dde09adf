//! Reductions over any set of axes.
//!
//! The input's axes are split into *kept* and *reduced* ones; each output element folds the
//! reduced sub-layout starting at its kept offset. The reduced sub-layout is simplified like any
//! other (see `strided::Plan`), so reducing trailing axes of a contiguous tensor is a
//! fold over plain slices. Outputs are computed in parallel; a reduction to one element of a
//! large contiguous input is split into parallel partial folds instead.
//!
//! Accuracy: `Sum` over f32 accumulates in f64 (eight independent lanes, so the loop still
//! vectorizes), then rounds once to f32: the f32 result is the correctly rounded sum except in
//! rare ties, whatever the size, and so does not depend on how the work was split across
//! threads. f64 sums use the same eight lanes (a blocked summation, more accurate than a
//! sequential one). i64 sums wrap. Reducing the leading axes of a contiguous tensor (a bias
//! gradient: `[n, c]` over `n`) accumulates row after row into `c` accumulators instead, so that
//! memory is read in order.
//!
//! NaN: `Max`/`Min` propagate it; `ArgMax`/`ArgMin` treat it as the largest/smallest value and
//! return the first NaN; ties pick the first occurrence.

use kiln_core::{DType, Layout, ReduceOp, Result, Shape};
use rayon::prelude::*;

use crate::elementwise::{dtype_err, slice};
use crate::storage::{CpuElem, CpuStorage, alloc, storage};
use crate::strided::{PAR_MIN, Plan, par_chunk};

/// Splits `layout` into the kept axes (with the offset) and the reduced axes (offset 0).
fn split(layout: &Layout, axes: &[usize]) -> (Layout, Layout) {
    let (mut kd, mut ks, mut rd, mut rs) = (vec![], vec![], vec![], vec![]);
    for (i, (&d, &s)) in layout.dims().iter().zip(layout.strides()).enumerate() {
        if axes.contains(&i) {
            rd.push(d);
            rs.push(s);
        } else {
            kd.push(d);
            ks.push(s);
        }
    }
    (
        Layout::from_parts(Shape::new(kd), ks, layout.offset()),
        Layout::from_parts(Shape::new(rd), rs, 0),
    )
}

/// `run(acc, src, start, stride, len)` folds one run of the reduced axes into `acc`.
#[allow(clippy::too_many_arguments)]
fn reduce_with<T, A, U>(
    op: &'static str,
    s: &CpuStorage,
    src: &[T],
    layout: &Layout,
    axes: &[usize],
    init: A,
    run: impl Fn(A, &[T], usize, usize, usize) -> A + Sync,
    merge: Option<impl Fn(A, A) -> A + Sync + Send>,
    finish: impl Fn(A) -> U + Sync,
) -> Result<CpuStorage>
where
    T: CpuElem,
    A: Copy + Send + Sync,
    U: CpuElem,
{
    // Everything into one output from a contiguous input (`sum_all`, a loss's mean): one run,
    // folded without building the layouts and plans below (the same single run they make).
    // Not for arg reductions (no `merge`), whose runs count positions from the storage's start.
    let all =
        merge.is_some() && (0..layout.rank()).all(|i| axes.contains(&i) || layout.dims()[i] == 1);
    if let Some(r) = layout
        .contiguous_range()
        .filter(|r| all && r.len() < PAR_MIN)
    {
        let mut out = alloc::<U>(op, s.device(), 1)?;
        out[0] = finish(if r.is_empty() {
            init
        } else {
            run(init, &src[r.clone()], 0, 1, r.len())
        });
        return Ok(storage(s.device(), out));
    }
    let (kept, red) = split(layout, axes);
    let n_out = kept.elem_count();
    let mut out = alloc::<U>(op, s.device(), n_out)?;
    if n_out == 0 {
        return Ok(storage(s.device(), out));
    }
    let n_red = red.elem_count();
    if n_red == 0 {
        out.fill(finish(init));
        return Ok(storage(s.device(), out));
    }
    // One output from a large contiguous input: parallel partial folds. (Arg reductions fold
    // positions, which partial folds would lose: their `merge` is None.)
    let whole = layout
        .contiguous_range()
        .filter(|_| n_out == 1 && n_red >= PAR_MIN);
    if let (Some(r), Some(merge)) = (whole, merge.as_ref()) {
        let x = &src[r];
        let chunk = par_chunk(x.len());
        let acc = x
            .par_chunks(chunk)
            .map(|c| run(init, c, 0, 1, c.len()))
            .reduce(|| init, merge);
        out[0] = finish(acc);
        return Ok(storage(s.device(), out));
    }
    let red_plan = Plan::new([&red]);
    let (rlen, rstride) = (red_plan.run_len(), red_plan.run_stride(0));
    let kept_plan = Plan::new([&kept]);
    let (klen, kstride) = (kept_plan.run_len(), kept_plan.run_stride(0));
    let fold = |base: usize| {
        let mut acc = init;
        red_plan.for_runs(0..red_plan.runs(), |_, [o]| {
            acc = run(acc, src, base + o, rstride, rlen);
        });
        finish(acc)
    };
    let body = |s0: usize, o: &mut [U]| {
        let mut i = 0;
        let r0 = s0 / klen;
        let first = s0 % klen;
        kept_plan.for_runs(r0..r0 + (first + o.len()).div_ceil(klen), |_, [k]| {
            let lo = if i == 0 { first } else { 0 };
            for j in lo..klen {
                if i == o.len() {
                    return;
                }
                o[i] = fold(k + j * kstride);
                i += 1;
            }
        });
    };
    // Parallel over outputs once the total work is large.
    if n_out.saturating_mul(n_red) >= PAR_MIN && n_out > 1 {
        let chunk = (n_out.div_ceil(4 * rayon::current_num_threads().max(1))).max(1);
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, o)| body(c * chunk, o));
    } else {
        body(0, &mut out);
    }
    Ok(storage(s.device(), out))
}

/// Reduces the leading `r` rows of a contiguous `[r, k]` matrix into `k` outputs, row after row
/// (`start(row)` makes the accumulators from a block's first row, `add_row(acc, row)` folds
/// each further row into them), so that reducing the batch
/// axis of `[n, c]` reads memory in order and vectorizes along `c`. Large inputs are split into
/// row blocks whose partial accumulators are merged.
#[allow(clippy::too_many_arguments)]
fn reduce_leading<T, A, U>(
    op: &'static str,
    s: &CpuStorage,
    x: &[T],
    r: usize,
    k: usize,
    start: impl Fn(&[T]) -> Vec<A> + Sync,
    add_row: impl Fn(&mut [A], &[T]) + Sync,
    merge: impl Fn(A, A) -> A + Sync,
    finish: impl Fn(A) -> U + Sync,
) -> Result<CpuStorage>
where
    T: CpuElem,
    A: Copy + Send + Sync,
    U: CpuElem,
{
    let fold_rows = |rows: std::ops::Range<usize>| {
        let mut acc = start(&x[rows.start * k..(rows.start + 1) * k]);
        for i in rows.start + 1..rows.end {
            add_row(&mut acc, &x[i * k..(i + 1) * k]);
        }
        acc
    };
    let acc = if r * k >= PAR_MIN && r > 1 {
        let per = r.div_ceil((2 * rayon::current_num_threads()).min(r));
        (0..r.div_ceil(per))
            .into_par_iter()
            .map(|t| fold_rows(t * per..((t + 1) * per).min(r)))
            .reduce_with(|mut a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = merge(*x, y);
                }
                a
            })
            .unwrap_or_default()
    } else {
        fold_rows(0..r)
    };
    let mut out = alloc::<U>(op, s.device(), k)?;
    for (o, a) in out.iter_mut().zip(acc) {
        *o = finish(a);
    }
    Ok(storage(s.device(), out))
}

/// `Some((r, k))` when `layout` is contiguous and `axes` are its leading `j >= 1` axes with at
/// least one axis kept: then the reduction is over the rows of an `[r, k]` matrix.
fn leading(layout: &Layout, axes: &[usize]) -> Option<(usize, usize, std::ops::Range<usize>)> {
    let range = layout.contiguous_range()?;
    let j = axes.len();
    if j == 0 || j >= layout.rank() || axes.iter().enumerate().any(|(i, &a)| a != i) {
        return None;
    }
    let r: usize = layout.dims()[..j].iter().product();
    let k: usize = layout.dims()[j..].iter().product();
    (r > 0 && k > 0).then_some((r, k, range))
}

/// Sum of an f32 run in f64 with eight lanes.
#[inline]
fn sum_f32(x: &[f32], start: usize, stride: usize, len: usize) -> f64 {
    if stride == 1 {
        let x = &x[start..start + len];
        let mut acc = [0f64; 8];
        let mut it = x.chunks_exact(8);
        for c in &mut it {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += v as f64;
            }
        }
        let tail: f64 = it.remainder().iter().map(|&v| v as f64).sum();
        acc.iter().sum::<f64>() + tail
    } else {
        (0..len).map(|i| x[start + i * stride] as f64).sum()
    }
}

#[inline]
fn sum_f64(x: &[f64], start: usize, stride: usize, len: usize) -> f64 {
    if stride == 1 {
        let x = &x[start..start + len];
        let mut acc = [0f64; 8];
        let mut it = x.chunks_exact(8);
        for c in &mut it {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += v;
            }
        }
        let tail: f64 = it.remainder().iter().sum();
        acc.iter().sum::<f64>() + tail
    } else {
        (0..len).map(|i| x[start + i * stride]).sum()
    }
}

#[inline]
fn sum_i64(x: &[i64], start: usize, stride: usize, len: usize) -> i64 {
    if stride == 1 {
        x[start..start + len]
            .iter()
            .fold(0i64, |a, &v| a.wrapping_add(v))
    } else {
        (0..len).fold(0i64, |a, i| a.wrapping_add(x[start + i * stride]))
    }
}

/// The maximum (`MAX`) or minimum of a non-empty slice; NaN if any element is NaN. Sixteen
/// independent lanes and no early exit, so the loop vectorizes.
#[inline]
pub(crate) fn slice_extreme<T: CpuElem, const MAX: bool>(x: &[T]) -> T {
    let mut acc = [x[0]; 16];
    let mut nan = false;
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            nan |= v.is_nan();
            *a = if (MAX && v > *a) || (!MAX && v < *a) {
                v
            } else {
                *a
            };
        }
    }
    let mut best = x[0];
    for &v in acc.iter().chain(it.remainder()) {
        nan |= v.is_nan();
        if (MAX && v > best) || (!MAX && v < best) {
            best = v;
        }
    }
    if nan {
        x.iter().copied().find(|v| v.is_nan()).unwrap_or(best)
    } else {
        best
    }
}

/// `Some(better)` of two candidates for Max (`max == true`) or Min, propagating NaN.
#[inline]
fn pick<T: CpuElem>(max: bool, a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(a), Some(b)) => {
            if a.is_nan() {
                Some(a)
            } else if b.is_nan() || (max && b > a) || (!max && b < a) {
                Some(b)
            } else {
                Some(a)
            }
        }
    }
}

fn minmax<T: CpuElem>(
    s: &CpuStorage,
    layout: &Layout,
    axes: &[usize],
    max: bool,
) -> Result<CpuStorage> {
    let op = if max { "max" } else { "min" };
    let src = slice::<T>(op, s)?;
    reduce_with(
        op,
        s,
        src,
        layout,
        axes,
        None::<T>,
        |acc, x, start, stride, len| {
            if stride == 1 {
                let run = &x[start..start + len];
                let r = if max {
                    slice_extreme::<T, true>(run)
                } else {
                    slice_extreme::<T, false>(run)
                };
                return pick(max, acc, Some(r));
            }
            let mut acc = acc;
            for i in 0..len {
                acc = pick(max, acc, Some(x[start + i * stride]));
            }
            acc
        },
        Some(move |a, b| pick(max, a, b)),
        |a| a.unwrap_or_default(),
    )
}

fn arg<T: CpuElem>(
    s: &CpuStorage,
    layout: &Layout,
    axes: &[usize],
    max: bool,
) -> Result<CpuStorage> {
    let op = if max { "argmax" } else { "argmin" };
    let src = slice::<T>(op, s)?;
    // The reduced sub-layout is a single axis, hence a single run: `i` is the axis index.
    reduce_with(
        op,
        s,
        src,
        layout,
        axes,
        0i64,
        |_, x, start, stride, len| {
            let mut best = x[start];
            let mut bi = 0;
            for i in 1..len {
                if best.is_nan() {
                    break;
                }
                let v = x[start + i * stride];
                if v.is_nan() || (max && v > best) || (!max && v < best) {
                    best = v;
                    bi = i;
                }
            }
            bi as i64
        },
        None::<fn(i64, i64) -> i64>,
        |a| a,
    )
}

pub(crate) fn reduce(
    op: ReduceOp,
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
    axes: &[usize],
) -> Result<CpuStorage> {
    let name = op.name();
    if axes.iter().any(|&a| a >= layout.rank()) {
        return Err(kiln_core::Error::AxisOutOfRange {
            op: name,
            axis: axes.iter().copied().max().unwrap_or(0) as isize,
            rank: layout.rank(),
        });
    }
    if op.is_arg() && axes.len() != 1 {
        return Err(kiln_core::Error::invalid(
            name,
            format!("reduces exactly one axis, got {}", axes.len()),
        ));
    }
    if op != ReduceOp::Sum && axes.iter().any(|&a| layout.dims()[a] == 0) {
        return Err(kiln_core::Error::invalid(
            name,
            format!("cannot reduce an empty axis of shape {}", layout.shape()),
        ));
    }
    macro_rules! by_dtype {
        ($f:ident, $max:expr) => {
            match dtype {
                DType::F32 => $f::<f32>(s, layout, axes, $max),
                DType::F64 => $f::<f64>(s, layout, axes, $max),
                DType::I64 => $f::<i64>(s, layout, axes, $max),
                DType::U8 => $f::<u8>(s, layout, axes, $max),
                _ => Err(dtype_err(name, "f32, f64, i64 or u8", dtype)),
            }
        };
    }
    if let Some((r, k, range)) = leading(layout, axes).filter(|_| !op.is_arg()) {
        return reduce_leading_op(op, s, dtype, r, k, range);
    }
    match op {
        ReduceOp::Sum => match dtype {
            DType::F32 => {
                let src = slice::<f32>(name, s)?;
                reduce_with(
                    name,
                    s,
                    src,
                    layout,
                    axes,
                    0f64,
                    |a, x, st, sd, n| a + sum_f32(x, st, sd, n),
                    Some(|a, b| a + b),
                    |a| a as f32,
                )
            }
            DType::F64 => {
                let src = slice::<f64>(name, s)?;
                reduce_with(
                    name,
                    s,
                    src,
                    layout,
                    axes,
                    0f64,
                    |a, x, st, sd, n| a + sum_f64(x, st, sd, n),
                    Some(|a, b| a + b),
                    |a| a,
                )
            }
            DType::I64 => {
                let src = slice::<i64>(name, s)?;
                reduce_with(
                    name,
                    s,
                    src,
                    layout,
                    axes,
                    0i64,
                    |a, x, st, sd, n| a.wrapping_add(sum_i64(x, st, sd, n)),
                    Some(i64::wrapping_add),
                    |a| a,
                )
            }
            _ => Err(dtype_err(name, "f32, f64 or i64", dtype)),
        },
        ReduceOp::Max => by_dtype!(minmax, true),
        ReduceOp::Min => by_dtype!(minmax, false),
        ReduceOp::ArgMax => by_dtype!(arg, true),
        ReduceOp::ArgMin => by_dtype!(arg, false),
    }
}

fn leading_minmax<T: CpuElem>(
    s: &CpuStorage,
    r: usize,
    k: usize,
    range: std::ops::Range<usize>,
    max: bool,
) -> Result<CpuStorage> {
    let op = if max { "max" } else { "min" };
    let x = &slice::<T>(op, s)?[range];
    let better = move |a: T, v: T| {
        if a.is_nan() || !(v.is_nan() || (max && v > a) || (!max && v < a)) {
            a
        } else {
            v
        }
    };
    reduce_leading(
        op,
        s,
        x,
        r,
        k,
        |row| row.to_vec(),
        |acc, row| {
            for (a, &v) in acc.iter_mut().zip(row) {
                *a = better(*a, v);
            }
        },
        better,
        |a| a,
    )
}

/// Sum, Max or Min over the leading axes of a contiguous tensor (see [`reduce_leading`]).
fn reduce_leading_op(
    op: ReduceOp,
    s: &CpuStorage,
    dtype: DType,
    r: usize,
    k: usize,
    range: std::ops::Range<usize>,
) -> Result<CpuStorage> {
    let name = op.name();
    match (op, dtype) {
        (ReduceOp::Sum, DType::F32) => {
            let x = &slice::<f32>(name, s)?[range];
            reduce_leading(
                name,
                s,
                x,
                r,
                k,
                |row| row.iter().map(|&v| v as f64).collect(),
                |acc, row| {
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                },
                |a, b| a + b,
                |a| a as f32,
            )
        }
        (ReduceOp::Sum, DType::F64) => {
            let x = &slice::<f64>(name, s)?[range];
            reduce_leading(
                name,
                s,
                x,
                r,
                k,
                |row| row.to_vec(),
                |acc, row| {
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += v;
                    }
                },
                |a, b| a + b,
                |a| a,
            )
        }
        (ReduceOp::Sum, DType::I64) => {
            let x = &slice::<i64>(name, s)?[range];
            reduce_leading(
                name,
                s,
                x,
                r,
                k,
                |row| row.to_vec(),
                |acc, row| {
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a = a.wrapping_add(v);
                    }
                },
                i64::wrapping_add,
                |a| a,
            )
        }
        (ReduceOp::Sum, _) => Err(dtype_err(name, "f32, f64 or i64", dtype)),
        (ReduceOp::Max | ReduceOp::Min, _) => {
            let max = op == ReduceOp::Max;
            match dtype {
                DType::F32 => leading_minmax::<f32>(s, r, k, range, max),
                DType::F64 => leading_minmax::<f64>(s, r, k, range, max),
                DType::I64 => leading_minmax::<i64>(s, r, k, range, max),
                DType::U8 => leading_minmax::<u8>(s, r, k, range, max),
                _ => Err(dtype_err(name, "f32, f64, i64 or u8", dtype)),
            }
        }
        _ => Err(dtype_err(name, "a reducible dtype", dtype)),
    }
}
