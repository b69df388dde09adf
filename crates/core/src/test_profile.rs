//! Checks of the profiler that every backend runs (`check_profile_counts::<B>`), and a small
//! JSON parser to validate Chrome traces without a serde dependency.

use crate::profile::{self, CopyKind, Kind, LaunchKind, Profile};
use crate::{Backend, Tensor};

/// A parsed JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    /// The member `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Num(n) => Some(*n),
            _ => None,
        }
    }
}

/// Parses `s` as one JSON value (RFC 8259; errors name the byte offset).
pub fn parse_json(s: &str) -> Result<Json, String> {
    let mut p = Parser {
        b: s.as_bytes(),
        i: 0,
    };
    let v = p.value()?;
    p.ws();
    if p.i != p.b.len() {
        return Err(format!("trailing characters at byte {}", p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\n' | b'\r' | b'\t') {
            self.i += 1;
        }
    }
    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} at byte {}", self.i))
    }
    fn lit(&mut self, w: &str, v: Json) -> Result<Json, String> {
        if self.b[self.i..].starts_with(w.as_bytes()) {
            self.i += w.len();
            Ok(v)
        } else {
            self.err("bad literal")
        }
    }
    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        match self.b.get(self.i) {
            None => self.err("unexpected end"),
            Some(b'{') => {
                self.i += 1;
                let mut m = Vec::new();
                self.ws();
                if self.b.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    if self.b.get(self.i) != Some(&b'"') {
                        return self.err("expected a key");
                    }
                    let k = self.string()?;
                    self.ws();
                    if self.b.get(self.i) != Some(&b':') {
                        return self.err("expected ':'");
                    }
                    self.i += 1;
                    let v = self.value()?;
                    m.push((k, v));
                    self.ws();
                    match self.b.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(m));
                        }
                        _ => return self.err("expected ',' or '}'"),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.b.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value()?);
                    self.ws();
                    match self.b.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(v));
                        }
                        _ => return self.err("expected ',' or ']'"),
                    }
                }
            }
            Some(b'"') => self.string().map(Json::Str),
            Some(b't') => self.lit("true", Json::Bool(true)),
            Some(b'f') => self.lit("false", Json::Bool(false)),
            Some(b'n') => self.lit("null", Json::Null),
            Some(_) => self.number(),
        }
    }
    fn number(&mut self) -> Result<Json, String> {
        let start = self.i;
        if self.b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        let digits = |p: &mut Self| {
            let s = p.i;
            while p.i < p.b.len() && p.b[p.i].is_ascii_digit() {
                p.i += 1;
            }
            p.i > s
        };
        match self.b.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(c) if c.is_ascii_digit() => {
                digits(self);
            }
            _ => return self.err("bad number"),
        }
        if self.b.get(self.i) == Some(&b'.') {
            self.i += 1;
            if !digits(self) {
                return self.err("bad fraction");
            }
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if !digits(self) {
                return self.err("bad exponent");
            }
        }
        let t = std::str::from_utf8(&self.b[start..self.i]).map_err(|e| e.to_string())?;
        t.parse()
            .map(Json::Num)
            .map_err(|e| format!("{e} at byte {start}"))
    }
    fn string(&mut self) -> Result<String, String> {
        self.i += 1; // opening quote
        let mut out = Vec::new();
        loop {
            match self.b.get(self.i) {
                None => return self.err("unterminated string"),
                Some(b'"') => {
                    self.i += 1;
                    return String::from_utf8(out).map_err(|e| e.to_string());
                }
                Some(b'\\') => {
                    self.i += 1;
                    let c = match self.b.get(self.i) {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            let h = self
                                .b
                                .get(self.i + 1..self.i + 5)
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u32::from_str_radix(h, 16).ok());
                            self.i += 4;
                            match h.and_then(char::from_u32) {
                                Some(c) => c,
                                None => return self.err("bad \\u escape"),
                            }
                        }
                        _ => return self.err("bad escape"),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    self.i += 1;
                }
                Some(&c) if c < 0x20 => return self.err("control character in string"),
                Some(&c) => {
                    out.push(c);
                    self.i += 1;
                }
            }
        }
    }
}

/// Counts of a validated Chrome trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceCounts {
    /// Complete (`X`) events on the host process (pid 0).
    pub host: usize,
    /// Complete events on device processes (pid > 0).
    pub device: usize,
    /// Begin/end pairs (user ranges).
    pub ranges: usize,
}

/// Validates `json` as a Chrome trace: an object with a `traceEvents` array whose events have a
/// known `ph`, a name, integer pid and tid, a numeric `ts` (but metadata), a non-negative `dur`
/// on complete events, and balanced begin/end pairs per track.
pub fn check_chrome_trace(json: &str) -> Result<TraceCounts, String> {
    let v = parse_json(json)?;
    let Some(Json::Arr(events)) = v.get("traceEvents") else {
        return Err("no traceEvents array".into());
    };
    let mut c = TraceCounts::default();
    let mut open: std::collections::HashMap<(i64, i64), Vec<String>> = Default::default();
    for (k, e) in events.iter().enumerate() {
        let ph = e
            .get("ph")
            .and_then(Json::as_str)
            .ok_or(format!("event {k}: no ph"))?;
        let name = e
            .get("name")
            .and_then(Json::as_str)
            .ok_or(format!("event {k}: no name"))?;
        let int = |key: &str| -> Result<i64, String> {
            let x = e
                .get(key)
                .and_then(Json::as_f64)
                .ok_or(format!("event {k}: no {key}"))?;
            if x.fract() != 0.0 || x < 0.0 {
                return Err(format!(
                    "event {k}: {key} {x} is not a non-negative integer"
                ));
            }
            Ok(x as i64)
        };
        let (pid, tid) = (int("pid")?, int("tid")?);
        if ph == "M" {
            continue;
        }
        let ts = e
            .get("ts")
            .and_then(Json::as_f64)
            .ok_or(format!("event {k}: no ts"))?;
        if !ts.is_finite() || ts < 0.0 {
            return Err(format!("event {k}: bad ts {ts}"));
        }
        match ph {
            "X" => {
                let d = e
                    .get("dur")
                    .and_then(Json::as_f64)
                    .ok_or(format!("event {k}: X without dur"))?;
                if d < 0.0 {
                    return Err(format!("event {k}: negative dur"));
                }
                if pid == 0 {
                    c.host += 1;
                } else {
                    c.device += 1;
                }
            }
            "B" => open.entry((pid, tid)).or_default().push(name.to_string()),
            "E" => {
                let top = open.get_mut(&(pid, tid)).and_then(|s| s.pop());
                if top.as_deref() != Some(name) {
                    return Err(format!("event {k}: end of {name} without its begin"));
                }
                c.ranges += 1;
            }
            "C" | "i" => {}
            p => return Err(format!("event {k}: unknown ph {p}")),
        }
    }
    if let Some((t, s)) = open.iter().find(|(_, s)| !s.is_empty()) {
        return Err(format!("range {:?} on {t:?} never ends", s.last()));
    }
    Ok(c)
}

/// Profiles a known sequence of ops on `dev` inside a user range and checks the calls and
/// bytes the profiler saw; returns the profile (everything recorded, not only the range) for
/// backend-specific checks. Panics with a message on a mismatch. `allocs`: the backend reports
/// its allocations (every real backend does; the reference backend does not).
///
/// The sequence: upload `a` `[64, 32]` and `b` `[32, 16]` (f32), `c = a·b`, `d = exp(c)`,
/// `e = d + d`, read `e` back.
pub fn check_profile_counts<B: Backend>(dev: &B::Device, range: &str, allocs: bool) -> Profile {
    let av: Vec<f32> = (0..64 * 32).map(|i| (i % 7) as f32 * 0.01).collect();
    let bv: Vec<f32> = (0..32 * 16).map(|i| (i % 5) as f32 * 0.01).collect();
    let (res, p) = profile::profile(|| {
        let _r = profile::range(range);
        let a = Tensor::<B>::from_vec(av, [64, 32], dev)?;
        let b = Tensor::<B>::from_vec(bv, [32, 16], dev)?;
        let c = a.matmul(&b)?;
        let d = c.exp()?;
        let e = d.add(&d)?;
        e.to_vec::<f32>()
    });
    let v = res.expect("the profiled ops run");
    assert_eq!(v.len(), 64 * 16);
    let mine = p.in_range(range);
    let f = 4u64;
    let want: [(&str, u64, u64); 5] = [
        ("from_host", 2, (64 * 32 + 32 * 16) * f),
        ("matmul", 1, (64 * 32 + 32 * 16) * f),
        ("exp", 1, 64 * 16 * f),
        ("add", 1, 2 * 64 * 16 * f),
        ("to_host", 1, 64 * 16 * f),
    ];
    for (name, calls, bytes) in want {
        let row = mine
            .row(Kind::Op, name)
            .unwrap_or_else(|| panic!("no row for op {name}:\n{mine}"));
        assert_eq!(row.calls, calls, "calls of {name}:\n{mine}");
        assert_eq!(row.bytes, bytes, "bytes of {name}:\n{mine}");
        for r in mine.find(Kind::Op, name) {
            assert_eq!(r.device, dev.to_string(), "device of {name}");
            assert_eq!(r.depth, 0, "{name} is a top-level op");
            assert!(
                r.detail.starts_with("f32"),
                "detail of {name}: {}",
                r.detail
            );
        }
    }
    let range_row = mine
        .row(Kind::Range, range)
        .expect("the user range is recorded");
    assert_eq!(range_row.calls, 1);
    let exp = mine.find(Kind::Op, "exp").next().unwrap();
    let whole = mine.find(Kind::Range, range).next().unwrap();
    assert!(exp.start_ns >= whole.start_ns && exp.start_ns <= whole.start_ns + whole.dur_ns);
    // Allocations were reported: at least the three results (by the backend; a lazy GPU
    // backend may allocate some of them while reading back, inside `to_host`).
    let alloc: u64 = mine
        .records()
        .iter()
        .filter(|r| r.kind == Kind::Alloc)
        .map(|r| r.bytes)
        .sum();
    assert!(
        !allocs || alloc >= 64 * 16 * f,
        "allocated {alloc} bytes, expected at least the result's {}:\n{mine}",
        64 * 16 * f
    );
    let on_device = !profile::is_host_device(&dev.to_string());
    if on_device {
        // Uploads may run on helper threads (outside the range): count them everywhere.
        let h2d: u64 = p
            .records()
            .iter()
            .filter(|r| r.kind == Kind::Copy(CopyKind::HostToDevice))
            .map(|r| r.bytes)
            .sum();
        assert!(
            h2d >= (64 * 32 + 32 * 16) * f,
            "host-to-device bytes {h2d}:\n{p}"
        );
        let d2h: u64 = p
            .records()
            .iter()
            .filter(|r| r.kind == Kind::Copy(CopyKind::DeviceToHost))
            .map(|r| r.bytes)
            .sum();
        assert!(d2h >= 64 * 16 * f, "device-to-host bytes {d2h}:\n{p}");
        // A BLAS call, or the backend's own kernel for a product this small.
        let gemm: Vec<_> = mine
            .records()
            .iter()
            .filter(|r| {
                matches!(r.kind, Kind::Launch(LaunchKind::Blas | LaunchKind::Kernel))
                    && r.op == Some("matmul")
            })
            .collect();
        assert_eq!(gemm.len(), 1, "one launch for the matmul:\n{mine}");
        assert!(
            gemm[0].device_time.is_some_and(|d| d.dur_ns > 0),
            "the matmul's launch has device time: {:?}",
            gemm[0]
        );
        let syncs = mine
            .records()
            .iter()
            .filter(|r| r.kind == Kind::Sync)
            .count();
        assert!(syncs >= 1, "reading back waits for the device:\n{mine}");
        let counts = check_chrome_trace(&p.chrome_trace_json()).expect("valid trace");
        assert!(counts.device > 0, "device events in the trace");
    }
    p
}
