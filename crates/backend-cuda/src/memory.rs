//! Device memory: buffers, the stream-ordered pool, the block cache, statistics and
//! out-of-memory handling. (Transfers live in `transfer.rs`, page-locked host memory in
//! `pinned.rs`.)
//!
//! Every buffer is allocated with `cuMemAllocAsync` on the calling thread's current stream
//! (its *home* stream) from the device's default memory pool, whose release threshold we raise
//! to `u64::MAX`: freed memory stays in the pool and the next allocation of a similar size is
//! served without a driver round-trip to the OS, like PyTorch's caching allocator.
//!
//! On top of the pool sits a host-side cache of freed blocks, keyed by home stream and size
//! (rounded up by at most 1/8): a free is a push onto a list and a same-size allocation on the
//! same stream a pop, with no driver call at all. That is safe because the stream orders every
//! later use after every earlier one — as long as the block was used on its home stream only.
//! A block used on another stream (PyTorch's `record_stream` problem) remembers those streams
//! (`CudaStorage::buffer` notes each use); when it is dropped, an event is recorded on each of
//! them and the block waits in `deferred_frees` until all have passed, and only then returns to
//! the cache. `KILN_CUDA_CACHE=0` (or [`set_block_cache`]) bypasses the cache: frees then go
//! to the driver on the home stream, after it waited on the other streams' events.
//!
//! On out-of-memory we free the cached blocks, return the pool's memory to the driver (trim),
//! synchronize, retry once, and then fail with [`Error::OutOfMemory`] naming the request and
//! what we hold.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUresult};
use kiln_core::{Error, MemoryStats, Result};

use crate::device::{DeviceState, SharedEvent, check, state};
use crate::pool::{DeferredFree, GraphPool, bucket};
use crate::types::CudaDevice;

/// A copy into a [`Buffer`] still in flight (see [`Buffer::set_pending`]).
struct PendingCopy {
    event: Arc<SharedEvent>,
    waited: Vec<usize>,
}

/// One untyped block of memory on one GPU (the dtype lives in the tensor); what a computed
/// [`crate::CudaStorage`] holds. Returned to the block cache (or freed) on drop.
pub(crate) struct Buffer {
    ptr: sys::CUdeviceptr,
    /// The block's size (the request rounded up to its cache bucket).
    bytes: usize,
    /// Whether the block returns to the host-side cache on drop.
    cached: bool,
    dev: &'static DeviceState,
    /// The stream it was allocated on (a `CUstream` as an address).
    home: usize,
    /// Other streams it was used on (see the module docs).
    foreign: std::sync::Mutex<Vec<usize>>,
    /// A copy into the block still queued on another stream (an upload on the copy stream),
    /// and the streams already told to wait for it: the first use on each stream waits there
    /// ([`Buffer::mark_used`]), rather than every stream at the time of the upload.
    pending: std::sync::Mutex<Option<PendingCopy>>,
    /// Whether `pending` may hold a copy (a lock-free check on every use).
    has_pending: std::sync::atomic::AtomicBool,
    /// What is known of these contents as ids (see [`Buffer::ids_known_below`]).
    ids_ok: std::sync::Mutex<IdsKnown>,
    /// The CUDA graph whose private pool the block belongs to (allocated while capturing);
    /// it returns there on drop, never to the device's cache.
    graph: Option<Arc<GraphPool>>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer({} bytes on cuda:{})",
            self.bytes,
            self.dev.ordinal()
        )
    }
}

impl Buffer {
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }
    pub fn device(&self) -> CudaDevice {
        self.dev.device()
    }
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    pub(crate) fn state(&self) -> &'static DeviceState {
        self.dev
    }
    /// Notes that work on `stream` uses this block, so that it is not reused before that work
    /// has passed (free when `stream` is the block's home), and orders that work after a copy
    /// into the block still in flight ([`Buffer::set_pending`]).
    pub fn mark_used(&self, stream: sys::CUstream) -> Result<()> {
        self.note_stream(stream);
        if self.has_pending.load(Ordering::Acquire) {
            self.wait_pending(stream)?;
        }
        Ok(())
    }
    /// The bookkeeping half of [`Buffer::mark_used`]: no wait for a pending copy.
    pub fn note_stream(&self, stream: sys::CUstream) {
        let s = stream as usize;
        if s != self.home && self.bytes > 0 {
            let mut f = self.foreign.lock().unwrap();
            if !f.contains(&s) {
                f.push(s);
            }
        }
    }
    /// Records that a copy into the block, queued on another stream, completes with `event`:
    /// every stream that uses the block from now on waits for it first.
    pub fn set_pending(&self, event: Arc<SharedEvent>) {
        *self.pending.lock().unwrap() = Some(PendingCopy {
            event,
            waited: Vec::new(),
        });
        self.has_pending.store(true, Ordering::Release);
    }
    /// Orders `stream` after the pending copy (once per stream). While the calling thread
    /// captures a CUDA graph the host waits instead: a capturing stream cannot wait for an
    /// event recorded outside the capture (the relaxed capture mode allows the host wait).
    fn wait_pending(&self, stream: sys::CUstream) -> Result<()> {
        let mut p = self.pending.lock().unwrap();
        let Some(copy) = p.as_mut() else {
            return Ok(());
        };
        let s = stream as usize;
        if copy.waited.contains(&s) {
            return Ok(());
        }
        let ev = copy.event.event;
        if self.dev.capturing() {
            // SAFETY: a live event of this context.
            check(unsafe { sys::cuEventSynchronize(ev) }, "from_host")?;
            *p = None;
            self.has_pending.store(false, Ordering::Release);
            return Ok(());
        }
        // SAFETY: a live event and a stream of this context; the event stays recorded for
        // this copy while `copy` holds it (`SharedEvent`).
        check(
            unsafe { sys::cuStreamWaitEvent(stream, ev, 0) },
            "from_host",
        )?;
        copy.waited.push(s);
        Ok(())
    }
    /// Whether a device-side check already found every id read through `l` in `0..limit`
    /// (then an index kernel over the same ids need not synchronize to read the error flag;
    /// contents only change through [`Buffer::contents_changed`]).
    pub fn ids_known_below(&self, l: &kiln_core::Layout, limit: usize) -> bool {
        self.known_id_bound(l).is_some_and(|b| b <= limit)
    }
    /// A bound known for every element read through `l`, as ids: the upload's scan, or a
    /// device-side check of this very layout. Selecting such elements (`index_select`,
    /// `gather`) gives a buffer with the same bound, so the labels of a batch picked from
    /// labels already on the device need no check of their own.
    pub fn known_id_bound(&self, l: &kiln_core::Layout) -> Option<usize> {
        let k = self.ids_ok.lock().unwrap();
        let checked = k
            .checked
            .as_ref()
            .filter(|(ok, _)| ok == l)
            .map(|&(_, lim)| lim);
        // The tighter of the two when both are known.
        match (k.all_below, checked) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }
    /// Records a passed check (see [`Buffer::ids_known_below`]).
    pub fn mark_ids_below(&self, l: &kiln_core::Layout, limit: usize) {
        self.ids_ok.lock().unwrap().checked = Some((l.clone(), limit));
    }
    /// Records that every element of the buffer, read as an id, is in `0..bound` (known on the
    /// host when the contents were uploaded; see `transfer::host_id_bound`).
    pub fn mark_all_ids_below(&self, bound: usize) {
        self.ids_ok.lock().unwrap().all_below = Some(bound);
    }
    /// Forgets what was known of the contents (before an in-place write).
    pub fn contents_changed(&self) {
        *self.ids_ok.lock().unwrap() = IdsKnown::default();
    }
}

/// What is known of a buffer's contents read as ids, so that an index kernel's bounds check
/// need not synchronize to read the device's error flag (one host–GPU round trip per step
/// would otherwise follow every fresh batch of labels).
#[derive(Default)]
struct IdsKnown {
    /// The last device-side check these contents passed: every id read through the layout is
    /// in `0..limit`.
    checked: Option<(kiln_core::Layout, usize)>,
    /// Every element is in `0..bound` (scanned on the host at upload).
    all_below: Option<usize>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        if let Some(pool) = &self.graph {
            pool.put(self.bytes, self.ptr);
            return;
        }
        let dev = self.dev;
        dev.allocator().shrank(self.bytes);
        let home = self.home as sys::CUstream;
        let foreign = std::mem::take(&mut *self.foreign.lock().unwrap());
        if foreign.is_empty() {
            if self.cached {
                dev.allocator().cache_put(self.home, self.bytes, self.ptr);
            } else if dev.bind().is_ok() {
                // SAFETY: `ptr` came from cuMemAllocAsync on this device and is freed once;
                // the free is ordered on its home stream, the only stream that used it.
                unsafe { sys::cuMemFreeAsync(self.ptr, home) };
            }
            return;
        }
        if dev.bind().is_err() {
            return; // the context is gone: leak rather than risk reuse during other work
        }
        let mut events = Vec::with_capacity(foreign.len());
        for s in foreign {
            let recorded = dev.event().and_then(|ev| {
                // SAFETY: a live stream of this device; the event belongs to its context.
                check(
                    unsafe { sys::cuEventRecord(ev, s as sys::CUstream) },
                    "free",
                )?;
                Ok(ev)
            });
            match recorded {
                Ok(ev) => events.push(ev),
                // SAFETY: as above. Without an event, wait for that stream on the host.
                Err(_) => unsafe {
                    sys::cuStreamSynchronize(s as sys::CUstream);
                },
            }
        }
        if self.cached {
            dev.allocator().defer(DeferredFree {
                ptr: self.ptr,
                bytes: self.bytes,
                stream: home,
                events,
            });
        } else {
            for ev in events {
                // SAFETY: the home stream waits for the other streams' uses, then frees.
                unsafe { sys::cuStreamWaitEvent(home, ev, 0) };
                dev.recycle_event(ev);
            }
            // SAFETY: as above; ordered after every use by the waits.
            unsafe { sys::cuMemFreeAsync(self.ptr, home) };
        }
    }
}

/// Moves blocks whose other streams have passed their last use into the cache.
fn sweep_deferred(dev: &DeviceState) {
    dev.allocator().sweep_deferred(
        |d| {
            d.events.iter().all(|&e| {
                // SAFETY: live events of this device's context.
                let r = unsafe { sys::cuEventQuery(e) };
                r != CUresult::CUDA_ERROR_NOT_READY
            })
        },
        |e| dev.recycle_event(e),
    );
}

static BLOCK_CACHE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether freed blocks are cached on the host side (default on; `KILN_CUDA_CACHE=0` turns it
/// off). Blocks already cached stay until [`kiln_core::Backend::empty_cache`].
pub fn set_block_cache(on: bool) {
    BLOCK_CACHE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

fn block_cache_on() -> bool {
    match BLOCK_CACHE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_CUDA_CACHE").map_or(true, |v| v != "0");
            set_block_cache(on);
            on
        }
        v => v == 2,
    }
}

/// `bytes` of device memory on the calling thread's current stream.
pub(crate) fn alloc(dev: &'static DeviceState, bytes: usize) -> Result<Buffer> {
    alloc_on(dev, bytes, dev.stream())
}

/// `bytes` of device memory whose home is `stream` (see the module docs).
pub(crate) fn alloc_on(
    dev: &'static DeviceState,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<Buffer> {
    let home = stream as usize;
    let buffer = |ptr, bytes, cached| Buffer {
        ptr,
        bytes,
        cached,
        dev,
        home,
        foreign: Default::default(),
        pending: Default::default(),
        has_pending: Default::default(),
        ids_ok: Default::default(),
        graph: None,
    };
    if bytes == 0 {
        return Ok(buffer(0, 0, false));
    }
    if let Some(pool) = dev.capture_pool() {
        return alloc_in_graph(dev, pool, bytes, home);
    }
    let cached = block_cache_on();
    let requested = bytes;
    let bytes = if cached { bucket(bytes) } else { bytes };
    crate::profile::alloc(dev, bytes, stream);
    if cached {
        if dev.allocator().has_deferred() {
            sweep_deferred(dev);
        }
        if let Some(p) = dev.allocator().cache_take(home, bytes) {
            dev.allocator().grew(bytes);
            return Ok(buffer(p, bytes, cached));
        }
    }
    let try_alloc = || {
        let mut p = 0;
        // SAFETY: valid out-pointer; the stream belongs to the current context.
        let r = unsafe { sys::cuMemAllocAsync(&mut p, bytes, stream) };
        (r, p)
    };
    let (mut r, mut p) = try_alloc();
    if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        empty_cache(dev)?;
        (r, p) = try_alloc();
    }
    match r {
        CUresult::CUDA_SUCCESS => {}
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            let held = dev.allocator().in_use();
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: valid out-pointers; context is current.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
            return Err(Error::OutOfMemory {
                device: dev.device().to_string(),
                requested,
                held,
                msg: format!(
                    "{} MiB free of {} MiB on the device",
                    free >> 20,
                    total >> 20
                ),
            });
        }
        e => return Err(Error::backend("alloc", format!("{e:?} ({bytes} bytes)"))),
    }
    dev.allocator().grew(bytes);
    Ok(buffer(p, bytes, cached))
}

/// A block of `pool` for a buffer allocated while its graph is being captured: one the capture
/// freed, or a new one from the driver. `cuMemAlloc` rather than the stream-ordered pool, whose
/// allocation on a capturing stream would become a node of the graph.
fn alloc_in_graph(
    dev: &'static DeviceState,
    pool: Arc<GraphPool>,
    bytes: usize,
    home: usize,
) -> Result<Buffer> {
    let bytes = bucket(bytes);
    crate::profile::alloc(dev, bytes, home as sys::CUstream);
    let ptr = match pool.take(bytes) {
        Some(p) => p,
        None => {
            let mut p = 0;
            // SAFETY: valid out-pointer; this device's context is current (callers bind).
            let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes) };
            if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(Error::OutOfMemory {
                    device: dev.device().to_string(),
                    requested: bytes,
                    held: dev.allocator().in_use(),
                    msg: "while capturing a CUDA graph (its memory is private to the graph)".into(),
                });
            }
            check(r, "alloc (graph capture)")?;
            pool.blocks.lock().unwrap().push((p, bytes));
            dev.allocator().grew(bytes);
            p
        }
    };
    Ok(Buffer {
        ptr,
        bytes,
        cached: false,
        dev,
        home,
        foreign: Default::default(),
        pending: Default::default(),
        has_pending: Default::default(),
        ids_ok: Default::default(),
        graph: Some(pool),
    })
}

/// Blocks of graph pools dropped while their thread was capturing another graph, by device:
/// released after that capture ([`release_deferred_graph_blocks`]).
static DEFERRED_GRAPH_BLOCKS: std::sync::Mutex<Vec<(usize, sys::CUdeviceptr, usize)>> =
    std::sync::Mutex::new(Vec::new());

/// Gives a dropped graph pool's blocks back to the driver, once the device is idle (a replay
/// may still be running on any stream). While the calling thread captures a graph on the
/// device, waiting for it would invalidate that capture: the blocks wait for its end instead.
pub(crate) fn release_graph_blocks(ordinal: usize, blocks: &[(sys::CUdeviceptr, usize)]) {
    let Ok(dev) = state(&CudaDevice::new(ordinal)) else {
        return; // the device is gone: nothing to give back to
    };
    if dev.capturing() {
        let mut d = DEFERRED_GRAPH_BLOCKS.lock().unwrap();
        d.extend(blocks.iter().map(|&(p, b)| (ordinal, p, b)));
        return;
    }
    // SAFETY: this device's context is current (bound by `state`).
    if unsafe { sys::cuCtxSynchronize() } != CUresult::CUDA_SUCCESS {
        return; // the context is broken: leak rather than free memory a kernel may still use
    }
    for &(p, bytes) in blocks {
        // SAFETY: `p` came from cuMemAlloc on this device, belongs to no buffer any more (the
        // pool drops after its last buffer) and no work uses it (the device is idle).
        unsafe { sys::cuMemFree_v2(p) };
        dev.allocator().shrank(bytes);
    }
}

/// Releases the blocks [`release_graph_blocks`] deferred on device `ordinal` (called by a
/// capture once it has ended).
pub(crate) fn release_deferred_graph_blocks(ordinal: usize) {
    let mine: Vec<_> = {
        let mut d = DEFERRED_GRAPH_BLOCKS.lock().unwrap();
        let (mine, rest): (Vec<_>, Vec<_>) = d.drain(..).partition(|b| b.0 == ordinal);
        *d = rest;
        mine
    };
    if !mine.is_empty() {
        let blocks: Vec<_> = mine.into_iter().map(|(_, p, b)| (p, b)).collect();
        release_graph_blocks(ordinal, &blocks);
    }
}

/// Keeps `b` alive as long as the graph being captured on the calling thread, if any: the
/// graph's replays will use it whatever happens to the tensors that hold it now.
pub(crate) fn note_capture_use(b: &Arc<Buffer>) {
    if b.graph.is_some() || b.bytes == 0 {
        return;
    }
    if let Some(pool) = b.dev.capture_pool() {
        pool.keep
            .lock()
            .unwrap()
            .entry(b.ptr)
            .or_insert_with(|| b.clone());
    }
}

/// A copy of the whole of `b` (for a write into a buffer that something else still reads).
pub(crate) fn duplicate(b: &Buffer) -> Result<Buffer> {
    let dev = b.state();
    dev.bind()?;
    let out = alloc(dev, b.len_bytes())?;
    if b.len_bytes() > 0 {
        b.mark_used(dev.stream())?;
        let _prof = crate::profile::d2d(dev, "copy", dev.stream(), b.len_bytes());
        // SAFETY: both blocks are `len_bytes` long (same bucket); ordered on the compute stream.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(out.ptr, b.ptr, b.len_bytes(), dev.stream()) },
            "copy",
        )?;
    }
    Ok(out)
}

/// Frees the cached blocks and returns the pool's cached memory to the driver (after every
/// stream of the device is idle).
pub(crate) fn empty_cache(dev: &DeviceState) -> Result<()> {
    dev.sync_all("empty_cache")?;
    sweep_deferred(dev); // every stream is idle: all of them return to the cache
    let blocks = dev.allocator().cache_drain();
    for (s, p) in blocks {
        // SAFETY: each cached block came from cuMemAllocAsync and is owned by the cache only;
        // its home stream is idle.
        unsafe { sys::cuMemFreeAsync(p, s as sys::CUstream) };
    }
    dev.sync_all("empty_cache")?;
    // SAFETY: the pool is this device's default pool; the device is idle.
    check(
        unsafe { sys::cuMemPoolTrimTo(dev.allocator().pool(), 0) },
        "empty_cache",
    )
}

pub(crate) fn memory_stats(dev: &DeviceState) -> Result<MemoryStats> {
    let mut reserved = 0u64;
    // SAFETY: the attribute is a u64; valid out-pointer.
    check(
        unsafe {
            sys::cuMemPoolGetAttribute(
                dev.allocator().pool(),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                &mut reserved as *mut u64 as *mut c_void,
            )
        },
        "memory_stats",
    )?;
    Ok(MemoryStats {
        in_use: dev.allocator().in_use(),
        peak: dev.allocator().peak(),
        reserved: reserved as usize,
    })
}

/// Resets the peak to the current use.
pub fn reset_peak(dev: &CudaDevice) -> Result<()> {
    let s = state(dev)?;
    s.allocator().reset_peak();
    Ok(())
}
