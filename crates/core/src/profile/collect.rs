//! Collecting: every thread's buffer merged into one [`Profile`], and the scopes that bound it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::record::{REGISTRY, ThreadBuf};
use super::{DeviceTime, GENERATION, Kind, Record, SESSIONS, env_on, now_ns, refresh_state};

// ---- collecting --------------------------------------------------------------------------

/// Hooks that backends register to finish pending work before a profile is collected (e.g.
/// make sure timed events were enqueued). Called once per collection.
static FLUSH: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Registers `f` to run before every collection (idempotent per function).
pub fn on_collect(f: fn()) {
    let mut v = FLUSH.lock().unwrap();
    if !v.iter().any(|g| std::ptr::fn_addr_eq(*g, f)) {
        v.push(f);
    }
}

/// Every record that started at or after `since_ns`, device timers resolved; `clear` empties
/// the buffers afterwards.
pub(super) fn collect(since_ns: u64, clear: bool) -> Vec<Record> {
    let hooks: Vec<fn()> = FLUSH.lock().unwrap().clone();
    for h in hooks {
        h();
    }
    let bufs: Vec<Arc<ThreadBuf>> = REGISTRY.lock().unwrap().clone();
    let mut out = Vec::new();
    for b in bufs {
        let mut v = b.records.lock().unwrap();
        for raw in v.iter_mut() {
            if raw.rec.start_ns < since_ns {
                continue;
            }
            if let Some(mut t) = raw.timer.take() {
                raw.rec.device_time = t.resolve();
            }
            out.push(raw.rec.clone());
        }
        if clear {
            v.clear();
        }
        drop(v);
        let mut a = b.allocs.lock().unwrap();
        out.extend(
            a.iter()
                .filter(|r| r.start_ns >= since_ns)
                .map(|r| r.record(b.id)),
        );
        if clear {
            a.clear();
        }
        drop(a);
        let mut sp = b.spans.lock().unwrap();
        out.extend(
            sp.iter()
                .filter(|r| r.start_ns >= since_ns)
                .map(|r| r.record(b.id)),
        );
        if clear {
            sp.clear();
        }
    }
    if clear {
        prune();
    }
    estimate_sampled(&mut out);
    out.sort_by_key(|r| (r.start_ns, r.thread));
    out
}

/// Gives each record that sampling left untimed the mean device time of the timed records of
/// the same kind, name and device (none if no such record was timed).
fn estimate_sampled(recs: &mut [Record]) {
    if !recs.iter().any(|r| r.device_estimated) {
        return;
    }
    let mut timed: BTreeMap<(Kind, &str, &str), (u64, u64)> = BTreeMap::new();
    for r in recs.iter().filter(|r| !r.device_estimated) {
        if let Some(d) = r.device_time {
            let e = timed.entry((r.kind, &r.name, &r.device)).or_default();
            *e = (e.0 + d.dur_ns, e.1 + 1);
        }
    }
    let means: Vec<Option<u64>> = recs
        .iter()
        .map(|r| {
            r.device_estimated
                .then(|| timed.get(&(r.kind, &*r.name, &*r.device)))
                .flatten()
                .map(|&(sum, n)| sum / n)
        })
        .collect();
    for (r, m) in recs.iter_mut().zip(means) {
        if let Some(dur_ns) = m {
            r.device_time = Some(DeviceTime {
                start_ns: r.start_ns,
                dur_ns,
            });
        }
    }
}

fn clear_all() {
    let bufs: Vec<Arc<ThreadBuf>> = REGISTRY.lock().unwrap().clone();
    for b in bufs {
        b.records.lock().unwrap().clear();
        b.allocs.lock().unwrap().clear();
        b.spans.lock().unwrap().clear();
    }
    prune();
}

/// Forgets the buffers of threads that have exited (only the registry holds them) once they
/// are empty.
fn prune() {
    REGISTRY.lock().unwrap().retain(|b| {
        Arc::strong_count(b) > 1
            || !b.records.lock().unwrap().is_empty()
            || !b.allocs.lock().unwrap().is_empty()
            || !b.spans.lock().unwrap().is_empty()
    });
}

/// A profiling scope (see [`start`]).
pub struct Session {
    start_ns: u64,
    active: bool,
}

/// Starts recording (whatever `KILN_PROFILE` says) until [`Session::finish`] or drop.
pub fn start() -> Session {
    GENERATION.fetch_add(1, Ordering::Relaxed);
    SESSIONS.fetch_add(1, Ordering::SeqCst);
    refresh_state();
    Session {
        start_ns: now_ns(),
        active: true,
    }
}

impl Session {
    /// Stops this scope and returns what was recorded since it started (on every thread).
    pub fn finish(mut self) -> Profile {
        // Collect before stopping: the last session to stop empties the buffers, and must not
        // do so before every other one has its records.
        let p = Profile::new(collect(self.start_ns, false));
        self.stop();
        if SESSIONS.load(Ordering::SeqCst) == 0 && !env_on() {
            clear_all();
        }
        p
    }

    fn stop(&mut self) {
        if std::mem::take(&mut self.active) {
            SESSIONS.fetch_sub(1, Ordering::SeqCst);
            refresh_state();
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `f` with the profiler on and returns its result and what it recorded.
pub fn profile<R>(f: impl FnOnce() -> R) -> (R, Profile) {
    let s = start();
    let r = f();
    (r, s.finish())
}

/// The records of one profiling run, and the views over them.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub(super) records: Vec<Record>,
}

impl Profile {
    pub(super) fn new(records: Vec<Record>) -> Self {
        Profile { records }
    }

    /// Every record, by start time.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// The records made inside the user range `name` (a path such as `"train/forward"`, or
    /// its first part), the range itself included: a view of one part of a program, and what
    /// tests use to ignore other threads' work.
    pub fn in_range(&self, name: &str) -> Profile {
        let inside = |r: &Record| {
            r.range.as_deref().is_some_and(|p| {
                p == name || (p.starts_with(name) && p.as_bytes().get(name.len()) == Some(&b'/'))
            })
        };
        Profile::new(self.records.iter().filter(|r| inside(r)).cloned().collect())
    }

    /// The records of `kind` named `name`.
    pub fn find<'a>(&'a self, kind: Kind, name: &'a str) -> impl Iterator<Item = &'a Record> {
        self.records
            .iter()
            .filter(move |r| r.kind == kind && r.name == name)
    }
}
