//! A stand-in for a GPU backend's pinned pool, for tests on machines without a GPU (feature
//! `testing`): ordinary 256-byte-aligned heap memory, zeroed, with a count of the live bytes.
//! It lets CI exercise the host side of pinned tensors and pinned uploads.

use std::alloc::Layout as AllocLayout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::host::{PinnedAllocator, register_pinned_allocator};
use crate::{Error, Result};

/// The stand-in allocator. Requests above 1 TiB fail with [`Error::OutOfMemory`], as a real
/// pool does when the system cannot lock that much.
pub struct HeapPinned {
    live: AtomicUsize,
}

impl HeapPinned {
    /// Bytes in live blocks.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

fn layout(bytes: usize) -> AllocLayout {
    AllocLayout::from_size_align(bytes, 256).expect("a valid size")
}

impl PinnedAllocator for HeapPinned {
    fn name(&self) -> &'static str {
        "heap stand-in for pinned memory"
    }
    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>> {
        if bytes > 1 << 40 {
            return Err(Error::OutOfMemory {
                device: "pinned host memory (test stand-in)".into(),
                requested: bytes,
                held: self.live(),
                msg: "over the stand-in's 1 TiB limit".into(),
            });
        }
        // SAFETY: a non-zero size (PinnedBlock never asks for 0 bytes); zeroed, since the
        // trait promises initialized bytes.
        let p = unsafe { std::alloc::alloc_zeroed(layout(bytes)) };
        let p = NonNull::new(p).ok_or_else(|| Error::OutOfMemory {
            device: "pinned host memory (test stand-in)".into(),
            requested: bytes,
            held: self.live(),
            msg: "the heap refused".into(),
        })?;
        self.live.fetch_add(bytes, Ordering::Relaxed);
        Ok(p)
    }
    unsafe fn release(&self, ptr: NonNull<u8>, bytes: usize) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
        // SAFETY: allocated above with this size and alignment (the caller's contract).
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout(bytes)) };
    }
}

/// The stand-in, registered as the process's pinned allocator on first call (unless a real
/// one was registered first: then that one serves, and this returns the unused stand-in).
pub fn register() -> &'static HeapPinned {
    static POOL: HeapPinned = HeapPinned {
        live: AtomicUsize::new(0),
    };
    register_pinned_allocator(&POOL);
    &POOL
}
