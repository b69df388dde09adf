//! The reduction driver of the fused evaluator (see the parent module's docs).

use std::ops::Range;

use kiln_core::expr::{Combine, Instr, Phase, Program};
use kiln_core::{DType, Layout, Shape};
use rayon::prelude::*;

use super::block::{BLOCK, Buf, Elt, Frame, Loc, Src};
use super::exec::{Leaves, Outs, exec_block, finish_acc, place_input, store, widen};
use super::walk::Walk;
use crate::storage::CpuData;
use crate::strided::{PAR_MIN, par_chunk};

/// One `Reduce` instruction: its index, combine, operand and the operand's dtype.
#[derive(Clone, Copy)]
struct Red {
    at: usize,
    c: Combine,
    arg: u32,
    dtype: DType,
}

impl Red {
    fn acc_dtype(&self) -> DType {
        match self.c {
            Combine::Sum | Combine::Prod => widen(self.dtype),
            Combine::Max | Combine::Min => self.dtype,
        }
    }
    /// Accumulators for `n` rows, at the identity of the fold (for max/min the value every
    /// element beats: -inf or the type's minimum, which NaN-propagating max then replaces).
    fn init(&self, n: usize) -> Buf {
        let id = |f: f64, i: i64, u: u8| match self.acc_dtype() {
            DType::F32 => Buf::F32(vec![f as f32; n]),
            DType::I64 => Buf::I64(vec![i; n]),
            DType::U8 => Buf::U8(vec![u; n]),
            _ => Buf::F64(vec![f; n]),
        };
        match self.c {
            Combine::Sum => id(0.0, 0, 0),
            Combine::Prod => id(1.0, 1, 1),
            Combine::Max => id(f64::NEG_INFINITY, i64::MIN, 0),
            Combine::Min => id(f64::INFINITY, i64::MAX, u8::MAX),
        }
    }
}

/// Everything a task needs.
struct Ctx<'a> {
    program: &'a Program,
    leaves: &'a Leaves,
    outs: &'a Outs,
    reds: Vec<Red>,
    /// Values computed per element (the map) and after the reduction (the post-map).
    body: Vec<bool>,
    post: Vec<bool>,
    walks: Vec<Walk>,
    post_walks: Vec<Walk>,
    /// Where the iteration's (kept-first) flat index lands in an elementwise output.
    elem_walk: Walk,
    /// Elements per row (the reduced extent).
    r: usize,
}

pub(super) fn run(
    program: &Program,
    shape: &Shape,
    axes: &[usize],
    layouts: &[&Layout],
    inputs: &[&CpuData],
    leaves: &Leaves,
    outs: &Outs,
) {
    let rank = shape.rank();
    let kept_axes: Vec<usize> = (0..rank).filter(|a| !axes.contains(a)).collect();
    let perm: Vec<usize> = kept_axes.iter().chain(axes).copied().collect();
    let k_count: usize = kept_axes.iter().map(|&a| shape.dims()[a]).product();
    let r: usize = axes.iter().map(|&a| shape.dims()[a]).product();
    let permuted: Vec<Layout> = layouts
        .iter()
        .map(|l| l.permute(&perm).expect("a permutation"))
        .collect();
    let kept_dims: Vec<usize> = kept_axes.iter().map(|&a| shape.dims()[a]).collect();
    let post_walks = permuted
        .iter()
        .map(|l| {
            Walk::new(&Layout::from_parts(
                Shape::new(kept_dims.clone()),
                &l.strides()[..kept_axes.len()],
                l.offset(),
            ))
        })
        .collect();
    let n = program.code().len();
    let mut body = vec![false; n];
    let mut post = vec![false; n];
    let mut reds = Vec::new();
    for (j, &o) in program.outputs().iter().enumerate() {
        if program.output_is_reduced(j) {
            post[o as usize] = true;
        } else {
            body[o as usize] = true;
        }
    }
    for i in (0..n).rev() {
        let ins = program.code()[i];
        if let Instr::Reduce(c, a) = ins {
            if post[i] {
                body[a as usize] = true;
                reds.push(Red {
                    at: i,
                    c,
                    arg: a,
                    dtype: program.dtype(a),
                });
            }
            continue;
        }
        for a in ins.operands() {
            body[a as usize] |= body[i];
            post[a as usize] |= post[i];
        }
    }
    reds.reverse();
    let cx = Ctx {
        program,
        leaves,
        outs,
        reds,
        body,
        post,
        walks: permuted.iter().map(Walk::new).collect(),
        post_walks,
        elem_walk: Walk::new(
            &Layout::contiguous(shape.clone())
                .permute(&perm)
                .expect("a permutation"),
        ),
        r,
    };
    let total = k_count * r;
    let threads = rayon::current_num_threads().max(1);
    if k_count == 0 {
        return;
    }
    if total >= PAR_MIN && k_count < 2 * threads && r >= PAR_MIN {
        // Few long rows: split each row across cores, merge the partial accumulators.
        let chunk = par_chunk(r).div_ceil(BLOCK) * BLOCK;
        for row in 0..k_count {
            let parts: Vec<Vec<Buf>> = (0..r.div_ceil(chunk))
                .into_par_iter()
                .map(|c| {
                    let mut f = Frame::new(program, inputs);
                    let mut accs: Vec<Buf> = cx.reds.iter().map(|d| d.init(1)).collect();
                    let lo = row * r + c * chunk;
                    let hi = (row * r + (c + 1) * chunk).min((row + 1) * r);
                    fold_range(&cx, &mut f, lo..hi, row, &mut accs);
                    accs
                })
                .collect();
            let mut accs: Vec<Buf> = cx.reds.iter().map(|d| d.init(1)).collect();
            for p in &parts {
                for (k, d) in cx.reds.iter().enumerate() {
                    merge(d.c, &mut accs[k], &p[k]);
                }
            }
            let mut f = Frame::new(program, inputs);
            finish_rows(&cx, &mut f, row..row + 1, &accs);
        }
        return;
    }
    // Many rows: each task folds whole rows, a batch of at most BLOCK rows at a time.
    let rows_per = if total < PAR_MIN {
        k_count
    } else {
        (par_chunk(total) / r.max(1)).max(1)
    };
    let tasks = k_count.div_ceil(rows_per);
    let task = |t: usize| {
        let mut f = Frame::new(program, inputs);
        let end = ((t + 1) * rows_per).min(k_count);
        let mut r0 = t * rows_per;
        while r0 < end {
            let r1 = (r0 + BLOCK).min(end);
            let mut accs: Vec<Buf> = cx.reds.iter().map(|d| d.init(r1 - r0)).collect();
            fold_range(&cx, &mut f, r0 * r..r1 * r, r0, &mut accs);
            finish_rows(&cx, &mut f, r0..r1, &accs);
            r0 = r1;
        }
    };
    if tasks <= 1 {
        task(0);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// Runs the map over the flat (kept-first) elements `range`, folding each element into the
/// accumulator of its row (`accs[..][row - row_base]`) and storing elementwise outputs.
fn fold_range(
    cx: &Ctx<'_>,
    f: &mut Frame<'_>,
    range: Range<usize>,
    row_base: usize,
    accs: &mut [Buf],
) {
    let p = cx.program;
    let mut start = range.start;
    while start < range.end {
        f.len = BLOCK.min(range.end - start);
        exec_block(f, p, cx.leaves, &cx.body, |f, i, k| {
            let dt = p.inputs()[k as usize];
            place_input(f, i, k as usize, &cx.walks[k as usize], start, dt);
        });
        // Fold, row segment by row segment.
        let mut lo = 0;
        while lo < f.len {
            let row = (start + lo) / cx.r.max(1);
            let hi = ((row + 1) * cx.r - start).min(f.len);
            for (k, d) in cx.reds.iter().enumerate() {
                fold_seg(f, d, lo..hi, &mut accs[k], row - row_base);
            }
            lo = hi;
        }
        // Elementwise outputs, scattered into the iteration's row-major order.
        for (j, &o) in p.outputs().iter().enumerate() {
            if !p.output_is_reduced(j) {
                // SAFETY: tasks fold disjoint element ranges, and `elem_walk` maps distinct
                // elements to distinct output positions; the buffer outlives the evaluation.
                unsafe { scatter(cx, f, o, j, start) };
            }
        }
        start += f.len;
    }
}

/// # Safety
/// This task alone writes the output positions of elements `start..start + f.len`.
unsafe fn scatter(cx: &Ctx<'_>, f: &Frame<'_>, o: u32, j: usize, start: usize) {
    fn go<T: Elt>(cx: &Ctx<'_>, f: &Frame<'_>, o: u32, j: usize, start: usize) {
        let mut buf = vec![T::default(); f.len];
        f.read::<T>(o, &mut buf);
        let p = cx.outs.ptr::<T>(j);
        cx.elem_walk.scatter(start, &buf, |i, v| {
            // SAFETY: `i` is inside the output (the walk of its own contiguous layout), and
            // no other task writes position `i` (the caller's promise).
            unsafe { *p.add(i) = v }
        });
    }
    match cx.program.dtype(o) {
        DType::F32 => go::<f32>(cx, f, o, j, start),
        DType::F64 => go::<f64>(cx, f, o, j, start),
        DType::I64 => go::<i64>(cx, f, o, j, start),
        DType::F16 => go::<kiln_core::f16>(cx, f, o, j, start),
        DType::BF16 => go::<kiln_core::bf16>(cx, f, o, j, start),
        _ => go::<u8>(cx, f, o, j, start),
    }
}

/// Runs the post-map over rows `rows` (at most BLOCK) whose accumulators are complete, and
/// stores the reduced outputs.
fn finish_rows(cx: &Ctx<'_>, f: &mut Frame<'_>, rows: Range<usize>, accs: &[Buf]) {
    let p = cx.program;
    f.len = rows.len();
    for (k, d) in cx.reds.iter().enumerate() {
        finish_acc(&accs[k], &mut f.regs[d.at], f.len);
        f.locs[d.at] = Loc::Reg;
    }
    exec_block(f, p, cx.leaves, &cx.post, |f, i, k| {
        let dt = p.inputs()[k as usize];
        place_input(f, i, k as usize, &cx.post_walks[k as usize], rows.start, dt);
    });
    for (j, &o) in p.outputs().iter().enumerate() {
        if p.output_is_reduced(j) {
            // SAFETY: row ranges of tasks are disjoint; reduced outputs are contiguous in the
            // kept order, so this task alone writes `rows`.
            unsafe { store(f, o, p.dtype(o), cx.outs, j, rows.start) };
        }
    }
    debug_assert!(
        p.outputs()
            .iter()
            .all(|&o| p.phase(o) != Phase::Reduced || cx.post[o as usize])
    );
}

// ---- folds -----------------------------------------------------------------------------------

/// NaN-propagating max/min (as `Backend::reduce`).
#[inline(always)]
fn pick_f<T: PartialOrd + Copy>(max: bool, a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    let b_nan = b != b;
    if b_nan || (max && b > a) || (!max && b < a) {
        b
    } else {
        a
    }
}

/// The sum of `x` in f64 with eight independent lanes (vectorizes; as `reduce.rs`).
fn sum_lanes<T: Copy + Into<f64>>(x: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v.into();
        }
    }
    let mut s: f64 = chunks.remainder().iter().map(|&v| v.into()).sum();
    s += acc.iter().sum::<f64>();
    s
}

/// Folds elements `seg` of the map value into accumulator `i` of `acc`.
fn fold_seg(f: &Frame<'_>, d: &Red, seg: Range<usize>, acc: &mut Buf, i: usize) {
    let n = seg.len();
    macro_rules! float_fold {
        ($t:ty, $wide:ident, $self_:ident) => {{
            let src = f.src::<$t>(d.arg);
            match (d.c, acc) {
                (Combine::Sum, Buf::$wide(a)) => {
                    a[i] += match src {
                        Src::S(s) => sum_lanes(&s[seg]),
                        Src::C(c) => c as f64 * n as f64,
                    };
                }
                (Combine::Prod, Buf::$wide(a)) => {
                    let mut p: f64 = a[i];
                    match src {
                        Src::S(s) => s[seg].iter().for_each(|&v| p *= v as f64),
                        Src::C(c) => (0..n).for_each(|_| p *= c as f64),
                    }
                    a[i] = p;
                }
                (c, Buf::$self_(a)) => {
                    let max = c == Combine::Max;
                    let mut m = a[i];
                    match src {
                        Src::S(s) => s[seg].iter().for_each(|&v| m = pick_f(max, m, v)),
                        Src::C(v) => m = pick_f(max, m, v),
                    }
                    a[i] = m;
                }
                _ => unreachable!("accumulator of another dtype"),
            }
        }};
    }
    match d.dtype {
        DType::F32 => float_fold!(f32, F64, F32),
        DType::F64 => float_fold!(f64, F64, F64),
        DType::I64 => {
            let src = f.src::<i64>(d.arg);
            let Buf::I64(a) = acc else {
                unreachable!("accumulator of another dtype")
            };
            let mut m = a[i];
            let each = |m: &mut i64, v: i64| {
                *m = match d.c {
                    Combine::Sum => m.wrapping_add(v),
                    Combine::Prod => m.wrapping_mul(v),
                    Combine::Max => (*m).max(v),
                    Combine::Min => (*m).min(v),
                }
            };
            match src {
                Src::S(s) => s[seg].iter().for_each(|&v| each(&mut m, v)),
                Src::C(v) => (0..n).for_each(|_| each(&mut m, v)),
            }
            a[i] = m;
        }
        _ => {
            let src = f.src::<u8>(d.arg);
            let Buf::U8(a) = acc else {
                unreachable!("accumulator of another dtype")
            };
            let max = d.c == Combine::Max;
            let mut m = a[i];
            match src {
                Src::S(s) => s[seg]
                    .iter()
                    .for_each(|&v| m = if max { m.max(v) } else { m.min(v) }),
                Src::C(v) => m = if max { m.max(v) } else { m.min(v) },
            }
            a[i] = m;
        }
    }
}

/// `dst[0] = combine(dst[0], src[0])` for one-row accumulators.
fn merge(c: Combine, dst: &mut Buf, src: &Buf) {
    match (dst, src) {
        (Buf::F64(a), Buf::F64(b)) => {
            a[0] = match c {
                Combine::Sum => a[0] + b[0],
                Combine::Prod => a[0] * b[0],
                Combine::Max => pick_f(true, a[0], b[0]),
                Combine::Min => pick_f(false, a[0], b[0]),
            }
        }
        (Buf::F32(a), Buf::F32(b)) => a[0] = pick_f(c == Combine::Max, a[0], b[0]),
        (Buf::I64(a), Buf::I64(b)) => {
            a[0] = match c {
                Combine::Sum => a[0].wrapping_add(b[0]),
                Combine::Prod => a[0].wrapping_mul(b[0]),
                Combine::Max => a[0].max(b[0]),
                Combine::Min => a[0].min(b[0]),
            }
        }
        (Buf::U8(a), Buf::U8(b)) => {
            a[0] = if c == Combine::Max {
                a[0].max(b[0])
            } else {
                a[0].min(b[0])
            }
        }
        _ => unreachable!("accumulators of another dtype"),
    }
}
