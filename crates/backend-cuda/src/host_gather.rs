//! Rows of page-locked host arrays gathered on the GPU: the DataLoader's path for a pinned
//! dataset ([`kiln_core::Backend::gather_host_rows`]).
//!
//! # Why
//!
//! The host-side loader gathers each batch's rows into a pinned block with a pool of threads
//! and then copies the block by DMA: for a 784-100-100-10 MLP at batch 1000 on an H200 that is
//! ~30 GB/s of host memory traffic beside the training thread, and the prefetching epoch ran
//! 1.08–1.12× the compute-only one with no host call left to blame (BENCHMARKS.md, ninth
//! session). Here the host writes only the row numbers; one kernel on the copy stream reads
//! each row once over the bus and writes it to device memory (DGL's "UVA sampling" does the
//! same for graph features).
//!
//! # Ordering
//!
//! As for a pinned upload (`transfer::upload_pinned`): the sources and the row numbers stay in
//! the device's in-flight list until the kernel's event completes, and each new buffer's first
//! use on a stream waits for that event.

use std::sync::Arc;

use kiln_core::{Error, HostRows, PinnedBlock, Result};

use crate::compile::Module;
use crate::device::{DeviceState, InFlight, SharedEvent, set_current_stream};
use crate::memory::{Buffer, alloc_on};
use crate::pinned;

const OP: &str = "gather_host_rows";

/// One array's arguments (`GatherArray` in `kernels/util.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GatherArray {
    src: u64,
    dst: u64,
    row_words: u64,
    word: u32,
    per_block: u32,
}

/// Rows per tile at most (`GATHER_TILE` in the kernel).
const TILE: usize = 1024;
/// Threads per block.
const BLOCK: u32 = 256;
/// Blocks at most: enough reads in flight to move a batch well within a training step
/// (32 × 256 threads, 16 bytes each), few enough to leave the multiprocessors to the step.
const MAX_BLOCKS: usize = 32;

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

/// Rows per tile: at least four words per thread of a block, at most [`TILE`].
fn rows_per_tile(row_words: usize) -> usize {
    (4 * BLOCK as usize)
        .div_ceil(row_words.max(1))
        .clamp(1, TILE)
}

/// Checks `srcs` and `rows` (typed errors naming the op).
fn check(srcs: &[HostRows], rows: &[usize]) -> Result<()> {
    if rows.len() > u32::MAX as usize {
        return Err(Error::invalid(
            OP,
            format!("{} rows at once (at most 2^32 - 1)", rows.len()),
        ));
    }
    for (k, s) in srcs.iter().enumerate() {
        let size = s.dtype.size_in_bytes();
        if s.row_bytes == 0 || !s.row_bytes.is_multiple_of(size) {
            return Err(Error::invalid(
                OP,
                format!(
                    "array {k}: a row of {} bytes is not a whole number of {} elements",
                    s.row_bytes, s.dtype
                ),
            ));
        }
        if !s.block.is_empty() && !pinned::is_pinned(s.block.as_ptr(), s.block.len()) {
            return Err(Error::invalid(
                OP,
                format!("array {k} is not in this process's page-locked (pinned) memory"),
            ));
        }
        let n = s.rows();
        if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
            return Err(Error::invalid(
                OP,
                format!("row {bad} requested of array {k}, which has {n} rows"),
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
        .map(|s| alloc_on(dev, rows.len() * s.row_bytes, dev.copy))
        .collect::<Result<Vec<_>>>()?;
    if rows.is_empty() || srcs.is_empty() {
        for b in &bufs {
            b.note_stream(user);
        }
        return Ok(bufs);
    }
    let mut idx = PinnedBlock::uninit(OP, rows.len() * 4)?;
    for (d, &r) in idx.as_bytes_mut().chunks_exact_mut(4).zip(rows) {
        d.copy_from_slice(&(r as u32).to_ne_bytes());
    }
    let f = dev.func(Module::Util, &["gather", "rows"])?;
    let arrays: Vec<GatherArray> = srcs
        .iter()
        .zip(&bufs)
        .map(|(s, b)| {
            let (src, dst) = (s.block.as_ptr() as u64, b.device_ptr());
            let word = word_size(s.row_bytes, src, dst);
            let row_words = s.row_bytes / word as usize;
            GatherArray {
                src,
                dst,
                row_words: row_words as u64,
                word,
                per_block: rows_per_tile(row_words) as u32,
            }
        })
        .collect();
    let prev = set_current_stream(dev.ordinal, dev.copy);
    let launched = (|| {
        for pair in arrays.chunks(2) {
            let (a0, a1) = (pair[0], pair.get(1).copied().unwrap_or_default());
            let tiles = pair
                .iter()
                .map(|a| rows.len().div_ceil(a.per_block as usize))
                .max()
                .unwrap_or(1);
            let mut rows_ptr = idx.as_ptr() as u64;
            let mut n = rows.len() as u32;
            let (mut a0, mut a1) = (a0, a1);
            let mut p = [
                &mut rows_ptr as *mut u64 as *mut std::ffi::c_void,
                &mut n as *mut u32 as *mut std::ffi::c_void,
                &mut a0 as *mut GatherArray as *mut std::ffi::c_void,
                &mut a1 as *mut GatherArray as *mut std::ffi::c_void,
            ];
            let grid = [tiles.min(MAX_BLOCKS) as u32, pair.len() as u32, 1];
            dev.launch_3d(OP, f, grid, [BLOCK, 1, 1], 0, &mut p)?;
        }
        Ok(())
    })();
    set_current_stream(dev.ordinal, prev);
    launched?;
    let event = Arc::new(SharedEvent::record(dev, dev.copy, OP)?);
    let mut owners: Vec<Arc<dyn std::any::Any + Send + Sync>> =
        srcs.iter().map(|s| s.block.clone() as _).collect();
    owners.push(Arc::new(idx));
    dev.in_flight.lock().unwrap().push_back(InFlight {
        event: event.clone(),
        _owner: Arc::new(owners),
    });
    for (b, s) in bufs.iter().zip(srcs) {
        b.note_stream(user);
        b.set_pending(event.clone());
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
    fn words_divide_the_row_and_both_addresses() {
        assert_eq!(word_size(3136, 4096, 256), 16);
        assert_eq!(word_size(8, 4096, 256), 8);
        assert_eq!(word_size(8, 4096 + 4, 256), 4);
        assert_eq!(word_size(3, 4096, 256), 1);
    }

    #[test]
    fn tiles_hold_four_words_a_thread_within_the_kernel_tile() {
        assert_eq!(rows_per_tile(196), 6); // MNIST rows of 16-byte words
        assert_eq!(rows_per_tile(1), TILE); // labels
        assert_eq!(rows_per_tile(100_000), 1);
    }
}
