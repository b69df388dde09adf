//! [`CudaStorage`]: what a tensor on a GPU holds — a computed buffer, or elementwise work that
//! has not run yet (`lazy.rs`). Every op that is not elementwise asks for the buffer, which
//! runs the pending work first.

use std::sync::Arc;

use kiln_core::Result;

use crate::device::{CudaDevice, DeviceState, state};
use crate::lazy::{self, Node};
use crate::memory::{Buffer, alloc, duplicate};

/// A tensor's storage on one GPU (untyped; the dtype lives in the tensor).
pub struct CudaStorage {
    repr: Repr,
}

pub(crate) enum Repr {
    Ready(Arc<Buffer>),
    Lazy(Arc<Node>),
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.is_pending() { ", pending" } else { "" };
        write!(
            f,
            "CudaStorage({} bytes on cuda:{}{what})",
            self.len_bytes(),
            self.state().ordinal
        )
    }
}

impl CudaStorage {
    pub(crate) fn ready(b: Buffer) -> Self {
        CudaStorage {
            repr: Repr::Ready(Arc::new(b)),
        }
    }
    pub(crate) fn pending(n: Arc<Node>) -> Self {
        CudaStorage {
            repr: Repr::Lazy(n),
        }
    }
    pub(crate) fn repr(&self) -> &Repr {
        &self.repr
    }

    /// An uninitialized buffer of `bytes` on `dev` (what `torch.empty` does).
    pub fn alloc(dev: &CudaDevice, bytes: usize) -> Result<CudaStorage> {
        alloc(state(dev)?, bytes).map(CudaStorage::ready)
    }
    /// Bytes held (for a computed buffer, its allocation: the request rounded up to the
    /// cache's bucket).
    pub fn len_bytes(&self) -> usize {
        match &self.repr {
            Repr::Ready(b) => b.len_bytes(),
            Repr::Lazy(n) => n.len_bytes(),
        }
    }
    pub fn device(&self) -> CudaDevice {
        self.state().device()
    }
    pub(crate) fn state(&self) -> &'static DeviceState {
        match &self.repr {
            Repr::Ready(b) => b.state(),
            Repr::Lazy(n) => n.state(),
        }
    }
    /// Whether this holds elementwise work that has not run yet.
    pub fn is_pending(&self) -> bool {
        match &self.repr {
            Repr::Ready(_) => false,
            Repr::Lazy(n) => !n.is_done(),
        }
    }
    /// Runs pending work, if any (one launch); the values are then in device memory.
    pub fn realize(&self) -> Result<()> {
        self.buffer().map(drop)
    }
    /// The raw device address (for interop and custom kernels), after running pending work.
    pub fn device_ptr(&self) -> Result<u64> {
        Ok(self.buffer()?.device_ptr())
    }

    /// The computed buffer, running pending work first, for work on the caller's current
    /// stream (noted on the buffer, so that it is not reused before that work has passed).
    pub(crate) fn buffer(&self) -> Result<Arc<Buffer>> {
        let b = match &self.repr {
            Repr::Ready(b) => b.clone(),
            Repr::Lazy(n) => lazy::force(n)?,
        };
        b.mark_used(b.state().stream());
        Ok(b)
    }

    /// The buffer for an in-place write: computed, and held by nothing else (a pending node
    /// that still reads it gets the old contents, in a copy made here).
    pub(crate) fn buffer_mut(&mut self) -> Result<&Buffer> {
        if let Repr::Lazy(n) = &self.repr {
            self.repr = Repr::Ready(lazy::force(n)?);
        }
        let Repr::Ready(b) = &mut self.repr else {
            unreachable!("made ready above")
        };
        if Arc::get_mut(b).is_none() {
            *b = Arc::new(duplicate(b)?);
        }
        b.contents_changed();
        b.mark_used(b.state().stream());
        Ok(b)
    }
}
