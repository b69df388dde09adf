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

use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use kiln_core::{Error, Result};

mod allocator;
mod error_flag;
mod kernels;
mod streams;
mod transfers;

pub(crate) use allocator::Allocator;
use error_flag::ErrorFlag;
pub(crate) use kernels::Func;
use kernels::KernelCache;
pub(crate) use streams::{Streams, time_on};
pub(crate) use transfers::{InFlight, STAGING_BLOCKS, Staging, Transfers, staging_bytes};

use crate::pool::GraphPool;
use crate::sources::Module;
use crate::types::CudaDevice;

// The methods of the device handle that reach the GPU (the handle itself is in `types.rs`).
impl CudaDevice {
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
    for m in s.kernels.forget_all() {
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

pub(crate) struct Blas {
    pub handle: cudarc::cublas::sys::cublasHandle_t,
    pub tf32: bool,
    /// The stream the handle is bound to (a `CUstream` as an address).
    pub stream: usize,
}
// SAFETY: the handle is only used under the `blas` mutex.
unsafe impl Send for Blas {}

/// The lazily created state of one GPU: its identity (read-only after creation, read through
/// methods), then owned parts, each with private state and methods, in its own file: streams
/// and events (`streams.rs`), the kernel cache (`kernels.rs`), the allocator's state
/// (`allocator.rs`), transfers' state (`transfers.rs`), the error flag (`error_flag.rs`), and
/// the cuBLAS handle (used by `blas.rs` under its lock).
pub(crate) struct DeviceState {
    ordinal: usize,
    cu_dev: sys::CUdevice,
    /// The retained primary context.
    ctx: sys::CUcontext,
    name: String,
    /// Compute capability, `major * 10 + minor`.
    arch: u32,
    sm_count: u32,
    smem_optin: usize,
    total_mem: usize,
    streams: Streams,
    kernels: KernelCache,
    alloc: Allocator,
    transfers: Transfers,
    errors: ErrorFlag,
    /// The cuBLAS handle, created on first matmul (`blas.rs`).
    blas: Mutex<Option<Blas>>,
    /// The side stream's own cuBLAS handle, so that products running at once on the two
    /// streams neither rebind one handle's stream at every call nor share its workspace (a
    /// precaution: PyTorch shares one handle's default workspace across streams on CUDA).
    side_blas: Mutex<Option<Blas>>,
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
        self.alloc.in_use()
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
    let slot = states.get(dev.ordinal()).ok_or_else(|| {
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
        let s = DeviceState::create(dev.ordinal())
            .map(|s| &*Box::leak(Box::new(s)))
            .map_err(|e| e.to_string())?;
        // The fixed kernels almost every program needs start compiling in the background now
        // (unless prebuilt or cached), so their first use waits on a compile under way.
        crate::fixed_cubins::prefetch(s.arch);
        Ok(s)
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
            let smem_optin =
                attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as usize;
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
            let streams = Streams::create()?;
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
            let errors = ErrorFlag::create()?;
            Ok(DeviceState {
                ordinal,
                cu_dev,
                ctx,
                streams,
                alloc: Allocator::new(pool),
                name,
                arch: (major * 10 + minor) as u32,
                sm_count,
                smem_optin,
                total_mem,
                errors,
                kernels: KernelCache::default(),
                blas: Mutex::new(None),
                side_blas: Mutex::new(None),
                transfers: Transfers::default(),
            })
        }
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver's handle of the device.
    pub fn cu_dev(&self) -> sys::CUdevice {
        self.cu_dev
    }

    /// The device's (retained primary) context.
    pub fn ctx(&self) -> sys::CUcontext {
        self.ctx
    }

    /// Compute capability, `major * 10 + minor`.
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// Multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The most shared memory (bytes) a block may opt in to.
    pub fn smem_optin(&self) -> usize {
        self.smem_optin
    }

    /// The cuBLAS handle slot for `stream` (`None` until `blas.rs` creates it), locked while a
    /// call uses it: the side stream's own, else the device's.
    pub fn blas(&self, stream: sys::CUstream) -> std::sync::MutexGuard<'_, Option<Blas>> {
        if self.streams.is_side(stream) {
            self.side_blas.lock().unwrap()
        } else {
            self.blas.lock().unwrap()
        }
    }

    /// The allocator's state (the allocator itself is `memory.rs`).
    pub fn allocator(&self) -> &Allocator {
        &self.alloc
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
        if s.is_null() {
            self.streams.compute()
        } else {
            s
        }
    }

    /// An event with timing disabled, from the device's spare list. Give it back with
    /// [`DeviceState::recycle_event`] once every wait on its recording has been enqueued (a
    /// later re-record does not affect waits already enqueued) and nobody queries it.
    pub fn event(&self) -> Result<sys::CUevent> {
        self.streams.event()
    }

    pub fn recycle_event(&self, ev: sys::CUevent) {
        self.streams.recycle_event(ev);
    }

    /// The device's default (compute) stream.
    pub fn default_stream(&self) -> sys::CUstream {
        self.streams.compute()
    }

    /// The device's copy stream (host transfers).
    pub fn copy_stream(&self) -> sys::CUstream {
        self.streams.copy()
    }

    /// The device's streams (spare user streams).
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// Drops the sources of host-to-device copies that have finished.
    pub fn sweep_in_flight(&self) {
        self.transfers.sweep_in_flight();
    }

    /// The staging ring, copies in flight and peers of this device.
    pub fn transfers(&self) -> &Transfers {
        &self.transfers
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
    /// `module`, compiling (or loading from the disk cache) the module on first use (see
    /// [`KernelCache::func`]).
    pub fn func(&self, module: Module, parts: &[&'static str]) -> Result<Func> {
        self.kernels.func(self.arch, module, parts)
    }

    /// The generated kernel memoized under `key` (see [`KernelCache::generated_func`]); the
    /// device's context is made current before the module is loaded.
    pub fn generated_func<K>(
        &self,
        key: &K,
        budget: usize,
        build: impl FnOnce() -> Result<(Vec<u8>, CString)>,
    ) -> Result<Option<Func>>
    where
        K: Clone + Eq + std::hash::Hash + Send + 'static,
    {
        self.kernels
            .generated_func(key, budget, build, || self.bind())
    }

    /// Whether `generated_func` of `key` would answer without building (see
    /// [`KernelCache::generated_settled`]).
    pub fn generated_settled<K>(&self, key: &K, budget: usize) -> bool
    where
        K: Eq + std::hash::Hash + 'static,
    {
        self.kernels.generated_settled(key, budget)
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
        self.errors
            .check(op, limit, self.stream(), || self.sync(op))
    }

    /// The device address of the error record, for kernels that check bounds.
    pub fn err_flag(&self) -> sys::CUdeviceptr {
        self.errors.ptr()
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

    /// Runs `first` on the calling thread's current stream and `second` on the side stream,
    /// which first waits for the current stream's work so far; then the current stream waits
    /// for the side stream, so later work sees both results. What both read must already be
    /// queued (not computed inside `first`). The side stream is current inside `second` only,
    /// also if it panics.
    pub fn fork_join<R1, R2>(
        &self,
        op: &'static str,
        first: impl FnOnce() -> Result<R1>,
        second: impl FnOnce() -> Result<R2>,
    ) -> Result<(R1, R2)> {
        /// Restores the thread's current stream when dropped.
        struct Restore(usize, sys::CUstream);
        impl Drop for Restore {
            fn drop(&mut self) {
                set_current_stream(self.0, self.1);
            }
        }
        let here = self.stream();
        let side = self.streams.side()?;
        self.order(here, side, op)?;
        let a = first()?;
        let b = {
            let _restore = Restore(self.ordinal, set_current_stream(self.ordinal, side));
            second()
        };
        // Joined whatever `second` returned: a failure may have queued part of its work.
        self.order(side, here, op)?;
        Ok((a, b?))
    }
}
