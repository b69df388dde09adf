//! `Tensor<B>`: an n-dimensional array on one device of backend `B`.
//!
//! A tensor is a cheap handle: `Arc<B::Storage>` + [`Layout`] + [`DType`] + device. Cloning it
//! never copies data, and views (see `view.rs`) only make a new layout over the same storage.
//! Ops validate their inputs here (dtypes, devices, shapes, axes) and return typed errors; the
//! backend then runs the kernel.

mod conv;
mod display;
mod ops;
mod unary;
mod update;
mod view;

use std::sync::Arc;

use crate::backend::{Backend, HostBuffer, RandDist};
use crate::profile::{self, OpSpan};
use crate::{DType, Element, Error, Layout, Result, Shape};

pub use ops::Reduction;
pub use update::Updated;

pub struct Tensor<B: Backend> {
    storage: Arc<B::Storage>,
    layout: Layout,
    dtype: DType,
    device: B::Device,
}

impl<B: Backend> Clone for Tensor<B> {
    fn clone(&self) -> Self {
        Tensor {
            storage: self.storage.clone(),
            layout: self.layout.clone(),
            dtype: self.dtype,
            device: self.device.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor<{}>{{shape: {}, dtype: {}, device: {}}}",
            B::NAME,
            self.shape(),
            self.dtype,
            self.device
        )
    }
}

impl<B: Backend> Tensor<B> {
    // ---- raw parts -----------------------------------------------------------------------

    /// A tensor over `storage`, contiguous with `shape`.
    pub fn from_storage(storage: B::Storage, shape: impl Into<Shape>, dtype: DType) -> Self {
        let device = B::storage_device(&storage);
        Tensor {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape),
            dtype,
            device,
        }
    }

    /// A tensor over shared `storage` with an explicit layout (for backends and autograd).
    pub fn from_parts(storage: Arc<B::Storage>, layout: Layout, dtype: DType) -> Self {
        let device = B::storage_device(&storage);
        Tensor {
            storage,
            layout,
            dtype,
            device,
        }
    }

    pub fn storage(&self) -> &B::Storage {
        &self.storage
    }
    pub fn storage_arc(&self) -> &Arc<B::Storage> {
        &self.storage
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn shape(&self) -> &Shape {
        self.layout.shape()
    }
    pub fn dims(&self) -> &[usize] {
        self.layout.dims()
    }
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }
    pub fn elem_count(&self) -> usize {
        self.layout.elem_count()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &B::Device {
        &self.device
    }
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }
    /// True when both handles share one storage buffer.
    pub fn same_storage(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    pub(crate) fn with_layout(&self, layout: Layout) -> Self {
        Tensor {
            storage: self.storage.clone(),
            layout,
            dtype: self.dtype,
            device: self.device.clone(),
        }
    }

    /// A new contiguous tensor over freshly computed `storage` on this tensor's device.
    pub(crate) fn fresh(&self, storage: B::Storage, shape: impl Into<Shape>, dtype: DType) -> Self {
        Tensor {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape),
            dtype,
            device: self.device.clone(),
        }
    }

    // ---- profiling -----------------------------------------------------------------------

    /// A profiler span for `op` over `self` and `others`, or `None` (a load and a branch) when
    /// the profiler is off. `elementwise` marks ops a GPU backend may fuse.
    #[inline(always)]
    pub(crate) fn prof(
        &self,
        op: &'static str,
        others: &[&Self],
        elementwise: bool,
    ) -> Option<OpSpan> {
        if !profile::enabled() {
            return None;
        }
        Some(self.prof_open(op, others, elementwise))
    }

    #[cold]
    #[inline(never)]
    fn prof_open(&self, op: &'static str, others: &[&Self], elementwise: bool) -> OpSpan {
        let mut detail = profile::OpDetail::new(self.dtype);
        detail.push(self.dims());
        let mut bytes = self.byte_len();
        for o in others {
            detail.push(o.dims());
            bytes += o.byte_len();
        }
        profile::op(
            op,
            profile::device_label(&self.device),
            detail,
            bytes,
            elementwise,
        )
    }

    fn byte_len(&self) -> u64 {
        (self.elem_count() * self.dtype.size_in_bytes()) as u64
    }

    // ---- constructors --------------------------------------------------------------------

    /// A tensor filled with `value` (converted to `dtype`).
    pub fn full(
        shape: impl Into<Shape>,
        value: f64,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self> {
        let shape = shape.into();
        let _p = prof_new::<B>("full", device, dtype, &shape, 0);
        let s = B::fill(device, dtype, shape.elem_count_for("full")?, value)?;
        Ok(Self::from_storage(s, shape, dtype))
    }
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &B::Device) -> Result<Self> {
        Self::full(shape, 0.0, dtype, device)
    }
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &B::Device) -> Result<Self> {
        Self::full(shape, 1.0, dtype, device)
    }
    pub fn zeros_like(&self) -> Result<Self> {
        Self::zeros(self.shape().clone(), self.dtype, &self.device)
    }
    pub fn ones_like(&self) -> Result<Self> {
        Self::ones(self.shape().clone(), self.dtype, &self.device)
    }
    pub fn full_like(&self, value: f64) -> Result<Self> {
        Self::full(self.shape().clone(), value, self.dtype, &self.device)
    }

    /// Uploads a host buffer with `shape`.
    pub fn from_host(
        data: &HostBuffer,
        shape: impl Into<Shape>,
        device: &B::Device,
    ) -> Result<Self> {
        let shape = shape.into();
        check_len("from_vec", data.len(), &shape)?;
        let bytes = data.as_bytes().len() as u64;
        let _p = prof_new::<B>("from_host", device, data.dtype(), &shape, bytes);
        let s = B::from_host(device, data)?;
        Ok(Self::from_storage(s, shape, data.dtype()))
    }

    /// A tensor holding `data` with `shape` (row-major).
    pub fn from_vec<T: Element>(
        data: Vec<T>,
        shape: impl Into<Shape>,
        device: &B::Device,
    ) -> Result<Self> {
        Self::from_host(&T::into_host(data), shape, device)
    }
    /// A tensor holding a copy of `data` with `shape` (row-major). The slice is read once, with
    /// no intermediate host copy (a GPU backend stages it through its pinned ring); it may be
    /// reused as soon as the call returns.
    pub fn from_slice<T: Element>(
        data: &[T],
        shape: impl Into<Shape>,
        device: &B::Device,
    ) -> Result<Self> {
        let shape = shape.into();
        check_len("from_slice", data.len(), &shape)?;
        let bytes = std::mem::size_of_val(data) as u64;
        let _p = prof_new::<B>("from_slice", device, T::DTYPE, &shape, bytes);
        let src = crate::HostSource::borrowed(bytemuck::cast_slice(data));
        let s = B::from_host_source(device, T::DTYPE, src)?;
        Ok(Self::from_storage(s, shape, T::DTYPE))
    }
    /// A 0-d tensor.
    pub fn scalar<T: Element>(value: T, device: &B::Device) -> Result<Self> {
        Self::from_vec(vec![value], Shape::scalar(), device)
    }

    /// `start, start+step, ...` up to but excluding `end` (numpy's arange).
    pub fn arange(
        start: f64,
        end: f64,
        step: f64,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "arange",
                format!("bad range {start}..{end} step {step}"),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        let v: Vec<f64> = (0..n).map(|i| start + step * i as f64).collect();
        Self::from_host(&HostBuffer::from_f64(dtype, &v), n, device)
    }

    /// `n` evenly spaced values from `start` to `end` inclusive.
    pub fn linspace(
        start: f64,
        end: f64,
        n: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self> {
        let v: Vec<f64> = match n {
            0 => vec![],
            1 => vec![start],
            _ => {
                let step = (end - start) / (n - 1) as f64;
                (0..n)
                    .map(|i| {
                        if i == n - 1 {
                            end
                        } else {
                            start + step * i as f64
                        }
                    })
                    .collect()
            }
        };
        Self::from_host(&HostBuffer::from_f64(dtype, &v), n, device)
    }

    /// The `n x n` identity.
    pub fn eye(n: usize, dtype: DType, device: &B::Device) -> Result<Self> {
        let mut v = vec![0.0; n * n];
        for i in 0..n {
            v[i * n + i] = 1.0;
        }
        Self::from_host(&HostBuffer::from_f64(dtype, &v), [n, n], device)
    }

    /// The draw itself: element `i` is Philox's under `key` as [`crate::philox`] assigns its
    /// counter (the generator chose the key).
    pub(crate) fn random_keyed(
        shape: Shape,
        dist: RandDist,
        key: u64,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self> {
        if !dist.supports(dtype) {
            let expected = match dist {
                RandDist::Keep { .. } => "u8 for a keep mask",
                _ => "a float dtype",
            };
            return Err(Error::DTypeMismatch {
                op: "rand",
                expected: expected.into(),
                got: dtype,
            });
        }
        let _p = prof_new::<B>("rand", device, dtype, &shape, 0);
        let s = B::rand(device, dtype, shape.elem_count_for("rand")?, key, dist)?;
        Ok(Self::from_storage(s, shape, dtype))
    }

    // ---- reading back --------------------------------------------------------------------

    /// All elements in row-major order, as a host buffer (synchronizes with the device).
    pub fn to_host(&self) -> Result<HostBuffer> {
        let _p = self.prof("to_host", &[], false);
        B::to_host(&self.storage, &self.layout, self.dtype)
    }

    /// All elements in row-major order. `T` must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "to_vec",
                expected: T::DTYPE.to_string(),
                got: self.dtype,
            });
        }
        Ok(T::from_host(self.to_host()?).expect("dtype checked above"))
    }

    /// Reads all elements in row-major order into `out`, a buffer the caller owns (so a loop
    /// reuses its memory instead of faulting in fresh pages each time). Synchronizes with the
    /// device. `out` must hold exactly `elem_count` elements of this tensor's dtype; page-locked
    /// memory (a pinned tensor's) is filled by direct DMA.
    pub fn copy_to_slice<T: Element>(&self, out: &mut [T]) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "copy_to_slice",
                expected: T::DTYPE.to_string(),
                got: self.dtype,
            });
        }
        if out.len() != self.elem_count() {
            return Err(Error::invalid(
                "copy_to_slice",
                format!(
                    "the buffer holds {} elements, the tensor of shape {} has {}",
                    out.len(),
                    self.shape(),
                    self.elem_count()
                ),
            ));
        }
        let _p = self.prof("copy_to_slice", &[], false);
        B::to_host_bytes(
            &self.storage,
            &self.layout,
            self.dtype,
            bytemuck::cast_slice_mut(out),
        )
    }

    /// Computes the values now if the backend deferred them (see [`Backend::realize`]), without
    /// waiting for the device: for benchmarks that must not skip unread results, and to bound
    /// where deferred work runs. Reading values (`to_vec`, ...) does this on its own.
    pub fn realize(&self) -> Result<()> {
        if !B::is_deferred(&self.storage) {
            return Ok(()); // nothing to run (and nothing for the profiler to record)
        }
        let _p = self.prof("realize", &[], false);
        B::realize(&self.storage)
    }

    /// All elements widened to f64.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        Ok(self.to_host()?.to_f64_vec())
    }

    /// The single element of a tensor with one element (any rank), widened to f64.
    pub fn to_scalar(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(Error::invalid(
                "to_scalar",
                format!(
                    "tensor of shape {} has {} elements, not 1",
                    self.shape(),
                    self.elem_count()
                ),
            ));
        }
        Ok(self.to_f64_vec()?[0])
    }

    // ---- devices -------------------------------------------------------------------------

    /// This tensor on `device`: the same handle (no copy) when it is already there.
    pub fn to_device(&self, device: &B::Device) -> Result<Self> {
        if &self.device == device {
            return Ok(self.clone());
        }
        self.copy_to(device)
    }

    /// A new copy of this tensor on `device`, always (even the same device).
    pub fn copy_to(&self, device: &B::Device) -> Result<Self> {
        let _p = self.prof("copy_to", &[], false);
        let s = B::copy_to_device(&self.storage, &self.layout, self.dtype, device)?;
        Ok(Self::from_storage(s, self.shape().clone(), self.dtype))
    }

    /// Moves to another backend (`Tensor<Cpu>` to `Tensor<Cuda>` and back). A contiguous host
    /// tensor is handed over without an intermediate copy; from page-locked memory
    /// ([`Tensor::pin_memory`]) a GPU backend copies by DMA and returns at once (PyTorch's
    /// `non_blocking=True`): the copy is ordered before every later use on the GPU, and the
    /// source stays alive until it is done.
    pub fn to_backend<C: Backend>(&self, device: &C::Device) -> Result<Tensor<C>> {
        let _p = self.prof("to_backend", &[], false);
        let s = match B::host_source(&self.storage, &self.layout, self.dtype) {
            Some(src) => C::from_host_source(device, self.dtype, src)?,
            None => C::from_host_owned(device, self.to_host()?)?,
        };
        Ok(Tensor::from_storage(s, self.shape().clone(), self.dtype))
    }

    /// Overwrites this host tensor with the values of `src`, a tensor of any backend with the
    /// same shape and dtype (PyTorch's `cpu_tensor.copy_(gpu_tensor)`): a GPU tensor is read
    /// straight into this tensor's memory, by DMA when it is pinned. This tensor must be
    /// contiguous, the only handle on its storage, and in host memory.
    pub fn copy_from<C: Backend>(&mut self, src: &Tensor<C>) -> Result<()> {
        if src.dtype() != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "copy_from",
                expected: self.dtype.to_string(),
                got: src.dtype(),
            });
        }
        if src.dims() != self.dims() {
            return Err(Error::invalid(
                "copy_from",
                format!("shapes differ: {} into {}", src.shape(), self.shape()),
            ));
        }
        let storage = Arc::get_mut(&mut self.storage).ok_or_else(|| {
            Error::invalid(
                "copy_from",
                "the destination shares its storage with another tensor (copy it first)",
            )
        })?;
        let out = B::host_bytes_mut(storage, &self.layout, self.dtype).ok_or_else(|| {
            Error::invalid(
                "copy_from",
                format!(
                    "the destination must be a contiguous tensor in host memory (it is a {} \
                     tensor on {})",
                    B::NAME,
                    self.device
                ),
            )
        })?;
        let _p = src.prof("copy_from", &[], false);
        C::to_host_bytes(src.storage(), src.layout(), src.dtype(), out)
    }

    /// A copy of this tensor in page-locked host memory (PyTorch's `pin_memory()`): every CPU
    /// op reads it as usual, and copies between it and a GPU are direct, asynchronous DMA.
    /// Needs a host backend and a GPU backend that found a GPU; a typed error otherwise, and
    /// when the system cannot lock that much memory.
    pub fn pin_memory(&self) -> Result<Self> {
        if self.is_pinned() && self.layout.is_contiguous() && self.layout.offset() == 0 {
            return Ok(self.clone());
        }
        let _p = self.prof("pin_memory", &[], false);
        let s = B::pin_memory(&self.storage, &self.layout, self.dtype)?;
        Ok(Self::from_storage(s, self.shape().clone(), self.dtype))
    }

    /// Whether this tensor lies in page-locked host memory.
    pub fn is_pinned(&self) -> bool {
        B::is_pinned(&self.storage)
    }

    /// Errors unless `other` is on this tensor's device.
    pub fn check_same_device(&self, op: &'static str, other: &Self) -> Result<()> {
        if self.device != other.device {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device.to_string(),
                rhs: other.device.to_string(),
            });
        }
        Ok(())
    }

    /// Errors unless `factor` is one element of this tensor's dtype on its device: a factor
    /// that scales it (a gradient scale, `what` in the error), as `op` names it.
    pub fn check_factor(&self, op: &'static str, what: &str, factor: &Self) -> Result<()> {
        self.check_same_device(op, factor)?;
        if factor.dtype != self.dtype {
            return Err(Error::DTypeMismatch {
                op,
                expected: self.dtype.to_string(),
                got: factor.dtype,
            });
        }
        if factor.elem_count() != 1 {
            return Err(Error::invalid(
                op,
                format!("{what} must have one element, got shape {}", factor.shape()),
            ));
        }
        Ok(())
    }
}

/// A profiler span for a constructor (no input tensor): `None` when the profiler is off.
#[inline(always)]
fn prof_new<B: Backend>(
    op: &'static str,
    device: &B::Device,
    dtype: DType,
    shape: &Shape,
    bytes: u64,
) -> Option<OpSpan> {
    if !profile::enabled() {
        return None;
    }
    prof_new_open::<B>(op, device, dtype, shape, bytes)
}

#[cold]
#[inline(never)]
fn prof_new_open<B: Backend>(
    op: &'static str,
    device: &B::Device,
    dtype: DType,
    shape: &Shape,
    bytes: u64,
) -> Option<OpSpan> {
    let mut detail = profile::OpDetail::new(dtype);
    detail.push(shape.dims());
    Some(profile::op(
        op,
        profile::device_label(device),
        detail,
        bytes,
        false,
    ))
}

/// `len` values must fill `shape` exactly.
fn check_len(op: &'static str, len: usize, shape: &Shape) -> Result<()> {
    if len != shape.elem_count() {
        return Err(Error::invalid(
            op,
            format!(
                "{} values cannot fill shape {} ({} elements)",
                len,
                shape,
                shape.elem_count()
            ),
        ));
    }
    Ok(())
}
