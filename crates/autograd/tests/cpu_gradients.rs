//! The generic gradient suite and the cross-device checks on the CPU backend (`cpu` and its
//! virtual second device `cpu:1`).

use kiln_autograd::testing::{run_copy_suite, run_gradient_suite};
use kiln_backend_cpu::Cpu;

#[test]
fn gradient_suite_on_cpu() {
    run_gradient_suite::<Cpu>(&Cpu::device(0));
}

#[test]
fn gradients_cross_cpu_devices() {
    run_copy_suite::<Cpu>(&Cpu::device(0), &Cpu::device(1));
}

/// The same suite in f32 with the documented looser tolerances: f32 is what models train in.
#[test]
fn gradient_suite_on_cpu_in_f32() {
    use kiln_autograd::CheckOptions;
    use kiln_autograd::testing::{SuiteConfig, run_gradient_suite_with};
    let cfg = SuiteConfig {
        cases: 8,
        check: CheckOptions::f32(),
        filter: None,
        threads: 1,
    };
    run_gradient_suite_with::<Cpu>(&Cpu::device(0), &cfg);
}
