//! Expression programs on CUDA: one generated kernel per distinct program and variant, for
//! users' programs (`Backend::eval_expr`, in `expr_eval.rs`) and for the deferral layer's
//! recorded chains (`lazy.rs`).
//!
//! # Why
//!
//! An expression program ([`kiln_core::expr`]) run op by op launches one kernel per instruction
//! and sends every intermediate through device memory. Here the whole program is one kernel:
//! each input is read once, each output written once, reductions and their post-map included.
//! One code generator ([`codegen`]) serves both callers, so a chain kiln records and a program
//! a user writes compile to the same kind of kernel.
//!
//! # How
//!
//! `check_call` validates the call; [`codegen::plan`] classifies every operand's layout and
//! merges dimensions (pure, no device); [`codegen::source`] writes the CUDA C; NVRTC compiles it
//! through the disk cache of `nvrtc.rs`, and the function is memoized per device by `(program,
//! variant)` (`DeviceState::generated_func`; its module is unloaded by `clear_kernel_cache`
//! with the other generated kernels), apart for each [`Caller`]. A program run again on
//! operands of the same layouts finds its checked call, plan and kernel in a per-thread memo
//! ([`PLANNED`]) and redoes none of them: its plan keeps what every run needs (output sizes,
//! bounds, the widest vector width, and per device and width the kernel, grid and dimension
//! arguments), so a run only checks alignment and packs pointers. A lone op (`run_single`
//! in `expr_lone.rs`, what a realized op of the op table runs) first looks in the few plans
//! its thread used last, by comparison alone: a realized lone op's host time is its whole
//! cost, and it had grown by ~0.6 µs (40%) when per-op kernels became generated programs.
//! Inputs are computed buffers; outputs are fresh contiguous buffers; the launch goes to the
//! calling thread's current stream. A program not compiled yet may run in the interpreter
//! while it compiles (`tier.rs`).
//!
//! A program that cannot run as one kernel (layouts with more than 8 non-mergeable dimensions,
//! argument lists beyond what a launch takes, a caller's kernel budget spent) gives `None`, and
//! the caller runs it another way. A kernel NVRTC rejects is an [`Error::Backend`] carrying its
//! log.

use std::cell::RefCell;
use std::sync::atomic::Ordering;

use std::sync::atomic::AtomicU64;

use kiln_core::expr::{Instr, Program, Val, check_call};
use kiln_core::{DType, Error, Layout, Result, Shape};

use crate::codegen::{self, Access, Geometry, KERNEL, Strategy, Variant};
use crate::device::{DeviceState, Func, KERNEL_EPOCH};
use crate::launch::{Args, Dims, MAX_DIMS, Strides};
use crate::memory::{Buffer, alloc};
use crate::tier;

/// Distinct generated kernels per device; past this, new programs run op by op.
pub(crate) const MAX_KERNELS: usize = 1024;

/// Threads per block of the elementwise and thread-per-kept-element kernels.
const BLOCK: u32 = 256;
/// Threads per block of a reduction with few kept elements (at most 128 registers a thread
/// then fit an SM; `block_reduce`'s scratch holds up to 32 warps).
const WIDE_BLOCK: u32 = 512;

/// A launch's argument budget, below `launch::Args`'s capacity (128 arguments, 512 words).
const MAX_ARG_COUNT: usize = 120;
const MAX_ARG_WORDS: usize = 500;

/// Who runs a program: its kernels are memoized apart, under their own budget, and launched
/// under their own name (what the profiler shows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// `Backend::eval_expr`: a user's program, up to [`MAX_KERNELS`] per device ("expr").
    User,
    /// The deferral layer (`lazy.rs`): a recorded chain of elementwise ops, up to `budget`
    /// programs per device ("fused elementwise").
    Lazy { budget: usize },
    /// One op of the op table over computed buffers (`expr_lone::run_single`), under the op's name: no
    /// budget, as there are at most a few per op, dtype and layout class.
    Op(&'static str),
}

impl Caller {
    fn op(self) -> &'static str {
        match self {
            Caller::User => "expr",
            Caller::Lazy { .. } => "fused elementwise",
            Caller::Op(name) => name,
        }
    }
}

static LAZY_PROGRAMS: AtomicU64 = AtomicU64::new(0);
static LAZY_NANOS: AtomicU64 = AtomicU64::new(0);

/// The deferral layer's programs built so far in this process (every device) and the host
/// nanoseconds spent building them (NVRTC, or the disk cache): see
/// `lazy::fused_program_stats`.
pub(crate) fn lazy_program_stats() -> (u64, u64) {
    (
        LAZY_PROGRAMS.load(Ordering::Relaxed),
        LAZY_NANOS.load(Ordering::Relaxed),
    )
}

/// Runs a planned program over computed buffers (`layouts`, the planned ones): one generated
/// kernel (two for a split reduction), its outputs fresh buffers. `None` when the program
/// cannot run fused (too many dimensions or arguments, or the caller's kernel budget is
/// spent): the caller then runs it another way.
pub(crate) fn run_planned(
    dev: &'static DeviceState,
    planned: &Planned,
    bufs: &[&Buffer],
    layouts: &[&Layout],
    params: &[f64],
    caller: Caller,
) -> Result<Option<Vec<Buffer>>> {
    let Some(run) = prepare(dev, planned, bufs, layouts, caller)? else {
        return Ok(None);
    };
    let outs = (planned.out_bytes.iter())
        .map(|&bytes| alloc(dev, bytes))
        .collect::<Result<Vec<Buffer>>>()?;
    if planned.work {
        launch(dev, &run, planned, bufs, layouts, &outs, params, caller)?;
    }
    Ok(Some(outs))
}

/// [`run_planned`] of a program with one output (a lone op, a recorded chain), which it
/// returns without a `Vec` around it: a lone op's host time is its cost.
pub(crate) fn run_planned_one(
    dev: &'static DeviceState,
    planned: &Planned,
    bufs: &[&Buffer],
    layouts: &[&Layout],
    params: &[f64],
    caller: Caller,
) -> Result<Option<Buffer>> {
    debug_assert_eq!(planned.exec.outputs().len(), 1, "one output");
    let Some(run) = prepare(dev, planned, bufs, layouts, caller)? else {
        return Ok(None);
    };
    let out = alloc(dev, planned.out_bytes[0])?;
    if planned.work {
        let outs = std::slice::from_ref(&out);
        launch(dev, &run, planned, bufs, layouts, outs, params, caller)?;
    }
    Ok(Some(out))
}

/// The kernel and geometry (with the vector width the buffers' alignment allows) that run
/// `planned` over `bufs`, after checking that every input's layout lies inside its buffer;
/// `None` when it cannot run fused (see [`run_planned`]).
fn prepare(
    dev: &'static DeviceState,
    planned: &Planned,
    bufs: &[&Buffer],
    layouts: &[&Layout],
    caller: Caller,
) -> Result<Option<Run>> {
    let Some(geo) = &planned.geo else {
        return Ok(None);
    };
    for (k, (b, &reach)) in bufs.iter().zip(&planned.reach).enumerate() {
        if reach > b.len_bytes() {
            let l = layouts[k];
            return Err(Error::invalid(
                caller.op(),
                format!(
                    "input {k}: layout {:?} (offset {}) reaches past a buffer of {} bytes",
                    l.strides(),
                    l.offset(),
                    b.len_bytes()
                ),
            ));
        }
    }
    // The vector width depends on the buffers' alignment.
    let vec = planned.vec_width(geo, bufs, layouts);
    planned.ready(dev, geo, vec, caller)
}

/// A checked call and its plan (`None`: the program runs op by op), for one program, iteration
/// shape, input layouts and parameter count.
pub(crate) struct Planned {
    program: Program,
    /// What the kernel computes: `program` itself, or its widened form when it has 16-bit
    /// floats (`Program::widened`: loads and stores in 16 bits, arithmetic in f32, one
    /// rounding per instruction, as on the CPU). Plan, source and arguments follow it.
    exec: Program,
    shape: Shape,
    layouts: Vec<Layout>,
    params: usize,
    /// `None`: the program cannot run as one kernel.
    pub(crate) geo: Option<Geometry>,
    /// The bytes of each output (a fresh contiguous buffer).
    out_bytes: Vec<usize>,
    /// Whether a run has anything to compute (an element, or a kept element when reducing).
    work: bool,
    /// The bytes each input's layout reaches into its buffer (offset included), for the
    /// bounds check of every run.
    reach: Vec<usize>,
    /// The vector width of an elementwise kernel whose contiguous inputs are all aligned for
    /// it ([`codegen::vec_elems`] at address 0), or 0: only the alignment is checked per run.
    vec_max: u32,
    /// What runs it, per device, kernel-cache epoch and vector width: `geo` with that width
    /// and the kernel (so a run looks up nothing else, and compares no program).
    ready: RefCell<Vec<Ready>>,
}

/// A kernel found for a [`Planned`] (see `Planned::ready`).
struct Ready {
    ordinal: usize,
    epoch: u64,
    vec: u32,
    run: Run,
}

/// What one run launches: the geometry (with its vector width), the kernel, and what follows
/// from them alone (computed once per [`Ready`]).
#[derive(Clone)]
struct Run {
    geo: std::rc::Rc<Geometry>,
    func: Func,
    /// `func` is the interpreter (`tier.rs`): the program's kernel is not compiled yet.
    interp: bool,
    /// The launch's grid and block (unused by a split reduction: `launch_split`).
    grid: (u32, u32),
    block: u32,
    /// The iteration dimensions argument (`geo.dims`).
    dims: Dims,
}

impl Planned {
    /// Whether this is the plan of a call over `shape` and `layouts` with `params` parameters
    /// (of its program: the caller compares that). Lists are compared element by element:
    /// they are short, and a `memcmp` call for each cost more than the comparisons.
    fn is_for(&self, shape: &Shape, layouts: &[&Layout], params: usize) -> bool {
        fn same(a: &[usize], b: &[usize]) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
        }
        self.params == params
            && same(self.shape.dims(), shape.dims())
            && self.layouts.len() == layouts.len()
            && self.layouts.iter().zip(layouts).all(|(a, b)| {
                a.offset() == b.offset()
                    && same(a.dims(), b.dims())
                    && same(a.strides(), b.strides())
            })
    }

    /// The elements per vector of the kernel's loop over `bufs` (see `codegen::Variant::vec`):
    /// [`Planned::vec_max`] when every contiguous input is aligned for it, else 0; for a split
    /// reduction, 4 or 0 (see [`vec_width`]).
    fn vec_width(&self, geo: &Geometry, bufs: &[&Buffer], layouts: &[&Layout]) -> u32 {
        if self.exec.reduces() {
            return vec_width(&self.exec, geo, bufs, layouts);
        }
        if self.vec_max == 0 {
            return 0;
        }
        let n = self.vec_max as usize;
        let aligned = (0..bufs.len())
            .filter(|&k| geo.variant.access[k] == Access::Contig)
            .all(|k| {
                let size = self.exec.inputs()[k].size_in_bytes();
                let at = bufs[k].device_ptr() + (layouts[k].offset() * size) as u64;
                at.is_multiple_of((n * size) as u64)
            });
        if aligned { self.vec_max } else { 0 }
    }

    /// How many outputs its program has.
    pub(crate) fn outputs(&self) -> usize {
        self.exec.outputs().len()
    }

    /// Whether this is the plan of the program `parts` define over `shape` and `layouts` with
    /// `params` parameters (by comparison alone: no fingerprint, no hash).
    pub(crate) fn is_plan_of(
        &self,
        parts: Parts<'_>,
        shape: &Shape,
        layouts: &[&Layout],
        params: usize,
    ) -> bool {
        parts.matches(&self.program) && self.is_for(shape, layouts, params)
    }

    /// The geometry (this plan's `geo` with vector width `vec`) and kernel that run it on
    /// `dev`: remembered per device, kernel-cache epoch and width, else found by [`kernel`]
    /// (`None`: the caller's kernel budget is spent).
    fn ready(
        &self,
        dev: &'static DeviceState,
        geo: &Geometry,
        vec: u32,
        caller: Caller,
    ) -> Result<Option<Run>> {
        let (ordinal, epoch) = (dev.ordinal(), KERNEL_EPOCH.load(Ordering::SeqCst));
        {
            let ready = self.ready.borrow();
            let hit = ready
                .iter()
                .find(|r| r.ordinal == ordinal && r.epoch == epoch && r.vec == vec);
            if let Some(r) = hit {
                return Ok(Some(r.run.clone()));
            }
        }
        let shared = (self.ready.borrow().iter())
            .find(|r| r.vec == vec)
            .map(|r| r.run.geo.clone());
        let geo = shared.unwrap_or_else(|| {
            let mut g = geo.clone();
            g.variant.vec = vec;
            std::rc::Rc::new(g)
        });
        let Some(k) = kernel(dev, &self.exec, &geo.variant, caller)? else {
            return Ok(None);
        };
        let (func, interp) = match k {
            Kernel::Compiled(f) => (f, false),
            Kernel::Interpreted(f) => (f, true),
        };
        // The interpreter loops element by element, whatever the vector width.
        let (grid, block) = match interp {
            true => (dev.grid_1d(geo.n as u64, BLOCK), BLOCK),
            false => grid_and_block(dev, &geo),
        };
        let dims = dims_arg(&geo.dims);
        let run = Run {
            geo,
            func,
            interp,
            grid,
            block,
            dims,
        };
        if interp {
            // Not remembered: a later run takes the compiled kernel once it is there.
            return Ok(Some(run));
        }
        self.ready.borrow_mut().push(Ready {
            ordinal,
            epoch,
            vec,
            run: run.clone(),
        });
        Ok(Some(run))
    }
}

/// Plans a thread made, by a hash of what they depend on. A program run again on operands of
/// the same layouts (a norm in a loop; every chain the deferral layer records in a training
/// step) reuses its checked call and plan instead of making them again: `check_call` and
/// `codegen::plan` were a fifth of the host time of d2l's matmul-and-norm loop, profiled
/// against a stand-in driver. At most [`PLANNED_LEN`]; when full, it starts over.
const PLANNED_LEN: usize = 512;

type PlanMemo = kiln_core::fasthash::FastMap<u64, Vec<std::rc::Rc<Planned>>>;

thread_local! {
    static PLANNED: RefCell<(PlanMemo, usize)> = RefCell::new((PlanMemo::default(), 0));
}

/// The defining parts of a program (what `Program::new` takes).
#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    pub inputs: &'a [DType],
    pub params: &'a [DType],
    pub code: &'a [Instr],
    pub outputs: &'a [Val],
    pub axes: &'a [isize],
}

impl Parts<'_> {
    pub(crate) fn of(p: &Program) -> Parts<'_> {
        Parts {
            inputs: p.inputs(),
            params: p.params(),
            code: p.code(),
            outputs: p.outputs(),
            axes: p.axes(),
        }
    }
    /// Whether `p` is the program of these parts. Compared element by element: the slices are
    /// a few elements long, and `==` on slices of plain values calls `memcmp` once per slice,
    /// which was a quarter of a lone op's host time against a stand-in driver.
    fn matches(&self, p: &Program) -> bool {
        fn same<T: PartialEq>(a: &[T], b: &[T]) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
        }
        same(self.code, p.code())
            && same(self.inputs, p.inputs())
            && same(self.params, p.params())
            && same(self.outputs, p.outputs())
            && same(self.axes, p.axes())
    }
}

fn plan_key(fingerprint: u128, shape: &Shape, layouts: &[&Layout], params: usize) -> u64 {
    use std::hash::Hasher;
    let mut h = kiln_core::fasthash::FnvHasher::default();
    h.write_u64(fingerprint as u64);
    h.write_usize(params);
    for &d in shape.dims() {
        h.write_usize(d);
    }
    for l in layouts {
        h.write_usize(l.offset());
        for &s in l.strides() {
            h.write_usize(s);
        }
    }
    h.finish()
}

/// The checked call and plan of `program` over `layouts` (see [`PLANNED`]); a bad call is an
/// error as `check_call` says, and is not remembered.
pub(crate) fn planned(
    program: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    params: &[f64],
) -> Result<std::rc::Rc<Planned>> {
    let fp = program.fingerprint();
    let key = plan_key(fp, shape, layouts, params.len());
    if let Some(p) = planned_hit(key, fp, Parts::of(program), shape, layouts, params.len()) {
        return Ok(p);
    }
    plan_new(key, program.clone(), shape, layouts, params)
}

/// [`planned`] of the program `Program::new` would make of `parts`, which it builds only
/// when this call was not planned before (the deferral layer records its chains anew every
/// step; building and validating the same program again was a tenth of a logistic-regression
/// step's host time). `None`: `parts` is not a valid program.
pub(crate) fn planned_parts(
    parts: Parts<'_>,
    shape: &Shape,
    layouts: &[&Layout],
    params: &[f64],
) -> Result<Option<std::rc::Rc<Planned>>> {
    let fp = kiln_core::expr::fingerprint(
        parts.inputs,
        parts.params,
        parts.code,
        parts.outputs,
        parts.axes,
    );
    let key = plan_key(fp, shape, layouts, params.len());
    if let Some(p) = planned_hit(key, fp, parts, shape, layouts, params.len()) {
        return Ok(Some(p));
    }
    let Ok(program) = Program::new(
        parts.inputs.to_vec(),
        parts.params.to_vec(),
        parts.code.to_vec(),
        parts.outputs.to_vec(),
        parts.axes.to_vec(),
    ) else {
        return Ok(None);
    };
    plan_new(key, program, shape, layouts, params).map(Some)
}

/// The plan of the program with fingerprint `fp` (whose parts are `parts`) for this call,
/// if planned before. Equal 128-bit fingerprints are taken for equal programs (checked in
/// debug builds).
fn planned_hit(
    key: u64,
    fp: u128,
    parts: Parts<'_>,
    shape: &Shape,
    layouts: &[&Layout],
    params: usize,
) -> Option<std::rc::Rc<Planned>> {
    PLANNED.with(|m| {
        m.borrow().0.get(&key).and_then(|bucket| {
            let hit = (bucket.iter())
                .find(|e| e.program.fingerprint() == fp && e.is_for(shape, layouts, params))?;
            debug_assert!(parts.matches(&hit.program), "a fingerprint collision");
            Some(hit.clone())
        })
    })
}

fn plan_new(
    key: u64,
    program: Program,
    shape: &Shape,
    layouts: &[&Layout],
    params: &[f64],
) -> Result<std::rc::Rc<Planned>> {
    let call = check_call(&program, shape, layouts, params)?;
    let exec = program.widened()?;
    let geo = codegen::plan(&exec, shape, layouts, &call.axes)
        .ok()
        .filter(|g| fits_args(&exec, g));
    let reach = layouts
        .iter()
        .zip(exec.inputs())
        .map(|(l, d)| l.storage_extent() * d.size_in_bytes())
        .collect();
    let vec_max = match &geo {
        Some(g) if !exec.reduces() => {
            codegen::vec_elems(&exec, &g.variant.access, (&g.dims, &g.strides), |_| 0)
        }
        _ => 0,
    };
    let out_bytes = (0..exec.outputs().len())
        .map(|j| {
            let n = call.output_len(&program, j, shape);
            n * exec.dtype(exec.outputs()[j]).size_in_bytes()
        })
        .collect();
    let work = if exec.reduces() {
        call.kept.elem_count() > 0
    } else {
        shape.elem_count() > 0
    };
    let p = std::rc::Rc::new(Planned {
        program,
        exec,
        shape: shape.clone(),
        layouts: layouts.iter().map(|l| (*l).clone()).collect(),
        params: params.len(),
        out_bytes,
        work,
        reach,
        vec_max,
        geo,
        ready: RefCell::new(Vec::new()),
    });
    PLANNED.with(|m| {
        let (map, len) = &mut *m.borrow_mut();
        if *len == PLANNED_LEN {
            map.clear();
            *len = 0;
        }
        map.entry(key).or_default().push(p.clone());
        *len += 1;
    });
    Ok(p)
}

/// The elements per vector of an elementwise program's loop (see `codegen::Variant::vec`,
/// [`codegen::vec_elems`]), or 0. For a split or block reduction, 4 or 0: groups of 4
/// elements per load, so every contiguous or strided input must have 2- or 4-byte elements and
/// be aligned to 4 of them at the start of every kept element's row and of every group (parts
/// start at multiples of 4 elements); a strided operand must run with unit stride along the
/// innermost reduced dim, which 4 divides, so that a group never leaves one row (batch norm's
/// statistics over `(n, h, w)` of `[n, c, h, w]`: rows of `h·w`), and its other strides
/// must keep the groups aligned.
fn vec_width(p: &Program, g: &Geometry, bufs: &[&Buffer], layouts: &[&Layout]) -> u32 {
    let at = |k: usize| {
        bufs[k].device_ptr() + (layouts[k].offset() * p.inputs()[k].size_in_bytes()) as u64
    };
    if !p.reduces() {
        return codegen::vec_elems(p, &g.variant.access, (&g.dims, &g.strides), at);
    }
    if !matches!(g.variant.strategy, Strategy::Split | Strategy::Block) {
        return 0;
    }
    let n_in = p.inputs().len();
    let rows = g.red_dims.last().is_some_and(|d| d % 4 == 0);
    let load_ok = |k: usize| {
        let size = p.inputs()[k].size_in_bytes();
        matches!(size, 2 | 4)
            && at(k).is_multiple_of(4 * size as u64)
            && (g.n == 1 || g.strides[k].iter().all(|s| s % 4 == 0))
    };
    let ok = g.variant.access.iter().enumerate().all(|(m, a)| match a {
        Access::Bcast => true,
        Access::Contig => m >= n_in || load_ok(m),
        Access::Strided => {
            let rs = &g.red_strides[m];
            let inner = rs
                .split_last()
                .is_some_and(|(&last, outer)| last == 1 && outer.iter().all(|s| s % 4 == 0));
            rows && inner && (m >= n_in || load_ok(m))
        }
    });
    if ok { 4 } else { 0 }
}

/// Whether the launch's arguments fit (see [`MAX_ARG_COUNT`]).
fn fits_args(p: &Program, g: &Geometry) -> bool {
    const DIMS: usize = std::mem::size_of::<Dims>() / 8;
    const STRIDES: usize = std::mem::size_of::<Strides>() / 8;
    let strided = g
        .variant
        .access
        .iter()
        .filter(|a| **a == Access::Strided)
        .count();
    let ptrs = p.outputs().len() + p.inputs().len();
    let (count, words) = if p.reduces() {
        let ops = g.variant.access.len();
        // A split reduction's parts, phase and partial buffers.
        let split = match g.variant.strategy {
            Strategy::Split => 2 + g.partials.len(),
            _ => 0,
        };
        (
            4 + ptrs + ops + strided + p.params().len() + split,
            2 + 2 * DIMS + ptrs + (ops + strided) * STRIDES + p.params().len() + split,
        )
    } else {
        (
            2 + ptrs + strided + p.params().len(),
            1 + DIMS + ptrs + strided * STRIDES + p.params().len(),
        )
    };
    count <= MAX_ARG_COUNT && words <= MAX_ARG_WORDS
}

fn dims_arg(d: &[usize]) -> Dims {
    debug_assert!(d.len() <= MAX_DIMS, "checked by codegen::plan");
    let mut out = Dims {
        rank: d.len() as i32,
        ..Default::default()
    };
    for (o, &x) in out.d.iter_mut().zip(d) {
        *o = x as u64;
    }
    out
}

fn strides_arg(s: &[usize]) -> Strides {
    let mut out = Strides::default();
    for (o, &x) in out.s.iter_mut().zip(s) {
        *o = x as u64;
    }
    out
}

/// Packs the arguments in the order `codegen::source` declares them, and launches.
#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &'static DeviceState,
    run: &Run,
    planned: &Planned,
    bufs: &[&Buffer],
    layouts: &[&Layout],
    outs: &[Buffer],
    params: &[f64],
    caller: Caller,
) -> Result<()> {
    let (p, g, f) = (&planned.exec, &*run.geo, run.func);
    let at = |k: usize| -> u64 {
        bufs[k].device_ptr() + (layouts[k].offset() * p.inputs()[k].size_in_bytes()) as u64
    };
    if run.interp {
        // Named per program (the interpreter's one function runs them all).
        let fp = planned.program.fingerprint();
        crate::profile::fused_ops(((fp ^ fp >> 64) as usize, u64::MAX), || {
            format!("interpreted: {}", op_names(planned, caller))
        });
        let mut ptrs = [0u64; 8];
        for (o, b) in ptrs.iter_mut().zip(outs) {
            *o = b.device_ptr();
        }
        let outs = &ptrs[..outs.len()];
        return tier::launch(
            dev,
            f,
            p,
            g,
            at,
            outs,
            params,
            caller.op(),
            run.grid,
            run.block,
        );
    }
    let mut a = Args::new();
    let reduces = p.reduces();
    if reduces {
        a.push(g.n as u64).push(g.n_red as u64);
        a.push(run.dims).push(dims_arg(&g.red_dims));
    } else {
        a.push(g.n as u64).push(run.dims);
    }
    for o in outs {
        a.push(o.device_ptr());
    }
    for k in 0..p.inputs().len() {
        a.push(at(k));
        if !reduces && g.variant.access[k] == Access::Strided {
            a.push(strides_arg(&g.strides[k]));
        }
    }
    if reduces {
        for m in 0..g.variant.access.len() {
            a.push(strides_arg(&g.strides[m]));
            if g.variant.access[m] == Access::Strided {
                a.push(strides_arg(&g.red_strides[m]));
            }
        }
    }
    for (&v, &d) in params.iter().zip(p.params()) {
        match d {
            DType::F32 => a.push(v as f32),
            DType::I64 => a.push(v as i64),
            DType::U8 => a.push(v as u8),
            _ => a.push(v),
        };
    }
    let kernel = (f.0 as usize, KERNEL_EPOCH.load(Ordering::SeqCst));
    crate::profile::fused_ops(kernel, || op_names(planned, caller));
    if g.variant.strategy == Strategy::Split {
        return launch_split(dev, f, g, a, caller.op());
    }
    dev.launch(caller.op(), f, run.grid, run.block, 0, a.ptrs())
}

/// What the profiler names a launch of `planned` after: the program as written (not its
/// widened form's casts).
fn op_names(planned: &Planned, caller: Caller) -> String {
    match caller {
        Caller::User => format!(
            "expr: {}",
            crate::profile::program_op_names(&planned.program)
        ),
        Caller::Lazy { .. } => crate::profile::program_op_names(&planned.program),
        Caller::Op(name) => name.to_string(),
    }
}

/// The grid and block of a launch of `g`'s kernel on `dev` (a split reduction's are
/// `launch_split`'s).
fn grid_and_block(dev: &DeviceState, g: &Geometry) -> ((u32, u32), u32) {
    match g.variant.strategy {
        Strategy::Elementwise if g.variant.vec > 1 => (
            dev.grid_1d((g.n as u64).div_ceil(g.variant.vec as u64), BLOCK),
            BLOCK,
        ),
        Strategy::Elementwise | Strategy::Thread => (dev.grid_1d(g.n as u64, BLOCK), BLOCK),
        Strategy::Block => {
            // Fewer kept elements than SMs (a full reduction, such as a norm): wider blocks,
            // since each block reduces its whole share alone. A 10,000-element norm took ~9 µs
            // of GPU time with 256 threads, more than the whole rest of d2l's loop step.
            let max = if g.n < dev.sm_count() as usize {
                WIDE_BLOCK
            } else {
                BLOCK
            };
            let block = (g.n_red.next_power_of_two() as u32).clamp(32, max);
            let blocks = g.n.min(dev.sm_count() as usize * 16).max(1);
            ((blocks as u32, 1), block)
        }
        Strategy::Split => ((0, 0), 0),
    }
}

/// The two launches of a [`Strategy::Split`] kernel whose arguments up to its parameters are
/// `args`: a block per part of each kept element folds into the partial buffers (made here,
/// freed in stream order after the second launch), then a block per kept element folds the
/// partials and runs the post-map.
fn launch_split(
    dev: &'static DeviceState,
    f: Func,
    g: &Geometry,
    args: Args,
    op: &'static str,
) -> Result<()> {
    let slots = g.n * g.parts;
    let partials = g
        .partials
        .iter()
        .map(|d| alloc(dev, slots * d.size_in_bytes()))
        .collect::<Result<Vec<Buffer>>>()?;
    for phase in [0u32, 1] {
        let mut a = args.clone();
        a.push(g.parts as u64).push(phase);
        for b in &partials {
            a.push(b.device_ptr());
        }
        let blocks = if phase == 0 { slots } else { g.n };
        let grid = (blocks.min(dev.sm_count() as usize * 16) as u32, 1);
        dev.launch(op, f, grid, BLOCK, 0, a.ptrs())?;
    }
    Ok(())
}

/// What runs a program: its compiled kernel, or the interpreter while it compiles.
enum Kernel {
    Compiled(Func),
    Interpreted(Func),
}

/// The kernel of `(p, v)` on `dev`: memoized, else generated, compiled (or loaded from the disk
/// cache) and loaded; or the interpreter while that compile runs in the background
/// ([`tier::tiered`]); `None` when the device already holds the caller's budget of them
/// ([`MAX_KERNELS`] for users' programs).
fn kernel(
    dev: &'static DeviceState,
    p: &Program,
    v: &Variant,
    caller: Caller,
) -> Result<Option<Kernel>> {
    let epoch = KERNEL_EPOCH.load(Ordering::SeqCst);
    let hit = RECENT.with(|r| {
        r.borrow()
            .iter()
            .find(|e| {
                e.ordinal == dev.ordinal() && e.epoch == epoch && e.variant == *v && e.program == *p
            })
            .map(|e| e.func)
    });
    if let Some(f) = hit {
        return Ok(Some(Kernel::Compiled(f)));
    }
    let key = ExprKey(p.clone(), v.clone());
    let settled = || match caller {
        Caller::User => dev.generated_settled(&key, MAX_KERNELS),
        Caller::Lazy { budget } => dev.generated_settled(&LazyKey(key.clone()), budget),
        Caller::Op(_) => dev.generated_settled(&OpKey(key.clone()), usize::MAX),
    };
    let mut compiled = None;
    if v.strategy == Strategy::Elementwise && tier::interpretable(p) && !settled() {
        match tier::tiered(dev, p, v)? {
            tier::Tiered::Interpret(f) => return Ok(Some(Kernel::Interpreted(f))),
            tier::Tiered::Compiled(bin) => compiled = Some(bin),
            tier::Tiered::OnTheSpot => {}
        }
    }
    let build = || {
        let t0 = std::time::Instant::now();
        let name = std::ffi::CString::new(KERNEL).map_err(|e| Error::backend("expr", e))?;
        if let Some(bin) = compiled {
            // Built in the background: counted, but nobody waited for it.
            if let Caller::Lazy { .. } = caller {
                LAZY_PROGRAMS.fetch_add(1, Ordering::Relaxed);
            }
            return Ok((bin, name));
        }
        let src = codegen::source(p, v)?;
        let bin = build(&src, dev.arch(), flavor(v))?;
        if let Caller::Lazy { .. } = caller {
            LAZY_PROGRAMS.fetch_add(1, Ordering::Relaxed);
            LAZY_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        Ok((bin, name))
    };
    let f = match caller {
        Caller::User => dev.generated_func(&key, MAX_KERNELS, build)?,
        // The deferral layer's programs are memoized apart (their own budget).
        Caller::Lazy { budget } => dev.generated_func(&LazyKey(key.clone()), budget, build)?,
        Caller::Op(_) => dev.generated_func(&OpKey(key.clone()), usize::MAX, build)?,
    };
    if let Some(func) = f {
        RECENT.with(|r| {
            let mut r = r.borrow_mut();
            if r.len() == RECENT_LEN {
                r.remove(0);
            }
            r.push(Recent {
                ordinal: dev.ordinal(),
                epoch,
                program: key.0,
                variant: key.1,
                func,
            });
        });
    }
    Ok(f.map(Kernel::Compiled))
}

/// Kernels a thread looked up last, so that a program run again (a norm in a loop) finds its
/// kernel by comparing, without cloning and hashing the program and taking the device's memo
/// locks. Valid for one [`KERNEL_EPOCH`] (`clear_kernel_cache` unloads the modules).
struct Recent {
    ordinal: usize,
    epoch: u64,
    program: Program,
    variant: Variant,
    func: Func,
}

const RECENT_LEN: usize = 8;

thread_local! {
    static RECENT: RefCell<Vec<Recent>> = const { RefCell::new(Vec::new()) };
}

/// The memo key of an expression kernel on a device (`DeviceState::generated_func`).
#[derive(Clone, PartialEq, Eq, Hash)]
struct ExprKey(Program, Variant);

/// The same for the deferral layer's programs (a memo of its own, under its own budget).
#[derive(Clone, PartialEq, Eq, Hash)]
struct LazyKey(ExprKey);

/// The same for single ops (`expr_lone::run_single`).
#[derive(Clone, PartialEq, Eq, Hash)]
struct OpKey(ExprKey);

/// How the program of variant `v` compiles: elementwise programs without multiply-add
/// contraction (`Flavor::Elementwise`: the interpreter's bits), reductions with it.
fn flavor(v: &Variant) -> crate::nvrtc::Flavor {
    match v.strategy {
        Strategy::Elementwise => crate::nvrtc::Flavor::Elementwise,
        _ => crate::nvrtc::Flavor::Generated,
    }
}

/// The CUBIN of a generated `source` of `flavor` for `sm_{arch}` (disk cache, else NVRTC);
/// NVRTC's log in an [`Error::Backend`] naming `expr` when it does not compile.
pub(crate) fn build(source: &str, arch: u32, flavor: crate::nvrtc::Flavor) -> Result<Vec<u8>> {
    crate::nvrtc::load_or_compile_source(flavor, "expr.cu", source, arch).map_err(|log| {
        Error::backend(
            "expr",
            format!("NVRTC could not compile a generated kernel for sm_{arch}: {log}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source NVRTC rejects gives a typed error carrying NVRTC's log (needs libnvrtc only).
    #[test]
    fn a_kernel_that_does_not_compile_is_a_typed_error_with_the_log() {
        if !crate::nvrtc::nvrtc_available() {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        let src = "extern \"C\" __global__ void expr(float* y) { y[0] = undefined_name; }";
        match build(src, 90, crate::nvrtc::Flavor::Elementwise) {
            Err(Error::Backend { op, msg }) => {
                assert_eq!(op, "expr");
                assert!(msg.contains("undefined_name"), "{msg}");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
    }
}
