//! The kernels of the `Backend` trait: argument packing and launch configuration for each op.
//! This file holds the shared helpers, the elementwise ops and data movement; reductions
//! (`reduce.rs`), softmax and cross-entropy (`rows.rs`) and indexing (`index.rs`) have files
//! of their own.

use cudarc::driver::sys;
use std::sync::Arc;

use kiln_core::expr::rules;
use kiln_core::{BinaryOp, CmpOp, DType, Error, Layout, RandDist, Result, UnaryOp};

use crate::device::{DeviceState, check};
use crate::expr_run::run_single;
use crate::launch::{Args, collapse, fits_u32};
use crate::memory::{Buffer, alloc};
use crate::sources::Module;
pub(crate) use crate::sources::ctype as tname;

pub(crate) const BLOCK: u32 = 256;

/// The kernel type for moving elements of `dtype` without looking at them.
fn sized(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        1 => "u8",
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

/// `base` followed by `suffix`: the parts of a kernel name, without allocating.
struct Name {
    parts: [&'static str; 5],
    len: usize,
}

impl std::ops::Deref for Name {
    type Target = [&'static str];
    fn deref(&self) -> &[&'static str] {
        &self.parts[..self.len]
    }
}

fn with_suffix(base: &[&'static str], suffix: &'static str) -> Name {
    let mut parts = [""; 5];
    parts[..base.len()].copy_from_slice(base);
    parts[base.len()] = suffix;
    Name {
        parts,
        len: base.len() + 1,
    }
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

/// An elementwise kernel over `inputs` (all with the output's shape) into a new contiguous
/// buffer of `out_dtype`. `extra` pushes the arguments between `n` and the layouts.
/// Contiguous, 16-byte-aligned operands take the `_c` (vectorized) kernel when `has_c`.
fn elementwise(
    op: &'static str,
    module: Module,
    base: &[&'static str],
    inputs: &[(&Buffer, &Layout, DType)],
    out_dtype: DType,
    has_c: bool,
    extra: &dyn Fn(&mut Args),
) -> Result<Buffer> {
    let (s0, l0, _) = inputs[0];
    for (s, _, _) in &inputs[1..] {
        same_device(op, s0, s)?;
    }
    let dev = s0.state();
    dev.bind()?;
    let n = l0.elem_count();
    let out = alloc(dev, n * out_dtype.size_in_bytes())?;
    if n == 0 {
        return Ok(out);
    }
    let contiguous = has_c
        && inputs
            .iter()
            .all(|(s, l, dt)| l.is_contiguous() && ptr_at(s, l, *dt).is_multiple_of(16));
    let mut a = Args::new();
    if contiguous {
        for (s, l, dt) in inputs {
            a.push(ptr_at(s, l, *dt));
        }
        a.push(out.device_ptr()).push(n as u64);
        extra(&mut a);
        let vec = 16 / inputs[0].2.size_in_bytes() as u64;
        let grid = dev.grid_1d((n as u64).div_ceil(vec), BLOCK);
        run(
            dev,
            op,
            module,
            &with_suffix(base, "c"),
            grid,
            BLOCK,
            0,
            &mut a,
        )?;
    } else {
        let strides: Vec<&[usize]> = inputs.iter().map(|(_, l, _)| l.strides()).collect();
        let offsets: Vec<usize> = inputs.iter().map(|(_, l, _)| l.offset()).collect();
        let (d, ss) = collapse(op, l0.dims(), &strides, &offsets)?;
        for (s, _, _) in inputs {
            a.push(s.device_ptr());
        }
        a.push(out.device_ptr()).push(n as u64);
        extra(&mut a);
        a.push(d);
        for s in ss {
            a.push(s);
        }
        let layouts: Vec<&Layout> = inputs.iter().map(|(_, l, _)| *l).collect();
        let suffix = if fits_u32(&layouts) { "s32" } else { "s64" };
        let grid = dev.grid_1d(n as u64, BLOCK);
        run(
            dev,
            op,
            module,
            &with_suffix(base, suffix),
            grid,
            BLOCK,
            0,
            &mut a,
        )?;
    }
    Ok(out)
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
    let program = rules::unary_program(op, dtype)?;
    run_single(op.name(), &program, &[(s, l)], l.shape(), contiguous)
}

pub(crate) fn binary(
    op: BinaryOp,
    a: &Buffer,
    la: &Layout,
    b: &Buffer,
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
    let base: &[&str] = &["binary", op.name(), tname(dtype)];
    elementwise(
        op.name(),
        Module::Elementwise,
        base,
        &[(a, la, dtype), (b, lb, dtype)],
        dtype,
        true,
        &|_| {},
    )
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
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: "f32 or f64".into(),
            got: dtype,
        });
    }
    let program = rules::unary_backward_program(op, dtype)?;
    run_single(OP, &program, &[(s, ls), (g, lg)], lg.shape(), contiguous)
}

pub(crate) fn binary_scalar(
    op: BinaryOp,
    s: &Buffer,
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
    let base: &[&str] = &["scalar", op.name(), tname(dtype)];
    let lhs = scalar_lhs as i32;
    let extra = |a: &mut Args| {
        match dtype {
            DType::F32 => a.push(scalar as f32),
            DType::F64 => a.push(scalar),
            DType::I64 => a.push(scalar as i64),
            _ => a.push(scalar as u8),
        };
        a.push(lhs);
    };
    elementwise(
        op.name(),
        Module::Elementwise,
        base,
        &[(s, l, dtype)],
        dtype,
        true,
        &extra,
    )
}

pub(crate) fn compare(
    op: CmpOp,
    a: &Buffer,
    la: &Layout,
    b: &Buffer,
    lb: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    let base: &[&str] = &["cmp", op.name(), tname(dtype)];
    elementwise(
        op.name(),
        Module::Elementwise,
        base,
        &[(a, la, dtype), (b, lb, dtype)],
        DType::U8,
        true,
        &|_| {},
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn where_cond(
    c: &Buffer,
    lc: &Layout,
    t: &Buffer,
    lt: &Layout,
    f: &Buffer,
    lf: &Layout,
    dtype: DType,
) -> Result<Buffer> {
    let base: &[&str] = &["where", sized(dtype)];
    elementwise(
        "where",
        Module::Elementwise,
        base,
        &[(c, lc, DType::U8), (t, lt, dtype), (f, lf, dtype)],
        dtype,
        false,
        &|_| {},
    )
}

pub(crate) fn cast(s: &Buffer, l: &Layout, from: DType, to: DType) -> Result<Buffer> {
    if from == to {
        return contiguous(s, l, from);
    }
    let base: &[&str] = &["cast", tname(from), tname(to)];
    elementwise(
        "cast",
        Module::Elementwise,
        base,
        &[(s, l, from)],
        to,
        false,
        &|_| {},
    )
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
    if !dtype.is_float() {
        return Err(Error::DTypeMismatch {
            op: "rand",
            expected: "a float dtype".into(),
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
    };
    let mut a = Args::new();
    a.push(out.device_ptr()).push(len as u64).push(seed);
    if dtype == DType::F32 {
        a.push(p as f32).push(q as f32);
    } else {
        a.push(p).push(q);
    }
    let grid = dev.grid_1d(len as u64, BLOCK);
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

mod index;
mod reduce;
mod rows;

pub(crate) use index::{gather, index_select, scatter_add};
pub(crate) use reduce::reduce;
pub(crate) use rows::{cross_entropy, cross_entropy_backward, softmax};
