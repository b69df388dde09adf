//! The elementwise driver's fast path: f32 programs whose inputs are contiguous or a single
//! value, run element block by element block with every decision taken once per call.
//!
//! Why a second driver: the general one ([`super::elementwise`]) decides per block and per
//! instruction where each operand is (an input's run, a broadcast value, a gathered view), which
//! dtype it has and whether it is uniform. That cost is paid per block, so its blocks must be
//! long (4096 elements; 1024 or 2048 measured no faster) to amortize it, and a long block makes
//! the program wait for memory, then compute, with little overlap. Here the plan is made once: each instruction
//! becomes a step with resolved operands (a register, an input at a fixed offset, a constant)
//! and its scalar tail; registers are reused once their value is dead, so a chain needs two or
//! three; and a block is only [`BLOCK`] elements, a few kilobytes that stay in L1 while the
//! hardware prefetcher streams the inputs in. Outputs are streamed out of their registers, or,
//! on one thread, written by the steps that compute them ([`direct_writes`]). The kernels are
//! those of the general driver, so the results are the same bits.
//!
//! Small calls keep their plan, per thread, for the next call of the same program over inputs
//! in the same places ([`remembered`]): a training step runs the same gradient rules over the same
//! shapes every step, and over a few hundred elements planning cost more than running.

use std::cell::RefCell;
use std::rc::Rc;

use kiln_core::expr::{Instr, Program};
use kiln_core::{BinaryOp, DType, Layout, UnaryOp};
use rayon::prelude::*;

use super::block::{Aff, Elt, Src, binary_f32, store_fence, stream_copy, unary_f32};
use super::exec::{Leaves, Outs, PAR_WORK, Step};
use super::walk::{Run, Walk};
use crate::storage::{CpuData, CpuElem};
use crate::strided::{PAR_MIN, par_chunk};

/// Elements per block. The five-op chain of the fuse bench over 32M f32 on the 2-core EPYC VM
/// (2026-11-26), by block size: 128: 14.0–15.4 ms, 256: 11.9–12.5, 512: 18.5–20.7, 1024:
/// 15.6–18.9, 2048: 19.6–21.5 (the hand-written AVX-512 loop: 12.2).
const BLOCK: usize = 256;

/// Where a step's operand is.
#[derive(Clone, Copy, Debug)]
enum Opd {
    /// Register `r` of the block.
    Reg(usize),
    /// Input `k`, from storage index `off` onwards (element `i` of the iteration at `off + i`).
    In { k: usize, off: usize },
    /// One value everywhere.
    Uni(f32),
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Unary(UnaryOp),
    Binary(BinaryOp),
}

/// One loop over a block: `out = post(op(a, b))`.
#[derive(Clone, Copy, Debug)]
struct FStep {
    op: Op,
    a: Opd,
    b: Opd,
    post: Option<Aff<f32>>,
    dst: Dst,
}

/// Where a step writes.
#[derive(Clone, Copy, Debug)]
enum Dst {
    /// Register `r`.
    Reg(usize),
    /// Output `j`, directly, with plain stores (see [`direct_writes`]).
    Out(usize),
}

/// A program resolved for one call (see the module docs).
pub(super) struct Plan {
    steps: Vec<FStep>,
    regs: usize,
    /// Output `j` is this operand, or `None` when its step writes it (see [`plan`]'s `direct`).
    outs: Vec<Option<Opd>>,
    /// Whether the outputs copied out of registers are streamed past the caches (not with
    /// `direct`: see [`direct_writes`]).
    stream: bool,
}

/// The plan of `program` over `n` elements, or `None` when the general driver must run it:
/// a value that is not f32, a reduction, a comparison, a select or a cast, or an input read
/// with strides. With `direct`, a step whose value is one output and read by no other step
/// writes that output itself with plain stores; otherwise every output is computed into a
/// register and streamed out (see [`direct_writes`]).
pub(super) fn plan(
    program: &Program,
    layouts: &[&Layout],
    inputs: &[&CpuData],
    leaves: &Leaves,
    n: usize,
    direct: bool,
) -> Option<Plan> {
    let f32_only = program.inputs().iter().all(|&d| d == DType::F32)
        && program.dtypes().iter().all(|&d| d == DType::F32);
    if !f32_only || program.reduces() {
        return None;
    }
    let code = program.code();
    // Each value's operand; `None` for values computed by the tail op that uses them.
    let mut vals: Vec<Option<Opd>> = vec![None; code.len()];
    // Steps with value indices as outputs (registers are assigned below).
    let mut steps: Vec<(FStep, usize)> = Vec::with_capacity(code.len());
    let uni = |vals: &[Option<Opd>], v: u32| match vals[v as usize] {
        Some(Opd::Uni(c)) => Some(c),
        _ => None,
    };
    for (i, ins) in code.iter().enumerate() {
        let (op, a, b, post) = match (*ins, leaves.steps[i]) {
            (Instr::Input(k), _) => {
                let k = k as usize;
                let data = f32::slice(inputs[k])?;
                vals[i] = Some(match whole_run(layouts[k], n) {
                    Run::Contig(off) => Opd::In { k, off },
                    Run::Const(off) => Opd::Uni(data[off]),
                    Run::Strided => return None,
                });
                continue;
            }
            (Instr::Const(_) | Instr::Param(_), _) => {
                let c = leaves.uni[i].expect("leaf value");
                vals[i] = Some(Opd::Uni(f32::sv(c)));
                continue;
            }
            (_, Step::Skip) => continue,
            (Instr::Unary(op, a), Step::Plain) => (Op::Unary(op), a, a, None),
            (Instr::Binary(op, a, b), Step::Plain) => (Op::Binary(op), a, b, None),
            (
                _,
                Step::Tail {
                    head,
                    ops,
                    n: count,
                },
            ) => {
                let post = Aff::<f32>::new(
                    ops[..count]
                        .iter()
                        .map(|&(o, v, l)| uni(&vals, v).map(|c| (o, c, l)))
                        .collect::<Option<Vec<_>>>()?,
                );
                match code[head as usize] {
                    Instr::Unary(op, a) => (Op::Unary(op), a, a, Some(post)),
                    Instr::Binary(op, a, b) => (Op::Binary(op), a, b, Some(post)),
                    _ => return None,
                }
            }
            _ => return None,
        };
        let (a, b) = (vals[a as usize]?, vals[b as usize]?);
        let step = FStep {
            op,
            a,
            b,
            post,
            dst: Dst::Reg(0),
        };
        if let (Opd::Uni(_), Opd::Uni(_)) = (a, b) {
            // Uniform: computed once, here.
            let mut r = [0.0f32];
            exec(
                &step,
                src(a, &[], &[], 0, 1),
                src(b, &[], &[], 0, 1),
                &mut r,
            );
            vals[i] = Some(Opd::Uni(r[0]));
            continue;
        }
        vals[i] = Some(Opd::Reg(i));
        steps.push((step, i));
    }
    let outs: Vec<Opd> = program
        .outputs()
        .iter()
        .map(|&o| vals[o as usize])
        .collect::<Option<_>>()?;
    Some(assign_registers(steps, outs, code.len(), direct))
}

/// Maps values to registers, reusing a register once its value's last reader has run (never
/// for that reader's own output: a kernel's output does not alias its operands). A value that
/// is one output and read by no step is written straight into that output, with no register,
/// when `direct`. Operands and outputs name values on the way in, registers on the way out.
fn assign_registers(
    steps: Vec<(FStep, usize)>,
    outs: Vec<Opd>,
    values: usize,
    direct: bool,
) -> Plan {
    // What the allocation needs per value, in one vector (one allocation per call: this runs
    // on every evaluation, and small programs over small tensors are all overhead).
    #[derive(Clone, Copy)]
    struct Val {
        /// The last step reading it (`usize::MAX`: an output, read to the end).
        last_use: Option<usize>,
        /// How many outputs name it.
        named: u32,
        /// The output its step writes directly.
        write_of: Option<usize>,
        reg: usize,
    }
    let mut val = vec![
        Val {
            last_use: None,
            named: 0,
            write_of: None,
            reg: usize::MAX,
        };
        values
    ];
    for (s, (st, _)) in steps.iter().enumerate() {
        for o in [st.a, st.b] {
            if let Opd::Reg(v) = o {
                val[v].last_use = Some(s);
            }
        }
    }
    for o in &outs {
        if let Opd::Reg(v) = *o {
            val[v].named += 1;
        }
    }
    let outs: Vec<Option<Opd>> = outs
        .into_iter()
        .enumerate()
        .map(|(j, o)| match o {
            Opd::Reg(v) if direct && val[v].last_use.is_none() && val[v].named == 1 => {
                val[v].write_of = Some(j);
                None
            }
            o => Some(o),
        })
        .collect();
    for o in &outs {
        if let Some(Opd::Reg(v)) = *o {
            val[v].last_use = Some(usize::MAX);
        }
    }
    let (mut free, mut regs) = (Vec::with_capacity(steps.len()), 0);
    for (s, (st, v)) in steps.iter().enumerate() {
        let r = match val[*v].write_of {
            Some(_) => None,
            None => Some(free.pop().unwrap_or_else(|| {
                regs += 1;
                regs - 1
            })),
        };
        if let Some(r) = r {
            val[*v].reg = r;
        }
        let mut read = [st.a, st.b].map(|o| match o {
            Opd::Reg(u) => Some(u),
            _ => None,
        });
        if read[0] == read[1] {
            read[1] = None;
        }
        for u in read.into_iter().flatten() {
            if val[u].last_use == Some(s) {
                free.push(val[u].reg);
            }
        }
        if let (Some(r), None) = (r, val[*v].last_use) {
            free.push(r); // never read: the next step may overwrite it
        }
    }
    let reg = |o: Opd| match o {
        Opd::Reg(v) => Opd::Reg(val[v].reg),
        o => o,
    };
    let outs = outs.into_iter().map(|o| o.map(reg)).collect();
    let steps = steps
        .into_iter()
        .map(|(st, v)| FStep {
            a: reg(st.a),
            b: reg(st.b),
            dst: val[v].write_of.map_or(Dst::Reg(val[v].reg), Dst::Out),
            ..st
        })
        .collect();
    Plan {
        steps,
        regs,
        outs,
        stream: !direct,
    }
}

/// Where elements `0..n` of layout `l` are: [`Walk::run`] over the whole iteration, without
/// building the walk (no allocation) when `l` is contiguous or reads one element.
fn whole_run(l: &Layout, n: usize) -> Run {
    if n > 1 && l.reads_one() {
        Run::Const(l.offset())
    } else if l.is_contiguous() {
        Run::Contig(l.offset())
    } else {
        Walk::new(l).run(0, n)
    }
}

/// Operand `o` for elements `start..start + len`.
#[inline(always)]
fn src<'a>(o: Opd, regs: &'a [f32], ins: &[&'a [f32]], start: usize, len: usize) -> Src<'a, f32> {
    match o {
        Opd::Reg(r) => Src::S(&regs[r * BLOCK..r * BLOCK + len]),
        Opd::In { k, off } => Src::S(&ins[k][off + start..off + start + len]),
        Opd::Uni(c) => Src::C(c),
    }
}

#[inline(always)]
fn exec(st: &FStep, a: Src<'_, f32>, b: Src<'_, f32>, out: &mut [f32]) {
    match st.op {
        Op::Unary(op) => unary_f32(op, a, out, st.post),
        Op::Binary(op) => binary_f32(op, a, b, out, st.post),
    }
}

/// Whether outputs are written with plain stores by the steps that compute them
/// ([`plan`]'s `direct`) rather than streamed out of registers: when the program runs on one
/// thread and writes at least 8 MiB. Streaming stores skip reading the lines they write, which
/// pays when several cores together saturate memory; one core is bound by its own latency, and
/// the extra pass through a register costs more. Five-op chain over 32M f32 on the 2-core EPYC
/// VM with one thread: 23.5–25.7 ms direct against 35–37 streamed (a lone multiply 16–18
/// against 24–26); with two threads, the multiply streamed 8.2–9.9 ms against 12.6–14.0 direct.
///
/// Outputs of less than [`CACHED_MAX_BYTES`] in all are written with plain stores too: they
/// fit in the last-level cache, where the next op finds them. Streamed, they went to memory
/// and were read back from there: the SGD update of a small MLP's 784x100 weight, read by the
/// next step's product, took 53–65 µs streamed against 29–34 µs with plain stores, and the
/// whole step 0.91 ms against 0.84–0.86 (2-core EPYC VM under load, 2026-11-27). Between the
/// two sizes outputs stay streamed, as the general driver does.
pub(super) fn direct_writes(n: usize, outputs: usize) -> bool {
    let bytes = n.saturating_mul(4 * outputs);
    bytes < CACHED_MAX_BYTES || (rayon::current_num_threads() == 1 && bytes >= DIRECT_MIN_BYTES)
}

/// See [`direct_writes`].
const DIRECT_MIN_BYTES: usize = 8 << 20;
/// See [`direct_writes`].
const CACHED_MAX_BYTES: usize = 4 << 20;

thread_local! {
    /// This thread's registers of the last call, for the next one (no allocation per call).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// This thread's plans of recent small calls (see [`remembered`]).
    static PLANS: RefCell<Vec<Remembered>> = const { RefCell::new(Vec::new()) };
    /// The entry of `PLANS` the next new plan replaces once it is full.
    static NEXT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Calls over at most this many elements keep their plan for the next call of the same
/// program over operands of the same places ([`remembered`]). Planning a small program (building
/// its leaves, resolving operands, assigning registers: a dozen small allocations) took
/// about a third of a 400-element gradient rule's evaluation; over large tensors it is noise.
const REMEMBER_MAX: usize = 1 << 16;
/// Plans kept per thread (a training step's distinct small programs: its gradient rules).
const REMEMBERED: usize = 32;

/// A plan with what it was made for: the program (by its fingerprint, which memoizers take
/// for the program: `kiln_core::expr::fingerprint`), the element count, the write mode and
/// every input's [`Place`] (no parameters: what else the plan bakes in is a function of the
/// program).
struct Remembered {
    print: u128,
    n: usize,
    direct: bool,
    places: Vec<Place>,
    plan: Rc<Plan>,
}

/// Where an input's elements are, as far as a plan depends on it: from an offset, or one
/// value (by its bits) everywhere.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Contig(usize),
    Uni(u32),
}

fn place(l: &Layout, d: &CpuData, n: usize) -> Option<Place> {
    match whole_run(l, n) {
        Run::Contig(off) => Some(Place::Contig(off)),
        Run::Const(off) => Some(Place::Uni(f32::slice(d)?.get(off)?.to_bits())),
        Run::Strided => None,
    }
}

/// The plan of `program` over these inputs: the one a previous call over inputs in the same
/// places made, if this thread still has it, else `make()`'s, kept for the next such call.
/// Calls with parameters, strided inputs or more than [`REMEMBER_MAX`] elements are neither
/// looked up nor kept.
pub(super) fn remembered(
    program: &Program,
    layouts: &[&Layout],
    inputs: &[&CpuData],
    params: &[f64],
    (n, direct): (usize, bool),
    make: impl FnOnce() -> Option<Plan>,
) -> Option<Rc<Plan>> {
    let small = n <= REMEMBER_MAX && params.is_empty() && layouts.len() == inputs.len();
    let print = program.fingerprint();
    let hit = small
        .then(|| {
            PLANS.with(|plans| {
                let plans = plans.try_borrow().ok()?;
                let hit = plans.iter().find(|r| {
                    r.print == print
                        && r.n == n
                        && r.direct == direct
                        && r.places.len() == layouts.len()
                        && (r.places.iter().zip(layouts).zip(inputs))
                            .all(|((&p, l), d)| place(l, d, n) == Some(p))
                })?;
                Some(hit.plan.clone())
            })
        })
        .flatten();
    if hit.is_some() {
        return hit;
    }
    let plan = Rc::new(make()?);
    let places = small
        .then(|| {
            (layouts.iter().zip(inputs))
                .map(|(l, d)| place(l, d, n))
                .collect::<Option<Vec<_>>>()
        })
        .flatten();
    if let Some(places) = places {
        PLANS.with(|plans| {
            if let Ok(mut plans) = plans.try_borrow_mut() {
                let entry = Remembered {
                    print,
                    n,
                    direct,
                    places,
                    plan: plan.clone(),
                };
                // Replaced in turn once full (a step's rules fit; a stream of one-off
                // programs only cycles through).
                let at = NEXT.with(|c| {
                    let at = c.get();
                    c.set((at + 1) % REMEMBERED);
                    at
                });
                if plans.len() < REMEMBERED {
                    plans.push(entry);
                } else {
                    plans[at] = entry;
                }
            }
        });
    }
    Some(plan)
}

/// Runs `plan` over `n` elements into `outs`, in chunks across cores when large.
pub(super) fn run(plan: &Plan, program: &Program, inputs: &[&CpuData], n: usize, outs: &Outs) {
    let ins: Vec<&[f32]> = inputs
        .iter()
        .map(|d| f32::slice(d).unwrap_or(&[]))
        .collect();
    let chunk = if n < PAR_MIN || n.saturating_mul(program.code().len()) < PAR_WORK {
        n
    } else {
        par_chunk(n).div_ceil(BLOCK) * BLOCK
    };
    let task = |c: usize| {
        let (start, end) = (c * chunk, ((c + 1) * chunk).min(n));
        let mut regs = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
        regs.resize(plan.regs * BLOCK, 0.0);
        run_range(plan, &ins, start, end, &mut regs, outs);
        SCRATCH.with(|s| *s.borrow_mut() = regs);
    };
    let tasks = n.div_ceil(chunk.max(1));
    if tasks <= 1 {
        task(0);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// Elements `start..end`, compiled for the widest vector unit the processor has (as
/// `Frame::kernel` is).
fn run_range(plan: &Plan, ins: &[&[f32]], start: usize, end: usize, regs: &mut [f32], o: &Outs) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
        unsafe fn avx512(p: &Plan, i: &[&[f32]], s: usize, e: usize, r: &mut [f32], o: &Outs) {
            run_body(p, i, s, e, r, o)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(p: &Plan, i: &[&[f32]], s: usize, e: usize, r: &mut [f32], o: &Outs) {
            run_body(p, i, s, e, r, o)
        }
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
            // SAFETY: the processor has every feature `avx512` is compiled for (checked just
            // above); the function itself is safe Rust.
            return unsafe { avx512(plan, ins, start, end, regs, o) };
        }
        if has!("avx2") && has!("fma") {
            // SAFETY: as above, for AVX2 and FMA.
            return unsafe { avx2(plan, ins, start, end, regs, o) };
        }
    }
    run_body(plan, ins, start, end, regs, o)
}

#[inline(always)]
fn run_body(plan: &Plan, ins: &[&[f32]], mut start: usize, end: usize, regs: &mut [f32], o: &Outs) {
    while start < end {
        let len = BLOCK.min(end - start);
        for st in &plan.steps {
            match st.dst {
                Dst::Out(j) => {
                    // SAFETY: chunks are disjoint ranges of the flat index and every output has
                    // the iteration's shape, so this task alone writes `start..start + len`.
                    let dst = unsafe { o.slice::<f32>(j, start, len) };
                    let (a, b) = (
                        src(st.a, regs, ins, start, len),
                        src(st.b, regs, ins, start, len),
                    );
                    exec(st, a, b, dst);
                }
                Dst::Reg(r) => {
                    // The register written is never an operand (see `assign_registers`): take
                    // it out.
                    let (lo, hi) = regs.split_at_mut(r * BLOCK);
                    let (out, hi) = hi.split_at_mut(BLOCK);
                    let (a, b) = (
                        split_src(st.a, lo, hi, r, ins, start, len),
                        split_src(st.b, lo, hi, r, ins, start, len),
                    );
                    exec(st, a, b, &mut out[..len]);
                }
            }
        }
        for (j, v) in plan.outs.iter().enumerate() {
            let Some(v) = *v else { continue };
            // SAFETY: chunks are disjoint ranges of the flat index and every output has the
            // iteration's shape, so this task alone writes `start..start + len` of each.
            let dst = unsafe { o.slice::<f32>(j, start, len) };
            match src(v, regs, ins, start, len) {
                Src::S(s) if plan.stream => {
                    stream_copy(bytemuck::cast_slice(s), bytemuck::cast_slice_mut(dst))
                }
                Src::S(s) => dst.copy_from_slice(s),
                Src::C(c) => dst.fill(c),
            }
        }
        start += len;
    }
    store_fence();
}

/// As [`src`], for registers split around register `out` (`lo` below it, `hi` above it).
#[inline(always)]
fn split_src<'a>(
    o: Opd,
    lo: &'a [f32],
    hi: &'a [f32],
    out: usize,
    ins: &[&'a [f32]],
    start: usize,
    len: usize,
) -> Src<'a, f32> {
    match o {
        Opd::Reg(r) if r < out => Src::S(&lo[r * BLOCK..r * BLOCK + len]),
        Opd::Reg(r) => {
            let at = (r - out - 1) * BLOCK;
            Src::S(&hi[at..at + len])
        }
        o => src(o, &[], ins, start, len),
    }
}
