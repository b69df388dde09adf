//! What the GPU bench binaries share: the `BENCH` line `bench/compare.py` reads, and the
//! event-timed median of a call. (`mod common;` in each bench; not a bench target itself.)

#![allow(dead_code)] // each bench uses what it needs

use kiln_backend_cuda::{Cuda, CudaDevice, raw};
use kiln_core::{Backend, Result};

/// Prints `BENCH kiln <name> <value> <unit>`.
pub fn report(name: &str, value: f64, unit: &str) {
    println!("BENCH kiln {name} {value:.4} {unit}");
}

/// Median over `reps` of the event-timed milliseconds of `iters` calls of `f`, per call (after
/// three warm-up calls).
pub fn time(dev: &CudaDevice, reps: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> f64 {
    for _ in 0..3 {
        f().unwrap();
    }
    Cuda::synchronize(dev).unwrap();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            raw::time_ms(dev, || {
                for _ in 0..iters {
                    f()?;
                }
                Ok(())
            })
            .unwrap() as f64
                / iters as f64
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}
