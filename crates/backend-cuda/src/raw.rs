//! Low-level access for benchmarks, tests and custom kernels: raw allocations, a spin kernel
//! of known length, event timing around a closure.

use kiln_core::Result;

use crate::device::{self, state};
use crate::{CudaDevice, CudaStorage, sources};

/// Allocates `bytes` of uninitialized device memory (`torch.empty`), freed on drop.
pub fn alloc(device: &CudaDevice, bytes: usize) -> Result<CudaStorage> {
    CudaStorage::alloc(device, bytes)
}

/// Queues a kernel that keeps one GPU thread busy for `micros` microseconds on the calling
/// thread's current stream of `device`: work of known length that leaves the GPU otherwise
/// free, for testing and measuring stream concurrency and ordering.
pub fn spin(device: &CudaDevice, micros: u64) -> Result<()> {
    let s = state(device)?;
    let f = s.func(sources::Module::Util, &["spin", "ns"])?;
    let mut ns = micros * 1000;
    let mut p = [&mut ns as *mut u64 as *mut std::ffi::c_void];
    s.launch("spin", f, (1, 1), 1, 0, &mut p)
}

/// Queues a [`spin`] of `micros` on the device's internal copy stream, delaying the host
/// transfers queued after it: lets a test prove that an asynchronous copy's source is kept
/// alive and its result ordered (no use outside tests).
#[doc(hidden)]
pub fn delay_copies(device: &CudaDevice, micros: u64) -> Result<()> {
    let s = state(device)?;
    let prev = device::set_current_stream(s.ordinal(), s.copy_stream());
    let r = spin(device, micros);
    device::set_current_stream(s.ordinal(), prev);
    r
}

/// Runs `f` between two timing events on the calling thread's current stream of `device`
/// and returns the elapsed milliseconds (after synchronizing with the second).
pub fn time_ms(device: &CudaDevice, f: impl FnOnce() -> Result<()>) -> Result<f32> {
    device::time_on(state(device)?.stream(), "time", f)
}
