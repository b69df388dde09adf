//! Device memory: buffers, the stream-ordered pool, statistics, out-of-memory handling, and
//! transfers (host through pinned staging buffers, device to device by peer copy).
//!
//! Every buffer is allocated with `cuMemAllocAsync` and freed with `cuMemFreeAsync` on the
//! device's compute stream, from the device's default memory pool whose release threshold we
//! raise to `u64::MAX`: freed memory stays in the pool and the next allocation of a similar
//! size is served without a driver round-trip to the OS, like PyTorch's caching allocator. All
//! kernels run on that same stream, so a freed block can be reused at once: later work is
//! ordered after every earlier use. Work on the copy stream is always followed by a wait of
//! the compute stream on it (or by a host synchronization) before the buffer can be freed.
//!
//! On top of the pool sits a small host-side cache of freed blocks, bucketed by size (rounded
//! up by at most 1/8): a free is a push onto a list and a same-size allocation a pop, with no
//! driver call at all. It is safe for the same reason the pool is (one compute stream orders
//! every use), and it is what makes an allocate-launch-free loop cheaper than the driver pool
//! alone. `KILN_CUDA_CACHE=0` (or [`set_block_cache`]) bypasses it.
//!
//! On out-of-memory we free the cached blocks, return the pool's memory to the driver (trim),
//! synchronize, retry once, and then fail with [`Error::OutOfMemory`] naming the request and
//! what we hold.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUresult};
use kiln_core::{Error, MemoryStats, Result};

use crate::device::{CudaDevice, DeviceState, STAGING_BLOCKS, STAGING_BYTES, check, state};

/// One untyped block of memory on one GPU (the dtype lives in the tensor); what a computed
/// [`crate::CudaStorage`] holds. Returned to the block cache (or freed) on drop.
pub(crate) struct Buffer {
    ptr: sys::CUdeviceptr,
    /// The block's size (the request rounded up to its cache bucket).
    bytes: usize,
    /// Whether the block returns to the host-side cache on drop.
    cached: bool,
    dev: &'static DeviceState,
    /// The last index check these contents passed, as ids: every id read through the layout
    /// is in `0..limit` (see [`Buffer::ids_known_below`]).
    ids_ok: std::sync::Mutex<Option<(kiln_core::Layout, usize)>>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer({} bytes on cuda:{})",
            self.bytes, self.dev.ordinal
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
    /// Whether a device-side check already found every id read through `l` in `0..limit`
    /// (then an index kernel over the same ids need not synchronize to read the error flag;
    /// contents only change through [`Buffer::contents_changed`]).
    pub fn ids_known_below(&self, l: &kiln_core::Layout, limit: usize) -> bool {
        matches!(&*self.ids_ok.lock().unwrap(), Some((ok, lim)) if ok == l && *lim <= limit)
    }
    /// Records a passed check (see [`Buffer::ids_known_below`]).
    pub fn mark_ids_below(&self, l: &kiln_core::Layout, limit: usize) {
        *self.ids_ok.lock().unwrap() = Some((l.clone(), limit));
    }
    /// Forgets what was known of the contents (before an in-place write).
    pub fn contents_changed(&self) {
        *self.ids_ok.lock().unwrap() = None;
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        self.dev.in_use.fetch_sub(self.bytes, Ordering::Relaxed);
        if self.cached {
            let mut c = self.dev.block_cache.lock().unwrap();
            c.bytes += self.bytes;
            c.free.entry(self.bytes).or_default().push(self.ptr);
            return;
        }
        if self.dev.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAllocAsync on this device and is freed once; the
            // free is ordered on the compute stream after every kernel that used it.
            unsafe {
                sys::cuMemFreeAsync(self.ptr, self.dev.compute);
            }
        }
    }
}

/// Freed blocks kept for reuse, by block size.
#[derive(Default)]
pub(crate) struct BlockCache {
    pub free: kiln_core::fasthash::FastMap<usize, Vec<sys::CUdeviceptr>>,
    /// Total bytes in `free`.
    pub bytes: usize,
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

/// The cache bucket of a request: a multiple of 512 bytes and of 1/8 of the request's power of
/// two, so rounding wastes at most 12.5% and similar sizes share blocks.
pub(crate) fn bucket(bytes: usize) -> usize {
    let step = (bytes.next_power_of_two() / 8).max(512);
    bytes.next_multiple_of(step)
}

pub(crate) fn alloc(dev: &'static DeviceState, bytes: usize) -> Result<Buffer> {
    if bytes == 0 {
        return Ok(Buffer {
            ptr: 0,
            bytes,
            cached: false,
            dev,
            ids_ok: Default::default(),
        });
    }
    let cached = block_cache_on();
    let requested = bytes;
    let bytes = if cached { bucket(bytes) } else { bytes };
    if cached {
        let mut c = dev.block_cache.lock().unwrap();
        if let Some(p) = c.free.get_mut(&bytes).and_then(|v| v.pop()) {
            c.bytes -= bytes;
            drop(c);
            let now = dev.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
            dev.peak.fetch_max(now, Ordering::Relaxed);
            return Ok(Buffer {
                ptr: p,
                bytes,
                cached,
                dev,
                ids_ok: Default::default(),
            });
        }
    }
    let try_alloc = || {
        let mut p = 0;
        // SAFETY: valid out-pointer; the stream belongs to the current context.
        let r = unsafe { sys::cuMemAllocAsync(&mut p, bytes, dev.compute) };
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
            let held = dev.in_use.load(Ordering::Relaxed);
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
    let now = dev.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
    dev.peak.fetch_max(now, Ordering::Relaxed);
    Ok(Buffer {
        ptr: p,
        bytes,
        cached,
        dev,
        ids_ok: Default::default(),
    })
}

/// Frees the cached blocks and returns the pool's cached memory to the driver (after the
/// device is idle).
/// A copy of the whole of `b` (for a write into a buffer that something else still reads).
pub(crate) fn duplicate(b: &Buffer) -> Result<Buffer> {
    let dev = b.state();
    dev.bind()?;
    let out = alloc(dev, b.len_bytes())?;
    if b.len_bytes() > 0 {
        // SAFETY: both blocks are `len_bytes` long (same bucket); ordered on the compute stream.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(out.ptr, b.ptr, b.len_bytes(), dev.compute) },
            "copy",
        )?;
    }
    Ok(out)
}

pub(crate) fn empty_cache(dev: &DeviceState) -> Result<()> {
    let blocks: Vec<_> = {
        let mut c = dev.block_cache.lock().unwrap();
        c.bytes = 0;
        c.free.drain().flat_map(|(_, v)| v).collect()
    };
    for p in blocks {
        // SAFETY: each cached block came from cuMemAllocAsync and is owned by the cache only.
        unsafe { sys::cuMemFreeAsync(p, dev.compute) };
    }
    dev.sync("empty_cache")?;
    // SAFETY: the pool is this device's default pool; the device is idle.
    check(unsafe { sys::cuMemPoolTrimTo(dev.pool, 0) }, "empty_cache")
}

pub(crate) fn memory_stats(dev: &DeviceState) -> Result<MemoryStats> {
    let mut reserved = 0u64;
    // SAFETY: the attribute is a u64; valid out-pointer.
    check(
        unsafe {
            sys::cuMemPoolGetAttribute(
                dev.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                &mut reserved as *mut u64 as *mut c_void,
            )
        },
        "memory_stats",
    )?;
    Ok(MemoryStats {
        in_use: dev.in_use.load(Ordering::Relaxed),
        peak: dev.peak.load(Ordering::Relaxed),
        reserved: reserved as usize,
    })
}

/// Resets the peak to the current use.
pub fn reset_peak(dev: &CudaDevice) -> Result<()> {
    let s = state(dev)?;
    s.peak
        .store(s.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
    Ok(())
}

// ---- transfers -------------------------------------------------------------------------------

/// Takes the next block of the pinned ring (allocating it on first use). With `wait`, blocks
/// until the block's previous DMA has finished (needed before the host writes into it).
fn staging_block(st: &mut crate::device::Staging, wait: bool) -> Result<usize> {
    let i = st.next;
    st.next = (st.next + 1) % STAGING_BLOCKS;
    if st.blocks.len() <= i {
        // SAFETY: valid out-pointers; the pinned block and event are owned by the ring.
        unsafe {
            let mut h = std::ptr::null_mut();
            check(
                sys::cuMemHostAlloc(&mut h, STAGING_BYTES, 0),
                "pinned staging alloc",
            )?;
            let mut ev = std::ptr::null_mut();
            check(
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
                "cuEventCreate",
            )?;
            st.blocks.push((h as *mut u8, ev));
        }
    } else if wait {
        // SAFETY: a live event of this context (never recorded counts as complete).
        check(
            unsafe { sys::cuEventSynchronize(st.blocks[i].1) },
            "staging wait",
        )?;
    }
    Ok(i)
}

/// Uploads `bytes` into a new buffer: chunks go through the pinned ring on the copy stream;
/// the call returns once the last chunk is queued (asynchronous for up to the ring's size).
pub(crate) fn upload(dev: &'static DeviceState, data: &[u8]) -> Result<Buffer> {
    let dst = alloc(dev, data.len())?;
    if data.is_empty() {
        return Ok(dst);
    }
    dev.order(dev.compute, dev.copy, "from_host")?;
    {
        let mut st = dev.staging.lock().unwrap();
        for (k, chunk) in data.chunks(STAGING_BYTES).enumerate() {
            let i = staging_block(&mut st, true)?;
            let (h, ev) = st.blocks[i];
            // SAFETY: `h` is a pinned block of STAGING_BYTES >= chunk.len() whose previous DMA
            // has completed; the device range lies inside `dst`.
            unsafe {
                std::ptr::copy_nonoverlapping(chunk.as_ptr(), h, chunk.len());
                check(
                    sys::cuMemcpyHtoDAsync_v2(
                        dst.ptr + (k * STAGING_BYTES) as u64,
                        h as *const c_void,
                        chunk.len(),
                        dev.copy,
                    ),
                    "from_host",
                )?;
                check(sys::cuEventRecord(ev, dev.copy), "from_host")?;
            }
        }
    }
    dev.order(dev.copy, dev.compute, "from_host")?;
    Ok(dst)
}

/// Downloads `len` bytes from `src` at byte offset `off` (a contiguous range), pipelined
/// through the pinned ring on the copy stream.
pub(crate) fn download(src: &Buffer, off: usize, out: &mut [u8]) -> Result<()> {
    let dev = src.dev;
    if out.is_empty() {
        return Ok(());
    }
    dev.order(dev.compute, dev.copy, "to_host")?;
    let mut st = dev.staging.lock().unwrap();
    let n = out.len().div_ceil(STAGING_BYTES);
    let mut pending: std::collections::VecDeque<(usize, usize)> = Default::default();
    let drain =
        |st: &crate::device::Staging, out: &mut [u8], (k, i): (usize, usize)| -> Result<()> {
            let (h, ev) = st.blocks[i];
            let start = k * STAGING_BYTES;
            let len = (out.len() - start).min(STAGING_BYTES);
            // SAFETY: the event marks the end of this chunk's DMA into the pinned block `h`.
            unsafe {
                check(sys::cuEventSynchronize(ev), "to_host")?;
                std::ptr::copy_nonoverlapping(h, out[start..].as_mut_ptr(), len);
            }
            Ok(())
        };
    for k in 0..n {
        if pending.len() == STAGING_BLOCKS {
            let p = pending.pop_front().unwrap();
            drain(&st, out, p)?;
        }
        // No host wait needed: a DMA into the block is ordered after its earlier uses on the
        // same copy stream.
        let i = staging_block(&mut st, false)?;
        let (h, ev) = st.blocks[i];
        let start = k * STAGING_BYTES;
        let len = (out.len() - start).min(STAGING_BYTES);
        // SAFETY: the source range lies inside `src`; `h` holds STAGING_BYTES; its previous
        // use was drained above (at most STAGING_BLOCKS chunks are in flight).
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    h as *mut c_void,
                    src.ptr + (off + start) as u64,
                    len,
                    dev.copy,
                ),
                "to_host",
            )?;
            check(sys::cuEventRecord(ev, dev.copy), "to_host")?;
        }
        pending.push_back((k, i));
    }
    while let Some(p) = pending.pop_front() {
        drain(&st, out, p)?;
    }
    Ok(())
}

/// Copies `bytes` from `src` (byte offset `off`) into a new buffer on `dst_dev`: a peer copy
/// between GPUs (direct over NVLink/PCIe when the devices can access each other).
pub(crate) fn copy_peer(
    src: &Buffer,
    off: usize,
    bytes: usize,
    dst_dev: &'static DeviceState,
) -> Result<Buffer> {
    let src_dev = src.dev;
    enable_peer(src_dev, dst_dev);
    dst_dev.bind()?;
    let dst = alloc(dst_dev, bytes)?;
    if bytes == 0 {
        return Ok(dst);
    }
    // dst's (recycled) memory may still be in use by earlier work on dst's stream.
    cross_order(dst_dev, src_dev, "copy_to_device")?;
    src_dev.bind()?;
    // SAFETY: both ranges are inside live buffers; the copy is ordered on src's compute
    // stream after src's producers, and after dst's earlier work by the event above.
    check(
        unsafe {
            sys::cuMemcpyPeerAsync(
                dst.ptr,
                dst_dev.ctx,
                src.ptr + off as u64,
                src_dev.ctx,
                bytes,
                src_dev.compute,
            )
        },
        "copy_to_device",
    )?;
    cross_order(src_dev, dst_dev, "copy_to_device")?;
    dst_dev.bind()?;
    Ok(dst)
}

/// Makes `to`'s compute stream wait for the work queued so far on `from`'s compute stream.
fn cross_order(from: &DeviceState, to: &DeviceState, op: &'static str) -> Result<()> {
    from.bind()?;
    // SAFETY: the event is created in `from`'s context and recorded on its stream; waiting on
    // an event of another context is allowed; destroying it after the wait is enqueued is too.
    unsafe {
        let mut ev = std::ptr::null_mut();
        check(
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
            op,
        )?;
        check(sys::cuEventRecord(ev, from.compute), op)?;
        to.bind()?;
        let r = check(sys::cuStreamWaitEvent(to.compute, ev, 0), op);
        from.bind()?;
        sys::cuEventDestroy_v2(ev);
        r
    }
}

/// Enables direct peer access between two GPUs (context and pool), once per pair, when the
/// hardware allows; otherwise peer copies are staged by the driver.
fn enable_peer(a: &DeviceState, b: &DeviceState) {
    for (x, y) in [(a, b), (b, a)] {
        let mut done = x.peers_enabled.lock().unwrap();
        if done.contains(&y.ordinal) {
            continue;
        }
        done.push(y.ordinal);
        let mut can = 0;
        // SAFETY: valid devices and out-pointer; failures only mean no direct access.
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, x.cu_dev, y.cu_dev);
            if can == 0 || x.bind().is_err() {
                continue;
            }
            sys::cuCtxEnablePeerAccess(y.ctx, 0);
            // Let x read and write memory of y's pool.
            let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            set_location_id(&mut desc.location, x.ordinal as i32);
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            sys::cuMemPoolSetAccess(y.pool, &desc, 1);
        }
    }
}

fn set_location_id(l: &mut sys::CUmemLocation, id: i32) {
    l.id = id;
}
