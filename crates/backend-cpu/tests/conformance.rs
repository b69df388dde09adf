//! The whole conformance suite of kiln-core, against the f64 reference, on the CPU backend.

use kiln_backend_cpu::Cpu;

#[test]
fn conformance() {
    kiln_core::testing::run_conformance::<Cpu>(&Cpu::device(0));
}

/// The same suite as the GPU runs it: groups and shares of the slowest groups on four threads.
#[test]
fn conformance_in_shares_on_threads() {
    kiln_core::testing::run_parallel::<Cpu, Cpu>(&Cpu::device(0), None, 4);
}
