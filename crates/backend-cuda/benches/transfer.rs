//! Host↔GPU transfer benchmarks: what a user's whole call costs, wall clock, from their code
//! to the data being usable (a synchronize after each call), median of 7. Prints `BENCH kiln
//! <name> <value> <unit>` lines; `bench/gpu_torch.py` prints PyTorch's twins.
//!
//! Also measures whether registering an ordinary buffer with the driver (`cuMemHostRegister`)
//! before a direct copy could beat kiln's staged copy (`h2d_register_256MB`, kiln only).
//!
//! Without a GPU it prints `skipped: no CUDA device (...)` and exits 0.

use std::time::Instant;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, copy_threads, try_gpu, unavailable_reason};
use kiln_core::{Backend, DType, Tensor};

fn report(name: &str, value: f64, unit: &str) {
    println!("BENCH kiln {name} {value:.4} {unit}");
}

/// Median wall-clock seconds of `f` over 7 runs (after 2 warm-ups).
fn wall(mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    let mut v: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return;
    };
    println!(
        "kiln device: {} (host copy threads: {})",
        dev.name().unwrap(),
        copy_threads()
    );
    let cpu = Cpu::device(0);
    let n = 64 << 20; // 256 MB of f32
    let bytes = (n * 4) as f64;
    let gbs = |s: f64| bytes / s / 1e9;
    let data: Vec<f32> = (0..n).map(|i| (i % 977) as f32).collect();
    let sync = || Cuda::synchronize(&dev).unwrap();

    // Host → GPU from ordinary memory: `from_slice` (no intermediate Vec).
    let s = wall(|| {
        let g = Tensor::<Cuda>::from_slice(&data, [n], &dev).unwrap();
        sync();
        drop(g);
    });
    report("h2d_pageable_256MB", gbs(s), "GB/s");

    // Host → GPU from pinned memory (asynchronous; timed to completion).
    let pinned = Tensor::<Cpu>::from_slice(&data, [n], &cpu)
        .unwrap()
        .pin_memory()
        .unwrap();
    let s = wall(|| {
        let g = pinned.to_backend::<Cuda>(&dev).unwrap();
        sync();
        drop(g);
    });
    report("h2d_pinned_256MB", gbs(s), "GB/s");
    // How long the non-blocking call itself takes (the host is free after it).
    let t0 = Instant::now();
    let g = pinned.to_backend::<Cuda>(&dev).unwrap();
    let call = t0.elapsed().as_secs_f64();
    sync();
    drop(g);
    report("h2d_pinned_256MB_call_returns", call * 1e3, "ms");

    let g = Tensor::<Cuda>::from_slice(&data, [n], &dev).unwrap();
    sync();

    // GPU → host into a fresh Vec (`to_vec`).
    let s = wall(|| {
        let v = g.to_vec::<f32>().unwrap();
        assert_eq!(v[977], 0.0);
    });
    report("d2h_pageable_256MB", gbs(s), "GB/s");

    // GPU → host into a buffer the caller reuses.
    let mut buf = vec![0f32; n];
    let s = wall(|| g.copy_to_slice(&mut buf).unwrap());
    assert!(buf == data);
    report("d2h_into_buffer_256MB", gbs(s), "GB/s");

    // GPU → pinned CPU tensor (direct DMA).
    let mut host = Tensor::<Cpu>::zeros([n], DType::F32, &cpu)
        .unwrap()
        .pin_memory()
        .unwrap();
    let s = wall(|| host.copy_from(&g).unwrap());
    report("d2h_pinned_256MB", gbs(s), "GB/s");
    drop(host);

    // Would registering the user's buffer pay? Register + direct copy + unregister.
    register_probe(&dev, &data, n);

    // Theano's loop: exp over 230,400 f32, copied back to the host each time.
    let x = Tensor::<Cuda>::rand([230_400], -1.0, 1.0, 1, DType::F32, &dev).unwrap();
    let s = wall(|| {
        for _ in 0..1000 {
            let v = x.exp().unwrap().to_vec::<f32>().unwrap();
            std::hint::black_box(v);
        }
    });
    report("exp_230400_to_host_x1000", s * 1e3, "ms");
    let mut out = vec![0f32; 230_400];
    let s = wall(|| {
        for _ in 0..1000 {
            x.exp().unwrap().copy_to_slice(&mut out).unwrap();
        }
    });
    report("exp_230400_into_buffer_x1000", s * 1e3, "ms");
}

/// Times `cuMemHostRegister` of an ordinary 256 MB buffer, a direct copy from it, and the
/// unregistration: the alternative to staging that the transfers issue asked to measure.
fn register_probe(dev: &kiln_backend_cuda::CudaDevice, data: &[f32], n: usize) {
    use cudarc::driver::sys;
    let dst = kiln_backend_cuda::raw::alloc(dev, n * 4).unwrap();
    let ptr = dst.device_ptr().unwrap();
    let bytes = n * 4;
    let mut reg = Vec::new();
    let s = wall(|| {
        let t = Instant::now();
        // SAFETY: `data` outlives the registration; the copy is synchronous; the context is
        // current (the device was used above on this thread).
        unsafe {
            let p = data.as_ptr() as *mut std::ffi::c_void;
            assert_eq!(
                sys::cuMemHostRegister_v2(p, bytes, 0),
                sys::CUresult::CUDA_SUCCESS
            );
            reg.push(t.elapsed().as_secs_f64());
            assert_eq!(
                sys::cuMemcpyHtoD_v2(ptr, p, bytes),
                sys::CUresult::CUDA_SUCCESS
            );
            assert_eq!(sys::cuMemHostUnregister(p), sys::CUresult::CUDA_SUCCESS);
        }
    });
    reg.sort_by(|a, b| a.partial_cmp(b).unwrap());
    report("h2d_register_256MB", bytes as f64 / s / 1e9, "GB/s");
    report("h2d_register_only_256MB", reg[reg.len() / 2] * 1e3, "ms");
}
