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

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::{Error, Result};

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

// ---- records -----------------------------------------------------------------------------

/// What a launch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LaunchKind {
    /// One of the backend's own kernels.
    Kernel,
    /// A generated program of several fused ops.
    Fused,
    /// A kernel the user compiled.
    User,
    /// A BLAS call (cuBLAS): its kernels are the library's.
    Blas,
}

/// The direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// The kind of a [`Record`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A tensor-layer op span.
    Op,
    Launch(LaunchKind),
    Copy(CopyKind),
    Alloc,
    /// The host waiting for a device.
    Sync,
    /// A user range ([`range`]).
    Range,
}

impl Kind {
    /// A short label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Op => "op",
            Kind::Launch(LaunchKind::Kernel) => "kernel",
            Kind::Launch(LaunchKind::Fused) => "fused",
            Kind::Launch(LaunchKind::User) => "user kernel",
            Kind::Launch(LaunchKind::Blas) => "blas",
            Kind::Copy(CopyKind::HostToDevice) => "copy h2d",
            Kind::Copy(CopyKind::DeviceToHost) => "copy d2h",
            Kind::Copy(CopyKind::DeviceToDevice) => "copy d2d",
            Kind::Alloc => "alloc",
            Kind::Sync => "sync",
            Kind::Range => "range",
        }
    }
}

/// Where and when work ran on a device, on the profiler's host clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceTime {
    pub start_ns: u64,
    pub dur_ns: u64,
}

/// A handle to device timing that is not known yet (a pair of CUDA events): resolved when the
/// profile is collected, not when the work is enqueued.
pub trait DeviceTimer: Send + 'static {
    /// The device span, waiting for the work to finish if needed; `None` if unavailable.
    fn resolve(&mut self) -> Option<DeviceTime>;
}

/// What a backend reports ([`record`]); the profiler adds the thread, the enclosing op and the
/// user range.
pub struct Event {
    pub kind: Kind,
    /// Kernel, program or op name.
    pub name: Cow<'static, str>,
    /// Free text: dtype and shapes, or the ops a fused program contains.
    pub detail: String,
    /// The device, as it displays (`cpu`, `cuda:0`; see [`device_label`]).
    pub device: Cow<'static, str>,
    /// The stream (any id the backend chooses; 0 for none).
    pub stream: u64,
    /// Host start and duration ([`now_ns`]).
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Bytes copied or allocated.
    pub bytes: u64,
    /// Device memory in use after an allocation.
    pub mem_in_use: Option<u64>,
    /// Why this did not take the normal path (e.g. `"unfused"`), if it did not.
    pub fallback: Option<&'static str>,
    pub timer: Option<Box<dyn DeviceTimer>>,
    /// Device work left untimed by sampling ([`device_sample_every`]): its device time is
    /// estimated at collection from the timed records of the same kind, name and device.
    pub sampled_out: bool,
}

impl Event {
    /// An event of `kind` named `name` on `device`, starting now with no duration.
    pub fn new(
        kind: Kind,
        name: impl Into<Cow<'static, str>>,
        device: impl Into<Cow<'static, str>>,
    ) -> Self {
        Event {
            kind,
            name: name.into(),
            detail: String::new(),
            device: device.into(),
            stream: 0,
            start_ns: now_ns(),
            dur_ns: 0,
            bytes: 0,
            mem_in_use: None,
            fallback: None,
            timer: None,
            sampled_out: false,
        }
    }
}

/// One recorded event, as collected into a [`Profile`].
#[derive(Clone, Debug)]
pub struct Record {
    pub kind: Kind,
    pub name: Cow<'static, str>,
    pub detail: String,
    pub device: Cow<'static, str>,
    pub stream: u64,
    /// The profiler's id of the recording thread.
    pub thread: u64,
    pub start_ns: u64,
    pub dur_ns: u64,
    pub bytes: u64,
    pub mem_in_use: Option<u64>,
    pub fallback: Option<&'static str>,
    /// The innermost op span open on the thread when this was recorded (for an op span: the
    /// one around it).
    pub op: Option<&'static str>,
    /// The innermost user range's path (`"train/forward"`) when this was recorded.
    pub range: Option<Arc<str>>,
    /// How many op spans were open around this one.
    pub depth: u16,
    /// An elementwise op (for the "where did it run" listing).
    pub elementwise: bool,
    /// Device time, when the backend gave a timer and it resolved — or, when
    /// [`Record::device_estimated`], the mean of the timed records like it.
    pub device_time: Option<DeviceTime>,
    /// The device time is an estimate: this launch was not timed (sampling; see
    /// [`device_sample_every`]). Totals count it; the trace draws no device span for it.
    pub device_estimated: bool,
}

impl Record {
    /// A record of `kind` named `name` on `device`, every other field zero or empty (the
    /// recording paths fill in what they know).
    fn blank(kind: Kind, name: Cow<'static, str>, device: Cow<'static, str>) -> Record {
        Record {
            kind,
            name,
            detail: String::new(),
            device,
            stream: 0,
            thread: 0,
            start_ns: 0,
            dur_ns: 0,
            bytes: 0,
            mem_in_use: None,
            fallback: None,
            op: None,
            range: None,
            depth: 0,
            elementwise: false,
            device_time: None,
            device_estimated: false,
        }
    }
}

struct Raw {
    rec: Record,
    timer: Option<Box<dyn DeviceTimer>>,
}

struct ThreadBuf {
    /// The recording thread's id ([`Record::thread`]).
    id: u64,
    records: Mutex<Vec<Raw>>,
    allocs: Mutex<Vec<AllocRaw>>,
    spans: Mutex<Vec<SpanRaw>>,
}

/// A closed op span as the hot path records it (184 bytes, where a [`Raw`] with the op's detail
/// took 308; the detail stays numbers), made into a [`Record`] when collected.
struct SpanRaw {
    name: &'static str,
    device: Cow<'static, str>,
    /// The enclosing op span, and how many are open around this one.
    op: Option<&'static str>,
    depth: u16,
    elementwise: bool,
    start_ns: u64,
    dur_ns: u64,
    bytes: u64,
    detail: OpDetail,
    range: Option<Arc<str>>,
}

impl SpanRaw {
    fn record(&self, thread: u64) -> Record {
        Record {
            detail: self.detail.render(),
            thread,
            start_ns: self.start_ns,
            dur_ns: self.dur_ns,
            bytes: self.bytes,
            op: self.op,
            range: self.range.clone(),
            depth: self.depth,
            elementwise: self.elementwise,
            ..Record::blank(Kind::Op, Cow::Borrowed(self.name), self.device.clone())
        }
    }
}

/// An allocation as the hot path records it ([`record_alloc`]): 104 bytes instead of a
/// [`Raw`]'s 224, made into a [`Record`] when collected. A training step allocates for
/// almost every op (28 of the small MLP step's 72 records), so this is most of what profiling
/// a step writes.
struct AllocRaw {
    name: &'static str,
    device: &'static str,
    op: Option<&'static str>,
    start_ns: u64,
    stream: u64,
    bytes: u64,
    mem_in_use: u64,
    depth: u16,
    /// The user range, if any (rarely open: kept out of line).
    range: Option<Arc<str>>,
}

impl AllocRaw {
    fn record(&self, thread: u64) -> Record {
        Record {
            stream: self.stream,
            thread,
            start_ns: self.start_ns,
            bytes: self.bytes,
            mem_in_use: Some(self.mem_in_use),
            op: self.op,
            range: self.range.clone(),
            depth: self.depth,
            ..Record::blank(
                Kind::Alloc,
                Cow::Borrowed(self.name),
                Cow::Borrowed(self.device),
            )
        }
    }
}

static REGISTRY: Mutex<Vec<Arc<ThreadBuf>>> = Mutex::new(Vec::new());
static NEXT_THREAD: AtomicU64 = AtomicU64::new(0);

struct Local {
    id: u64,
    buf: Arc<ThreadBuf>,
    ops: Vec<&'static str>,
    ranges: Vec<Arc<str>>,
}

thread_local! {
    static LOCAL: RefCell<Option<Local>> = const { RefCell::new(None) };
}

fn with_local<R>(f: impl FnOnce(&mut Local) -> R) -> R {
    LOCAL.with(|l| {
        let mut l = l.borrow_mut();
        let l = l.get_or_insert_with(|| {
            let id = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            let buf = Arc::new(ThreadBuf {
                id,
                records: Mutex::new(Vec::new()),
                allocs: Mutex::new(Vec::new()),
                spans: Mutex::new(Vec::new()),
            });
            REGISTRY.lock().unwrap().push(buf.clone());
            Local {
                id,
                buf,
                ops: Vec::new(),
                ranges: Vec::new(),
            }
        });
        f(l)
    })
}

fn push(mut rec: Record, timer: Option<Box<dyn DeviceTimer>>) {
    with_local(|l| {
        rec.thread = l.id;
        let n = l.ops.len();
        rec.op = n.checked_sub(1).map(|i| l.ops[i]);
        rec.depth = n as u16;
        if rec.range.is_none() {
            rec.range = l.ranges.last().cloned();
        }
        l.buf.records.lock().unwrap().push(Raw { rec, timer });
    });
}

/// Records a backend event (nothing when the profiler is off).
pub fn record(ev: Event) {
    if !enabled() {
        return;
    }
    let rec = Record {
        detail: ev.detail,
        stream: ev.stream,
        start_ns: ev.start_ns,
        dur_ns: ev.dur_ns,
        bytes: ev.bytes,
        mem_in_use: ev.mem_in_use,
        fallback: ev.fallback,
        device_estimated: ev.sampled_out,
        ..Record::blank(ev.kind, ev.name, ev.device)
    };
    push(rec, ev.timer);
}

/// Records an allocation of `bytes` for `name` (an op, or `"alloc"`) on `device` (a label from
/// [`device_label`]) and `stream`, with `mem_in_use` bytes in use after it: what
/// `record(Event::new(Kind::Alloc, ..))` records, written compactly (nothing when the profiler
/// is off).
pub fn record_alloc(
    name: &'static str,
    device: &'static str,
    stream: u64,
    bytes: u64,
    mem_in_use: u64,
) {
    if !enabled() {
        return;
    }
    let start_ns = now_ns();
    with_local(|l| {
        let n = l.ops.len();
        let a = AllocRaw {
            name,
            device,
            op: n.checked_sub(1).map(|i| l.ops[i]),
            start_ns,
            stream,
            bytes,
            mem_in_use,
            depth: n as u16,
            range: l.ranges.last().cloned(),
        };
        l.buf.allocs.lock().unwrap().push(a);
    });
}

/// The name of the innermost op span open on this thread (backends name their events after
/// it when they have nothing better).
pub fn current_op() -> Option<&'static str> {
    if !enabled() {
        return None;
    }
    with_local(|l| l.ops.last().copied())
}

// ---- spans and ranges --------------------------------------------------------------------

/// An op's dtype and up to three operand shapes, kept as numbers while recording and turned
/// into text ([`Record::detail`], `f32 [100, 784] [784, 100]`) only when collected.
#[derive(Clone, Copy, Debug)]
pub struct OpDetail {
    dtype: crate::DType,
    n: u8,
    ranks: [u8; 3],
    dims: [[u32; 6]; 3],
    /// More operands, or more dims, than are kept.
    more: bool,
}

impl OpDetail {
    pub fn new(dtype: crate::DType) -> Self {
        OpDetail {
            dtype,
            n: 0,
            ranks: [0; 3],
            dims: [[0; 6]; 3],
            more: false,
        }
    }

    /// Adds an operand's shape.
    pub fn push(&mut self, dims: &[usize]) {
        let k = self.n as usize;
        if k == 3 || dims.len() > 6 {
            self.more = true;
            return;
        }
        for (d, &x) in self.dims[k].iter_mut().zip(dims) {
            *d = x.min(u32::MAX as usize) as u32;
        }
        self.ranks[k] = dims.len() as u8;
        self.n += 1;
    }

    fn render(&self) -> String {
        let mut s = self.dtype.to_string();
        for k in 0..self.n as usize {
            let dims: Vec<String> = self.dims[k][..self.ranks[k] as usize]
                .iter()
                .map(|d| d.to_string())
                .collect();
            let _ = write!(s, " [{}]", dims.join(", "));
        }
        if self.more {
            s.push_str(" ...");
        }
        s
    }
}

/// An open op span (see [`op`]); recorded when dropped.
pub struct OpSpan {
    name: &'static str,
    detail: OpDetail,
    device: Cow<'static, str>,
    bytes: u64,
    elementwise: bool,
    start_ns: u64,
    /// Closed on the thread that opened it (the op stack is per thread).
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Opens an op span named `name` on `device`: `detail` (dtype and shapes) and `bytes` (the
/// operands') describe it. The tensor layer calls this only when [`enabled`].
pub fn op(
    name: &'static str,
    device: impl Into<Cow<'static, str>>,
    detail: OpDetail,
    bytes: u64,
    elementwise: bool,
) -> OpSpan {
    with_local(|l| l.ops.push(name));
    OpSpan {
        name,
        detail,
        device: device.into(),
        bytes,
        elementwise,
        start_ns: now_ns(),
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for OpSpan {
    fn drop(&mut self) {
        let end = now_ns();
        with_local(|l| {
            // This span's own name is on top of the stack; its parent is the one below.
            let outer = l.ops.len().saturating_sub(1);
            let span = SpanRaw {
                name: self.name,
                device: std::mem::take(&mut self.device),
                op: outer.checked_sub(1).map(|i| l.ops[i]),
                depth: outer as u16,
                elementwise: self.elementwise,
                start_ns: self.start_ns,
                dur_ns: end.saturating_sub(self.start_ns),
                bytes: self.bytes,
                detail: self.detail,
                range: l.ranges.last().cloned(),
            };
            l.buf.spans.lock().unwrap().push(span);
            l.ops.pop();
        });
    }
}

/// A user range (see [`range`]); closed when dropped.
pub struct Range {
    open: Option<(Arc<str>, u64)>,
    /// Closed on the thread that opened it (the range stack is per thread).
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Opens a user-named range (`profile::range("forward")`): until the guard drops, every record
/// of this thread carries its path, and the range itself appears in the table and the trace.
/// Ranges nest (`"epoch/forward"`). Free when the profiler is off.
pub fn range(name: &str) -> Range {
    if !enabled() {
        return Range {
            open: None,
            _not_send: std::marker::PhantomData,
        };
    }
    let path: Arc<str> = with_local(|l| {
        let p: Arc<str> = match l.ranges.last() {
            Some(outer) => format!("{outer}/{name}").into(),
            None => name.into(),
        };
        l.ranges.push(p.clone());
        p
    });
    Range {
        open: Some((path, now_ns())),
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        let Some((path, start)) = self.open.take() else {
            return;
        };
        with_local(|l| {
            l.ranges.pop();
        });
        let rec = Record {
            start_ns: start,
            dur_ns: now_ns().saturating_sub(start),
            range: Some(path.clone()),
            ..Record::blank(Kind::Range, Cow::Owned(path.to_string()), "host".into())
        };
        push(rec, None);
    }
}

// ---- collecting --------------------------------------------------------------------------

/// Hooks that backends register to finish pending work before a profile is collected (e.g.
/// make sure timed events were enqueued). Called once per collection.
static FLUSH: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Registers `f` to run before every collection (idempotent per function).
pub fn on_collect(f: fn()) {
    let mut v = FLUSH.lock().unwrap();
    if !v.iter().any(|g| std::ptr::fn_addr_eq(*g, f)) {
        v.push(f);
    }
}

/// Every record that started at or after `since_ns`, device timers resolved; `clear` empties
/// the buffers afterwards.
fn collect(since_ns: u64, clear: bool) -> Vec<Record> {
    let hooks: Vec<fn()> = FLUSH.lock().unwrap().clone();
    for h in hooks {
        h();
    }
    let bufs: Vec<Arc<ThreadBuf>> = REGISTRY.lock().unwrap().clone();
    let mut out = Vec::new();
    for b in bufs {
        let mut v = b.records.lock().unwrap();
        for raw in v.iter_mut() {
            if raw.rec.start_ns < since_ns {
                continue;
            }
            if let Some(mut t) = raw.timer.take() {
                raw.rec.device_time = t.resolve();
            }
            out.push(raw.rec.clone());
        }
        if clear {
            v.clear();
        }
        drop(v);
        let mut a = b.allocs.lock().unwrap();
        out.extend(
            a.iter()
                .filter(|r| r.start_ns >= since_ns)
                .map(|r| r.record(b.id)),
        );
        if clear {
            a.clear();
        }
        drop(a);
        let mut sp = b.spans.lock().unwrap();
        out.extend(
            sp.iter()
                .filter(|r| r.start_ns >= since_ns)
                .map(|r| r.record(b.id)),
        );
        if clear {
            sp.clear();
        }
    }
    if clear {
        prune();
    }
    estimate_sampled(&mut out);
    out.sort_by_key(|r| (r.start_ns, r.thread));
    out
}

/// Gives each record that sampling left untimed the mean device time of the timed records of
/// the same kind, name and device (none if no such record was timed).
fn estimate_sampled(recs: &mut [Record]) {
    if !recs.iter().any(|r| r.device_estimated) {
        return;
    }
    let mut timed: BTreeMap<(Kind, &str, &str), (u64, u64)> = BTreeMap::new();
    for r in recs.iter().filter(|r| !r.device_estimated) {
        if let Some(d) = r.device_time {
            let e = timed.entry((r.kind, &r.name, &r.device)).or_default();
            *e = (e.0 + d.dur_ns, e.1 + 1);
        }
    }
    let means: Vec<Option<u64>> = recs
        .iter()
        .map(|r| {
            r.device_estimated
                .then(|| timed.get(&(r.kind, &*r.name, &*r.device)))
                .flatten()
                .map(|&(sum, n)| sum / n)
        })
        .collect();
    for (r, m) in recs.iter_mut().zip(means) {
        if let Some(dur_ns) = m {
            r.device_time = Some(DeviceTime {
                start_ns: r.start_ns,
                dur_ns,
            });
        }
    }
}

fn clear_all() {
    let bufs: Vec<Arc<ThreadBuf>> = REGISTRY.lock().unwrap().clone();
    for b in bufs {
        b.records.lock().unwrap().clear();
        b.allocs.lock().unwrap().clear();
        b.spans.lock().unwrap().clear();
    }
    prune();
}

/// Forgets the buffers of threads that have exited (only the registry holds them) once they
/// are empty.
fn prune() {
    REGISTRY.lock().unwrap().retain(|b| {
        Arc::strong_count(b) > 1
            || !b.records.lock().unwrap().is_empty()
            || !b.allocs.lock().unwrap().is_empty()
            || !b.spans.lock().unwrap().is_empty()
    });
}

/// A profiling scope (see [`start`]).
pub struct Session {
    start_ns: u64,
    active: bool,
}

/// Starts recording (whatever `KILN_PROFILE` says) until [`Session::finish`] or drop.
pub fn start() -> Session {
    GENERATION.fetch_add(1, Ordering::Relaxed);
    SESSIONS.fetch_add(1, Ordering::SeqCst);
    refresh_state();
    Session {
        start_ns: now_ns(),
        active: true,
    }
}

impl Session {
    /// Stops this scope and returns what was recorded since it started (on every thread).
    pub fn finish(mut self) -> Profile {
        // Collect before stopping: the last session to stop empties the buffers, and must not
        // do so before every other one has its records.
        let p = Profile::new(collect(self.start_ns, false));
        self.stop();
        if SESSIONS.load(Ordering::SeqCst) == 0 && !env_on() {
            clear_all();
        }
        p
    }

    fn stop(&mut self) {
        if std::mem::take(&mut self.active) {
            SESSIONS.fetch_sub(1, Ordering::SeqCst);
            refresh_state();
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `f` with the profiler on and returns its result and what it recorded.
pub fn profile<R>(f: impl FnOnce() -> R) -> (R, Profile) {
    let s = start();
    let r = f();
    (r, s.finish())
}

/// With `KILN_PROFILE=1`: collects everything recorded so far (and forgets it), prints the
/// table, the "where did it run" listing and the memory view to stderr, writes the Chrome
/// trace to `KILN_PROFILE_TRACE` if that is set, and returns the profile. `None` (and nothing
/// printed) when the variable is not set.
pub fn report() -> Option<Profile> {
    if !env_on() {
        return None;
    }
    let p = Profile::new(collect(0, true));
    eprintln!("{p}");
    if let Ok(path) = std::env::var("KILN_PROFILE_TRACE") {
        match p.export_chrome_trace(&path) {
            Ok(()) => eprintln!("kiln profile: Chrome trace written to {path}"),
            Err(e) => eprintln!("kiln profile: {e}"),
        }
    }
    Some(p)
}

// ---- the profile -------------------------------------------------------------------------

/// One row of [`Profile::key_averages`]: every record of one kind and name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub name: String,
    /// [`Kind::label`].
    pub kind: &'static str,
    pub calls: u64,
    pub host_ns: u64,
    /// Device time: of the record itself (launches, copies), or for an op of every launch and
    /// copy made inside it.
    pub device_ns: u64,
    /// Bytes copied (copies) or read (ops: their operands).
    pub bytes: u64,
    /// Bytes allocated (inside an op, or by the allocation itself).
    pub alloc_bytes: u64,
}

/// Where the time went, in total.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Device time of launches, plus the host time of ops on host devices (the CPU computes
    /// on the host).
    pub compute_ns: u64,
    /// Copies: device time where timed, host time otherwise.
    pub transfer_ns: u64,
    /// Host time waiting for devices.
    pub sync_ns: u64,
    /// Host time of top-level ops on devices that is not spent waiting or copying: the
    /// framework's own cost (validation, dispatch, launching).
    pub overhead_ns: u64,
    /// Host time of top-level ops.
    pub host_ns: u64,
}

/// Peak and current device memory seen by allocations, for one op kind or user range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemRow {
    pub name: String,
    pub device: String,
    pub allocs: u64,
    pub alloc_bytes: u64,
    /// Highest memory in use right after one of its allocations.
    pub peak: u64,
    /// Memory in use after its last allocation.
    pub current: u64,
}

/// The records of one profiling run, and the views over them.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    records: Vec<Record>,
}

/// Whether a device name (as it displays) is host memory: `cpu`, `cpu:N`, the reference
/// backend's `ref`, `ref:N`, or `host`. Ops there compute on the host.
pub fn is_host_device(d: &str) -> bool {
    let base = d.split(':').next().unwrap_or(d);
    matches!(base, "cpu" | "ref" | "host")
}

fn is_transfer_op(name: &str) -> bool {
    matches!(
        name,
        "from_host"
            | "from_slice"
            | "to_host"
            | "copy_to_slice"
            | "to_backend"
            | "copy_to"
            | "copy_from"
            | "pin_memory"
            | "full"
            | "rand"
    )
}

impl Profile {
    fn new(records: Vec<Record>) -> Self {
        Profile { records }
    }

    /// Every record, by start time.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// The records made inside the user range `name` (a path such as `"train/forward"`, or
    /// its first part), the range itself included: a view of one part of a program, and what
    /// tests use to ignore other threads' work.
    pub fn in_range(&self, name: &str) -> Profile {
        let inside = |r: &Record| {
            r.range.as_deref().is_some_and(|p| {
                p == name || (p.starts_with(name) && p.as_bytes().get(name.len()) == Some(&b'/'))
            })
        };
        Profile::new(self.records.iter().filter(|r| inside(r)).cloned().collect())
    }

    /// The records of `kind` named `name`.
    pub fn find<'a>(&'a self, kind: Kind, name: &'a str) -> impl Iterator<Item = &'a Record> {
        self.records
            .iter()
            .filter(move |r| r.kind == kind && r.name == name)
    }

    /// One row per kind and name (PyTorch's `key_averages`), sorted by time (the larger of host
    /// and device), largest first.
    pub fn key_averages(&self) -> Vec<Row> {
        let mut rows: BTreeMap<(Kind, &str), Row> = BTreeMap::new();
        let mut op_dev: BTreeMap<&str, u64> = BTreeMap::new();
        let mut op_alloc: BTreeMap<&str, u64> = BTreeMap::new();
        for r in &self.records {
            // Allocations are one row (each op's also show in its Allocated column).
            let name: &str = if r.kind == Kind::Alloc {
                "alloc"
            } else {
                &r.name
            };
            let row = rows.entry((r.kind, name)).or_insert_with(|| Row {
                name: name.to_string(),
                kind: r.kind.label(),
                ..Default::default()
            });
            row.calls += 1;
            row.host_ns += r.dur_ns;
            row.bytes += if r.kind == Kind::Alloc { 0 } else { r.bytes };
            if let Some(d) = r.device_time {
                row.device_ns += d.dur_ns;
            }
            if r.kind == Kind::Alloc {
                row.alloc_bytes += r.bytes;
            }
            if let Some(op) = r.op {
                match r.kind {
                    Kind::Launch(_) | Kind::Copy(_) => {
                        *op_dev.entry(op).or_default() += r.device_time.map_or(0, |d| d.dur_ns)
                    }
                    Kind::Alloc => *op_alloc.entry(op).or_default() += r.bytes,
                    _ => {}
                }
            }
        }
        let mut out: Vec<Row> = rows
            .into_iter()
            .map(|((kind, name), mut row)| {
                if kind == Kind::Op {
                    row.device_ns += op_dev.get(name).copied().unwrap_or(0);
                    row.alloc_bytes += op_alloc.get(name).copied().unwrap_or(0);
                }
                row
            })
            .collect();
        out.sort_by(|a, b| {
            b.host_ns
                .max(b.device_ns)
                .cmp(&a.host_ns.max(a.device_ns))
                .then_with(|| a.name.cmp(&b.name))
        });
        out
    }

    /// The row of kind `kind` named `name`, if any.
    pub fn row(&self, kind: Kind, name: &str) -> Option<Row> {
        self.key_averages()
            .into_iter()
            .find(|r| r.kind == kind.label() && r.name == name)
    }

    /// Where the time went (see [`Totals`]).
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        let mut inside = 0u64;
        for r in &self.records {
            match r.kind {
                Kind::Op if r.depth == 0 => {
                    t.host_ns += r.dur_ns;
                    if is_host_device(&r.device) {
                        t.compute_ns += r.dur_ns;
                    } else {
                        t.overhead_ns += r.dur_ns;
                    }
                }
                Kind::Launch(_) => t.compute_ns += r.device_time.map_or(0, |d| d.dur_ns),
                Kind::Copy(_) => {
                    t.transfer_ns += r.device_time.map_or(r.dur_ns, |d| d.dur_ns);
                    if r.depth > 0 && !is_host_device(&r.device) {
                        inside += r.dur_ns;
                    }
                }
                Kind::Sync => {
                    t.sync_ns += r.dur_ns;
                    if r.depth > 0 && !is_host_device(&r.device) {
                        inside += r.dur_ns;
                    }
                }
                _ => {}
            }
        }
        t.overhead_ns = t.overhead_ns.saturating_sub(inside);
        t
    }

    /// The key-averages table as text.
    pub fn table(&self) -> String {
        let rows = self.key_averages();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<34} {:<11} {:>7} {:>11} {:>10} {:>11} {:>10} {:>10} {:>10} {:>10}",
            "Name",
            "Type",
            "Calls",
            "Host total",
            "Host mean",
            "Dev total",
            "Dev mean",
            "Bytes",
            "Rate",
            "Allocated"
        );
        let _ = writeln!(s, "{}", "-".repeat(132));
        for r in &rows {
            let time = if r.device_ns > 0 {
                r.device_ns
            } else {
                r.host_ns
            };
            let rate = if r.bytes > 0 && time > 0 {
                format!("{:.2}GB/s", r.bytes as f64 / time as f64)
            } else {
                String::new()
            };
            let n = r.calls.max(1);
            let _ = writeln!(
                s,
                "{:<34} {:<11} {:>7} {:>11} {:>10} {:>11} {:>10} {:>10} {:>10} {:>10}",
                clip(&r.name, 34),
                r.kind,
                r.calls,
                fmt_ns(r.host_ns),
                fmt_ns(r.host_ns / n),
                if r.device_ns > 0 {
                    fmt_ns(r.device_ns)
                } else {
                    "-".into()
                },
                if r.device_ns > 0 {
                    fmt_ns(r.device_ns / n)
                } else {
                    "-".into()
                },
                fmt_bytes(r.bytes),
                rate,
                fmt_bytes(r.alloc_bytes),
            );
        }
        let t = self.totals();
        let _ = writeln!(
            s,
            "Totals: ops (top level, host) {} | device compute {} | transfers {} | sync waits {} | framework overhead {}",
            fmt_ns(t.host_ns),
            fmt_ns(t.compute_ns),
            fmt_ns(t.transfer_ns),
            fmt_ns(t.sync_ns),
            fmt_ns(t.overhead_ns)
        );
        let launches = self
            .records
            .iter()
            .filter(|r| matches!(r.kind, Kind::Launch(_)));
        let (n, est) = launches.fold((0, 0), |(n, e), r| (n + 1, e + r.device_estimated as u64));
        if est > 0 {
            let _ = writeln!(
                s,
                "Device times of launches: {} of {n} timed (1 in {} sampled at random; \
                 KILN_PROFILE_SAMPLE=1 times every launch), the rest estimated from their name's mean",
                n - est,
                device_sample_every()
            );
        }
        s
    }

    /// Theano's "did it run on the GPU?": per op, the devices it ran on, what it launched and
    /// whether it fell back (a host copy inside a compute op, an elementwise op launched on
    /// its own instead of fused, or a backend-reported fallback).
    pub fn where_ran(&self) -> String {
        #[derive(Default)]
        struct W {
            devices: std::collections::BTreeSet<String>,
            calls: u64,
            launches: BTreeMap<&'static str, u64>,
            fallback: std::collections::BTreeSet<String>,
            elementwise: bool,
        }
        let mut m: BTreeMap<&str, W> = BTreeMap::new();
        for r in &self.records {
            match r.kind {
                Kind::Op => {
                    let w = m.entry(&r.name).or_default();
                    w.calls += 1;
                    w.devices.insert(r.device.to_string());
                    w.elementwise |= r.elementwise;
                }
                Kind::Launch(_) | Kind::Copy(_) => {
                    let Some(op) = r.op else { continue };
                    let w = m.entry(op).or_default();
                    *w.launches.entry(r.kind.label()).or_default() += 1;
                    if let Some(f) = r.fallback {
                        w.fallback.insert(f.to_string());
                    }
                    if matches!(
                        r.kind,
                        Kind::Copy(CopyKind::DeviceToHost | CopyKind::HostToDevice)
                    ) && !is_transfer_op(op)
                    {
                        w.fallback.insert("host copy".into());
                    }
                }
                _ => {}
            }
        }
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<24} {:>7}  {:<14} {:<36} fallback",
            "Op", "Calls", "Device", "Ran as"
        );
        for (name, mut w) in m {
            if w.calls == 0 {
                continue;
            }
            let on_gpu = w.devices.iter().any(|d| !is_host_device(d));
            if on_gpu && w.elementwise && w.launches.contains_key("kernel") {
                w.fallback.insert("unfused".into());
            }
            let ran = if w.launches.is_empty() {
                if on_gpu && w.elementwise {
                    "deferred (fused later)".to_string()
                } else if on_gpu {
                    "no launch".into()
                } else {
                    "host".into()
                }
            } else {
                w.launches
                    .iter()
                    .map(|(k, n)| format!("{k} x{n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let fb = if w.fallback.is_empty() {
                "-".to_string()
            } else {
                format!(
                    "YES: {}",
                    w.fallback.into_iter().collect::<Vec<_>>().join(", ")
                )
            };
            let devs: Vec<String> = w.devices.into_iter().collect();
            let _ = writeln!(
                s,
                "{:<24} {:>7}  {:<14} {:<36} {}",
                clip(name, 24),
                w.calls,
                devs.join(","),
                clip(&ran, 36),
                fb
            );
        }
        let fused: std::collections::BTreeSet<&str> = self
            .records
            .iter()
            .filter(|r| r.kind == Kind::Launch(LaunchKind::Fused) && !r.detail.is_empty())
            .map(|r| r.detail.as_str())
            .collect();
        if !fused.is_empty() {
            let _ = writeln!(s, "Fused programs:");
            for f in fused {
                let _ = writeln!(s, "  {f}");
            }
        }
        s
    }

    /// Chainer's memory hook: per op kind and per user range, the allocations made inside and
    /// the device memory in use after them (peak and latest).
    pub fn memory(&self) -> Vec<MemRow> {
        let mut m: BTreeMap<(String, String), MemRow> = BTreeMap::new();
        for r in self.records.iter().filter(|r| r.kind == Kind::Alloc) {
            let mut keys = vec![format!("op {}", r.op.unwrap_or("(no op)"))];
            if let Some(range) = &r.range {
                // The allocation counts for its range and every range around it.
                let mut p = String::new();
                for part in range.split('/') {
                    if !p.is_empty() {
                        p.push('/');
                    }
                    p.push_str(part);
                    keys.push(format!("range {p}"));
                }
            }
            for k in keys {
                let e = m
                    .entry((k.clone(), r.device.to_string()))
                    .or_insert_with(|| MemRow {
                        name: k,
                        device: r.device.to_string(),
                        ..Default::default()
                    });
                e.allocs += 1;
                e.alloc_bytes += r.bytes;
                if let Some(u) = r.mem_in_use {
                    e.peak = e.peak.max(u);
                    e.current = u;
                }
            }
        }
        let mut v: Vec<MemRow> = m.into_values().collect();
        v.sort_by(|a, b| b.peak.cmp(&a.peak).then(b.alloc_bytes.cmp(&a.alloc_bytes)));
        v
    }

    fn memory_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<40} {:<8} {:>8} {:>11} {:>11} {:>11}",
            "Memory: op / range", "Device", "Allocs", "Allocated", "Peak", "Current"
        );
        for r in self.memory() {
            let _ = writeln!(
                s,
                "{:<40} {:<8} {:>8} {:>11} {:>11} {:>11}",
                clip(&r.name, 40),
                r.device,
                r.allocs,
                fmt_bytes(r.alloc_bytes),
                fmt_bytes(r.peak),
                fmt_bytes(r.current)
            );
        }
        s
    }

    /// The trace in Chrome's JSON format (`chrome://tracing`, Perfetto): host spans on one
    /// track per thread (process "host"), device spans on one process per device with one
    /// track per stream, user ranges as begin/end pairs on their thread, memory in use as
    /// counters.
    pub fn chrome_trace_json(&self) -> String {
        let mut pids: BTreeMap<&str, u64> = BTreeMap::new();
        let mut tids: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        let mut ev: Vec<String> = Vec::new();
        let us = |ns: u64| format!("{:.3}", ns as f64 / 1e3);
        ev.push(
            r#"{"ph":"M","name":"process_name","pid":0,"tid":0,"args":{"name":"host"}}"#.into(),
        );
        for r in &self.records {
            let name = match r.kind {
                Kind::Launch(LaunchKind::Fused) if !r.detail.is_empty() => {
                    format!("{} [{}]", r.name, r.detail)
                }
                _ => r.name.to_string(),
            };
            let mut args = format!(
                r#""kind":{},"device":{}"#,
                json_str(r.kind.label()),
                json_str(&r.device)
            );
            if !r.detail.is_empty() {
                let _ = write!(args, r#","detail":{}"#, json_str(&r.detail));
            }
            if r.bytes > 0 {
                let _ = write!(args, r#","bytes":{}"#, r.bytes);
            }
            if let Some(op) = r.op {
                let _ = write!(args, r#","op":{}"#, json_str(op));
            }
            if let Some(f) = r.fallback {
                let _ = write!(args, r#","fallback":{}"#, json_str(f));
            }
            let cat = json_str(r.kind.label());
            let n = json_str(&name);
            if r.kind == Kind::Range {
                ev.push(format!(
                    r#"{{"ph":"B","name":{n},"cat":{cat},"pid":0,"tid":{},"ts":{}}}"#,
                    r.thread,
                    us(r.start_ns)
                ));
                ev.push(format!(
                    r#"{{"ph":"E","name":{n},"cat":{cat},"pid":0,"tid":{},"ts":{}}}"#,
                    r.thread,
                    us(r.start_ns + r.dur_ns)
                ));
                continue;
            }
            ev.push(format!(
                r#"{{"ph":"X","name":{n},"cat":{cat},"pid":0,"tid":{},"ts":{},"dur":{},"args":{{{args}}}}}"#,
                r.thread,
                us(r.start_ns),
                us(r.dur_ns)
            ));
            if let (Some(u), Kind::Alloc) = (r.mem_in_use, r.kind) {
                ev.push(format!(
                    r#"{{"ph":"C","name":{},"pid":0,"tid":0,"ts":{},"args":{{"bytes":{u}}}}}"#,
                    json_str(&format!("memory in use {}", r.device)),
                    us(r.start_ns + r.dur_ns)
                ));
            }
            if let (Some(d), false) = (r.device_time, r.device_estimated) {
                let next = pids.len() as u64 + 1;
                let pid = *pids.entry(&r.device).or_insert(next);
                let next = tids.keys().filter(|k| k.0 == pid).count() as u64;
                let tid = *tids.entry((pid, r.stream)).or_insert(next);
                ev.push(format!(
                    r#"{{"ph":"X","name":{n},"cat":{cat},"pid":{pid},"tid":{tid},"ts":{},"dur":{},"args":{{{args}}}}}"#,
                    us(d.start_ns),
                    us(d.dur_ns)
                ));
            }
        }
        for (dev, pid) in &pids {
            ev.push(format!(
                r#"{{"ph":"M","name":"process_name","pid":{pid},"tid":0,"args":{{"name":{}}}}}"#,
                json_str(dev)
            ));
        }
        for ((pid, stream), tid) in &tids {
            ev.push(format!(
                r#"{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},"args":{{"name":{}}}}}"#,
                json_str(&format!("stream {stream:#x}"))
            ));
        }
        format!(
            "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n{}\n]}}\n",
            ev.join(",\n")
        )
    }

    /// Writes [`Profile::chrome_trace_json`] to `path`.
    pub fn export_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.chrome_trace_json()).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "== kiln profile: {} records ==", self.records.len())?;
        writeln!(f, "{}", self.table())?;
        writeln!(f, "== where did it run ==")?;
        writeln!(f, "{}", self.where_ran())?;
        write!(f, "== memory ==\n{}", self.memory_text())
    }
}

fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    let mut c: String = s.chars().take(n - 1).collect();
    c.push('…');
    c
}

fn fmt_ns(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns}ns"),
        1_000..1_000_000 => format!("{:.2}us", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2}ms", ns as f64 / 1e6),
        _ => format!("{:.3}s", ns as f64 / 1e9),
    }
}

fn fmt_bytes(b: u64) -> String {
    match b {
        0 => "-".into(),
        1..1024 => format!("{b}B"),
        1024..1_048_576 => format!("{:.1}KiB", b as f64 / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1}MiB", b as f64 / 1_048_576.0),
        _ => format!("{:.2}GiB", b as f64 / 1_073_741_824.0),
    }
}

/// `s` as a JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Tests that need the module's private state; the rest (they use the reference backend and
/// `test_profile`, which sit above this module) are in `tests/profile.rs`.
#[cfg(test)]
mod tests {
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
            with_local(|l| l.id)
        };
        let workers: Vec<_> = (0..3)
            .map(|i| {
                std::thread::spawn(move || {
                    let _r = range("threads-worker");
                    let mut ev = Event::new(Kind::Copy(CopyKind::HostToDevice), "upload", "gpu:3");
                    ev.bytes = 100 + i;
                    record(ev);
                    with_local(|l| l.id)
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
