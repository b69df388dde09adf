//! # kiln-backend-cpu
//!
//! The CPU backend (to be built by the foundation issue).
