//! The multi-tensor optimizer kernel (generated from `UpdateRule::program`) against the composed default that the
//! CPU backend runs: SGD (momentum, Nesterov, first step), Adam and AdamW, f32 and f64, with
//! more parameters than one launch takes (so the chunking runs) and sizes 0, 1 and odd.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType, Generator, RandDist, Tensor, UpdateRule};

/// 30 parameters of assorted sizes (one launch takes 24).
const SIZES: [usize; 30] = [
    7, 0, 1, 1000, 33, 4096, 5, 100, 17, 3, 250, 1, 64, 65, 129, 999, 2, 8, 31, 1024, 77, 6, 300,
    4, 11, 13, 19, 23, 29, 100_003,
];

fn tensors<B: Backend>(dev: &B::Device, dtype: DType, seed: u64, positive: bool) -> Vec<Tensor<B>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let (lo, hi) = if positive { (0.0, 1.0) } else { (-1.0, 1.0) };
            Generator::new(seed * 1000 + i as u64)
                .sample::<B>([n], RandDist::Uniform { low: lo, high: hi }, dtype, dev)
                .unwrap()
        })
        .collect()
}

fn step<B: Backend>(rule: &UpdateRule, dev: &B::Device, dtype: DType) -> Vec<Vec<f64>> {
    let p = tensors::<B>(dev, dtype, 1, false);
    let g = tensors::<B>(dev, dtype, 2, false);
    let s0 = tensors::<B>(dev, dtype, 3, false);
    let s1 = tensors::<B>(dev, dtype, 4, true);
    let states: Vec<Vec<Tensor<B>>> = (0..p.len())
        .map(|i| {
            [&s0[i], &s1[i]][..rule.state_count()]
                .iter()
                .map(|t| (*t).clone())
                .collect()
        })
        .collect();
    let out = Tensor::<B>::fused_update(rule, &p, &g, &states).unwrap();
    out.iter()
        .flat_map(|(p, st)| std::iter::once(p).chain(st.iter()))
        .map(|t| t.to_f64_vec().unwrap())
        .collect()
}

fn rules() -> Vec<UpdateRule> {
    let sgd = |momentum, nesterov, first_step, weight_decay| UpdateRule::Sgd {
        lr: 0.05,
        momentum,
        dampening: 0.0,
        nesterov,
        weight_decay,
        first_step,
    };
    let adam = |decoupled| UpdateRule::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled,
        bias_correction1: 1.0 - 0.9f64.powi(3),
        bias_correction2: 1.0 - 0.999f64.powi(3),
    };
    vec![
        sgd(0.0, false, false, 0.0),
        sgd(0.9, false, true, 1e-4),
        sgd(0.9, false, false, 0.0),
        sgd(0.9, true, false, 1e-4),
        adam(false),
        adam(true),
    ]
}

#[test]
fn fused_update_matches_the_composed_default() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 2e-6 } else { 1e-13 };
        for rule in rules() {
            let got = step::<Cuda>(&rule, &dev, dtype);
            let want = step::<Cpu>(&rule, &cpu, dtype);
            assert_eq!(got.len(), want.len());
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.len(), w.len());
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(1.0),
                        "{rule:?} {dtype}: output {k} element {i}: cuda {a} vs cpu {b}"
                    );
                }
            }
        }
    }
    println!(
        "fused_update: {} rules x f32/f64 x {} params: cuda == cpu",
        rules().len(),
        SIZES.len()
    );
}
