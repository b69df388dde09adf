//! # kiln-core
//!
//! The part of kiln every other crate stands on:
//!
//! - [`DType`], [`Shape`] and [`Layout`]: element types, shapes, and strided layouts whose views
//!   (reshape, transpose, narrow, broadcast, ...) share storage;
//! - [`Error`] and [`Result`]: one typed error for the whole framework;
//! - the [`Backend`] trait: a small, enum-driven set of kernels that a device implements;
//! - [`Tensor<B>`](Tensor): the user-facing array, generic over its backend;
//! - [`philox`]: the counter-based generator every backend implements bit for bit, and
//!   [`Generator`]: seedable random tensors from it (`manual_seed` for the default one);
//! - [`profile`]: the profiler (`KILN_PROFILE=1`), per-op tables and Chrome traces;
//! - [`reference`](mod@reference): a plain-loop f64 backend, obviously correct and slow,
//!   against which the conformance suite (`testing`, behind the feature `testing`) checks every
//!   real backend.
//!
//! Code written against `B: Backend` runs unchanged on the CPU and on NVIDIA GPUs:
//!
//! ```
//! use kiln_core::reference::{RefDevice, Reference};
//! use kiln_core::{Backend, DType, Tensor};
//!
//! fn affine<B: Backend>(dev: &B::Device) -> kiln_core::Result<Tensor<B>> {
//!     let x = Tensor::<B>::arange(0.0, 6.0, 1.0, DType::F32, dev)?.reshape([2, 3])?;
//!     let w = Tensor::<B>::ones([3, 4], DType::F32, dev)?;
//!     x.matmul(&w)?.add_scalar(1.0)
//! }
//!
//! // Here on the f64 reference backend; `affine::<Cpu>` or `affine::<Cuda>` elsewhere.
//! let y = affine::<Reference>(&RefDevice(0))?;
//! assert_eq!(y.to_f64_vec()?, [4.0, 4.0, 4.0, 4.0, 13.0, 13.0, 13.0, 13.0]);
//! # Ok::<(), kiln_core::Error>(())
//! ```

mod attention_layout;
pub mod backend;
mod clock;
mod device;
mod dims;
mod dtype;
pub mod env;
pub mod epilogue;
pub mod epilogue_composed;
mod error;
pub mod expr;
pub mod fasthash;
pub mod fsutil;
pub mod halfround;
pub mod host;
mod ir;
mod layout;
pub mod op;
pub mod philox;
pub mod profile;
mod random;
pub mod reference;
mod sampling;
mod shape;
mod tensor;
#[cfg(feature = "testing")]
pub mod test_pinned;
#[cfg(any(test, feature = "testing"))]
pub mod test_profile;
#[cfg(feature = "testing")]
pub mod testing;
pub mod unscale;
mod update;

pub use backend::{
    Activation, AttentionGrads, AttentionOutput, AttentionOutputs, AttentionSpec, AttnMaskOperand,
    Backend, BinaryOp, CmpOp, Conv2dSpec, FOUND_NON_FINITE, GradFrom, MemoryStats, NormGrads,
    NormOutputs, NormSpec, RandDist, ReduceOp, UnaryOp, UnscaleSlot, UpdateRule, UpdateSlot,
    attention_output_layout, attention_packed_layouts,
};
pub use device::{DeviceKind, DeviceSpec};
pub use dims::Shape;
pub use dtype::{DType, UnknownDType};
pub use error::{DistErrorKind, Error, ExprErrorKind, Result};
/// The 16-bit float element types of [`DType::F16`] and [`DType::BF16`] (the `half` crate's).
pub use half::{bf16, f16};
pub use host::{Element, HostBuffer, HostRows, HostSource, PinnedAllocator, PinnedBlock};
pub use layout::{Layout, StridedOffsets};
pub use op::{
    BinaryFn, BinaryVisitor, CmpFn, CmpVisitor, CompositeOp, Real, Side, UnaryFn, UnaryVisitor, Vjp,
};
pub use random::{Generator, default_generator, manual_seed};
pub use sampling::sample_logits;
pub use shape::normalize_axis;
pub use tensor::{Reduction, Tensor, Updated};
