//! Helper threads that spin between jobs, for splitting one matrix product across cores.
//!
//! Why not rayon: a rayon worker that finds no work goes to sleep within tens of microseconds,
//! and waking it (on a virtual machine, waking its halted vCPU) costs about as much again:
//! measured on the 2-core CI-class VM, a 100x784x100 product split across two rayon tasks took
//! 163 µs back to back but 234 µs after 100 µs of idleness, against 250 µs on one core. The
//! products of a training step are separated by exactly such gaps. Like OpenBLAS's threads,
//! these helpers keep polling for [`SPIN`] after each job before they park, so a product that
//! follows within that window starts on every core at once. The caller always computes one part
//! itself and waits (spinning) for the helpers' parts.
//!
//! Jobs are `'static` closures: they capture `Arc`s of the operands
//! ([`CpuStorage::shared`](crate::storage::CpuStorage::shared)) and return their part by value.
//! A helper that is busy (another thread's product) is skipped and the caller computes that
//! part itself, so concurrent callers never wait on each other.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper polls for the next job before parking (`KILN_CPU_SPIN_US` overrides).
pub const SPIN: Duration = Duration::from_millis(1);

type Job = Box<dyn FnOnce() + Send>;

struct Helper {
    /// Claimed by a caller from submitting a job until it has collected the result.
    busy: AtomicBool,
    /// Set when `job` holds a job the helper has not taken yet.
    ready: AtomicBool,
    job: Mutex<Option<Job>>,
    thread: OnceLock<Thread>,
}

struct Pool {
    helpers: Vec<Arc<Helper>>,
    spin: Duration,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let spin = std::env::var("KILN_CPU_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(SPIN, Duration::from_micros);
        let n = rayon::current_num_threads().saturating_sub(1);
        let helpers = (0..n)
            .filter_map(|i| {
                let h = Arc::new(Helper {
                    busy: AtomicBool::new(false),
                    ready: AtomicBool::new(false),
                    job: Mutex::new(None),
                    thread: OnceLock::new(),
                });
                let worker = Arc::clone(&h);
                let spawned = std::thread::Builder::new()
                    .name(format!("kiln-gemm-{i}"))
                    .spawn(move || run(&worker, spin));
                // A helper that cannot start is simply not there: callers compute its share.
                let t = spawned.ok()?;
                h.thread.set(t.thread().clone()).ok()?;
                Some(h)
            })
            .collect();
        Pool { helpers, spin }
    })
}

fn run(h: &Helper, spin: Duration) {
    loop {
        let idle_since = Instant::now();
        let mut polls = 0u32;
        while !h.ready.load(Ordering::Acquire) {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) {
                if idle_since.elapsed() > spin {
                    std::thread::park();
                } else {
                    // Poll politely: a runnable thread (a rayon worker) gets the core.
                    std::thread::yield_now();
                }
            } else {
                std::hint::spin_loop();
            }
        }
        h.ready.store(false, Ordering::Relaxed);
        let job = h.job.lock().map(|mut j| j.take()).unwrap_or(None);
        if let Some(job) = job {
            job();
        }
    }
}

/// How many parts a product should be split into here: this thread plus the helpers.
pub fn parts() -> usize {
    pool().helpers.len() + 1
}

/// A part running on a helper; [`Pending::wait`] returns its result.
pub struct Pending<R> {
    result: Arc<Mutex<Option<std::thread::Result<R>>>>,
    done: Arc<AtomicBool>,
    helper: Arc<Helper>,
}

/// Runs `f` on an idle helper, or returns it when none is idle (the caller then runs it).
pub fn submit<R, F>(f: F) -> Result<Pending<R>, F>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    let Some(helper) = pool().helpers.iter().find(|h| {
        h.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }) else {
        return Err(f);
    };
    let result = Arc::new(Mutex::new(None));
    let done = Arc::new(AtomicBool::new(false));
    let (r, d) = (Arc::clone(&result), Arc::clone(&done));
    let job: Job = Box::new(move || {
        let out = catch_unwind(AssertUnwindSafe(f));
        if let Ok(mut slot) = r.lock() {
            *slot = Some(out);
        }
        d.store(true, Ordering::Release);
    });
    if let Ok(mut slot) = helper.job.lock() {
        *slot = Some(job);
    }
    helper.ready.store(true, Ordering::Release);
    if let Some(t) = helper.thread.get() {
        t.unpark();
    }
    Ok(Pending {
        result,
        done,
        helper: Arc::clone(helper),
    })
}

impl<R> Pending<R> {
    /// Waits for the part; `None` if it panicked.
    pub fn wait(self) -> Option<R> {
        self.finish();
        self.result.lock().ok().and_then(|mut r| r.take())?.ok()
    }

    /// Spins (then yields) until the helper is done with the part.
    fn finish(&self) {
        let start = Instant::now();
        while !self.done.load(Ordering::Acquire) {
            if start.elapsed() > pool().spin {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl<R> Drop for Pending<R> {
    /// The helper is free again once its part is done, waited for or not.
    fn drop(&mut self) {
        self.finish();
        self.helper.busy.store(false, Ordering::Release);
    }
}
