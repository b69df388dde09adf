//! The profiler on the CPU backend: calls and bytes of a known sequence of ops (the check every
//! backend runs, `kiln_core::test_profile`), allocations reported by the backend, and a Chrome
//! trace that parses.

use kiln_backend_cpu::Cpu;
use kiln_core::Generator;
use kiln_core::profile::{self, Kind};
use kiln_core::test_profile::{check_chrome_trace, check_profile_counts};

#[test]
fn known_sequence_calls_bytes_and_allocations() {
    let dev = Cpu::device(0);
    let p = check_profile_counts::<Cpu>(&dev, "cpu-known-sequence", true);
    let mine = p.in_range("cpu-known-sequence");
    // exp and add each allocate their 64 x 16 f32 result inside their own span.
    for op in ["exp", "add"] {
        let row = mine.row(Kind::Op, op).unwrap();
        assert_eq!(row.alloc_bytes, 64 * 16 * 4, "{op}:\n{mine}");
    }
    let mem = mine.memory();
    assert!(
        mem.iter()
            .any(|m| m.name == "range cpu-known-sequence" && m.peak >= 64 * 16 * 4),
        "{mem:?}"
    );
    // On the CPU every op computes on the host: no framework-overhead share, no launches.
    let t = mine.totals();
    assert_eq!(t.compute_ns, t.host_ns);
    assert_eq!(t.overhead_ns, 0);
}

#[test]
fn trace_has_host_events_and_ranges() {
    let dev = Cpu::device(0);
    let (_, p) = profile::profile(|| {
        let _r = profile::range("cpu-trace");
        let x = Generator::new(1).rand::<Cpu>([1000], &dev).unwrap();
        let _f = profile::range("forward");
        x.exp().unwrap().sum_all().unwrap().to_scalar().unwrap()
    });
    let p = p.in_range("cpu-trace");
    let c = check_chrome_trace(&p.chrome_trace_json()).unwrap();
    assert!(c.host >= 4, "{c:?}");
    assert_eq!(c.ranges, 2);
    assert!(p.row(Kind::Range, "cpu-trace/forward").is_some());
}
