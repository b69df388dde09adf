//! The conformance suite run on the reference backend itself: a sanity check that the suite's
//! generators, views and comparisons are consistent (every check must pass trivially).

#![cfg(feature = "testing")]

use kiln_core::reference::{RefDevice, Reference};

#[test]
fn reference_passes_its_own_suite() {
    kiln_core::testing::run_conformance::<Reference>(&RefDevice(0));
}

/// The two-backend path (used for CUDA against the CPU), here with the reference on two of its
/// devices: the subject's outputs must stay on the subject's device.
#[test]
fn compare_backends_across_reference_devices() {
    kiln_core::testing::compare_backends::<Reference, Reference>(&RefDevice(1), &RefDevice(0));
}

#[test]
fn single_groups_by_name() {
    let cfg = kiln_core::testing::Config::with_cases(16);
    kiln_core::testing::check_matmul::<Reference>(&RefDevice(0), &cfg);
    kiln_core::testing::run_groups_named::<Reference>(&RefDevice(1), &cfg, &["unary", "cast"]);
}
