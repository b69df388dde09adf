//! Rows of page-locked host arrays gathered on the GPU: the DataLoader's path for a pinned
//! dataset ([`kiln_core::Backend::gather_host_rows`], [`kiln_core::Backend::copy_host_rows`]).
//!
//! # Why
//!
//! The host-side loader gathers each batch's rows into a pinned block with a pool of threads
//! and then copies the block by DMA: for a 784-100-100-10 MLP at batch 1000 on an H200 that is
//! ~30 GB/s of host memory traffic beside the training thread, and the prefetching epoch ran
//! 1.08–1.12× the compute-only one with no host call left to blame (BENCHMARKS.md, ninth
//! session). Here the host writes only the row numbers (copied to the device by one small
//! DMA); one kernel on the copy stream reads each row once over the bus and writes it to
//! device memory (DGL's "UVA sampling" does the same for graph features). Bytes decoded to
//! f32 on the way (`HostRows::bytes_over`) cut the bus traffic of MNIST-like pixels by four.
//!
//! Consecutive rows (an epoch in order) take [`copy_host_rows`] instead: one DMA of each
//! range on a copy engine, and the bytes decoded by a small kernel queued after it on the copy
//! stream, so neither the bus reads nor the decode run on the training step's stream.
//!
//! # Measured (H200, 2026-11-26; BENCHMARKS.md, tenth session)
//!
//! A 1000-row batch of MNIST-shaped f32 rows takes ~66 µs (~47 GB/s, the bus's rate), of
//! pixel bytes ~25 µs. The kernel runs beside the training step, and how many blocks it has
//! decides how much it slows the step: with 132 blocks (one per multiprocessor) the
//! prefetching epoch of a 784-100-100-10 MLP at batch 1000 was 1.31–1.41× the compute-only
//! one, with 16 blocks 1.07–1.11, with 8 the gather itself was too slow (1.17). A first
//! version that staged row numbers in shared memory was worse still (1.35 at 64 blocks): a
//! block holding shared memory can keep a multiprocessor in a configuration the step's
//! kernels do not fit.
//!
//! # Ordering
//!
//! As for a pinned upload (`transfer::upload_pinned`): the sources and the row numbers stay in
//! the device's in-flight list until the kernel's event completes, and each new buffer's first
//! use on a stream waits for that event.

use std::sync::{Arc, OnceLock};

use kiln_core::{Error, HostRows, PinnedBlock, Result};

use crate::device::{DeviceState, set_current_stream};
use crate::launch::Args;
use crate::memory::{Buffer, alloc_on};
use crate::pinned;
use crate::sources::Module;
use crate::transfer::{dma_to_device, hand_over};

const OP: &str = "gather_host_rows";

/// One array's arguments (`GatherArray` in `kernels/util.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GatherArray {
    src: u64,
    dst: u64,
    row_words: u64,
    word: u32,
    decode: u32,
    div: f32,
    pad: u32,
}

/// Threads per block.
const BLOCK: u32 = 256;
/// Blocks at most (`KILN_GATHER_BLOCKS` overrides it): enough reads in flight to move a
/// batch well within a training step, few enough to leave the multiprocessors to the step.
fn max_blocks() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    blocks_from_env(&N, "KILN_GATHER_BLOCKS")
}

/// Blocks at most of the decode after a copy (`KILN_DECODE_BLOCKS` overrides it).
fn decode_blocks() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    blocks_from_env(&N, "KILN_DECODE_BLOCKS")
}

/// A positive block count from `var`, else 16; read once into `cell`.
fn blocks_from_env(cell: &'static OnceLock<usize>, var: &str) -> usize {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(16)
    })
}

/// The largest word (16, 8, 4 or 1 bytes) that divides `row_bytes` and both addresses.
fn word_size(row_bytes: usize, src: u64, dst: u64) -> u32 {
    [16u32, 8, 4]
        .into_iter()
        .find(|&w| {
            let w64 = w as u64;
            row_bytes.is_multiple_of(w as usize)
                && src.is_multiple_of(w64)
                && dst.is_multiple_of(w64)
        })
        .unwrap_or(1)
}

/// Checks `srcs` and `rows` (typed errors naming the op).
fn check(srcs: &[HostRows], rows: &[usize]) -> Result<()> {
    // One pass for the largest row number; the offending one is looked for only on error.
    let max = rows.iter().copied().max();
    if let Some(m) = max.filter(|&m| m > u32::MAX as usize) {
        return Err(Error::invalid(
            OP,
            format!("row {m}: row numbers go to the device as 32-bit integers"),
        ));
    }
    if rows.len() > u32::MAX as usize {
        return Err(Error::invalid(
            OP,
            format!("{} rows at once (at most 2^32 - 1)", rows.len()),
        ));
    }
    check_arrays(OP, srcs)?;
    for (k, s) in srcs.iter().enumerate() {
        let n = s.rows();
        if max.is_some_and(|m| m >= n)
            && let Some(&bad) = rows.iter().find(|&&r| r >= n)
        {
            return Err(Error::invalid(
                OP,
                format!("row {bad} requested of array {k}, which has {n} rows"),
            ));
        }
    }
    Ok(())
}

/// Checks what `op` needs of every array: whole elements a row, a valid decode, page-locked.
fn check_arrays(op: &'static str, srcs: &[HostRows]) -> Result<()> {
    for (k, s) in srcs.iter().enumerate() {
        let size = s.stored_size();
        if s.row_bytes == 0 || !s.row_bytes.is_multiple_of(size) {
            return Err(Error::invalid(
                op,
                format!(
                    "array {k}: a row of {} bytes is not a whole number of {} elements",
                    s.row_bytes, s.dtype
                ),
            ));
        }
        if let Some(d) = s.bytes_over
            && (s.dtype != kiln_core::DType::F32 || !d.is_finite() || d == 0.0)
        {
            return Err(Error::invalid(
                op,
                format!(
                    "array {k}: bytes decode to f32 by a finite, non-zero divisor (got {} and \
                     {d})",
                    s.dtype
                ),
            ));
        }
        if !s.block.is_empty() && !pinned::is_pinned(s.block.as_ptr(), s.block.len()) {
            return Err(Error::invalid(
                op,
                format!("array {k} is not in this process's page-locked (pinned) memory"),
            ));
        }
    }
    Ok(())
}

/// New buffers on `dev` holding rows `rows` of each of `srcs`, gathered by one kernel on the
/// copy stream (see the module docs for the ordering).
pub(crate) fn gather_host_rows(
    dev: &'static DeviceState,
    srcs: &[HostRows],
    rows: &[usize],
) -> Result<Vec<Buffer>> {
    dev.refuse_in_capture(OP, "reading host memory")?;
    check(srcs, rows)?;
    dev.bind()?;
    let user = dev.stream();
    dev.sweep_in_flight();
    let bufs = srcs
        .iter()
        .map(|s| alloc_on(dev, rows.len() * s.out_row_bytes(), dev.copy_stream()))
        .collect::<Result<Vec<_>>>()?;
    if rows.is_empty() || srcs.is_empty() {
        for b in &bufs {
            b.note_stream(user);
        }
        return Ok(bufs);
    }
    let mut idx = PinnedBlock::uninit(OP, rows.len() * 4)?;
    // A pinned block is 256-byte aligned: u32s in place (a loop the compiler vectorizes).
    let words: &mut [u32] = bytemuck::cast_slice_mut(idx.as_bytes_mut());
    for (d, &r) in words.iter_mut().zip(rows) {
        *d = r as u32; // `check` made sure it fits
    }
    // The row numbers go to device memory first (one small DMA): every thread reads the number
    // of the row its words belong to, which over the bus would be one more read per word.
    let idx_dev = alloc_on(dev, idx.len(), dev.copy_stream())?;
    // SAFETY: `idx` is page-locked and kept alive (in-flight list, below) until the copy
    // stream passes the copy; the range is `idx_dev`'s.
    unsafe { dma_to_device(dev, idx_dev.device_ptr(), idx.as_bytes()) }?;
    let f = dev.func(Module::Util, &["gather", "rows"])?;
    let arrays: Vec<GatherArray> = srcs
        .iter()
        .zip(&bufs)
        .map(|(s, b)| {
            let (src, dst) = (s.block.as_ptr() as u64, b.device_ptr());
            // Decoded bytes go 16, 4 or 1 at a time (four float4s, one float4 or one float
            // out; the output is 16-byte aligned wherever the input word is: device buffers
            // are, and rows scale by 4).
            let word = match (s.bytes_over, word_size(s.row_bytes, src, dst)) {
                (Some(_), 8) => 4,
                (_, w) => w,
            };
            let row_words = s.row_bytes / word as usize;
            GatherArray {
                src,
                dst,
                row_words: row_words as u64,
                word,
                decode: s.bytes_over.is_some() as u32,
                div: s.bytes_over.unwrap_or(1.0),
                pad: 0,
            }
        })
        .collect();
    let prev = set_current_stream(dev.ordinal(), dev.copy_stream());
    let launched = (|| {
        for pair in arrays.chunks(2) {
            // Four words a thread per pass of the grid (the kernel's reads in flight).
            let words = pair
                .iter()
                .map(|a| rows.len() * a.row_words as usize)
                .max()
                .unwrap_or(1);
            let blocks = words.div_ceil(4 * BLOCK as usize).max(1);
            let mut args = Args::new();
            args.push(idx_dev.device_ptr())
                .push(rows.len() as u32)
                .push(pair[0])
                .push(pair.get(1).copied().unwrap_or_default());
            let grid = [blocks.min(max_blocks()) as u32, pair.len() as u32, 1];
            dev.launch_3d(OP, f, grid, [BLOCK, 1, 1], 0, args.ptrs())?;
        }
        Ok(())
    })();
    set_current_stream(dev.ordinal(), prev);
    launched?;
    // `idx_dev` is freed on the copy stream, after the kernel that reads it (the pool reuses
    // it in stream order).
    drop(idx_dev);
    let mut owners: Vec<Arc<dyn std::any::Any + Send + Sync>> =
        srcs.iter().map(|s| s.block.clone() as _).collect();
    owners.push(Arc::new(idx));
    hand_over(dev, user, &bufs, owners, OP)?;
    for (b, s) in bufs.iter().zip(srcs) {
        if let Some(bound) = s.id_bound {
            b.mark_all_ids_below(bound);
        }
    }
    Ok(bufs)
}

const COPY_OP: &str = "copy_host_rows";

/// New buffers on `dev` holding rows `rows` (consecutive) of each of `srcs`: one DMA of each
/// range on the copy stream, and for bytes decoded to f32 one `decode_bytes` kernel after it on
/// the same stream (see the module docs for the ordering; [`kiln_core::Backend::copy_host_rows`]).
///
/// Why not the gather kernel: over consecutive rows a DMA moves the bytes on a copy engine,
/// where the kernel would hold multiprocessors for as long as the bus takes, and decoding on
/// the copy stream keeps the decode (and the host's scan of labels, whose bound the dataset
/// knows) off the training step's stream.
pub(crate) fn copy_host_rows(
    dev: &'static DeviceState,
    srcs: &[HostRows],
    rows: std::ops::Range<usize>,
) -> Result<Vec<Buffer>> {
    dev.refuse_in_capture(COPY_OP, "copying host memory")?;
    check_arrays(COPY_OP, srcs)?;
    if rows.start > rows.end {
        return Err(Error::invalid(
            COPY_OP,
            format!("rows {rows:?}: the range is inverted"),
        ));
    }
    for (k, s) in srcs.iter().enumerate() {
        if rows.end > s.rows() {
            return Err(Error::invalid(
                COPY_OP,
                format!(
                    "rows {rows:?} requested of array {k}, which has {} rows",
                    s.rows()
                ),
            ));
        }
    }
    let n = rows.end - rows.start;
    dev.bind()?;
    let user = dev.stream();
    dev.sweep_in_flight();
    let bufs = srcs
        .iter()
        .map(|s| alloc_on(dev, n * s.out_row_bytes(), dev.copy_stream()))
        .collect::<Result<Vec<_>>>()?;
    // Bytes to decode: (staged bytes on the device, output, divisor).
    let mut staged = Vec::new();
    for (s, b) in srcs.iter().zip(&bufs) {
        let bytes = &s.block.as_bytes()[rows.start * s.row_bytes..][..n * s.row_bytes];
        if bytes.is_empty() {
            continue;
        }
        let raw = match s.bytes_over {
            Some(d) => Some((alloc_on(dev, bytes.len(), dev.copy_stream())?, d)),
            None => None,
        };
        let to = raw.as_ref().map_or(b.device_ptr(), |(r, _)| r.device_ptr());
        // SAFETY: `bytes` lie in the page-locked block `s.block`, kept alive (in-flight list,
        // below) until the copy stream passes the copy; `to` is a buffer of `bytes.len()`
        // bytes (the staging buffer, or the output when nothing is decoded).
        unsafe { dma_to_device(dev, to, bytes) }?;
        if let Some((r, d)) = raw {
            staged.push((r, b.device_ptr(), bytes.len(), d));
        }
    }
    if !staged.is_empty() {
        let f = dev.func(Module::Util, &["decode", "bytes"])?;
        let prev = set_current_stream(dev.ordinal(), dev.copy_stream());
        let launched = staged.iter().try_for_each(|(src, dst, len, div)| {
            let (src, dst) = (src.device_ptr(), *dst);
            // 16 bytes a thread where both addresses allow it (device buffers are aligned).
            let words = match src % 16 == 0 && dst % 16 == 0 {
                true => len / 16,
                false => 0,
            };
            // Four words a thread per pass of the grid (the kernel's loads in flight).
            let blocks = words.div_ceil(4).max(len - 16 * words);
            let blocks = blocks.div_ceil(BLOCK as usize).max(1);
            let mut args = Args::new();
            args.push(src)
                .push(dst)
                .push(*len as u64)
                .push(words as u64)
                .push(*div);
            let grid = [blocks.min(decode_blocks()) as u32, 1, 1];
            dev.launch_3d(COPY_OP, f, grid, [BLOCK, 1, 1], 0, args.ptrs())
        });
        set_current_stream(dev.ordinal(), prev);
        launched?;
    }
    // The staged bytes are freed on the copy stream, after the kernels that read them.
    drop(staged);
    let owners = srcs.iter().map(|s| s.block.clone() as _).collect();
    hand_over(dev, user, &bufs, owners, COPY_OP)?;
    for (b, s) in bufs.iter().zip(srcs) {
        if let Some(bound) = s.id_bound {
            b.mark_all_ids_below(bound);
        }
    }
    Ok(bufs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_struct_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<GatherArray>(), 40);
    }

    #[test]
    fn words_divide_the_row_and_both_addresses() {
        assert_eq!(word_size(3136, 4096, 256), 16);
        assert_eq!(word_size(8, 4096, 256), 8);
        assert_eq!(word_size(8, 4096 + 4, 256), 4);
        assert_eq!(word_size(3, 4096, 256), 1);
    }
}
