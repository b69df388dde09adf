//! The profiler: where the time, the bytes and the memory of a kiln program go.
//!
//! # Why here
//!
//! Every backend reports to one profiler at the single place in its code where a launch, a
//! copy, an allocation or a synchronization happens, and the tensor layer wraps each op in a
//! span; kiln-core is the one crate they all see. Off (the default) it costs each hook one
//! relaxed atomic load and a branch ([`enabled`]); nothing is allocated or timed.
//!
//! # Switching it on
//!
//! - `KILN_PROFILE=1`: everything the process does is recorded; [`report`] prints the tables
//!   (to stderr) and, with `KILN_PROFILE_TRACE=trace.json`, writes a Chrome trace. Call it at
//!   the end of `main` (the examples do).
//! - A scope: [`profile`]`(|| ...)` or [`start`]`()`…[`Session::finish`] return a [`Profile`]
//!   with the records made meanwhile, whatever the variable says.
//!
//! # What is recorded
//!
//! - **Op spans** from the tensor layer: name, dtype and shapes, operand bytes, device, host
//!   start and duration.
//! - **Backend events** ([`record`]): launches of built-in kernels, fused programs (their
//!   [`Record::detail`] lists the ops they contain), user kernels and BLAS calls; copies between
//!   host and device and between devices, with bytes; allocations with bytes and the memory in
//!   use after them; synchronizations with the time waited. A launch or copy may carry a
//!   [`DeviceTimer`] (on CUDA, a pair of pooled events): it is resolved only when the profile is
//!   collected, so profiling never waits for the device per op.
//! - **User ranges** ([`range`]`("forward")`), a guard: they nest, appear in the table, the
//!   memory view and the trace, and every record made inside carries the range's path.
//!
//! Records go to a buffer per thread (an uncontended lock each; no global lock on the hot
//! path) and are merged when a profile is collected.

//! # How the code is laid out
//!
//! The profiler has four jobs, one file each, in the order data flows through them:
//!
//! - `record`: what a record is ([`Event`], [`Record`], [`Kind`]) and the hot path that writes
//!   them: the per-thread buffers, [`record`], [`record_alloc`], op spans ([`op`]) and user
//!   ranges ([`range`]);
//! - `collect`: merging every thread's buffer into a [`Profile`] (device timers resolved,
//!   sampled launches estimated), and the scopes that bound it ([`start`], [`profile`]);
//! - `report`: the views of a profile as numbers and text: the per-op table
//!   ([`Profile::key_averages`], [`Profile::table`]), totals, "where did it run", the memory
//!   view, and [`report`] that prints them at the end of a program;
//! - `trace`: the Chrome trace JSON ([`Profile::chrome_trace_json`]).
//!
//! The switches (whether recording is on, the clock, device-time sampling) stay in this file:
//! every part reads them, and the hot path's check must be one inlined load.

mod collect;
mod record;
mod report;
mod trace;

pub use collect::{Profile, Session, on_collect, profile, start};
pub use record::{
    CopyKind, DeviceTime, DeviceTimer, Event, Kind, LaunchKind, OpDetail, OpSpan, Range, Record,
    current_op, op, range, record, record_alloc,
};
pub use report::{MemRow, Row, Totals, is_host_device, report};
pub use trace::json_str;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

// ---- switching ---------------------------------------------------------------------------

const UNINIT: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static SESSIONS: AtomicUsize = AtomicUsize::new(0);

fn env_on() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| std::env::var("KILN_PROFILE").is_ok_and(|v| v == "1"))
}

/// Whether the profiler records: one relaxed load and one branch when it is off.
#[inline(always)]
pub fn enabled() -> bool {
    let s = STATE.load(Ordering::Relaxed);
    if s != OFF { enabled_slow(s) } else { false }
}

#[cold]
#[inline(never)]
fn enabled_slow(s: u8) -> bool {
    if s == ON {
        return true;
    }
    refresh_state();
    STATE.load(Ordering::Relaxed) == ON
}

fn refresh_state() {
    let on = env_on() || SESSIONS.load(Ordering::SeqCst) > 0;
    STATE.store(if on { ON } else { OFF }, Ordering::SeqCst);
}

/// Nanoseconds on the profiler's host clock (monotonic, started with the first call; the CPU's
/// time-stamp counter where that is cheaper to read than the OS clock). Backends time their
/// events with it, and only with it: it may sit microseconds away from [`Instant`].
///
/// [`Instant`]: std::time::Instant
#[inline]
pub fn now_ns() -> u64 {
    crate::clock::now_ns()
}

/// Which clock [`now_ns`] reads: `"tsc"` (the CPU's time-stamp counter, calibrated against the
/// OS clock) or `"os"` (`KILN_PROFILE_CLOCK=os` forces it).
pub fn clock_source() -> &'static str {
    crate::clock::source()
}

/// `device` as it displays (`cuda:0`), formatted once per device: records name their device
/// without formatting it each time. A per-thread cache in front of a process-wide one, so
/// that each distinct device leaks one string however many threads record on it.
pub fn device_label<D: std::fmt::Display + PartialEq + Clone + Send + 'static>(
    device: &D,
) -> &'static str {
    type Labels = Vec<(Box<dyn std::any::Any + Send>, &'static str)>;
    fn find<D: PartialEq + 'static>(labels: &Labels, device: &D) -> Option<&'static str> {
        labels.iter().find_map(|(d, s)| {
            d.downcast_ref::<D>()
                .is_some_and(|d| d == device)
                .then_some(*s)
        })
    }
    static SHARED: Mutex<Labels> = Mutex::new(Vec::new());
    thread_local! {
        static LOCAL: RefCell<Labels> = const { RefCell::new(Vec::new()) };
    }
    LOCAL.with(|l| {
        if let Some(s) = find(&l.borrow(), device) {
            return s;
        }
        let s = {
            let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
            find(&shared, device).unwrap_or_else(|| {
                let s: &'static str = Box::leak(device.to_string().into_boxed_str());
                shared.push((Box::new(device.clone()), s));
                s
            })
        };
        l.borrow_mut().push((Box::new(device.clone()), s));
        s
    })
}

/// Launches are timed on the device one in this many by default (see [`device_sample_every`]).
pub const DEFAULT_SAMPLE_EVERY: u32 = 16;

/// 0 until first read.
static SAMPLE_EVERY: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// How backends sample device timing of launches: each launch is timed with probability
/// 1/n, and the first two launches of each name on a thread in each profiling scope always
/// are (copies are always timed). A timing event costs the driver about as much as a small
/// launch, so timing every launch of a launch-bound step made it 36–63 % slower (an H100,
/// 2026-11-23), at 1 in 16 12–19 %. Untimed launches get the mean device time of the timed
/// launches of the same name at collection ([`Record::device_estimated`]), which is unbiased
/// because the choice is random, not periodic. `KILN_PROFILE_SAMPLE=n` sets it (1: time
/// every launch), as does [`set_device_sample_every`].
pub fn device_sample_every() -> u32 {
    match SAMPLE_EVERY.load(Ordering::Relaxed) {
        0 => {
            let n = std::env::var("KILN_PROFILE_SAMPLE")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .filter(|&n| n > 0)
                .unwrap_or(DEFAULT_SAMPLE_EVERY);
            SAMPLE_EVERY.store(n, Ordering::Relaxed);
            n
        }
        n => n,
    }
}

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// A number that changes whenever a profiling scope starts ([`start`], [`profile`]): backends
/// that sample per name restart their counts with it, so every scope times the first
/// launches of each name.
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// Sets [`device_sample_every`] for the whole process (`1` times every launch; `0` is read
/// as 1).
pub fn set_device_sample_every(n: u32) {
    SAMPLE_EVERY.store(n.max(1), Ordering::Relaxed);
}

/// Tests that need the module's private state; the rest (they use the reference backend and
/// `test_profile`, which sit above this module) are in `tests/profile.rs`.
#[cfg(test)]
mod tests {
    use super::record::thread_id;
    use super::*;

    #[test]
    fn off_outside_a_scope_and_on_inside() {
        if env_on() {
            return; // KILN_PROFILE=1 in the environment: always on
        }
        let (_, p) = profile(|| {
            assert!(enabled());
        });
        drop(p);
        // Other tests may hold a session meanwhile; the state follows the count.
        assert_eq!(enabled(), SESSIONS.load(Ordering::SeqCst) > 0);
    }

    #[test]
    fn records_of_other_threads_are_merged() {
        let s = start();
        let main_thread = {
            let _r = range("threads-main");
            let mut ev = Event::new(Kind::Launch(LaunchKind::Kernel), "on_main", "gpu:3");
            ev.dur_ns = 1;
            record(ev);
            thread_id()
        };
        let workers: Vec<_> = (0..3)
            .map(|i| {
                std::thread::spawn(move || {
                    let _r = range("threads-worker");
                    let mut ev = Event::new(Kind::Copy(CopyKind::HostToDevice), "upload", "gpu:3");
                    ev.bytes = 100 + i;
                    record(ev);
                    thread_id()
                })
            })
            .collect();
        let ids: Vec<u64> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        let p = s.finish();
        let up = p.in_range("threads-worker");
        let row = up
            .row(Kind::Copy(CopyKind::HostToDevice), "upload")
            .unwrap();
        assert_eq!((row.calls, row.bytes), (3, 303));
        let threads: std::collections::BTreeSet<u64> = up
            .find(Kind::Copy(CopyKind::HostToDevice), "upload")
            .map(|r| r.thread)
            .collect();
        assert_eq!(threads.len(), 3, "one buffer per thread");
        assert!(!ids.contains(&main_thread));
        assert_eq!(p.in_range("threads-main").records().len(), 2);
    }
}
