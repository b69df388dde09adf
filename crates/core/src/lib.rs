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
//! ```ignore
//! fn affine<B: Backend>(dev: &B::Device) -> kiln_core::Result<Tensor<B>> {
//!     let x = Tensor::<B>::arange(0.0, 6.0, 1.0, DType::F32, dev)?.reshape([2, 3])?;
//!     let w = Tensor::<B>::ones([3, 4], DType::F32, dev)?;
//!     (&x.matmul(&w)? + 1.0)
//! }
//! ```

pub mod backend;
mod clock;
mod dims;
mod dtype;
mod error;
pub mod expr;
pub mod fasthash;
pub mod fsutil;
pub mod host;
mod ir;
mod layout;
mod op;
pub mod philox;
pub mod profile;
mod random;
pub mod reference;
mod shape;
mod tensor;
#[cfg(feature = "testing")]
pub mod test_pinned;
#[cfg(any(test, feature = "testing"))]
pub mod test_profile;
#[cfg(feature = "testing")]
pub mod testing;
mod update;

pub use backend::{
    Backend, BinaryOp, CmpOp, GradFrom, HostBuffer, MemoryStats, RandDist, ReduceOp, UnaryOp,
    UpdateRule, UpdateSlot,
};
pub use dtype::{DType, Element};
pub use error::{DistErrorKind, Error, ExprErrorKind, Result};
pub use host::{HostRows, HostSource, PinnedAllocator, PinnedBlock};
pub use layout::{Layout, StridedOffsets};
pub use random::{Generator, default_generator, manual_seed};
pub use shape::{Shape, normalize_axis};
pub use tensor::{Reduction, Tensor, Updated};
