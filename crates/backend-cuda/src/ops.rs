//! The kernels of the `Backend` trait: argument packing and launch configuration for each op.

use cudarc::driver::sys;
use kiln_core::{BinaryOp, CmpOp, DType, Error, Layout, RandDist, ReduceOp, Result, UnaryOp};

use crate::device::{DeviceState, check};
use crate::launch::{Args, Dims, Strides, collapse, fits_u32};
use crate::memory::{Buffer, alloc};
use crate::sources::Module;
pub(crate) use crate::sources::{bwd_name, ctype as tname};

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

pub(crate) fn unary(op: UnaryOp, s: &Buffer, l: &Layout, dtype: DType) -> Result<Buffer> {
    if !op.supports(dtype) {
        return Err(Error::DTypeMismatch {
            op: op.name(),
            expected: "a dtype the op supports".into(),
            got: dtype,
        });
    }
    let base: &[&str] = &["unary", op.name(), tname(dtype)];
    elementwise(
        op.name(),
        Module::Elementwise,
        base,
        &[(s, l, dtype)],
        dtype,
        true,
        &|_| {},
    )
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

/// `Backend::unary_backward`: one kernel, `g * op'(saved)`.
pub(crate) fn unary_backward(
    op: UnaryOp,
    s: &Buffer,
    ls: &Layout,
    g: &Buffer,
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
    let Some(name) = bwd_name(op) else {
        return Err(Error::invalid(
            OP,
            format!("`{}` has no single-operand backward kernel", op.name()),
        ));
    };
    elementwise(
        OP,
        Module::Elementwise,
        &["unary", name, tname(dtype)],
        &[(s, ls, dtype), (g, lg, dtype)],
        dtype,
        true,
        &|_| {},
    )
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

// ---- reductions ------------------------------------------------------------------------------

fn block_for(n: u64, max: u32) -> u32 {
    (n.next_power_of_two().clamp(32, max as u64)) as u32
}

pub(crate) fn reduce(
    op: ReduceOp,
    s: &Buffer,
    l: &Layout,
    dtype: DType,
    axes: &[usize],
) -> Result<Buffer> {
    let name = op.name();
    let dev = s.state();
    dev.bind()?;
    let out_dtype = if op.is_arg() { DType::I64 } else { dtype };
    let (mut kd, mut ks, mut rd, mut rs) = (vec![], vec![], vec![], vec![]);
    for (i, (&d, &st)) in l.dims().iter().zip(l.strides()).enumerate() {
        if axes.contains(&i) {
            rd.push(d);
            rs.push(st);
        } else {
            kd.push(d);
            ks.push(st);
        }
    }
    let nout: usize = kd.iter().product();
    let inner: usize = rd.iter().product();
    let out = alloc(dev, nout * out_dtype.size_in_bytes())?;
    if nout == 0 {
        return Ok(out);
    }
    if inner == 0 {
        if op != ReduceOp::Sum {
            return Err(Error::invalid(name, "cannot reduce an empty axis"));
        }
        // SAFETY: the range is exactly `out`.
        check(
            unsafe {
                sys::cuMemsetD8Async(
                    out.device_ptr(),
                    0,
                    nout * out_dtype.size_in_bytes(),
                    dev.stream(),
                )
            },
            name,
        )?;
        return Ok(out);
    }
    let (kdims, kstr) = collapse(name, &kd, &[&ks], &[l.offset()])?;
    // For arg reductions `rd` is the one reduced axis: `r` is the index the kernel reports.
    let (rdims, rstr) = collapse(name, &rd, &[&rs], &[0])?;
    let (kstr, rstr) = (kstr[0], rstr[0]);
    let contig = rdims.rank == 0 || (rdims.rank == 1 && rstr.s[0] == 1);
    let min_stride = |d: &[usize], s: &[usize]| {
        d.iter()
            .zip(s)
            .filter(|(d, _)| **d > 1)
            .map(|(_, s)| *s)
            .min()
    };
    let row_mode = match (min_stride(&rd, &rs), min_stride(&kd, &ks)) {
        (Some(r), Some(k)) => r < k || nout < 64,
        _ => true,
    };
    let call = ReduceCall {
        dev,
        name,
        t: tname(dtype),
        sms: dev.sm_count() as usize,
        src: s,
        nout,
        inner,
        kdims,
        kstr,
        rdims,
        rstr,
        arg: op.is_arg(),
        dtype,
    };
    if row_mode {
        call.rows(&out, contig)?;
    } else {
        call.columns(&out)?;
    }
    Ok(out)
}

/// One reduction's launch parameters, after the dimensions were split and merged.
struct ReduceCall<'a> {
    dev: &'static DeviceState,
    name: &'static str,
    /// The element type's name in kernel names.
    t: &'static str,
    sms: usize,
    src: &'a Buffer,
    nout: usize,
    inner: usize,
    kdims: Dims,
    kstr: Strides,
    rdims: Dims,
    rstr: Strides,
    arg: bool,
    dtype: DType,
}

impl ReduceCall<'_> {
    /// Reduced elements closer together than kept ones: threads cooperate along the reduced
    /// axes (a block per output, or `splits` partial blocks per output and a second pass).
    fn rows(&self, out: &Buffer, contig: bool) -> Result<()> {
        let ReduceCall {
            dev,
            name,
            t,
            sms,
            src: s,
            nout,
            inner,
            kdims,
            kstr,
            rdims,
            rstr,
            arg,
            dtype,
        } = *self;
        let block = block_for(inner as u64, 256);
        let kernel: &[&str] = &["reduce_row", name, t];
        let splits = if !arg && nout < sms * 2 && inner >= 1 << 16 {
            (sms * 8).div_ceil(nout).min(inner / 8192).max(1)
        } else {
            1
        };
        let grid_x = nout.min(sms * 32) as u32;
        if splits == 1 {
            let mut a = Args::new();
            a.push(s.device_ptr())
                .push(out.device_ptr())
                .push(nout as u64)
                .push(kdims)
                .push(kstr)
                .push(rdims)
                .push(rstr)
                .push(inner as u64)
                .push(contig as i32)
                .push(inner as u64);
            run(
                dev,
                name,
                Module::Reduce,
                kernel,
                (grid_x, 1),
                block,
                0,
                &mut a,
            )?;
            return Ok(());
        }
        // Two passes: `splits` partial results per output, then one block per output
        // combines them.
        let chunk = inner.div_ceil(splits).next_multiple_of(16);
        let splits = inner.div_ceil(chunk);
        let partial = alloc(dev, nout * splits * dtype.size_in_bytes())?;
        let mut a = Args::new();
        a.push(s.device_ptr())
            .push(partial.device_ptr())
            .push(nout as u64)
            .push(kdims)
            .push(kstr)
            .push(rdims)
            .push(rstr)
            .push(inner as u64)
            .push(contig as i32)
            .push(chunk as u64);
        run(
            dev,
            name,
            Module::Reduce,
            kernel,
            (grid_x, splits as u32),
            256,
            0,
            &mut a,
        )?;
        combine_partials(dev, name, t, &partial, out, nout, splits, grid_x as usize)
    }

    /// Kept elements closer together than reduced ones: 32 outputs per block, each thread
    /// folding one output's column; the reduced elements split too when that leaves the GPU
    /// idle (then a second pass).
    fn columns(&self, out: &Buffer) -> Result<()> {
        let ReduceCall {
            dev,
            name,
            t,
            sms,
            src: s,
            nout,
            inner,
            kdims,
            kstr,
            rdims,
            rstr,
            arg,
            dtype,
        } = *self;
        // 32 outputs per block; split the reduced elements too when that leaves the GPU idle.
        let grid_x = nout.div_ceil(32).min(sms * 32);
        let splits = if !arg && inner >= 2048 {
            (sms * 8).div_ceil(grid_x).min(inner / 512).max(1)
        } else {
            1
        };
        let chunk = inner.div_ceil(splits);
        let splits = inner.div_ceil(chunk);
        let partial = if splits > 1 {
            Some(alloc(dev, nout * splits * dtype.size_in_bytes())?)
        } else {
            None
        };
        let dst = partial.as_ref().unwrap_or(out);
        let mut a = Args::new();
        a.push(s.device_ptr())
            .push(dst.device_ptr())
            .push(nout as u64)
            .push(kdims)
            .push(kstr)
            .push(rdims)
            .push(rstr)
            .push(inner as u64)
            .push(chunk as u64);
        run(
            dev,
            name,
            Module::Reduce,
            &["reduce_col", name, t],
            (grid_x as u32, splits as u32),
            256,
            0,
            &mut a,
        )?;
        if let Some(partial) = partial {
            combine_partials(
                dev,
                name,
                t,
                &partial,
                out,
                nout,
                splits,
                // One block per output (up to 32 per SM): a block of 32 threads has only a
                // few partials to add, so fewer blocks would leave the GPU waiting on latency.
                nout.min(sms * 32),
            )?;
        }
        Ok(())
    }
}

/// The second pass of a split reduction: `partial` holds `splits` contiguous partial results
/// per output; one block per output combines them, in a fixed order, into `out`.
#[allow(clippy::too_many_arguments)]
fn combine_partials(
    dev: &DeviceState,
    name: &'static str,
    t: &'static str,
    partial: &Buffer,
    out: &Buffer,
    nout: usize,
    splits: usize,
    grid_x: usize,
) -> Result<()> {
    let (pk, pks) = collapse(name, &[nout], &[&[splits]], &[0])?;
    let (pr, prs) = collapse(name, &[splits], &[&[1]], &[0])?;
    let mut a = Args::new();
    a.push(partial.device_ptr())
        .push(out.device_ptr())
        .push(nout as u64)
        .push(pk)
        .push(pks[0])
        .push(pr)
        .push(prs[0])
        .push(splits as u64)
        .push(1i32)
        .push(splits as u64);
    run(
        dev,
        name,
        Module::Reduce,
        &["reduce_row", name, t],
        (grid_x as u32, 1),
        block_for(splits as u64, 256),
        0,
        &mut a,
    )
}

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
    let row_bytes = cols * dtype.size_in_bytes();
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

/// After a kernel that checks `ids` (read through `l`) against `0..limit` on the device: reads
/// the error flag (a synchronization) unless these same ids already passed such a check, as a
/// cross-entropy's labels did in the forward pass when its backward runs.
fn check_ids(
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

// ---- indexing --------------------------------------------------------------------------------

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
    let sx = zero_axis(l, axis);
    let (d, sxs) = collapse(OP, &od, &[&sx], &[l.offset()])?;
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
        &["index_select", tname(dtype)],
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
        &["gather", tname(dtype)],
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
