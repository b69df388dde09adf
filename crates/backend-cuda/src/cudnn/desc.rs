//! cuDNN descriptors for one convolution geometry (a [`Plan`]), its cache key, and the mapping
//! of kiln's dtypes and TF32 switch onto cuDNN's data, compute and math types.
//!
//! Descriptors are plain host objects; a plan builds its four once per geometry and memory
//! format (NCHW, and NHWC for tensor-core math, `nhwc.rs`) and keeps them (with the algorithms
//! measured for it, `algo.rs`) for the life of the process, so a steady training step makes no
//! descriptor calls.

use cudarc::cudnn::sys;
use kiln_core::{Conv2dSpec, DType, Error, Result};

use super::status;

/// What determines a convolution's descriptors and its measured algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    /// `[n, c, h, w]`, packed NCHW.
    pub x: [usize; 4],
    /// `[oc, c/groups, kh, kw]`, packed.
    pub w: [usize; 4],
    /// `[n, oc, oh, ow]`, packed NCHW.
    pub y: [usize; 4],
    pub spec: Conv2dSpec,
    pub dtype: DType,
    /// The math type asked for (TF32 on or off for f32).
    pub math: sys::cudnnMathType_t,
}

/// cuDNN's storage type, compute type and requested math type for `dtype`, or `None` for a
/// dtype cuDNN does not convolve. 16-bit floats compute in f32 on tensor cores (as kiln's
/// GEMMs do); f32 is full FMA math unless TF32 is allowed (`blas.rs`'s switch), so that f32
/// results match the CPU's.
pub(super) fn types(
    dtype: DType,
    tf32: bool,
) -> Option<(
    sys::cudnnDataType_t,
    sys::cudnnDataType_t,
    sys::cudnnMathType_t,
)> {
    use sys::cudnnDataType_t::*;
    use sys::cudnnMathType_t::*;
    Some(match dtype {
        DType::F32 if tf32 => (CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, CUDNN_DEFAULT_MATH),
        DType::F32 => (CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, CUDNN_FMA_MATH),
        DType::F64 => (CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE, CUDNN_DEFAULT_MATH),
        DType::F16 => (CUDNN_DATA_HALF, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH),
        DType::BF16 => (CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH),
        _ => return None,
    })
}

/// `v` as cuDNN's `int`.
fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid("conv2d", format!("{v} exceeds cuDNN's int")))
}

/// The four descriptors of one geometry, destroyed on drop.
pub(super) struct Plan {
    pub x: sys::cudnnTensorDescriptor_t,
    pub w: sys::cudnnFilterDescriptor_t,
    pub y: sys::cudnnTensorDescriptor_t,
    pub conv: sys::cudnnConvolutionDescriptor_t,
}

// SAFETY: descriptors are host objects with no thread affinity; a plan is only used under its
// device's cuDNN lock (`mod.rs`).
unsafe impl Send for Plan {}

impl Plan {
    /// The descriptors of `key` (packed tensors and filter in `format`, NCHW or NHWC, the
    /// filter's NHWC being KRSC; cross-correlation with the key's padding, stride, dilation
    /// and group count, its math type). The dimensions are given in NCHW order either way.
    pub fn new(key: &Key, format: sys::cudnnTensorFormat_t) -> Result<Plan> {
        const OP: &str = "conv2d";
        let (data, compute, math) =
            types(key.dtype, key.math != sys::cudnnMathType_t::CUDNN_FMA_MATH).ok_or_else(
                || Error::DTypeMismatch {
                    op: OP,
                    expected: "f32, f64, f16 or bf16".into(),
                    got: key.dtype,
                },
            )?;
        let mut plan = Plan {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        let d4 = |d: [usize; 4]| -> Result<[i32; 4]> {
            Ok([int(d[0])?, int(d[1])?, int(d[2])?, int(d[3])?])
        };
        let (x, w, y) = (d4(key.x)?, d4(key.w)?, d4(key.y)?);
        let s = &key.spec;
        let (pad, stride, dil) = (
            [int(s.padding[0])?, int(s.padding[1])?],
            [int(s.stride[0])?, int(s.stride[1])?],
            [int(s.dilation[0])?, int(s.dilation[1])?],
        );
        // SAFETY: valid out-pointers; each descriptor is created before it is set, and one
        // that was created is destroyed by `Drop` even if a later call fails.
        unsafe {
            status(sys::cudnnCreateTensorDescriptor(&mut plan.x), OP)?;
            status(sys::cudnnCreateTensorDescriptor(&mut plan.y), OP)?;
            status(sys::cudnnCreateFilterDescriptor(&mut plan.w), OP)?;
            status(sys::cudnnCreateConvolutionDescriptor(&mut plan.conv), OP)?;
            status(
                sys::cudnnSetTensor4dDescriptor(plan.x, format, data, x[0], x[1], x[2], x[3]),
                OP,
            )?;
            status(
                sys::cudnnSetTensor4dDescriptor(plan.y, format, data, y[0], y[1], y[2], y[3]),
                OP,
            )?;
            status(
                sys::cudnnSetFilter4dDescriptor(plan.w, data, format, w[0], w[1], w[2], w[3]),
                OP,
            )?;
            status(
                sys::cudnnSetConvolution2dDescriptor(
                    plan.conv,
                    pad[0],
                    pad[1],
                    stride[0],
                    stride[1],
                    dil[0],
                    dil[1],
                    sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    compute,
                ),
                OP,
            )?;
            status(
                sys::cudnnSetConvolutionGroupCount(plan.conv, int(s.groups)?),
                OP,
            )?;
            status(sys::cudnnSetConvolutionMathType(plan.conv, math), OP)?;
        }
        Ok(plan)
    }

    /// Sets the convolution's math type (an algorithm is measured and run with its own).
    pub fn set_math(&self, math: sys::cudnnMathType_t, op: &'static str) -> Result<()> {
        // SAFETY: a live descriptor, used under the device's cuDNN lock.
        status(
            unsafe { sys::cudnnSetConvolutionMathType(self.conv, math) },
            op,
        )
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by `Plan::new` and is destroyed once;
        // errors on destruction are ignored (nothing can be done about them in a drop).
        unsafe {
            if !self.x.is_null() {
                sys::cudnnDestroyTensorDescriptor(self.x);
            }
            if !self.y.is_null() {
                sys::cudnnDestroyTensorDescriptor(self.y);
            }
            if !self.w.is_null() {
                sys::cudnnDestroyFilterDescriptor(self.w);
            }
            if !self.conv.is_null() {
                sys::cudnnDestroyConvolutionDescriptor(self.conv);
            }
        }
    }
}
