//! # kiln-backend-cuda
//!
//! The NVIDIA GPU backend: cudarc with dynamic loading, our own CUDA C kernels compiled by NVRTC,
//! cuBLAS for matrix products, and a cached stream-ordered memory pool. Not built yet; see the
//! CUDA backend issue.
