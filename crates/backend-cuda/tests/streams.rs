//! Streams, events, pinned memory and host transfers on a real GPU: concurrency, the
//! allocator's cross-stream safety, non-blocking copies whose source is dropped at once,
//! copies into caller-owned and pinned buffers, deferred work on user streams, and typed
//! errors for bad input.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use std::time::Instant;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, Event, Stream, gpu_or_skip, raw};
use kiln_core::{DType, Error, Generator, PinnedBlock, RandDist, Reduction, Tensor};

const F32: DType = DType::F32;

/// `KILN_CUDA_SYNC=1` synchronizes after every launch (like `CUDA_LAUNCH_BLOCKING=1`), so
/// nothing can overlap and no event is still pending when the host looks.
fn launches_block() -> bool {
    std::env::var("KILN_CUDA_SYNC").is_ok_and(|v| v == "1")
}

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % 1000) as f32 * 0.5 - 7.0).collect()
}

#[test]
fn two_streams_run_concurrently() {
    let Some(dev) = gpu_or_skip(0) else { return };
    if launches_block() {
        eprintln!("skipped: KILN_CUDA_SYNC=1 serializes every launch, so streams cannot overlap");
        return;
    }
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let run = |both: bool| {
        kiln_backend_cuda::synchronize(&dev).unwrap();
        let t = Instant::now();
        a.scope(|| raw::spin(&dev, 100_000)).unwrap();
        if both {
            b.scope(|| raw::spin(&dev, 100_000)).unwrap();
        }
        kiln_backend_cuda::synchronize(&dev).unwrap();
        t.elapsed().as_secs_f64()
    };
    run(true); // warm-up: compiles the kernel
    let one = run(false);
    let two = run(true);
    println!("one 100 ms kernel: {one:.4} s; one on each of two streams: {two:.4} s");
    assert!(
        two < 1.3 * one,
        "two streams did not overlap: {two} vs {one}"
    );
}

#[test]
fn a_block_used_on_another_stream_is_not_reused_before_that_stream_passes() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let n = 1 << 20;
    let x = a
        .scope(|| Tensor::<Cuda>::full([n], 1.0, F32, &dev))
        .unwrap();
    a.synchronize().unwrap();
    // Stream B is busy for 200 ms, then reads x.
    let y = b
        .scope(|| {
            raw::spin(&dev, 200_000)?;
            let y = (&x * 2.0)?;
            y.realize()?;
            Ok::<_, Error>(y)
        })
        .unwrap();
    drop(x);
    // Stream A is idle: a same-size allocation there must not get x's block while B still
    // has to read it.
    let z = a
        .scope(|| Tensor::<Cuda>::full([n], 7.0, F32, &dev))
        .unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let got = y.to_vec::<f32>().unwrap();
    assert!(
        got.iter().all(|&v| v == 2.0),
        "y read recycled memory: {}",
        got[0]
    );
    assert!(z.to_vec::<f32>().unwrap().iter().all(|&v| v == 7.0));
}

/// A tensor used on a stream that is dropped before the tensor: the tensor's free records an
/// event on that stream, so the stream must still exist (it crashed `data_parallel` at exit,
/// where a collective's output outlived its communicator's stream).
#[test]
fn a_tensor_used_on_a_dropped_stream_is_freed_safely() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let n = 1 << 16;
    let mut handles = Vec::new();
    for round in 0..20 {
        let x = Tensor::<Cuda>::full([n], round as f64, F32, &dev).unwrap();
        // A priority no other test uses, so that no other test takes this spare meanwhile.
        let s = Stream::with_priority(&dev, -2).unwrap();
        handles.push(format!("{s:?}"));
        let y = s
            .scope(|| {
                let y = (&x + 1.0)?;
                y.realize()?;
                Ok::<_, Error>(y)
            })
            .unwrap();
        s.synchronize().unwrap();
        drop(s);
        drop(x); // records "x is free once the dropped stream passes here"
        drop(y);
        let z = Tensor::<Cuda>::full([n], 3.0, F32, &dev).unwrap();
        assert_eq!(z.sum_all().unwrap().to_scalar().unwrap(), 3.0 * n as f64);
    }
    // The dropped streams were kept and handed out again, not destroyed and recreated.
    handles.sort();
    handles.dedup();
    assert_eq!(handles.len(), 1, "streams were not reused: {handles:?}");
    kiln_backend_cuda::synchronize(&dev).unwrap();
}

#[test]
fn deferred_work_runs_on_the_stream_it_was_recorded_on() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let a = Stream::new(&dev).unwrap();
    let n = 1 << 16;
    let y = a
        .scope(|| {
            raw::spin(&dev, 100_000)?;
            let w = Tensor::<Cuda>::full([n], 5.0, F32, &dev)?; // after the spin, on A
            (&w * 2.0)?.exp() // pending, recorded on A
        })
        .unwrap();
    // Read on the default stream: the fused kernel must run on A after the fill, and the read
    // must wait for it.
    let got = y.to_vec::<f32>().unwrap();
    let want = 10f32.exp();
    assert!(
        got.iter().all(|&v| (v - want).abs() <= want * 1e-6),
        "{}",
        got[0]
    );
}

#[test]
fn events_record_wait_query_and_time() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let s = Stream::new(&dev).unwrap();
    let (start, end) = (Event::timing(&dev).unwrap(), Event::timing(&dev).unwrap());
    s.scope(|| -> kiln_core::Result<()> {
        start.record()?;
        raw::spin(&dev, 50_000)?;
        end.record()
    })
    .unwrap();
    if !launches_block() {
        assert!(
            !end.query().unwrap(),
            "the event passed before its work ran"
        );
    }
    let ms = start.elapsed_ms(&end).unwrap();
    assert!((45.0..500.0).contains(&ms), "{ms} ms for a 50 ms kernel");
    assert!(end.query().unwrap() && s.query().unwrap());
    // A stream waiting on an event runs after it.
    let t = Tensor::<Cuda>::full([1 << 20], 3.0, F32, &dev).unwrap();
    let e = s
        .scope(|| {
            raw::spin(&dev, 50_000)?;
            let u = (&t + 1.0)?;
            u.realize()?;
            Ok::<_, Error>((s.record_event()?, u))
        })
        .unwrap();
    let default = Stream::current(&dev).unwrap();
    default.wait_event(&e.0).unwrap();
    assert!(e.1.to_vec::<f32>().unwrap().iter().all(|&v| v == 4.0));
    let plain = Event::new(&dev).unwrap();
    assert!(
        plain.elapsed_ms(&end).is_err(),
        "timing a non-timing event must fail"
    );
}

#[test]
fn a_nonblocking_copy_from_pinned_memory_keeps_its_source_alive() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    let n = 16 << 20;
    let data = ramp(n);
    let host = Tensor::<Cpu>::from_slice(&data, [n], &cpu)
        .unwrap()
        .pin_memory()
        .unwrap();
    assert!(host.is_pinned());
    raw::delay_copies(&dev, 200_000).unwrap(); // the DMA starts 200 ms from now
    let t0 = Instant::now();
    let g = host.to_backend::<Cuda>(&dev).unwrap();
    let returned = t0.elapsed();
    let returned = if launches_block() {
        std::time::Duration::ZERO
    } else {
        returned
    };
    drop(host); // the only handle: the pool may not recycle the block before the DMA ran
    let junk = Tensor::<Cpu>::full([n], -1.0, F32, &cpu)
        .unwrap()
        .pin_memory()
        .unwrap();
    let got = g.to_vec::<f32>().unwrap();
    assert!(
        returned.as_millis() < 100,
        "the copy blocked for {returned:?}"
    );
    assert!(got == data, "the copy read recycled pinned memory");
    drop(junk);
}

#[test]
fn transfers_into_caller_buffers_pinned_and_strided() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    // Not a multiple of the staging block (8 MiB), several blocks long.
    let n = (37 << 20) / 4 + 3;
    let data = ramp(n);
    let g = Tensor::<Cuda>::from_slice(&data, [n], &dev).unwrap();
    let mut out = vec![0f32; n];
    g.copy_to_slice(&mut out).unwrap();
    assert!(out == data);
    assert!(g.to_vec::<f32>().unwrap() == data);
    // Into a pinned CPU tensor, by DMA.
    let mut pinned = Tensor::<Cpu>::zeros([n], F32, &cpu)
        .unwrap()
        .pin_memory()
        .unwrap();
    pinned.copy_from(&g).unwrap();
    assert!(pinned.to_vec::<f32>().unwrap() == data);
    // Pinned back to the GPU, and a strided view out.
    let back = pinned.to_backend::<Cuda>(&dev).unwrap();
    let m = back
        .narrow(0, 0, 1000 * 6)
        .unwrap()
        .reshape([1000, 6])
        .unwrap();
    let col = m.t().unwrap();
    let mut want = vec![0f32; 6000];
    for i in 0..1000 {
        for j in 0..6 {
            want[j * 1000 + i] = data[i * 6 + j];
        }
    }
    let mut got = vec![0f32; 6000];
    col.copy_to_slice(&mut got).unwrap();
    assert_eq!(got, want);
    // Wrong sizes and dtypes are typed errors.
    let mut short = vec![0f32; 10];
    assert!(matches!(
        g.copy_to_slice(&mut short),
        Err(Error::InvalidArgument { .. })
    ));
    let mut ints = vec![0i64; n];
    assert!(matches!(
        g.copy_to_slice(&mut ints),
        Err(Error::DTypeMismatch { .. })
    ));
}

#[test]
fn pinning_more_than_the_machine_has_is_a_typed_error() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let r = PinnedBlock::new("pin_memory", 1 << 46);
    match r {
        Err(Error::OutOfMemory { device, .. }) => assert!(device.contains("pinned"), "{device}"),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Still usable.
    let x = Tensor::<Cuda>::arange(0.0, 4.0, 1.0, F32, &dev).unwrap();
    assert_eq!(x.sum_all().unwrap().to_scalar().unwrap(), 6.0);
    let p = PinnedBlock::new("pin_memory", 1 << 20).unwrap();
    assert_eq!(p.len(), 1 << 20);
}

#[test]
fn streams_and_events_of_another_device_are_typed_errors() {
    let Some(d0) = gpu_or_skip(0) else { return };
    let Some(d1) = gpu_or_skip(1) else { return };
    let s1 = Stream::new(&d1).unwrap();
    let e0 = Event::new(&d0).unwrap();
    let t0 = Tensor::<Cuda>::zeros([4], F32, &d0).unwrap();
    let e = e0.record_on(&s1).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("cuda:1"), "{e}");
    let e = s1.record_tensor(&t0).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("cuda:1"), "{e}");
    let e = s1.scope_with(&[&t0], || Ok(())).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("cuda:1"), "{e}");
    // Cross-device waits are allowed: that is how two GPUs are ordered.
    s1.wait_event(&e0).unwrap();
}

#[test]
fn several_pinned_sources_upload_behind_one_event_and_stay_alive() {
    use kiln_core::{Backend, HostSource};
    use std::sync::Arc;
    let Some(dev) = gpu_or_skip(0) else { return };
    let n = 4 << 20;
    let data = ramp(n);
    let ids: Vec<i64> = (0..1000).map(|i| i % 10).collect();
    let block = |bytes: &[u8]| Arc::new(PinnedBlock::from_bytes("test", bytes).unwrap());
    let (f, l) = (
        block(bytemuck::cast_slice(&data)),
        block(bytemuck::cast_slice(&ids)),
    );
    fn src(b: &Arc<PinnedBlock>) -> HostSource<'_> {
        HostSource {
            bytes: b.as_bytes(),
            pinned: true,
            owner: Some(b.clone()),
        }
    }
    raw::delay_copies(&dev, 200_000).unwrap(); // the DMAs start 200 ms from now
    let mut s = Cuda::from_host_sources(&dev, vec![(F32, src(&f)), (DType::I64, src(&l))]).unwrap();
    drop((f, l)); // only the uploads hold the blocks now
    let junk = PinnedBlock::new("test", n * 4).unwrap();
    let ls = Tensor::<Cuda>::from_storage(s.pop().unwrap(), [1000], DType::I64);
    let fs = Tensor::<Cuda>::from_storage(s.pop().unwrap(), [n], F32);
    assert!(
        fs.to_vec::<f32>().unwrap() == data,
        "features read recycled memory"
    );
    assert_eq!(ls.to_vec::<i64>().unwrap(), ids);
    // The labels were scanned on the host: a loss over them needs no flag read.
    let logits = Tensor::<Cuda>::zeros([1000, 10], F32, &dev).unwrap();
    let s0 = kiln_backend_cuda::thread_syncs();
    logits.cross_entropy(&ls, Reduction::None).unwrap();
    if !launches_block() {
        // (`KILN_CUDA_SYNC=1` synchronizes after the loss's launch itself.)
        assert_eq!(kiln_backend_cuda::thread_syncs(), s0);
    }
    drop(junk);
}

/// `other + 1` queued and waited for on the current stream: the result, and the milliseconds
/// from `t0` until it was done (work that must not wait for a delayed copy stream).
fn unrelated_work(
    dev: &kiln_backend_cuda::CudaDevice,
    other: &Tensor<Cuda>,
    t0: Instant,
) -> (Tensor<Cuda>, f64) {
    let unrelated = (other + 1.0).unwrap();
    unrelated.realize().unwrap();
    let done = Event::new(dev).unwrap();
    done.record().unwrap();
    done.synchronize().unwrap();
    (unrelated, t0.elapsed().as_secs_f64() * 1e3)
}

/// An upload from pinned memory holds back only the work that reads its result: the current
/// stream's other work runs while the copy is still queued (the DataLoader uploads the next
/// batch ahead, before the current step's kernels), and the first op that reads the upload,
/// an elementwise kernel here, still sees the copied values. Fails when the upload orders the
/// whole stream after the copy (the 200 ms delay then holds the unrelated op), or when the
/// first use does not wait (the kernel then reads the buffer before the DMA ran).
#[test]
fn an_upload_from_pinned_memory_holds_back_only_the_work_that_reads_it() {
    use kiln_core::{Backend, HostSource};
    use std::sync::Arc;
    let Some(dev) = gpu_or_skip(0) else { return };
    let n = 4 << 20;
    let data = ramp(n);
    let f = Arc::new(PinnedBlock::from_bytes("test", bytemuck::cast_slice(&data)).unwrap());
    let other = Tensor::<Cuda>::full([1 << 20], 3.0, F32, &dev).unwrap();
    // Warm-up: the timed ops' kernels compiled and their modules loaded now (loading a
    // module waits for the whole device, the delayed copy stream included).
    (&other + 1.0).unwrap().realize().unwrap();
    let same_shape = Tensor::<Cuda>::full([n], 1.0, F32, &dev).unwrap();
    (&same_shape * 2.0).unwrap().realize().unwrap();
    raw::delay_copies(&dev, 1).unwrap();
    kiln_backend_cuda::synchronize(&dev).unwrap();
    raw::delay_copies(&dev, 200_000).unwrap(); // the DMA starts 200 ms from now
    let t0 = Instant::now();
    let src = HostSource {
        bytes: f.as_bytes(),
        pinned: true,
        owner: Some(f.clone()),
    };
    let mut s = Cuda::from_host_sources(&dev, vec![(F32, src)]).unwrap();
    drop(f);
    let x = Tensor::<Cuda>::from_storage(s.pop().unwrap(), [n], F32);
    let (unrelated, unrelated_ms) = unrelated_work(&dev, &other, t0);
    let y = (&x * 2.0).unwrap();
    y.realize().unwrap();
    let got = y.to_vec::<f32>().unwrap();
    let want: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
    assert!(
        got == want,
        "the first kernel on the upload ran before its DMA"
    );
    assert!(unrelated.to_vec::<f32>().unwrap().iter().all(|&v| v == 4.0));
    if launches_block() {
        eprintln!("KILN_CUDA_SYNC=1: every launch waits for the device, timing not checked");
        return;
    }
    println!("unrelated work done {unrelated_ms:.1} ms after an upload delayed by 200 ms");
    assert!(
        unrelated_ms < 100.0,
        "work that does not read the upload waited for it ({unrelated_ms:.1} ms)"
    );
}

/// The DataLoader over a pinned dataset of MNIST-like pixels (`byte / 255`, kept as bytes) on
/// the GPU, each way it moves them: gathered by the device, copied as bytes by the worker, and
/// in order (one DMA of the dataset's own memory a group, decoded on the copy stream by
/// `copy_host_rows`): every batch equals the host's, bit for bit, labels included.
#[test]
fn the_loader_moves_a_pinned_pixel_dataset_to_the_gpu_bit_for_bit() {
    use kiln_core::HostBuffer;
    use kiln_data::{ArrayDataset, DataLoader};
    let Some(dev) = gpu_or_skip(0) else { return };
    let (n, width) = (2000, 784);
    let f: Vec<f32> = (0..n * width)
        .map(|k| (k * 37 % 256) as f32 / 255.0)
        .collect();
    let labels = HostBuffer::I64((0..n as i64).map(|i| i * 7 % 10).collect());
    let data = ArrayDataset::new(HostBuffer::F32(f), [width], labels, [], n).unwrap();
    let pinned = data.clone().pin().unwrap();
    // An epoch's batches: feature bits and labels.
    fn epoch<B: kiln_core::Backend>(l: &mut DataLoader<B>) -> Vec<(Vec<u32>, Vec<i64>)> {
        let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect();
        l.iter()
            .map(|b| {
                let (x, y) = b.unwrap();
                (bits(x.to_vec::<f32>().unwrap()), y.to_vec::<i64>().unwrap())
            })
            .collect()
    }
    let host = |shuffle: bool| {
        let l = DataLoader::<Cpu>::new(data.clone(), 300, &Cpu::device(0)).unwrap();
        epoch(&mut if shuffle { l.shuffle(3) } else { l })
    };
    for shuffle in [false, true] {
        let want = host(shuffle);
        for device_gather in [true, false] {
            // 1 MB groups: several batches an upload, and a short last batch.
            let l = DataLoader::<Cuda>::new(pinned.clone(), 300, &dev)
                .unwrap()
                .upload_bytes(1 << 20)
                .device_gather(device_gather);
            let got = epoch(&mut if shuffle { l.shuffle(3) } else { l });
            assert!(
                got == want,
                "shuffle {shuffle}, device_gather {device_gather}: batches differ"
            );
        }
    }
}

/// After a typed error: `other + 1` (`other` holds 3.0 everywhere) still computes.
fn assert_device_still_works(other: &Tensor<Cuda>) {
    let v = (other + 1.0).unwrap().to_vec::<f32>().unwrap();
    assert!(v.iter().all(|&v| v == 4.0), "the device keeps working");
}

/// `rows` rows of MNIST-shaped host data: f32 features (784 a row), labels `i * 7 % 10`, and
/// pixel bytes (784 a row).
fn host_arrays(rows: usize) -> (Vec<f32>, Vec<i64>, Vec<u8>) {
    let feats = ramp(rows * 784);
    let labels = (0..rows as i64).map(|i| i * 7 % 10).collect();
    let pixels = (0..rows * 784).map(|i| (i * 37 % 256) as u8).collect();
    (feats, labels, pixels)
}

/// `gather_host_rows` (the DataLoader's path for a pinned dataset): the GPU reads the rows of
/// page-locked host arrays itself. Rows of 3136 bytes (16-byte words), 8-byte labels and
/// 3-byte rows (byte words) come out as a host gather gives them, in the requested order with
/// repeats, and bytes decoded to f32 (16, 4 and 1 at a time) equal the host's
/// division bit for bit; the gather runs on the copy stream, so with that stream delayed by 200 ms the
/// caller's unrelated work is not held back, and the first kernel that reads a result waits for
/// it. Then bad input: a row out of range and a row size that is not a whole number of
/// elements are typed errors, and the device keeps working.
#[test]
fn the_gpu_gathers_rows_of_pinned_host_arrays() {
    use kiln_core::{Backend, HostRows};
    use std::sync::Arc;
    let Some(dev) = gpu_or_skip(0) else { return };
    let rows_n = 5000;
    let (feats, labels, pixels) = host_arrays(rows_n);
    let bytes3: Vec<u8> = (0..rows_n * 3).map(|i| (i % 251) as u8).collect();
    let pinned = |b: &[u8]| Arc::new(PinnedBlock::from_bytes("test", b).unwrap());
    let srcs = [
        HostRows {
            block: pinned(bytemuck::cast_slice(&feats)),
            dtype: F32,
            row_bytes: 784 * 4,
            id_bound: None,
            bytes_over: None,
        },
        HostRows {
            block: pinned(bytemuck::cast_slice(&labels)),
            dtype: DType::I64,
            row_bytes: 8,
            id_bound: Some(10),
            bytes_over: None,
        },
        HostRows {
            block: pinned(&bytes3),
            dtype: DType::U8,
            row_bytes: 3,
            id_bound: None,
            bytes_over: None,
        },
        // MNIST-like pixels kept as bytes, decoded to `byte / 255` on the device.
        HostRows {
            block: pinned(&pixels),
            dtype: F32,
            row_bytes: 784,
            id_bound: None,
            bytes_over: Some(255.0),
        },
        // 12-byte rows (four bytes, one float4 at a time), divided by 3.
        HostRows {
            block: pinned(&pixels),
            dtype: F32,
            row_bytes: 12,
            id_bound: None,
            bytes_over: Some(3.0),
        },
        // The same bytes a row of 3 (one byte, one float at a time).
        HostRows {
            block: pinned(&bytes3),
            dtype: F32,
            row_bytes: 3,
            id_bound: None,
            bytes_over: Some(1.0),
        },
    ];
    let order: Vec<usize> = (0..3000)
        .map(|i| (i * 7919 + 13) % rows_n)
        .chain([0, 0, rows_n - 1])
        .collect();
    let other = Tensor::<Cuda>::full([1 << 20], 3.0, F32, &dev).unwrap();
    (&other + 1.0).unwrap().realize().unwrap();
    // Warm-up: the gather's module loaded (loading waits for the whole device).
    drop(Cuda::gather_host_rows(&dev, &srcs, &[1]).unwrap());
    kiln_backend_cuda::synchronize(&dev).unwrap();
    raw::delay_copies(&dev, 200_000).unwrap();
    let t0 = Instant::now();
    let got = Cuda::gather_host_rows(&dev, &srcs, &order)
        .unwrap()
        .unwrap();
    let (_, unrelated_ms) = unrelated_work(&dev, &other, t0);
    let mut got = got.into_iter();
    let x = Tensor::<Cuda>::from_storage(got.next().unwrap(), [order.len(), 784], F32);
    let y = Tensor::<Cuda>::from_storage(got.next().unwrap(), [order.len()], DType::I64);
    let z = Tensor::<Cuda>::from_storage(got.next().unwrap(), [order.len(), 3], DType::U8);
    let px = Tensor::<Cuda>::from_storage(got.next().unwrap(), [order.len(), 784], F32);
    let px12 = Tensor::<Cuda>::from_storage(got.next().unwrap(), [order.len(), 12], F32);
    let z1 = Tensor::<Cuda>::from_storage(got.next().unwrap(), [order.len(), 3], F32);
    let x2 = (&x * 2.0).unwrap().to_vec::<f32>().unwrap();
    let want: Vec<f32> = order
        .iter()
        .flat_map(|&r| feats[r * 784..(r + 1) * 784].iter().map(|v| v * 2.0))
        .collect();
    assert!(
        x2 == want,
        "the gathered features differ from the host rows"
    );
    let want: Vec<i64> = order.iter().map(|&r| labels[r]).collect();
    assert_eq!(y.to_vec::<i64>().unwrap(), want);
    let want: Vec<u8> = order
        .iter()
        .flat_map(|&r| bytes3[r * 3..r * 3 + 3].to_vec())
        .collect();
    assert_eq!(z.to_vec::<u8>().unwrap(), want);
    // Decoded bytes, compared as bits with the host's `byte as f32 / d`.
    let bits = |t: &Tensor<Cuda>| -> Vec<u32> {
        t.to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let host = |bytes: &[u8], row: usize, d: f32| -> Vec<u32> {
        order
            .iter()
            .flat_map(|&r| {
                bytes[r * row..(r + 1) * row]
                    .iter()
                    .map(move |&b| (b as f32 / d).to_bits())
            })
            .collect()
    };
    assert!(
        bits(&z1) == host(&bytes3, 3, 1.0),
        "bytes decoded one at a time differ"
    );
    assert!(
        bits(&px) == host(&pixels, 784, 255.0),
        "pixels decoded on the device differ from the host's byte / 255"
    );
    assert!(
        bits(&px12) == host(&pixels, 12, 3.0),
        "bytes decoded four at a time differ"
    );
    if !launches_block() {
        println!("unrelated work done {unrelated_ms:.1} ms after a gather delayed by 200 ms");
        assert!(
            unrelated_ms < 100.0,
            "work that does not read the gather waited for it ({unrelated_ms:.1} ms)"
        );
    }
    // Bad input.
    match Cuda::gather_host_rows(&dev, &srcs, &[0, rows_n]) {
        Err(Error::InvalidArgument { op, msg }) => {
            assert_eq!(op, "gather_host_rows");
            assert!(msg.contains(&format!("row {rows_n}")), "{msg}");
        }
        other => panic!("expected a typed error, got {:?}", other.map(|_| ())),
    }
    // A row size that is not a whole number of elements.
    let heap = vec![0u8; 64];
    let odd = HostRows {
        block: pinned(&heap),
        dtype: F32,
        row_bytes: 6,
        id_bound: None,
        bytes_over: None,
    };
    assert!(matches!(
        Cuda::gather_host_rows(&dev, &[odd], &[0]),
        Err(Error::InvalidArgument { .. })
    ));
    assert_device_still_works(&other);
}

/// `copy_host_rows` (the DataLoader's path for an epoch in order over a pinned dataset):
/// consecutive rows of page-locked arrays arrive as the host holds them, bytes decoded to f32
/// equal the host's `byte as f32 / d` bit for bit (16 at a time, and the tail of a range that
/// is not a whole number of 16 bytes one at a time), and labels keep the dataset's id bound
/// (the cross-entropy over them reads no device flag). The copy runs on the copy stream: with
/// that stream delayed by 200 ms, unrelated work on the caller's stream is not held back, and
/// the first kernel that reads a result waits for it. Then bad input: a range past the rows is
/// a typed error naming the op, and the device keeps working.
#[test]
fn the_gpu_copies_consecutive_rows_of_pinned_host_arrays() {
    use kiln_backend_cuda::thread_syncs;
    use kiln_core::{Backend, HostRows};
    use std::sync::Arc;
    let Some(dev) = gpu_or_skip(0) else { return };
    let rows_n = 5000;
    let (feats, labels, pixels) = host_arrays(rows_n);
    let pinned = |b: &[u8]| Arc::new(PinnedBlock::from_bytes("test", b).unwrap());
    let rows = |block, dtype, row_bytes, id_bound, bytes_over| HostRows {
        block,
        dtype,
        row_bytes,
        id_bound,
        bytes_over,
    };
    let srcs = [
        rows(
            pinned(bytemuck::cast_slice(&feats)),
            F32,
            784 * 4,
            None,
            None,
        ),
        rows(
            pinned(bytemuck::cast_slice(&labels)),
            DType::I64,
            8,
            Some(10),
            None,
        ),
        // MNIST-like pixels kept as bytes, decoded to `byte / 255` on the device.
        rows(pinned(&pixels), F32, 784, None, Some(255.0)),
        // Rows of 3 bytes divided by 3: ranges that end inside a 16-byte word.
        rows(pinned(&pixels), F32, 3, None, Some(3.0)),
    ];
    let other = Tensor::<Cuda>::full([1 << 20], 3.0, F32, &dev).unwrap();
    (&other + 1.0).unwrap().realize().unwrap();
    // Warm-up: the decode's module loaded (loading waits for the whole device).
    drop(Cuda::copy_host_rows(&dev, &srcs, 0..1).unwrap());
    kiln_backend_cuda::synchronize(&dev).unwrap();
    let bits = |t: &Tensor<Cuda>| -> Vec<u32> {
        let v = t.to_vec::<f32>().unwrap();
        v.iter().map(|v| v.to_bits()).collect()
    };
    let host = |bytes: &[u8], row: usize, d: f32, r: &std::ops::Range<usize>| -> Vec<u32> {
        let b = &bytes[r.start * row..r.end * row];
        b.iter().map(|&b| (b as f32 / d).to_bits()).collect()
    };
    let logits = Generator::new(3)
        .sample::<Cuda>(
            [7, 10],
            RandDist::Uniform {
                low: -1.0,
                high: 1.0,
            },
            F32,
            &dev,
        )
        .unwrap();
    for (k, range) in [1234..4321, 0..rows_n, 17..24, 9..9]
        .into_iter()
        .enumerate()
    {
        let n = range.len();
        let delayed = k == 0;
        if delayed {
            raw::delay_copies(&dev, 200_000).unwrap();
        }
        let t0 = Instant::now();
        let got = Cuda::copy_host_rows(&dev, &srcs, range.clone())
            .unwrap()
            .unwrap();
        if delayed && !launches_block() {
            let (_, unrelated_ms) = unrelated_work(&dev, &other, t0);
            println!("unrelated work done {unrelated_ms:.1} ms after a copy delayed by 200 ms");
            assert!(
                unrelated_ms < 100.0,
                "work that does not read the copy waited for it ({unrelated_ms:.1} ms)"
            );
        }
        let mut got = got.into_iter();
        let x = Tensor::<Cuda>::from_storage(got.next().unwrap(), [n, 784], F32);
        let y = Tensor::<Cuda>::from_storage(got.next().unwrap(), [n], DType::I64);
        let px = Tensor::<Cuda>::from_storage(got.next().unwrap(), [n, 784], F32);
        let px3 = Tensor::<Cuda>::from_storage(got.next().unwrap(), [n, 3], F32);
        // The first kernel that reads the copy (here delayed) sees its values.
        let x2 = (&x * 2.0).unwrap().to_vec::<f32>().unwrap();
        let want: Vec<f32> = feats[range.start * 784..range.end * 784]
            .iter()
            .map(|v| v * 2.0)
            .collect();
        assert!(x2 == want, "rows {range:?}: the features differ");
        assert_eq!(y.to_vec::<i64>().unwrap(), labels[range.clone()]);
        assert!(
            bits(&px) == host(&pixels, 784, 255.0, &range),
            "rows {range:?}: pixels decoded on the device differ from the host's byte / 255"
        );
        assert!(
            bits(&px3) == host(&pixels, 3, 3.0, &range),
            "rows {range:?}: 3-byte rows decoded differ"
        );
        // (With `KILN_CUDA_SYNC=1` every launch synchronizes.)
        if n >= 7 && !launches_block() {
            let s0 = thread_syncs();
            logits
                .cross_entropy(&y.narrow(0, 0, 7).unwrap(), Reduction::None)
                .unwrap();
            assert_eq!(thread_syncs(), s0, "the labels' id bound was carried");
        }
    }
    // Bad input.
    match Cuda::copy_host_rows(&dev, &srcs, 10..rows_n + 1) {
        Err(Error::InvalidArgument { op, msg }) => {
            assert_eq!(op, "copy_host_rows");
            assert!(msg.contains(&format!("{}", rows_n + 1)), "{msg}");
        }
        other => panic!("expected a typed error, got {:?}", other.map(|_| ())),
    }
    // An inverted range whose start lies past the rows.
    #[allow(clippy::reversed_empty_ranges)]
    let inverted = rows_n + 9..3;
    assert!(matches!(
        Cuda::copy_host_rows(&dev, &srcs, inverted),
        Err(Error::InvalidArgument { .. })
    ));
    assert_device_still_works(&other);
}
