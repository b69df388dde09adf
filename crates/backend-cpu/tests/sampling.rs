//! `multinomial` and `sample_logits` draw the same samples on the CPU as on the f64 reference
//! backend for one seed (Philox is the same everywhere; the sampling is device ops only). The
//! distributions themselves are tested in kiln-core's `tests/sampling.rs`.

use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, Generator, Tensor, sample_logits};

fn draws<B: Backend>(dev: &B::Device) -> Vec<Vec<i64>> {
    let w: Vec<f64> = (0..40).map(|i| ((i * 7 % 11) as f64) * 0.1).collect();
    let p = Tensor::<B>::from_vec(w, [4, 10], dev).unwrap();
    let mut g = Generator::new(21);
    let mut out = Vec::new();
    for replacement in [true, false] {
        let x = g.multinomial(&p, 5, replacement).unwrap();
        out.push(x.to_vec::<i64>().unwrap());
    }
    let logits = p.log().unwrap().mul_scalar(3.0).unwrap();
    for top_k in [None, Some(3)] {
        let x = sample_logits(&logits, 0.8, top_k, &mut g).unwrap();
        out.push(x.to_vec::<i64>().unwrap());
    }
    out
}

#[test]
fn cpu_draws_the_reference_backends_samples() {
    assert_eq!(
        draws::<Cpu>(&Cpu::device(0)),
        draws::<Reference>(&RefDevice(0))
    );
}
