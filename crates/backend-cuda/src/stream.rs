//! Streams and events for users (CuPy's `Stream`/`Event`, `torch.cuda.stream`).
//!
//! Every kiln op on a GPU goes to the calling thread's *current stream* of that device: the
//! device's default stream, or a [`Stream`] made current with [`Stream::scope`] /
//! [`Stream::enter`]. Work on different streams may run concurrently; ordering between them is
//! the user's, with [`Event`]s ([`Stream::wait_event`], [`Stream::wait_stream`]), as in every
//! CUDA framework. What kiln guarantees on its own:
//!
//! - memory is never reused while another stream may still use it: a tensor allocated on
//!   stream A and used on stream B is recycled only after B's work has passed (see
//!   `memory.rs`; PyTorch needs `record_stream` for this);
//! - deferred (fused) elementwise work launches on the stream that was current when it was
//!   recorded, and a read from another stream waits for it;
//! - copies from the host are ordered before every later use on the stream that asked for them
//!   (from pinned memory, before the first use on any stream, and nothing else waits for them).
//!
//! ```no_run
//! # use kiln_backend_cuda::{Cuda, CudaDevice, Stream, Event};
//! # use kiln_core::{DType, Tensor};
//! # fn main() -> kiln_core::Result<()> {
//! let dev = CudaDevice::new(0);
//! let s = Stream::new(&dev)?;
//! let x = Tensor::<Cuda>::ones([1024, 1024], DType::F32, &dev)?;
//! let (start, end) = (Event::timing(&dev)?, Event::timing(&dev)?);
//! let y = s.scope(|| {
//!     start.record()?;
//!     let y = x.matmul(&x)?;
//!     end.record()?;
//!     Ok::<_, kiln_core::Error>(y)
//! })?;
//! Stream::current(&dev)?.wait_stream(&s)?; // later default-stream work sees `y`
//! println!("{} ms", start.elapsed_ms(&end)?);
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use cudarc::driver::sys::{self, CUresult};
use kiln_core::{DType, Error, Result, Tensor};

use crate::device::{DeviceState, check, set_current_stream, state};
use crate::types::Cuda;
use crate::types::CudaDevice;

struct Raw {
    dev: &'static DeviceState,
    stream: sys::CUstream,
    /// Created by [`Stream::with_priority`] (returned to the device's spares on drop, with
    /// this priority), or a device's default stream (`None`).
    owned: Option<i32>,
}
// SAFETY: a stream handle is valid from any thread (with its context bound, which every use
// below ensures).
unsafe impl Send for Raw {}
// SAFETY: as above; the driver's stream calls are thread-safe.
unsafe impl Sync for Raw {}

impl Drop for Raw {
    fn drop(&mut self) {
        // Not destroyed but kept for the next `Stream::new`, as PyTorch keeps a pool of
        // streams: a tensor used on this stream may outlive the `Stream` (an NCCL
        // communicator's output, a user's scope), and its free records an event here.
        // Destroying the stream made that record a use after free (SIGSEGV at exit).
        if let Some(priority) = self.owned {
            self.dev.streams().put_spare(priority, self.stream);
        }
    }
}

/// A CUDA stream of one device: a queue of work that runs in order. Cheap to clone.
#[derive(Clone)]
pub struct Stream {
    raw: Arc<Raw>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:p} on {})", self.raw.stream, self.device())
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.raw.stream == other.raw.stream
    }
}

impl Stream {
    /// A new stream on `dev` that does not synchronize with the default stream.
    ///
    /// Streams are pooled per device, as in PyTorch: the CUDA stream of a dropped `Stream` is
    /// kept and handed out again (tensors it touched may still record events on it when they
    /// are freed). Work still queued from its earlier use runs before new work, as on any
    /// stream.
    pub fn new(dev: &CudaDevice) -> Result<Stream> {
        Self::with_priority(dev, 0)
    }

    /// A new stream with a scheduling priority (lower numbers run first; the device's range is
    /// typically -5..=0, and values outside it are clamped by the driver).
    pub fn with_priority(dev: &CudaDevice, priority: i32) -> Result<Stream> {
        let st = state(dev)?;
        let s = match st.streams().take_spare(priority) {
            Some(s) => s,
            None => {
                let mut s = std::ptr::null_mut();
                // SAFETY: valid out-pointer; the device's context is current (bound by
                // `state`).
                check(
                    unsafe {
                        sys::cuStreamCreateWithPriority(
                            &mut s,
                            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                            priority,
                        )
                    },
                    "Stream::new",
                )?;
                s
            }
        };
        Ok(Stream {
            raw: Arc::new(Raw {
                dev: st,
                stream: s,
                owned: Some(priority),
            }),
        })
    }

    /// The device's default stream (where kiln works outside any scope).
    pub fn default_stream(dev: &CudaDevice) -> Result<Stream> {
        let st = state(dev)?;
        Ok(Self::wrap(st, st.default_stream()))
    }

    /// The calling thread's current stream on `dev`.
    pub fn current(dev: &CudaDevice) -> Result<Stream> {
        let st = state(dev)?;
        Ok(Self::wrap(st, st.stream()))
    }

    fn wrap(dev: &'static DeviceState, stream: sys::CUstream) -> Stream {
        Stream {
            raw: Arc::new(Raw {
                dev,
                stream,
                owned: None,
            }),
        }
    }

    pub fn device(&self) -> CudaDevice {
        self.raw.dev.device()
    }

    /// The raw `CUstream`, for interop with other CUDA libraries.
    pub fn as_raw(&self) -> sys::CUstream {
        self.raw.stream
    }

    /// Runs `f` with this stream current on its device for the calling thread (PyTorch's
    /// `with torch.cuda.stream(s):`), then restores the previous one, also if `f` panics.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        let _g = self.enter();
        f()
    }

    /// Makes this stream current on its device until the guard drops.
    pub fn enter(&self) -> StreamGuard {
        let prev = set_current_stream(self.raw.dev.ordinal(), self.raw.stream);
        StreamGuard {
            stream: self.clone(),
            prev,
        }
    }

    /// Waits on the host until all work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.raw.dev.bind()?;
        if self.raw.stream == self.raw.dev.stream() {
            self.raw
                .dev
                .refuse_in_capture("Stream::synchronize", "waiting for the device")?;
        }
        let _prof = crate::profile::sync(self.raw.dev, "Stream::synchronize");
        // SAFETY: a live stream of the bound context.
        check(
            unsafe { sys::cuStreamSynchronize(self.raw.stream) },
            "Stream::synchronize",
        )?;
        self.raw.dev.sweep_in_flight();
        Ok(())
    }

    /// Whether all work queued on this stream has finished (never blocks).
    pub fn query(&self) -> Result<bool> {
        self.raw.dev.bind()?;
        // SAFETY: a live stream of the bound context.
        match unsafe { sys::cuStreamQuery(self.raw.stream) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => check(e, "Stream::query").map(|_| false),
        }
    }

    /// Makes later work on this stream wait until `event`'s recorded work has finished (an
    /// event of another device is allowed: that is how two GPUs' streams are ordered).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.raw.dev.bind()?;
        // SAFETY: a live stream and a live event; waiting on another context's event is
        // allowed by the driver.
        check(
            unsafe { sys::cuStreamWaitEvent(self.raw.stream, event.raw, 0) },
            "Stream::wait_event",
        )
    }

    /// Makes later work on this stream wait for everything queued on `other` so far.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        if other.raw.stream == self.raw.stream {
            return Ok(());
        }
        let e = Event::new(&other.device())?;
        e.record_on(other)?;
        self.wait_event(&e)
    }

    /// Records a new event on this stream.
    pub fn record_event(&self) -> Result<Event> {
        let e = Event::new(&self.device())?;
        e.record_on(self)?;
        Ok(e)
    }

    /// Tells the allocator that `t`'s memory is used by work on this stream, so it is not
    /// reused before that work has passed. kiln notes every use it makes itself; this is for
    /// memory that other code reads on this stream (through [`crate::CudaStorage::device_ptr`],
    /// a raw kernel or a library). An error when `t` lives on another device.
    pub fn record_tensor(&self, t: &Tensor<Cuda>) -> Result<()> {
        check_device("record_tensor", self.device(), *t.device())?;
        t.storage().buffer()?.mark_used(self.raw.stream)?;
        Ok(())
    }

    /// Runs `f` with this stream current, after checking that every tensor in `inputs` lives
    /// on this stream's device (a typed error naming both devices otherwise).
    pub fn scope_with<R>(
        &self,
        inputs: &[&Tensor<Cuda>],
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        for t in inputs {
            check_device("Stream::scope_with", self.device(), *t.device())?;
        }
        self.scope(f)
    }
}

fn check_device(op: &'static str, stream_dev: CudaDevice, tensor_dev: CudaDevice) -> Result<()> {
    if stream_dev != tensor_dev {
        return Err(Error::DeviceMismatch {
            op,
            lhs: format!("a stream of {stream_dev}"),
            rhs: format!("a tensor on {tensor_dev}"),
        });
    }
    Ok(())
}

/// Restores the previous current stream when dropped (see [`Stream::enter`]).
pub struct StreamGuard {
    stream: Stream,
    prev: sys::CUstream,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        set_current_stream(self.stream.raw.dev.ordinal(), self.prev);
    }
}

/// A CUDA event: a point in a stream's work to wait for, query, or time.
pub struct Event {
    dev: &'static DeviceState,
    raw: sys::CUevent,
    timing: bool,
}
// SAFETY: an event handle is valid from any thread; the driver's event calls are thread-safe.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: an event we created; waits already enqueued on it stay valid.
            unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({:p} on {})", self.raw, self.dev.device())
    }
}

impl Event {
    /// An event for ordering and queries (no timing: cheaper to record and wait on).
    pub fn new(dev: &CudaDevice) -> Result<Event> {
        Self::create(dev, false)
    }

    /// An event that can be timed with [`Event::elapsed_ms`].
    pub fn timing(dev: &CudaDevice) -> Result<Event> {
        Self::create(dev, true)
    }

    fn create(dev: &CudaDevice, timing: bool) -> Result<Event> {
        let st = state(dev)?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        check(
            unsafe { sys::cuEventCreate(&mut e, flags as u32) },
            "Event::new",
        )?;
        Ok(Event {
            dev: st,
            raw: e,
            timing,
        })
    }

    pub fn device(&self) -> CudaDevice {
        self.dev.device()
    }

    /// Records the event on the calling thread's current stream of its device.
    pub fn record(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: event and stream belong to the bound context.
        check(
            unsafe { sys::cuEventRecord(self.raw, self.dev.stream()) },
            "Event::record",
        )
    }

    /// Records the event on `stream`; an error when the stream is another device's.
    pub fn record_on(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op: "Event::record_on",
                lhs: format!("an event of {}", self.device()),
                rhs: format!("a stream of {}", stream.device()),
            });
        }
        self.dev.bind()?;
        // SAFETY: event and stream belong to the bound context.
        check(
            unsafe { sys::cuEventRecord(self.raw, stream.raw.stream) },
            "Event::record",
        )
    }

    /// Whether the recorded work has finished (true for an event never recorded).
    pub fn query(&self) -> Result<bool> {
        self.dev.bind()?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => check(e, "Event::query").map(|_| false),
        }
    }

    /// Waits on the host until the recorded work has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        let _prof = crate::profile::sync(self.dev, "Event::synchronize");
        // SAFETY: a live event.
        check(
            unsafe { sys::cuEventSynchronize(self.raw) },
            "Event::synchronize",
        )
    }

    /// Milliseconds between this event and `end` (both recorded, both timing events; waits
    /// for `end`).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::invalid(
                "Event::elapsed_ms",
                "both events must be created with Event::timing",
            ));
        }
        end.synchronize()?;
        let mut ms = 0f32;
        // SAFETY: two live events, both recorded and complete.
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.raw, end.raw) },
            "Event::elapsed_ms",
        )?;
        Ok(ms)
    }
}

/// Waits until all work on every stream of `dev` has finished (`torch.cuda.synchronize`).
pub fn synchronize(dev: &CudaDevice) -> Result<()> {
    state(dev)?.sync_all("synchronize")
}

/// Pairs of work smaller than this (the smaller one's flops) run one after the other: below it
/// the fork and join (two events, two waits, ~4 µs of host time) cost more than the overlap
/// can give back. An f32 product of 16384 × 384 × 384 is 4.8 GFLOP.
const CONCURRENT_MIN_FLOPS: u64 = 1 << 30;

/// Whether products of `dtype` gain from running in pairs: those on the FMA units (f32 without
/// TF32, f64) do. Tensor-core products do not: the GPT's on an H200 (2026-11-29), f32 28.67 →
/// 28.43 ms an iteration in pairs, TF32 9.52 → 9.65, bf16 5.18 → 5.09 / 5.20.
fn pairs_pay(dtype: DType) -> bool {
    match dtype {
        DType::F32 => !crate::blas::allow_tf32(),
        DType::F64 => true,
        _ => false,
    }
}

static CONCURRENCY: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1 off; 2 on
static SIDE_RUNS: AtomicU64 = AtomicU64::new(0);

/// Whether [`Backend::concurrently`](kiln_core::Backend::concurrently) may use the side
/// stream: [`set_concurrency`]'s last choice, else `KILN_CUDA_CONCURRENT` (`0` turns it off;
/// on by default).
pub fn concurrency() -> bool {
    match CONCURRENCY.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_CUDA_CONCURRENT").map_or(true, |v| v != "0");
            set_concurrency(on);
            on
        }
        v => v == 2,
    }
}

/// Lets independent pairs of large products run at once on the side stream (`true`, the
/// default) or keeps everything on the current stream, for the whole process.
pub fn set_concurrency(on: bool) {
    CONCURRENCY.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// How many pairs this process ran with their second half on the side stream.
pub fn side_stream_runs() -> u64 {
    SIDE_RUNS.load(Ordering::Relaxed)
}

/// The device whose side stream a pair of `(dtype, flops)` forks to, or `None` (see
/// [`concurrently`]). The size and dtype first: a small model's pairs stop there, before the
/// device's state is looked up.
fn fork_on(dev: &CudaDevice, (dtype, flops): (DType, u64)) -> Result<Option<&'static DeviceState>> {
    if flops < CONCURRENT_MIN_FLOPS || !pairs_pay(dtype) || !concurrency() {
        return Ok(None);
    }
    let st = state(dev)?;
    Ok((!st.capturing() && !st.streams().is_side(st.stream())).then_some(st))
}

/// [`Backend::concurrently`](kiln_core::Backend::concurrently) on one GPU: `first` on the
/// current stream, `second` on the device's side stream (`DeviceState::fork_join`). Memory
/// stays safe without more: a block used on both streams is recycled only after both passed
/// (`memory.rs`), and the side stream has its own cuBLAS handle (`device/`).
///
/// One after the other instead: pairs below [`CONCURRENT_MIN_FLOPS`] or on tensor cores
/// ([`pairs_pay`]), inside a graph capture (a fork would have to be captured too), when
/// already on the side stream (nested), and with concurrency off ([`set_concurrency`]).
pub(crate) fn concurrently<R1, R2>(
    dev: &CudaDevice,
    work: (DType, u64),
    first: impl FnOnce() -> Result<R1>,
    second: impl FnOnce() -> Result<R2>,
) -> Result<(R1, R2)> {
    let Some(st) = fork_on(dev, work)? else {
        let a = first()?;
        return Ok((a, second()?));
    };
    let r = st.fork_join("concurrently", first, second);
    SIDE_RUNS.fetch_add(1, Ordering::Relaxed);
    r
}
