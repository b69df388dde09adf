//! Devices and their lazily created per-GPU state.
//!
//! Nothing touches the driver until a device is used: [`device_count`] loads libcuda
//! dynamically and reports 0 (never panics) when it or a GPU is missing. The first op on a
//! device creates its [`DeviceState`]: the primary context, a compute stream (every kernel,
//! cuBLAS call, allocation and free), a copy stream (host transfers through pinned staging
//! buffers, ordered against the compute stream with events), the cuBLAS handle (on first
//! matmul), the kernel cache and the device error flag. States live for the whole process, like
//! the CUDA primary context they hold.
//!
//! We call the driver through cudarc's `sys`/`result` layers rather than its safe wrappers: we
//! order our two streams ourselves, so cudarc's per-buffer event tracking would only add cost.

use std::collections::HashMap;

use kiln_core::fasthash::FastMap;
use std::ffi::{CString, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use kiln_core::{Error, Result};

use crate::pool::{BlockCache, DeferredFree, GraphPool};
use crate::sources::Module;

/// One NVIDIA GPU, by ordinal. Displays as `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CudaDevice {
    ordinal: usize,
}

impl CudaDevice {
    /// The device with this ordinal; does not check that it exists (see [`crate::try_gpu`]).
    pub fn new(ordinal: usize) -> Self {
        CudaDevice { ordinal }
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// The GPU's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> Result<String> {
        Ok(state(self)?.name.clone())
    }
    /// Total memory of the GPU in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        Ok(state(self)?.total_mem)
    }
    /// The compute capability as `major * 10 + minor` (90 for Hopper).
    pub fn compute_capability(&self) -> Result<u32> {
        Ok(state(self)?.arch)
    }
}

impl fmt::Display for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

/// Why CUDA is unusable here, or `None` when at least one GPU is there.
pub fn unavailable_reason() -> Option<String> {
    match driver_info() {
        Ok(0) => Some("the CUDA driver reports no device".into()),
        Ok(_) => None,
        Err(e) => Some(e.clone()),
    }
}

fn driver_info() -> &'static std::result::Result<usize, String> {
    static INFO: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    INFO.get_or_init(|| {
        // SAFETY: only tries to dlopen libcuda by its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda not found (no NVIDIA driver)".into());
        }
        // SAFETY: cuInit may be called any number of times.
        check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.to_string())?;
        let mut n = 0;
        // SAFETY: valid out-pointer; the driver is initialized.
        check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")
            .map_err(|e| e.to_string())?;
        Ok(n.max(0) as usize)
    })
}

/// Number of usable GPUs (0 without a driver or a GPU; never panics).
pub fn device_count() -> usize {
    *driver_info().as_ref().unwrap_or(&0)
}

/// GPU `i` if it exists (d2l's `try_gpu`); `None` otherwise. The caller picks the CPU then.
pub fn try_gpu(i: usize) -> Option<CudaDevice> {
    (i < device_count()).then(|| CudaDevice::new(i))
}

/// [`try_gpu`] for GPU tests: when GPU `i` is missing, prints `skipped: no CUDA device i
/// (<reason>)` straight to stderr (which libtest does not capture), so that a skipped test shows
/// in a plain `cargo test` run instead of passing silently, and returns `None`.
pub fn gpu_or_skip(i: usize) -> Option<CudaDevice> {
    let d = try_gpu(i);
    if d.is_none() {
        use std::io::Write;
        let reason = unavailable_reason().unwrap_or_else(|| format!("cuda:{i} is not present"));
        let _ = writeln!(std::io::stderr(), "skipped: no CUDA device {i} ({reason})");
    }
    d
}

/// Turns a driver status into a typed error naming the op.
pub(crate) fn check(r: CUresult, op: &'static str) -> Result<()> {
    r.result().map_err(|e| Error::backend(op, format!("{e}")))
}

/// `KILN_CUDA_SYNC=1`: synchronize and check after every launch (CUDA_LAUNCH_BLOCKING).
pub(crate) fn sync_debug() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUDA_SYNC").is_ok_and(|v| v == "1"))
}

/// `KILN_CUDA_LAUNCH_STATS=1`: count kernel launches and the host time spent inside
/// `cuLaunchKernel` (see [`launch_stats`]).
fn launch_stats_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUDA_LAUNCH_STATS").is_ok_and(|v| v == "1"))
}

static LAUNCHES: AtomicU64 = AtomicU64::new(0);
static LAUNCH_NANOS: AtomicU64 = AtomicU64::new(0);

/// Kernel launches so far in this process (every device) and the host nanoseconds spent inside
/// `cuLaunchKernel` for them: where a small-op workload's host time goes. Counted only with
/// `KILN_CUDA_LAUNCH_STATS=1` (otherwise `(0, 0)`); cuBLAS's own launches are not included.
pub fn launch_stats() -> (u64, u64) {
    (
        LAUNCHES.load(Ordering::Relaxed),
        LAUNCH_NANOS.load(Ordering::Relaxed),
    )
}

thread_local! {
    static THREAD_LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static THREAD_SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Times the calling thread waited for a device's compute stream so far (`synchronize`, and
/// the error-flag reads of index and cross-entropy kernels): where the host stops running ahead.
pub fn thread_syncs() -> u64 {
    THREAD_SYNCS.with(|c| c.get())
}

/// Kernel launches made so far by the calling thread (always counted; cuBLAS's own launches
/// are not included): lets a test see how many kernels an op ran, whatever other threads do.
pub fn thread_launches() -> u64 {
    THREAD_LAUNCHES.with(|c| c.get())
}

/// Forgets every compiled kernel of `dev` (CuPy's `clear_memo`, Chainer's memoize cache):
/// waits for the device, unloads the modules of built-in and generated kernels (lazy chains,
/// expression programs, user kernels), and lets the next use load them again (from the disk
/// cache, which stays). Frees their device memory (code, constants) and resets the per-device
/// budgets of generated kernels.
pub fn clear_kernel_cache(dev: &CudaDevice) -> Result<()> {
    let s = state(dev)?;
    s.sync_all("clear_kernel_cache")?;
    KERNEL_EPOCH.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let mut modules: Vec<usize> = s.modules.lock().unwrap().drain().map(|(_, m)| m).collect();
    s.funcs.lock().unwrap().clear();
    s.generated.slots.lock().unwrap().clear();
    modules.append(&mut s.generated.modules.lock().unwrap());
    for m in modules {
        // SAFETY: each module was loaded into this context and nothing runs on the device
        // (synchronized above); its functions were forgotten above.
        check(
            unsafe { sys::cuModuleUnload(m as sys::CUmodule) },
            "clear_kernel_cache",
        )?;
    }
    Ok(())
}

/// Changes whenever [`clear_kernel_cache`] unloads modules: memos of kernel handles kept
/// outside the device state (per-thread ones) are valid only for the epoch they were made in.
pub(crate) static KERNEL_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A kernel's name, as the parts that are joined with `_` to spell it, compared and hashed by
/// the parts' addresses: every call site passes string literals, so one kernel looked up from
/// one site is one key, without reading the strings. (Comparing and hashing their bytes was
/// 12 % of the host time of d2l's matmul-and-norm loop, profiled against a stand-in driver.)
/// The same name spelled by literals at another address is another key for the same kernel:
/// one more entry, found by `cuModuleGetFunction` once.
#[derive(Clone, Copy)]
pub(crate) struct FuncKey([&'static str; 5]);

impl PartialEq for FuncKey {
    fn eq(&self, other: &Self) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .all(|(a, b)| std::ptr::eq(*a, *b))
    }
}

impl Eq for FuncKey {}

impl std::hash::Hash for FuncKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let h = self.0.iter().fold(0u64, |h, s| {
            (h ^ s.as_ptr() as u64 ^ (s.len() as u64) << 48).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        });
        state.write_u64(h);
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Func(pub sys::CUfunction);
// SAFETY: a CUfunction is a handle valid in its context from any thread.
unsafe impl Send for Func {}
// SAFETY: as above; launching is thread-safe in the driver.
unsafe impl Sync for Func {}

pub(crate) struct Blas {
    pub handle: cudarc::cublas::sys::cublasHandle_t,
    pub tf32: bool,
    /// The stream the handle is bound to (a `CUstream` as an address).
    pub stream: usize,
}
// SAFETY: the handle is only used under the `blas` mutex.
unsafe impl Send for Blas {}

/// Pinned host buffers for transfers: a ring of `STAGING_BLOCKS` blocks of [`staging_bytes`],
/// each with the event of its last DMA, so a block is reused only once its copy is done.
pub(crate) struct Staging {
    pub blocks: Vec<(*mut u8, sys::CUevent)>,
    pub next: usize,
}
// SAFETY: only used under the `staging` mutex.
unsafe impl Send for Staging {}
/// The size of one staging block: `KILN_CUDA_STAGING_MB` MiB (default 32, the best of 8 and 32
/// for 256 MB copies on an H100 host, BENCHMARKS.md; read once).
pub(crate) fn staging_bytes() -> usize {
    static B: OnceLock<usize> = OnceLock::new();
    *B.get_or_init(|| {
        let mb = std::env::var("KILN_CUDA_STAGING_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(32);
        mb.clamp(1, 256) << 20
    })
}
pub(crate) const STAGING_BLOCKS: usize = 4;

/// The generated kernels of one device: per generator (by the `TypeId` of its key type) a
/// `FastMap<K, Func>` behind its own lock (a compilation blocks only its own generator), and
/// the modules they live in.
#[derive(Default)]
pub(crate) struct Generated {
    slots: Mutex<HashMap<std::any::TypeId, Slot>>,
    modules: Mutex<Vec<usize>>,
}

type Slot = std::sync::Arc<Mutex<Box<dyn std::any::Any + Send>>>;

/// The lazily created state of one GPU.
pub(crate) struct DeviceState {
    pub ordinal: usize,
    pub cu_dev: sys::CUdevice,
    pub ctx: sys::CUcontext,
    pub compute: sys::CUstream,
    pub copy: sys::CUstream,
    pub pool: sys::CUmemoryPool,
    pub name: String,
    /// Compute capability, `major * 10 + minor`.
    pub arch: u32,
    pub sm_count: u32,
    pub total_mem: usize,
    /// A 16-byte device record `{u32 code, u32 pad, i64 value}`: code 0, or the code and
    /// offending value of the first kernel error since the last check.
    pub err_flag: sys::CUdeviceptr,
    /// Pinned host copy of the record.
    pub err_host: *mut u32,
    pub err_lock: Mutex<()>,
    pub modules: Mutex<HashMap<Module, usize>>,
    pub funcs: Mutex<FastMap<FuncKey, Func>>,
    /// Generated kernels (lazy chains, expression programs, user kernels), memoized per
    /// generator under a key of the generator's choosing (see [`DeviceState::generated_func`]).
    pub generated: Generated,
    pub blas: Mutex<Option<Blas>>,
    pub staging: Mutex<Staging>,
    pub block_cache: Mutex<BlockCache>,
    pub in_use: AtomicUsize,
    pub peak: AtomicUsize,
    pub peers_enabled: Mutex<Vec<usize>>,
    pub tf32_override: AtomicBool,
    /// Blocks waiting for other streams before they can be reused (see `memory.rs`).
    pub deferred_frees: Mutex<Vec<DeferredFree>>,
    pub deferred_count: AtomicUsize,
    /// Sources of asynchronous host-to-device copies, kept alive until their copy is done.
    pub in_flight: Mutex<std::collections::VecDeque<InFlight>>,
    /// Spare events (timing disabled) for ordering streams and tracking copies.
    pub events: Mutex<Vec<usize>>,
    /// Streams of dropped [`crate::Stream`]s, by priority, for the next `Stream::new`. A stream
    /// is never destroyed: blocks it used still name it, and record an event on it when they
    /// are freed (see `memory.rs`), possibly long after the `Stream` was dropped.
    pub spare_streams: Mutex<Vec<(i32, usize)>>,
}
// SAFETY: every raw handle here (context, streams, pool, device pointers, pinned memory) is
// valid from any thread once the context is current, which `bind` ensures; mutable parts are
// behind mutexes or atomics.
unsafe impl Send for DeviceState {}
// SAFETY: see above.
unsafe impl Sync for DeviceState {}

thread_local! {
    static CURRENT: std::cell::Cell<sys::CUcontext> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    /// The calling thread's current stream per device ordinal (null: the device's default
    /// stream). Set by `stream::Stream::scope` and while deferred work launches.
    static CURRENT_STREAM: [std::cell::Cell<sys::CUstream>; MAX_STREAM_DEVICES] =
        const { [const { std::cell::Cell::new(std::ptr::null_mut()) }; MAX_STREAM_DEVICES] };
    /// The private pool of the CUDA graph this thread is capturing, if any (`graph.rs`), and
    /// its device's ordinal + 1 (0: none) for a check without a borrow.
    static CAPTURE: std::cell::RefCell<Option<std::sync::Arc<GraphPool>>> =
        const { std::cell::RefCell::new(None) };
    static CAPTURING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether this thread is capturing a CUDA graph on any device.
pub(crate) fn capture_active() -> bool {
    CAPTURING.with(|c| c.get()) != 0
}

/// Starts (`Some`) or ends (`None`) this thread's capture into `pool`; returns the previous.
pub(crate) fn set_capture(
    pool: Option<std::sync::Arc<GraphPool>>,
) -> Option<std::sync::Arc<GraphPool>> {
    CAPTURING.with(|c| c.set(pool.as_ref().map_or(0, |p| p.ordinal + 1)));
    CAPTURE.with(|c| c.replace(pool))
}

/// Devices with ordinals at or above this always run on their default stream.
pub(crate) const MAX_STREAM_DEVICES: usize = 16;
const _: () = assert!(MAX_STREAM_DEVICES == crate::profile::MAX_DEVICES);

impl crate::profile::Site for DeviceState {
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn current_stream(&self) -> sys::CUstream {
        self.stream()
    }
    fn bytes_in_use(&self) -> usize {
        self.in_use.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn capturing(&self) -> bool {
        DeviceState::capturing(self)
    }
}

/// Makes `stream` the calling thread's current stream on device `ordinal` (null: the default
/// stream) and returns the previous one.
pub(crate) fn set_current_stream(ordinal: usize, stream: sys::CUstream) -> sys::CUstream {
    CURRENT_STREAM.with(|c| match c.get(ordinal) {
        Some(c) => c.replace(stream),
        None => std::ptr::null_mut(),
    })
}

/// Host memory that an asynchronous copy still reads (a pinned source's storage), held until
/// the copy's event completes.
pub(crate) struct InFlight {
    pub event: std::sync::Arc<SharedEvent>,
    pub _owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

/// An event of the device's pool with several holders (an upload's in-flight record and the
/// buffers it fills): back to the pool when the last one drops, so no holder ever sees it
/// re-recorded for other work.
pub(crate) struct SharedEvent {
    pub event: sys::CUevent,
    dev: &'static DeviceState,
}

impl SharedEvent {
    /// A pooled event of `dev`, recorded on `stream`.
    pub fn record(
        dev: &'static DeviceState,
        stream: sys::CUstream,
        op: &'static str,
    ) -> Result<Self> {
        let event = dev.event()?;
        let e = SharedEvent { event, dev };
        // SAFETY: a live event and a stream of this context.
        check(unsafe { sys::cuEventRecord(event, stream) }, op)?;
        Ok(e)
    }
}

impl Drop for SharedEvent {
    fn drop(&mut self) {
        self.dev.recycle_event(self.event);
    }
}

// SAFETY: an event handle is valid from any thread of the process; the state is 'static.
unsafe impl Send for SharedEvent {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for SharedEvent {}

/// The state of `dev`, created on first use.
pub(crate) fn state(dev: &CudaDevice) -> Result<&'static DeviceState> {
    static STATES: OnceLock<Vec<OnceLock<std::result::Result<&'static DeviceState, String>>>> =
        OnceLock::new();
    let states = STATES.get_or_init(|| (0..device_count()).map(|_| OnceLock::new()).collect());
    let slot = states.get(dev.ordinal).ok_or_else(|| {
        Error::invalid(
            "cuda",
            format!(
                "{dev} does not exist ({} CUDA device(s){})",
                device_count(),
                unavailable_reason()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
        )
    })?;
    let s = slot.get_or_init(|| {
        crate::profile::set_binder(|o| state(&CudaDevice::new(o)).is_ok());
        DeviceState::create(dev.ordinal)
            .map(|s| &*Box::leak(Box::new(s)))
            .map_err(|e| e.to_string())
    });
    match s {
        Ok(s) => {
            s.bind()?;
            Ok(s)
        }
        Err(e) => Err(Error::backend("cuda init", e)),
    }
}

impl DeviceState {
    fn create(ordinal: usize) -> Result<DeviceState> {
        let mut cu_dev = 0;
        // SAFETY: the driver is initialized (device_count succeeded); valid out-pointers
        // throughout; every handle created here is owned by the returned state.
        unsafe {
            check(sys::cuDeviceGet(&mut cu_dev, ordinal as i32), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, cu_dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            CURRENT.with(|c| c.set(ctx));
            let attr = |a| -> Result<i32> {
                let mut v = 0;
                check(
                    sys::cuDeviceGetAttribute(&mut v, a, cu_dev),
                    "cuDeviceGetAttribute",
                )?;
                Ok(v)
            };
            use sys::CUdevice_attribute::*;
            let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
            let mut name = [0 as std::ffi::c_char; 256];
            check(
                sys::cuDeviceGetName(name.as_mut_ptr(), 256, cu_dev),
                "cuDeviceGetName",
            )?;
            let name = std::ffi::CStr::from_ptr(name.as_ptr())
                .to_string_lossy()
                .into_owned();
            let mut total_mem = 0usize;
            check(
                sys::cuDeviceTotalMem_v2(&mut total_mem, cu_dev),
                "cuDeviceTotalMem",
            )?;
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            let mut compute = std::ptr::null_mut();
            check(sys::cuStreamCreate(&mut compute, flags), "cuStreamCreate")?;
            let mut copy = std::ptr::null_mut();
            check(sys::cuStreamCreate(&mut copy, flags), "cuStreamCreate")?;
            // The device's default stream-ordered pool, keeping freed memory cached.
            let mut pool = std::ptr::null_mut();
            check(
                sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev),
                "cuDeviceGetDefaultMemPool",
            )?;
            let mut threshold = u64::MAX;
            check(
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut c_void,
                ),
                "cuMemPoolSetAttribute",
            )?;
            let mut err_flag = 0;
            check(sys::cuMemAlloc_v2(&mut err_flag, 16), "cuMemAlloc")?;
            check(sys::cuMemsetD32_v2(err_flag, 0, 4), "cuMemsetD32")?;
            let mut err_host = std::ptr::null_mut();
            check(sys::cuMemHostAlloc(&mut err_host, 16, 0), "cuMemHostAlloc")?;
            Ok(DeviceState {
                ordinal,
                cu_dev,
                ctx,
                compute,
                copy,
                pool,
                name,
                arch: (major * 10 + minor) as u32,
                sm_count,
                total_mem,
                err_flag,
                err_host: err_host as *mut u32,
                err_lock: Mutex::new(()),
                modules: Mutex::new(HashMap::new()),
                funcs: Mutex::new(FastMap::default()),
                generated: Generated::default(),
                blas: Mutex::new(None),
                staging: Mutex::new(Staging {
                    blocks: Vec::new(),
                    next: 0,
                }),
                block_cache: Mutex::new(Default::default()),
                in_use: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
                peers_enabled: Mutex::new(Vec::new()),
                tf32_override: AtomicBool::new(false),
                deferred_frees: Mutex::new(Vec::new()),
                deferred_count: AtomicUsize::new(0),
                in_flight: Mutex::new(Default::default()),
                events: Mutex::new(Vec::new()),
                spare_streams: Mutex::new(Vec::new()),
            })
        }
    }

    pub fn device(&self) -> CudaDevice {
        CudaDevice::new(self.ordinal)
    }

    /// The calling thread's current stream on this device: a user stream inside its scope,
    /// otherwise the device's default (compute) stream. Every launch, allocation and free goes
    /// to it.
    pub fn stream(&self) -> sys::CUstream {
        let s = CURRENT_STREAM.with(|c| {
            c.get(self.ordinal)
                .map_or(std::ptr::null_mut(), |c| c.get())
        });
        if s.is_null() { self.compute } else { s }
    }

    /// An event with timing disabled, from the device's spare list. Give it back with
    /// [`DeviceState::recycle_event`] once every wait on its recording has been enqueued (a
    /// later re-record does not affect waits already enqueued) and nobody queries it.
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

    pub fn recycle_event(&self, ev: sys::CUevent) {
        self.events.lock().unwrap().push(ev as usize);
    }

    /// Drops the sources of host-to-device copies that have finished.
    pub fn sweep_in_flight(&self) {
        let mut q = self.in_flight.lock().unwrap();
        while let Some(f) = q.front() {
            // SAFETY: a live event of this context.
            let r = unsafe { sys::cuEventQuery(f.event.event) };
            if r == CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            q.pop_front(); // the event returns to the pool with its last holder
        }
    }

    /// Whether the calling thread is capturing a CUDA graph on this device (`graph.rs`).
    #[inline]
    pub fn capturing(&self) -> bool {
        CAPTURING.with(|c| c.get()) == self.ordinal + 1
    }

    /// The pool of the graph the calling thread is capturing on this device, if any.
    pub fn capture_pool(&self) -> Option<std::sync::Arc<GraphPool>> {
        if !self.capturing() {
            return None;
        }
        CAPTURE.with(|c| c.borrow().clone())
    }

    /// A typed error for `op`, which does `what`, when the calling thread is capturing a CUDA
    /// graph on this device: a capture records work for later replays, so it cannot wait for
    /// the device or exchange data with the host (the driver would invalidate the capture).
    pub fn refuse_in_capture(&self, op: &'static str, what: &str) -> Result<()> {
        if !self.capturing() {
            return Ok(());
        }
        Err(Error::invalid(
            op,
            format!(
                "{what} while a CUDA graph is being captured on {}: a capture only records \
                 device work for later replays; do this before the capture or after a replay",
                self.device()
            ),
        ))
    }

    /// Waits for every stream of the device (`torch.cuda.synchronize()`).
    pub fn sync_all(&self, op: &'static str) -> Result<()> {
        self.refuse_in_capture(op, "waiting for the device")?;
        THREAD_SYNCS.with(|c| c.set(c.get() + 1));
        self.bind()?;
        let _prof = crate::profile::sync(self, op);
        // SAFETY: this device's context is current.
        check(unsafe { sys::cuCtxSynchronize() }, op)?;
        self.sweep_in_flight();
        Ok(())
    }

    /// Makes this device's context current on the calling thread (cached per thread).
    pub fn bind(&self) -> Result<()> {
        if CURRENT.with(|c| c.get()) != self.ctx {
            // SAFETY: `ctx` is the retained primary context, alive for the whole process.
            check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")?;
            CURRENT.with(|c| c.set(self.ctx));
        }
        Ok(())
    }

    /// The kernel named by `parts` joined with `_` (e.g. `["unary", "exp", "float", "c"]`) in
    /// `module`, compiling (or loading from the disk cache) the module on first use. Memoized
    /// by the parts themselves, so the hot path formats no string.
    pub fn func(&self, module: Module, parts: &[&'static str]) -> Result<Func> {
        let mut names = [""; 5];
        names[..parts.len()].copy_from_slice(parts);
        let key = FuncKey(names);
        if let Some(f) = self.funcs.lock().unwrap().get(&key) {
            return Ok(*f);
        }
        let name = parts.join("_");
        let m = self.module(module)?;
        let cname = CString::new(name.as_str()).map_err(|e| Error::backend("kernel lookup", e))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: `m` is a loaded module of this context; valid out-pointer.
        check(
            unsafe { sys::cuModuleGetFunction(&mut f, m as sys::CUmodule, cname.as_ptr()) },
            "cuModuleGetFunction",
        )
        .map_err(|e| Error::backend("kernel lookup", format!("{name}: {e}")))?;
        self.funcs.lock().unwrap().insert(key, Func(f));
        Ok(Func(f))
    }

    /// The generated kernel memoized under `key` in the memo of key type `K` (one per
    /// generator; the type is the generator's own, so this module names none of them): on a
    /// miss, `build` returns the CUBIN and the kernel's name, the module is loaded and kept
    /// (unloaded by [`clear_kernel_cache`]). `None` when the key is new and this generator
    /// already holds `budget` kernels on this device. The memo is locked while `build` runs,
    /// so two threads never compile the same kernel twice (other generators are not held up).
    pub fn generated_func<K>(
        &self,
        key: &K,
        budget: usize,
        build: impl FnOnce() -> Result<(Vec<u8>, CString)>,
    ) -> Result<Option<Func>>
    where
        K: Clone + Eq + std::hash::Hash + Send + 'static,
    {
        let slot: Slot = self
            .generated
            .slots
            .lock()
            .unwrap()
            .entry(std::any::TypeId::of::<K>())
            .or_insert_with(|| {
                std::sync::Arc::new(Mutex::new(Box::new(FastMap::<K, Func>::default())))
            })
            .clone();
        let mut guard = slot.lock().unwrap();
        let map = guard
            .downcast_mut::<FastMap<K, Func>>()
            .expect("a memo slot holds the map of its own key type");
        if let Some(f) = map.get(key) {
            return Ok(Some(*f));
        }
        if map.len() >= budget {
            return Ok(None);
        }
        let (bin, name) = build()?;
        self.bind()?;
        let mut m = std::ptr::null_mut();
        // SAFETY: `bin` is a CUBIN image (NVRTC output for this device's architecture), alive
        // for the call; valid out-pointer; this device's context is current (bound above).
        check(
            unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        let mut f = std::ptr::null_mut();
        // SAFETY: `m` is the module just loaded into this context; the name is NUL-terminated.
        let found = check(
            unsafe { sys::cuModuleGetFunction(&mut f, m, name.as_ptr()) },
            "cuModuleGetFunction",
        );
        if let Err(e) = found {
            // SAFETY: the module was loaded above and none of its functions is known.
            unsafe { sys::cuModuleUnload(m) };
            return Err(Error::backend(
                "cuModuleGetFunction",
                format!(
                    "no kernel `{}` in the compiled module: {e}",
                    name.to_string_lossy()
                ),
            ));
        }
        self.generated.modules.lock().unwrap().push(m as usize);
        map.insert(key.clone(), Func(f));
        Ok(Some(Func(f)))
    }

    fn module(&self, module: Module) -> Result<usize> {
        let mut mods = self.modules.lock().unwrap();
        if let Some(&m) = mods.get(&module) {
            return Ok(m);
        }
        let bin = crate::nvrtc::load_or_compile(module, self.arch).map_err(|e| {
            Error::backend(
                "nvrtc",
                format!("compiling {} for sm_{}: {e}", module.file_name(), self.arch),
            )
        })?;
        let mut m = std::ptr::null_mut();
        // SAFETY: `bin` is a CUBIN image for this device's architecture; valid out-pointer.
        let r = unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) };
        if r != CUresult::CUDA_SUCCESS {
            // A stale or corrupt cache entry slipped through: recompile once, bypassing it.
            let bin =
                crate::nvrtc::compile(module, self.arch).map_err(|e| Error::backend("nvrtc", e))?;
            // SAFETY: as above.
            check(
                unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) },
                "cuModuleLoadData",
            )?;
        }
        mods.insert(module, m as usize);
        Ok(m as usize)
    }

    /// Launches `f` on the calling thread's current stream. `params` point at the kernel's
    /// arguments, in order and with the exact C types the kernel declares.
    pub fn launch(
        &self,
        op: &'static str,
        f: Func,
        grid: (u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_3d(op, f, [grid.0, grid.1, 1], [block, 1, 1], smem, params)
    }

    /// [`DeviceState::launch`] with a 3-d grid and block (nothing when the grid is empty).
    pub fn launch_3d(
        &self,
        op: &'static str,
        f: Func,
        grid: [u32; 3],
        block: [u32; 3],
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if grid.contains(&0) {
            return Ok(());
        }
        let _prof = crate::profile::launch(self, op, false);
        let t0 = launch_stats_on().then(std::time::Instant::now);
        // SAFETY: `f` is a kernel of this context; `params` match its signature (each call
        // site passes the arguments its kernel declares; user kernels' are checked against
        // the compiled parameter list) and point at live values.
        let r = check(
            unsafe {
                sys::cuLaunchKernel(
                    f.0,
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    smem,
                    self.stream(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            op,
        );
        THREAD_LAUNCHES.with(|c| c.set(c.get() + 1));
        if let Some(t0) = t0 {
            LAUNCHES.fetch_add(1, Ordering::Relaxed);
            LAUNCH_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        r?;
        // A capture records instead of running: nothing to wait for (graph.rs).
        if sync_debug() && !self.capturing() {
            self.sync(op)?;
        }
        Ok(())
    }

    /// 1-d launch configuration for `n` work items with grid-stride loops.
    pub fn grid_1d(&self, n: u64, block: u32) -> (u32, u32) {
        let want = n.div_ceil(block as u64);
        let cap = self.sm_count as u64 * (2048 / block as u64) * 4;
        (want.min(cap).max(if n == 0 { 0 } else { 1 }) as u32, 1)
    }

    /// Waits for the calling thread's current stream.
    pub fn sync(&self, op: &'static str) -> Result<()> {
        self.refuse_in_capture(op, "waiting for the device")?;
        THREAD_SYNCS.with(|c| c.set(c.get() + 1));
        let _prof = crate::profile::sync(self, op);
        // SAFETY: the stream belongs to this (current) context.
        check(unsafe { sys::cuStreamSynchronize(self.stream()) }, op)
    }

    /// Reads the device error record (synchronizing) and turns a raised flag into a typed
    /// error naming `op`, the offending value and the valid range `0..limit`
    /// ([`Error::IndexOutOfRange`] for an index or a label); the record is cleared, so the
    /// device stays usable.
    pub fn check_flag(&self, op: &'static str, limit: usize) -> Result<()> {
        let _g = self.err_lock.lock().unwrap();
        // SAFETY: `err_host` is 16 bytes of pinned memory; `err_flag` a 16-byte device record;
        // the copy is ordered on the compute stream, which we synchronize before reading.
        let (code, value) = unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    self.err_host as *mut c_void,
                    self.err_flag,
                    16,
                    self.stream(),
                ),
                op,
            )?;
            self.sync(op)?;
            let code = std::ptr::read_volatile(self.err_host);
            let value = std::ptr::read_volatile(self.err_host.add(2) as *const i64);
            (code, value)
        };
        if code == 0 {
            return Ok(());
        }
        // SAFETY: the 16-byte device record, ordered on the compute stream.
        check(
            unsafe { sys::cuMemsetD32Async(self.err_flag, 0, 4, self.stream()) },
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

    /// Records an event on `from` and makes `to` wait for it (nothing when they are the same
    /// stream).
    pub fn order(&self, from: sys::CUstream, to: sys::CUstream, op: &'static str) -> Result<()> {
        if from == to {
            return Ok(());
        }
        let ev = self.event()?;
        // SAFETY: both streams belong to live contexts; a later re-record of the recycled event
        // does not affect the wait enqueued here.
        let r = unsafe {
            sys::cuEventRecord(ev, from)
                .result()
                .and_then(|_| sys::cuStreamWaitEvent(to, ev, 0).result())
        };
        self.recycle_event(ev);
        r.map_err(|e| Error::backend(op, format!("{e}")))
    }
}
