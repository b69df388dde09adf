//! [`CudaStorage`]: what a tensor on a GPU holds — a computed buffer, or elementwise work that
//! has not run yet (`lazy.rs`). Every op that is not elementwise asks for the buffer, which
//! runs the pending work first.
//!
//! The representation and its forcing belong to the deferral layer (`lazy::Repr`); this is
//! the public handle above it, so that layer never names the storage type.

use std::sync::Arc;

use kiln_core::Result;

use crate::device::{DeviceState, state};
use crate::lazy::{Node, Repr};
use crate::memory::{Buffer, alloc};
use crate::types::CudaDevice;

/// A tensor's storage on one GPU (untyped; the dtype lives in the tensor).
pub struct CudaStorage {
    repr: Repr,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.is_pending() { ", pending" } else { "" };
        write!(
            f,
            "CudaStorage({} bytes on cuda:{}{what})",
            self.len_bytes(),
            self.state().ordinal()
        )
    }
}

impl From<Repr> for CudaStorage {
    fn from(repr: Repr) -> Self {
        CudaStorage { repr }
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
        self.repr.len_bytes()
    }
    pub fn device(&self) -> CudaDevice {
        self.state().device()
    }
    pub(crate) fn state(&self) -> &'static DeviceState {
        self.repr.state()
    }
    /// Whether this holds elementwise work that has not run yet.
    pub fn is_pending(&self) -> bool {
        self.repr.is_pending()
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
        self.repr.buffer()
    }

    /// The buffer for an in-place write: computed, and held by nothing else (a pending node
    /// that still reads it gets the old contents, in a copy made here).
    pub(crate) fn buffer_mut(&mut self) -> Result<&Buffer> {
        self.repr.buffer_mut()
    }
}
