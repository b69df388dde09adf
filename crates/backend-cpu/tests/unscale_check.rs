//! `Tensor::unscale_check` on the CPU (the composed default of `Backend::unscale_check`, one
//! fused expression pass per gradient): kiln-core's planted inf/NaN checks and typed errors;
//! and `Tensor::sq_sum` (the composed default of `Backend::sq_sum`).

use kiln_backend_cpu::Cpu;
use kiln_core::testing::{
    check_sq_sum, check_sq_sum_errors, check_unscale_check, check_unscale_check_errors,
};

#[test]
fn unscale_check_on_the_cpu() {
    // Large enough for the evaluator's parallel split of one gradient.
    check_unscale_check::<Cpu>(&Cpu::device(0), 300_001);
}

#[test]
fn unscale_check_errors_are_typed() {
    check_unscale_check_errors::<Cpu>(&Cpu::device(0));
}

#[test]
fn sq_sum_on_the_cpu() {
    check_sq_sum::<Cpu>(&Cpu::device(0), 300_001);
    check_sq_sum_errors::<Cpu>(&Cpu::device(0));
}
