//! GPU tests: the conformance suite against the reference, CUDA against the CPU on the same
//! random inputs, and what only a real device shows (out-of-memory, error flags, memory
//! statistics, bit-identical Philox, > 2^31 elements, peer copies, TF32).
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip, set_allow_tf32, thread_syncs, try_all_gpus};
use kiln_core::{Backend, DType, Error, Generator, RandDist, Reduction, Tensor, philox};

#[test]
fn conformance_against_reference() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // Sixteen threads: the groups' programs compile in parallel (NVRTC, empty caches).
    kiln_core::testing::run_parallel::<Cuda, Cpu>(&dev, None, 16);
}

#[test]
fn cuda_matches_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    kiln_core::testing::run_parallel::<Cuda, Cpu>(&dev, Some(&Cpu::device(0)), 8);
}

#[test]
fn softmax_on_every_axis_matches_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let v: Vec<f32> = (0..6 * 33 * 17)
        .map(|i| ((i * 37 + 11) % 23) as f32 * 0.37 - 4.1)
        .collect();
    let g = Tensor::<Cuda>::from_slice(&v, [6, 33, 17], &dev).unwrap();
    let c = Tensor::<Cpu>::from_slice(&v, [6, 33, 17], &Cpu::device(0)).unwrap();
    for dim in [0isize, 1, 2, -1, -2, -3] {
        for log in [false, true] {
            let (yg, yc) = if log {
                (g.log_softmax(dim).unwrap(), c.log_softmax(dim).unwrap())
            } else {
                (g.softmax(dim).unwrap(), c.softmax(dim).unwrap())
            };
            let (a, b) = (yg.to_vec::<f32>().unwrap(), yc.to_vec::<f32>().unwrap());
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(worst < 1e-5, "softmax(dim {dim}, log {log}): {worst}");
        }
    }
}

#[test]
fn out_of_memory_is_a_typed_error_and_the_device_recovers() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let total = dev.total_memory().unwrap();
    let too_much = total * 2;
    let r = Tensor::<Cuda>::zeros([too_much / 4], DType::F32, &dev);
    match r {
        Err(Error::OutOfMemory {
            requested, device, ..
        }) => {
            assert_eq!(requested, too_much);
            assert_eq!(device, "cuda:0");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Fill most of the card, then ask for more than is left: the retry path runs.
    let big = Tensor::<Cuda>::zeros([total / 4 / 8 * 5], DType::F32, &dev).unwrap();
    let r = Tensor::<Cuda>::zeros([total / 4 / 2], DType::F32, &dev);
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    println!("OOM test: {}", r.unwrap_err());
    drop(big);
    // Still usable.
    let x = Tensor::<Cuda>::arange(0.0, 10.0, 1.0, DType::F32, &dev).unwrap();
    let s = x.sum_all().unwrap().to_scalar().unwrap();
    assert_eq!(s, 45.0);
    let y = Tensor::<Cuda>::zeros([total / 4 / 2], DType::F32, &dev);
    assert!(
        y.is_ok(),
        "after freeing, half the card must be allocatable"
    );
}

#[test]
fn index_errors_are_typed_and_the_device_stays_usable() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Tensor::<Cuda>::arange(0.0, 12.0, 1.0, DType::F32, &dev)
        .unwrap()
        .reshape([3, 4])
        .unwrap();
    let bad = Tensor::<Cuda>::from_vec(vec![0i64, 7], [2], &dev).unwrap();
    let e = x.index_select(0, &bad).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "index_select",
                index: 7,
                size: 3
            }
        ),
        "{e:?}"
    );
    let labels = Tensor::<Cuda>::from_vec(vec![0i64, -1, 2], [3], &dev).unwrap();
    let e = x.cross_entropy(&labels, Reduction::None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "cross_entropy",
                index: -1,
                size: 4
            }
        ),
        "{e:?}"
    );
    // The flag was cleared: valid ops work and report no stale error.
    let good = Tensor::<Cuda>::from_vec(vec![2i64, 0], [2], &dev).unwrap();
    let y = x.index_select(0, &good).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(y, vec![8., 9., 10., 11., 0., 1., 2., 3.]);
    Cuda::synchronize(&dev).unwrap();
}

#[test]
fn index_select_matches_the_cpu_on_whole_rows_and_on_the_rest() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    // (table dims, axis, dtype, element offset of the table in its storage, ids): whole 16-byte
    // rows take the warp-per-row kernel (an embedding's [84, 384] lookup, rows after a leading
    // dim, bf16 rows of 8, u8 rows of 16); 8- and 12-byte rows, a table starting 4 bytes into
    // its storage and a selection of columns take the element kernel.
    type Case = (Vec<usize>, isize, DType, usize, Vec<i64>);
    let many: Vec<i64> = (0..1000).map(|i| (i * 37 % 84) as i64).collect();
    let cases: Vec<Case> = vec![
        (vec![84, 384], 0, DType::F32, 0, many),
        (vec![2, 7, 8], 1, DType::F32, 0, vec![6, 0, 3, 3, 1]),
        (vec![50, 8], 0, DType::BF16, 0, vec![49, 0, 7, 7, 20, 1]),
        (vec![6, 16], 0, DType::U8, 0, vec![5, 1, 0]),
        (vec![6, 2], 0, DType::F64, 0, vec![5, 1, 0, 4]),
        (vec![6, 2], 0, DType::F32, 0, vec![5, 1, 0, 4]),
        (vec![5, 3], 0, DType::F32, 0, vec![4, 0, 2]),
        (vec![10, 4], 0, DType::F32, 1, vec![9, 0, 5]),
        (vec![4, 8], 1, DType::F32, 0, vec![7, 0, 2]),
    ];
    for (dims, axis, dtype, offset, ids) in cases {
        let n: usize = dims.iter().product::<usize>() + offset;
        let vals: Vec<f32> = (0..n).map(|i| (i % 251) as f32).collect();
        let len = ids.len();
        let got = Tensor::<Cuda>::from_slice(&vals, [n], &dev)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.narrow(0, offset, n - offset))
            .and_then(|t| t.reshape(dims.clone()))
            .and_then(|t| t.index_select(axis, &Tensor::from_vec(ids.clone(), [len], &dev)?))
            .and_then(|t| t.to_f64_vec())
            .unwrap();
        let want = Tensor::<Cpu>::from_slice(&vals, [n], &cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.narrow(0, offset, n - offset))
            .and_then(|t| t.reshape(dims.clone()))
            .and_then(|t| t.index_select(axis, &Tensor::from_vec(ids, [len], &cpu)?))
            .and_then(|t| t.to_f64_vec())
            .unwrap();
        assert_eq!(got, want, "{dims:?} axis {axis} {dtype} offset {offset}");
    }
    // An id out of range in a whole-row lookup: a typed error, and the device stays usable.
    let table = Tensor::<Cuda>::ones([84, 384], DType::F32, &dev).unwrap();
    let bad = Tensor::<Cuda>::from_vec(vec![3i64, 84, 0], [3], &dev).unwrap();
    let e = table.index_select(0, &bad).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "index_select",
                index: 84,
                size: 84
            }
        ),
        "{e:?}"
    );
    let ok = Tensor::<Cuda>::from_vec(vec![83i64], [1], &dev).unwrap();
    let row = table.index_select(0, &ok).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(row, vec![1.0; 384]);
}

/// An embedding's backward (`scatter_add` of f32 rows of whole 16-byte vectors, one id a row)
/// takes the warp-per-row kernel; the rest (12-byte rows, a source starting one element into
/// its storage, f64) the element kernel; each equals the CPU exactly (small integers: every
/// order of the additions gives the same sum), repeated ids accumulating. A bad id is a typed
/// error.
#[test]
fn scatter_add_matches_the_cpu_on_whole_rows_and_on_the_rest() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    // (table rows, columns, dtype, element offset of the source in its storage, ids)
    type Case = (usize, usize, DType, usize, Vec<i64>);
    let many: Vec<i64> = (0..1000).map(|i| (i * 37 % 65) as i64).collect();
    let cases: Vec<Case> = vec![
        (65, 384, DType::F32, 0, many.clone()),
        (65, 384, DType::F32, 384, many),
        (9, 4, DType::F32, 0, vec![8, 0, 3, 3, 8, 1]),
        (9, 4, DType::F32, 1, vec![8, 0, 3, 3, 8, 1]),
        (9, 3, DType::F32, 0, vec![8, 0, 3, 3]),
        (9, 4, DType::F64, 0, vec![8, 0, 3, 3]),
    ];
    fn run<B: Backend>(c: &Case, dev: &B::Device) -> Vec<f64> {
        let (rows, cols, dtype, offset, ids) = c;
        let n = ids.len() * cols + offset;
        let vals: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let src = Tensor::<B>::from_slice(&vals, [n], dev)
            .and_then(|t| t.to_dtype(*dtype))
            .and_then(|t| t.narrow(0, *offset, n - offset))
            .and_then(|t| t.reshape([ids.len(), *cols]))
            .unwrap();
        let ids = Tensor::<B>::from_vec(ids.clone(), [ids.len(), 1], dev)
            .and_then(|t| t.broadcast_to([ids.len(), *cols]))
            .unwrap();
        Tensor::<B>::ones([*rows, *cols], *dtype, dev)
            .and_then(|t| t.scatter_add(0, &ids, &src))
            .and_then(|t| t.to_f64_vec())
            .unwrap()
    }
    for c in &cases {
        assert_eq!(
            run::<Cuda>(c, &dev),
            run::<Cpu>(c, &cpu),
            "{:?}",
            (c.0, c.1, c.2, c.3)
        );
    }
    let table = Tensor::<Cuda>::zeros([65, 384], DType::F32, &dev).unwrap();
    let src = Tensor::<Cuda>::ones([3, 384], DType::F32, &dev).unwrap();
    let bad = Tensor::<Cuda>::from_vec(vec![3i64, 65, 0], [3, 1], &dev)
        .and_then(|t| t.broadcast_to([3, 384]))
        .unwrap();
    let e = table.scatter_add(0, &bad, &src).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "scatter_add",
                index: 65,
                size: 65
            }
        ),
        "{e:?}"
    );
    let good = Tensor::<Cuda>::from_vec(vec![64i64], [1, 1], &dev)
        .and_then(|t| t.broadcast_to([1, 384]))
        .unwrap();
    let one = Tensor::<Cuda>::ones([1, 384], DType::F32, &dev).unwrap();
    let sum = table
        .scatter_add(0, &good, &one)
        .unwrap()
        .sum_all()
        .unwrap();
    assert_eq!(sum.to_scalar().unwrap(), 384.0);
}

/// Cross-entropy and its gradient against the CPU on rows longer than the conformance suite's
/// 1-13 classes (a GPT's 65, 1024, 1025, 2000, 5000: blocks of 32 to 256 threads a row),
/// contiguous and transposed logits.
#[test]
fn cross_entropy_matches_the_cpu_on_short_and_long_rows() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    for (rows, cols, transposed) in [
        (333, 65, false),
        (40, 1024, false),
        (5, 1025, false),
        (3, 5000, false),
        (9, 65, true),
        (4, 2000, true),
    ] {
        let labels: Vec<i64> = (0..rows).map(|r| (r * 7919 % cols) as i64).collect();
        let run = |on_gpu: bool| -> (Vec<f64>, Vec<f64>) {
            fn go<B: Backend>(
                dev: &B::Device,
                rows: usize,
                cols: usize,
                transposed: bool,
                labels: &[i64],
            ) -> (Vec<f64>, Vec<f64>) {
                let dims = if transposed {
                    [cols, rows]
                } else {
                    [rows, cols]
                };
                let mut x = Generator::new(11)
                    .uniform::<Cpu>(dims, -4.0, 4.0, &Cpu::device(0))
                    .and_then(|t| t.to_vec::<f32>())
                    .and_then(|v| Tensor::<B>::from_vec(v, dims, dev))
                    .unwrap();
                if transposed {
                    x = x.t().unwrap();
                }
                let y = Tensor::<B>::from_vec(labels.to_vec(), [rows], dev).unwrap();
                let g = Tensor::<B>::full([rows], 0.5, DType::F32, dev).unwrap();
                let loss = x.cross_entropy(&y, Reduction::None).unwrap();
                let dx = x.cross_entropy_backward(&y, &g).unwrap();
                (loss.to_f64_vec().unwrap(), dx.to_f64_vec().unwrap())
            }
            if on_gpu {
                go::<Cuda>(&dev, rows, cols, transposed, &labels)
            } else {
                go::<Cpu>(&cpu, rows, cols, transposed, &labels)
            }
        };
        let ((lg, dg), (lc, dc)) = (run(true), run(false));
        for (what, got, want) in [("loss", &lg, &lc), ("grad", &dg, &dc)] {
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{rows}x{cols} transposed {transposed}: {what}[{i}] {a} against {b}"
                );
            }
        }
    }
}

#[test]
fn checked_labels_are_not_checked_again_until_written() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let logits = Generator::new(7)
        .uniform::<Cuda>([4, 5], -1.0, 1.0, &dev)
        .unwrap();
    let ones = Tensor::<Cuda>::ones([4], DType::F32, &dev).unwrap();
    // Labels uploaded from the host were scanned there: no check needs the device's flag, so
    // a training step over a fresh batch does not wait for the GPU.
    let labels = Tensor::<Cuda>::from_vec(vec![0i64, 4, 2, 1], [4], &dev).unwrap();
    let s0 = thread_syncs();
    logits.cross_entropy(&labels, Reduction::None).unwrap();
    logits.cross_entropy_backward(&labels, &ones).unwrap();
    assert_eq!(thread_syncs(), s0, "host-scanned labels need no flag read");
    // Labels written on the device are checked there, once.
    let four = Tensor::<Cuda>::from_vec(vec![4i64], [1], &dev).unwrap();
    let labels = labels.slice_assign(0, 0, &four).unwrap();
    let s0 = thread_syncs();
    logits.cross_entropy(&labels, Reduction::None).unwrap();
    assert_eq!(
        thread_syncs(),
        s0 + 1,
        "the forward pass reads the error flag"
    );
    logits.cross_entropy_backward(&labels, &ones).unwrap();
    assert_eq!(
        thread_syncs(),
        s0 + 1,
        "the same labels passed that check already"
    );
    // An in-place write forgets the check: an out-of-range label is caught again.
    let bad = Tensor::<Cuda>::from_vec(vec![9i64], [1], &dev).unwrap();
    let labels = labels.slice_assign(0, 3, &bad).unwrap();
    let e = logits.cross_entropy_backward(&labels, &ones).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                index: 9,
                size: 5,
                ..
            }
        ),
        "{e}"
    );
    let mut raw = Cuda::from_host(&dev, &kiln_core::HostBuffer::I64(vec![0, 4, 2, 1])).unwrap();
    let l = kiln_core::Layout::contiguous([4]);
    let xl = kiln_core::Layout::contiguous([4, 5]);
    let gl = kiln_core::Layout::contiguous([4]);
    let (x, g) = (logits.storage(), ones.storage());
    Cuda::cross_entropy(x, &xl, &raw, &l, DType::F32).unwrap();
    let bad = Cuda::from_host(&dev, &kiln_core::HostBuffer::I64(vec![7])).unwrap();
    let one = kiln_core::Layout::contiguous([1]);
    let at3 = l.narrow(0, 3, 1).unwrap();
    Cuda::copy_into(&bad, &one, &mut raw, &at3, DType::I64).unwrap();
    let e = Cuda::cross_entropy_backward(x, &xl, &raw, &l, g, &gl, DType::F32).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                index: 7,
                size: 5,
                ..
            }
        ),
        "{e}"
    );
}

/// A batch of labels picked on the device from labels already there (a dataset kept on the
/// GPU) keeps the bound known of its source: the step's cross-entropy does not wait for the
/// GPU, while an index that the pick itself gets wrong is still caught.
#[test]
fn labels_picked_on_the_device_keep_their_bound() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let logits = Generator::new(7)
        .uniform::<Cuda>([3, 5], -1.0, 1.0, &dev)
        .unwrap();
    let all = Tensor::<Cuda>::from_vec(vec![0i64, 4, 2, 1, 3, 0], [6], &dev).unwrap();
    let order = Tensor::<Cuda>::from_vec(vec![5i64, 1, 3, 2, 0, 4], [6], &dev).unwrap();
    let ids = order.narrow(0, 3, 3).unwrap();
    let s0 = thread_syncs();
    let picked = all.index_select(0, &ids).unwrap();
    let gathered = all.gather(0, &ids).unwrap();
    logits.cross_entropy(&picked, Reduction::None).unwrap();
    logits.cross_entropy(&gathered, Reduction::None).unwrap();
    assert_eq!(
        thread_syncs(),
        s0,
        "picked labels inherit the upload's scan"
    );
    assert_eq!(picked.to_vec::<i64>().unwrap(), vec![2, 0, 3]);
    // Labels of another bound: the cross-entropy over 5 classes catches a 7.
    let wide = Tensor::<Cuda>::from_vec(vec![7i64, 1, 2], [3], &dev).unwrap();
    let first = Tensor::<Cuda>::from_vec(vec![0i64, 1, 2], [3], &dev).unwrap();
    let picked = wide.index_select(0, &first).unwrap();
    let e = logits.cross_entropy(&picked, Reduction::None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                index: 7,
                size: 5,
                ..
            }
        ),
        "{e:?}"
    );
    // Indices out of range are still caught by the pick (no bound is passed on then).
    let bad = Tensor::<Cuda>::from_vec(vec![0i64, 9], [2], &dev).unwrap();
    assert!(all.index_select(0, &bad).is_err());
    assert!(
        logits
            .cross_entropy(&all.narrow(0, 0, 3).unwrap(), Reduction::None)
            .is_ok()
    );
}

#[test]
fn memory_stats_track_use_and_empty_cache_trims() {
    let Some(dev) = gpu_or_skip(0) else { return };
    Cuda::synchronize(&dev).unwrap();
    let before = Cuda::memory_stats(&dev).unwrap();
    let x = Tensor::<Cuda>::zeros([1 << 20], DType::F32, &dev).unwrap();
    let during = Cuda::memory_stats(&dev).unwrap();
    assert_eq!(during.in_use, before.in_use + (4 << 20));
    assert!(during.peak >= during.in_use);
    assert!(during.reserved >= during.in_use);
    drop(x);
    let after = Cuda::memory_stats(&dev).unwrap();
    assert_eq!(after.in_use, before.in_use);
    Cuda::empty_cache(&dev).unwrap();
    let trimmed = Cuda::memory_stats(&dev).unwrap();
    assert!(trimmed.reserved <= during.reserved);
}

#[test]
fn philox_uniforms_are_bit_identical_to_core() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let n = 100_003;
    let (seed, lo, hi) = (0x1234_5678_9abc_def0u64, -3.0, 5.5);
    // A generator's first draw is Philox under the key `draw_key(seed, 0)`.
    let key = philox::draw_key(seed, 0);
    let g = Generator::new(seed)
        .uniform::<Cuda>([n], lo, hi, &dev)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for (i, v) in g.iter().enumerate() {
        let want = philox::uniform_f32(key, i as u64, lo as f32, hi as f32);
        assert_eq!(v.to_bits(), want.to_bits(), "element {i}");
    }
    let g = Generator::new(seed)
        .sample::<Cuda>(
            [n],
            RandDist::Uniform { low: lo, high: hi },
            DType::F64,
            &dev,
        )
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    for (i, v) in g.iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            philox::uniform_f64(key, i as u64, lo, hi).to_bits()
        );
    }
    let c = Generator::new(seed)
        .uniform::<Cpu>([n], lo, hi, &Cpu::device(0))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let g = Generator::new(seed)
        .uniform::<Cuda>([n], lo, hi, &dev)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(
        c.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()),
        "CPU vs CUDA"
    );
}

#[test]
fn more_than_2_pow_31_elements_use_64_bit_indexing() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let n: usize = (1 << 31) + 40;
    if dev.total_memory().unwrap() < n * 8 * 4 {
        println!("skipped: needs {} GiB of GPU memory", (n * 8 * 4) >> 30);
        return;
    }
    let x = Tensor::<Cuda>::ones([n], DType::I64, &dev).unwrap();
    let y = x.add_scalar(2.0).unwrap(); // contiguous path
    assert_eq!(y.sum_all().unwrap().to_scalar().unwrap(), 3.0 * n as f64);
    // Strided path with 64-bit offsets: a transposed view, made contiguous.
    let m = y
        .narrow(0, 0, (1 << 31) + 32)
        .unwrap()
        .reshape([8, (1 << 28) + 4])
        .unwrap();
    let t = m.t().unwrap().contiguous().unwrap();
    let tail = t
        .narrow(0, (1 << 28) + 3, 1)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    assert_eq!(tail, vec![3; 8]);
    let v = y.narrow(0, n - 3, 3).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(v, vec![3, 3, 3]);
}

#[test]
fn tf32_is_off_by_default_and_can_be_enabled() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // Entries with more mantissa bits than TF32 keeps: exact f32 products differ from TF32's.
    let a: Vec<f32> = (0..64 * 64)
        .map(|i| 1.0 + (i % 97) as f32 * 1.0e-4)
        .collect();
    let ta = Tensor::<Cuda>::from_slice(&a, [64, 64], &dev).unwrap();
    let tc = Tensor::<Cpu>::from_slice(&a, [64, 64], &Cpu::device(0)).unwrap();
    let exact = tc.matmul(&tc).unwrap().to_vec::<f32>().unwrap();
    let err = |g: &[f32]| {
        g.iter()
            .zip(&exact)
            .map(|(x, y)| ((x - y) / y).abs())
            .fold(0f32, f32::max)
    };
    let off = ta.matmul(&ta).unwrap().to_vec::<f32>().unwrap();
    assert!(err(&off) < 1e-5, "f32 matmul off by {}", err(&off));
    set_allow_tf32(true);
    let on = ta.matmul(&ta).unwrap().to_vec::<f32>().unwrap();
    set_allow_tf32(false);
    println!(
        "relative error: tf32 off {:e}, on {:e}",
        err(&off),
        err(&on)
    );
    assert!(err(&on) > err(&off), "TF32 should be visibly less exact");
}

#[test]
fn copies_between_gpus_and_transposed_views() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let all = try_all_gpus();
    let x = Tensor::<Cuda>::arange(0.0, 6.0, 1.0, DType::F32, &dev)
        .unwrap()
        .reshape([2, 3])
        .unwrap()
        .t()
        .unwrap();
    let same = x.copy_to(&dev).unwrap();
    assert!(!same.same_storage(&x));
    assert_eq!(same.to_vec::<f32>().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
    if all.len() < 2 {
        println!("peer copy: skipped: one CUDA device");
        return;
    }
    let other = all[1];
    let y = x.to_device(&other).unwrap();
    assert_eq!(y.device(), &other);
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
    let z = y.mul_scalar(2.0).unwrap().to_device(&dev).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![0., 6., 2., 8., 4., 10.]);
    let e = x.add(&y).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    println!("peer copy between cuda:0 and cuda:1 ok");
}

#[test]
fn large_transfers_round_trip_through_the_staging_ring() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let n = 10_000_019; // ~40 MB: several staging blocks, not a multiple of the block
    let v: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let t = Tensor::<Cuda>::from_slice(&v, [n], &dev).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), v);
    println!(
        "device: {} (sm_{})",
        dev.name().unwrap(),
        dev.compute_capability().unwrap()
    );
}

/// Products timed once per shape (`gemm_tune.rs`): cuBLASLt's algorithms (forced with
/// `GemmTuning::Lt`, so that they run whatever the timings) give cuBLAS's result within the
/// dtype's rounding and the same bits on every later call, at any operand alignment (views one
/// element in) and for the weight gradient's long inner dimension (split-K candidates); timed
/// tuning agrees too.
#[test]
fn tuned_products_match_cublas_and_keep_their_bits() {
    use kiln_backend_cuda::{GemmTuning, set_gemm_tuning, tuned_gemm_calls};
    let Some(dev) = gpu_or_skip(0) else { return };
    let host = |r: usize, c: usize, s: usize| -> Vec<f32> {
        (0..r * c)
            .map(|i| ((i * 7919 + s) % 1013) as f32 / 1013.0 - 0.5)
            .collect()
    };
    for (m, k, n) in [(384, 16384, 1152), (64, 4096, 96), (300, 77, 129)] {
        for dtype in [DType::F32, DType::BF16] {
            for offset in [0, 1] {
                // `a` is [m, k] read from column `offset` of [m, k + offset].
                let a = Tensor::<Cuda>::from_slice(&host(m, k + offset, 1), [m, k + offset], &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .narrow(1, offset, k)
                    .unwrap();
                let b = Tensor::<Cuda>::from_slice(&host(k, n, 2), [k, n], &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let run = |mode| -> Vec<f32> {
                    set_gemm_tuning(mode);
                    let y = a.matmul(&b).unwrap().to_dtype(DType::F32).unwrap();
                    y.to_vec().unwrap()
                };
                let want = run(GemmTuning::Off);
                let calls = tuned_gemm_calls();
                let forced = [
                    run(GemmTuning::Lt),
                    run(GemmTuning::Lt),
                    run(GemmTuning::Lt),
                ];
                let ran = tuned_gemm_calls() - calls;
                let timed = run(GemmTuning::Timed);
                set_gemm_tuning(GemmTuning::Timed);
                let what = format!("{m}x{k}x{n} {dtype}, operand offset {offset}");
                assert!(ran >= 3, "{what}: cuBLASLt ran {ran} of 3 forced calls");
                let scale = want.iter().fold(0f32, |s, v| s.max(v.abs()));
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 } * scale;
                for (name, got) in [("forced Lt", &forced[0]), ("timed", &timed)] {
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    assert!(worst <= tol, "{what}, {name}: off by {worst} (tol {tol})");
                }
                assert_eq!(forced[1], forced[2], "{what}: bits changed between calls");
                assert_eq!(forced[0], forced[1], "{what}: bits changed after measuring");
            }
        }
    }
}
