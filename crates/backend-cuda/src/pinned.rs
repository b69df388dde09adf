//! Page-locked host memory: the pool behind pinned CPU tensors (`Tensor::pin_memory`).
//!
//! Page-locking is slow (the driver pins every page: milliseconds for a few MiB), so freed
//! blocks are cached by size bucket and reused, as CuPy's `PinnedMemoryPool` does. Blocks are
//! allocated `PORTABLE` (usable with every GPU's context) through device 0's context. The pool
//! is registered with kiln-core as the process's [`PinnedAllocator`] as soon as a GPU is found
//! (`device::driver_info`), so the CPU backend can place tensors in it.
//!
//! The pool also answers "is this host range page-locked?" ([`is_pinned`]): a copy from or into
//! such a range is direct DMA instead of going through the staging ring.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Mutex;

use cudarc::driver::sys::{self, CUresult};
use kiln_core::{Error, PinnedAllocator, Result};

use crate::device::state;
use crate::pool::bucket;
use crate::types::CudaDevice;

/// Memory held by the pinned pool, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// In live pinned tensors.
    pub in_use: usize,
    /// Highest `in_use` so far.
    pub peak: usize,
    /// Freed and kept for reuse ([`empty_pinned_cache`] gives it back).
    pub cached: usize,
}

#[derive(Default)]
struct Pool {
    /// Cached blocks by bucket size (addresses).
    free: BTreeMap<usize, Vec<usize>>,
    /// Every block the pool holds, live or cached: address → bucket size.
    blocks: BTreeMap<usize, usize>,
    stats: PinnedStats,
}

pub(crate) struct PinnedPool {
    pool: Mutex<Pool>,
}

pub(crate) static PINNED: PinnedPool = PinnedPool {
    pool: Mutex::new(Pool {
        free: BTreeMap::new(),
        blocks: BTreeMap::new(),
        stats: PinnedStats {
            in_use: 0,
            peak: 0,
            cached: 0,
        },
    }),
};

impl PinnedAllocator for PinnedPool {
    fn name(&self) -> &'static str {
        "cuda pinned pool"
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>> {
        let size = bucket(bytes);
        let mut p = self.pool.lock().unwrap();
        if let Some(ptr) = p.free.get_mut(&size).and_then(|v| v.pop()) {
            p.stats.cached -= size;
            p.stats.in_use += size;
            p.stats.peak = p.stats.peak.max(p.stats.in_use);
            return Ok(NonNull::new(ptr as *mut u8).expect("cached blocks are not null"));
        }
        drop(p);
        state(&CudaDevice::new(0))?;
        let mut h = std::ptr::null_mut();
        // SAFETY: valid out-pointer; device 0's context is current (bound by `state`).
        let mut r = unsafe { sys::cuMemHostAlloc(&mut h, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            empty_pinned_cache();
            // SAFETY: as above.
            r = unsafe { sys::cuMemHostAlloc(&mut h, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
        }
        let mut p = self.pool.lock().unwrap();
        match r {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(Error::OutOfMemory {
                    device: "pinned host memory".into(),
                    requested: bytes,
                    held: p.stats.in_use + p.stats.cached,
                    msg: "the system could not page-lock that much memory".into(),
                });
            }
            e => {
                return Err(Error::backend(
                    "pin_memory",
                    format!("{e:?} ({bytes} bytes)"),
                ));
            }
        }
        p.blocks.insert(h as usize, size);
        p.stats.in_use += size;
        p.stats.peak = p.stats.peak.max(p.stats.in_use);
        Ok(NonNull::new(h as *mut u8).expect("cuMemHostAlloc succeeded"))
    }

    unsafe fn release(&self, ptr: NonNull<u8>, bytes: usize) {
        let size = bucket(bytes);
        let mut p = self.pool.lock().unwrap();
        p.stats.in_use -= size;
        p.stats.cached += size;
        p.free.entry(size).or_default().push(ptr.as_ptr() as usize);
    }
}

/// What the pinned pool holds.
pub fn pinned_memory_stats() -> PinnedStats {
    PINNED.pool.lock().unwrap().stats
}

/// Gives the cached (freed) page-locked blocks back to the system.
pub fn empty_pinned_cache() {
    let blocks: Vec<usize> = {
        let mut p = PINNED.pool.lock().unwrap();
        let blocks: Vec<usize> = std::mem::take(&mut p.free)
            .into_values()
            .flatten()
            .collect();
        for b in &blocks {
            p.blocks.remove(b);
        }
        p.stats.cached = 0;
        blocks
    };
    for b in blocks {
        // SAFETY: each block came from cuMemHostAlloc and is owned by the cache alone; a
        // freed pinned tensor's copies are done (its storage was kept alive until then).
        unsafe { sys::cuMemFreeHost(b as *mut c_void) };
    }
}

/// Whether `ptr..ptr+len` lies inside one block of the pinned pool.
pub(crate) fn is_pinned(ptr: *const u8, len: usize) -> bool {
    let a = ptr as usize;
    let p = PINNED.pool.lock().unwrap();
    p.blocks
        .range(..=a)
        .next_back()
        .is_some_and(|(&start, &size)| a + len <= start + size)
}

/// Registers the pool with kiln-core (once; called when a GPU is found).
pub(crate) fn register() {
    kiln_core::host::register_pinned_allocator(&PINNED);
}
