//! The profiler's tests (an integration test: they use the reference backend and
//! `test_profile`, which sit above `profile`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_core::profile::*;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::test_profile::{check_chrome_trace, check_profile_counts, parse_json};
use kiln_core::{DType, Tensor};

/// A device timer that counts how often it was resolved.
struct Fake(Arc<AtomicUsize>, DeviceTime);
impl DeviceTimer for Fake {
    fn resolve(&mut self) -> Option<DeviceTime> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Some(self.1)
    }
}

#[test]
fn counts_calls_and_bytes_of_a_known_sequence_on_the_reference_backend() {
    let p = check_profile_counts::<Reference>(&RefDevice(0), "ref-known-sequence", false);
    let mine = p.in_range("ref-known-sequence");
    // The reference backend computes on the host: compute time, no launches.
    let t = mine.totals();
    assert!(t.compute_ns > 0 && t.compute_ns == t.host_ns, "{t:?}");
    assert!(mine.where_ran().contains("from_host"));
}

#[test]
fn nested_ops_and_ranges_carry_their_parents() {
    let dev = RefDevice(0);
    let (_, p) = profile(|| {
        let _outer = range("nest-outer");
        let _inner = range("inner");
        let a = Tensor::<Reference>::ones([3, 4], DType::F32, &dev).unwrap();
        // A broadcast operand is neither row- nor column-major: matmul copies it.
        let b = Tensor::<Reference>::ones([4, 1], DType::F32, &dev)
            .unwrap()
            .broadcast_to([4, 5])
            .unwrap();
        a.matmul(&b).unwrap();
    });
    let mine = p.in_range("nest-outer");
    assert!(mine.row(Kind::Range, "nest-outer").is_some());
    assert!(mine.row(Kind::Range, "nest-outer/inner").is_some());
    let mm = mine.find(Kind::Op, "matmul").next().expect("matmul span");
    assert_eq!(mm.depth, 0);
    assert_eq!(mm.range.as_deref(), Some("nest-outer/inner"));
    assert_eq!(mm.detail, "f32 [3, 4] [4, 5]", "dtype and operand shapes");
    let c = mine
        .find(Kind::Op, "contiguous")
        .next()
        .expect("a copy inside matmul");
    assert_eq!((c.depth, c.op), (1, Some("matmul")));
    assert!(c.start_ns >= mm.start_ns && c.start_ns + c.dur_ns <= mm.start_ns + mm.dur_ns);
    // The inner range's records count for the outer one too, not the other way round.
    assert!(mine.in_range("nest-outer/inner").records().len() < mine.records().len());
    assert_eq!(
        p.in_range("nest-out").records().len(),
        0,
        "a prefix is not a path"
    );
}

#[test]
fn device_timers_resolve_at_collection_not_before() {
    let n = Arc::new(AtomicUsize::new(0));
    let s = start();
    {
        let _r = range("timers");
        for i in 0..3u64 {
            let mut ev = Event::new(Kind::Launch(LaunchKind::Fused), "fused", "gpu:7");
            ev.detail = "exp, add".into();
            ev.stream = 5;
            ev.timer = Some(Box::new(Fake(
                n.clone(),
                DeviceTime {
                    start_ns: 1_000 * i,
                    dur_ns: 500,
                },
            )));
            record(ev);
        }
        let mut ev = Event::new(Kind::Copy(CopyKind::DeviceToHost), "to_host", "gpu:7");
        ev.bytes = 4096;
        ev.dur_ns = 2_000;
        record(ev);
        let mut ev = Event::new(Kind::Sync, "synchronize", "gpu:7");
        ev.dur_ns = 7_000;
        record(ev);
        let mut ev = Event::new(Kind::Alloc, "alloc", "gpu:7");
        ev.bytes = 1 << 20;
        ev.mem_in_use = Some(3 << 20);
        record(ev);
    }
    assert_eq!(
        n.load(Ordering::SeqCst),
        0,
        "nothing resolved while recording"
    );
    let p = s.finish().in_range("timers");
    assert_eq!(n.load(Ordering::SeqCst), 3);
    let row = p.row(Kind::Launch(LaunchKind::Fused), "fused").unwrap();
    assert_eq!((row.calls, row.device_ns), (3, 1_500));
    let t = p.totals();
    assert_eq!(t.compute_ns, 1_500);
    assert_eq!(t.transfer_ns, 2_000, "untimed copy: its host time");
    assert_eq!(t.sync_ns, 7_000);
    let copy = p
        .row(Kind::Copy(CopyKind::DeviceToHost), "to_host")
        .unwrap();
    assert_eq!(copy.bytes, 4096);
    let mem = p.memory();
    let r = mem.iter().find(|m| m.name == "range timers").unwrap();
    assert_eq!(
        (r.peak, r.current, r.alloc_bytes),
        (3 << 20, 3 << 20, 1 << 20)
    );
    assert!(
        p.where_ran().contains("exp, add"),
        "fused programs list their ops"
    );
    let counts = check_chrome_trace(&p.chrome_trace_json()).unwrap();
    assert_eq!(counts.device, 3, "one device span per timed launch");
    assert_eq!(counts.ranges, 1);
    assert!(counts.host >= 6);
}

#[test]
fn trace_exports_to_a_file_that_parses() {
    let dev = RefDevice(0);
    let (_, p) = profile(|| {
        let _r = range("trace \"quoted\"\n\\ range");
        let x = Tensor::<Reference>::ones([8], DType::F32, &dev).unwrap();
        x.exp().unwrap().sum_all().unwrap().to_scalar().unwrap();
    });
    let p = p.in_range("trace \"quoted\"\n\\ range");
    let path = std::env::temp_dir().join(format!("kiln-trace-{}.json", std::process::id()));
    p.export_chrome_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let c = check_chrome_trace(&text).unwrap();
    assert!(c.host >= 4 && c.ranges == 1, "{c:?}");
    let v = parse_json(&text).unwrap();
    let names: Vec<&str> = match v.get("traceEvents") {
        Some(kiln_core::test_profile::Json::Arr(e)) => {
            e.iter().filter_map(|e| e.get("name")?.as_str()).collect()
        }
        _ => panic!("no events"),
    };
    assert!(
        names.contains(&"trace \"quoted\"\n\\ range"),
        "escaped and read back"
    );
    assert!(names.contains(&"exp") && names.contains(&"sum"));
    let bad = p.export_chrome_trace("/nonexistent-dir/x/trace.json");
    assert!(matches!(bad, Err(kiln_core::Error::Io { .. })));
}

#[test]
fn the_json_checker_rejects_broken_traces() {
    assert!(parse_json(r#"{"a":[1,2.5e3,-0.1,"x\u0041"],"b":null}"#).is_ok());
    assert!(parse_json(r#"{"a":1,}"#).is_err());
    assert!(parse_json("\"a\nb\"").is_err());
    assert!(check_chrome_trace(r#"{"events":[]}"#).is_err());
    let unbalanced = r#"{"traceEvents":[{"ph":"B","name":"r","pid":0,"tid":0,"ts":1}]}"#;
    assert!(check_chrome_trace(unbalanced).is_err());
    let no_dur = r#"{"traceEvents":[{"ph":"X","name":"r","pid":0,"tid":0,"ts":1}]}"#;
    assert!(check_chrome_trace(no_dur).is_err());
}

#[test]
fn json_strings_are_escaped() {
    assert_eq!(json_str("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
}

#[test]
fn the_table_is_sorted_by_time() {
    let (_, p) = profile(|| {
        let _r = range("sorted");
        for (name, d) in [("short", 10u64), ("long", 1_000), ("mid", 100)] {
            let mut ev = Event::new(Kind::Launch(LaunchKind::Kernel), name, "gpu:9");
            ev.dur_ns = d;
            record(ev);
        }
    });
    let rows: Vec<String> = p
        .in_range("sorted")
        .key_averages()
        .into_iter()
        .filter(|r| r.kind == "kernel")
        .map(|r| r.name)
        .collect();
    assert_eq!(rows, ["long", "mid", "short"]);
    assert!(p.to_string().contains("where did it run"));
}

#[test]
fn launches_left_untimed_by_sampling_get_their_names_mean() {
    let n = Arc::new(AtomicUsize::new(0));
    let s = start();
    {
        let _r = range("sampled");
        for i in 0..10u64 {
            let mut ev = Event::new(Kind::Launch(LaunchKind::Kernel), "k", "gpu:3");
            if i < 4 {
                ev.timer = Some(Box::new(Fake(
                    n.clone(),
                    DeviceTime {
                        start_ns: 1_000 * i,
                        dur_ns: 10 * (i + 1),
                    },
                )));
            } else {
                ev.sampled_out = true;
            }
            record(ev);
        }
        // A name with no timed launch gets no estimate.
        let mut ev = Event::new(Kind::Launch(LaunchKind::Kernel), "never", "gpu:3");
        ev.sampled_out = true;
        record(ev);
    }
    let p = s.finish().in_range("sampled");
    // Timed: 10 + 20 + 30 + 40; six more at the mean, 25.
    let row = p.row(Kind::Launch(LaunchKind::Kernel), "k").unwrap();
    assert_eq!((row.calls, row.device_ns), (10, 100 + 6 * 25));
    assert_eq!(p.totals().compute_ns, 250);
    let never = p
        .find(Kind::Launch(LaunchKind::Kernel), "never")
        .next()
        .unwrap();
    assert!(never.device_estimated && never.device_time.is_none());
    let c = check_chrome_trace(&p.chrome_trace_json()).unwrap();
    assert_eq!(
        c.device, 4,
        "device spans only for the timed launches: {c:?}"
    );
    assert!(p.table().contains("4 of 11 timed"), "{}", p.table());
}

#[test]
fn a_device_label_is_one_string_whatever_thread_asks() {
    let here = device_label(&RefDevice(3));
    let there = std::thread::spawn(|| device_label(&RefDevice(3)))
        .join()
        .unwrap();
    assert_eq!(here, RefDevice(3).to_string());
    assert!(std::ptr::eq(here, there), "one leaked label per device");
}

/// Allocations and op spans are written compactly on the hot path (`record_alloc`, `OpSpan`'s
/// drop) and made into records at collection: each keeps its enclosing op, depth, range,
/// device, stream, bytes and detail, and the memory view sees the allocation.
#[test]
fn compact_allocations_and_spans_keep_op_range_and_depth() {
    let s = start();
    {
        let _r = range("compact");
        let _outer = op("outer_op", "gpu:3", OpDetail::new(DType::F32), 0, false);
        record_alloc("alloc", "gpu:3", 5, 1 << 10, 7 << 10);
        let mut d = OpDetail::new(DType::F32);
        d.push(&[2, 3]);
        drop(op("inner_op", "gpu:3", d, 24, true));
    }
    let p = s.finish().in_range("compact");
    let a = p.find(Kind::Alloc, "alloc").next().expect("the allocation");
    assert_eq!(
        (a.op, a.depth, a.stream, a.bytes, a.mem_in_use),
        (Some("outer_op"), 1, 5, 1 << 10, Some(7 << 10))
    );
    assert_eq!((&*a.device, a.range.as_deref()), ("gpu:3", Some("compact")));
    let inner = p.find(Kind::Op, "inner_op").next().expect("the inner span");
    assert_eq!(
        (inner.op, inner.depth, inner.bytes, inner.elementwise),
        (Some("outer_op"), 1, 24, true)
    );
    assert_eq!(inner.detail, "f32 [2, 3]");
    let outer = p.find(Kind::Op, "outer_op").next().expect("the outer span");
    assert_eq!(
        (outer.op, outer.depth, outer.range.as_deref()),
        (None, 0, Some("compact"))
    );
    assert!(outer.start_ns <= a.start_ns && a.start_ns <= outer.start_ns + outer.dur_ns);
    let mem = p.memory();
    let r = mem.iter().find(|m| m.name == "range compact").unwrap();
    assert_eq!((r.peak, r.alloc_bytes), (7 << 10, 1 << 10));
}
