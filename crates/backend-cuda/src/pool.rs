//! The bookkeeping types of the device memory cache: freed blocks by (home stream, size), and
//! blocks waiting for other streams before they may be reused.
//!
//! # Why a module of its own
//!
//! The per-device state (`device.rs`) owns these containers, and the allocator (`memory.rs`)
//! fills and drains them through the device state. Keeping the types here, below both, lets
//! `memory.rs` import `device.rs` without `device.rs` importing it back. Plain data and size
//! arithmetic: no driver call happens here.

use cudarc::driver::sys;

/// Freed blocks kept for reuse, by (home stream, block size).
#[derive(Default)]
pub(crate) struct BlockCache {
    pub free: kiln_core::fasthash::FastMap<(usize, usize), Vec<sys::CUdeviceptr>>,
    /// Total bytes in `free`.
    pub bytes: usize,
}

impl BlockCache {
    pub fn put(&mut self, stream: usize, bytes: usize, ptr: sys::CUdeviceptr) {
        self.bytes += bytes;
        self.free.entry((stream, bytes)).or_default().push(ptr);
    }
}

/// A block freed while streams other than the one it was allocated on may still use it: it
/// returns to the cache once every event (one per such stream) has completed.
pub(crate) struct DeferredFree {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    pub stream: sys::CUstream,
    pub events: Vec<sys::CUevent>,
}
// SAFETY: raw driver handles, valid from any thread.
unsafe impl Send for DeferredFree {}

/// The cache bucket of a request: a multiple of 512 bytes and of 1/8 of the request's power of
/// two, so rounding wastes at most 12.5% and similar sizes share blocks.
pub(crate) fn bucket(bytes: usize) -> usize {
    let step = (bytes.next_power_of_two() / 8).max(512);
    bytes.next_multiple_of(step)
}
