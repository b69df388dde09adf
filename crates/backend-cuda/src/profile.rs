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
//! A launch or copy is followed by one CUDA event recorded on the stream it went to, taken from
//! a pool per device (an event costs about as much driver time as a small launch, so one per
//! launch, not two). The work started when the stream was done with what came before it —
//! the previous timed event on that stream — or, if the device was idle by then, when the
//! host enqueued it: its device time is the shorter of `elapsed(previous event, its event)`
//! and the span from the host's enqueue to its event on the host clock. Nothing waits for the
//! events while the program runs: the profiler keeps them in its record as a [`DeviceTimer`]
//! and resolves them (`cuEventSynchronize`, `cuEventElapsedTime`) only when a profile is
//! collected; an event returns to the pool when no timer needs it any more. To place device spans on the host clock of the trace, the first timed event of each
//! device is preceded by an anchor: one synchronization, one event, and the host time at which
//! it completed (renewed every 10 s, so that offsets keep microsecond precision).
//! `KILN_PROFILE_DEVICE=0` records no events (host times only).
//!
//! # Sampling
//!
//! Each timing event costs the driver about as much as a small launch, and timing every
//! launch of a launch-bound training step made it 36–63 % slower. So by default launches are
//! timed at random, one in [`profile::device_sample_every`] (the first two of each name
//! always), each between two events of its own; copies are always timed. The profile
//! estimates the untimed launches from the timed ones of the same name. With
//! `KILN_PROFILE_SAMPLE=1` every launch is timed with one event, as described above.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use kiln_core::profile::{
    self, CopyKind, DeviceTime, DeviceTimer, Event, Kind, LaunchKind, enabled, now_ns,
};

/// Devices this module keeps event pools and anchors for (`device/` checks that it equals
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
    /// Whether the calling thread is capturing a CUDA graph on this device: captured work
    /// does not run now, so it gets host time only (its replays are timed as one launch).
    fn capturing(&self) -> bool;
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

/// `cuda:N`, formatted once per device (kiln-core's label cache).
fn device_name(dev: &dyn Site) -> &'static str {
    kiln_core::profile::device_label(&crate::types::CudaDevice::new(dev.ordinal()))
}

/// `KILN_PROFILE_DEBUG=1`: each resolved device timer prints its raw times (stderr).
fn debug_timers() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_PROFILE_DEBUG").is_ok_and(|v| v == "1"))
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

/// A timing event of device `ordinal`'s pool, or a new one (its context must be current).
fn take_event(ordinal: usize) -> Option<sys::CUevent> {
    if let Some(e) = POOL.get(ordinal)?.lock().unwrap().pop() {
        return Some(e as sys::CUevent);
    }
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device's context is current (callers hold a bound state).
    let r = unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(ev)
}

/// A timing event of the pool, back in it when the last timer (or [`LAST`]) lets go.
struct Pooled {
    ordinal: usize,
    ev: usize,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(p) = POOL.get(self.ordinal) {
            p.lock().unwrap().push(self.ev);
        }
    }
}

/// Per device: the last timing event recorded on each stream (stream as an address), where
/// the next timed work on that stream starts at the earliest.
static LAST: [Mutex<LastOnStreams>; MAX_DEVICES] = [const { Mutex::new(Vec::new()) }; MAX_DEVICES];

/// `(stream as an address, its last timing event)` pairs of one device.
type LastOnStreams = Vec<(usize, Arc<Pooled>)>;

/// The device's anchor, made (one synchronization) on first use and every [`ANCHOR_NS`].
/// Anchors are never recycled: timers made under one keep using it.
fn anchor(dev: &dyn Site) -> Option<(usize, u64)> {
    let mut a = ANCHOR.get(dev.ordinal())?.lock().unwrap();
    if let Some((ev, host)) = *a
        && now_ns().saturating_sub(host) < ANCHOR_NS
    {
        return Some((ev, host));
    }
    let ev = take_event(dev.ordinal())?;
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

/// One event after work on one stream, resolved at collection (see the module docs).
struct Timer {
    ordinal: usize,
    /// The anchor event and its host time.
    anchor: (usize, u64),
    /// Host time just before the work was enqueued.
    submit_ns: u64,
    /// The stream's previous timing event, if any.
    prev: Option<Arc<Pooled>>,
    /// `prev` was recorded just before this work (sampling), so `elapsed(prev, end)` is its
    /// time; otherwise the host's enqueue time bounds it too (the device may have idled).
    own_start: bool,
    end: Arc<Pooled>,
}

/// Milliseconds from event `a` to event `b` (both recorded and complete).
fn elapsed_ms(a: usize, b: usize) -> Option<f32> {
    let mut ms = 0f32;
    // SAFETY: two timing events of the current context, both recorded; the caller waited for
    // the later one.
    unsafe { sys::cuEventElapsedTime_v2(&mut ms, a as sys::CUevent, b as sys::CUevent) }
        .result()
        .ok()?;
    Some(ms.max(0.0))
}

impl DeviceTimer for Timer {
    fn resolve(&mut self) -> Option<DeviceTime> {
        if !BINDER.get().is_some_and(|bind| bind(self.ordinal)) {
            return None;
        }
        let (anchor, host) = self.anchor;
        // SAFETY: an event of this device's context, recorded after the anchor; waiting for it
        // is what resolving means.
        unsafe { sys::cuEventSynchronize(self.end.ev as sys::CUevent) }
            .result()
            .ok()?;
        let end_ns = host + (elapsed_ms(anchor, self.end.ev)? as f64 * 1e6) as u64;
        let since_submit = end_ns.saturating_sub(self.submit_ns);
        let from_prev = match &self.prev {
            Some(p) => Some((elapsed_ms(p.ev, self.end.ev)? as f64 * 1e6) as u64),
            None => None,
        };
        let dur_ns = match from_prev {
            Some(p) if self.own_start => p,
            // The anchor's clock mapping drifts (the GPU's clock against the host's, up to
            // ANCHOR_NS apart): an end mapped before the submission is that drift, not a
            // kernel of no length, so the previous event bounds it instead.
            Some(p) if since_submit == 0 => p,
            Some(p) => p.min(since_submit),
            None => since_submit,
        };
        if debug_timers() {
            eprintln!(
                "kiln profile timer: end {end_ns} submit {} since_submit {since_submit} \
                 from_prev {from_prev:?}",
                self.submit_ns
            );
        }
        Some(DeviceTime {
            start_ns: end_ns - dur_ns,
            dur_ns,
        })
    }
}

thread_local! {
    /// The ops of the fused program about to launch (see [`fused_ops`]).
    static FUSED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Op lists already written on one thread, by kernel handle and kernel-cache epoch.
type Named = Vec<((usize, u64), std::rc::Rc<str>)>;

thread_local! {
    static NAMED: RefCell<Named> = const { RefCell::new(Vec::new()) };
}

/// Op lists remembered per thread (the oldest is forgotten first).
const NAMED_LEN: usize = 256;

/// Names the ops of the fused program the next launch on this thread runs (when profiling).
/// `kernel` (its handle and the kernel-cache epoch) identifies the program, so `names` runs
/// once per kernel: printing a program for every launch cost microseconds per fused launch.
pub(crate) fn fused_ops(kernel: (usize, u64), names: impl FnOnce() -> String) {
    if !enabled() {
        return;
    }
    let ops = NAMED.with(|n| {
        let mut n = n.borrow_mut();
        if let Some((_, s)) = n.iter().find(|(k, _)| *k == kernel) {
            return s.clone();
        }
        if n.len() == NAMED_LEN {
            n.remove(0);
        }
        let s: std::rc::Rc<str> = names().into();
        n.push((kernel, s.clone()));
        s
    });
    FUSED.with(|f| *f.borrow_mut() = Some(ops.to_string()));
}

/// The op names of an expression program, in order (from its printed form: inputs,
/// parameters and constants left out).
pub(crate) fn program_op_names(p: &kiln_core::expr::Program) -> String {
    let text = p.to_string();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split(" = ").nth(1)?.split(' ').next())
        .filter(|n| !matches!(*n, "input" | "param" | "const"))
        .collect();
    names.join(", ")
}

/// An open launch, copy or wait; reported when dropped.
pub(crate) struct Span {
    ev: Option<Event>,
    /// The device's anchor when the work is timed on the device.
    anchor: Option<(usize, u64)>,
    /// Under sampling, the event recorded just before the timed work (the stream's previous
    /// timing event may be many untimed launches back).
    start: Option<Arc<Pooled>>,
    ordinal: usize,
    stream: sys::CUstream,
}

/// Per thread: a xorshift state and how often each launch name was seen in the current
/// profiling scope (see [`sampled`]).
struct Sampler {
    rng: u64,
    generation: u64,
    seen: Vec<(usize, u8)>,
}

thread_local! {
    static SAMPLER: RefCell<Sampler> = RefCell::new(Sampler {
        rng: 0x9e37_79b9_7f4a_7c15 ^ now_ns().max(1),
        generation: u64::MAX,
        seen: Vec::new(),
    });
}

/// Whether this launch is timed on the device ([`profile::device_sample_every`]): the first
/// two of each name on this thread in each profiling scope, then one in n at random.
fn sampled(name: &'static str, every: u32) -> bool {
    if every <= 1 {
        return true;
    }
    SAMPLER.with(|s| {
        let mut s = s.borrow_mut();
        let generation = profile::generation();
        if s.generation != generation {
            s.generation = generation;
            s.seen.clear();
        }
        let key = name.as_ptr() as usize;
        match s.seen.iter_mut().find(|(k, _)| *k == key) {
            Some((_, c)) if *c >= 2 => {}
            Some((_, c)) => {
                *c += 1;
                return true;
            }
            None => {
                s.seen.push((key, 1));
                return true;
            }
        }
        let mut x = s.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.rng = x;
        x % every as u64 == 0
    })
}

/// Records a timing event on `stream` now (the start of sampled work).
fn start_event(ordinal: usize, stream: sys::CUstream) -> Option<Arc<Pooled>> {
    let ev = take_event(ordinal)?;
    let start = Arc::new(Pooled {
        ordinal,
        ev: ev as usize,
    });
    // SAFETY: our event, a stream of the current context.
    unsafe { sys::cuEventRecord(ev, stream) }.result().ok()?;
    Some(start)
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
        let mut anchor = None;
        let mut start = None;
        let timed = timed && !dev.capturing();
        if device_timing() {
            let every = profile::device_sample_every();
            let launch = matches!(kind, Kind::Launch(_));
            if timed && launch && !sampled(name, every) {
                ev.sampled_out = true;
            } else if timed {
                anchor = self::anchor(dev);
                if every > 1 && anchor.is_some() {
                    // With sampling the stream's previous timing event is no start: time
                    // this work between two events of its own.
                    start = start_event(dev.ordinal(), stream);
                    anchor = anchor.filter(|_| start.is_some());
                }
            }
        }
        if start.is_some() || anchor.is_some() {
            // The start event and the anchor took time: the host span starts after them.
            ev.start_ns = now_ns();
        }
        Span {
            ev: Some(ev),
            anchor,
            start,
            ordinal: dev.ordinal(),
            stream,
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(mut ev) = self.ev.take() else { return };
        if let Some(anchor) = self.anchor {
            ev.timer = self.finish_timer(anchor, ev.start_ns);
        }
        ev.dur_ns = now_ns().saturating_sub(ev.start_ns);
        profile::record(ev);
    }
}

impl Span {
    /// Records the event after the work and pairs it with the stream's previous one.
    fn finish_timer(
        &mut self,
        anchor: (usize, u64),
        submit_ns: u64,
    ) -> Option<Box<dyn DeviceTimer>> {
        let ev = take_event(self.ordinal)?;
        let end = Arc::new(Pooled {
            ordinal: self.ordinal,
            ev: ev as usize,
        });
        if let Some(start) = self.start.take() {
            // SAFETY: our event, the stream the work went to (of the current context).
            unsafe { sys::cuEventRecord(ev, self.stream) }
                .result()
                .ok()?;
            return Some(Box::new(Timer {
                ordinal: self.ordinal,
                anchor,
                submit_ns,
                prev: Some(start),
                own_start: true,
                end,
            }));
        }
        let last = LAST.get(self.ordinal)?;
        let key = self.stream as usize;
        // Recording and noting the event under one lock keeps `prev` in stream order.
        let mut last = last.lock().unwrap();
        // SAFETY: our event, the stream the work went to (of the current context).
        unsafe { sys::cuEventRecord(ev, self.stream) }
            .result()
            .ok()?;
        let prev = match last.iter_mut().find(|(s, _)| *s == key) {
            Some((_, p)) => Some(std::mem::replace(p, end.clone())),
            None => {
                last.push((key, end.clone()));
                None
            }
        };
        Some(Box::new(Timer {
            ordinal: self.ordinal,
            anchor,
            submit_ns,
            prev,
            own_start: false,
            end,
        }))
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
    let in_use = dev.bytes_in_use() + bytes;
    profile::record_alloc(
        "alloc",
        device_name(dev),
        stream as u64,
        bytes as u64,
        in_use as u64,
    );
}
