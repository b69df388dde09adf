//! With the fused-program budget spent, pending chains still compute the right values, op by
//! op on the single-op kernels. Its own test binary: the budget is process-wide.
//!
//! Without a GPU the test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cuda::thread_launches;
use kiln_backend_cuda::{Cuda, fused_program_stats, gpu_or_skip, set_fusion_program_budget};
use kiln_core::{DType, Tensor};

#[test]
fn chains_past_the_program_budget_run_op_by_op() {
    let Some(dev) = gpu_or_skip(0) else { return };
    set_fusion_program_budget(0);
    let x = Tensor::<Cuda>::arange(0.0, 6.0, 1.0, DType::F32, &dev).unwrap();
    let r = x
        .mul_scalar(2.0)
        .unwrap()
        .add_scalar(1.0)
        .unwrap()
        .square()
        .unwrap();
    assert!(r.storage().is_pending());
    let before = thread_launches();
    let v = r.to_vec::<f32>().unwrap();
    assert_eq!(v, [1.0, 9.0, 25.0, 49.0, 81.0, 121.0]);
    // Three single-op kernels (and the copy to the host), no program compiled.
    assert!(thread_launches() - before >= 3);
    assert_eq!(fused_program_stats().0, 0);
}
