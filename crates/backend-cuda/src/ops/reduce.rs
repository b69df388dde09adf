//! Reductions over chosen axes (`Backend::reduce`): one pass, or partial results per output
//! and a second pass that combines them.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::driver::sys;
use kiln_core::{DType, Error, Layout, ReduceOp, Result};

use crate::device::{DeviceState, check};
use crate::launch::{Args, Dims, Strides, collapse, collapse_where};
use crate::memory::{Buffer, alloc};
use crate::ops::{Module, run, tname};

/// Which path `Backend::reduce` of a computed buffer takes: this file's hand-written kernels
/// (`kernels/reduce.cu`, prebuilt: nothing to compile on a fresh machine) or a generated
/// one-reduction program (`expr_eval::reduce`, compiled on first use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReducePath {
    /// Per shape, the path that measured faster (`generated_is_faster`); the default.
    Auto,
    /// The hand-written kernels always.
    Kernels,
    /// Generated programs wherever they apply (sum, max, min of floats).
    Generated,
}

/// The process's [`ReducePath`]: [`set_reduce_path`], else `KILN_CUDA_REDUCE=auto|kernels|
/// generated` (read once), else `Auto`.
pub fn reduce_path() -> ReducePath {
    match PATH.load(Ordering::Relaxed) {
        1 => ReducePath::Kernels,
        2 => ReducePath::Generated,
        3 => ReducePath::Auto,
        _ => *ENV_PATH,
    }
}

/// Sets [`reduce_path`] for the process (overrides the environment).
pub fn set_reduce_path(path: ReducePath) {
    let v = match path {
        ReducePath::Kernels => 1,
        ReducePath::Generated => 2,
        ReducePath::Auto => 3,
    };
    PATH.store(v, Ordering::Relaxed);
}

/// 0 unset (the environment decides), else [`set_reduce_path`]'s choice.
static PATH: AtomicU8 = AtomicU8::new(0);
static ENV_PATH: LazyLock<ReducePath> =
    LazyLock::new(
        || match std::env::var("KILN_CUDA_REDUCE").as_deref().map(str::trim) {
            Ok("kernels") => ReducePath::Kernels,
            Ok("generated") => ReducePath::Generated,
            _ => ReducePath::Auto,
        },
    );

/// Whether a generated program reduces `l` over `axes` faster than the hand-written kernels,
/// on a device of `sms` multiprocessors. Measured on an H100 (2026-11-27, `reduce_*` rows of
/// the gpu bench, GB/s read, hand kernels against generated):
/// - columns (the reduced axes are not the innermost): 4096² 1876 against 562, 16384 × 384
///   2313 against 633 — the hand kernel's coalesced column walk; kept;
/// - long rows with many outputs: 4096² sum 2468 against 1837, max 2561 against 1836, bf16
///   2455 against 1309 — kept;
/// - everything (one output): 2761 against 2769 — equal; the prebuilt kernel is kept;
/// - short rows: 16384 × 384 732 against 1078, and few outputs over many elements (batch
///   norm's statistics, (256, 64, 32, 32) over (0, 2, 3): 64 outputs) 643 against 1078 — the
///   hand kernels give each output one block, the generated ones split long reductions over
///   the whole GPU (`codegen::plan`): generated, from a million elements up.
pub(crate) fn generated_is_faster(l: &Layout, axes: &[usize], sms: usize) -> bool {
    let (mut nout, mut inner) = (1usize, 1usize);
    let (mut red_stride, mut kept_stride) = (usize::MAX, usize::MAX);
    for (i, (&d, &st)) in l.dims().iter().zip(l.strides()).enumerate() {
        if axes.contains(&i) {
            inner *= d;
            if d > 1 {
                red_stride = red_stride.min(st);
            }
        } else {
            nout *= d;
            if d > 1 {
                kept_stride = kept_stride.min(st);
            }
        }
    }
    let rows = red_stride < kept_stride;
    // Under a million elements the launch dominates either way, and the prebuilt kernel costs
    // a fresh process no compile (a classifier's loss rows, a small batch's statistics).
    let large = nout * inner >= 1 << 20;
    large && rows && nout > 1 && (nout < sms || inner <= 1024)
}

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
    let reduced = |i: usize| axes.contains(&i);
    let (mut nout, mut inner) = (1usize, 1usize);
    for (i, &d) in l.dims().iter().enumerate() {
        if reduced(i) {
            inner *= d;
        } else {
            nout *= d;
        }
    }
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
    let (dims, strides) = (l.dims(), &[l.strides()]);
    let (kdims, [kstr]) = collapse_where(name, dims, strides, &[l.offset()], |i| !reduced(i))?;
    // For arg reductions the reduced dims are the one reduced axis: `r` is the index the kernel
    // reports.
    let (rdims, [rstr]) = collapse_where(name, dims, strides, &[0], reduced)?;
    let contig = rdims.rank == 0 || (rdims.rank == 1 && rstr.s[0] == 1);
    // The smallest stride of a dim longer than 1 (merged dims keep their innermost stride).
    let min_stride = |d: &Dims, s: &Strides| s.s[..d.rank as usize].iter().min().copied();
    let row_mode = match (min_stride(&rdims, &rstr), min_stride(&kdims, &kstr)) {
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

#[cfg(test)]
mod tests {
    use super::generated_is_faster;
    use kiln_core::{Layout, Shape};

    fn faster(dims: &[usize], axes: &[usize]) -> bool {
        generated_is_faster(&Layout::contiguous(Shape::from(dims.to_vec())), axes, 132)
    }

    #[test]
    fn the_measured_shapes_take_the_faster_path() {
        assert!(!faster(&[4096, 4096], &[1]), "long rows: the kernels");
        assert!(!faster(&[4096, 4096], &[0]), "columns: the kernels");
        assert!(!faster(&[16384, 384], &[0]), "columns: the kernels");
        assert!(!faster(&[1 << 26], &[0]), "everything: the prebuilt kernel");
        assert!(faster(&[16384, 384], &[1]), "short rows: generated");
        assert!(
            faster(&[256, 64, 32, 32], &[0, 2, 3]),
            "few outputs: generated"
        );
        let t = Layout::contiguous(Shape::from(vec![4096, 384]))
            .transpose(0, 1)
            .unwrap();
        assert!(
            generated_is_faster(&t, &[0], 132),
            "by memory order: a short row"
        );
        assert!(
            !generated_is_faster(&t, &[1], 132),
            "by memory order: a column"
        );
    }
}
