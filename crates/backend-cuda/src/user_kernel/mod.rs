//! User-written CUDA kernels, CuPy-style: [`ElementwiseKernel`], [`ReductionKernel`] and
//! [`RawKernel`].
//!
//! # Why
//!
//! kiln's ops cover what a framework needs; a user who needs one more kernel should write a
//! few lines of CUDA C, not a backend. CuPy's API is the model (Chainer's
//! `cuda.elementwise`/`reduce`, PyCUDA's `SourceModule`), in Rust's terms:
//!
//! - [`ElementwiseKernel`]: typed parameter lists with type placeholders (`"T x, T y"`), a
//!   CUDA C body run once per element (`"z = (x - y) * (x - y)"`), broadcasting over its
//!   tensor arguments, scalar parameters, outputs allocated or given.
//! - [`ReductionKernel`]: a map expression per element, a reduce expression over `a` and `b`,
//!   an identity and a post-map statement, over chosen axes (keepdims or not).
//! - [`RawKernel`]: a whole `extern "C" __global__` source; the user picks grid, block and
//!   shared memory; arguments are tensors (device pointers) and scalars.
//!
//! # How
//!
//! Each call resolves the placeholders from the dtypes of its tensor arguments
//! (`params.rs`), classifies every tensor's layout as contiguous, broadcast (one element) or
//! strided, and looks up the kernel generated for that signature (`source.rs`, pure) in the
//! device's memo of generated kernels — compiling it with NVRTC (through the disk cache) the
//! first time. So each kernel is compiled once per device and dtype signature; the memo is
//! dropped by [`crate::clear_kernel_cache`]. Inputs are computed first (pending fused work
//! runs), the launch goes to the calling thread's current stream ([`crate::Stream::scope`]),
//! and every buffer is marked as used there for the allocator.
//!
//! Every mistake is a typed error, and the device stays usable: a source NVRTC rejects
//! ([`kiln_core::Error::Backend`] with NVRTC's log), a placeholder no tensor determines, the
//! wrong number of arguments, shapes that do not broadcast, a tensor of the wrong dtype,
//! tensors on different devices.

mod elementwise;
mod params;
mod raw;
mod reduction;
mod source;

use std::ffi::CString;

use kiln_core::{DType, Error, Layout, Result, Shape, Tensor};

use crate::codegen::Access;
use crate::device::{DeviceState, Func};
use crate::launch::{Dims, MAX_DIMS, Strides, collapse_raw};
use crate::types::Cuda;
use crate::types::CudaDevice;

pub use elementwise::ElementwiseKernel;
pub use raw::{Dim3, RawKernel};
pub use reduction::ReductionKernel;

pub(crate) use source::sample_sources;

/// An uninitialized contiguous tensor (`torch.empty`, `cupy.empty`): the output of a
/// [`RawKernel`] that writes every element.
pub fn empty(shape: impl Into<Shape>, dtype: DType, device: &CudaDevice) -> Result<Tensor<Cuda>> {
    let shape = shape.into();
    let bytes = shape.elem_count_for("empty")? * dtype.size_in_bytes();
    let s = crate::storage::CudaStorage::alloc(device, bytes)?;
    Ok(Tensor::from_storage(s, shape, dtype))
}

/// One argument of a user kernel: a tensor (passed by its device memory) or a scalar.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    Tensor(&'a Tensor<Cuda>),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
}

impl<'a> From<&'a Tensor<Cuda>> for KernelArg<'a> {
    fn from(t: &'a Tensor<Cuda>) -> Self {
        KernelArg::Tensor(t)
    }
}
impl From<i32> for KernelArg<'_> {
    fn from(v: i32) -> Self {
        KernelArg::I32(v)
    }
}
impl From<i64> for KernelArg<'_> {
    fn from(v: i64) -> Self {
        KernelArg::I64(v)
    }
}
impl From<f32> for KernelArg<'_> {
    fn from(v: f32) -> Self {
        KernelArg::F32(v)
    }
}
impl From<f64> for KernelArg<'_> {
    fn from(v: f64) -> Self {
        KernelArg::F64(v)
    }
}

impl KernelArg<'_> {
    fn describe(&self) -> String {
        match self {
            KernelArg::Tensor(t) => format!("a {} tensor of shape {}", t.dtype(), t.shape()),
            KernelArg::I32(v) => format!("the i32 scalar {v}"),
            KernelArg::I64(v) => format!("the i64 scalar {v}"),
            KernelArg::F32(v) => format!("the f32 scalar {v}"),
            KernelArg::F64(v) => format!("the f64 scalar {v}"),
        }
    }
}

/// The device every tensor of a call lives on (`None` when there is no tensor); a
/// [`Error::DeviceMismatch`] naming both devices when they differ.
fn common_device<'a>(
    op: &'static str,
    tensors: impl Iterator<Item = &'a Tensor<Cuda>>,
) -> Result<Option<CudaDevice>> {
    let mut dev: Option<CudaDevice> = None;
    for t in tensors {
        match dev {
            None => dev = Some(*t.device()),
            Some(d) if d != *t.device() => {
                return Err(Error::DeviceMismatch {
                    op,
                    lhs: d.to_string(),
                    rhs: t.device().to_string(),
                });
            }
            Some(_) => {}
        }
    }
    Ok(dev)
}

/// The memo key of a user kernel on a device: the kernel's definition (a hash of its
/// parameters and snippets) and one call's signature.
#[derive(Clone, PartialEq, Eq, Hash)]
struct UserKey {
    id: u128,
    types: Vec<params::CType>,
    slots: Vec<source::Slot>,
    wide: bool,
    /// A reduction split over blocks: 0 (not), 1, or 4 (16-byte loads; `source::reduction`).
    split: u32,
}

/// The memoized kernel of `key` on `dev`, compiled from `source()` on a miss. A source NVRTC
/// rejects is an [`Error::Backend`] naming `op` and the kernel and carrying NVRTC's log.
fn kernel(
    dev: &DeviceState,
    op: &'static str,
    name: &str,
    key: &UserKey,
    source: impl FnOnce() -> String,
) -> Result<Func> {
    let f = dev.generated_func(key, usize::MAX, || {
        let cname = CString::new(name)
            .map_err(|_| Error::invalid(op, format!("kernel name `{name}` contains a NUL")))?;
        let bin = crate::nvrtc::load_or_compile_source(
            crate::nvrtc::Flavor::User,
            &format!("{name}.cu"),
            &source(),
            dev.arch(),
        )
        .map_err(|log| {
            Error::backend(
                op,
                format!(
                    "kernel `{name}` does not compile (NVRTC, sm_{}):\n{log}",
                    dev.arch()
                ),
            )
        })?;
        Ok((bin, cname))
    })?;
    Ok(f.expect("user kernels have no budget"))
}

/// How a kernel addresses a tensor read or written through `dims`/`strides`.
fn access(dims: &[usize], strides: &[usize]) -> Access {
    if Layout::strides_read_one(dims, strides) {
        Access::Bcast
    } else if Layout::strides_row_major(dims, strides) {
        Access::Contig
    } else {
        Access::Strided
    }
}

/// Merges `dims` with the strides of the strided operands; errors past [`MAX_DIMS`].
fn merged(op: &'static str, dims: &[usize], strided: &[&[usize]]) -> Result<(Dims, Vec<Strides>)> {
    let (d, ss) = collapse_raw(dims, strided);
    if d.len() > MAX_DIMS {
        return Err(Error::invalid(
            op,
            format!(
                "user kernels take up to {MAX_DIMS} non-mergeable dimensions, got {} (shape {dims:?})",
                d.len()
            ),
        ));
    }
    let mut dims = Dims {
        rank: d.len() as i32,
        ..Default::default()
    };
    for (o, &x) in dims.d.iter_mut().zip(&d) {
        *o = x as u64;
    }
    let strides = ss
        .iter()
        .map(|s| {
            let mut out = Strides::default();
            for (o, &x) in out.s.iter_mut().zip(s) {
                *o = x as u64;
            }
            out
        })
        .collect();
    Ok((dims, strides))
}

/// Pushes scalar `a` converted to `c` (the parameter's type) onto a launch's arguments.
/// The computed buffer of each tensor argument (pending work runs first; each is marked used
/// on the current stream), `None` for scalars: held until the launch is enqueued.
fn held_buffers(args: &[KernelArg]) -> Result<Vec<Option<std::sync::Arc<crate::memory::Buffer>>>> {
    args.iter()
        .map(|a| match a {
            KernelArg::Tensor(t) => t.storage().buffer().map(Some),
            _ => Ok(None),
        })
        .collect()
}

fn push_scalar(args: &mut crate::launch::Args, a: &KernelArg, c: params::CType) {
    let (f, i) = match *a {
        KernelArg::I32(v) => (v as f64, v as i64),
        KernelArg::I64(v) => (v as f64, v),
        KernelArg::F32(v) => (v as f64, v as i64),
        KernelArg::F64(v) => (v, v as i64),
        KernelArg::Tensor(_) => unreachable!("scalars only"),
    };
    let int = matches!(a, KernelArg::I32(_) | KernelArg::I64(_));
    match c {
        params::CType::F32 => args.push(f as f32),
        params::CType::F64 => args.push(f),
        params::CType::I64 => args.push(if int { i } else { f as i64 }),
        params::CType::I32 => args.push(if int { i as i32 } else { f as i32 }),
        params::CType::U8 => args.push(if int { i as u8 } else { f as u8 }),
    };
}

/// A tensor given as an output, taken out of its handle for an in-place write: its storage is
/// put back when this is dropped, whatever happened meanwhile.
struct Taken<'a> {
    slot: &'a mut Tensor<Cuda>,
    storage: Option<std::sync::Arc<crate::storage::CudaStorage>>,
    layout: Layout,
    dtype: DType,
}

impl<'a> Taken<'a> {
    /// Takes `t`'s storage; an error (and `t` untouched) when another tensor shares it, since
    /// writing into it would change that tensor too.
    fn new(op: &'static str, name: &str, t: &'a mut Tensor<Cuda>) -> Result<Self> {
        let layout = t.layout().clone();
        let dtype = t.dtype();
        let storage = t.storage_arc().clone();
        if std::sync::Arc::strong_count(&storage) > 2 {
            return Err(Error::invalid(
                op,
                format!(
                    "output `{name}` shares its storage with another tensor (writing into it \
                     would change that one too): pass a tensor of its own, or let the kernel \
                     allocate the output"
                ),
            ));
        }
        if layout
            .dims()
            .iter()
            .zip(layout.strides())
            .any(|(&d, &s)| d > 1 && s == 0)
        {
            return Err(Error::invalid(
                op,
                format!("output `{name}` is a broadcast view (several elements share memory)"),
            ));
        }
        let empty = crate::storage::CudaStorage::alloc(t.device(), 0)?;
        *t = Tensor::from_storage(empty, Shape::new([0]), dtype);
        Ok(Taken {
            slot: t,
            storage: Some(storage),
            layout,
            dtype,
        })
    }

    /// The device address of the first element, for writing (after pending work that reads
    /// the old contents got a copy of its own).
    fn write_ptr(&mut self) -> Result<u64> {
        let st = std::sync::Arc::get_mut(self.storage.as_mut().expect("held until drop"))
            .ok_or_else(|| Error::invalid("user kernel", "output storage is shared"))?;
        let b = st.buffer_mut()?;
        Ok(b.device_ptr() + (self.layout.offset() * self.dtype.size_in_bytes()) as u64)
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.storage.take() {
            *self.slot = Tensor::from_parts(s, self.layout.clone(), self.dtype);
        }
    }
}
