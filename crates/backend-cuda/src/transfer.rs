//! Copies between the host and a GPU, and between GPUs.
//!
//! Host to device: the destination is allocated on the device's copy stream and the copy runs
//! there, so it overlaps kernels queued on the compute stream (a DataLoader thread's upload
//! overlaps the training step); the buffer is marked as used on the caller's current stream
//! (see `memory.rs`). From page-locked memory (a pinned tensor, or any range of the pinned
//! pool) the copy is one direct DMA, and when the source's owner is known the call returns
//! before the DMA ends (PyTorch's `non_blocking`): the owner is kept in the device's in-flight
//! list until the copy's event completes, and the first use of the buffer on each stream waits
//! for that event ([`upload_pinned`] says why not the caller's stream at once). Otherwise the
//! caller's stream waits for the copy with an event right away. From
//! ordinary memory the bytes go through a ring of pinned staging blocks: the host copies chunk
//! `k + 1` into the ring (split over threads, [`host_copy`]) while the DMA engine moves chunk
//! `k`, and nothing else is allocated on the way.
//!
//! Device to host: the copy stream first waits for the caller's current stream (the producers),
//! then the bytes come straight into the caller's buffer when it is page-locked, else through
//! the ring the other way. Every device-to-host copy is synchronous: it returns with the data.
//!
//! Whether registering a large ordinary buffer with the driver (`cuMemHostRegister`) pays
//! instead of staging was measured (BENCHMARKS.md, "transfers"): pinning pages costs more
//! than the staged copy of the same bytes, so kiln stages.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use kiln_core::{DType, HostSource, Result};

use crate::device::{
    DeviceState, InFlight, STAGING_BLOCKS, SharedEvent, Staging, check, staging_bytes,
};
use crate::memory::{Buffer, alloc, alloc_on};
use crate::pinned;

/// Host copies below this size run on the calling thread.
const PAR_COPY_MIN: usize = 1 << 20;

/// Threads used for one large host copy: `KILN_CUDA_COPY_THREADS`, else up to 8 of rayon's.
pub fn copy_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("KILN_CUDA_COPY_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| rayon::current_num_threads().min(8))
            .max(1)
    })
}

/// Integer uploads at most this large are scanned on the host for their range (a few µs for a
/// batch of labels; bigger id tensors skip the scan and are checked on the device).
pub(crate) const ID_SCAN_MAX_BYTES: usize = 1 << 20;

/// [`kiln_core::host::id_bound`] for uploads of at most [`ID_SCAN_MAX_BYTES`] (`None` above).
pub(crate) fn host_id_bound(dtype: DType, bytes: &[u8]) -> Option<usize> {
    if bytes.len() > ID_SCAN_MAX_BYTES {
        return None;
    }
    kiln_core::host::id_bound(dtype, bytes)
}

/// `dst.copy_from_slice(src)`, split over [`copy_threads`] threads when large: one thread's
/// memcpy does not saturate host memory bandwidth, and on fresh pages the page faults are
/// spread over cores too.
pub(crate) fn host_copy(dst: &mut [u8], src: &[u8]) {
    let threads = copy_threads();
    if src.len() < PAR_COPY_MIN || threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    use rayon::prelude::*;
    let piece = src.len().div_ceil(threads).next_multiple_of(4096);
    dst.par_chunks_mut(piece)
        .zip(src.par_chunks(piece))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Takes the next block of the pinned ring (allocating it on first use). With `wait`, blocks
/// until the block's previous DMA has finished (needed before the host writes into it).
fn staging_block(st: &mut Staging, wait: bool) -> Result<usize> {
    let block_bytes = staging_bytes();
    let i = st.next;
    st.next = (st.next + 1) % STAGING_BLOCKS;
    if st.blocks.len() <= i {
        // SAFETY: valid out-pointers; the pinned block and event are owned by the ring.
        unsafe {
            let mut h = std::ptr::null_mut();
            check(
                sys::cuMemHostAlloc(&mut h, block_bytes, 0),
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

/// A new buffer on `dev` holding `src.bytes` (see the module docs for when this returns
/// before the copy is done).
pub(crate) fn upload(dev: &'static DeviceState, src: HostSource<'_>) -> Result<Buffer> {
    dev.refuse_in_capture("from_host", "copying from the host")?;
    let data = src.bytes;
    let pinned = !data.is_empty() && (src.pinned || pinned::is_pinned(data.as_ptr(), data.len()));
    if let (true, Some(owner)) = (pinned, src.owner) {
        let mut bufs = upload_pinned(dev, &[(data, owner)])?;
        return Ok(bufs.pop().expect("one buffer per source"));
    }
    dev.bind()?;
    let user = dev.stream();
    let dst = alloc_on(dev, data.len(), dev.copy_stream())?;
    if data.is_empty() {
        return Ok(dst);
    }
    dev.sweep_in_flight();
    if pinned {
        // SAFETY: `data` is page-locked host memory that the caller lends for this call only:
        // we wait for the copy before returning; the device range is `dst`.
        unsafe { dma_to_device(dev, dst.device_ptr(), data) }?;
        let _prof = crate::profile::sync(dev, "from_host");
        // SAFETY: the copy stream belongs to this (current) context.
        check(
            unsafe { sys::cuStreamSynchronize(dev.copy_stream()) },
            "from_host",
        )?;
    } else {
        let block_bytes = staging_bytes();
        let mut st = dev.transfers().staging();
        for (k, chunk) in data.chunks(block_bytes).enumerate() {
            let i = staging_block(&mut st, true)?;
            let (h, ev) = st.blocks[i];
            // SAFETY: `h` is a pinned block of block_bytes >= chunk.len() whose previous DMA
            // has completed (waited above), so the host may write it.
            let block = unsafe { std::slice::from_raw_parts_mut(h, chunk.len()) };
            host_copy(block, chunk);
            // SAFETY: the device range lies inside `dst`; the pinned block is not written
            // again before its event (recorded next) has completed.
            unsafe {
                dma_to_device(dev, dst.device_ptr() + (k * block_bytes) as u64, block)?;
                check(sys::cuEventRecord(ev, dev.copy_stream()), "from_host")?;
            }
        }
    }
    dst.note_stream(user);
    dev.order(dev.copy_stream(), user, "from_host")?;
    Ok(dst)
}

/// Copies page-locked sources to new device buffers asynchronously on the copy stream: one
/// DMA each, then one event that tells when the sources (kept alive by their owners until
/// then) may go, and that each buffer's first use on a stream waits for
/// ([`Buffer::set_pending`]). A batch's features and labels thus cost one event, not one each.
///
/// Why not order the caller's stream after the copies here: the DataLoader uploads the next
/// group of batches ahead, before the current step's kernels are queued, and a wait queued
/// now would hold those kernels until the next batch's DMA was done (~66 µs for 3.1 MB,
/// against a 0.15 ms step of a small MLP on an H200).
pub(crate) fn upload_pinned(
    dev: &'static DeviceState,
    srcs: &[(&[u8], Arc<dyn Any + Send + Sync>)],
) -> Result<Vec<Buffer>> {
    dev.refuse_in_capture("from_host", "copying from the host")?;
    dev.bind()?;
    let user = dev.stream();
    dev.sweep_in_flight();
    let mut bufs = Vec::with_capacity(srcs.len());
    for (data, _) in srcs {
        let dst = alloc_on(dev, data.len(), dev.copy_stream())?;
        if !data.is_empty() {
            // SAFETY: `data` is page-locked host memory kept alive by its owner (held in
            // `in_flight` below) until the DMA is done; the device range is `dst`.
            unsafe { dma_to_device(dev, dst.device_ptr(), data) }?;
        }
        bufs.push(dst);
    }
    let owners = srcs.iter().map(|(_, o)| o.clone()).collect();
    hand_over(dev, user, &bufs, owners, "from_host")?;
    Ok(bufs)
}

/// Ends an asynchronous fill of `bufs` queued on the copy stream (pinned uploads, the GPU's
/// gather from host memory): one event after it keeps `owners` (the host memory it reads) in
/// the in-flight list until it completes, and each buffer's first use on a stream waits for
/// it ([`Buffer::set_pending`]); the buffers count as used on `user`, the caller's stream.
pub(crate) fn hand_over(
    dev: &'static DeviceState,
    user: sys::CUstream,
    bufs: &[Buffer],
    owners: Vec<Arc<dyn Any + Send + Sync>>,
    op: &'static str,
) -> Result<()> {
    let event = Arc::new(SharedEvent::record(dev, dev.copy_stream(), op)?);
    dev.transfers().keep_in_flight(InFlight {
        event: event.clone(),
        _owner: Arc::new(owners),
    });
    for b in bufs {
        b.note_stream(user);
        b.set_pending(event.clone());
    }
    Ok(())
}

/// Queues one copy of `src` to device address `dst` on the copy stream (profiled as a
/// host-to-device copy). Every caller passes page-locked memory, so the copy is one DMA and
/// the call returns before it is done.
///
/// # Safety
/// `src` must stay alive and unchanged until the copy stream has passed this copy, and
/// `dst..dst + src.len()` must lie in a live buffer of `dev`.
pub(crate) unsafe fn dma_to_device(dev: &DeviceState, dst: u64, src: &[u8]) -> Result<()> {
    let _prof = crate::profile::h2d(dev, "from_host", dev.copy_stream(), src.len());
    // SAFETY: the caller's contract above.
    check(
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.as_ptr() as *const c_void,
                src.len(),
                dev.copy_stream(),
            )
        },
        "from_host",
    )
}

/// Reads `out.len()` bytes from `src` at byte offset `off` (a contiguous range) into `out`,
/// after the work queued so far on the caller's current stream.
pub(crate) fn download(src: &Buffer, off: usize, out: &mut [u8]) -> Result<()> {
    let dev = src.state();
    if out.is_empty() {
        return Ok(());
    }
    dev.refuse_in_capture("to_host", "copying to the host")?;
    dev.bind()?;
    dev.order(dev.stream(), dev.copy_stream(), "to_host")?;
    if pinned::is_pinned(out.as_ptr(), out.len()) {
        let prof = crate::profile::d2h(dev, "to_host", dev.copy_stream(), out.len());
        // SAFETY: `out` is page-locked memory the caller lends us until we return, after the
        // copy stream is synchronized; the source range lies inside `src`.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr() as *mut c_void,
                    src.device_ptr() + off as u64,
                    out.len(),
                    dev.copy_stream(),
                ),
                "to_host",
            )?;
            drop(prof);
            let _prof = crate::profile::sync(dev, "to_host");
            return check(sys::cuStreamSynchronize(dev.copy_stream()), "to_host");
        }
    }
    let block_bytes = staging_bytes();
    let mut st = dev.transfers().staging();
    let n = out.len().div_ceil(block_bytes);
    let mut pending: std::collections::VecDeque<(usize, usize)> = Default::default();
    let drain = |st: &Staging, out: &mut [u8], (k, i): (usize, usize)| -> Result<()> {
        let (h, ev) = st.blocks[i];
        let start = k * block_bytes;
        let len = (out.len() - start).min(block_bytes);
        let prof = crate::profile::sync(dev, "to_host");
        // SAFETY: the event marks the end of this chunk's DMA into the pinned block `h`.
        check(unsafe { sys::cuEventSynchronize(ev) }, "to_host")?;
        drop(prof);
        // SAFETY: `h` holds `len` bytes written by that DMA; nothing else touches it until
        // the next DMA into it is queued (after this drain).
        let block = unsafe { std::slice::from_raw_parts(h, len) };
        host_copy(&mut out[start..start + len], block);
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
        let start = k * block_bytes;
        let len = (out.len() - start).min(block_bytes);
        let _prof = crate::profile::d2h(dev, "to_host", dev.copy_stream(), len);
        // SAFETY: the source range lies inside `src`; `h` holds block_bytes; its previous
        // use was drained above (at most STAGING_BLOCKS chunks are in flight).
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    h as *mut c_void,
                    src.device_ptr() + (off + start) as u64,
                    len,
                    dev.copy_stream(),
                ),
                "to_host",
            )?;
            check(sys::cuEventRecord(ev, dev.copy_stream()), "to_host")?;
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
    let src_dev = src.state();
    enable_peer(src_dev, dst_dev);
    dst_dev.bind()?;
    let dst = alloc(dst_dev, bytes)?;
    if bytes == 0 {
        return Ok(dst);
    }
    // dst's (recycled) memory may still be in use by earlier work on dst's stream.
    cross_order(dst_dev, src_dev, "copy_to_device")?;
    src_dev.bind()?;
    let _prof = crate::profile::d2d(src_dev, "copy_to_device", src_dev.stream(), bytes);
    // SAFETY: both ranges are inside live buffers; the copy is ordered on src's current
    // stream after src's producers, and after dst's earlier work by the event above.
    check(
        unsafe {
            sys::cuMemcpyPeerAsync(
                dst.device_ptr(),
                dst_dev.ctx(),
                src.device_ptr() + off as u64,
                src_dev.ctx(),
                bytes,
                src_dev.stream(),
            )
        },
        "copy_to_device",
    )?;
    cross_order(src_dev, dst_dev, "copy_to_device")?;
    dst_dev.bind()?;
    Ok(dst)
}

/// Makes `to`'s current stream wait for the work queued so far on `from`'s current stream.
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
        check(sys::cuEventRecord(ev, from.stream()), op)?;
        to.bind()?;
        let r = check(sys::cuStreamWaitEvent(to.stream(), ev, 0), op);
        from.bind()?;
        sys::cuEventDestroy_v2(ev);
        r
    }
}

/// Enables direct peer access between two GPUs (context and pool), once per pair, when the
/// hardware allows; otherwise peer copies are staged by the driver.
fn enable_peer(a: &DeviceState, b: &DeviceState) {
    for (x, y) in [(a, b), (b, a)] {
        x.transfers().with_peer_once(y.ordinal(), || {
            let mut can = 0;
            // SAFETY: valid devices and out-pointer; failures only mean no direct access.
            unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, x.cu_dev(), y.cu_dev());
                if can == 0 || x.bind().is_err() {
                    return;
                }
                sys::cuCtxEnablePeerAccess(y.ctx(), 0);
                // Let x read and write memory of y's pool.
                let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
                desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                set_location_id(&mut desc.location, x.ordinal() as i32);
                desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                sys::cuMemPoolSetAccess(y.allocator().pool(), &desc, 1);
            }
        });
    }
}

fn set_location_id(l: &mut sys::CUmemLocation, id: i32) {
    l.id = id;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn i64s(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    #[test]
    fn host_id_bound_is_one_past_the_largest_non_negative_id() {
        assert_eq!(host_id_bound(DType::I64, &i64s(&[3, 0, 9, 2])), Some(10));
        assert_eq!(host_id_bound(DType::I64, &i64s(&[])), Some(0));
        assert_eq!(host_id_bound(DType::I64, &i64s(&[3, -1])), None);
        assert_eq!(host_id_bound(DType::U8, &[4, 200, 7]), Some(201));
        assert_eq!(host_id_bound(DType::F32, &[0; 8]), None);
        let big = vec![0u8; ID_SCAN_MAX_BYTES + 8];
        assert_eq!(host_id_bound(DType::I64, &big), None, "too big to scan");
    }
}
