//! Tiered execution of generated programs: a program whose kernel is not compiled yet runs in
//! the interpreter (`kernels/interp.cu`, a fixed kernel shipped prebuilt) while NVRTC compiles
//! it on a background thread; once the CUBIN is there, runs take the compiled kernel.
//!
//! # Why
//!
//! A fresh machine's first training step used to wait for NVRTC once per program, one after
//! another, as the step reached each (the main job's 12 programs: ~750 ms on an H100 host, 35–
//! 120 ms each, of which ~35 ms is NVRTC's floor for any kernel). The programs of a step are
//! not known before the step reaches them, so they cannot be compiled ahead; but they need not
//! be waited for: the interpreter runs any elementwise f32 program at once (slower per element,
//! which a first step does not notice), the compiles run in parallel on idle cores, and the
//! step goes on. Only what the interpreter does not take — reductions, other dtypes, programs
//! over its limits, graph capture — still compiles on the spot.
//!
//! # The same bits
//!
//! Each instruction calls the op's own `op_<name><float>` (the checked-in `interp_ops.cuh`,
//! written from the op tables like every generated program's), and both the interpreter and
//! the generated elementwise programs compile with `--fmad=false` (`Flavor::Elementwise`), so
//! an interpreted run gives exactly the compiled kernel's bits (a GPU test checks random
//! programs both ways, and fails when the compiled side contracts multiply-adds).
//!
//! # Switches
//!
//! `KILN_CUDA_TIER=0` or [`set_tiering`]`(Tiering::Off)` compiles on the spot as before;
//! `Tiering::Always` interprets every program it can that is not loaded yet, and compiles none
//! of them (tests).
//!
//! Layer: beside `expr_run.rs`, which calls it; it imports the runtime (`device/`, `nvrtc.rs`,
//! `fixed_cubins.rs`) and the pure helpers below them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use kiln_core::expr::{Instr, Program};
use kiln_core::{BinaryOp, CmpOp, DType, Result, UnaryOp};

use crate::codegen::{Access, Geometry, Strategy, Variant};
use crate::device::{DeviceState, Func};
use crate::launch::{Args, Dims, Strides};
use crate::sources::{Group, Module};

/// How generated programs that are not compiled yet run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiering {
    /// Compiled on the spot before their first run (the caller waits for NVRTC).
    Off,
    /// Interpreted while they compile in the background (the default).
    On,
    /// Interpreted whenever the interpreter takes them, never compiled (for tests).
    Always,
}

static MODE: AtomicU8 = AtomicU8::new(u8::MAX);

/// Sets how programs not compiled yet run, for the whole process (see [`Tiering`]).
pub fn set_tiering(t: Tiering) {
    MODE.store(t as u8, Ordering::Relaxed);
}

/// The current [`Tiering`]: [`set_tiering`]'s, else `KILN_CUDA_TIER` (`0` off, `always`),
/// else on.
pub fn tiering() -> Tiering {
    let m = MODE.load(Ordering::Relaxed);
    let m = if m == u8::MAX {
        let t = match std::env::var("KILN_CUDA_TIER").as_deref().map(str::trim) {
            Ok("0") => Tiering::Off,
            Ok("always") => Tiering::Always,
            _ => Tiering::On,
        };
        // A concurrent `set_tiering` wins over the environment.
        let _ = MODE.compare_exchange(u8::MAX, t as u8, Ordering::Relaxed, Ordering::Relaxed);
        MODE.load(Ordering::Relaxed)
    } else {
        m
    };
    match m {
        0 => Tiering::Off,
        2 => Tiering::Always,
        _ => Tiering::On,
    }
}

static INTERPRETED: AtomicU64 = AtomicU64::new(0);
static BACKGROUND: AtomicU64 = AtomicU64::new(0);

/// Interpreted launches and background compiles started, in this process so far.
pub fn tier_stats() -> (u64, u64) {
    (
        INTERPRETED.load(Ordering::Relaxed),
        BACKGROUND.load(Ordering::Relaxed),
    )
}

// The interpreter's limits (`kernels/interp.cu`).
const MAX_IN: usize = 12;
const MAX_OUT: usize = 5;
const MAX_PARAMS: usize = 64;
const MAX_CODE: usize = 128;

const INPUT: u32 = 0;
const PARAM: u32 = 1;
const CONST: u32 = 2;
const UNARY: u32 = 3;
const BINARY: u32 = 4;
const CMP: u32 = 5;
const WHERE: u32 = 6;
const COPY: u32 = 7;

const CONTIG: u32 = 0;
const BCAST: u32 = 1;
const STRIDED: u32 = 2;
const U8_INPUT: u32 = 4;

/// `kernels/interp.cu`'s `InterpArgs`, field for field (2,440 bytes, passed by value; both
/// sides assert the size).
#[repr(C)]
#[derive(Clone, Copy)]
struct InterpArgs {
    n: u64,
    d: Dims,
    x: [u64; MAX_IN],
    y: [u64; MAX_OUT],
    s: [Strides; MAX_IN],
    n_code: u32,
    n_out: u32,
    access: [u32; MAX_IN],
    out_val: [u32; MAX_OUT],
    out_u8: u32,
    params: [f32; MAX_PARAMS],
    code: [u32; 2 * MAX_CODE],
}

const _: () = assert!(std::mem::size_of::<InterpArgs>() == 2440);

/// Whether the interpreter runs `p` (an elementwise program of f32 values, with u8 inputs,
/// comparisons, selections and outputs, within its limits).
pub(crate) fn interpretable(p: &Program) -> bool {
    let is = |v: u32, d: DType| p.dtype(v) == d;
    let f32_or_u8 = |v: u32| is(v, DType::F32) || is(v, DType::U8);
    !p.reduces()
        && p.code().len() <= MAX_CODE
        && p.inputs().len() <= MAX_IN
        && p.params().len() <= MAX_PARAMS
        && p.outputs().len() <= MAX_OUT
        && (p.inputs().iter()).all(|&d| d == DType::F32 || d == DType::U8)
        && p.params().iter().all(|&d| d == DType::F32)
        && p.outputs().iter().all(|&v| f32_or_u8(v))
        && p.code().iter().all(|ins| match *ins {
            Instr::Input(_) | Instr::Param(_) => true,
            Instr::Const(c) => c.dtype() == DType::F32,
            Instr::Unary(op, a) => is(a, DType::F32) && op.supports(DType::F32),
            Instr::Binary(op, a, b) => {
                is(a, DType::F32) && is(b, DType::F32) && op.supports(DType::F32)
            }
            // A u8 compared as f32 holds the same integer: the same answer.
            Instr::Cmp(_, a, b) => f32_or_u8(a) && p.dtype(a) == p.dtype(b),
            Instr::Where(c, a, b) => is(c, DType::U8) && f32_or_u8(a) && p.dtype(a) == p.dtype(b),
            // To f32 from f32 or u8, or u8 to u8: the value itself.
            Instr::Cast(to, a) => {
                (to == DType::F32 && f32_or_u8(a)) || (to == DType::U8 && is(a, DType::U8))
            }
            Instr::Reduce(..) => false,
        })
}

fn index_of<T: PartialEq>(all: &[T], x: &T) -> u32 {
    all.iter().position(|y| y == x).expect("an op of its table") as u32
}

/// Launches the interpreter on `p` (elementwise, [`interpretable`]) planned as `g`: inputs at
/// `inputs` (device addresses, layout offsets applied), fresh contiguous `outs`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    dev: &DeviceState,
    f: Func,
    p: &Program,
    g: &Geometry,
    inputs: impl Fn(usize) -> u64,
    outs: &[u64],
    params: &[f64],
    op: &'static str,
    grid: (u32, u32),
    block: u32,
) -> Result<()> {
    debug_assert!(g.variant.strategy == Strategy::Elementwise && interpretable(p));
    // SAFETY: `InterpArgs` is plain old data (integers and floats); all-zero is a valid value.
    let mut a: InterpArgs = unsafe { std::mem::zeroed() };
    a.n = g.n as u64;
    a.d.rank = g.dims.len() as i32;
    for (o, &x) in a.d.d.iter_mut().zip(&g.dims) {
        *o = x as u64;
    }
    for (k, &dt) in p.inputs().iter().enumerate() {
        a.x[k] = inputs(k);
        let acc = match g.variant.access[k] {
            Access::Contig => CONTIG,
            Access::Bcast => BCAST,
            Access::Strided => {
                for (o, &x) in a.s[k].s.iter_mut().zip(&g.strides[k]) {
                    *o = x as u64;
                }
                STRIDED
            }
        };
        a.access[k] = acc | if dt == DType::U8 { U8_INPUT } else { 0 };
    }
    for (j, (&o, &v)) in outs.iter().zip(p.outputs()).enumerate() {
        a.y[j] = o;
        a.out_val[j] = v;
        if p.dtype(v) == DType::U8 {
            a.out_u8 |= 1 << j;
        }
    }
    a.n_out = outs.len() as u32;
    for (o, &v) in a.params.iter_mut().zip(params) {
        *o = v as f32;
    }
    a.n_code = p.code().len() as u32;
    for (j, ins) in p.code().iter().enumerate() {
        let ops = |x: &[u32]| x.iter().enumerate().fold(0, |w, (i, &v)| w | v << (8 * i));
        let (kind, op, arg) = match *ins {
            Instr::Input(k) => (INPUT, 0, k),
            Instr::Param(k) => (PARAM, 0, k),
            Instr::Const(c) => (CONST, 0, (c.to_f64() as f32).to_bits()),
            Instr::Unary(u, x) => (UNARY, index_of(&UnaryOp::ALL, &u), x),
            Instr::Binary(b, x, y) => (BINARY, index_of(&BinaryOp::ALL, &b), ops(&[x, y])),
            Instr::Cmp(c, x, y) => (CMP, index_of(&CmpOp::ALL, &c), ops(&[x, y])),
            Instr::Where(c, x, y) => (WHERE, 0, ops(&[c, x, y])),
            Instr::Cast(_, x) => (COPY, 0, x),
            Instr::Reduce(..) => unreachable!("an elementwise program"),
        };
        a.code[2 * j] = kind | op << 4;
        a.code[2 * j + 1] = arg;
    }
    INTERPRETED.fetch_add(1, Ordering::Relaxed);
    let mut args = Args::new();
    args.push(a);
    dev.launch(op, f, grid, block, 0, args.ptrs())
}

/// The interpreter's kernel on `dev`, when it loads without waiting for NVRTC (prebuilt, or
/// compiled by this process already) or `wait`; `None` otherwise (programs then compile on
/// the spot, and `fixed_cubins::prefetch` has its compile under way).
fn interpreter(dev: &DeviceState, wait: bool) -> Option<Func> {
    if !wait && !crate::fixed_cubins::available(Module::Interp, Group::All, dev.arch()) {
        return None;
    }
    dev.func(Module::Interp, &["interp_f32"]).ok()
}

/// How [`tiered`] says a program not loaded yet runs.
pub(crate) enum Tiered {
    /// In the interpreter (its compile is under way, or tiering is `Always`).
    Interpret(Func),
    /// Its background compile finished: the CUBIN to load.
    Compiled(Vec<u8>),
    /// Compiled on the spot (tiering off, the interpreter not loaded, a graph being captured,
    /// the disk cache has it, or a background compile failed: the compile on the spot then
    /// reports NVRTC's log).
    OnTheSpot,
}

/// Background compiles kept before finished ones nobody took are dropped.
const PENDING_MAX: usize = 1024;

/// Background compiles under way, by architecture, program and variant.
type Pending = std::collections::HashMap<(u32, Program, Variant), Arc<Job>>;

fn pending() -> &'static std::sync::Mutex<Pending> {
    static PENDING: std::sync::OnceLock<std::sync::Mutex<Pending>> = std::sync::OnceLock::new();
    PENDING.get_or_init(Default::default)
}

/// How the interpretable program `p` of variant `v`, not loaded on `dev`, runs now (see the
/// module docs).
pub(crate) fn tiered(dev: &DeviceState, p: &Program, v: &Variant) -> Result<Tiered> {
    let mode = tiering();
    if mode == Tiering::Off || dev.capturing() {
        return Ok(Tiered::OnTheSpot);
    }
    let Some(interp) = interpreter(dev, mode == Tiering::Always) else {
        return Ok(Tiered::OnTheSpot);
    };
    if mode == Tiering::Always {
        return Ok(Tiered::Interpret(interp));
    }
    let at = (dev.arch(), p.clone(), v.clone());
    let mut pending = pending().lock().unwrap();
    if let Some(job) = pending.get(&at) {
        return Ok(match job.take() {
            None => Tiered::Interpret(interp),
            Some(r) => {
                pending.remove(&at);
                r.map_or(Tiered::OnTheSpot, Tiered::Compiled)
            }
        });
    }
    let src = crate::codegen::source(p, v)?;
    if crate::nvrtc::is_source_cached(
        crate::nvrtc::Flavor::Elementwise,
        "expr.cu",
        &src,
        dev.arch(),
    ) {
        return Ok(Tiered::OnTheSpot);
    }
    // Programs run once (tests, a user's experiments) leave finished compiles nobody takes:
    // forget those now and then (the disk cache has them).
    if pending.len() >= PENDING_MAX {
        pending.retain(|_, job| !job.finished());
    }
    pending.insert(at, compile_in_background(dev.arch(), src));
    Ok(Tiered::Interpret(interp))
}

/// A background compile: the CUBIN, or NVRTC's log, once done.
struct Job {
    done: Mutex<Option<std::result::Result<Vec<u8>, String>>>,
}

impl Job {
    /// The result if the compile finished (taken: a second call gets `None`).
    fn take(&self) -> Option<std::result::Result<Vec<u8>, String>> {
        self.done.lock().unwrap().take()
    }

    /// Whether the compile finished (its result not taken yet).
    fn finished(&self) -> bool {
        self.done.lock().unwrap().is_some()
    }
}

/// Starts compiling generated elementwise `source` for `sm_{arch}` on a background worker
/// (`Flavor::Elementwise`, through the disk cache, which it fills).
fn compile_in_background(arch: u32, source: String) -> Arc<Job> {
    let job = Arc::new(Job {
        done: Mutex::new(None),
    });
    let j = job.clone();
    BACKGROUND.fetch_add(1, Ordering::Relaxed);
    // The exit hook in place before any worker runs, and after every library loaded so far
    // (see `fixed_cubins::hook_exit`).
    crate::fixed_cubins::hook_exit(arch);
    crate::fixed_cubins::rehook_after_new_libraries();
    crate::fixed_cubins::wait_at_thread_exit();
    pool().submit(Box::new(move || {
        let r = crate::nvrtc::load_or_compile_source(
            crate::nvrtc::Flavor::Elementwise,
            "expr.cu",
            &source,
            arch,
        );
        *j.done.lock().unwrap() = Some(r);
    }));
    job
}

type Task = Box<dyn FnOnce() + Send>;

/// Worker threads for background compiles: started on demand, up to one fewer than the cores
/// (at least one, at most 8), each taking the oldest task. NVRTC is thread-safe per program.
struct Pool {
    queue: Mutex<VecDeque<Task>>,
    ready: Condvar,
    workers: AtomicUsize,
    /// The most workers it starts.
    max_workers: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        queue: Mutex::new(VecDeque::new()),
        ready: Condvar::new(),
        workers: AtomicUsize::new(0),
        max_workers: std::thread::available_parallelism()
            .map_or(1, |n| n.get().saturating_sub(1))
            .clamp(1, 8),
    })
}

impl Pool {
    /// Queues `task`, starting one more worker while there are fewer than `max_workers`.
    fn submit(&'static self, task: Task) {
        self.queue.lock().unwrap().push_back(task);
        if self.workers.load(Ordering::Relaxed) < self.max_workers {
            let i = self.workers.fetch_add(1, Ordering::Relaxed);
            // NVRTC is used to a main thread's stack (8 MiB), not a spawned thread's 2 MiB.
            let spawned = std::thread::Builder::new()
                .name(format!("kiln-compile-{i}"))
                .stack_size(16 << 20)
                .spawn(move || self.work());
            if spawned.is_err() {
                self.workers.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.ready.notify_one();
    }

    /// A worker: runs tasks as they come; at process exit it starts none (a task's result is
    /// then not needed, and NVRTC must not be inside a compile while the process tears down:
    /// `fixed_cubins::hook_exit`'s exit hook waits for the task under way).
    fn work(&self) {
        loop {
            let task = {
                let mut q = self.queue.lock().unwrap();
                loop {
                    if let Some(t) = q.pop_front() {
                        break t;
                    }
                    q = self.ready.wait(q).unwrap();
                }
            };
            let Some(_running) = crate::fixed_cubins::in_flight().enter() else {
                return;
            };
            task();
            crate::fixed_cubins::rehook_after_new_libraries();
        }
    }
}
