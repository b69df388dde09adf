//! Records and the hot path that writes them: per-thread buffers, backend events, allocations,
//! op spans and user ranges.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{enabled, now_ns};

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
    /// The device, as it displays (`cpu`, `cuda:0`; see [`device_label`](super::device_label)).
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
    /// Device work left untimed by sampling ([`device_sample_every`](super::device_sample_every)): its device time is
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

/// One recorded event, as collected into a [`Profile`](super::Profile).
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
    /// [`device_sample_every`](super::device_sample_every)). Totals count it; the trace draws no device span for it.
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

pub(super) struct Raw {
    pub(super) rec: Record,
    pub(super) timer: Option<Box<dyn DeviceTimer>>,
}

pub(super) struct ThreadBuf {
    /// The recording thread's id ([`Record::thread`]).
    pub(super) id: u64,
    pub(super) records: Mutex<Vec<Raw>>,
    pub(super) allocs: Mutex<Vec<AllocRaw>>,
    pub(super) spans: Mutex<Vec<SpanRaw>>,
}

/// A closed op span as the hot path records it (184 bytes, where a [`Raw`] with the op's detail
/// took 308; the detail stays numbers), made into a [`Record`] when collected.
pub(super) struct SpanRaw {
    name: &'static str,
    device: Cow<'static, str>,
    /// The enclosing op span, and how many are open around this one.
    op: Option<&'static str>,
    depth: u16,
    elementwise: bool,
    pub(super) start_ns: u64,
    dur_ns: u64,
    bytes: u64,
    detail: OpDetail,
    range: Option<Arc<str>>,
}

impl SpanRaw {
    pub(super) fn record(&self, thread: u64) -> Record {
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
pub(super) struct AllocRaw {
    name: &'static str,
    device: &'static str,
    op: Option<&'static str>,
    pub(super) start_ns: u64,
    stream: u64,
    bytes: u64,
    mem_in_use: u64,
    depth: u16,
    /// The user range, if any (rarely open: kept out of line).
    range: Option<Arc<str>>,
}

impl AllocRaw {
    pub(super) fn record(&self, thread: u64) -> Record {
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

pub(super) static REGISTRY: Mutex<Vec<Arc<ThreadBuf>>> = Mutex::new(Vec::new());
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
/// [`device_label`](super::device_label)) and `stream`, with `mem_in_use` bytes in use after it: what
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

/// The calling thread's id as its records carry it ([`Record::thread`]).
#[cfg(test)]
pub(super) fn thread_id() -> u64 {
    with_local(|l| l.id)
}
