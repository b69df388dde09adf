//! The profiler on the GPU: the known-sequence check every backend runs (calls, bytes,
//! copies, a timed cuBLAS call), fused programs listing their ops, device spans on the stream
//! they ran on, no synchronization added per op, and a Chrome trace with device tracks.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cuda::{Cuda, Stream, gpu_or_skip, thread_syncs};
use kiln_core::profile::{self, Kind, LaunchKind};
use kiln_core::test_profile::{check_chrome_trace, check_profile_counts};
use kiln_core::{Backend, DType, Tensor};

#[test]
fn known_sequence_calls_bytes_copies_and_device_time() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let p = check_profile_counts::<Cuda>(&dev, "cuda-known-sequence", true);
    let mine = p.in_range("cuda-known-sequence");
    // exp and add are deferred and run as one fused program when the result is read.
    let fused: Vec<_> = mine
        .records()
        .iter()
        .filter(|r| r.kind == Kind::Launch(LaunchKind::Fused))
        .collect();
    assert!(!fused.is_empty(), "a fused program ran:\n{mine}");
    assert!(
        fused
            .iter()
            .any(|r| r.detail.contains("exp") && r.detail.contains("add")),
        "the fused program lists its ops: {fused:?}"
    );
    assert!(fused.iter().all(|r| r.device_time.is_some()), "{fused:?}");
    let t = mine.totals();
    assert!(t.compute_ns > 0 && t.sync_ns > 0, "{t:?}");
    let listing = mine.where_ran();
    assert!(listing.contains("cuda:0"), "{listing}");
    eprintln!("{mine}");
}

#[test]
fn profiling_adds_no_synchronization_per_op() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Tensor::<Cuda>::rand([230_400], -1.0, 1.0, 1, DType::F32, &dev).unwrap();
    x.exp().unwrap().realize().unwrap();
    Cuda::synchronize(&dev).unwrap();
    let (syncs, p) = profile::profile(|| {
        let _r = profile::range("no-sync-loop");
        let before = thread_syncs();
        for _ in 0..100 {
            x.exp().unwrap().realize().unwrap();
        }
        thread_syncs() - before
    });
    assert_eq!(
        syncs, 0,
        "the profiler waited for the device while recording"
    );
    let mine = p.in_range("no-sync-loop");
    let launches: Vec<_> = mine
        .records()
        .iter()
        .filter(|r| matches!(r.kind, Kind::Launch(_)))
        .collect();
    assert_eq!(launches.len(), 100, "one launch per realized exp:\n{mine}");
    // Resolved at collection: every launch has a device span, in order, not overlapping.
    let mut last_end = 0;
    for r in &launches {
        let d = r.device_time.expect("device time");
        assert!(
            d.start_ns + 1_000 >= last_end,
            "spans overlap on one stream"
        );
        last_end = d.start_ns + d.dur_ns;
    }
}

#[test]
fn device_spans_are_on_the_stream_they_ran_on() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let s = Stream::new(&dev).unwrap();
    let x = Tensor::<Cuda>::rand([1 << 16], -1.0, 1.0, 2, DType::F32, &dev).unwrap();
    let (_, p) = profile::profile(|| {
        let _r = profile::range("on-a-stream");
        s.scope(|| {
            let m = x.reshape([256, 256]).unwrap();
            m.matmul(&m).unwrap().realize().unwrap();
            x.exp().unwrap().sum_all().unwrap().to_scalar().unwrap();
        });
    });
    let mine = p.in_range("on-a-stream");
    let launched: Vec<_> = mine
        .records()
        .iter()
        .filter(|r| matches!(r.kind, Kind::Launch(_)))
        .collect();
    assert!(!launched.is_empty());
    for r in launched {
        assert_eq!(r.stream, s.as_raw() as u64, "{r:?}");
    }
    let c = check_chrome_trace(&p.chrome_trace_json()).unwrap();
    assert!(c.device > 0 && c.host > 0, "{c:?}");
}

#[test]
fn trace_file_has_host_and_device_events() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (_, p) = profile::profile(|| {
        let _r = profile::range("gpu-trace");
        let a = Tensor::<Cuda>::rand([128, 128], -1.0, 1.0, 3, DType::F32, &dev).unwrap();
        let _f = profile::range("forward");
        a.matmul(&a)
            .unwrap()
            .relu()
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
    });
    let path = std::env::temp_dir().join(format!("kiln-gpu-trace-{}.json", std::process::id()));
    p.in_range("gpu-trace").export_chrome_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let c = check_chrome_trace(&text).unwrap();
    assert!(c.host >= 3 && c.device >= 2 && c.ranges == 2, "{c:?}");
    assert!(text.contains("\"cuda:0\""), "a process per device");
}
