//! `Backend::eval_expr` on CUDA: one generated kernel per distinct program and variant.
//!
//! # Why
//!
//! An expression program ([`kiln_core::expr`]) run op by op launches one kernel per instruction
//! and sends every intermediate through device memory. Here the whole program is one kernel:
//! each input is read once, each output written once, reductions and their post-map included.
//!
//! # How
//!
//! `check_call` validates the call; [`codegen::plan`] classifies every operand's layout and
//! merges dimensions (pure, no device); [`codegen::source`] writes the CUDA C; NVRTC compiles it
//! through the disk cache of `nvrtc.rs`, and the function is memoized per device by `(program,
//! variant)` (`DeviceState::generated_func`; its module is unloaded by `clear_kernel_cache`
//! with the other generated kernels). A program run again on operands of the same layouts finds
//! its checked call, plan and kernel in a per-thread memo ([`PLANNED`]) and redoes none of
//! them. Inputs are read through their computed buffers (pending lazy
//! work runs first); outputs are fresh contiguous buffers; the launch goes to the calling
//! thread's current stream.
//!
//! What is not fused runs op by op ([`eval_composed`], kiln-core's composed evaluator), so results are
//! always those of the op-by-op semantics: layouts with more than 8 non-mergeable dimensions,
//! argument lists beyond what a launch takes, and programs past [`MAX_KERNELS`] per device (a
//! bound on compile time). A kernel NVRTC rejects is an [`Error::Backend`] carrying its log.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kiln_core::expr::{Program, check_call, eval_composed};
use kiln_core::{DType, Error, Layout, Result, Shape};

use crate::Cuda;
use crate::codegen::{self, Access, Geometry, KERNEL, Strategy, Variant};
use crate::device::{CudaDevice, DeviceState, Func, KERNEL_EPOCH, state};
use crate::launch::{Args, Dims, MAX_DIMS, Strides};
use crate::memory::{Buffer, alloc};
use crate::storage::CudaStorage;

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

/// Evaluates `program` fused (see the module docs).
pub(crate) fn eval_expr(
    device: &CudaDevice,
    program: &Program,
    shape: &Shape,
    inputs: &[(&CudaStorage, &Layout)],
    params: &[f64],
) -> Result<Vec<CudaStorage>> {
    let layouts: Vec<&Layout> = inputs.iter().map(|(_, l)| *l).collect();
    let planned = planned(program, shape, &layouts, params)?;
    let (call, geo) = (&planned.call, &planned.geo);
    for (s, _) in inputs {
        if s.device() != *device {
            return Err(Error::DeviceMismatch {
                op: "expr",
                lhs: device.to_string(),
                rhs: s.device().to_string(),
            });
        }
    }
    let dev = state(device)?;
    let Some(geo) = geo else {
        return eval_composed::<Cuda>(device, program, shape, inputs, params);
    };
    // Computed input buffers, held until the launch is enqueued.
    let bufs = inputs
        .iter()
        .map(|(s, _)| s.buffer())
        .collect::<Result<Vec<Arc<Buffer>>>>()?;
    // The vector width depends on the buffers' alignment.
    let geo = planned.with_vec(geo, vec_width(program, geo, &bufs, &layouts));
    let geo = &*geo;
    let Some(f) = planned.kernel(dev, program, &geo.variant)? else {
        return eval_composed::<Cuda>(device, program, shape, inputs, params);
    };
    for (k, ((b, l), &dt)) in bufs.iter().zip(&layouts).zip(program.inputs()).enumerate() {
        if l.storage_extent() * dt.size_in_bytes() > b.len_bytes() {
            return Err(Error::invalid(
                "expr",
                format!(
                    "input {k}: layout {:?} (offset {}) reaches past a buffer of {} bytes",
                    l.strides(),
                    l.offset(),
                    b.len_bytes()
                ),
            ));
        }
    }
    let n_iter = shape.elem_count();
    let n_kept = call.kept.elem_count();
    let outs = program
        .outputs()
        .iter()
        .enumerate()
        .map(|(j, &o)| {
            let n = if program.output_is_reduced(j) {
                n_kept
            } else {
                n_iter
            };
            alloc(dev, n * program.dtype(o).size_in_bytes())
        })
        .collect::<Result<Vec<Buffer>>>()?;
    let work = if program.reduces() { n_kept } else { n_iter };
    if work > 0 {
        launch(dev, f, program, geo, &bufs, &layouts, &outs, params)?;
    }
    Ok(outs.into_iter().map(CudaStorage::ready).collect())
}

/// A checked call and its plan (`None`: the program runs op by op), for one program, iteration
/// shape, input layouts and parameter count.
struct Planned {
    program: Program,
    shape: Shape,
    layouts: Vec<Layout>,
    params: usize,
    call: kiln_core::expr::CallPlan,
    geo: Option<Geometry>,
    /// `geo` with each vector width seen so far (alignment of the buffers decides it).
    by_vec: RefCell<Vec<std::rc::Rc<Geometry>>>,
    /// The kernels found for it: (device ordinal, kernel-cache epoch, vector width, kernel).
    funcs: RefCell<Vec<(usize, u64, u32, Func)>>,
}

impl Planned {
    /// `geo` (this plan's) with `variant.vec` set to `vec`, made once per width.
    fn with_vec(&self, geo: &Geometry, vec: u32) -> std::rc::Rc<Geometry> {
        let mut by_vec = self.by_vec.borrow_mut();
        if let Some(g) = by_vec.iter().find(|g| g.variant.vec == vec) {
            return g.clone();
        }
        let mut g = geo.clone();
        g.variant.vec = vec;
        let g = std::rc::Rc::new(g);
        by_vec.push(g.clone());
        g
    }

    /// [`kernel`] for this plan's program and `variant`, remembered per device, epoch and
    /// vector width (so a hit compares no program).
    fn kernel(
        &self,
        dev: &'static DeviceState,
        program: &Program,
        variant: &Variant,
    ) -> Result<Option<Func>> {
        let epoch = KERNEL_EPOCH.load(Ordering::SeqCst);
        let key = (dev.ordinal, epoch, variant.vec);
        let hit = self
            .funcs
            .borrow()
            .iter()
            .find(|(o, e, v, _)| (*o, *e, *v) == key)
            .map(|e| e.3);
        if hit.is_some() {
            return Ok(hit);
        }
        let f = kernel(dev, program, variant)?;
        if let Some(f) = f {
            self.funcs.borrow_mut().push((key.0, key.1, key.2, f));
        }
        Ok(f)
    }
}

/// Plans a thread made last. A program run again on operands of the same layouts (a norm in a
/// loop) reuses its checked call and plan instead of making them again: `check_call` and
/// `codegen::plan` were a fifth of the host time of d2l's matmul-and-norm loop, profiled
/// against a stand-in driver.
const PLANNED_LEN: usize = 8;

thread_local! {
    static PLANNED: RefCell<Vec<std::rc::Rc<Planned>>> = const { RefCell::new(Vec::new()) };
}

/// The checked call and plan of `program` over `layouts` (see [`PLANNED`]); a bad call is an
/// error as `check_call` says, and is not remembered.
fn planned(
    program: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    params: &[f64],
) -> Result<std::rc::Rc<Planned>> {
    let hit = PLANNED.with(|m| {
        m.borrow()
            .iter()
            .find(|e| {
                e.params == params.len()
                    && e.shape == *shape
                    && e.layouts.len() == layouts.len()
                    && e.layouts.iter().zip(layouts).all(|(a, b)| a == *b)
                    && e.program == *program
            })
            .cloned()
    });
    if let Some(p) = hit {
        return Ok(p);
    }
    let call = check_call(program, shape, layouts, params)?;
    let geo = codegen::plan(program, shape, layouts, &call.axes)
        .ok()
        .filter(|g| fits_args(program, g));
    let p = std::rc::Rc::new(Planned {
        program: program.clone(),
        shape: shape.clone(),
        layouts: layouts.iter().map(|l| (*l).clone()).collect(),
        params: params.len(),
        call,
        geo,
        by_vec: RefCell::new(Vec::new()),
        funcs: RefCell::new(Vec::new()),
    });
    PLANNED.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() == PLANNED_LEN {
            m.remove(0);
        }
        m.push(p.clone());
    });
    Ok(p)
}

/// The elements per 16-byte vector of an elementwise program's loop (see
/// `codegen::Variant::vec`), or 0: every operand contiguous or broadcast, the contiguous
/// inputs and the outputs of one element size, the contiguous inputs 16-byte aligned (fresh
/// outputs always are).
fn vec_width(p: &Program, g: &Geometry, bufs: &[Arc<Buffer>], layouts: &[&Layout]) -> u32 {
    if p.reduces() || g.variant.access.contains(&Access::Strided) {
        return 0;
    }
    let mut size = None;
    let contig = (0..p.inputs().len()).filter(|&k| g.variant.access[k] == Access::Contig);
    let sizes = contig
        .clone()
        .map(|k| p.inputs()[k].size_in_bytes())
        .chain(p.outputs().iter().map(|&o| p.dtype(o).size_in_bytes()));
    for sz in sizes {
        match size {
            None => size = Some(sz),
            Some(s) if s != sz => return 0,
            Some(_) => {}
        }
    }
    let Some(size) = size else { return 0 };
    let aligned = contig.into_iter().all(|k| {
        let at =
            bufs[k].device_ptr() + (layouts[k].offset() * p.inputs()[k].size_in_bytes()) as u64;
        at.is_multiple_of(16)
    });
    if aligned && size < 16 {
        (16 / size) as u32
    } else {
        0
    }
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
            Strategy::Split => 2 + codegen::split_partials(p).len(),
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
    f: Func,
    p: &Program,
    g: &Geometry,
    bufs: &[Arc<Buffer>],
    layouts: &[&Layout],
    outs: &[Buffer],
    params: &[f64],
) -> Result<()> {
    let at = |k: usize| -> u64 {
        bufs[k].device_ptr() + (layouts[k].offset() * p.inputs()[k].size_in_bytes()) as u64
    };
    let mut a = Args::new();
    let reduces = p.reduces();
    if reduces {
        a.push(g.n as u64).push(g.n_red as u64);
        a.push(dims_arg(&g.dims)).push(dims_arg(&g.red_dims));
    } else {
        a.push(g.n as u64).push(dims_arg(&g.dims));
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
    crate::profile::fused_ops(kernel, || crate::profile::expr_op_names(p));
    if g.variant.strategy == Strategy::Split {
        return launch_split(dev, f, p, g, a);
    }
    let (grid, block) = match g.variant.strategy {
        Strategy::Elementwise if g.variant.vec > 1 => (
            dev.grid_1d((g.n as u64).div_ceil(g.variant.vec as u64), BLOCK),
            BLOCK,
        ),
        Strategy::Elementwise | Strategy::Thread => (dev.grid_1d(g.n as u64, BLOCK), BLOCK),
        Strategy::Block => {
            // Fewer kept elements than SMs (a full reduction, such as a norm): wider blocks,
            // since each block reduces its whole share alone. A 10,000-element norm took ~9 µs
            // of GPU time with 256 threads, more than the whole rest of d2l's loop step.
            let max = if g.n < dev.sm_count as usize {
                WIDE_BLOCK
            } else {
                BLOCK
            };
            let block = (g.n_red.next_power_of_two() as u32).clamp(32, max);
            let blocks = g.n.min(dev.sm_count as usize * 16).max(1);
            ((blocks as u32, 1), block)
        }
        Strategy::Split => unreachable!("launched by launch_split"),
    };
    dev.launch("expr", f, grid, block, 0, a.ptrs())
}

/// The two launches of a [`Strategy::Split`] kernel whose arguments up to its parameters are
/// `args`: a block per part of each kept element folds into the partial buffers (made here,
/// freed in stream order after the second launch), then a block per kept element folds the
/// partials and runs the post-map.
fn launch_split(
    dev: &'static DeviceState,
    f: Func,
    p: &Program,
    g: &Geometry,
    args: Args,
) -> Result<()> {
    let slots = g.n * g.parts;
    let partials = codegen::split_partials(p)
        .into_iter()
        .map(|d| alloc(dev, slots * d.size_in_bytes()))
        .collect::<Result<Vec<Buffer>>>()?;
    for phase in [0u32, 1] {
        let mut a = args.clone();
        a.push(g.parts as u64).push(phase);
        for b in &partials {
            a.push(b.device_ptr());
        }
        let blocks = if phase == 0 { slots } else { g.n };
        let grid = (blocks.min(dev.sm_count as usize * 16) as u32, 1);
        dev.launch("expr", f, grid, BLOCK, 0, a.ptrs())?;
    }
    Ok(())
}

/// The kernel of `(p, v)` on `dev`: memoized, else generated, compiled (or loaded from the disk
/// cache) and loaded; `None` when the device already holds [`MAX_KERNELS`] of them.
fn kernel(dev: &'static DeviceState, p: &Program, v: &Variant) -> Result<Option<Func>> {
    let epoch = KERNEL_EPOCH.load(Ordering::SeqCst);
    let hit = RECENT.with(|r| {
        r.borrow()
            .iter()
            .find(|e| {
                e.ordinal == dev.ordinal && e.epoch == epoch && e.variant == *v && e.program == *p
            })
            .map(|e| e.func)
    });
    if hit.is_some() {
        return Ok(hit);
    }
    let key = ExprKey(p.clone(), v.clone());
    let f = dev.generated_func(&key, MAX_KERNELS, || {
        let src = codegen::source(p, v)?;
        let name = std::ffi::CString::new(KERNEL).map_err(|e| Error::backend("expr", e))?;
        Ok((build(&src, dev.arch)?, name))
    })?;
    if let Some(func) = f {
        RECENT.with(|r| {
            let mut r = r.borrow_mut();
            if r.len() == RECENT_LEN {
                r.remove(0);
            }
            r.push(Recent {
                ordinal: dev.ordinal,
                epoch,
                program: key.0,
                variant: key.1,
                func,
            });
        });
    }
    Ok(f)
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

/// The CUBIN of a generated `source` for `sm_{arch}` (disk cache, else NVRTC); NVRTC's log in
/// an [`Error::Backend`] naming `expr` when it does not compile.
pub(crate) fn build(source: &str, arch: u32) -> Result<Vec<u8>> {
    crate::nvrtc::load_or_compile_source("expr.cu", source, arch).map_err(|log| {
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
        match build(src, 90) {
            Err(Error::Backend { op, msg }) => {
                assert_eq!(op, "expr");
                assert!(msg.contains("undefined_name"), "{msg}");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
    }
}
