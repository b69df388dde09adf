//! The allocator's per-device state: the driver's stream-ordered pool, the host-side cache of
//! freed blocks, blocks waiting for other streams, and the byte counts. The policy (when to
//! cache, defer, trim, retry) lives in `memory.rs`, which calls these methods.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys;

use crate::pool::{BlockCache, DeferredFree};

pub(crate) struct Allocator {
    /// The device's default stream-ordered pool (its release threshold raised at creation).
    pool: sys::CUmemoryPool,
    block_cache: Mutex<BlockCache>,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    /// Blocks waiting for other streams before they can be reused (see `memory.rs`).
    deferred_frees: Mutex<Vec<DeferredFree>>,
    deferred_count: AtomicUsize,
}

impl Allocator {
    pub(super) fn new(pool: sys::CUmemoryPool) -> Self {
        Allocator {
            pool,
            block_cache: Mutex::new(Default::default()),
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            deferred_frees: Mutex::new(Vec::new()),
            deferred_count: AtomicUsize::new(0),
        }
    }

    /// The device's default memory pool.
    pub fn pool(&self) -> sys::CUmemoryPool {
        self.pool
    }

    /// Bytes of device memory held by live buffers.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    /// The most [`Allocator::in_use`] since creation or [`Allocator::reset_peak`].
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Resets the peak to the current use.
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use(), Ordering::Relaxed);
    }

    /// Counts `bytes` handed to a buffer (raising the peak).
    pub fn grew(&self, bytes: usize) {
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Counts `bytes` given back by a buffer.
    pub fn shrank(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Caches a freed block of `bytes` whose home is `stream` (an address).
    pub fn cache_put(&self, stream: usize, bytes: usize, ptr: sys::CUdeviceptr) {
        self.block_cache.lock().unwrap().put(stream, bytes, ptr);
    }

    /// A cached block of exactly `bytes` (a bucket size) whose home is `stream`, if any.
    pub fn cache_take(&self, stream: usize, bytes: usize) -> Option<sys::CUdeviceptr> {
        let mut c = self.block_cache.lock().unwrap();
        let p = c.free.get_mut(&(stream, bytes)).and_then(|v| v.pop())?;
        c.bytes -= bytes;
        Some(p)
    }

    /// Empties the cache: every block, with its home stream, for the caller to free.
    pub fn cache_drain(&self) -> Vec<(usize, sys::CUdeviceptr)> {
        let mut c = self.block_cache.lock().unwrap();
        c.bytes = 0;
        c.free
            .drain()
            .flat_map(|((s, _), v)| v.into_iter().map(move |p| (s, p)))
            .collect()
    }

    /// Queues a block that must wait for other streams before it returns to the cache.
    pub fn defer(&self, d: DeferredFree) {
        self.deferred_frees.lock().unwrap().push(d);
        self.deferred_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether any block waits (a lock-free check before [`Allocator::sweep_deferred`]).
    pub fn has_deferred(&self) -> bool {
        self.deferred_count.load(Ordering::Relaxed) > 0
    }

    /// Moves the waiting blocks for which `done` holds into the cache, giving each one's
    /// events to `recycle`.
    pub fn sweep_deferred(
        &self,
        mut done: impl FnMut(&DeferredFree) -> bool,
        mut recycle: impl FnMut(sys::CUevent),
    ) {
        let mut list = self.deferred_frees.lock().unwrap();
        let mut i = 0;
        while i < list.len() {
            if done(&list[i]) {
                let d = list.swap_remove(i);
                for e in d.events {
                    recycle(e);
                }
                self.cache_put(d.stream as usize, d.bytes, d.ptr);
                self.deferred_count.fetch_sub(1, Ordering::Relaxed);
            } else {
                i += 1;
            }
        }
    }
}
