//! [`RawKernel`]: a whole CUDA C source, launched with the user's grid and block.

use cudarc::driver::sys;
use kiln_core::{Error, Result};

use super::{KernelArg, UserKey, common_device, held_buffers, kernel};
use crate::device::{Func, state};
use crate::launch::Args;
use crate::types::CudaDevice;

const OP: &str = "RawKernel";

/// A grid or block extent: `n`, `(x, y)` or `(x, y, z)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim3(pub u32, pub u32, pub u32);

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3(x, 1, 1)
    }
}
impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Dim3(x, y, 1)
    }
}
impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3(x, y, z)
    }
}

/// A kernel from user source (CuPy's `RawKernel`, PyCUDA's `SourceModule`).
///
/// ```no_run
/// # use kiln_backend_cuda::{Cuda, RawKernel};
/// # use kiln_core::{DType, Generator, Tensor};
/// # fn main() -> kiln_core::Result<()> {
/// # let dev = kiln_backend_cuda::try_gpu(0).unwrap();
/// let k = RawKernel::new(
///     r#"extern "C" __global__ void multiply_them(float* dest, const float* a, const float* b) {
///         const int i = threadIdx.x;
///         dest[i] = a[i] * b[i];
///     }"#,
///     "multiply_them",
/// );
/// let a = Generator::new(1).uniform::<Cuda>([400], -1.0, 1.0, &dev)?;
/// let b = Generator::new(2).uniform::<Cuda>([400], -1.0, 1.0, &dev)?;
/// let dest = kiln_backend_cuda::empty([400], DType::F32, &dev)?;
/// k.launch(1u32, 400u32, 0, &[(&dest).into(), (&a).into(), (&b).into()])?;
/// # Ok(()) }
/// ```
///
/// The kernel must be `extern "C"` (so that its name is not mangled). Tensor arguments are
/// passed as the device address of their first element (pending work runs first); the
/// kernel indexes them itself, so pass contiguous tensors, and write only into tensors you
/// own (a fresh [`crate::empty`]: kiln's tensors are otherwise immutable, and a write is seen
/// by every tensor sharing that storage). Scalars are passed by value with their own type
/// (`i32` → `int`, `i64` → `long long`, `f32` → `float`, `f64` → `double`). The argument
/// count and sizes are checked against the compiled kernel's parameters.
#[derive(Clone, Debug)]
pub struct RawKernel {
    source: String,
    name: String,
    id: u128,
}

impl RawKernel {
    /// The kernel `name` of `source`; compiled (once per device) at the first launch.
    pub fn new(source: &str, name: &str) -> Self {
        let id = crate::nvrtc::fnv128(&[b"raw", source.as_bytes(), name.as_bytes()]);
        RawKernel {
            source: source.to_string(),
            name: name.to_string(),
            id,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Launches on the device of the tensor arguments (there must be one; see
    /// [`RawKernel::launch_on`]), on the calling thread's current stream.
    pub fn launch(
        &self,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem: u32,
        args: &[KernelArg],
    ) -> Result<()> {
        let tensors = args.iter().filter_map(|a| match a {
            KernelArg::Tensor(t) => Some(*t),
            _ => None,
        });
        let dev = common_device(OP, tensors)?.ok_or_else(|| {
            Error::invalid(
                OP,
                format!(
                    "kernel `{}`: no tensor argument to take the device from (use launch_on)",
                    self.name
                ),
            )
        })?;
        self.launch_on(&dev, grid, block, shared_mem, args)
    }

    /// Launches on `device` (every tensor argument must live there).
    pub fn launch_on(
        &self,
        device: &CudaDevice,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem: u32,
        args: &[KernelArg],
    ) -> Result<()> {
        let (grid, block) = (grid.into(), block.into());
        let tensors = args.iter().filter_map(|a| match a {
            KernelArg::Tensor(t) => Some(*t),
            _ => None,
        });
        if let Some(d) = common_device(OP, tensors)?
            && d != *device
        {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: device.to_string(),
                rhs: d.to_string(),
            });
        }
        if [grid.0, grid.1, grid.2, block.0, block.1, block.2].contains(&0) {
            return Err(Error::invalid(
                OP,
                format!(
                    "kernel `{}`: grid {grid:?} and block {block:?} must be at least 1 in \
                     every dimension",
                    self.name
                ),
            ));
        }
        let s = state(device)?;
        let key = UserKey {
            id: self.id,
            types: Vec::new(),
            slots: Vec::new(),
            wide: false,
            split: 0,
        };
        let f = kernel(s, OP, &self.name, &key, || self.source.clone())?;
        check_params(f, &self.name, args)?;
        let held = held_buffers(args)?;
        let mut p = Args::new();
        for (a, b) in args.iter().zip(&held) {
            match (a, b) {
                (KernelArg::Tensor(t), Some(b)) => {
                    // The kernel may write through the pointer: what was known of the
                    // contents (index checks) no longer holds.
                    b.contents_changed();
                    p.push(
                        b.device_ptr() + (t.layout().offset() * t.dtype().size_in_bytes()) as u64,
                    )
                }
                (KernelArg::I32(v), _) => p.push(*v),
                (KernelArg::I64(v), _) => p.push(*v),
                (KernelArg::F32(v), _) => p.push(*v),
                (KernelArg::F64(v), _) => p.push(*v),
                (KernelArg::Tensor(_), None) => unreachable!("held above"),
            };
        }
        let pp = p.ptrs();
        s.launch_3d(
            OP,
            f,
            [grid.0, grid.1, grid.2],
            [block.0, block.1, block.2],
            shared_mem,
            pp,
        )
    }
}

/// Checks `args` against the compiled kernel's parameter list (count, and the size of each:
/// 8 bytes for a tensor's pointer, `i64` and `f64`; 4 for `i32` and `f32`), through
/// `cuFuncGetParamInfo` where the driver has it (CUDA 12.4+; elsewhere nothing is checked).
fn check_params(f: Func, name: &str, args: &[KernelArg]) -> Result<()> {
    // SAFETY: only looks the symbol up in the already loaded driver library.
    let present = unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(b"cuFuncGetParamInfo\0")
            .is_ok()
    };
    if !present {
        return Ok(());
    }
    let mut sizes = Vec::new();
    loop {
        let (mut off, mut size) = (0usize, 0usize);
        // SAFETY: `f` is a loaded kernel; valid out-pointers; an index past the last parameter
        // returns an error, which ends the loop.
        let r = unsafe { sys::cuFuncGetParamInfo(f.0, sizes.len(), &mut off, &mut size) };
        if r != sys::CUresult::CUDA_SUCCESS || sizes.len() > 4096 {
            break;
        }
        sizes.push(size);
    }
    if sizes.len() != args.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "kernel `{name}` takes {} parameter(s), got {} argument(s)",
                sizes.len(),
                args.len()
            ),
        ));
    }
    for (k, (a, &want)) in args.iter().zip(&sizes).enumerate() {
        let got = match a {
            KernelArg::I32(_) | KernelArg::F32(_) => 4,
            _ => 8,
        };
        if got != want {
            return Err(Error::invalid(
                OP,
                format!(
                    "kernel `{name}`: parameter {k} is {want} bytes, got {} ({got} bytes)",
                    a.describe()
                ),
            ));
        }
    }
    Ok(())
}
