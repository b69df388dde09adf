//! The names every other module uses: the backend marker [`Cuda`] and the device handle
//! [`CudaDevice`].
//!
//! # Why a module of its own
//!
//! They are plain values that know nothing of the driver, so they sit at the bottom of the
//! crate: the runtime, the ops and the user kernels name them without importing `lib.rs`,
//! which only holds the [`kiln_core::Backend`] implementation that calls down into them. The
//! methods that reach a GPU (`CudaDevice::name` and friends) are implemented in `device/`.

use std::fmt;

/// The CUDA backend (a marker type: state lives per device).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cuda;

/// One NVIDIA GPU, by ordinal. Displays as `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CudaDevice {
    ordinal: usize,
}

impl CudaDevice {
    /// The device with this ordinal; does not check that it exists (see [`crate::try_gpu`]).
    pub fn new(ordinal: usize) -> Self {
        CudaDevice { ordinal }
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl fmt::Display for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}
