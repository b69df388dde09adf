//! What this backend tells kiln's profiler ([`kiln_core::profile`]).
//!
//! # Why a module of its own
//!
//! The rest of the backend calls one guard at the single place where each thing happens —
//! [`launch`] around `cuLaunchKernel` and the cuBLAS call, [`copy`] around each `cuMemcpy*`,
//! [`alloc`] in the allocator, [`sync`] around each host wait — so that profiling stays out of
//! their code. Each guard is `None` (one relaxed load and a branch) when the profiler is off.
//!
//! # Device time without serializing the stream
//!
//! A launch or copy is bracketed by two CUDA events recorded on the stream it goes to, taken
//! from a pool per device. Nothing waits for them while the program runs: the profiler keeps
//! them in its record as a [`DeviceTimer`] and resolves them (`cuEventSynchronize` on the
//! second, `cuEventElapsedTime`) only when a profile is collected, then returns them to the
//! pool. To place device spans on the host clock of the trace, the first timed event of each
//! device is preceded by an anchor: one synchronization, one event, and the host time at which
//! it completed (renewed every 10 s, so that offsets keep microsecond precision).
//! `KILN_PROFILE_DEVICE=0` records no events (host times only).

use std::cell::RefCell;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;
use kiln_core::profile::{
    self, CopyKind, DeviceTime, DeviceTimer, Event, Kind, LaunchKind, enabled, now_ns,
};

use crate::device::{DeviceState, MAX_STREAM_DEVICES};

fn device_timing() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_PROFILE_DEVICE").map_or(true, |v| v != "0"))
}

/// Timing events per device ordinal (raw handles as integers).
static POOL: [Mutex<Vec<usize>>; MAX_STREAM_DEVICES] =
    [const { Mutex::new(Vec::new()) }; MAX_STREAM_DEVICES];

/// Per device: the latest anchor event and the host time ([`now_ns`]) at which it completed.
static ANCHOR: [Mutex<Option<(usize, u64)>>; MAX_STREAM_DEVICES] =
    [const { Mutex::new(None) }; MAX_STREAM_DEVICES];

/// A new anchor after this long: `cuEventElapsedTime` is an f32 of milliseconds, so offsets
/// from an older anchor would lose sub-microsecond precision.
const ANCHOR_NS: u64 = 10_000_000_000;

fn take_event(dev: &DeviceState) -> Option<sys::CUevent> {
    if let Some(e) = POOL.get(dev.ordinal)?.lock().unwrap().pop() {
        return Some(e as sys::CUevent);
    }
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device's context is current (callers hold a bound state).
    let r = unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(ev)
}

/// The device's anchor, made (one synchronization) on first use and every [`ANCHOR_NS`].
/// Anchors are never recycled: timers made under one keep using it.
fn anchor(dev: &DeviceState) -> Option<(usize, u64)> {
    let mut a = ANCHOR.get(dev.ordinal)?.lock().unwrap();
    if let Some((ev, host)) = *a
        && now_ns().saturating_sub(host) < ANCHOR_NS
    {
        return Some((ev, host));
    }
    let ev = take_event(dev)?;
    // SAFETY: the context is current; the event is ours; we wait for it before reading the
    // host clock, so the anchor's host time is when the device reached it.
    unsafe {
        sys::cuCtxSynchronize().result().ok()?;
        sys::cuEventRecord(ev, dev.stream()).result().ok()?;
        sys::cuEventSynchronize(ev).result().ok()?;
    }
    *a = Some((ev as usize, now_ns()));
    *a
}

/// Two events around work on one stream, resolved at collection.
struct Timer {
    ordinal: usize,
    /// The anchor event and its host time.
    anchor: (usize, u64),
    start: usize,
    end: usize,
}

impl DeviceTimer for Timer {
    fn resolve(&mut self) -> Option<DeviceTime> {
        crate::device::state(&crate::CudaDevice::new(self.ordinal)).ok()?;
        let (anchor, host) = self.anchor;
        let (mut from_anchor, mut dur) = (0f32, 0f32);
        // SAFETY: all three events belong to this device's context and were recorded (the
        // anchor before every timed event); waiting for the last is what resolving means.
        unsafe {
            sys::cuEventSynchronize(self.end as sys::CUevent)
                .result()
                .ok()?;
            sys::cuEventElapsedTime_v2(
                &mut from_anchor,
                anchor as sys::CUevent,
                self.start as sys::CUevent,
            )
            .result()
            .ok()?;
            sys::cuEventElapsedTime_v2(
                &mut dur,
                self.start as sys::CUevent,
                self.end as sys::CUevent,
            )
            .result()
            .ok()?;
        }
        Some(DeviceTime {
            start_ns: host + (from_anchor.max(0.0) as f64 * 1e6) as u64,
            dur_ns: (dur.max(0.0) as f64 * 1e6) as u64,
        })
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(p) = POOL.get(self.ordinal) {
            p.lock().unwrap().extend([self.start, self.end]);
        }
    }
}

thread_local! {
    /// The ops of the fused program about to launch (see [`fused_ops`]).
    static FUSED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Names the ops of the fused program the next launch on this thread runs (when profiling).
pub(crate) fn fused_ops(names: impl FnOnce() -> String) {
    if enabled() {
        FUSED.with(|f| *f.borrow_mut() = Some(names()));
    }
}

/// The op names of a lazy program, in order (its leaves and constants left out).
pub(crate) fn lazy_op_names(
    code: &[crate::lazy::Ins],
    reduce: Option<kiln_core::ReduceOp>,
) -> String {
    use crate::lazy::Ins;
    let mut v: Vec<String> = code
        .iter()
        .filter_map(|i| match i {
            Ins::Unary(u, _) => Some(u.name().to_string()),
            Ins::Binary(b, ..) => Some(b.name().to_string()),
            Ins::Bwd(u, ..) => Some(format!("{}_backward", u.name())),
            Ins::Cmp(c, ..) => Some(c.name().to_string()),
            Ins::Cast(..) => Some("cast".into()),
            Ins::Where(..) => Some("where".into()),
            Ins::Leaf(_) | Ins::Uni(_) | Ins::Const(_) => None,
        })
        .collect();
    if let Some(r) = reduce {
        v.push(r.name().to_string());
    }
    v.join(", ")
}

/// The op names of an expression program, in order (from its printed form: inputs,
/// parameters and constants left out).
pub(crate) fn expr_op_names(p: &kiln_core::expr::Program) -> String {
    let text = p.to_string();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split(" = ").nth(1)?.split(' ').next())
        .filter(|n| !matches!(*n, "input" | "param" | "const"))
        .collect();
    format!("expr: {}", names.join(", "))
}

/// An open launch, copy or wait; reported when dropped.
pub(crate) struct Span {
    ev: Option<Event>,
    timer: Option<Timer>,
    stream: sys::CUstream,
}

impl Span {
    #[cold]
    #[inline(never)]
    fn open(
        dev: &DeviceState,
        kind: Kind,
        name: &'static str,
        stream: sys::CUstream,
        bytes: usize,
        timed: bool,
    ) -> Span {
        let mut ev = Event::new(kind, name, dev.device());
        ev.stream = stream as u64;
        ev.bytes = bytes as u64;
        if kind == Kind::Launch(LaunchKind::Fused) {
            ev.detail = FUSED.with(|f| f.borrow_mut().take()).unwrap_or_default();
        }
        if kind == Kind::Launch(LaunchKind::Kernel) && !crate::lazy::fusion_enabled() {
            ev.fallback = profile::current_op()
                .is_some_and(|op| op != name)
                .then_some("fusion off");
        }
        let anchored = (timed && device_timing()).then(|| anchor(dev)).flatten();
        let timer = if let Some(anchor) = anchored {
            match (take_event(dev), take_event(dev)) {
                (Some(s), Some(e)) => {
                    // SAFETY: our event, the stream of this (current) context.
                    unsafe { sys::cuEventRecord(s, stream) };
                    Some(Timer {
                        ordinal: dev.ordinal,
                        anchor,
                        start: s as usize,
                        end: e as usize,
                    })
                }
                _ => None,
            }
        } else {
            None
        };
        ev.start_ns = now_ns();
        Span {
            ev: Some(ev),
            timer,
            stream,
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(mut ev) = self.ev.take() else { return };
        if let Some(t) = self.timer.take() {
            // SAFETY: our event, recorded on the stream the work went to.
            unsafe { sys::cuEventRecord(t.end as sys::CUevent, self.stream) };
            ev.timer = Some(Box::new(t));
        }
        ev.dur_ns = now_ns().saturating_sub(ev.start_ns);
        profile::record(ev);
    }
}

/// Around a kernel launch (`name` is the op the launch site gives) or a cuBLAS call (`blas`) on
/// the current stream.
#[inline(always)]
pub(crate) fn launch(dev: &DeviceState, name: &'static str, blas: bool) -> Option<Span> {
    if !enabled() {
        return None;
    }
    let kind = match (blas, name) {
        (true, _) => LaunchKind::Blas,
        (_, "fused elementwise" | "expr" | "fused_update") => LaunchKind::Fused,
        (_, "spin") => LaunchKind::User,
        _ => LaunchKind::Kernel,
    };
    Some(Span::open(
        dev,
        Kind::Launch(kind),
        name,
        dev.stream(),
        0,
        true,
    ))
}

/// Around a copy of `bytes` enqueued on `stream`.
#[inline(always)]
pub(crate) fn copy(
    dev: &DeviceState,
    name: &'static str,
    dir: CopyKind,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    if !enabled() {
        return None;
    }
    Some(Span::open(dev, Kind::Copy(dir), name, stream, bytes, true))
}

/// [`copy`] host to device.
#[inline(always)]
pub(crate) fn h2d(
    dev: &DeviceState,
    name: &'static str,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    copy(dev, name, CopyKind::HostToDevice, stream, bytes)
}

/// [`copy`] device to host.
#[inline(always)]
pub(crate) fn d2h(
    dev: &DeviceState,
    name: &'static str,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    copy(dev, name, CopyKind::DeviceToHost, stream, bytes)
}

/// [`copy`] device to device.
#[inline(always)]
pub(crate) fn d2d(
    dev: &DeviceState,
    name: &'static str,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    copy(dev, name, CopyKind::DeviceToDevice, stream, bytes)
}

/// Around a host wait for the device (stream, event or context synchronization).
#[inline(always)]
pub(crate) fn sync(dev: &DeviceState, name: &'static str) -> Option<Span> {
    if !enabled() {
        return None;
    }
    Some(Span::open(dev, Kind::Sync, name, dev.stream(), 0, false))
}

/// An allocation of `bytes` (reported at once, with the memory in use counting it).
#[inline(always)]
pub(crate) fn alloc(dev: &DeviceState, bytes: usize, stream: sys::CUstream) {
    if enabled() {
        alloc_slow(dev, bytes, stream);
    }
}

#[cold]
#[inline(never)]
fn alloc_slow(dev: &DeviceState, bytes: usize, stream: sys::CUstream) {
    let mut ev = Event::new(Kind::Alloc, "alloc", dev.device());
    ev.stream = stream as u64;
    ev.bytes = bytes as u64;
    let in_use = dev.in_use.load(std::sync::atomic::Ordering::Relaxed) + bytes;
    ev.mem_in_use = Some(in_use as u64);
    profile::record(ev);
}
