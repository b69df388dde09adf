//! Lone elementwise ops and the multi-tensor optimizer update, with fusion off (each op runs
//! its own kernel now): what a hand-written kernel would have to beat. Device time from CUDA
//! events (as `gpu.rs`), reported as effective GB/s (bytes each op must move); the small-op
//! rows are host wall time per op (launch overhead). Prints `BENCH kiln <name> <value> <unit>`
//! lines; run through `cargo xtask bench-gpu`, or on its own beside an older build of the same
//! file to compare kernels.
//!
//! Without a GPU it prints `skipped: no CUDA device (...)` and exits 0.

mod common;
use common::{report, time};

use std::time::Instant;

use kiln_backend_cuda::{Cuda, CudaDevice, try_gpu, unavailable_reason};
use kiln_core::{Backend, DType, Generator, Result, Tensor, UpdateRule};

/// Best of 5 rounds of host wall time per call of `f` (1000 calls a round), in µs.
fn wall_us(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        Cuda::synchronize(dev).unwrap();
        let t0 = Instant::now();
        for _ in 0..1000 {
            f().unwrap();
        }
        Cuda::synchronize(dev).unwrap();
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    best
}

fn gbs(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e-3) / 1e9
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test` runs benches as tests: nothing to do
    }
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return;
    };
    println!("kiln device: {}", dev.name().unwrap());
    kiln_backend_cuda::set_fusion(false);
    let t = |shape: &[usize], seed, dtype| {
        Generator::new(seed)
            .sample::<Cuda>(
                shape,
                kiln_core::RandDist::Uniform {
                    low: -4.0,
                    high: 4.0,
                },
                dtype,
                &dev,
            )
            .unwrap()
    };
    let n = 1usize << 24; // 16M elements
    let side = 4096usize; // 4096 x 4096 = 16M
    let nf = n as f64;
    let a = t(&[n], 1, DType::F32);
    let b = t(&[n], 2, DType::F32);
    let m = t(&[side, side], 3, DType::F32);
    let row = t(&[side], 4, DType::F32);
    let r = |ms: f64, bytes: f64, name: &str| report(name, gbs(bytes, ms), "GB/s");

    r(
        time(&dev, 5, 20, || a.add(&b).map(drop)),
        12.0 * nf,
        "add_f32_16M",
    );
    r(
        time(&dev, 5, 20, || m.add(&row).map(drop)),
        8.0 * nf,
        "add_f32_4096x4096_bcast_row",
    );
    let col = row.reshape([side, 1]).unwrap();
    r(
        time(&dev, 5, 20, || m.add(&col).map(drop)),
        8.0 * nf,
        "add_f32_4096x4096_bcast_col",
    );
    let mt = m.t().unwrap();
    r(
        time(&dev, 5, 20, || mt.add(&m).map(drop)),
        12.0 * nf,
        "add_f32_4096x4096_transposed",
    );
    r(
        time(&dev, 5, 20, || a.add_scalar(0.5).map(drop)),
        8.0 * nf,
        "add_scalar_f32_16M",
    );
    r(
        time(&dev, 5, 20, || a.lt(&b).map(drop)),
        9.0 * nf,
        "lt_f32_16M",
    );
    let mask = a.lt(&b).unwrap();
    r(
        time(&dev, 5, 20, || mask.where_cond(&a, &b).map(drop)),
        13.0 * nf,
        "where_f32_16M",
    );
    r(
        time(&dev, 5, 20, || a.to_dtype(DType::F64).map(drop)),
        12.0 * nf,
        "cast_f32_f64_16M",
    );
    r(
        time(&dev, 5, 20, || a.to_dtype(DType::U8).map(drop)),
        5.0 * nf,
        "cast_f32_u8_16M",
    );
    let ai = t(&[n], 5, DType::F32).to_dtype(DType::I64).unwrap();
    let bi = t(&[n], 6, DType::F32).to_dtype(DType::I64).unwrap();
    r(
        time(&dev, 5, 20, || ai.div(&bi).map(drop)),
        24.0 * nf,
        "div_i64_16M",
    );
    let ad = a.to_dtype(DType::F64).unwrap();
    r(
        time(&dev, 5, 20, || ad.mul_scalar(3.0).map(drop)),
        16.0 * nf,
        "mul_scalar_f64_16M",
    );
    drop((a, b, m, row, col, mt, mask, ai, bi, ad));

    // Launch overhead: ops on 1,000 elements, host wall time per op.
    let (x, y) = (t(&[1000], 7, DType::F32), t(&[1000], 8, DType::F32));
    report("add_1000_host", wall_us(&dev, || x.add(&y).map(drop)), "us");
    let mut k = 0.0;
    report(
        "add_scalar_1000_new_value_host",
        wall_us(&dev, || {
            k += 1.0;
            x.add_scalar(k).map(drop)
        }),
        "us",
    );
    report("lt_1000_host", wall_us(&dev, || x.lt(&y).map(drop)), "us");
    // Where the time of a small op goes: event-timed (the stream's pace) and, with
    // KILN_CUDA_LAUNCH_STATS=1, the host time inside cuLaunchKernel.
    report(
        "add_1000_stream",
        time(&dev, 5, 1000, || x.add(&y).map(drop)) * 1e3,
        "us",
    );
    let (l0, ns0) = kiln_backend_cuda::launch_stats();
    wall_us(&dev, || x.add(&y).map(drop));
    let (l1, ns1) = kiln_backend_cuda::launch_stats();
    if l1 > l0 {
        report(
            "add_1000_in_cuLaunchKernel",
            (ns1 - ns0) as f64 / (l1 - l0) as f64 / 1e3,
            "us",
        );
    }

    // Multi-tensor updates: 40 parameters of 2.5M f32 (100M elements: device bound), of 250K
    // (near the host's pace), and 40 of 1,000 (host bound: one step's host time).
    for (len, tag) in [
        (2_500_000usize, "40x2.5M"),
        (250_000, "40x250K"),
        (1000, "40x1000"),
    ] {
        let params: Vec<Tensor<Cuda>> = (0..40).map(|i| t(&[len], 100 + i, DType::F32)).collect();
        let grads: Vec<Tensor<Cuda>> = (0..40).map(|i| t(&[len], 200 + i, DType::F32)).collect();
        let s0: Vec<Tensor<Cuda>> = (0..40).map(|i| t(&[len], 300 + i, DType::F32)).collect();
        let s1: Vec<Tensor<Cuda>> = (0..40)
            .map(|i| t(&[len], 400 + i, DType::F32).abs().unwrap())
            .collect();
        let sgd = UpdateRule::Sgd {
            lr: 0.01,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 1e-4,
            first_step: false,
        };
        let mut step = 10;
        let mut adam = || {
            step += 1;
            UpdateRule::Adam {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                decoupled: true,
                bias_correction1: 1.0 - 0.9f64.powi(step),
                bias_correction2: 1.0 - 0.999f64.powi(step),
            }
        };
        let st1: Vec<Vec<Tensor<Cuda>>> = s0.iter().map(|s| vec![s.clone()]).collect();
        let st2: Vec<Vec<Tensor<Cuda>>> = s0
            .iter()
            .zip(&s1)
            .map(|(a, b)| vec![a.clone(), b.clone()])
            .collect();
        let elems = 40.0 * len as f64;
        if len > 1000 {
            // SGD momentum: reads p, g, m; writes p, m. Adam: reads p, g, m, v; writes p, m, v.
            let ms = time(&dev, 5, 10, || {
                Tensor::fused_update(&sgd, &params, &grads, &st1).map(drop)
            });
            r(ms, 20.0 * elems, &format!("sgd_nesterov_update_{tag}"));
            let ms = time(&dev, 5, 10, || {
                Tensor::fused_update(&adam(), &params, &grads, &st2).map(drop)
            });
            r(ms, 28.0 * elems, &format!("adamw_update_{tag}"));
        } else {
            report(
                &format!("sgd_nesterov_update_{tag}_host"),
                wall_us(&dev, || {
                    Tensor::fused_update(&sgd, &params, &grads, &st1).map(drop)
                }),
                "us",
            );
            report(
                &format!("adamw_update_{tag}_host"),
                wall_us(&dev, || {
                    Tensor::fused_update(&adam(), &params, &grads, &st2).map(drop)
                }),
                "us",
            );
        }
    }
    kiln_backend_cuda::set_fusion(true);
}
