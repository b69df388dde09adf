//! Storage: one typed `Vec` per tensor (its elements starting on a cache line:
//! [`AlignedVec`]), memory accounting, and a small buffer cache.
//!
//! Why a cache: a fresh multi-megabyte `Vec` comes from `mmap`, so every page of it faults on
//! first write; for a memory-bound op such as `add` over 32M f32 the faults cost about as much
//! as the arithmetic (see BENCHMARKS.md). Buffers of at least [`CACHE_MIN_BYTES`] are therefore
//! returned to a per-device cache keyed by dtype and exact length when their storage drops, and
//! reused by the next allocation of the same size — the common case in a training loop, where
//! shapes repeat every step. The cache holds at most [`CACHE_MAX_BYTES`] per device;
//! `Backend::empty_cache` frees it. Buffers from 1 KiB up are cached, not only the large ones:
//! glibc serves requests of 1 KiB and more from its sorted bins (no thread cache), and each such
//! `calloc` consolidated the fast bins, searched the bins and zeroed the block, about 1,300
//! instructions (callgrind) for the 400- and 784-element vectors of a logistic-regression step.
//! Only smaller buffers go straight to the system allocator, whose thread cache is fast for them.
//!
//! Accounting: `in_use` counts bytes of live storages, `peak` its maximum, `reserved` adds the
//! cached bytes. All are plain atomics per virtual device.
//!
//! Failure: every buffer an op creates comes through `alloc` (or `new_vec`), which never
//! aborts the process. A size that cannot exist (an element count or byte size past the address
//! space: a shape whose element count overflowed saturates at `usize::MAX`) is an
//! [`Error::InvalidArgument`] naming the op; a size the system allocator refuses is an
//! [`Error::OutOfMemory`], returned after the cache was emptied and the allocation retried once.
//! So a user who asks for `zeros([1 << 40])` gets an error and a device that still works, not
//! Rust's `memory allocation of ... bytes failed` abort. Fresh buffers come zeroed from `calloc`
//! (`bytemuck::allocation::try_zeroed_vec`), as `vec![0; n]` did before: the kernel that fills
//! them then takes the page faults in parallel, where `Vec::try_reserve_exact` plus a fill would
//! add one single-threaded pass over the whole buffer. (Under Linux's default heuristic
//! overcommit a request beyond RAM plus swap is refused up front; a system set to always
//! overcommit hands out address space and fails later, where no library can report it.)
//!
//! Pinned memory: a storage's elements may live in a page-locked block from the pinned allocator
//! a GPU backend registered with kiln-core ([`HostVec::Pinned`]; `Tensor::pin_memory`). Every
//! kernel sees a plain slice either way; copies between such a storage and a GPU are direct DMA.
//! Pinned blocks are pooled by the GPU backend, so they bypass the cache below.
//!
//! The data sit in a `Block` behind an `Arc`, so that a kernel can hand a `'static` reference
//! to a helper thread (the split GEMM of `matmul.rs` does) and a deferred op (`lazy.rs`) can
//! hold its inputs; the memory counts as in use, and returns to the cache, with the last holder.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::expr::defer::{self, Deferral};
use kiln_core::fasthash::FastMap;
use kiln_core::{DType, Error, HostBuffer, MemoryStats, PinnedBlock, Result, bf16, f16};

pub use crate::aligned::AlignedVec;
use crate::device::{CpuDevice, MAX_CPU_DEVICES};

/// Buffers smaller than this are never cached: glibc's own per-thread cache serves them (see
/// the module docs). 256 KiB until 2026-11-27; at 1 KiB a logistic-regression step (400x784,
/// `bench_train --which logreg`) runs 3.1% fewer instructions (callgrind, 300 steps: 178.2M
/// against 172.6M).
pub const CACHE_MIN_BYTES: usize = 1 << 10;
/// The most bytes the cache keeps per device.
pub const CACHE_MAX_BYTES: usize = 2 << 30;

/// A storage's elements: ordinary memory (starting on a cache line, [`AlignedVec`]), or
/// page-locked memory. Dereferences to a slice.
pub enum HostVec<T> {
    Heap(AlignedVec<T>),
    /// `len` elements at the start of a pinned block.
    Pinned {
        block: PinnedBlock,
        len: usize,
        _t: std::marker::PhantomData<T>,
    },
}

impl<T: bytemuck::Pod> HostVec<T> {
    /// A pinned copy of `data`.
    pub fn pinned(op: &'static str, data: &[T]) -> Result<Self> {
        Ok(HostVec::Pinned {
            block: PinnedBlock::from_bytes(op, bytemuck::cast_slice(data))?,
            len: data.len(),
            _t: std::marker::PhantomData,
        })
    }
    pub fn is_pinned(&self) -> bool {
        matches!(self, HostVec::Pinned { .. })
    }
}

impl<T: CpuElem> HostVec<T> {
    /// `len` zeroed elements in pinned memory.
    pub fn pinned_zeroed(op: &'static str, len: usize) -> Result<Self> {
        Ok(HostVec::Pinned {
            block: PinnedBlock::new(op, byte_size::<T>(op, len)?)?,
            len,
            _t: std::marker::PhantomData,
        })
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for HostVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            HostVec::Heap(v) => v,
            HostVec::Pinned { block, len, .. } => &bytemuck::cast_slice(block.as_bytes())[..*len],
        }
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for HostVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            HostVec::Heap(v) => v,
            HostVec::Pinned { block, len, .. } => {
                &mut bytemuck::cast_slice_mut(block.as_bytes_mut())[..*len]
            }
        }
    }
}

/// A clone lands in ordinary memory (pin it again if needed).
impl<T: bytemuck::Pod> Clone for HostVec<T> {
    fn clone(&self) -> Self {
        HostVec::Heap(AlignedVec::from_slice(self))
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for HostVec<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: bytemuck::Pod + std::fmt::Debug> std::fmt::Debug for HostVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_pinned() {
            f.write_str("pinned ")?;
        }
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The caller's vector, moved onto a cache line within its own allocation when it is large
/// enough to care ([`AlignedVec::from_vec`]).
impl<T: bytemuck::Pod> From<Vec<T>> for HostVec<T> {
    fn from(v: Vec<T>) -> Self {
        HostVec::Heap(AlignedVec::from_vec(v))
    }
}

/// The typed contents of a storage.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuData {
    F32(HostVec<f32>),
    F64(HostVec<f64>),
    I64(HostVec<i64>),
    U8(HostVec<u8>),
    F16(HostVec<f16>),
    BF16(HostVec<bf16>),
}

/// Runs `$body` with `$t` the element type of `$dtype` (`$data`'s variant, when given, bound
/// to `$v`), for the six dtypes; `$other` for a dtype this crate does not know.
macro_rules! with_elem {
    ($dtype:expr, $t:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            kiln_core::DType::F32 => {
                type $t = f32;
                $body
            }
            kiln_core::DType::F64 => {
                type $t = f64;
                $body
            }
            kiln_core::DType::I64 => {
                type $t = i64;
                $body
            }
            kiln_core::DType::U8 => {
                type $t = u8;
                $body
            }
            kiln_core::DType::F16 => {
                type $t = kiln_core::f16;
                $body
            }
            kiln_core::DType::BF16 => {
                type $t = kiln_core::bf16;
                $body
            }
            #[allow(unreachable_patterns)]
            _ => $other,
        }
    };
}
pub(crate) use with_elem;

/// Runs `$body` with `$v` bound to the typed vector inside `$data` (a `CpuData` or a
/// reference to one), whatever its variant.
macro_rules! each_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            CpuData::F32($v) => $body,
            CpuData::F64($v) => $body,
            CpuData::I64($v) => $body,
            CpuData::U8($v) => $body,
            CpuData::F16($v) => $body,
            CpuData::BF16($v) => $body,
        }
    };
}

impl CpuData {
    pub fn dtype(&self) -> DType {
        match self {
            CpuData::F32(_) => DType::F32,
            CpuData::F64(_) => DType::F64,
            CpuData::I64(_) => DType::I64,
            CpuData::U8(_) => DType::U8,
            CpuData::F16(_) => DType::F16,
            CpuData::BF16(_) => DType::BF16,
        }
    }

    pub fn len(&self) -> usize {
        each_data!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    pub(crate) fn from_host_owned(h: HostBuffer) -> CpuData {
        match h {
            HostBuffer::F32(v) => CpuData::F32(v.into()),
            HostBuffer::F64(v) => CpuData::F64(v.into()),
            HostBuffer::I64(v) => CpuData::I64(v.into()),
            HostBuffer::U8(v) => CpuData::U8(v.into()),
            HostBuffer::F16(v) => CpuData::F16(v.into()),
            HostBuffer::BF16(v) => CpuData::BF16(v.into()),
        }
    }

    /// Whether the elements lie in page-locked memory.
    pub fn is_pinned(&self) -> bool {
        each_data!(self, v => v.is_pinned())
    }

    /// The elements as bytes (native endianness).
    pub fn as_bytes(&self) -> &[u8] {
        each_data!(self, v => bytemuck::cast_slice(v))
    }

    /// A copy for an in-place write, in the same kind of memory (pinned stays pinned); a typed
    /// error, not an abort, when there is no memory for it (`alloc`).
    fn copy_for_write(&self, device: CpuDevice) -> Result<CpuData> {
        const OP: &str = "copy_into";
        fn copy_vec<T: CpuElem>(v: &HostVec<T>, device: CpuDevice) -> Result<HostVec<T>> {
            if v.is_pinned() {
                return HostVec::pinned(OP, v);
            }
            let mut out = alloc::<T>(OP, device, v.len())?;
            out.copy_from_slice(v);
            Ok(HostVec::Heap(out))
        }
        Ok(match self {
            CpuData::F32(v) => CpuData::F32(copy_vec(v, device)?),
            CpuData::F64(v) => CpuData::F64(copy_vec(v, device)?),
            CpuData::I64(v) => CpuData::I64(copy_vec(v, device)?),
            CpuData::U8(v) => CpuData::U8(copy_vec(v, device)?),
            CpuData::F16(v) => CpuData::F16(copy_vec(v, device)?),
            CpuData::BF16(v) => CpuData::BF16(copy_vec(v, device)?),
        })
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        each_data!(self, v => bytemuck::cast_slice_mut(v))
    }
}

/// A computed buffer: the elements, counted against their device's memory while any holder
/// (a storage, a pending node that reads it, a helper thread) keeps it; the last one's drop
/// returns a large buffer to the cache.
pub(crate) struct Block {
    data: CpuData,
    device: CpuDevice,
}

impl Block {
    fn new(device: CpuDevice, data: CpuData) -> Block {
        counters(&device).add(data.size_in_bytes());
        Block { data, device }
    }
}

impl std::ops::Deref for Block {
    type Target = CpuData;
    fn deref(&self) -> &CpuData {
        &self.data
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let data = std::mem::replace(
            &mut self.data,
            CpuData::U8(HostVec::Heap(AlignedVec::empty())),
        );
        let bytes = data.size_in_bytes();
        counters(&self.device).sub(bytes);
        release(self.device, data, bytes);
    }
}

/// The CPU's side of the deferral graph (`kiln_core::expr::defer`): nodes hold blocks and
/// remember their device. Recording and forcing are `lazy.rs`'s.
pub(crate) struct CpuDeferral;

impl Deferral for CpuDeferral {
    type Buf = Arc<Block>;
    type Ctx = CpuDevice;
    fn same_buf(a: &Arc<Block>, b: &Arc<Block>) -> bool {
        Arc::ptr_eq(a, b)
    }
}

/// A deferred elementwise op of the CPU backend.
pub(crate) type Node = defer::Node<CpuDeferral>;

/// The error of a read of deferred work that was not computed (a kiln bug if it reaches a
/// user: the backend's ops compute their inputs first).
fn unforced() -> Error {
    Error::invalid(
        "read",
        "the storage holds deferred elementwise work that was not computed \
         (Tensor::realize computes it)",
    )
}

/// A storage's contents: computed, or deferred work.
enum Repr {
    Ready(Arc<Block>),
    Pending(Arc<Node>),
}

/// One buffer on one virtual CPU device, or the deferred elementwise work that computes it
/// (see `lazy.rs`: large elementwise chains are fused). The backend's ops compute a pending
/// storage before they read it; [`CpuStorage::data`] of one still pending is an error.
pub struct CpuStorage {
    repr: Repr,
    device: CpuDevice,
}

impl std::fmt::Debug for CpuStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.repr {
            Repr::Ready(b) => f
                .debug_struct("CpuStorage")
                .field("device", &self.device)
                .field("data", &b.data)
                .finish(),
            Repr::Pending(n) => f
                .debug_struct("CpuStorage")
                .field("device", &self.device)
                .field("pending", &(n.dtype(), n.shape()))
                .finish(),
        }
    }
}

impl CpuStorage {
    /// Wraps `data` as a storage on `device` (counted in the device's memory stats).
    pub fn new(device: CpuDevice, data: CpuData) -> Self {
        CpuStorage {
            repr: Repr::Ready(Arc::new(Block::new(device, data))),
            device,
        }
    }

    /// A storage whose contents are `block`.
    pub(crate) fn from_block(block: Arc<Block>) -> Self {
        CpuStorage {
            device: block.device,
            repr: Repr::Ready(block),
        }
    }

    /// A storage computed by deferred `node`.
    pub(crate) fn pending(node: Arc<Node>) -> Self {
        CpuStorage {
            device: node.ctx(),
            repr: Repr::Pending(node),
        }
    }

    /// The deferred work behind this storage, if it is (or was) deferred.
    pub(crate) fn node(&self) -> Option<&Arc<Node>> {
        match &self.repr {
            Repr::Ready(_) => None,
            Repr::Pending(n) => Some(n),
        }
    }

    /// The computed block, if computed.
    pub(crate) fn block(&self) -> Option<&Arc<Block>> {
        match &self.repr {
            Repr::Ready(b) => Some(b),
            Repr::Pending(n) => n.done(),
        }
    }

    /// The elements. An error when the storage is deferred work not computed yet
    /// (`Tensor::realize` computes it).
    pub fn data(&self) -> Result<&CpuData> {
        self.block().map(|b| &b.data).ok_or_else(unforced)
    }

    /// A shared reference to the computed block that may outlive this borrow (for a helper
    /// thread).
    pub(crate) fn shared(&self) -> Result<Arc<Block>> {
        self.block().cloned().ok_or_else(unforced)
    }

    /// Mutable access for in-place writes (`copy_into`). The length must not change. A block
    /// that someone else still holds (a pending node reading the old contents) is copied first.
    pub(crate) fn data_mut(&mut self) -> Result<&mut CpuData> {
        if let Repr::Pending(n) = &self.repr {
            // Replacing the node drops it (when this storage was its only holder), and with it
            // the node's reference to the block, which is then ours alone.
            let block = n.done().cloned().ok_or_else(unforced)?;
            self.repr = Repr::Ready(block);
        }
        let Repr::Ready(b) = &mut self.repr else {
            unreachable!("made ready above")
        };
        if Arc::get_mut(b).is_none() {
            // Someone else (a pending node) still reads these contents: write into a copy,
            // page-locked if they are.
            *b = Arc::new(Block::new(self.device, b.data.copy_for_write(self.device)?));
        }
        Ok(&mut Arc::get_mut(b).expect("unique: copied above").data)
    }

    /// The elements as writable bytes (for `Tensor::copy_from`).
    pub(crate) fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        Ok(self.data_mut()?.as_bytes_mut())
    }

    pub fn device(&self) -> CpuDevice {
        self.device
    }

    pub fn dtype(&self) -> DType {
        match &self.repr {
            Repr::Ready(b) => b.data.dtype(),
            Repr::Pending(n) => n.dtype(),
        }
    }

    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Ready(b) => b.data.len(),
            Repr::Pending(n) => n.shape().elem_count(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this holds deferred work not computed yet.
    pub fn is_pending(&self) -> bool {
        self.block().is_none()
    }
}

// ---- accounting ------------------------------------------------------------------------------

struct Counters {
    in_use: AtomicUsize,
    peak: AtomicUsize,
    cached: AtomicUsize,
}

impl Counters {
    fn add(&self, bytes: usize) {
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::Relaxed);
    }
}

static COUNTERS: [Counters; MAX_CPU_DEVICES] = [const {
    Counters {
        in_use: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        cached: AtomicUsize::new(0),
    }
}; MAX_CPU_DEVICES];

fn counters(device: &CpuDevice) -> &'static Counters {
    &COUNTERS[device.ordinal()]
}

pub(crate) fn memory_stats(device: &CpuDevice) -> MemoryStats {
    let c = counters(device);
    let in_use = c.in_use.load(Ordering::Relaxed);
    MemoryStats {
        in_use,
        peak: c.peak.load(Ordering::Relaxed),
        reserved: in_use + c.cached.load(Ordering::Relaxed),
    }
}

// ---- the buffer cache ------------------------------------------------------------------------

type Key = (usize, DType, usize);

/// Keyed with kiln's fast hasher: a cached buffer is looked up on every allocation from
/// [`CACHE_MIN_BYTES`] up; with std's SipHash a logistic-regression step ran 2.1% more
/// instructions (callgrind, 300 steps: 172.6M against 169.0M).
static CACHE: Mutex<Option<FastMap<Key, Vec<CpuData>>>> = Mutex::new(None);

/// Returns `data` (`bytes` long) to the cache, when it is worth keeping and there is room.
fn release(device: CpuDevice, data: CpuData, bytes: usize) {
    if bytes < CACHE_MIN_BYTES || data.is_pinned() {
        return;
    }
    let c = counters(&device);
    if c.cached.load(Ordering::Relaxed) + bytes > CACHE_MAX_BYTES {
        return;
    }
    let Ok(mut guard) = CACHE.lock() else { return };
    c.cached.fetch_add(bytes, Ordering::Relaxed);
    guard
        .get_or_insert_with(FastMap::default)
        .entry((device.ordinal(), data.dtype(), data.len()))
        .or_default()
        .push(data);
}

fn take(device: CpuDevice, dtype: DType, len: usize) -> Option<CpuData> {
    if len.saturating_mul(dtype.size_in_bytes()) < CACHE_MIN_BYTES {
        return None;
    }
    let mut guard = CACHE.lock().ok()?;
    let data = guard
        .as_mut()?
        .get_mut(&(device.ordinal(), dtype, len))?
        .pop()?;
    counters(&device)
        .cached
        .fetch_sub(data.size_in_bytes(), Ordering::Relaxed);
    Some(data)
}

/// Frees every cached buffer of `device`.
pub(crate) fn empty_cache(device: &CpuDevice) {
    let Ok(mut guard) = CACHE.lock() else { return };
    if let Some(map) = guard.as_mut() {
        map.retain(|k, _| k.0 != device.ordinal());
    }
    counters(device).cached.store(0, Ordering::Relaxed);
}

/// Frees the cached buffers of every virtual device (they all share the one host memory).
fn empty_all_caches() {
    let freed = CACHE.lock().ok().and_then(|mut g| g.take());
    for c in &COUNTERS {
        c.cached.store(0, Ordering::Relaxed);
    }
    drop(freed);
}

/// A Rust element type that a storage can hold.
pub trait CpuElem:
    Copy + Default + Send + Sync + PartialOrd + std::fmt::Debug + bytemuck::Pod + 'static
{
    const DTYPE: DType;
    fn wrap(v: AlignedVec<Self>) -> CpuData;
    fn unwrap(d: CpuData) -> Option<AlignedVec<Self>>;
    fn slice(d: &CpuData) -> Option<&[Self]>;
    fn slice_mut(d: &mut CpuData) -> Option<&mut [Self]>;
    /// `v as Self` (rounded to nearest even for the 16-bit floats).
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// NaN test (always false for integers).
    fn is_nan(self) -> bool;
}

macro_rules! cpu_elem {
    ($t:ty, $v:ident, $nan:expr) => {
        impl CpuElem for $t {
            const DTYPE: DType = DType::$v;
            fn wrap(v: AlignedVec<Self>) -> CpuData {
                CpuData::$v(HostVec::Heap(v))
            }
            fn unwrap(d: CpuData) -> Option<AlignedVec<Self>> {
                match d {
                    CpuData::$v(HostVec::Heap(v)) => Some(v),
                    _ => None,
                }
            }
            fn slice(d: &CpuData) -> Option<&[Self]> {
                match d {
                    CpuData::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(d: &mut CpuData) -> Option<&mut [Self]> {
                match d {
                    CpuData::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn from_f64(v: f64) -> Self {
                kiln_core::Element::from_f64(v)
            }
            fn to_f64(self) -> f64 {
                kiln_core::Element::to_f64(self)
            }
            #[allow(clippy::redundant_closure_call)]
            fn is_nan(self) -> bool {
                ($nan)(self)
            }
        }
    };
}
cpu_elem!(f32, F32, |x: f32| x.is_nan());
cpu_elem!(f64, F64, |x: f64| x.is_nan());
cpu_elem!(i64, I64, |_| false);
cpu_elem!(u8, U8, |_| false);
cpu_elem!(f16, F16, |x: f16| x.is_nan());
cpu_elem!(bf16, BF16, |x: bf16| x.is_nan());

/// A buffer of `len` elements for `op`'s output. Its contents are unspecified (a reused
/// buffer keeps old values): the caller writes every element. Fails with a typed error, never
/// an abort (see the module docs).
pub(crate) fn alloc<T: CpuElem>(
    op: &'static str,
    device: CpuDevice,
    len: usize,
) -> Result<AlignedVec<T>> {
    if kiln_core::profile::enabled() {
        profile_alloc(op, device, len * std::mem::size_of::<T>());
    }
    if let Some(v) = take(device, T::DTYPE, len).and_then(T::unwrap) {
        return Ok(v);
    }
    new_vec(op, device, len)
}

/// Reports an output buffer of `bytes` for `op` to the profiler, with the memory in use
/// counting it.
#[cold]
pub(crate) fn profile_alloc(op: &'static str, device: CpuDevice, bytes: usize) {
    let label = kiln_core::profile::device_label(&device);
    let in_use = counters(&device).in_use.load(Ordering::Relaxed) + bytes;
    kiln_core::profile::record_alloc(op, label, 0, bytes as u64, in_use as u64);
}

/// `len` zeroed elements in fresh memory (never from the cache), starting on a cache line
/// ([`AlignedVec`]), or a typed error as [`zeroed_vec`] gives.
pub(crate) fn new_vec<T: CpuElem>(
    op: &'static str,
    device: CpuDevice,
    len: usize,
) -> Result<AlignedVec<T>> {
    let bytes = byte_size::<T>(op, len)?;
    let padded = zeroed(op, device, AlignedVec::<T>::padded_len(len), bytes)?;
    Ok(AlignedVec::in_padded(padded, len))
}

/// `len` zeroed elements in a plain fresh `Vec` (for the caller's own use: `to_host`), or a
/// typed error: an impossible size is [`Error::InvalidArgument`], a refused one
/// [`Error::OutOfMemory`] (after emptying the cache and trying once more).
pub(crate) fn zeroed_vec<T: CpuElem>(
    op: &'static str,
    device: CpuDevice,
    len: usize,
) -> Result<Vec<T>> {
    zeroed(op, device, len, byte_size::<T>(op, len)?)
}

/// `len` zeroed elements, or [`Error::OutOfMemory`] naming `requested` bytes (what the caller
/// asked for, without the padding of an [`AlignedVec`]).
fn zeroed<T: CpuElem>(
    op: &'static str,
    device: CpuDevice,
    len: usize,
    requested: usize,
) -> Result<Vec<T>> {
    if let Ok(v) = bytemuck::allocation::try_zeroed_vec(len) {
        return Ok(v);
    }
    // Cached buffers are free memory that kiln holds back: give them up and try again.
    empty_all_caches();
    bytemuck::allocation::try_zeroed_vec(len).map_err(|()| Error::OutOfMemory {
        device: device.to_string(),
        requested,
        held: counters(&device).in_use.load(Ordering::Relaxed),
        msg: format!(
            "{op}: the system allocator refused, even after kiln's buffer cache was freed"
        ),
    })
}

/// The bytes of `len` elements of `T`, or an [`Error::InvalidArgument`] naming `op` when no
/// allocation can be that large (more than `isize::MAX` bytes, Rust's limit for one object).
pub(crate) fn byte_size<T: CpuElem>(op: &'static str, len: usize) -> Result<usize> {
    match len.checked_mul(std::mem::size_of::<T>()) {
        Some(b) if b <= isize::MAX as usize => Ok(b),
        _ if len == usize::MAX => Err(Error::invalid(
            op,
            format!(
                "the element count overflows usize (a shape with more than {} elements)",
                usize::MAX
            ),
        )),
        _ => Err(Error::invalid(
            op,
            format!(
                "{len} elements of {} need {} bytes, more than one allocation can hold ({} bytes)",
                T::DTYPE,
                len as u128 * std::mem::size_of::<T>() as u128,
                isize::MAX
            ),
        )),
    }
}

/// Wraps a typed vector as a storage.
pub(crate) fn storage<T: CpuElem>(device: CpuDevice, v: AlignedVec<T>) -> CpuStorage {
    CpuStorage::new(device, T::wrap(v))
}
