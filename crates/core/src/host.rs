//! Host memory that backends hand each other: page-locked ("pinned") blocks, and borrowed host
//! bytes on their way to a device.
//!
//! Why this lives in core: pinned memory is a CPU tensor's storage (every CPU op reads it like any
//! other buffer) but only a GPU driver can page-lock it, and the backends do not know each other.
//! So a GPU backend registers a [`PinnedAllocator`] here once (kiln-backend-cuda does when it
//! finds a GPU), the CPU backend allocates its pinned storages through it, and a transfer from a
//! pinned storage tells the GPU backend, through [`HostSource::pinned`], that it may copy by
//! direct, asynchronous DMA.
//!
//! The plain typed vectors that go into and come out of a device ([`HostBuffer`]) and the Rust
//! element types that map onto them ([`Element`]) live here too: both [`Backend`](crate::Backend)
//! and the element types name them, and neither may depend on the other.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::{DType, Error, Result};

/// A typed buffer in host memory: what goes into and comes out of a device.
#[derive(Clone, Debug, PartialEq)]
pub enum HostBuffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
}

impl HostBuffer {
    pub fn dtype(&self) -> DType {
        match self {
            HostBuffer::F32(_) => DType::F32,
            HostBuffer::F64(_) => DType::F64,
            HostBuffer::I64(_) => DType::I64,
            HostBuffer::U8(_) => DType::U8,
            HostBuffer::F16(_) => DType::F16,
            HostBuffer::BF16(_) => DType::BF16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostBuffer::F32(v) => v.len(),
            HostBuffer::F64(v) => v.len(),
            HostBuffer::I64(v) => v.len(),
            HostBuffer::U8(v) => v.len(),
            HostBuffer::F16(v) => v.len(),
            HostBuffer::BF16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f64 (exact for every dtype but i64 beyond 2^53).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            HostBuffer::F32(v) => v.iter().map(|&x| x as f64).collect(),
            HostBuffer::F64(v) => v.clone(),
            HostBuffer::I64(v) => v.iter().map(|&x| x as f64).collect(),
            HostBuffer::U8(v) => v.iter().map(|&x| x as f64).collect(),
            HostBuffer::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            HostBuffer::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }

    /// Converts f64 values into a buffer of `dtype` (`as` casts: saturating for ints; one
    /// rounding to nearest even for the 16-bit floats).
    pub fn from_f64(dtype: DType, v: &[f64]) -> HostBuffer {
        match dtype {
            DType::F32 => HostBuffer::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F64 => HostBuffer::F64(v.to_vec()),
            DType::I64 => HostBuffer::I64(v.iter().map(|&x| x as i64).collect()),
            DType::U8 => HostBuffer::U8(v.iter().map(|&x| x as u8).collect()),
            DType::F16 => HostBuffer::F16(
                v.iter()
                    .map(|&x| crate::halfround::f16_from_f64(x))
                    .collect(),
            ),
            DType::BF16 => HostBuffer::BF16(
                v.iter()
                    .map(|&x| crate::halfround::bf16_from_f64(x))
                    .collect(),
            ),
        }
    }

    /// A buffer of `dtype` holding a copy of `bytes` (native endianness; a length that is not
    /// a whole number of elements is an error).
    pub fn from_bytes(op: &'static str, dtype: DType, bytes: &[u8]) -> Result<HostBuffer> {
        fn v<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
            let mut out = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(b);
            out
        }
        if !bytes.len().is_multiple_of(dtype.size_in_bytes()) {
            return Err(Error::invalid(
                op,
                format!(
                    "{} bytes are not a whole number of {dtype} elements",
                    bytes.len()
                ),
            ));
        }
        Ok(match dtype {
            DType::F32 => HostBuffer::F32(v(bytes)),
            DType::F64 => HostBuffer::F64(v(bytes)),
            DType::I64 => HostBuffer::I64(v(bytes)),
            DType::U8 => HostBuffer::U8(bytes.to_vec()),
            DType::F16 => HostBuffer::F16(v(bytes)),
            DType::BF16 => HostBuffer::BF16(v(bytes)),
        })
    }

    /// The raw bytes (native endianness).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostBuffer::F32(v) => bytemuck::cast_slice(v),
            HostBuffer::F64(v) => bytemuck::cast_slice(v),
            HostBuffer::I64(v) => bytemuck::cast_slice(v),
            HostBuffer::U8(v) => v,
            HostBuffer::F16(v) => bytemuck::cast_slice(v),
            HostBuffer::BF16(v) => bytemuck::cast_slice(v),
        }
    }
}

/// A Rust element type that maps to a [`DType`].
pub trait Element:
    Copy + Send + Sync + std::fmt::Debug + std::fmt::Display + PartialOrd + bytemuck::Pod + 'static
{
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// Wraps a vector of this type into a [`HostBuffer`].
    fn into_host(v: Vec<Self>) -> HostBuffer;
    /// Borrows the vector out of a [`HostBuffer`] of this type.
    fn from_host(b: HostBuffer) -> Option<Vec<Self>>;
}

macro_rules! element {
    ($t:ty, $d:ident) => {
        element!($t, $d, |x: $t| x as f64, |v: f64| v as $t);
    };
    ($t:ty, $d:ident, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[allow(clippy::redundant_closure_call)]
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            #[allow(clippy::redundant_closure_call)]
            fn from_f64(v: f64) -> Self {
                ($from)(v)
            }
            fn into_host(v: Vec<Self>) -> HostBuffer {
                HostBuffer::$d(v)
            }
            fn from_host(b: HostBuffer) -> Option<Vec<Self>> {
                match b {
                    HostBuffer::$d(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(i64, I64);
element!(u8, U8);
element!(
    half::f16,
    F16,
    half::f16::to_f64,
    crate::halfround::f16_from_f64
);
element!(
    half::bf16,
    BF16,
    half::bf16::to_f64,
    crate::halfround::bf16_from_f64
);

/// Allocates and frees page-locked host memory (a GPU backend's pinned pool).
pub trait PinnedAllocator: Send + Sync + 'static {
    /// A short name for messages (`cuda`).
    fn name(&self) -> &'static str;
    /// `bytes` of page-locked memory, aligned to at least 256 bytes, holding initialized bytes
    /// of any value (zeros, or what an earlier user of a pooled block left); a typed error
    /// (never an abort) when the system cannot lock that much.
    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>>;
    /// Gives a block back.
    ///
    /// # Safety
    /// `ptr` came from [`PinnedAllocator::allocate`] of this allocator with the same `bytes`, and
    /// nothing uses it any more.
    unsafe fn release(&self, ptr: NonNull<u8>, bytes: usize);
}

static PINNED: OnceLock<&'static dyn PinnedAllocator> = OnceLock::new();

/// Installs the process's pinned allocator; the first registration wins (returns whether this
/// one did).
pub fn register_pinned_allocator(a: &'static dyn PinnedAllocator) -> bool {
    PINNED.set(a).is_ok()
}

/// The registered pinned allocator, if a GPU backend has found a GPU.
pub fn pinned_allocator() -> Option<&'static dyn PinnedAllocator> {
    PINNED.get().copied()
}

fn no_allocator(op: &'static str) -> Error {
    Error::invalid(
        op,
        "page-locked memory needs a GPU backend with a GPU (none has registered a pinned \
         allocator: no CUDA device found yet)",
    )
}

/// One block of page-locked host memory, given back to its allocator on drop.
pub struct PinnedBlock {
    ptr: NonNull<u8>,
    bytes: usize,
    alloc: &'static dyn PinnedAllocator,
}

// SAFETY: the block is plain host memory owned by this value alone; the allocator is Sync.
unsafe impl Send for PinnedBlock {}
// SAFETY: shared access only reads (`as_bytes`); writes need `&mut self`.
unsafe impl Sync for PinnedBlock {}

impl std::fmt::Debug for PinnedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedBlock({} bytes, {})",
            self.bytes,
            self.alloc.name()
        )
    }
}

impl PinnedBlock {
    /// `bytes` of pinned memory from the registered allocator, zero-filled. `op` names the
    /// caller in errors.
    pub fn new(op: &'static str, bytes: usize) -> Result<PinnedBlock> {
        let alloc = pinned_allocator().ok_or_else(|| no_allocator(op))?;
        let ptr = if bytes == 0 {
            NonNull::<u64>::dangling().cast()
        } else {
            alloc.allocate(bytes)?
        };
        let mut b = PinnedBlock { ptr, bytes, alloc };
        b.as_bytes_mut().fill(0);
        Ok(b)
    }
    /// `bytes` of pinned memory whose contents are unspecified (zeros, or an earlier user's
    /// bytes): for a caller that overwrites all of it, without a zero-fill pass first.
    pub fn uninit(op: &'static str, bytes: usize) -> Result<PinnedBlock> {
        let alloc = pinned_allocator().ok_or_else(|| no_allocator(op))?;
        let ptr = if bytes == 0 {
            NonNull::<u64>::dangling().cast()
        } else {
            alloc.allocate(bytes)?
        };
        Ok(PinnedBlock { ptr, bytes, alloc })
    }

    /// Pinned memory holding a copy of `data` (one pass: no zero-fill first).
    pub fn from_bytes(op: &'static str, data: &[u8]) -> Result<PinnedBlock> {
        let alloc = pinned_allocator().ok_or_else(|| no_allocator(op))?;
        let bytes = data.len();
        let ptr = if bytes == 0 {
            NonNull::<u64>::dangling().cast()
        } else {
            alloc.allocate(bytes)?
        };
        // SAFETY: `ptr` holds `bytes` writable bytes that nothing else uses; `data` is a
        // different allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.as_ptr(), bytes) };
        Ok(PinnedBlock { ptr, bytes, alloc })
    }
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points at `bytes` initialized bytes (zero-filled at creation) that this
        // block owns.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // SAFETY: the block came from this allocator with this size and is dropped once.
            unsafe { self.alloc.release(self.ptr, self.bytes) };
        }
    }
}

/// Host bytes on their way to a device (see [`crate::Backend::from_host_source`]).
pub struct HostSource<'a> {
    /// The elements, contiguous, in the dtype's native layout.
    pub bytes: &'a [u8],
    /// Whether `bytes` lie in page-locked memory: a GPU backend may then copy them by direct
    /// DMA and return before the copy ends.
    pub pinned: bool,
    /// Keeps `bytes` alive until an asynchronous copy has finished (the source tensor's
    /// storage); `None` for borrowed memory, which must then be copied before returning.
    pub owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl<'a> HostSource<'a> {
    /// Ordinary (pageable) memory the caller lends only for the call.
    pub fn borrowed(bytes: &'a [u8]) -> Self {
        HostSource {
            bytes,
            pinned: false,
            owner: None,
        }
    }
}

/// A host array of rows in page-locked memory that a device may read directly (see
/// [`crate::Backend::gather_host_rows`]): the DataLoader's dataset when pinned.
#[derive(Clone)]
pub struct HostRows {
    /// The rows, back to back.
    pub block: Arc<PinnedBlock>,
    /// The dtype of the gathered storage.
    pub dtype: DType,
    /// Bytes of one row in `block` (a whole number of elements as stored).
    pub row_bytes: usize,
    /// `Some(d)`: `block` holds one byte per element and `dtype` is `F32`; the device writes
    /// `byte as f32 / d` (MNIST's pixels, `byte / 255`, kept as bytes: a quarter of the bytes
    /// cross the bus, and the result equals the host's `byte as f32 / d` exactly).
    pub bytes_over: Option<f32>,
    /// For integer arrays of non-negative ids (labels): one past the largest, so that an op
    /// indexing with gathered rows needs no device-side bounds read (`None`: unknown).
    pub id_bound: Option<usize>,
}

impl std::fmt::Debug for HostRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRows")
            .field("rows", &self.rows())
            .field("dtype", &self.dtype)
            .field("row_bytes", &self.row_bytes)
            .field("bytes_over", &self.bytes_over)
            .field("id_bound", &self.id_bound)
            .finish()
    }
}

impl HostRows {
    /// How many rows the block holds.
    pub fn rows(&self) -> usize {
        self.block.len().checked_div(self.row_bytes).unwrap_or(0)
    }

    /// Bytes of one stored element: 1 for bytes decoded on the device, else the dtype's size.
    pub fn stored_size(&self) -> usize {
        if self.bytes_over.is_some() {
            1
        } else {
            self.dtype.size_in_bytes()
        }
    }

    /// The dtype of the elements as `block` stores them: `U8` for bytes decoded on the device.
    pub fn stored_dtype(&self) -> DType {
        if self.bytes_over.is_some() {
            DType::U8
        } else {
            self.dtype
        }
    }

    /// Bytes of one gathered row (on the device).
    pub fn out_row_bytes(&self) -> usize {
        self.row_bytes / self.stored_size() * self.dtype.size_in_bytes()
    }
}

/// When `bytes` of `dtype` (native layout) are all non-negative ids, one past the largest:
/// what lets an index kernel over a freshly uploaded or gathered batch of labels skip the
/// synchronizing read of its bounds check. `None` for floats and for negative values.
pub fn id_bound(dtype: DType, bytes: &[u8]) -> Option<usize> {
    match dtype {
        DType::I64 => {
            let (lo, hi) = bytes
                .chunks_exact(8)
                .map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes")))
                .fold((0i64, -1i64), |(lo, hi), v| (lo.min(v), hi.max(v)));
            // One past `hi` in usize: 0 for no ids (hi = -1), 2^63 for an id of i64::MAX.
            (lo >= 0).then(|| (hi as usize).wrapping_add(1))
        }
        DType::U8 => Some(bytes.iter().copied().max().map_or(0, |m| m as usize + 1)),
        _ => None,
    }
}
