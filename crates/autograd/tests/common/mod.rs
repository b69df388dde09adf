//! Helpers shared by the layer tests (attention, norms and embeddings, convolutional ops).
#![allow(dead_code)] // each test binary uses its own subset

use kiln_core::{Backend, DType, Generator, RandDist, Tensor};

/// Normal values with `mean` and `std` drawn from `seed`.
pub fn normal_with<B: Backend>(
    dims: &[usize],
    seed: u64,
    (mean, std): (f64, f64),
    dtype: DType,
    dev: &B::Device,
) -> Tensor<B> {
    Generator::new(seed)
        .sample::<B>(dims.to_vec(), RandDist::Normal { mean, std }, dtype, dev)
        .unwrap()
}

/// Normal values (mean 0.5, std 1.5: away from zero and of both signs) drawn from `seed`.
pub fn normal<B: Backend>(dims: &[usize], seed: u64, dtype: DType, dev: &B::Device) -> Tensor<B> {
    normal_with(dims, seed, (0.5, 1.5), dtype, dev)
}

pub fn f64s<B: Backend>(t: &Tensor<B>) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// Elementwise `|got - want| <= tol · (1 + |want|)`.
#[track_caller]
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (tol {tol})"
        );
    }
}
