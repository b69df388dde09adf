//! The device error flag: a 16-byte record kernels set instead of touching memory out of
//! bounds (an index or label out of range), read back and cleared by the op that launched them.

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys;
use kiln_core::{Error, Result};

use super::check;

/// The record `{u32 code, u32 pad, i64 value}` on the device (code 0, or the code and
/// offending value of the first kernel error since the last check) and its pinned host copy.
pub(crate) struct ErrorFlag {
    flag: sys::CUdeviceptr,
    host: *mut u32,
    /// One reader at a time (the host copy is shared).
    lock: Mutex<()>,
}

impl ErrorFlag {
    /// Allocates and clears the record.
    ///
    /// # Safety
    /// The device's context must be current on the calling thread.
    pub(super) unsafe fn create() -> Result<Self> {
        let mut flag = 0;
        let mut host = std::ptr::null_mut();
        // SAFETY: the context is current (the caller's contract); valid out-pointers.
        unsafe {
            check(sys::cuMemAlloc_v2(&mut flag, 16), "cuMemAlloc")?;
            check(sys::cuMemsetD32_v2(flag, 0, 4), "cuMemsetD32")?;
            check(sys::cuMemHostAlloc(&mut host, 16, 0), "cuMemHostAlloc")?;
        }
        Ok(ErrorFlag {
            flag,
            host: host as *mut u32,
            lock: Mutex::new(()),
        })
    }

    /// The record's device address: the argument of kernels that check bounds.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.flag
    }

    /// Copies the record back on `stream`, waits with `sync` (a synchronization of `stream`),
    /// and turns a raised flag into a typed error naming `op`, the offending value and the
    /// valid range `0..limit`; the record is then cleared on `stream`.
    pub fn check(
        &self,
        op: &'static str,
        limit: usize,
        stream: sys::CUstream,
        sync: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let _g = self.lock.lock().unwrap();
        // SAFETY: `host` is 16 bytes of pinned memory; `flag` a 16-byte device record; the copy
        // is ordered on `stream`, which `sync` synchronizes before we read.
        let (code, value) = unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(self.host as *mut c_void, self.flag, 16, stream),
                op,
            )?;
            sync()?;
            let code = std::ptr::read_volatile(self.host);
            let value = std::ptr::read_volatile(self.host.add(2) as *const i64);
            (code, value)
        };
        if code == 0 {
            return Ok(());
        }
        // SAFETY: the 16-byte device record, ordered on `stream`.
        check(
            unsafe { sys::cuMemsetD32Async(self.flag, 0, 4, stream) },
            op,
        )?;
        Err(match code {
            // 1: a cross-entropy label outside `0..classes`; 2: an index outside its axis.
            1 | 2 => Error::IndexOutOfRange {
                op,
                index: value,
                size: limit,
            },
            c => Error::backend(op, format!("kernel error code {c} (value {value})")),
        })
    }
}

// SAFETY: the device pointer and the pinned host memory are valid from any thread; the host
// copy is only read and written under `lock`.
unsafe impl Send for ErrorFlag {}
// SAFETY: as above.
unsafe impl Sync for ErrorFlag {}
