//! `Tensor::unscale_check` by the composed default (`Backend::unscale_check`) on the reference
//! backend: planted inf/NaN, exact unscaled values, typed errors (`kiln_core::testing`'s
//! checks, which the CPU and CUDA backends run too); and `Tensor::sq_sum`, likewise.

#![cfg(feature = "testing")]

use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::{
    check_sq_sum, check_sq_sum_errors, check_unscale_check, check_unscale_check_errors,
};

#[test]
fn unscale_check_on_the_reference_backend() {
    check_unscale_check::<Reference>(&RefDevice::default(), 3000);
}

#[test]
fn unscale_check_errors_are_typed() {
    check_unscale_check_errors::<Reference>(&RefDevice::default());
}

#[test]
fn sq_sum_on_the_reference_backend() {
    check_sq_sum::<Reference>(&RefDevice::default(), 3000);
    check_sq_sum_errors::<Reference>(&RefDevice::default());
}
