//! The whole conformance suite of kiln-core, against the f64 reference, on the CPU backend.

use kiln_backend_cpu::Cpu;

#[test]
fn conformance() {
    kiln_core::testing::run_conformance::<Cpu>(&Cpu::device(0));
}
