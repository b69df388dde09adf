//! # kiln-optim
//!
//! Optimizers (SGD, Adam, AdamW), schedulers and gradient clipping. Not built yet; see the
//! nn/optim/data issue.
