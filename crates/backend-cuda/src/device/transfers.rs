//! Host transfers' per-device state: the ring of pinned staging blocks, the host sources of
//! asynchronous copies still in flight, and the peers direct access was enabled for. The
//! copies themselves are `transfer.rs`'s.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use super::SharedEvent;

/// Pinned host buffers for transfers: a ring of `STAGING_BLOCKS` blocks of [`staging_bytes`],
/// each with the event of its last DMA, so a block is reused only once its copy is done.
#[derive(Default)]
pub(crate) struct Staging {
    pub blocks: Vec<(*mut u8, sys::CUevent)>,
    pub next: usize,
}
// SAFETY: only used under the `staging` mutex.
unsafe impl Send for Staging {}
/// The size of one staging block: `KILN_CUDA_STAGING_MB` MiB (default 32, the best of 8 and 32
/// for 256 MB copies on an H100 host, BENCHMARKS.md; read once).
pub(crate) fn staging_bytes() -> usize {
    static B: OnceLock<usize> = OnceLock::new();
    *B.get_or_init(|| {
        let mb = std::env::var("KILN_CUDA_STAGING_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(32);
        mb.clamp(1, 256) << 20
    })
}
pub(crate) const STAGING_BLOCKS: usize = 4;

/// Host memory that an asynchronous copy still reads (a pinned source's storage), held until
/// the copy's event completes.
pub(crate) struct InFlight {
    pub event: std::sync::Arc<SharedEvent>,
    pub _owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

/// Transfers' state of one device.
#[derive(Default)]
pub(crate) struct Transfers {
    staging: Mutex<Staging>,
    /// Sources of asynchronous host-to-device copies, kept alive until their copy is done.
    in_flight: Mutex<VecDeque<InFlight>>,
    /// Ordinals of the devices peer access was tried for.
    peers: Mutex<Vec<usize>>,
}

impl Transfers {
    /// The staging ring, locked for one transfer.
    pub fn staging(&self) -> MutexGuard<'_, Staging> {
        self.staging.lock().unwrap()
    }

    /// Keeps a copy's source alive until its event completes.
    pub fn keep_in_flight(&self, f: InFlight) {
        self.in_flight.lock().unwrap().push_back(f);
    }

    /// Drops the sources of host-to-device copies that have finished.
    pub fn sweep_in_flight(&self) {
        let mut q = self.in_flight.lock().unwrap();
        while let Some(f) = q.front() {
            // SAFETY: a live event of this context.
            let r = unsafe { sys::cuEventQuery(f.event.event) };
            if r == CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            q.pop_front(); // the event returns to the pool with its last holder
        }
    }

    /// Runs `enable` once per peer `ordinal` (under the lock, so a second caller waits until
    /// it has run).
    pub fn with_peer_once(&self, ordinal: usize, enable: impl FnOnce()) {
        let mut done = self.peers.lock().unwrap();
        if done.contains(&ordinal) {
            return;
        }
        done.push(ordinal);
        enable();
    }
}
