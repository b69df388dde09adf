//! Every differentiable op through `check_backward`, on the f64 reference backend (and on the
//! CPU backend in `cpu_gradients.rs`): the generic suite in `kiln_autograd::testing`.

use kiln_core::reference::{RefDevice, Reference};

#[test]
fn gradient_suite_on_reference() {
    kiln_autograd::testing::run_gradient_suite::<Reference>(&RefDevice(0));
}

#[test]
fn gradients_cross_reference_devices() {
    kiln_autograd::testing::run_copy_suite::<Reference>(&RefDevice(0), &RefDevice(1));
}
