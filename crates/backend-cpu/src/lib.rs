//! # kiln-backend-cpu
//!
//! [`Cpu`], kiln's CPU backend: the one every test runs on in CI, and a fast one, since the
//! examples' workloads (and every user without a GPU) train on it.
//!
//! - **Devices**: [`CpuDevice`] is a *virtual* ordinal over the one host memory (`cpu`,
//!   `cpu:1`, ...). Distinct ordinals are distinct devices, so the device rules (mismatch errors,
//!   explicit copies, model parallelism) are testable without a GPU.
//! - **Storage**: [`CpuStorage`], one typed `Vec` per tensor (or the deferred work that computes
//!   it), with memory stats and a small cache of large buffers (see [`storage`] for why).
//! - **Kernels**: every op has a contiguous fast path over plain slices (loops LLVM vectorizes)
//!   and a general strided path (transposed, sliced and broadcast views need no copy); work on
//!   at least 32K elements is split across cores with rayon. Matrix products go to
//!   matrixmultiply's sgemm/dgemm through ndarray views with the operands' own strides, so a
//!   transposed operand is never copied; a product from 2M multiply-adds up is cut into parts
//!   that the calling thread and helper threads claim, the helpers sleeping between products
//!   (`pool.rs` says why not rayon); `exp` for f32 is a vectorized polynomial.
//! - **Fusion**: expression programs (`kiln_core::expr`) run in one blocked pass (`expr`), and
//!   elementwise ops with large results are deferred and run as such a program when read
//!   (`lazy`; [`set_fusion`], [`set_fusion_min_elements`]).
//! - **Numerics**: f32 sums accumulate in f64 (documented in [`reduce`]), softmax
//!   and cross-entropy subtract the row maximum, GELU is exact (`libm::erf`), random numbers
//!   come from [`kiln_core::philox`] bit for bit.
//!
//! ```
//! use kiln_backend_cpu::Cpu;
//! use kiln_core::{DType, Tensor};
//!
//! let dev = Cpu::device(0);
//! let x = Tensor::<Cpu>::arange(0.0, 6.0, 1.0, DType::F32, &dev)?.reshape([2, 3])?;
//! let y = (&x.t()?.matmul(&x)? + 1.0)?;
//! assert_eq!(y.to_vec::<f32>()?[0], 10.0);
//! assert!(x.add(&x.copy_to(&Cpu::device(1))?).is_err()); // cpu vs cpu:1
//! # Ok::<(), kiln_core::Error>(())
//! ```
//!
//! # Layers
//!
//! Modules import downward only (no circle among the `crate::` imports of the files), so each
//! kernel file can be read and tested without the `Backend` implementation above it:
//!
//! 1. **Foundations, importing no other module** — `device.rs` (the [`Cpu`] marker and
//!    [`CpuDevice`]), `strided.rs` (the strided and parallel drivers the kernels run on),
//!    `fastmath.rs` (vectorized `exp`), `pool.rs` (the matrix product's helper threads).
//! 2. **Storage** — [`storage`] ([`CpuStorage`], typed buffers, memory stats, the buffer cache).
//! 3. **Kernels** — `elementwise.rs` (slice kernels, and the dtype helpers the later kernels
//!    share), `expr/` (the fused evaluator of expression programs, beside `elementwise.rs`, not
//!    above it; inside, bottom to top: `block.rs` and `walk.rs`, `exec.rs`, the drivers
//!    `flat.rs` and `fold.rs`, `mod.rs`), `transfer.rs` (fills, host copies, pinning, `copy_into`), [`reduce`],
//!    `index.rs`, `random.rs`, `matmul.rs`, then `softmax.rs` (which uses [`reduce`]).
//! 4. **Deferral** — `lazy.rs` (records elementwise ops and runs the chain as one program
//!    through `expr/` when read).
//! 5. `lib.rs`: the `Backend` implementation for [`Cpu`], checking layouts and calling down.

// Layers, bottom to top: see "Layers" above.
mod aligned;
mod convert;
mod device;
mod elementwise;
mod expr;
mod fastmath;
mod gemm_nn;
mod gemm_nt;
mod gemv;
mod half;
mod index;
mod lazy;
mod mat;
mod matmul;
mod pool;
mod random;
pub mod reduce;
mod softmax;
pub mod storage;
mod strided;
mod transfer;

pub use device::{Cpu, CpuDevice, MAX_CPU_DEVICES};
pub use lazy::{
    DEFAULT_FUSION_MIN_ELEMENTS, fusion_enabled, fusion_min_elements, set_fusion,
    set_fusion_min_elements,
};
pub use storage::{AlignedVec, CpuData, CpuStorage, HostVec};

use kiln_core::expr::defer::Op;
use kiln_core::{
    Backend, BinaryOp, CmpOp, DType, Error, HostBuffer, HostSource, Layout, MemoryStats, RandDist,
    ReduceOp, Result, UnaryOp,
};

use crate::elementwise::{ALL_DTYPES, dtype_err};
use crate::storage::{CpuElem, with_elem};

/// Computes `s` if it holds deferred work (see `lazy.rs`), then [`check`]s `layout`: the
/// first step of every op that reads elements.
fn input(op: &'static str, s: &CpuStorage, layout: &Layout) -> Result<()> {
    lazy::compute(s)?;
    check(op, s, layout)
}

/// Rejects a layout that reaches outside its storage (instead of panicking on an index).
fn check(op: &'static str, s: &CpuStorage, layout: &Layout) -> Result<()> {
    if layout.storage_extent() > s.len() {
        return Err(Error::invalid(
            op,
            format!(
                "layout {:?} (offset {}) reaches element {} of a storage of {} elements",
                layout.strides(),
                layout.offset(),
                layout.storage_extent() - 1,
                s.len()
            ),
        ));
    }
    Ok(())
}

fn same_shape(op: &'static str, a: &Layout, b: &Layout) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
        });
    }
    Ok(())
}

/// Number of devices [`Backend::devices`] lists: `KILN_CPU_DEVICES` (default 1).
fn listed_devices() -> usize {
    std::env::var("KILN_CPU_DEVICES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, MAX_CPU_DEVICES)
}

impl Backend for Cpu {
    type Device = CpuDevice;
    type Storage = CpuStorage;
    const NAME: &'static str = "cpu";

    /// `cpu:0 .. cpu:{n-1}` with `n` from the `KILN_CPU_DEVICES` environment variable (default
    /// 1). Every ordinal below [`MAX_CPU_DEVICES`] is usable whether listed or not.
    fn devices() -> Vec<CpuDevice> {
        (0..listed_devices()).map(Cpu::device).collect()
    }

    fn parse_device(name: &str) -> Result<CpuDevice> {
        CpuDevice::parse(name)
    }

    /// Kernels run to completion before they return: nothing to wait for.
    fn synchronize(_device: &CpuDevice) -> Result<()> {
        Ok(())
    }

    /// Runs the deferred elementwise chain behind `storage`, if any (see `lazy.rs`).
    fn realize(storage: &CpuStorage) -> Result<()> {
        lazy::compute(storage)
    }

    fn is_deferred(storage: &CpuStorage) -> bool {
        storage.is_pending()
    }

    fn memory_stats(device: &CpuDevice) -> Result<MemoryStats> {
        Ok(storage::memory_stats(device))
    }

    fn empty_cache(device: &CpuDevice) -> Result<()> {
        storage::empty_cache(device);
        Ok(())
    }

    fn storage_device(storage: &CpuStorage) -> CpuDevice {
        storage.device()
    }

    fn fill(device: &CpuDevice, dtype: DType, len: usize, value: f64) -> Result<CpuStorage> {
        let d = *device;
        // `value as T` (rounded to nearest even for the 16-bit floats).
        with_elem!(dtype, T => transfer::fill_t(d, len, <T as CpuElem>::from_f64(value)),
            _ => Err(dtype_err("fill", ALL_DTYPES, dtype)))
    }

    fn from_host(device: &CpuDevice, data: &HostBuffer) -> Result<CpuStorage> {
        let dtype = data.dtype();
        Self::from_host_source(device, dtype, HostSource::borrowed(data.as_bytes()))
    }

    fn from_host_owned(device: &CpuDevice, data: HostBuffer) -> Result<CpuStorage> {
        Ok(CpuStorage::new(*device, CpuData::from_host_owned(data)))
    }

    fn from_host_source(
        device: &CpuDevice,
        dtype: DType,
        src: HostSource<'_>,
    ) -> Result<CpuStorage> {
        with_elem!(dtype, T => transfer::from_bytes_t::<T>("from_host", *device, src.bytes),
            _ => Err(dtype_err("from_host", ALL_DTYPES, dtype)))
    }

    fn host_source<'a>(
        storage: &'a std::sync::Arc<CpuStorage>,
        layout: &Layout,
        dtype: DType,
    ) -> Option<HostSource<'a>> {
        let r = layout.contiguous_range()?;
        let size = dtype.size_in_bytes();
        lazy::compute(storage).ok()?;
        let data = storage.data().ok()?;
        let bytes = data.as_bytes().get(r.start * size..r.end * size)?;
        let owner: std::sync::Arc<dyn std::any::Any + Send + Sync> = storage.clone();
        Some(HostSource {
            bytes,
            pinned: data.is_pinned(),
            owner: Some(owner),
        })
    }

    fn to_host_bytes(
        storage: &CpuStorage,
        layout: &Layout,
        dtype: DType,
        out: &mut [u8],
    ) -> Result<()> {
        input("to_host", storage, layout)?;
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
        with_elem!(dtype, T => transfer::to_bytes_t::<T>(storage, layout, out),
            _ => Err(dtype_err("to_host", ALL_DTYPES, dtype)))
    }

    fn host_bytes_mut<'a>(
        storage: &'a mut CpuStorage,
        layout: &Layout,
        dtype: DType,
    ) -> Option<&'a mut [u8]> {
        let r = layout.contiguous_range()?;
        let size = dtype.size_in_bytes();
        lazy::compute(storage).ok()?;
        storage
            .bytes_mut()
            .ok()?
            .get_mut(r.start * size..r.end * size)
    }

    fn pin_memory(storage: &CpuStorage, layout: &Layout, dtype: DType) -> Result<CpuStorage> {
        input("pin_memory", storage, layout)?;
        let d = storage.device();
        let data = match dtype {
            DType::F32 => CpuData::F32(transfer::pin_t(storage, layout)?),
            DType::F64 => CpuData::F64(transfer::pin_t(storage, layout)?),
            DType::I64 => CpuData::I64(transfer::pin_t(storage, layout)?),
            DType::U8 => CpuData::U8(transfer::pin_t(storage, layout)?),
            DType::F16 => CpuData::F16(transfer::pin_t(storage, layout)?),
            DType::BF16 => CpuData::BF16(transfer::pin_t(storage, layout)?),
            _ => return Err(dtype_err("pin_memory", ALL_DTYPES, dtype)),
        };
        Ok(CpuStorage::new(d, data))
    }

    fn is_pinned(storage: &CpuStorage) -> bool {
        storage.data().is_ok_and(|d| d.is_pinned())
    }

    fn to_host(storage: &CpuStorage, layout: &Layout, dtype: DType) -> Result<HostBuffer> {
        input("to_host", storage, layout)?;
        with_elem!(dtype, T => Ok(<T as kiln_core::Element>::into_host(
            transfer::to_host_t::<T>(storage, layout)?)),
            _ => Err(dtype_err("to_host", ALL_DTYPES, dtype)))
    }

    fn copy_to_device(
        storage: &CpuStorage,
        layout: &Layout,
        dtype: DType,
        dst: &CpuDevice,
    ) -> Result<CpuStorage> {
        input("copy_to", storage, layout)?;
        elementwise::copy_contiguous("copy_to", storage, layout, dtype, *dst)
    }

    fn copy_into(
        src: &CpuStorage,
        src_layout: &Layout,
        dst: &mut CpuStorage,
        dst_layout: &Layout,
        dtype: DType,
    ) -> Result<()> {
        input("copy_into", src, src_layout)?;
        input("copy_into", dst, dst_layout)?;
        same_shape("copy_into", src_layout, dst_layout)?;
        with_elem!(dtype, T => transfer::copy_into_t::<T>(src, src_layout, dst, dst_layout),
            _ => Err(dtype_err("copy_into", ALL_DTYPES, dtype)))
    }

    fn contiguous(storage: &CpuStorage, layout: &Layout, dtype: DType) -> Result<CpuStorage> {
        input("contiguous", storage, layout)?;
        elementwise::copy_contiguous("contiguous", storage, layout, dtype, storage.device())
    }

    fn rand(
        device: &CpuDevice,
        dtype: DType,
        len: usize,
        seed: u64,
        dist: RandDist,
    ) -> Result<CpuStorage> {
        random::rand(*device, dtype, len, seed, dist)
    }

    fn unary(op: UnaryOp, s: &CpuStorage, layout: &Layout, dtype: DType) -> Result<CpuStorage> {
        check(op.name(), s, layout)?;
        lazy::record(Op::Unary(op), &[(s, layout, dtype)], dtype)
    }

    fn unary_backward(
        op: UnaryOp,
        saved: &CpuStorage,
        saved_layout: &Layout,
        g: &CpuStorage,
        g_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        check("unary_backward", saved, saved_layout)?;
        check("unary_backward", g, g_layout)?;
        same_shape("unary_backward", saved_layout, g_layout)?;
        let args = [(saved, saved_layout, dtype), (g, g_layout, dtype)];
        lazy::record(Op::UnaryBwd(op), &args, dtype)
    }

    fn binary(
        op: BinaryOp,
        lhs: &CpuStorage,
        lhs_layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        check(op.name(), lhs, lhs_layout)?;
        check(op.name(), rhs, rhs_layout)?;
        same_shape(op.name(), lhs_layout, rhs_layout)?;
        let args = [(lhs, lhs_layout, dtype), (rhs, rhs_layout, dtype)];
        lazy::record(Op::Binary(op), &args, dtype)
    }

    fn binary_scalar(
        op: BinaryOp,
        s: &CpuStorage,
        layout: &Layout,
        dtype: DType,
        scalar: f64,
        scalar_lhs: bool,
    ) -> Result<CpuStorage> {
        check(op.name(), s, layout)?;
        let op = Op::Scalar {
            op,
            value: scalar,
            lhs: scalar_lhs,
        };
        lazy::record(op, &[(s, layout, dtype)], dtype)
    }

    fn compare(
        op: CmpOp,
        lhs: &CpuStorage,
        lhs_layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        check(op.name(), lhs, lhs_layout)?;
        check(op.name(), rhs, rhs_layout)?;
        same_shape(op.name(), lhs_layout, rhs_layout)?;
        let args = [(lhs, lhs_layout, dtype), (rhs, rhs_layout, dtype)];
        lazy::record(Op::Compare(op), &args, DType::U8)
    }

    fn where_cond(
        cond: &CpuStorage,
        cond_layout: &Layout,
        on_true: &CpuStorage,
        true_layout: &Layout,
        on_false: &CpuStorage,
        false_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        check("where", cond, cond_layout)?;
        check("where", on_true, true_layout)?;
        check("where", on_false, false_layout)?;
        same_shape("where", cond_layout, true_layout)?;
        same_shape("where", cond_layout, false_layout)?;
        let args = [
            (cond, cond_layout, DType::U8),
            (on_true, true_layout, dtype),
            (on_false, false_layout, dtype),
        ];
        lazy::record(Op::Where, &args, dtype)
    }

    fn reduce(
        op: ReduceOp,
        s: &CpuStorage,
        layout: &Layout,
        dtype: DType,
        axes: &[usize],
    ) -> Result<CpuStorage> {
        // A sum, max or min of a pending chain runs in the chain's own pass.
        check(op.name(), s, layout)?;
        if let Some(out) = lazy::reduce(s, layout, op, dtype, axes)? {
            return Ok(out);
        }
        lazy::compute(s)?;
        if dtype.is_half() {
            return half::reduce(op, s, layout, dtype, axes);
        }
        reduce::reduce(op, s, layout, dtype, axes)
    }

    fn matmul(
        lhs: &CpuStorage,
        lhs_layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        input("matmul", lhs, lhs_layout)?;
        input("matmul", rhs, rhs_layout)?;
        if dtype.is_half() {
            return half::matmul(lhs, lhs_layout, rhs, rhs_layout, dtype);
        }
        matmul::matmul(lhs, lhs_layout, rhs, rhs_layout, dtype)
    }

    fn softmax(s: &CpuStorage, layout: &Layout, dtype: DType, log: bool) -> Result<CpuStorage> {
        let op = if log { "log_softmax" } else { "softmax" };
        input(op, s, layout)?;
        if dtype.is_half() {
            return half::softmax(s, layout, dtype, log);
        }
        softmax::softmax(s, layout, dtype, log)
    }

    fn cross_entropy(
        logits: &CpuStorage,
        logits_layout: &Layout,
        labels: &CpuStorage,
        labels_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        input("cross_entropy", logits, logits_layout)?;
        input("cross_entropy", labels, labels_layout)?;
        if dtype.is_half() {
            return half::cross_entropy(logits, logits_layout, labels, labels_layout, None, dtype);
        }
        softmax::cross_entropy(logits, logits_layout, labels, labels_layout, None, dtype)
    }

    fn cross_entropy_backward(
        logits: &CpuStorage,
        logits_layout: &Layout,
        labels: &CpuStorage,
        labels_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
        dtype: DType,
    ) -> Result<CpuStorage> {
        const OP: &str = "cross_entropy_backward";
        input(OP, logits, logits_layout)?;
        input(OP, labels, labels_layout)?;
        input(OP, grad, grad_layout)?;
        let grad = Some((grad, grad_layout));
        if dtype.is_half() {
            return half::cross_entropy(logits, logits_layout, labels, labels_layout, grad, dtype);
        }
        softmax::cross_entropy(logits, logits_layout, labels, labels_layout, grad, dtype)
    }

    fn cast(s: &CpuStorage, layout: &Layout, from: DType, to: DType) -> Result<CpuStorage> {
        check("cast", s, layout)?;
        lazy::record(Op::Cast(to), &[(s, layout, from)], to)
    }

    fn index_select(
        s: &CpuStorage,
        layout: &Layout,
        dtype: DType,
        ids: &CpuStorage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<CpuStorage> {
        input("index_select", s, layout)?;
        input("index_select", ids, ids_layout)?;
        index::index_select(s, layout, dtype, ids, ids_layout, axis)
    }

    fn gather(
        s: &CpuStorage,
        layout: &Layout,
        dtype: DType,
        ids: &CpuStorage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<CpuStorage> {
        input("gather", s, layout)?;
        input("gather", ids, ids_layout)?;
        index::gather(s, layout, dtype, ids, ids_layout, axis)
    }

    fn scatter_add(
        base: &CpuStorage,
        base_layout: &Layout,
        dtype: DType,
        ids: &CpuStorage,
        ids_layout: &Layout,
        src: &CpuStorage,
        src_layout: &Layout,
        axis: usize,
    ) -> Result<CpuStorage> {
        input("scatter_add", base, base_layout)?;
        input("scatter_add", ids, ids_layout)?;
        input("scatter_add", src, src_layout)?;
        let scatter = if dtype.is_half() {
            half::scatter_add
        } else {
            index::scatter_add
        };
        scatter(
            base,
            base_layout,
            dtype,
            ids,
            ids_layout,
            src,
            src_layout,
            axis,
        )
    }

    /// One fused pass, block by block (see the `expr` module), not one kernel per instruction.
    fn eval_expr(
        device: &CpuDevice,
        program: &kiln_core::expr::Program,
        shape: &kiln_core::Shape,
        inputs: &[(&CpuStorage, &Layout)],
        params: &[f64],
    ) -> Result<Vec<CpuStorage>> {
        for (s, _) in inputs {
            lazy::compute(s)?;
        }
        expr::eval_expr(device, program, shape, inputs, params)
    }
}
