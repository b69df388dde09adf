//! # kiln-nn
//!
//! Modules (Linear, Conv2d, activations, Sequential), losses, initializers and safetensors
//! save/load. Not built yet; see the nn/optim/data issue.
