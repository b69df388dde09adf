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

/// Devices this module keeps event pools and anchors for (`device.rs` checks that it equals
/// its own per-device table size).
pub(crate) const MAX_DEVICES: usize = 16;

/// What the guards need of a device's state. `device::DeviceState` implements it: this module
/// sits below the runtime (the runtime calls it), so it names no runtime type.
pub(crate) trait Site {
    fn ordinal(&self) -> usize;
    /// The calling thread's current stream on this device.
    fn current_stream(&self) -> sys::CUstream;
    /// Bytes of device memory in use (before the allocation being reported).
    fn bytes_in_use(&self) -> usize;
}

/// Makes device `ordinal`'s context current on this thread (registered by the runtime, see
/// [`set_binder`]); a timer resolved on another thread needs it.
static BINDER: OnceLock<fn(usize) -> bool> = OnceLock::new();

/// Registers how to make a device's context current (once, by the runtime).
pub(crate) fn set_binder(bind: fn(usize) -> bool) {
    let _ = BINDER.set(bind);
}

/// Whether lazy fusion is on, as `lazy::set_fusion` last said (launches of single-op kernels
/// with fusion off are listed as fallbacks). 0: unknown, 1: off, 2: on.
static FUSION: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Told by the deferral layer whenever fusion is switched.
pub(crate) fn note_fusion(on: bool) {
    FUSION.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
}

fn device_name(dev: &dyn Site) -> String {
    format!("cuda:{}", dev.ordinal())
}

fn device_timing() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_PROFILE_DEVICE").map_or(true, |v| v != "0"))
}

/// Timing events per device ordinal (raw handles as integers).
static POOL: [Mutex<Vec<usize>>; MAX_DEVICES] = [const { Mutex::new(Vec::new()) }; MAX_DEVICES];

/// Per device: the latest anchor event and the host time ([`now_ns`]) at which it completed.
static ANCHOR: [Mutex<Option<(usize, u64)>>; MAX_DEVICES] =
    [const { Mutex::new(None) }; MAX_DEVICES];

/// A new anchor after this long: `cuEventElapsedTime` is an f32 of milliseconds, so offsets
/// from an older anchor would lose sub-microsecond precision.
const ANCHOR_NS: u64 = 10_000_000_000;

fn take_event(dev: &dyn Site) -> Option<sys::CUevent> {
    if let Some(e) = POOL.get(dev.ordinal())?.lock().unwrap().pop() {
        return Some(e as sys::CUevent);
    }
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device's context is current (callers hold a bound state).
    let r = unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(ev)
}

/// The device's anchor, made (one synchronization) on first use and every [`ANCHOR_NS`].
/// Anchors are never recycled: timers made under one keep using it.
fn anchor(dev: &dyn Site) -> Option<(usize, u64)> {
    let mut a = ANCHOR.get(dev.ordinal())?.lock().unwrap();
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
        sys::cuEventRecord(ev, dev.current_stream()).result().ok()?;
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
        if !BINDER.get().is_some_and(|bind| bind(self.ordinal)) {
            return None;
        }
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
    code: &[crate::lazygen::Ins],
    reduce: Option<kiln_core::ReduceOp>,
) -> String {
    use crate::lazygen::Ins;
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
        dev: &dyn Site,
        kind: Kind,
        name: &'static str,
        stream: sys::CUstream,
        bytes: usize,
        timed: bool,
    ) -> Span {
        let mut ev = Event::new(kind, name, device_name(dev));
        ev.stream = stream as u64;
        ev.bytes = bytes as u64;
        if kind == Kind::Launch(LaunchKind::Fused) {
            ev.detail = FUSED.with(|f| f.borrow_mut().take()).unwrap_or_default();
        }
        if kind == Kind::Launch(LaunchKind::Kernel)
            && FUSION.load(std::sync::atomic::Ordering::Relaxed) == 1
        {
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
                        ordinal: dev.ordinal(),
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
pub(crate) fn launch(dev: &dyn Site, name: &'static str, blas: bool) -> Option<Span> {
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
        dev.current_stream(),
        0,
        true,
    ))
}

/// Around a copy of `bytes` enqueued on `stream`.
#[inline(always)]
pub(crate) fn copy(
    dev: &dyn Site,
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
    dev: &dyn Site,
    name: &'static str,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    copy(dev, name, CopyKind::HostToDevice, stream, bytes)
}

/// [`copy`] device to host.
#[inline(always)]
pub(crate) fn d2h(
    dev: &dyn Site,
    name: &'static str,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    copy(dev, name, CopyKind::DeviceToHost, stream, bytes)
}

/// [`copy`] device to device.
#[inline(always)]
pub(crate) fn d2d(
    dev: &dyn Site,
    name: &'static str,
    stream: sys::CUstream,
    bytes: usize,
) -> Option<Span> {
    copy(dev, name, CopyKind::DeviceToDevice, stream, bytes)
}

/// Around a host wait for the device (stream, event or context synchronization).
#[inline(always)]
pub(crate) fn sync(dev: &dyn Site, name: &'static str) -> Option<Span> {
    if !enabled() {
        return None;
    }
    Some(Span::open(
        dev,
        Kind::Sync,
        name,
        dev.current_stream(),
        0,
        false,
    ))
}

/// An allocation of `bytes` (reported at once, with the memory in use counting it).
#[inline(always)]
pub(crate) fn alloc(dev: &dyn Site, bytes: usize, stream: sys::CUstream) {
    if enabled() {
        alloc_slow(dev, bytes, stream);
    }
}

#[cold]
#[inline(never)]
fn alloc_slow(dev: &dyn Site, bytes: usize, stream: sys::CUstream) {
    let mut ev = Event::new(Kind::Alloc, "alloc", device_name(dev));
    ev.stream = stream as u64;
    ev.bytes = bytes as u64;
    let in_use = dev.bytes_in_use() + bytes;
    ev.mem_in_use = Some(in_use as u64);
    profile::record(ev);
}
