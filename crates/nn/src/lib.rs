//! # kiln-nn
//!
//! Modules (Linear, Conv2d, activations, Sequential), losses, initializers and safetensors
//! save/load.
pub mod init;
pub mod serialize;

pub use init::{Init, derive_seed};
pub use serialize::{load_safetensors, save_safetensors};
