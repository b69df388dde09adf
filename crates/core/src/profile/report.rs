//! The views of a [`Profile`] as numbers and text: the per-op table, totals, where each op ran,
//! the memory view; and [`report`], which prints them at the end of a program.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::collect::collect;
use super::{CopyKind, Kind, LaunchKind, Profile, device_sample_every, env_on};

/// With `KILN_PROFILE=1`: collects everything recorded so far (and forgets it), prints the
/// table, the "where did it run" listing and the memory view to stderr, writes the Chrome
/// trace to `KILN_PROFILE_TRACE` if that is set, and returns the profile. `None` (and nothing
/// printed) when the variable is not set.
pub fn report() -> Option<Profile> {
    if !env_on() {
        return None;
    }
    let p = Profile::new(collect(0, true));
    eprintln!("{p}");
    if let Ok(path) = std::env::var("KILN_PROFILE_TRACE") {
        match p.export_chrome_trace(&path) {
            Ok(()) => eprintln!("kiln profile: Chrome trace written to {path}"),
            Err(e) => eprintln!("kiln profile: {e}"),
        }
    }
    Some(p)
}

// ---- the profile -------------------------------------------------------------------------

/// One row of [`Profile::key_averages`]: every record of one kind and name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub name: String,
    /// [`Kind::label`].
    pub kind: &'static str,
    pub calls: u64,
    pub host_ns: u64,
    /// Device time: of the record itself (launches, copies), or for an op of every launch and
    /// copy made inside it.
    pub device_ns: u64,
    /// Bytes copied (copies) or read (ops: their operands).
    pub bytes: u64,
    /// Bytes allocated (inside an op, or by the allocation itself).
    pub alloc_bytes: u64,
}

/// Where the time went, in total.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Device time of launches, plus the host time of ops on host devices (the CPU computes
    /// on the host).
    pub compute_ns: u64,
    /// Copies: device time where timed, host time otherwise.
    pub transfer_ns: u64,
    /// Host time waiting for devices.
    pub sync_ns: u64,
    /// Host time of top-level ops on devices that is not spent waiting or copying: the
    /// framework's own cost (validation, dispatch, launching).
    pub overhead_ns: u64,
    /// Host time of top-level ops.
    pub host_ns: u64,
}

/// Peak and current device memory seen by allocations, for one op kind or user range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemRow {
    pub name: String,
    pub device: String,
    pub allocs: u64,
    pub alloc_bytes: u64,
    /// Highest memory in use right after one of its allocations.
    pub peak: u64,
    /// Memory in use after its last allocation.
    pub current: u64,
}

/// Whether a device name (as it displays) is host memory: `cpu`, `cpu:N`, the reference
/// backend's `ref`, `ref:N`, or `host`. Ops there compute on the host.
pub fn is_host_device(d: &str) -> bool {
    let base = d.split(':').next().unwrap_or(d);
    matches!(base, "cpu" | "ref" | "host")
}

fn is_transfer_op(name: &str) -> bool {
    matches!(
        name,
        "from_host"
            | "from_slice"
            | "to_host"
            | "copy_to_slice"
            | "to_backend"
            | "copy_to"
            | "copy_from"
            | "pin_memory"
            | "full"
            | "rand"
    )
}

impl Profile {
    /// One row per kind and name (PyTorch's `key_averages`), sorted by time (the larger of host
    /// and device), largest first.
    pub fn key_averages(&self) -> Vec<Row> {
        let mut rows: BTreeMap<(Kind, &str), Row> = BTreeMap::new();
        let mut op_dev: BTreeMap<&str, u64> = BTreeMap::new();
        let mut op_alloc: BTreeMap<&str, u64> = BTreeMap::new();
        for r in &self.records {
            // Allocations are one row (each op's also show in its Allocated column).
            let name: &str = if r.kind == Kind::Alloc {
                "alloc"
            } else {
                &r.name
            };
            let row = rows.entry((r.kind, name)).or_insert_with(|| Row {
                name: name.to_string(),
                kind: r.kind.label(),
                ..Default::default()
            });
            row.calls += 1;
            row.host_ns += r.dur_ns;
            row.bytes += if r.kind == Kind::Alloc { 0 } else { r.bytes };
            if let Some(d) = r.device_time {
                row.device_ns += d.dur_ns;
            }
            if r.kind == Kind::Alloc {
                row.alloc_bytes += r.bytes;
            }
            if let Some(op) = r.op {
                match r.kind {
                    Kind::Launch(_) | Kind::Copy(_) => {
                        *op_dev.entry(op).or_default() += r.device_time.map_or(0, |d| d.dur_ns)
                    }
                    Kind::Alloc => *op_alloc.entry(op).or_default() += r.bytes,
                    _ => {}
                }
            }
        }
        let mut out: Vec<Row> = rows
            .into_iter()
            .map(|((kind, name), mut row)| {
                if kind == Kind::Op {
                    row.device_ns += op_dev.get(name).copied().unwrap_or(0);
                    row.alloc_bytes += op_alloc.get(name).copied().unwrap_or(0);
                }
                row
            })
            .collect();
        out.sort_by(|a, b| {
            b.host_ns
                .max(b.device_ns)
                .cmp(&a.host_ns.max(a.device_ns))
                .then_with(|| a.name.cmp(&b.name))
        });
        out
    }

    /// The row of kind `kind` named `name`, if any.
    pub fn row(&self, kind: Kind, name: &str) -> Option<Row> {
        self.key_averages()
            .into_iter()
            .find(|r| r.kind == kind.label() && r.name == name)
    }

    /// Where the time went (see [`Totals`]).
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        let mut inside = 0u64;
        for r in &self.records {
            match r.kind {
                Kind::Op if r.depth == 0 => {
                    t.host_ns += r.dur_ns;
                    if is_host_device(&r.device) {
                        t.compute_ns += r.dur_ns;
                    } else {
                        t.overhead_ns += r.dur_ns;
                    }
                }
                Kind::Launch(_) => t.compute_ns += r.device_time.map_or(0, |d| d.dur_ns),
                Kind::Copy(_) => {
                    t.transfer_ns += r.device_time.map_or(r.dur_ns, |d| d.dur_ns);
                    if r.depth > 0 && !is_host_device(&r.device) {
                        inside += r.dur_ns;
                    }
                }
                Kind::Sync => {
                    t.sync_ns += r.dur_ns;
                    if r.depth > 0 && !is_host_device(&r.device) {
                        inside += r.dur_ns;
                    }
                }
                _ => {}
            }
        }
        t.overhead_ns = t.overhead_ns.saturating_sub(inside);
        t
    }

    /// The key-averages table as text.
    pub fn table(&self) -> String {
        let rows = self.key_averages();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<34} {:<11} {:>7} {:>11} {:>10} {:>11} {:>10} {:>10} {:>10} {:>10}",
            "Name",
            "Type",
            "Calls",
            "Host total",
            "Host mean",
            "Dev total",
            "Dev mean",
            "Bytes",
            "Rate",
            "Allocated"
        );
        let _ = writeln!(s, "{}", "-".repeat(132));
        for r in &rows {
            let time = if r.device_ns > 0 {
                r.device_ns
            } else {
                r.host_ns
            };
            let rate = if r.bytes > 0 && time > 0 {
                format!("{:.2}GB/s", r.bytes as f64 / time as f64)
            } else {
                String::new()
            };
            let n = r.calls.max(1);
            let _ = writeln!(
                s,
                "{:<34} {:<11} {:>7} {:>11} {:>10} {:>11} {:>10} {:>10} {:>10} {:>10}",
                clip(&r.name, 34),
                r.kind,
                r.calls,
                fmt_ns(r.host_ns),
                fmt_ns(r.host_ns / n),
                if r.device_ns > 0 {
                    fmt_ns(r.device_ns)
                } else {
                    "-".into()
                },
                if r.device_ns > 0 {
                    fmt_ns(r.device_ns / n)
                } else {
                    "-".into()
                },
                fmt_bytes(r.bytes),
                rate,
                fmt_bytes(r.alloc_bytes),
            );
        }
        let t = self.totals();
        let _ = writeln!(
            s,
            "Totals: ops (top level, host) {} | device compute {} | transfers {} | sync waits {} | framework overhead {}",
            fmt_ns(t.host_ns),
            fmt_ns(t.compute_ns),
            fmt_ns(t.transfer_ns),
            fmt_ns(t.sync_ns),
            fmt_ns(t.overhead_ns)
        );
        let launches = self
            .records
            .iter()
            .filter(|r| matches!(r.kind, Kind::Launch(_)));
        let (n, est) = launches.fold((0, 0), |(n, e), r| (n + 1, e + r.device_estimated as u64));
        if est > 0 {
            let _ = writeln!(
                s,
                "Device times of launches: {} of {n} timed (1 in {} sampled at random; \
                 KILN_PROFILE_SAMPLE=1 times every launch), the rest estimated from their name's mean",
                n - est,
                device_sample_every()
            );
        }
        s
    }

    /// Theano's "did it run on the GPU?": per op, the devices it ran on, what it launched and
    /// whether it fell back (a host copy inside a compute op, an elementwise op launched on
    /// its own instead of fused, or a backend-reported fallback).
    pub fn where_ran(&self) -> String {
        #[derive(Default)]
        struct W {
            devices: std::collections::BTreeSet<String>,
            calls: u64,
            launches: BTreeMap<&'static str, u64>,
            fallback: std::collections::BTreeSet<String>,
            elementwise: bool,
        }
        let mut m: BTreeMap<&str, W> = BTreeMap::new();
        for r in &self.records {
            match r.kind {
                Kind::Op => {
                    let w = m.entry(&r.name).or_default();
                    w.calls += 1;
                    w.devices.insert(r.device.to_string());
                    w.elementwise |= r.elementwise;
                }
                Kind::Launch(_) | Kind::Copy(_) => {
                    let Some(op) = r.op else { continue };
                    let w = m.entry(op).or_default();
                    *w.launches.entry(r.kind.label()).or_default() += 1;
                    if let Some(f) = r.fallback {
                        w.fallback.insert(f.to_string());
                    }
                    if matches!(
                        r.kind,
                        Kind::Copy(CopyKind::DeviceToHost | CopyKind::HostToDevice)
                    ) && !is_transfer_op(op)
                    {
                        w.fallback.insert("host copy".into());
                    }
                }
                _ => {}
            }
        }
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<24} {:>7}  {:<14} {:<36} fallback",
            "Op", "Calls", "Device", "Ran as"
        );
        for (name, mut w) in m {
            if w.calls == 0 {
                continue;
            }
            let on_gpu = w.devices.iter().any(|d| !is_host_device(d));
            if on_gpu && w.elementwise && w.launches.contains_key("kernel") {
                w.fallback.insert("unfused".into());
            }
            let ran = if w.launches.is_empty() {
                if on_gpu && w.elementwise {
                    "deferred (fused later)".to_string()
                } else if on_gpu {
                    "no launch".into()
                } else {
                    "host".into()
                }
            } else {
                w.launches
                    .iter()
                    .map(|(k, n)| format!("{k} x{n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let fb = if w.fallback.is_empty() {
                "-".to_string()
            } else {
                format!(
                    "YES: {}",
                    w.fallback.into_iter().collect::<Vec<_>>().join(", ")
                )
            };
            let devs: Vec<String> = w.devices.into_iter().collect();
            let _ = writeln!(
                s,
                "{:<24} {:>7}  {:<14} {:<36} {}",
                clip(name, 24),
                w.calls,
                devs.join(","),
                clip(&ran, 36),
                fb
            );
        }
        let fused: std::collections::BTreeSet<&str> = self
            .records
            .iter()
            .filter(|r| r.kind == Kind::Launch(LaunchKind::Fused) && !r.detail.is_empty())
            .map(|r| r.detail.as_str())
            .collect();
        if !fused.is_empty() {
            let _ = writeln!(s, "Fused programs:");
            for f in fused {
                let _ = writeln!(s, "  {f}");
            }
        }
        s
    }

    /// Chainer's memory hook: per op kind and per user range, the allocations made inside and
    /// the device memory in use after them (peak and latest).
    pub fn memory(&self) -> Vec<MemRow> {
        let mut m: BTreeMap<(String, String), MemRow> = BTreeMap::new();
        for r in self.records.iter().filter(|r| r.kind == Kind::Alloc) {
            let mut keys = vec![format!("op {}", r.op.unwrap_or("(no op)"))];
            if let Some(range) = &r.range {
                // The allocation counts for its range and every range around it.
                let mut p = String::new();
                for part in range.split('/') {
                    if !p.is_empty() {
                        p.push('/');
                    }
                    p.push_str(part);
                    keys.push(format!("range {p}"));
                }
            }
            for k in keys {
                let e = m
                    .entry((k.clone(), r.device.to_string()))
                    .or_insert_with(|| MemRow {
                        name: k,
                        device: r.device.to_string(),
                        ..Default::default()
                    });
                e.allocs += 1;
                e.alloc_bytes += r.bytes;
                if let Some(u) = r.mem_in_use {
                    e.peak = e.peak.max(u);
                    e.current = u;
                }
            }
        }
        let mut v: Vec<MemRow> = m.into_values().collect();
        v.sort_by(|a, b| b.peak.cmp(&a.peak).then(b.alloc_bytes.cmp(&a.alloc_bytes)));
        v
    }

    fn memory_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<40} {:<8} {:>8} {:>11} {:>11} {:>11}",
            "Memory: op / range", "Device", "Allocs", "Allocated", "Peak", "Current"
        );
        for r in self.memory() {
            let _ = writeln!(
                s,
                "{:<40} {:<8} {:>8} {:>11} {:>11} {:>11}",
                clip(&r.name, 40),
                r.device,
                r.allocs,
                fmt_bytes(r.alloc_bytes),
                fmt_bytes(r.peak),
                fmt_bytes(r.current)
            );
        }
        s
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "== kiln profile: {} records ==", self.records.len())?;
        writeln!(f, "{}", self.table())?;
        writeln!(f, "== where did it run ==")?;
        writeln!(f, "{}", self.where_ran())?;
        write!(f, "== memory ==\n{}", self.memory_text())
    }
}

fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    let mut c: String = s.chars().take(n - 1).collect();
    c.push('…');
    c
}

fn fmt_ns(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns}ns"),
        1_000..1_000_000 => format!("{:.2}us", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2}ms", ns as f64 / 1e6),
        _ => format!("{:.3}s", ns as f64 / 1e9),
    }
}

fn fmt_bytes(b: u64) -> String {
    match b {
        0 => "-".into(),
        1..1024 => format!("{b}B"),
        1024..1_048_576 => format!("{:.1}KiB", b as f64 / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1}MiB", b as f64 / 1_048_576.0),
        _ => format!("{:.2}GiB", b as f64 / 1_073_741_824.0),
    }
}
