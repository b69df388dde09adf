//! Fused layer norm and RMS norm (`Backend::layer_norm_forward` / `layer_norm_backward`,
//! kernels in `kernels/norm.cu`): one kernel forward (the row read once, two-pass f32
//! statistics, the normalized and affine output, f32 `mean`/`rstd` saved), and backward `dx`
//! plus a two-stage, atomics-free column sum for `dw`/`db` — PyTorch eager's kernel structure,
//! instead of the composed path's three generated programs each way (three reads of the input
//! forward, three of `g` and `x` backward). Short vectorized rows (`warp_rows`: the GPT's
//! 384) take a warp per row, and their backward writes `dx` and the column partials in one
//! pass over `g` and `x` (two launches); longer rows a block per row, in shared memory, and a
//! separate pass for the partials (three).
//!
//! Offered for f32, f16 and bf16 rows of 1 to [`MAX_COLS`] elements. f64 and longer rows are
//! not offered (`Ok(None)`): kiln-autograd runs its composed programs, which take any length.
//! Operands that are not contiguous are copied to contiguous first. `KILN_CUDA_FUSED_NORM=0`
//! offers nothing for the whole process (to measure a model against the composed path).

use std::sync::OnceLock;

use kiln_core::backend::Operand;
use kiln_core::{DType, Error, NormGrads, NormOutputs, NormSpec, Result};

use crate::device::DeviceState;
use crate::launch::Args;
use crate::memory::{Buffer, alloc};
use crate::ops::{Module, contiguous, run, same_device, tname};

/// The longest row the kernels take: the forward caches the row as f32 in shared memory (32 KiB
/// here, under the 48 KiB a launch gets without opting in).
pub(crate) const MAX_COLS: usize = 8192;

/// The backward's `dx` kernel caches `(ĝ, x̂)` f32 pairs in shared memory up to this row
/// length (32 KiB; with the kernel's static scratch it must stay under the 48 KiB a launch gets
/// without opting in); longer rows read `g`, `x` and `w` a second time instead (from L1/L2).
const CACHE_COLS: usize = 4096;

/// Rows per chunk of the column sums' first stage.
const CHUNK: usize = 64;

/// Vectors a lane holds in the warp-per-row kernels (`LN_WARP_VECS` in `norm.cu`): vectorized
/// rows of at most `32 * WARP_VECS` 16-byte vectors (512 f32, 1024 f16/bf16) take them.
const WARP_VECS: usize = 4;

/// The warp backward's instances by the vectors a lane holds (1 ..= [`WARP_VECS`]).
const WARP_BACKWARD: [&str; WARP_VECS] = [
    "ln_bwd_warp1",
    "ln_bwd_warp2",
    "ln_bwd_warp3",
    "ln_bwd_warp4",
];

/// Threads of a warp-per-row block (8 warps; the kernels' `__launch_bounds__(256, ..)` in
/// `norm.cu`).
const WARP_BLOCK: u32 = 256;

/// Whether vectorized rows of `cols` take the warp-per-row kernels.
fn warp_rows(dtype: DType, cols: usize) -> bool {
    cols / (16 / dtype.size_in_bytes()) <= 32 * WARP_VECS
}

/// An operand as a contiguous buffer: itself (at its offset) or a contiguous copy.
struct Contig<'a> {
    copy: Option<Buffer>,
    buf: &'a Buffer,
    offset: u64,
}

impl<'a> Contig<'a> {
    fn new((s, l): Operand<'a, Buffer>, dtype: DType) -> Result<Self> {
        if l.is_contiguous() {
            return Ok(Contig {
                copy: None,
                buf: s,
                offset: (l.offset() * dtype.size_in_bytes()) as u64,
            });
        }
        Ok(Contig {
            copy: Some(contiguous(s, l, dtype)?),
            buf: s,
            offset: 0,
        })
    }
    fn ptr(&self) -> u64 {
        self.copy.as_ref().unwrap_or(self.buf).device_ptr() + self.offset
    }
}

/// Whether `KILN_CUDA_FUSED_NORM` leaves the kernels on (anything but `0`), read once.
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUDA_FUSED_NORM").map_or(true, |v| v.trim() != "0"))
}

/// Whether the kernels take this call (module docs).
fn offered(dtype: DType, spec: &NormSpec) -> bool {
    enabled()
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && (1..=MAX_COLS).contains(&spec.cols)
        && spec.rows > 0
}

/// Checks that `o` holds `len` elements.
fn check_len(op: &'static str, what: &str, o: &Operand<'_, Buffer>, len: usize) -> Result<()> {
    if o.1.elem_count() != len {
        return Err(Error::invalid(
            op,
            format!("{what} must have {len} elements, got shape {}", o.1.shape()),
        ));
    }
    Ok(())
}

/// Threads per row: one per vector (or element) up to 256, a multiple of the warp.
fn row_block(units: usize) -> u32 {
    (units.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// Whether every pointer is 16-byte aligned and the rows are whole vectors.
fn vectorized(dtype: DType, cols: usize, ptrs: &[u64]) -> bool {
    cols.is_multiple_of(16 / dtype.size_in_bytes()) && ptrs.iter().all(|p| p.is_multiple_of(16))
}

fn grid_rows(dev: &DeviceState, rows: usize) -> (u32, u32) {
    (rows.min(dev.sm_count() as usize * 32) as u32, 1)
}

fn op_name(spec: &NormSpec, backward: bool) -> &'static str {
    match (spec.centered, backward) {
        (true, false) => "layer_norm",
        (true, true) => "layer_norm_backward",
        (false, false) => "rms_norm",
        (false, true) => "rms_norm_backward",
    }
}

/// `Backend::layer_norm_forward` on the GPU (module docs).
pub(crate) fn forward(
    x: Operand<'_, Buffer>,
    w: Option<Operand<'_, Buffer>>,
    b: Option<Operand<'_, Buffer>>,
    dtype: DType,
    spec: NormSpec,
) -> Result<Option<NormOutputs<Buffer>>> {
    if !offered(dtype, &spec) {
        return Ok(None);
    }
    let op = op_name(&spec, false);
    let (rows, cols) = (spec.rows, spec.cols);
    check_len(op, "the input", &x, rows * cols)?;
    for (name, p) in [("weight", &w), ("bias", &b)] {
        if let Some(p) = p {
            same_device(op, x.0, p.0)?;
            check_len(op, name, p, cols)?;
        }
    }
    let dev = x.0.state();
    dev.bind()?;
    let xc = Contig::new(x, dtype)?;
    let wc = w.map(|w| Contig::new(w, dtype)).transpose()?;
    let bc = b.map(|b| Contig::new(b, dtype)).transpose()?;
    let y = alloc(dev, rows * cols * dtype.size_in_bytes())?;
    let mean = spec.centered.then(|| alloc(dev, rows * 4)).transpose()?;
    let rstd = alloc(dev, rows * 4)?;
    let (wp, bp) = (
        wc.as_ref().map_or(0, Contig::ptr),
        bc.as_ref().map_or(0, Contig::ptr),
    );
    let vec = vectorized(dtype, cols, &[xc.ptr(), y.device_ptr(), wp, bp]);
    let units = if vec {
        cols / (16 / dtype.size_in_bytes())
    } else {
        cols
    };
    let mut a = Args::new();
    a.push(xc.ptr())
        .push(wp)
        .push(bp)
        .push(y.device_ptr())
        .push(mean.as_ref().map_or(0, Buffer::device_ptr))
        .push(rstd.device_ptr())
        .push(rows as u64)
        .push(cols as u64)
        .push(spec.eps as f32)
        .push(spec.centered as i32);
    if vec && warp_rows(dtype, cols) {
        // 8 rows a block, at most as many blocks an SM as its registers hold (`norm.cu`: 63
        // a thread in f32, 80 in f16/bf16): one wave whose warps prefetch their next row, the
        // rest grid-stride.
        let per_sm = if dtype == DType::F32 { 4 } else { 3 };
        let blocks = rows.div_ceil(8).min(dev.sm_count() as usize * per_sm);
        run(
            dev,
            op,
            Module::Norm,
            &["ln_fwd_warp", tname(dtype)],
            (blocks as u32, 1),
            WARP_BLOCK,
            0,
            &mut a,
        )?;
        return Ok(Some((y, mean, rstd)));
    }
    a.push(vec as i32);
    run(
        dev,
        op,
        Module::Norm,
        &["ln_fwd", tname(dtype)],
        grid_rows(dev, rows),
        row_block(units),
        (cols * 4) as u32,
        &mut a,
    )?;
    Ok(Some((y, mean, rstd)))
}

/// `Backend::layer_norm_backward` on the GPU (module docs); `None` exactly where the forward
/// was not offered.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    x: Operand<'_, Buffer>,
    mean: Option<Operand<'_, Buffer>>,
    rstd: Operand<'_, Buffer>,
    w: Option<Operand<'_, Buffer>>,
    g: Operand<'_, Buffer>,
    dx_acc: Option<Operand<'_, Buffer>>,
    dtype: DType,
    spec: NormSpec,
    needs: [bool; 3],
) -> Result<Option<NormGrads<Buffer>>> {
    if !offered(dtype, &spec) {
        return Ok(None);
    }
    let op = op_name(&spec, true);
    let (rows, cols) = (spec.rows, spec.cols);
    if spec.centered != mean.is_some() {
        return Err(Error::invalid(
            op,
            "the row means are given exactly for a layer norm",
        ));
    }
    check_len(op, "the input", &x, rows * cols)?;
    check_len(op, "the output gradient", &g, rows * cols)?;
    check_len(op, "rstd", &rstd, rows)?;
    same_device(op, x.0, g.0)?;
    same_device(op, x.0, rstd.0)?;
    if let Some(m) = &mean {
        check_len(op, "mean", m, rows)?;
        same_device(op, x.0, m.0)?;
    }
    if let Some(w) = &w {
        check_len(op, "weight", w, cols)?;
        same_device(op, x.0, w.0)?;
    }
    if let Some(a) = &dx_acc {
        check_len(op, "the accumulated gradient", a, rows * cols)?;
        same_device(op, x.0, a.0)?;
    }
    let dev = x.0.state();
    dev.bind()?;
    let xc = Contig::new(x, dtype)?;
    let gc = Contig::new(g, dtype)?;
    let mc = mean.map(|m| Contig::new(m, DType::F32)).transpose()?;
    let rc = Contig::new(rstd, DType::F32)?;
    let wc = w.map(|w| Contig::new(w, dtype)).transpose()?;
    let mp = mc.as_ref().map_or(0, Contig::ptr);
    let size = dtype.size_in_bytes();
    let wp = wc.as_ref().map_or(0, Contig::ptr);
    // Only dx reads the accumulated gradient.
    let ac = dx_acc
        .filter(|_| needs[0])
        .map(|a| Contig::new(a, dtype))
        .transpose()?;
    let ap = ac.as_ref().map_or(0, Contig::ptr);
    let (xp, gp) = (xc.ptr(), gc.ptr());
    if warp_rows(dtype, cols) && vectorized(dtype, cols, &[xp, gp, wp, ap]) {
        let ptrs = RowPtrs {
            mean: mp,
            w: wp,
            acc: ap,
        };
        return warp_backward(dev, op, &xc, &rc, &gc, ptrs, dtype, spec, needs).map(Some);
    }
    let dx = if needs[0] {
        let dx = alloc(dev, rows * cols * size)?;
        let vec = vectorized(dtype, cols, &[xp, gp, dx.device_ptr(), wp, ap]);
        let units = if vec { cols / (16 / size) } else { cols };
        let cache = cols <= CACHE_COLS;
        let mut a = Args::new();
        a.push(xc.ptr())
            .push(mp)
            .push(rc.ptr())
            .push(wp)
            .push(gc.ptr())
            .push(ap)
            .push(dx.device_ptr())
            .push(rows as u64)
            .push(cols as u64)
            .push(spec.centered as i32)
            .push(vec as i32)
            .push(cache as i32);
        let smem = if cache { cols * 8 } else { 0 };
        run(
            dev,
            op,
            Module::Norm,
            &["ln_bwd_dx", tname(dtype)],
            grid_rows(dev, rows),
            row_block(units),
            smem as u32,
            &mut a,
        )?;
        Some(dx)
    } else {
        None
    };
    let (dw, db) = if needs[1] || needs[2] {
        column_sums(
            dev,
            op,
            &xc,
            mp,
            &rc,
            &gc,
            dtype,
            spec,
            [needs[1], needs[2]],
        )?
    } else {
        (None, None)
    };
    Ok(Some((dx, dw, db)))
}

/// The optional operands of a backward's dx pass as device pointers (0 where absent): the row
/// means (layer norm), the weight, the gradient accumulated so far that dx adds.
struct RowPtrs {
    mean: u64,
    w: u64,
    acc: u64,
}

/// The backward of short vectorized rows ([`warp_rows`]): `ln_bwd_warp` writes `dx` and the
/// column partials of each chunk of rows in one pass over `g` and `x`, then `ln_bwd_cols_sum`
/// folds the partials (`norm.cu`).
#[allow(clippy::too_many_arguments)]
fn warp_backward(
    dev: &'static DeviceState,
    op: &'static str,
    xc: &Contig<'_>,
    rc: &Contig<'_>,
    gc: &Contig<'_>,
    ptrs: RowPtrs,
    dtype: DType,
    spec: NormSpec,
    needs: [bool; 3],
) -> Result<NormGrads<Buffer>> {
    let (rows, cols) = (spec.rows, spec.cols);
    let size = dtype.size_in_bytes();
    // Chunks of whole warps' rows, two blocks an SM: one wave of long-lived warps where the
    // registers allow two (f32 rows of up to 3 vectors a lane: `LN_BWD_MIN_BLOCKS` in
    // `norm.cu`), two waves elsewhere. Before the kernel prefetched rows, at the GPT's 16384
    // rows of 384 (H200, ncu) 2 blocks an SM took 27.7 + 4.1 µs with the fold, 1 took 42.8 +
    // 3.6, 4 took 29.4 + 5.3 and 8 took 32.4 + 7.4 (more blocks, more partials).
    let chunk = rows
        .div_ceil(dev.sm_count() as usize * 2)
        .next_multiple_of(8);
    // The vectors a lane holds: the instance whose registers fit the row.
    let lane_vecs = (cols / (16 / size)).div_ceil(32);
    let chunks = rows.div_ceil(chunk);
    let dx = needs[0]
        .then(|| alloc(dev, rows * cols * size))
        .transpose()?;
    let part_w = needs[1]
        .then(|| alloc(dev, chunks * cols * 4))
        .transpose()?;
    let part_b = needs[2]
        .then(|| alloc(dev, chunks * cols * 4))
        .transpose()?;
    let ptr = |b: &Option<Buffer>| b.as_ref().map_or(0, Buffer::device_ptr);
    let mut a = Args::new();
    a.push(xc.ptr())
        .push(ptrs.mean)
        .push(rc.ptr())
        .push(ptrs.w)
        .push(gc.ptr())
        .push(ptrs.acc)
        .push(ptr(&dx))
        .push(ptr(&part_w))
        .push(ptr(&part_b))
        .push(rows as u64)
        .push(cols as u64)
        .push(chunk as u64)
        .push(spec.centered as i32);
    let smem = (WARP_BLOCK as usize / 32) * cols * 4;
    run(
        dev,
        op,
        Module::Norm,
        &[WARP_BACKWARD[lane_vecs - 1], tname(dtype)],
        (chunks as u32, 1),
        WARP_BLOCK,
        smem as u32,
        &mut a,
    )?;
    if !(needs[1] || needs[2]) {
        return Ok((dx, None, None));
    }
    let (dw, db) = fold_partials(dev, op, &part_w, &part_b, dtype, chunks, cols, needs)?;
    Ok((dx, dw, db))
}

/// `dw = Σ_rows g x̂` and `db = Σ_rows g` where `want`: f32 partials per chunk of [`CHUNK`]
/// rows, then a fixed-order sum per column (deterministic, no atomics).
#[allow(clippy::too_many_arguments)]
fn column_sums(
    dev: &'static DeviceState,
    op: &'static str,
    xc: &Contig<'_>,
    mean_ptr: u64,
    rc: &Contig<'_>,
    gc: &Contig<'_>,
    dtype: DType,
    spec: NormSpec,
    want: [bool; 2],
) -> Result<(Option<Buffer>, Option<Buffer>)> {
    let (rows, cols) = (spec.rows, spec.cols);
    // Chunks of at least CHUNK rows, and few enough for the grid's y limit.
    let chunk = CHUNK.max(rows.div_ceil(65_535));
    let chunks = rows.div_ceil(chunk);
    let part_w = alloc(dev, chunks * cols * 4)?;
    let part_b = want[1].then(|| alloc(dev, chunks * cols * 4)).transpose()?;
    let mut a = Args::new();
    a.push(xc.ptr())
        .push(mean_ptr)
        .push(rc.ptr())
        .push(gc.ptr())
        .push(part_w.device_ptr())
        .push(part_b.as_ref().map_or(0, Buffer::device_ptr))
        .push(rows as u64)
        .push(cols as u64)
        .push(chunk as u64)
        .push(spec.centered as i32)
        .push(want[1] as i32);
    let f = dev.func(Module::Norm, &["ln_bwd_cols", tname(dtype)])?;
    let grid = [cols.div_ceil(32) as u32, chunks as u32, 1];
    dev.launch_3d(op, f, grid, [32, 8, 1], 0, a.ptrs())?;
    let needs = [false, want[0], want[1]];
    fold_partials(dev, op, &Some(part_w), &part_b, dtype, chunks, cols, needs)
}

/// `dw` / `db` (where `needs[1]` / `needs[2]`) from f32 partials `[chunks, cols]`, each column
/// added in a fixed order by `ln_bwd_cols_sum`. `part_w` is there whenever `dw` is wanted,
/// `part_b` whenever `db` is.
#[allow(clippy::too_many_arguments)]
fn fold_partials(
    dev: &'static DeviceState,
    op: &'static str,
    part_w: &Option<Buffer>,
    part_b: &Option<Buffer>,
    dtype: DType,
    chunks: usize,
    cols: usize,
    needs: [bool; 3],
) -> Result<(Option<Buffer>, Option<Buffer>)> {
    let size = dtype.size_in_bytes();
    let dw = needs[1].then(|| alloc(dev, cols * size)).transpose()?;
    let db = needs[2].then(|| alloc(dev, cols * size)).transpose()?;
    let mut a = Args::new();
    a.push(part_w.as_ref().map_or(0, Buffer::device_ptr))
        .push(part_b.as_ref().map_or(0, Buffer::device_ptr))
        .push(dw.as_ref().map_or(0, Buffer::device_ptr))
        .push(db.as_ref().map_or(0, Buffer::device_ptr))
        .push(chunks as u64)
        .push(cols as u64);
    // A block of 32 columns x 32 row lanes per 32 columns (norm.cu).
    let f = dev.func(Module::Norm, &["ln_bwd_cols_sum", tname(dtype)])?;
    dev.launch_3d(
        op,
        f,
        [cols.div_ceil(32) as u32, 1, 1],
        [32, 32, 1],
        0,
        a.ptrs(),
    )?;
    Ok((dw, db))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_the_float_dtypes_up_to_max_cols() {
        let spec = |cols| NormSpec {
            centered: true,
            eps: 1e-5,
            rows: 3,
            cols,
        };
        assert!(offered(DType::F32, &spec(1)));
        assert!(offered(DType::BF16, &spec(MAX_COLS)));
        assert!(!offered(DType::F16, &spec(MAX_COLS + 1)));
        assert!(!offered(DType::F64, &spec(384)));
        assert!(!offered(DType::F32, &spec(0)));
    }

    #[test]
    fn vector_path_needs_whole_vectors_and_alignment() {
        assert!(vectorized(DType::F32, 384, &[0, 256]));
        assert!(!vectorized(DType::F32, 1000 + 2, &[0, 256]));
        assert!(!vectorized(DType::BF16, 384, &[0, 258]));
        assert!(vectorized(DType::BF16, 1000, &[0, 16]));
        assert_eq!(row_block(1), 32);
        assert_eq!(row_block(96), 96);
        assert_eq!(row_block(8192), 256);
    }
}
