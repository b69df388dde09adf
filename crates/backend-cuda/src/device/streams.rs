//! The streams of one device: the compute (default) stream, the copy stream of host
//! transfers, the side stream of concurrent pairs (`stream.rs`), the spare streams of dropped
//! user [`crate::Stream`]s, and the pool of spare events that order them.

use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;
use kiln_core::Result;

use super::check;

pub(crate) struct Streams {
    compute: sys::CUstream,
    copy: sys::CUstream,
    /// Spare events (timing disabled) for ordering streams and tracking copies.
    events: Mutex<Vec<usize>>,
    /// Streams of dropped [`crate::Stream`]s, by priority, for the next `Stream::new`. A stream
    /// is never destroyed: blocks it used still name it, and record an event on it when they
    /// are freed (see `memory.rs`), possibly long after the `Stream` was dropped.
    spare: Mutex<Vec<(i32, usize)>>,
    /// The side stream of independent work beside the current stream (created on first use).
    side: OnceLock<usize>,
}

impl Streams {
    /// Creates the compute and copy streams (non-blocking).
    ///
    /// # Safety
    /// The device's context must be current on the calling thread.
    pub(super) unsafe fn create() -> Result<Self> {
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        let mut compute = std::ptr::null_mut();
        let mut copy = std::ptr::null_mut();
        // SAFETY: the context is current (the caller's contract); valid out-pointers.
        unsafe {
            check(sys::cuStreamCreate(&mut compute, flags), "cuStreamCreate")?;
            check(sys::cuStreamCreate(&mut copy, flags), "cuStreamCreate")?;
        }
        Ok(Streams {
            compute,
            copy,
            events: Mutex::new(Vec::new()),
            spare: Mutex::new(Vec::new()),
            side: OnceLock::new(),
        })
    }

    /// The default stream: kiln's work outside any [`crate::Stream::scope`].
    pub fn compute(&self) -> sys::CUstream {
        self.compute
    }

    /// The stream of host transfers.
    pub fn copy(&self) -> sys::CUstream {
        self.copy
    }

    /// The side stream (non-blocking), created on first use (the context must be current).
    /// Never destroyed, as the others: blocks it used record events on it when freed.
    pub fn side(&self) -> Result<sys::CUstream> {
        if let Some(&s) = self.side.get() {
            return Ok(s as sys::CUstream);
        }
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the context is current (callers bind first).
        check(
            unsafe { sys::cuStreamCreate(&mut s, flags) },
            "cuStreamCreate",
        )?;
        // Two threads racing here: the loser's stream is left unused (a few bytes, once).
        Ok(*self.side.get_or_init(|| s as usize) as sys::CUstream)
    }

    /// Whether `stream` is the side stream.
    pub fn is_side(&self, stream: sys::CUstream) -> bool {
        self.side.get() == Some(&(stream as usize))
    }

    /// An event with timing disabled, from the spare list or new (the context must be
    /// current).
    pub fn event(&self) -> Result<sys::CUevent> {
        if let Some(e) = self.events.lock().unwrap().pop() {
            return Ok(e as sys::CUevent);
        }
        let mut ev = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current (callers bind first).
        check(
            unsafe {
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(ev)
    }

    /// Gives an event from [`Streams::event`] back.
    pub fn recycle_event(&self, ev: sys::CUevent) {
        self.events.lock().unwrap().push(ev as usize);
    }

    /// A spare stream of `priority`, if a dropped `Stream` left one.
    pub fn take_spare(&self, priority: i32) -> Option<sys::CUstream> {
        let mut spare = self.spare.lock().unwrap();
        let i = spare.iter().rposition(|&(p, _)| p == priority);
        i.map(|i| spare.swap_remove(i).1 as sys::CUstream)
    }

    /// Keeps the stream of a dropped `Stream` of `priority` for the next one.
    pub fn put_spare(&self, priority: i32, stream: sys::CUstream) {
        self.spare.lock().unwrap().push((priority, stream as usize));
    }
}

// SAFETY: stream and event handles are valid from any thread once the context is current;
// the lists are behind mutexes.
unsafe impl Send for Streams {}
// SAFETY: as above.
unsafe impl Sync for Streams {}

/// Runs `f` between two timing events recorded on `stream` and returns the elapsed
/// milliseconds, after synchronizing with the second (so never while capturing). The events
/// are created for the call and destroyed on every path; `op` names a failing driver call.
pub(crate) fn time_on(
    stream: sys::CUstream,
    op: &'static str,
    f: impl FnOnce() -> Result<()>,
) -> Result<f32> {
    /// Timing events, destroyed on drop (also when a step below fails).
    struct Events([sys::CUevent; 2]);
    impl Drop for Events {
        fn drop(&mut self) {
            for e in self.0 {
                if !e.is_null() {
                    // SAFETY: created by cuEventCreate below and destroyed once, here.
                    unsafe { sys::cuEventDestroy_v2(e) };
                }
            }
        }
    }
    let mut ev = Events([std::ptr::null_mut(); 2]);
    // SAFETY: events are created into the guard (valid out-pointers), recorded on `stream`
    // (whose context the caller has bound), synchronized before being read, and destroyed by
    // the guard on every path.
    unsafe {
        check(sys::cuEventCreate(&mut ev.0[0], 0), op)?;
        check(sys::cuEventCreate(&mut ev.0[1], 0), op)?;
        let [a, b] = ev.0;
        check(sys::cuEventRecord(a, stream), op)?;
        let r = f();
        check(sys::cuEventRecord(b, stream), op)?;
        check(sys::cuEventSynchronize(b), op)?;
        let mut ms = 0f32;
        check(sys::cuEventElapsedTime_v2(&mut ms, a, b), op)?;
        r.map(|_| ms)
    }
}
