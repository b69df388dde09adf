//! The Chrome trace (`chrome://tracing`, Perfetto) of a [`Profile`].

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{Kind, LaunchKind, Profile};
use crate::{Error, Result};

impl Profile {
    /// The trace in Chrome's JSON format (`chrome://tracing`, Perfetto): host spans on one
    /// track per thread (process "host"), device spans on one process per device with one
    /// track per stream, user ranges as begin/end pairs on their thread, memory in use as
    /// counters.
    pub fn chrome_trace_json(&self) -> String {
        let mut pids: BTreeMap<&str, u64> = BTreeMap::new();
        let mut tids: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        let mut ev: Vec<String> = Vec::new();
        let us = |ns: u64| format!("{:.3}", ns as f64 / 1e3);
        ev.push(
            r#"{"ph":"M","name":"process_name","pid":0,"tid":0,"args":{"name":"host"}}"#.into(),
        );
        for r in &self.records {
            let name = match r.kind {
                Kind::Launch(LaunchKind::Fused) if !r.detail.is_empty() => {
                    format!("{} [{}]", r.name, r.detail)
                }
                _ => r.name.to_string(),
            };
            let mut args = format!(
                r#""kind":{},"device":{}"#,
                json_str(r.kind.label()),
                json_str(&r.device)
            );
            if !r.detail.is_empty() {
                let _ = write!(args, r#","detail":{}"#, json_str(&r.detail));
            }
            if r.bytes > 0 {
                let _ = write!(args, r#","bytes":{}"#, r.bytes);
            }
            if let Some(op) = r.op {
                let _ = write!(args, r#","op":{}"#, json_str(op));
            }
            if let Some(f) = r.fallback {
                let _ = write!(args, r#","fallback":{}"#, json_str(f));
            }
            let cat = json_str(r.kind.label());
            let n = json_str(&name);
            if r.kind == Kind::Range {
                ev.push(format!(
                    r#"{{"ph":"B","name":{n},"cat":{cat},"pid":0,"tid":{},"ts":{}}}"#,
                    r.thread,
                    us(r.start_ns)
                ));
                ev.push(format!(
                    r#"{{"ph":"E","name":{n},"cat":{cat},"pid":0,"tid":{},"ts":{}}}"#,
                    r.thread,
                    us(r.start_ns + r.dur_ns)
                ));
                continue;
            }
            ev.push(format!(
                r#"{{"ph":"X","name":{n},"cat":{cat},"pid":0,"tid":{},"ts":{},"dur":{},"args":{{{args}}}}}"#,
                r.thread,
                us(r.start_ns),
                us(r.dur_ns)
            ));
            if let (Some(u), Kind::Alloc) = (r.mem_in_use, r.kind) {
                ev.push(format!(
                    r#"{{"ph":"C","name":{},"pid":0,"tid":0,"ts":{},"args":{{"bytes":{u}}}}}"#,
                    json_str(&format!("memory in use {}", r.device)),
                    us(r.start_ns + r.dur_ns)
                ));
            }
            if let (Some(d), false) = (r.device_time, r.device_estimated) {
                let next = pids.len() as u64 + 1;
                let pid = *pids.entry(&r.device).or_insert(next);
                let next = tids.keys().filter(|k| k.0 == pid).count() as u64;
                let tid = *tids.entry((pid, r.stream)).or_insert(next);
                ev.push(format!(
                    r#"{{"ph":"X","name":{n},"cat":{cat},"pid":{pid},"tid":{tid},"ts":{},"dur":{},"args":{{{args}}}}}"#,
                    us(d.start_ns),
                    us(d.dur_ns)
                ));
            }
        }
        for (dev, pid) in &pids {
            ev.push(format!(
                r#"{{"ph":"M","name":"process_name","pid":{pid},"tid":0,"args":{{"name":{}}}}}"#,
                json_str(dev)
            ));
        }
        for ((pid, stream), tid) in &tids {
            ev.push(format!(
                r#"{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},"args":{{"name":{}}}}}"#,
                json_str(&format!("stream {stream:#x}"))
            ));
        }
        format!(
            "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n{}\n]}}\n",
            ev.join(",\n")
        )
    }

    /// Writes [`Profile::chrome_trace_json`] to `path`.
    pub fn export_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.chrome_trace_json()).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

/// `s` as a JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}
