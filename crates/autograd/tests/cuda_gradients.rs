//! The generic gradient suite on the GPU (`cargo xtask test-gpu` carries this binary to the GPU
//! machine), and the cross-device copy checks between two GPUs when there are two.
//!
//! Without a GPU each test prints `skipped: no CUDA device (<reason>)` and returns.

use kiln_autograd::CheckOptions;
use kiln_autograd::testing::{
    SuiteConfig, run_copy_suite, run_gradient_suite, run_gradient_suite_with,
};
use kiln_backend_cuda::{Cuda, CudaDevice, try_gpu, unavailable_reason};

fn gpu(i: usize) -> Option<CudaDevice> {
    let d = try_gpu(i);
    if d.is_none() {
        println!(
            "skipped: no CUDA device {i} ({})",
            unavailable_reason().unwrap_or_else(|| format!("cuda:{i} is not present"))
        );
    }
    d
}

#[test]
fn gradient_suite_on_cuda() {
    let Some(dev) = gpu(0) else { return };
    run_gradient_suite::<Cuda>(&dev);
}

#[test]
fn gradient_suite_on_cuda_in_f32() {
    let Some(dev) = gpu(0) else { return };
    let cfg = SuiteConfig {
        cases: 8,
        check: CheckOptions::f32(),
        filter: None,
    };
    run_gradient_suite_with::<Cuda>(&dev, &cfg);
}

#[test]
fn gradients_cross_two_gpus() {
    let Some(a) = gpu(0) else { return };
    let Some(b) = gpu(1) else { return };
    run_copy_suite::<Cuda>(&a, &b);
}
