//! # kiln-backend-cuda
//!
//! The NVIDIA GPU backend of kiln: [`Cuda`] implements [`kiln_core::Backend`], so code written
//! against `B: Backend` runs unchanged on a GPU.
//!
//! - **No CUDA needed to build.** cudarc loads libcuda, libnvrtc and libcublas at run time
//!   (`dynamic-loading`); without a driver or a GPU, [`device_count`] is 0 and [`try_gpu`] is
//!   `None` — never a panic. The bound CUDA version is 13.0 by default; build with
//!   `--no-default-features --features cuda-12080` (or `cuda-12060`, `cuda-12040`) for a 12.x
//!   driver.
//! - **Per-GPU state, created lazily** (`device/`): context, a default (compute) stream, a
//!   copy stream, the cuBLAS handle, the kernel cache.
//! - **Streams and events for users** (`stream.rs`): [`Stream::scope`] makes a stream current
//!   for the calling thread; every launch, allocation, cuBLAS call and copy goes to the current
//!   stream; [`Event`] records, waits, queries and times. Also there: `Backend::concurrently`,
//!   which runs a linear layer's two large f32 gradient products at once, the second on the
//!   device's side stream ([`set_concurrency`]).
//! - **Transfers** (`transfer.rs`, `pinned.rs`): uploads run on the copy stream (direct,
//!   asynchronous DMA from pinned memory; a threaded pinned staging ring from ordinary memory),
//!   downloads go straight into the caller's buffer; a pooled pinned host allocator backs
//!   `Tensor::<Cpu>::pin_memory`.
//! - **Our own kernels**: generated ones (`codegen/`) for every elementwise op (each a
//!   one-instruction program of kiln's IR), fused chains and the optimizers' multi-tensor
//!   updates (the rules' own programs), and hand-written ones (`kernels/*.cu`: reductions,
//!   softmax, indexing, copies, random numbers, fused layer / RMS norm); compiled by NVRTC for
//!   the device's architecture on first use, memoized per device (`device/`) and cached on disk
//!   (`nvrtc.rs`; `KILN_KERNEL_CACHE`).
//! - **Memory** (`memory.rs`): the driver's stream-ordered pool with its release threshold
//!   raised, a block cache per stream that never reuses a block before every stream that used
//!   it has passed, statistics, `empty_cache`, out-of-memory → trim, synchronize, retry once,
//!   then [`kiln_core::Error::OutOfMemory`].
//! - **User kernels** (`user_kernel/`): CuPy's [`ElementwiseKernel`], [`ReductionKernel`]
//!   and [`RawKernel`] — a few lines of CUDA C with type placeholders, compiled once per
//!   device and dtype signature.
//! - **CUDA graphs** (`graph.rs`): [`CudaGraph::capture`] records a block of kiln work (a
//!   training step) once; [`CudaGraph::replay`] runs it with one launch, on memory private to
//!   the graph.
//! - **Matmul** through cuBLAS with TF32 off unless asked for (`blas.rs`), or through the
//!   cuBLASLt algorithm a shape was timed fastest with at its first call (`gemm_tune.rs`).
//! - **Convolutions** through cuDNN where it can be loaded (`cudnn/`): forward and both
//!   gradients for kiln-nn's `conv2d`, algorithms measured once per shape and cached per
//!   device, workspaces from the memory pool. Without cuDNN (or with `KILN_CUDNN=0`,
//!   [`set_cudnn`]) the backend says so once and convolutions take kiln-nn's im2col path.
//! - **f16 and bf16** are storage types: every kernel loads and stores them in 16 bits and
//!   computes in f32 (generated programs run their `Program::widened` form, the hand-written
//!   kernels have f32-accumulating 16-bit instances compiled only when a 16-bit tensor uses
//!   them, matmul is cuBLAS's GemmEx with `CUBLAS_COMPUTE_32F`), so results are the CPU
//!   backend's within an ulp or two of the 16-bit type.
//! - **Fused elementwise chains** (`lazy.rs`, `storage.rs`): elementwise ops on the floats are
//!   recorded instead of launched; the first op that needs the values runs the pending chain as
//!   one generated kernel. A [`CudaStorage`] is a computed buffer or such pending work.
//!   `KILN_CUDA_FUSE=0` / [`set_fusion`] turns it off.
//! - **No waiting for NVRTC on a first run** (`tier.rs`): a generated elementwise program that
//!   is not compiled yet runs in an interpreter kernel (prebuilt like the fixed files) while
//!   it compiles on a background thread, with the same bits; `KILN_CUDA_TIER=0` /
//!   [`set_tiering`] compiles on the spot instead.
//!
//! Errors found inside kernels (an index or label out of range) set a device-side error flag
//! instead of touching memory out of bounds; the op that launched the kernel reads the flag
//! back (a synchronization) and returns a typed error (`Error::IndexOutOfRange`), and the device stays usable. Set
//! `KILN_CUDA_SYNC=1` to synchronize and check after every launch, so that an asynchronous
//! failure is reported by the op that caused it (this also runs every elementwise op on its own
//! instead of fusing chains).
//!
//! # Layers
//!
//! Modules import downward only (no circle among the `crate::` imports of the files), so the
//! code generators can be read, tested and compiled with NVRTC on a machine with no GPU, and
//! the runtime knows nothing of what runs on it:
//!
//! 1. **Names and pure helpers** — `types.rs` (the [`Cuda`] marker and [`CudaDevice`], which
//!    every module names), `sources.rs` (the `kernels/` files and headers, C type names),
//!    `launch.rs` (kernel argument packing, dimension merging), `pool.rs` (the block cache's
//!    and graph pools' bookkeeping types).
//! 2. **Code generator, pure** — `codegen/` (expression IR → CUDA C; the deferral layer's
//!    recorded chains are expression programs too).
//! 3. **Runtime** — `nvrtc.rs` (NVRTC + disk cache), `profile.rs` (the device's records for
//!    kiln-core's profiler, through a trait the device state implements), `device/` (the
//!    per-GPU state as owned parts: context and identity, streams and events, the kernel
//!    cache — type-erased so that it names no generator —, the allocator's state, transfers'
//!    state, the error flag), `memory.rs`, `pinned.rs`, `stream.rs`, `transfer.rs`.
//! 4. **Kernels and ops** — `ops/` (elementwise and data movement; reductions, rows, indexing
//!    in submodules), `blas.rs`, `cudnn/` (convolutions; after `blas.rs`, whose TF32 switch it
//!    follows), `fused.rs` (multi-tensor optimizer updates), `tier.rs` (the interpreter that
//!    runs a program while its kernel compiles in the background),
//!    `expr_run.rs` (expression programs over computed buffers: plan, kernel memo, launch),
//!    `expr_lone.rs` (a lone op's program: the plans it used last, found by comparison),
//!    `host_gather.rs` (batches gathered from host rows on the copy stream),
//!    `attention_cudnn.rs` (16-bit attention on cuDNN's engines in `ops/attention.rs`'s
//!    layouts; after both, which do not import each other).
//! 5. **Deferral** — `lazy.rs` (records and forces chains; owns the storage representation),
//!    then `storage.rs` (the public [`CudaStorage`] handle over it).
//! 6. **Users of storage** — `expr_eval.rs` (`Backend::eval_expr`); `update.rs` (the
//!    optimizers' multi-tensor update over storage handles); `raw.rs` (allocations, a spin
//!    kernel and event timing for benchmarks and tests); `graph.rs` (CUDA graph
//!    capture and replay); `nccl.rs` (collectives over tensors); `user_kernel/` (CuPy-style
//!    [`ElementwiseKernel`], [`ReductionKernel`], [`RawKernel`]: parameter lists and source
//!    generation in `params.rs`/`source.rs`, pure; launching in the others); `compile.rs` (the
//!    public compile tooling and `check_all`, which needs every generator's samples).
//! 7. `lib.rs`: the `Backend` implementation, which calls down, and the public re-exports.

// In rustfmt's order; the layers, bottom to top, are in "Layers" above: each module imports
// only modules listed before it there.
mod amp;
mod attention_cudnn;
mod blas;
mod blas_lt;
mod codegen;
pub mod compile;
mod cudnn;
mod device;
mod expr_eval;
mod expr_lone;
mod expr_run;
mod fixed_cubins;
mod fused;
mod gemm_tune;
mod graph;
mod host_gather;
mod kernel_files;
mod launch;
mod lazy;
mod memory;
pub mod nccl;
mod nvrtc;
mod ops;
mod pinned;
mod pool;
mod prebuilt;
mod profile;
pub mod raw;
mod sources;
mod storage;
mod stream;
mod tier;
mod transfer;
mod types;
mod update;
mod user_kernel;

use kiln_core::backend::Operand;
use kiln_core::epilogue::{EpilogueGrads, EpilogueOutputs};
use kiln_core::{
    Activation, AttentionGrads, AttentionOutputs, AttentionSpec, AttnMaskOperand, Backend,
    BinaryOp, CmpOp, Conv2dSpec, DType, Error, HostBuffer, HostSource, Layout, MemoryStats,
    NormGrads, NormOutputs, NormSpec, RandDist, ReduceOp, Result, UnaryOp, UnscaleSlot, UpdateRule,
    UpdateSlot,
};

pub use blas::{allow_tf32, set_allow_tf32};
pub use blas_lt::{lt_epilogues, set_lt_epilogues};
pub use cudnn::{
    CudnnApi, CudnnLayout, cudnn_api, cudnn_attention, cudnn_attention_calls, cudnn_available,
    cudnn_enabled, cudnn_fused_calls, cudnn_fusion, cudnn_graph_calls, cudnn_layout,
    cudnn_nhwc_calls, cudnn_version, set_cudnn, set_cudnn_api, set_cudnn_attention,
    set_cudnn_fusion, set_cudnn_layout,
};
pub use device::{
    clear_kernel_cache, launch_stats, thread_launches, thread_syncs, unavailable_reason,
};
pub use gemm_tune::{GemmTuning, gemm_tuning, set_gemm_tuning, tuned_gemm_calls};
pub use graph::{CudaGraph, write_static};
pub use lazy::{fused_program_stats, fusion_enabled, set_fusion, set_fusion_program_budget};
pub use memory::{reset_peak, set_block_cache};
pub use nccl::{Collective, NcclComm, NcclId, ReduceOp as NcclReduceOp, nccl_version};
pub use ops::attention::{
    fused_attention_16bit, set_attention_tensor_cores, set_attention_tensor_cores_f32,
    set_fused_attention_16bit,
};
pub use ops::reduce::{ReducePath, reduce_path, set_reduce_path};
pub use pinned::{PinnedStats, empty_pinned_cache, pinned_memory_stats};
pub use storage::CudaStorage;
pub use stream::{
    Event, Stream, StreamGuard, concurrency, set_concurrency, side_stream_runs, synchronize,
};
pub use tier::{Tiering, set_tiering, tier_stats, tiering};
pub use transfer::copy_threads;
pub use types::{Cuda, CudaDevice};
pub use user_kernel::{Dim3, ElementwiseKernel, KernelArg, RawKernel, ReductionKernel, empty};

use device::state;

// Device discovery. Finding a GPU also registers the pinned host pool with kiln-core, so CPU
// tensors can be pinned from then on (see `pinned.rs`).

/// Number of usable GPUs (0 without a driver or a GPU; never panics).
pub fn device_count() -> usize {
    let n = device::device_count();
    if n > 0 {
        pinned::register();
    }
    n
}

/// GPU `i` if it exists (d2l's `try_gpu`); `None` otherwise. The caller picks the CPU then.
pub fn try_gpu(i: usize) -> Option<CudaDevice> {
    (i < device_count()).then(|| CudaDevice::new(i))
}

/// Every GPU (empty when there is none).
pub fn try_all_gpus() -> Vec<CudaDevice> {
    (0..device_count()).map(CudaDevice::new).collect()
}

/// [`try_gpu`] for GPU tests: when GPU `i` is missing, prints `skipped: no CUDA device i
/// (<reason>)` straight to stderr (which libtest does not capture), so that a skipped test shows
/// in a plain `cargo test` run instead of passing silently, and returns `None`.
pub fn gpu_or_skip(i: usize) -> Option<CudaDevice> {
    device_count();
    device::gpu_or_skip(i)
}

impl Cuda {
    /// The number of usable GPUs (0 without a driver).
    pub fn device_count() -> usize {
        device_count()
    }
}

/// A zeroed host buffer of `n` elements of `dtype` (fresh pages, faulted in by whoever writes
/// them first).
fn host_zeros(dtype: DType, n: usize) -> HostBuffer {
    match dtype {
        DType::F32 => HostBuffer::F32(vec![0.0; n]),
        DType::F64 => HostBuffer::F64(vec![0.0; n]),
        DType::I64 => HostBuffer::I64(vec![0; n]),
        DType::F16 => HostBuffer::F16(vec![kiln_core::f16::ZERO; n]),
        DType::BF16 => HostBuffer::BF16(vec![kiln_core::bf16::ZERO; n]),
        _ => HostBuffer::U8(vec![0; n]),
    }
}

fn host_bytes_of(h: &mut HostBuffer) -> &mut [u8] {
    match h {
        HostBuffer::F32(v) => bytemuck::cast_slice_mut(v),
        HostBuffer::F64(v) => bytemuck::cast_slice_mut(v),
        HostBuffer::I64(v) => bytemuck::cast_slice_mut(v),
        HostBuffer::U8(v) => v,
        HostBuffer::F16(v) => bytemuck::cast_slice_mut(v),
        HostBuffer::BF16(v) => bytemuck::cast_slice_mut(v),
    }
}

/// Records (or runs) elementwise `op` over `inputs` through the deferral layer.
fn record(
    op: lazy::Op,
    inputs: &[(&CudaStorage, &Layout, DType)],
    out: DType,
) -> Result<CudaStorage> {
    let mut reprs: [(&lazy::Repr, &Layout, DType); 3] = [(inputs[0].0.repr(), inputs[0].1, out); 3];
    for (r, (s, l, d)) in reprs.iter_mut().zip(inputs) {
        *r = (s.repr(), l, *d);
    }
    lazy::record(op, &reprs[..inputs.len()], out).map(CudaStorage::from)
}

/// A layout's dims as NCHW, or an error (the convolution hooks get rank-4 operands).
fn dims4(l: &Layout) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(l.dims())
        .map_err(|_| Error::invalid("conv2d", format!("expects rank 4, got {:?}", l.dims())))
}

/// A fused attention call's tensor mask: its buffer (realized), and its layout and kind
/// (additive or not).
type MaskParts<'a> = (
    Option<std::sync::Arc<memory::Buffer>>,
    Option<(&'a Layout, bool)>,
);

/// A fused attention call's tensor mask as [`MaskParts`].
fn mask_parts<'a>(m: Option<AttnMaskOperand<'a, CudaStorage>>) -> Result<MaskParts<'a>> {
    Ok(match m {
        None => (None, None),
        Some(AttnMaskOperand::Keep((s, l))) => (Some(s.buffer()?), Some((l, false))),
        Some(AttnMaskOperand::Additive((s, l))) => (Some(s.buffer()?), Some((l, true))),
    })
}

/// The mask of [`mask_parts`] as `attention_cudnn` takes it.
fn mask_operand<'a>(
    buf: &'a Option<std::sync::Arc<memory::Buffer>>,
    m: Option<(&'a Layout, bool)>,
) -> Option<attention_cudnn::MaskOperand<'a>> {
    buf.as_deref()
        .zip(m)
        .map(|(buf, (layout, additive))| attention_cudnn::MaskOperand {
            buf,
            layout,
            additive,
        })
}

/// A tensor mask as kiln's attention kernels take it.
fn kernels_mask(m: attention_cudnn::MaskOperand<'_>) -> ops::attention::MaskOperand<'_> {
    ops::attention::MaskOperand {
        op: (m.buf, m.layout),
        additive: m.additive,
    }
}

/// An error unless both buffers live on one device.
fn same_device(op: &'static str, a: &memory::Buffer, b: &memory::Buffer) -> Result<()> {
    if a.state().ordinal() != b.state().ordinal() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device().to_string(),
            rhs: b.device().to_string(),
        });
    }
    Ok(())
}

impl Backend for Cuda {
    type Device = CudaDevice;
    type Storage = CudaStorage;
    const NAME: &'static str = "cuda";

    fn devices() -> Vec<CudaDevice> {
        try_all_gpus()
    }

    fn parse_device(name: &str) -> Result<CudaDevice> {
        let ordinal = kiln_core::DeviceSpec::parse_ordinal(name, kiln_core::DeviceKind::Cuda)?;
        try_gpu(ordinal).ok_or_else(|| {
            Error::invalid(
                "parse_device",
                format!(
                    "cuda:{ordinal} does not exist ({} CUDA device(s){})",
                    device_count(),
                    unavailable_reason()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ),
            )
        })
    }

    /// Waits for every stream of the device.
    fn synchronize(device: &CudaDevice) -> Result<()> {
        state(device)?.sync_all("synchronize")
    }

    fn is_capturing(device: &CudaDevice) -> bool {
        state(device).is_ok_and(|s| s.capturing())
    }

    fn concurrently<R1, R2>(
        device: &CudaDevice,
        work: (DType, u64),
        first: impl FnOnce() -> Result<R1>,
        second: impl FnOnce() -> Result<R2>,
    ) -> Result<(R1, R2)> {
        stream::concurrently(device, work, first, second)
    }

    fn memory_stats(device: &CudaDevice) -> Result<MemoryStats> {
        memory::memory_stats(state(device)?)
    }

    fn empty_cache(device: &CudaDevice) -> Result<()> {
        memory::empty_cache(state(device)?)
    }

    fn storage_device(storage: &CudaStorage) -> CudaDevice {
        storage.device()
    }

    fn fill(device: &CudaDevice, dtype: DType, len: usize, value: f64) -> Result<CudaStorage> {
        if dtype.is_half() {
            // Never deferred: a generated program would round the value through f32 (its
            // widened form's parameter) before 16 bits; the host rounds it once.
            return ops::fill(state(device)?, dtype, len, value).map(CudaStorage::ready);
        }
        lazy::fill(state(device)?, dtype, len, value).map(CudaStorage::from)
    }

    fn from_host(device: &CudaDevice, data: &HostBuffer) -> Result<CudaStorage> {
        Self::from_host_source(device, data.dtype(), HostSource::borrowed(data.as_bytes()))
    }

    fn from_host_source(
        device: &CudaDevice,
        dtype: DType,
        src: HostSource<'_>,
    ) -> Result<CudaStorage> {
        let bytes = src.bytes;
        let buf = transfer::upload(state(device)?, src)?;
        if let Some(bound) = transfer::host_id_bound(dtype, bytes) {
            buf.mark_all_ids_below(bound);
        }
        Ok(CudaStorage::ready(buf))
    }

    fn gather_host_rows(
        device: &CudaDevice,
        srcs: &[kiln_core::HostRows],
        rows: &[usize],
    ) -> Result<Option<Vec<CudaStorage>>> {
        let bufs = host_gather::gather_host_rows(state(device)?, srcs, rows)?;
        Ok(Some(bufs.into_iter().map(CudaStorage::ready).collect()))
    }

    fn copy_host_rows(
        device: &CudaDevice,
        srcs: &[kiln_core::HostRows],
        rows: std::ops::Range<usize>,
    ) -> Result<Option<Vec<CudaStorage>>> {
        let bufs = host_gather::copy_host_rows(state(device)?, srcs, rows)?;
        Ok(Some(bufs.into_iter().map(CudaStorage::ready).collect()))
    }

    fn gathers_host_rows(device: &CudaDevice) -> bool {
        state(device).is_ok()
    }

    fn from_host_sources(
        device: &CudaDevice,
        srcs: Vec<(DType, HostSource<'_>)>,
    ) -> Result<Vec<CudaStorage>> {
        let all_pinned = srcs
            .iter()
            .all(|(_, s)| s.pinned && s.owner.is_some() && !s.bytes.is_empty());
        if !all_pinned {
            return srcs
                .into_iter()
                .map(|(dtype, src)| Self::from_host_source(device, dtype, src))
                .collect();
        }
        let pairs: Vec<_> = srcs
            .iter()
            .map(|(_, s)| (s.bytes, s.owner.clone().expect("checked above")))
            .collect();
        let bufs = transfer::upload_pinned(state(device)?, &pairs)?;
        Ok(bufs
            .into_iter()
            .zip(&srcs)
            .map(|(buf, (dtype, src))| {
                if let Some(bound) = transfer::host_id_bound(*dtype, src.bytes) {
                    buf.mark_all_ids_below(bound);
                }
                CudaStorage::ready(buf)
            })
            .collect())
    }

    fn to_host_bytes(
        storage: &CudaStorage,
        layout: &Layout,
        dtype: DType,
        out: &mut [u8],
    ) -> Result<()> {
        let size = dtype.size_in_bytes();
        if out.len() != layout.elem_count() * size {
            return Err(Error::invalid(
                "to_host",
                format!(
                    "the buffer holds {} bytes, the tensor {}",
                    out.len(),
                    layout.elem_count() * size
                ),
            ));
        }
        let buf = storage.buffer()?;
        if layout.is_contiguous() {
            transfer::download(&buf, layout.offset() * size, out)
        } else {
            let c = ops::contiguous(&buf, layout, dtype)?;
            transfer::download(&c, 0, out)
        }
    }

    fn realize(storage: &CudaStorage) -> Result<()> {
        storage.realize()
    }

    fn is_deferred(storage: &CudaStorage) -> bool {
        storage.is_pending()
    }

    fn to_host(storage: &CudaStorage, layout: &Layout, dtype: DType) -> Result<HostBuffer> {
        let mut h = host_zeros(dtype, layout.elem_count());
        Self::to_host_bytes(storage, layout, dtype, host_bytes_of(&mut h))?;
        Ok(h)
    }

    fn copy_to_device(
        storage: &CudaStorage,
        layout: &Layout,
        dtype: DType,
        dst: &CudaDevice,
    ) -> Result<CudaStorage> {
        let size = dtype.size_in_bytes();
        if storage.device() == *dst {
            return Self::contiguous(storage, layout, dtype);
        }
        let dst_state = state(dst)?;
        let storage = &*storage.buffer()?;
        storage.state().bind()?;
        let copied = if layout.is_contiguous() {
            transfer::copy_peer(
                storage,
                layout.offset() * size,
                layout.elem_count() * size,
                dst_state,
            )
        } else {
            let c = ops::contiguous(storage, layout, dtype)?;
            transfer::copy_peer(&c, 0, layout.elem_count() * size, dst_state)
        };
        copied.map(CudaStorage::ready)
    }

    fn copy_into(
        src: &CudaStorage,
        src_layout: &Layout,
        dst: &mut CudaStorage,
        dst_layout: &Layout,
        dtype: DType,
    ) -> Result<()> {
        if src.device() != dst.device() {
            return Err(Error::DeviceMismatch {
                op: "copy_into",
                lhs: src.device().to_string(),
                rhs: dst.device().to_string(),
            });
        }
        let src = src.buffer()?;
        ops::copy_strided(&src, src_layout, dst.buffer_mut()?, dst_layout, dtype)
    }

    fn contiguous(storage: &CudaStorage, layout: &Layout, dtype: DType) -> Result<CudaStorage> {
        if let lazy::Repr::Lazy(n) = storage.repr() {
            // A pending tensor read in its own layout is already what `contiguous` returns.
            if layout.offset() == 0 && layout.is_contiguous() && n.shape().dims() == layout.dims() {
                return Ok(CudaStorage::pending(n.clone()));
            }
        }
        ops::contiguous(&*storage.buffer()?, layout, dtype).map(CudaStorage::ready)
    }

    fn rand(
        device: &CudaDevice,
        dtype: DType,
        len: usize,
        seed: u64,
        dist: RandDist,
    ) -> Result<CudaStorage> {
        ops::rand(state(device)?, dtype, len, seed, dist).map(CudaStorage::ready)
    }

    fn unary(op: UnaryOp, s: &CudaStorage, layout: &Layout, dtype: DType) -> Result<CudaStorage> {
        record(lazy::Op::Unary(op), &[(s, layout, dtype)], dtype)
    }

    fn unary_backward(
        op: UnaryOp,
        saved: &CudaStorage,
        saved_layout: &Layout,
        g: &CudaStorage,
        g_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        record(
            lazy::Op::UnaryBwd(op),
            &[(saved, saved_layout, dtype), (g, g_layout, dtype)],
            dtype,
        )
    }

    fn binary(
        op: BinaryOp,
        lhs: &CudaStorage,
        lhs_layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        record(
            lazy::Op::Binary(op),
            &[(lhs, lhs_layout, dtype), (rhs, rhs_layout, dtype)],
            dtype,
        )
    }

    fn binary_scalar(
        op: BinaryOp,
        s: &CudaStorage,
        layout: &Layout,
        dtype: DType,
        scalar: f64,
        scalar_lhs: bool,
    ) -> Result<CudaStorage> {
        let op = lazy::Op::Scalar {
            op,
            value: scalar,
            lhs: scalar_lhs,
        };
        record(op, &[(s, layout, dtype)], dtype)
    }

    fn compare(
        op: CmpOp,
        lhs: &CudaStorage,
        lhs_layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        record(
            lazy::Op::Compare(op),
            &[(lhs, lhs_layout, dtype), (rhs, rhs_layout, dtype)],
            DType::U8,
        )
    }

    fn where_cond(
        cond: &CudaStorage,
        cond_layout: &Layout,
        on_true: &CudaStorage,
        true_layout: &Layout,
        on_false: &CudaStorage,
        false_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        record(
            lazy::Op::Where,
            &[
                (cond, cond_layout, DType::U8),
                (on_true, true_layout, dtype),
                (on_false, false_layout, dtype),
            ],
            dtype,
        )
    }

    fn reduce(
        op: ReduceOp,
        s: &CudaStorage,
        layout: &Layout,
        dtype: DType,
        axes: &[usize],
    ) -> Result<CudaStorage> {
        // A reduction of everything in a pending elementwise chain (a loss) runs in the
        // chain's own kernel.
        let kept: usize = (0..layout.rank())
            .filter(|i| !axes.contains(i))
            .map(|i| layout.dims()[i])
            .product();
        if kept == 1
            && let Some(out) = lazy::reduce_all(s.repr(), layout, op)?
        {
            return Ok(CudaStorage::ready(out));
        }
        let generated = match ops::reduce::reduce_path() {
            ReducePath::Kernels => false,
            ReducePath::Generated => true,
            ReducePath::Auto => {
                let sms = state(&s.device())?.sm_count() as usize;
                ops::reduce::generated_is_faster(layout, axes, sms)
            }
        };
        if generated && let Some(out) = expr_eval::reduce(op, s, layout, dtype, axes)? {
            return Ok(out);
        }
        ops::reduce(op, &*s.buffer()?, layout, dtype, axes).map(CudaStorage::ready)
    }

    fn matmul(
        lhs: &CudaStorage,
        lhs_layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        blas::matmul(
            &*lhs.buffer()?,
            lhs_layout,
            &*rhs.buffer()?,
            rhs_layout,
            dtype,
        )
        .map(CudaStorage::ready)
    }

    fn softmax(s: &CudaStorage, layout: &Layout, dtype: DType, log: bool) -> Result<CudaStorage> {
        ops::softmax(&*s.buffer()?, layout, dtype, log).map(CudaStorage::ready)
    }

    fn cross_entropy(
        logits: &CudaStorage,
        logits_layout: &Layout,
        labels: &CudaStorage,
        labels_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        ops::cross_entropy(
            &*logits.buffer()?,
            logits_layout,
            &*labels.buffer()?,
            labels_layout,
            dtype,
        )
        .map(CudaStorage::ready)
    }

    fn attention_forward(
        q: Operand<'_, CudaStorage>,
        k: Operand<'_, CudaStorage>,
        v: Operand<'_, CudaStorage>,
        attn_mask: Option<AttnMaskOperand<'_, CudaStorage>>,
        dtype: DType,
        spec: AttentionSpec,
    ) -> Result<Option<AttentionOutputs<CudaStorage>>> {
        let (qb, kb, vb) = (q.0.buffer()?, k.0.buffer()?, v.0.buffer()?);
        let (mask_buf, mask) = mask_parts(attn_mask)?;
        let mask = mask_operand(&mask_buf, mask);
        let (qo, ko, vo) = ((&*qb, q.1), (&*kb, k.1), (&*vb, v.1));
        let tf32 = blas::allow_tf32();
        // cuDNN first (16-bit where its engines are wanted), then kiln's kernels.
        let r = match attention_cudnn::forward(qo, ko, vo, mask, dtype, spec)? {
            Some(r) => Some(r),
            None => {
                let mask = mask.map(kernels_mask);
                ops::attention::forward(qo, ko, vo, mask, dtype, (spec, tf32))?
            }
        };
        Ok(r.map(|((o, ol), l, m)| {
            (
                (CudaStorage::ready(o), ol),
                CudaStorage::ready(l),
                m.map(CudaStorage::ready),
            )
        }))
    }

    fn attention_backward(
        q: Operand<'_, CudaStorage>,
        k: Operand<'_, CudaStorage>,
        v: Operand<'_, CudaStorage>,
        attn_mask: Option<AttnMaskOperand<'_, CudaStorage>>,
        out: Operand<'_, CudaStorage>,
        lse: Operand<'_, CudaStorage>,
        mask: Option<&CudaStorage>,
        g: Operand<'_, CudaStorage>,
        dtype: DType,
        spec: AttentionSpec,
    ) -> Result<Option<AttentionGrads<CudaStorage>>> {
        let (qb, kb, vb) = (q.0.buffer()?, k.0.buffer()?, v.0.buffer()?);
        let (ob, lb, gb) = (out.0.buffer()?, lse.0.buffer()?, g.0.buffer()?);
        let mb = mask.map(|m| m.buffer()).transpose()?;
        let (am_buf, am) = mask_parts(attn_mask)?;
        let am = mask_operand(&am_buf, am);
        let (qo, ko, vo) = ((&*qb, q.1), (&*kb, k.1), (&*vb, v.1));
        let (oo, lo, go) = ((&*ob, out.1), (&*lb, lse.1), (&*gb, g.1));
        let mb = mb.as_deref();
        let on_cudnn = attention_cudnn::backward(qo, ko, vo, am, oo, lo, mb, go, dtype, spec)?;
        let r = match on_cudnn {
            Some(r) => Some(r),
            None => {
                let spec = (spec, blas::allow_tf32());
                let am = am.map(kernels_mask);
                ops::attention::backward(qo, ko, vo, oo, lo, (mb, am), go, dtype, spec)?
            }
        };
        Ok(r.map(|g| AttentionGrads {
            storages: g.storages.into_iter().map(CudaStorage::ready).collect(),
            grads: g.grads,
        }))
    }

    fn layer_norm_forward(
        x: Operand<'_, CudaStorage>,
        weight: Option<Operand<'_, CudaStorage>>,
        bias: Option<Operand<'_, CudaStorage>>,
        dtype: DType,
        spec: NormSpec,
    ) -> Result<Option<NormOutputs<CudaStorage>>> {
        let xb = x.0.buffer()?;
        let wb = weight.map(|w| w.0.buffer()).transpose()?;
        let bb = bias.map(|b| b.0.buffer()).transpose()?;
        let r = ops::norm::forward(
            (&xb, x.1),
            wb.as_deref().zip(weight.map(|w| w.1)),
            bb.as_deref().zip(bias.map(|b| b.1)),
            dtype,
            spec,
        )?;
        Ok(r.map(|(y, m, r)| {
            (
                CudaStorage::ready(y),
                m.map(CudaStorage::ready),
                CudaStorage::ready(r),
            )
        }))
    }

    fn layer_norm_backward(
        x: Operand<'_, CudaStorage>,
        mean: Option<Operand<'_, CudaStorage>>,
        rstd: Operand<'_, CudaStorage>,
        weight: Option<Operand<'_, CudaStorage>>,
        g: Operand<'_, CudaStorage>,
        dx_acc: Option<Operand<'_, CudaStorage>>,
        dtype: DType,
        spec: NormSpec,
        needs: [bool; 3],
    ) -> Result<Option<NormGrads<CudaStorage>>> {
        let (xb, rb, gb) = (x.0.buffer()?, rstd.0.buffer()?, g.0.buffer()?);
        let mb = mean.map(|m| m.0.buffer()).transpose()?;
        let wb = weight.map(|w| w.0.buffer()).transpose()?;
        let ab = dx_acc.map(|a| a.0.buffer()).transpose()?;
        let r = ops::norm::backward(
            (&xb, x.1),
            mb.as_deref().zip(mean.map(|m| m.1)),
            (&rb, rstd.1),
            wb.as_deref().zip(weight.map(|w| w.1)),
            (&gb, g.1),
            ab.as_deref().zip(dx_acc.map(|a| a.1)),
            dtype,
            spec,
            needs,
        )?;
        let ready = |b: Option<memory::Buffer>| b.map(CudaStorage::ready);
        Ok(r.map(|(dx, dw, db)| (ready(dx), ready(dw), ready(db))))
    }

    fn cross_entropy_backward(
        logits: &CudaStorage,
        logits_layout: &Layout,
        labels: &CudaStorage,
        labels_layout: &Layout,
        grad: &CudaStorage,
        grad_layout: &Layout,
        dtype: DType,
    ) -> Result<CudaStorage> {
        ops::cross_entropy_backward(
            &*logits.buffer()?,
            logits_layout,
            &*labels.buffer()?,
            labels_layout,
            &*grad.buffer()?,
            grad_layout,
            dtype,
        )
        .map(CudaStorage::ready)
    }

    fn cast(s: &CudaStorage, layout: &Layout, from: DType, to: DType) -> Result<CudaStorage> {
        record(lazy::Op::Cast(to), &[(s, layout, from)], to)
    }

    fn index_select(
        s: &CudaStorage,
        layout: &Layout,
        dtype: DType,
        ids: &CudaStorage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<CudaStorage> {
        ops::index_select(
            &*s.buffer()?,
            layout,
            dtype,
            &*ids.buffer()?,
            ids_layout,
            axis,
        )
        .map(CudaStorage::ready)
    }

    fn gather(
        s: &CudaStorage,
        layout: &Layout,
        dtype: DType,
        ids: &CudaStorage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<CudaStorage> {
        ops::gather(
            &*s.buffer()?,
            layout,
            dtype,
            &*ids.buffer()?,
            ids_layout,
            axis,
        )
        .map(CudaStorage::ready)
    }

    fn scatter_add(
        base: &CudaStorage,
        base_layout: &Layout,
        dtype: DType,
        ids: &CudaStorage,
        ids_layout: &Layout,
        src: &CudaStorage,
        src_layout: &Layout,
        axis: usize,
    ) -> Result<CudaStorage> {
        if dtype.is_half() {
            // In f32, each output rounded once (as the CPU backend): the 16-bit base and
            // sources widened by generated casts, the f32 kernel's atomics, one rounding.
            let wb = Self::cast(base, base_layout, dtype, DType::F32)?;
            let ws = Self::cast(src, src_layout, dtype, DType::F32)?;
            let (wbl, wsl) = (
                Layout::contiguous(base_layout.shape().clone()),
                Layout::contiguous(src_layout.shape().clone()),
            );
            let out = Self::scatter_add(&wb, &wbl, DType::F32, ids, ids_layout, &ws, &wsl, axis)?;
            return Self::cast(&out, &wbl, DType::F32, dtype);
        }
        ops::scatter_add(
            &*base.buffer()?,
            base_layout,
            dtype,
            &*ids.buffer()?,
            ids_layout,
            &*src.buffer()?,
            src_layout,
            axis,
        )
        .map(CudaStorage::ready)
    }

    fn offers_conv2d(_device: &CudaDevice, dtype: DType) -> bool {
        cudnn::offered(dtype)
    }

    fn conv2d(
        x: &CudaStorage,
        x_layout: &Layout,
        w: &CudaStorage,
        w_layout: &Layout,
        dtype: DType,
        spec: &Conv2dSpec,
    ) -> Result<Option<CudaStorage>> {
        if !cudnn::offered(dtype) {
            return Ok(None);
        }
        let (xd, wd) = (dims4(x_layout)?, dims4(w_layout)?);
        let Some(yd) = spec.output_dims(xd, wd) else {
            return Err(Error::invalid(
                "conv2d",
                "shapes do not fit the convolution",
            ));
        };
        let xb = cudnn::packed(x.buffer()?, x_layout, dtype)?;
        let wb = cudnn::packed(w.buffer()?, w_layout, dtype)?;
        same_device("conv2d", &xb, &wb)?;
        let r = cudnn::run(
            xb.state(),
            cudnn::Dir::Forward,
            &xb,
            &wb,
            (xd, wd, yd),
            yd,
            spec,
            dtype,
        );
        Ok(r?.map(CudaStorage::ready))
    }

    fn conv2d_bias_act(
        x: Operand<'_, CudaStorage>,
        w: Operand<'_, CudaStorage>,
        bias: Operand<'_, CudaStorage>,
        dtype: DType,
        spec: &Conv2dSpec,
        act: Activation,
    ) -> Result<Option<CudaStorage>> {
        cudnn::conv_bias_act(x, w, bias, dtype, spec, act)
    }

    fn conv2d_backward_data(
        w: &CudaStorage,
        w_layout: &Layout,
        dy: &CudaStorage,
        dy_layout: &Layout,
        dtype: DType,
        x_dims: [usize; 4],
        spec: &Conv2dSpec,
    ) -> Result<Option<CudaStorage>> {
        if !cudnn::usable(dtype) {
            return Ok(None);
        }
        let (wd, yd) = (dims4(w_layout)?, dims4(dy_layout)?);
        let wb = cudnn::packed(w.buffer()?, w_layout, dtype)?;
        let gb = cudnn::packed(dy.buffer()?, dy_layout, dtype)?;
        same_device("conv2d_backward_data", &wb, &gb)?;
        let r = cudnn::run(
            wb.state(),
            cudnn::Dir::Data,
            &wb,
            &gb,
            (x_dims, wd, yd),
            x_dims,
            spec,
            dtype,
        );
        Ok(r?.map(CudaStorage::ready))
    }

    fn conv2d_backward_filter(
        x: &CudaStorage,
        x_layout: &Layout,
        dy: &CudaStorage,
        dy_layout: &Layout,
        dtype: DType,
        w_dims: [usize; 4],
        spec: &Conv2dSpec,
    ) -> Result<Option<CudaStorage>> {
        if !cudnn::usable(dtype) {
            return Ok(None);
        }
        let (xd, yd) = (dims4(x_layout)?, dims4(dy_layout)?);
        let xb = cudnn::packed(x.buffer()?, x_layout, dtype)?;
        let gb = cudnn::packed(dy.buffer()?, dy_layout, dtype)?;
        same_device("conv2d_backward_filter", &xb, &gb)?;
        let r = cudnn::run(
            xb.state(),
            cudnn::Dir::Filter,
            &xb,
            &gb,
            (xd, w_dims, yd),
            w_dims,
            spec,
            dtype,
        );
        Ok(r?.map(CudaStorage::ready))
    }

    fn eval_expr(
        device: &CudaDevice,
        program: &kiln_core::expr::Program,
        shape: &kiln_core::Shape,
        inputs: &[(&CudaStorage, &Layout)],
        params: &[f64],
    ) -> Result<Vec<CudaStorage>> {
        expr_eval::eval_expr(device, program, shape, inputs, params)
    }

    fn linear_epilogue(
        x: Operand<'_, CudaStorage>,
        w: Operand<'_, CudaStorage>,
        bias: Option<(Operand<'_, CudaStorage>, DType)>,
        dtype: DType,
        act: Activation,
        keep_aux: bool,
    ) -> Result<Option<EpilogueOutputs<CudaStorage>>> {
        blas_lt::linear_epilogue(x, w, bias, dtype, act, keep_aux)
    }

    fn linear_epilogue_backward(
        x: Operand<'_, CudaStorage>,
        w: Operand<'_, CudaStorage>,
        aux: Option<&CudaStorage>,
        g: Operand<'_, CudaStorage>,
        dtype: DType,
        bias_dtype: Option<DType>,
        act: Activation,
    ) -> Result<Option<EpilogueGrads<CudaStorage>>> {
        blas_lt::linear_epilogue_backward(x, w, aux, g, dtype, bias_dtype, act)
    }

    fn unscale_check(
        dtype: DType,
        inv_scale: f64,
        slots: &[UnscaleSlot<'_, CudaStorage>],
    ) -> Result<(Vec<CudaStorage>, CudaStorage)> {
        amp::unscale_check_storages(dtype, inv_scale, slots)
    }

    fn sq_sum(dtype: DType, slots: &[UnscaleSlot<'_, CudaStorage>]) -> Result<CudaStorage> {
        amp::sq_sum_storages(dtype, slots)
    }

    fn fused_update(
        rule: &UpdateRule,
        dtype: DType,
        slots: &[UpdateSlot<'_, CudaStorage>],
        grad_scale: Option<&CudaStorage>,
    ) -> Result<Vec<(CudaStorage, Vec<CudaStorage>)>> {
        update::fused_update(rule, dtype, slots, grad_scale)
    }
}
