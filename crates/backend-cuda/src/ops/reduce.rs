//! Reductions over chosen axes (`Backend::reduce`): one pass, or partial results per output
//! and a second pass that combines them.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::driver::sys;
use kiln_core::{DType, Error, Layout, ReduceOp, Result};

use crate::device::{DeviceState, check};
use crate::launch::{Args, Dims, Strides, collapse};
use crate::memory::{Buffer, alloc};
use crate::ops::{Module, run, tname};

/// Whether `Backend::reduce` of a computed buffer runs as a generated program
/// (`expr_eval::reduce`) instead of this file's hand-written kernels: `KILN_CUDA_REDUCE=generated`
/// (read once) or [`set_generated_reductions`]. Off by default: the hand kernels are prebuilt
/// (no compile on a fresh machine), and the benchmark rows `reduce_*` time both paths.
pub fn generated_reductions() -> bool {
    GENERATED.load(Ordering::Relaxed) == 1
        || (GENERATED.load(Ordering::Relaxed) == 2 && *ENV_GENERATED)
}

/// Sets [`generated_reductions`] for the process (overrides the environment).
pub fn set_generated_reductions(on: bool) {
    GENERATED.store(on as u8, Ordering::Relaxed);
}

/// 0 off, 1 on, 2 unset (the environment decides).
static GENERATED: AtomicU8 = AtomicU8::new(2);
static ENV_GENERATED: LazyLock<bool> =
    LazyLock::new(|| std::env::var("KILN_CUDA_REDUCE").is_ok_and(|v| v.trim() == "generated"));

pub(super) fn block_for(n: u64, max: u32) -> u32 {
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
        let partial = alloc(dev, nout * splits * partial_size(dtype))?;
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
        let first: &[&str] = if dtype.is_half() {
            &["reduce_row", name, t, "part"]
        } else {
            kernel
        };
        run(
            dev,
            name,
            Module::Reduce,
            first,
            (grid_x, splits as u32),
            256,
            0,
            &mut a,
        )?;
        combine_partials(
            dev,
            name,
            t,
            dtype,
            &partial,
            out,
            nout,
            splits,
            grid_x as usize,
        )
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
            Some(alloc(dev, nout * splits * partial_size(dtype))?)
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
        let kernel: &[&str] = if partial.is_some() && dtype.is_half() {
            &["reduce_col", name, t, "part"]
        } else {
            &["reduce_col", name, t]
        };
        run(
            dev,
            name,
            Module::Reduce,
            kernel,
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
                dtype,
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

/// The bytes of one partial result of a split reduction of `dtype`: the dtype's own, or f32
/// for the 16-bit floats (their partial results stay in the f32 accumulator's precision).
fn partial_size(dtype: DType) -> usize {
    if dtype.is_half() {
        4
    } else {
        dtype.size_in_bytes()
    }
}

/// The second pass of a split reduction: `partial` holds `splits` contiguous partial results
/// per output; one block per output combines them, in a fixed order, into `out` (for the
/// 16-bit floats, f32 partials folded in f32 and rounded once: the `_fin` kernels).
#[allow(clippy::too_many_arguments)]
fn combine_partials(
    dev: &DeviceState,
    name: &'static str,
    t: &'static str,
    dtype: DType,
    partial: &Buffer,
    out: &Buffer,
    nout: usize,
    splits: usize,
    grid_x: usize,
) -> Result<()> {
    let kernel: &[&str] = if dtype.is_half() {
        &["reduce_row", name, t, "fin"]
    } else {
        &["reduce_row", name, t]
    };
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
        kernel,
        (grid_x as u32, 1),
        block_for(splits as u64, 256),
        0,
        &mut a,
    )
}
