//! The kernels of the `Backend` trait: argument packing and launch configuration for each op.
//! This file holds the shared helpers, the elementwise ops (each a generated one-instruction
//! program: `expr_lone::run_single`) and data movement; reductions
//! (`reduce.rs`), softmax and cross-entropy (`rows.rs`), indexing (`index.rs`), fused
//! attention (`attention.rs`) and fused layer / RMS norm (`norm.rs`) have files of their own.

use cudarc::driver::sys;
use std::sync::Arc;

use kiln_core::expr::{Instr, Program, Val, rules};
use kiln_core::{BinaryOp, CmpOp, DType, Error, Layout, RandDist, Result, UnaryOp};

use crate::device::{DeviceState, check};
use crate::expr_lone::{run_single, run_single_parts};
use crate::expr_run::Parts;
use crate::launch::{Args, collapse, fits_u32};
use crate::memory::{Buffer, alloc};
use crate::sources::Module;
pub(crate) use crate::sources::ctype as tname;

pub(crate) const BLOCK: u32 = 256;

/// The kernel type for moving elements of `dtype` without looking at them.
fn sized(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        1 => "u8",
        2 => "u16",
        4 => "u32",
        _ => "u64",
    }
}

fn ptr_at(s: &Buffer, l: &Layout, dtype: DType) -> u64 {
    s.device_ptr() + (l.offset() * dtype.size_in_bytes()) as u64
}

fn same_device(op: &'static str, a: &Buffer, b: &Buffer) -> Result<()> {
    if a.state().ordinal() != b.state().ordinal() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device().to_string(),
            rhs: b.device().to_string(),
        });
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    dev: &DeviceState,
    op: &'static str,
    module: Module,
    name: &[&'static str],
    grid: (u32, u32),
    block: u32,
    smem: u32,
    args: &mut Args,
) -> Result<()> {
    let f = dev.func(module, name)?;
    dev.launch(op, f, grid, block, smem, args.ptrs())
}

/// The one-instruction program `code` (its last instruction is the output) over `inputs`
/// (each read through a layout of the output's shape, with its dtype) and the scalar
/// parameters `params` (dtype, value): how every elementwise op without a table entry of its
/// own (binary, scalar, comparison, `where`, cast) runs on computed buffers. The kernel is
/// generated and compiled on first use for the layouts' class, as a fused chain's is
/// (`expr_lone::run_single_parts`): there is no hand-written kernel per op and dtype, and a
/// fresh process compiles only the ones it uses. Measured against the hand-written kernels
/// they replaced (H200, BENCHMARKS.md, 2026-11-27): device time within 1.2% (add, broadcast,
/// transposed, scalar, compare, i64 div), 1.2–2.2× faster for `where` and casts (which had no
/// contiguous kernel); ~0.5 µs more host time per launch.
fn single(
    op: &'static str,
    code: &[Instr],
    inputs: &[(&Arc<Buffer>, &Layout, DType)],
    params: &[(DType, f64)],
) -> Result<Buffer> {
    let mut dtypes = [DType::U8; 3];
    let mut ins: [(&Arc<Buffer>, &Layout); 3] = [(inputs[0].0, inputs[0].1); 3];
    for (k, &(b, l, d)) in inputs.iter().enumerate() {
        dtypes[k] = d;
        ins[k] = (b, l);
    }
    let mut param_dtypes = [DType::U8; 1];
    let mut values = [0.0; 1];
    for (k, &(d, v)) in params.iter().enumerate() {
        param_dtypes[k] = d;
        values[k] = v;
    }
    let parts = Parts {
        inputs: &dtypes[..inputs.len()],
        params: &param_dtypes[..params.len()],
        code,
        outputs: &[code.len() as Val - 1],
        axes: &[],
    };
    let shape = inputs[0].1.shape();
    run_single_parts(
        op,
        parts,
        &ins[..inputs.len()],
        shape,
        &values[..params.len()],
        contiguous,
    )
}

/// `Backend::unary` over a computed buffer: the op table's program `op(x)`, generated and
/// compiled like any fused chain (there is no hand-written kernel per unary op).
pub(crate) fn unary(op: UnaryOp, s: &Arc<Buffer>, l: &Layout, dtype: DType) -> Result<Buffer> {
    if !op.supports(dtype) {
        return Err(Error::DTypeMismatch {
            op: op.name(),
            expected: "a dtype the op supports".into(),
            got: dtype,
        });
    }
    let program = rule(false, op, dtype, rules::unary_program)?;
    run_single(op.name(), &program, &[(s, l)], l.shape(), contiguous)
}

/// The op table's program of unary `op` at `dtype` (its backward rule with `backward`), from
/// `make` once per thread: `rules`' process-wide memo takes a lock and hashes its key on
/// every call, which a realized lone op (whose host time is its cost) need not repeat.
fn rule(
    backward: bool,
    op: UnaryOp,
    dtype: DType,
    make: fn(UnaryOp, DType) -> Result<Arc<Program>>,
) -> Result<Arc<Program>> {
    type Rules = Vec<((bool, UnaryOp, DType), Arc<Program>)>;
    thread_local! {
        static RULES: std::cell::RefCell<Rules> = const { std::cell::RefCell::new(Vec::new()) };
    }
    /// Rules a thread keeps (a model uses a few unary ops at one or two dtypes).
    const RULES_LEN: usize = 64;
    let key = (backward, op, dtype);
    let hit = RULES.with(|r| {
        let r = r.borrow();
        r.iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone())
    });
    if let Some(p) = hit {
        return Ok(p);
    }
    let p = make(op, dtype)?;
    RULES.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() < RULES_LEN {
            r.push((key, p.clone()));
        }
    });
    Ok(p)
}

/// `Backend::binary` over computed buffers (broadcast operands arrive as stride-0 views).
pub(crate) fn binary(
    op: BinaryOp,
    a: &Arc<Buffer>,
    la: &Layout,
    b: &Arc<Buffer>,
    lb: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    if !op.supports(dtype) {
        return Err(Error::DTypeMismatch {
            op: op.name(),
            expected: "a dtype the op supports".into(),
            got: dtype,
        });
    }
    let code = [Instr::Input(0), Instr::Input(1), Instr::Binary(op, 0, 1)];
    single(op.name(), &code, &[(a, la, dtype), (b, lb, dtype)], &[])
}

/// `Backend::unary_backward` over computed buffers: the op table's rule `g · op'(saved)`, one
/// generated kernel (the program the deferral layer splices into its chains).
pub(crate) fn unary_backward(
    op: UnaryOp,
    s: &Arc<Buffer>,
    ls: &Layout,
    g: &Arc<Buffer>,
    lg: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    const OP: &str = "unary_backward";
    if !dtype.is_float() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: "a float dtype".into(),
            got: dtype,
        });
    }
    let program = rule(true, op, dtype, rules::unary_backward_program)?;
    run_single(OP, &program, &[(s, ls), (g, lg)], lg.shape(), contiguous)
}

/// `Backend::binary_scalar`: `op(x, scalar)`, or `op(scalar, x)` with `scalar_lhs`. The
/// scalar is a parameter of the program (a kernel argument converted to `dtype` with `as`),
/// so every value runs the same kernel.
pub(crate) fn binary_scalar(
    op: BinaryOp,
    s: &Arc<Buffer>,
    l: &Layout,
    dtype: DType,
    scalar: f64,
    scalar_lhs: bool,
) -> Result<Buffer> {
    if !op.supports(dtype) {
        return Err(Error::DTypeMismatch {
            op: op.name(),
            expected: "a dtype the op supports".into(),
            got: dtype,
        });
    }
    let (x, p) = if scalar_lhs { (1, 0) } else { (0, 1) };
    let code = [Instr::Input(0), Instr::Param(0), Instr::Binary(op, x, p)];
    single(op.name(), &code, &[(s, l, dtype)], &[(dtype, scalar)])
}

/// `Backend::compare`: a `u8` mask.
pub(crate) fn compare(
    op: CmpOp,
    a: &Arc<Buffer>,
    la: &Layout,
    b: &Arc<Buffer>,
    lb: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    let code = [Instr::Input(0), Instr::Input(1), Instr::Cmp(op, 0, 1)];
    single(op.name(), &code, &[(a, la, dtype), (b, lb, dtype)], &[])
}

/// `Backend::where_cond`: `c != 0 ? t : f` with a `u8` condition.
#[allow(clippy::too_many_arguments)]
pub(crate) fn where_cond(
    c: &Arc<Buffer>,
    lc: &Layout,
    t: &Arc<Buffer>,
    lt: &Layout,
    f: &Arc<Buffer>,
    lf: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    let code = [
        Instr::Input(0),
        Instr::Input(1),
        Instr::Input(2),
        Instr::Where(0, 1, 2),
    ];
    let inputs = [(c, lc, DType::U8), (t, lt, dtype), (f, lf, dtype)];
    single("where", &code, &inputs, &[])
}

/// `Backend::cast`, with Rust's `as` semantics (`cast_to` of `kernels/scalar_ops.cuh`: float
/// to int truncates and saturates, NaN gives 0); a cast to the same dtype is a copy.
pub(crate) fn cast(s: &Arc<Buffer>, l: &Layout, from: DType, to: DType) -> Result<Buffer> {
    if from == to {
        return contiguous(s, l, from);
    }
    let code = [Instr::Input(0), Instr::Cast(to, 0)];
    single("cast", &code, &[(s, l, from)], &[])
}

// ---- data movement ---------------------------------------------------------------------------

/// Strided copy of `src` (layout `ls`) into `dst` at layout `ld` (same shape).
pub(crate) fn copy_strided(
    src: &Buffer,
    ls: &Layout,
    dst: &Buffer,
    ld: &Layout,
    dtype: DType,
) -> Result<()> {
    let dev = src.state();
    dev.bind()?;
    let n = ls.elem_count();
    if n == 0 {
        return Ok(());
    }
    let size = dtype.size_in_bytes();
    if ls.is_contiguous() && ld.is_contiguous() {
        let _prof = crate::profile::d2d(dev, "copy", dev.stream(), n * size);
        // SAFETY: both ranges lie inside their buffers (the layouts' contract); ordered on the
        // current stream.
        return check(
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    ptr_at(dst, ld, dtype),
                    ptr_at(src, ls, dtype),
                    n * size,
                    dev.stream(),
                )
            },
            "copy",
        );
    }
    let (d, ss) = collapse(
        "copy",
        ls.dims(),
        &[ls.strides(), ld.strides()],
        &[ls.offset(), ld.offset()],
    )?;
    let mut a = Args::new();
    a.push(src.device_ptr())
        .push(dst.device_ptr())
        .push(n as u64)
        .push(d)
        .push(ss[0])
        .push(ss[1]);
    let suffix = if fits_u32(&[ls, ld]) { "s32" } else { "s64" };
    let grid = dev.grid_1d(n as u64, BLOCK);
    run(
        dev,
        "copy",
        Module::Copy,
        &["copy", sized(dtype), suffix],
        grid,
        BLOCK,
        0,
        &mut a,
    )
}

pub(crate) fn contiguous(s: &Buffer, l: &Layout, dtype: DType) -> Result<Buffer> {
    let dev = s.state();
    dev.bind()?;
    let out = alloc(dev, l.elem_count() * dtype.size_in_bytes())?;
    copy_strided(s, l, &out, &Layout::contiguous(l.shape().clone()), dtype)?;
    Ok(out)
}

pub(crate) fn fill(
    dev: &'static DeviceState,
    dtype: DType,
    len: usize,
    value: f64,
) -> Result<Buffer> {
    dev.bind()?;
    let out = alloc(dev, len * dtype.size_in_bytes())?;
    if len == 0 {
        return Ok(out);
    }
    let bits: u64 = match dtype {
        DType::F32 => (value as f32).to_bits() as u64,
        DType::F64 => value.to_bits(),
        DType::I64 => (value as i64) as u64,
        // The 16-bit floats: the value's bits, rounded on the host (a byte pattern, no 16-bit
        // arithmetic on the device).
        DType::F16 => kiln_core::halfround::f16_from_f64(value).to_bits() as u64,
        DType::BF16 => kiln_core::halfround::bf16_from_f64(value).to_bits() as u64,
        _ => (value as u8) as u64,
    };
    if bits == 0 {
        // SAFETY: the range is exactly `out`; ordered on the current stream.
        check(
            unsafe {
                sys::cuMemsetD8Async(
                    out.device_ptr(),
                    0,
                    len * dtype.size_in_bytes(),
                    dev.stream(),
                )
            },
            "fill",
        )?;
        return Ok(out);
    }
    let mut a = Args::new();
    a.push(out.device_ptr()).push(len as u64);
    match dtype.size_in_bytes() {
        1 => a.push(bits as u8),
        2 => a.push(bits as u16),
        4 => a.push(bits as u32),
        _ => a.push(bits),
    };
    let grid = dev.grid_1d(len as u64, BLOCK);
    run(
        dev,
        "fill",
        Module::Copy,
        &["fill", sized(dtype)],
        grid,
        BLOCK,
        0,
        &mut a,
    )?;
    Ok(out)
}

pub(crate) fn rand(
    dev: &'static DeviceState,
    dtype: DType,
    len: usize,
    seed: u64,
    dist: RandDist,
) -> Result<Buffer> {
    if !dist.supports(dtype) {
        return Err(Error::DTypeMismatch {
            op: "rand",
            expected: "a float dtype, or u8 for a keep mask".into(),
            got: dtype,
        });
    }
    dev.bind()?;
    dev.refuse_in_capture(
        "rand",
        "drawing random numbers (every replay would draw the same ones)",
    )?;
    let out = alloc(dev, len * dtype.size_in_bytes())?;
    let (kind, p, q) = match dist {
        RandDist::Uniform { low, high } => ("uniform", low, high),
        RandDist::Normal { mean, std } => ("normal", mean, std),
        RandDist::Keep { p } => return keep_mask(dev, out, len, seed, p),
    };
    let mut a = Args::new();
    a.push(out.device_ptr()).push(len as u64).push(seed);
    // f32 parameters for f32 and the 16-bit floats (drawn in f32, then rounded).
    if dtype.compute_dtype() == DType::F32 {
        a.push(p as f32).push(q as f32);
    } else {
        a.push(p).push(q);
    }
    // f32-computed uniforms take four elements a thread (one Philox call, `rand.cu`).
    let threads = if kind == "uniform" && dtype.compute_dtype() == DType::F32 {
        len.div_ceil(4)
    } else {
        len
    };
    let grid = dev.grid_1d(threads as u64, BLOCK);
    run(
        dev,
        "rand",
        Module::Rand,
        &["rand", kind, tname(dtype)],
        grid,
        BLOCK,
        0,
        &mut a,
    )?;
    Ok(out)
}

/// Dropout's keep mask ([`RandDist::Keep`]) into `out`: four bytes a thread (`rand.cu`).
fn keep_mask(
    dev: &'static DeviceState,
    out: Buffer,
    len: usize,
    seed: u64,
    p: f64,
) -> Result<Buffer> {
    let mut a = Args::new();
    a.push(out.device_ptr())
        .push(len as u64)
        .push(seed)
        .push(p as f32);
    let grid = dev.grid_1d(len.div_ceil(4) as u64, BLOCK);
    let name = ["rand", "keep", "float"];
    run(dev, "rand", Module::Rand, &name, grid, BLOCK, 0, &mut a)?;
    Ok(out)
}

/// After a kernel that checks `ids` (read through `l`) against `0..limit` on the device: reads
/// the error flag (a synchronization) unless these same ids already passed such a check, as a
/// cross-entropy's labels did in the forward pass when its backward runs.
pub(super) fn check_ids(
    dev: &DeviceState,
    op: &'static str,
    ids: &Buffer,
    l: &Layout,
    limit: usize,
) -> Result<()> {
    if ids.ids_known_below(l, limit) {
        return Ok(());
    }
    dev.check_flag(op, limit)?;
    ids.mark_ids_below(l, limit);
    Ok(())
}

pub(crate) mod attention;
mod attention_kernels;
mod index;
pub(crate) mod norm;
pub(crate) mod reduce;
mod rows;

pub(crate) use index::{gather, index_select, scatter_add};
pub(crate) use reduce::reduce;
pub(crate) use rows::{cross_entropy, cross_entropy_backward, softmax};
