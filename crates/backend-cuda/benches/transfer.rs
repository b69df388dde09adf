//! Host↔GPU transfer benchmarks: what a user's whole call costs, wall clock, from their code
//! to the data being usable (a synchronize after each call), median of 7. Prints `BENCH kiln
//! <name> <value> <unit>` lines; `bench/gpu_torch.py` prints PyTorch's twins.
//!
//! Also measures whether registering an ordinary buffer with the driver (`cuMemHostRegister`)
//! before a direct copy could beat kiln's staged copy (`h2d_register_256MB`, kiln only).
//!
//! Without a GPU it prints `skipped: no CUDA device (...)` and exits 0.

mod common;
use common::report;

use std::time::Instant;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, copy_threads, try_gpu, unavailable_reason};
use kiln_core::{Backend, DType, Generator, Tensor};

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
    let x = Generator::new(1)
        .uniform::<Cuda>([230_400], -1.0, 1.0, &dev)
        .unwrap();
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

    batch_upload_probe(&dev);
    #[cfg(feature = "cuda-13000")]
    rows_dma_probe(&dev);
}

/// Could the copy engine gather a shuffled group of rows instead of a kernel (issue 11: the
/// gather kernel shares multiprocessors with the training step)? 21,000 rows of 784 bytes
/// (MNIST pixels: a 16 MiB group of batch-1000 steps) scattered over a pinned dataset of
/// 65,536 rows, copied into device memory by one `cuMemcpyBatchAsync` call, against one
/// contiguous copy of the same bytes. GB/s of row bytes, and the host time of the call.
///
/// Answer on an H200 (2026-11-26): no. 0.68 GB/s, the call alone taking 24 ms of host time,
/// against 53 GB/s for the contiguous copy; a batch-1000 MLP step needs ~5 GB/s.
#[cfg(feature = "cuda-13000")]
fn rows_dma_probe(dev: &kiln_backend_cuda::CudaDevice) {
    use cudarc::driver::sys;
    use kiln_core::PinnedBlock;
    const TOTAL: usize = 65_536;
    const ROW: usize = 784;
    const N: usize = 21_000;
    let ok = |r: sys::CUresult| assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{r:?}");
    let mut data = PinnedBlock::new("probe", TOTAL * ROW).unwrap();
    for (i, b) in data.as_bytes_mut().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let dst = kiln_backend_cuda::raw::alloc(dev, N * ROW).unwrap();
    let ptr = dst.device_ptr().unwrap();
    let host = data.as_bytes().as_ptr() as u64;
    // an odd multiplier permutes 0..2^16: rows in a shuffled order
    let mut dsts: Vec<sys::CUdeviceptr> = (0..N).map(|i| ptr + (i * ROW) as u64).collect();
    let mut srcs: Vec<sys::CUdeviceptr> = (0..N)
        .map(|i| host + ((i * 40_503) % TOTAL * ROW) as u64)
        .collect();
    let mut sizes = vec![ROW; N];
    let loc = |type_, id| sys::CUmemLocation { type_, id };
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: loc(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0),
        dstLocHint: loc(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 0),
        flags: 0,
    };
    let mut idx = [0usize];
    let (mut call, mut total, mut contig) = (Vec::new(), Vec::new(), Vec::new());
    // SAFETY: the device's context is current on this thread (used above); every pointer
    // array holds N entries; sources lie in the pinned block and destinations in `dst`, both
    // alive until the stream is synchronized after each copy.
    unsafe {
        let mut st = std::ptr::null_mut();
        let nb = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        ok(sys::cuStreamCreate(&mut st, nb));
        // One call gathering every row (the arrays are the driver's to read during the call).
        let mut gather = || {
            ok(sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                N,
                &mut attrs,
                idx.as_mut_ptr(),
                1,
                st,
            ))
        };
        for k in 0..7 {
            let t = Instant::now();
            gather();
            let c = t.elapsed().as_secs_f64();
            ok(sys::cuStreamSynchronize(st));
            if k >= 2 {
                call.push(c);
                total.push(t.elapsed().as_secs_f64());
            }
            let t = Instant::now();
            ok(sys::cuMemcpyHtoDAsync_v2(
                ptr,
                data.as_bytes().as_ptr() as *const std::ffi::c_void,
                N * ROW,
                st,
            ));
            ok(sys::cuStreamSynchronize(st));
            if k >= 2 {
                contig.push(t.elapsed().as_secs_f64());
            }
        }
        // the rows arrived where they belong (the last copy was the contiguous one: redo)
        gather();
        ok(sys::cuStreamSynchronize(st));
        let mut back = vec![0u8; 3 * ROW];
        ok(sys::cuMemcpyDtoH_v2(
            back.as_mut_ptr() as *mut std::ffi::c_void,
            ptr + (N as u64 - 3) * ROW as u64,
            3 * ROW,
        ));
        for (j, row) in back.chunks(ROW).enumerate() {
            let r = (N - 3 + j) * 40_503 % TOTAL;
            assert_eq!(
                row,
                &data.as_bytes()[r * ROW..(r + 1) * ROW],
                "row {}",
                N - 3 + j
            );
        }
        ok(sys::cuStreamDestroy_v2(st));
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let bytes = (N * ROW) as f64;
    report(
        "rows_dma_batch_21000x784_gbs",
        bytes / med(total) / 1e9,
        "GB/s",
    );
    report("rows_dma_batch_call_us", med(call) * 1e6, "us");
    report(
        "rows_contiguous_16MB_gbs",
        bytes / med(contig) / 1e9,
        "GB/s",
    );
}

/// Host time per call of what a DataLoader's consumer does for each batch (MNIST-shaped: 784
/// f32 features and one i64 label per sample, from pinned blocks), with the GPU otherwise idle:
/// the upload of the batch's two sources, the drop of the batch two batches later (as a loop
/// that keeps one batch ahead does), and the driver calls they are made of. Microseconds.
fn batch_upload_probe(dev: &kiln_backend_cuda::CudaDevice) {
    use cudarc::driver::sys;
    use kiln_core::{HostSource, PinnedBlock};
    use std::sync::Arc;
    const N: usize = 2000;
    let us = |t: Instant| t.elapsed().as_secs_f64() * 1e6 / N as f64;
    let ok = |r: sys::CUresult| assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    for batch in [100, 1000] {
        let f = Arc::new(PinnedBlock::new("probe", batch * 784 * 4).unwrap());
        let l = Arc::new(PinnedBlock::new("probe", batch * 8).unwrap());
        fn src(b: &Arc<PinnedBlock>) -> HostSource<'_> {
            HostSource {
                bytes: b.as_bytes(),
                pinned: true,
                owner: Some(b.clone()),
            }
        }
        let (mut up, mut down) = (0f64, 0f64);
        let mut ring = std::collections::VecDeque::new();
        Cuda::synchronize(dev).unwrap();
        for k in 0..N + 100 {
            let t = Instant::now();
            let s =
                Cuda::from_host_sources(dev, vec![(DType::F32, src(&f)), (DType::I64, src(&l))])
                    .unwrap();
            let dt = t.elapsed().as_secs_f64();
            ring.push_back(s);
            let t = Instant::now();
            if ring.len() > 2 {
                drop(ring.pop_front());
            }
            if k >= 100 {
                up += dt;
                down += t.elapsed().as_secs_f64();
            }
            if k % 64 == 63 {
                Cuda::synchronize(dev).unwrap(); // bound the queue, as a step would
            }
        }
        drop(ring);
        Cuda::synchronize(dev).unwrap();
        // The same calls as the profiler sees them (host time of each copy, allocations).
        let (_, p) = kiln_core::profile::profile(|| {
            let mut ring = std::collections::VecDeque::new();
            for _ in 0..200 {
                let srcs = vec![(DType::F32, src(&f)), (DType::I64, src(&l))];
                ring.push_back(Cuda::from_host_sources(dev, srcs).unwrap());
                if ring.len() > 2 {
                    drop(ring.pop_front());
                }
            }
        });
        println!("profile of 200 batch{batch} uploads:\n{}", p.table());
        report(
            &format!("batch{batch}_upload_call_us"),
            up * 1e6 / N as f64,
            "us",
        );
        report(
            &format!("batch{batch}_drop_call_us"),
            down * 1e6 / N as f64,
            "us",
        );

        // The driver calls one by one, on a stream of our own.
        let dst = kiln_backend_cuda::raw::alloc(dev, batch * 784 * 4).unwrap();
        let ptr = dst.device_ptr().unwrap();
        // SAFETY: the device's context is current on this thread (used just above); every
        // handle is created here and destroyed at the end; the copies read pinned blocks that
        // outlive them (synchronized before the blocks drop) into a live allocation.
        unsafe {
            let (mut s1, mut s2, mut ev) = (
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let nb = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            ok(sys::cuStreamCreate(&mut s1, nb));
            ok(sys::cuStreamCreate(&mut s2, nb));
            let dis = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            ok(sys::cuEventCreate(&mut ev, dis));
            let fp = f.as_bytes().as_ptr() as *const std::ffi::c_void;
            let lp = l.as_bytes().as_ptr() as *const std::ffi::c_void;
            let mut memcpy = 0f64;
            for k in 0..N {
                let t = Instant::now();
                ok(sys::cuMemcpyHtoDAsync_v2(ptr, fp, batch * 784 * 4, s1));
                memcpy += t.elapsed().as_secs_f64();
                if k % 64 == 63 {
                    ok(sys::cuStreamSynchronize(s1));
                }
            }
            ok(sys::cuStreamSynchronize(s1));
            report(
                &format!("batch{batch}_memcpy_features_us"),
                memcpy * 1e6 / N as f64,
                "us",
            );
            let t = Instant::now();
            for _ in 0..N {
                ok(sys::cuMemcpyHtoDAsync_v2(ptr, lp, batch * 8, s1));
            }
            report(&format!("batch{batch}_memcpy_labels_us"), us(t), "us");
            ok(sys::cuStreamSynchronize(s1));
            let t = Instant::now();
            for _ in 0..N {
                ok(sys::cuEventRecord(ev, s1));
            }
            report(&format!("batch{batch}_event_record_us"), us(t), "us");
            let t = Instant::now();
            for _ in 0..N {
                ok(sys::cuStreamWaitEvent(s2, ev, 0));
            }
            report(&format!("batch{batch}_stream_wait_us"), us(t), "us");
            ok(sys::cuStreamSynchronize(s1));
            let t = Instant::now();
            for _ in 0..N {
                std::hint::black_box(sys::cuEventQuery(ev));
            }
            report(&format!("batch{batch}_event_query_us"), us(t), "us");
            ok(sys::cuStreamSynchronize(s2));
            ok(sys::cuEventDestroy_v2(ev));
            ok(sys::cuStreamDestroy_v2(s1));
            ok(sys::cuStreamDestroy_v2(s2));
        }
    }
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
