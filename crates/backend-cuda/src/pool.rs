//! The bookkeeping types of the device memory cache: freed blocks by (home stream, size), and
//! blocks waiting for other streams before they may be reused.
//!
//! # Why a module of its own
//!
//! The per-device state (`device/allocator.rs`) owns these containers, and the allocator
//! (`memory.rs`) fills and drains them through the device state's methods. Keeping the types
//! here, below both, lets `memory.rs` import `device/` without `device/` importing it back.
//! Plain data and size arithmetic: no driver call happens here.

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
/// two (1/16 above 32 MiB), so rounding wastes less than that step and similar sizes share
/// blocks. With eighths a GPT's `[16384, 1152]` f32 projection (72 MiB) took
/// an 80 MiB block, 8 MiB of every layer's saved activations (48 MiB of the model's 2.7 GiB
/// peak).
pub(crate) fn bucket(bytes: usize) -> usize {
    let pow2 = bytes.next_power_of_two();
    let step = (if pow2 > 32 << 20 { pow2 / 16 } else { pow2 / 8 }).max(512);
    bytes.next_multiple_of(step)
}

/// The private memory of one CUDA graph (`graph.rs`), like PyTorch's graph pools.
///
/// A captured graph replays its kernels on the addresses they had at capture, so every block
/// allocated during the capture belongs to the graph for as long as the graph or any tensor
/// holding one of its blocks lives: such a block must never be handed to work outside the
/// graph, which would then be overwritten by a replay. Blocks freed during the capture are
/// reused by later allocations of the same capture (the graph runs its kernels in the captured
/// order, so the reuse is as safe as on one stream); after the capture they stay here.
pub(crate) struct GraphPool {
    pub ordinal: usize,
    /// Freed blocks by size (bucketed like the block cache).
    pub free: std::sync::Mutex<kiln_core::fasthash::FastMap<usize, Vec<sys::CUdeviceptr>>>,
    /// Every block of the pool, `(ptr, bytes)`, released by `release` when the pool drops.
    pub blocks: std::sync::Mutex<Vec<(sys::CUdeviceptr, usize)>>,
    /// Buffers from outside the pool that the captured work reads or writes, held while the
    /// graph lives (type-erased: the allocator's buffer type lives above this module).
    /// Keyed by device address.
    pub keep: std::sync::Mutex<Kept>,
    /// Gives the blocks back to the driver (supplied by the allocator).
    pub release: fn(usize, &[(sys::CUdeviceptr, usize)]),
}

/// Buffers kept alive by a graph, by device address.
pub(crate) type Kept =
    kiln_core::fasthash::FastMap<sys::CUdeviceptr, std::sync::Arc<dyn std::any::Any + Send + Sync>>;

impl GraphPool {
    /// A freed block of exactly `bytes` (a bucket size), if the capture freed one.
    pub fn take(&self, bytes: usize) -> Option<sys::CUdeviceptr> {
        self.free.lock().unwrap().get_mut(&bytes)?.pop()
    }
    pub fn put(&self, bytes: usize, ptr: sys::CUdeviceptr) {
        self.free
            .lock()
            .unwrap()
            .entry(bytes)
            .or_default()
            .push(ptr);
    }
    /// Total bytes of the pool's blocks.
    pub fn bytes(&self) -> usize {
        self.blocks.lock().unwrap().iter().map(|b| b.1).sum()
    }
}

impl Drop for GraphPool {
    fn drop(&mut self) {
        let blocks = std::mem::take(&mut *self.blocks.lock().unwrap());
        (self.release)(self.ordinal, &blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_round_up_by_an_eighth_or_a_sixteenth() {
        assert_eq!(bucket(1), 512);
        assert_eq!(bucket(24 << 20), 24 << 20);
        assert_eq!(bucket((24 << 20) + 1), 28 << 20);
        assert_eq!(bucket(72 << 20), 72 << 20);
        assert_eq!(bucket((72 << 20) + 1), 80 << 20);
        assert_eq!(bucket(36 << 20), 36 << 20);
        for b in [1usize, 511, 513, 1 << 20, 5_505_024, 75_497_472, 1 << 31] {
            let r = bucket(b);
            let p = b.next_power_of_two();
            let step = if p > 32 << 20 { p / 16 } else { p / 8 };
            assert!(r >= b && r - b < step.max(512), "{b} -> {r}");
        }
    }
}
