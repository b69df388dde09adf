//! Helper threads that share one matrix product with the calling thread, watch briefly for
//! the next one, and sleep between bursts of products.
//!
//! A product is cut into parts ([`run`]) that the calling thread and the helpers claim, each
//! thread starting on its own share (a static schedule: thread `t` of `c` starts at part
//! `t·n/c`, so a core reads the same rows of a matrix each product and finds them in its own
//! cache) and then taking whatever is left. The caller starts at once, so a product never
//! waits for a helper: one that comes late finds fewer parts, or none.
//!
//! After a product a helper watches for the next for [`linger`] (100 µs), then sleeps on a
//! condition variable. An idle vCPU takes 20–30 µs to resume on a virtual machine, about a
//! third of each split product of a small MLP step; watching through the gaps between one
//! step's products removed most of that (784-100-100-10 at batch 100, 2-core VM, 2026-11-28:
//! 0.209–0.211 ms a step sleeping at once, 0.193–0.194 watching 50 µs, 0.176–0.180 watching
//! 100 µs; process CPU time 0.6 → 0.75–0.8× numpy's). The bound keeps the cost where issue 32
//! put it: the pool before kept polling for a millisecond after every product (OpenBLAS's
//! habit), which made that step cost 2.4× numpy's process CPU time; a loop that multiplies
//! less often than every 100 µs sleeps between products.
//!
//! Why not rayon: `rayon::join` from a thread outside rayon's pool (the user's thread, where
//! the training loop runs) moves the whole job into the pool and puts the caller to sleep, so
//! the product waits for one wake-up to start and another to return.
//!
//! Parts are `'static` closures: they capture `Arc`s of the operands
//! ([`CpuStorage::shared`](crate::storage::CpuStorage::shared)) and return their result by
//! value. Concurrent callers never wait on each other: the helpers serve the latest product
//! posted, and every caller computes whatever parts of its own product nobody claimed.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// The parts of one product, claimed by index.
trait Parts: Send + Sync {
    /// Claims and runs parts until none is left, starting at `thread`'s own share (thread 0
    /// is the caller, helper `h` is thread `h + 1`).
    fn work(&self, thread: usize);
}

struct Job<R, F> {
    f: F,
    n: usize,
    /// Which parts someone has taken.
    claimed: Vec<AtomicBool>,
    /// Parts finished (their results stored).
    done: AtomicUsize,
    results: Mutex<Vec<Option<std::thread::Result<R>>>>,
    /// The caller, unparked by whoever finishes the last part.
    caller: Thread,
}

impl<R: Send, F: Fn(usize) -> R + Send + Sync> Parts for Job<R, F> {
    fn work(&self, thread: usize) {
        // Each thread starts on the same parts every product (a static schedule), so the rows
        // it read last time are still in its own cache; then it takes whatever is left.
        let first = (thread * self.n / cores()).min(self.n);
        for i in (first..self.n).chain(0..first) {
            if self.claimed[i].swap(true, Ordering::Relaxed) {
                continue;
            }
            let r = catch_unwind(AssertUnwindSafe(|| (self.f)(i)));
            if let Ok(mut slots) = self.results.lock() {
                slots[i] = Some(r);
            }
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
                self.caller.unpark();
            }
        }
    }
}

/// The product the helpers serve, with a number that changes whenever a new one is posted.
struct Posted {
    job: Option<Arc<dyn Parts>>,
    serial: u64,
}

static POSTED: Mutex<Posted> = Mutex::new(Posted {
    job: None,
    serial: 0,
});
static WAKE: Condvar = Condvar::new();
/// `POSTED.serial`, readable without the lock by a helper watching between products.
static SERIAL: AtomicU64 = AtomicU64::new(0);
/// Helpers waiting on [`WAKE`]: changed only under `POSTED`'s lock, so a poster holding it
/// reads it exactly and skips the wake-up call when none sleeps; read without the lock by
/// [`awake`].
static SLEEPING: AtomicUsize = AtomicUsize::new(0);

/// Whether a helper is awake (working, or watching for the next product): sharing a product
/// then costs no wake-up, so smaller products are worth splitting (`matmul.rs`).
pub fn awake() -> bool {
    helpers() > 0 && SLEEPING.load(Ordering::Relaxed) < helpers()
}

/// How long a helper keeps watching for the next product after its last one before it sleeps:
/// [`LINGER_US`], or `KILN_CPU_LINGER_US` (read once; 0 sleeps at once, as on a machine shared
/// with other work).
fn linger() -> Duration {
    static LINGER: OnceLock<Duration> = OnceLock::new();
    *LINGER.get_or_init(|| {
        let us = std::env::var("KILN_CPU_LINGER_US")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(LINGER_US);
        Duration::from_micros(us)
    })
}

/// The default of [`linger`]: longer than most gaps between one small training step's
/// products (the module docs have the measurement), a tenth of the millisecond OpenBLAS spins.
const LINGER_US: u64 = 100;

/// The helper threads started (one per core beyond the first), started on first use.
fn helpers() -> usize {
    static HELPERS: OnceLock<usize> = OnceLock::new();
    *HELPERS.get_or_init(|| {
        let wanted = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
        (0..wanted)
            .filter(|&i| {
                // A helper that cannot start is simply not there: callers compute its share.
                std::thread::Builder::new()
                    .name(format!("kiln-gemm-{i}"))
                    .spawn(move || serve(i + 1))
                    .is_ok()
            })
            .count()
    })
}

/// A helper's life: watch for the next product for [`linger`], then sleep until one is
/// posted; work on it; again.
fn serve(thread: usize) {
    let mut seen = 0;
    loop {
        let since = Instant::now();
        while SERIAL.load(Ordering::Acquire) == seen && since.elapsed() < linger() {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        }
        let job = {
            let mut posted = POSTED.lock().unwrap_or_else(|e| e.into_inner());
            while posted.serial == seen {
                SLEEPING.fetch_add(1, Ordering::Relaxed);
                posted = WAKE.wait(posted).unwrap_or_else(|e| e.into_inner());
                SLEEPING.fetch_sub(1, Ordering::Relaxed);
            }
            seen = posted.serial;
            posted.job.clone()
        };
        if let Some(job) = job {
            job.work(thread);
        }
    }
}

/// Cores a product can be shared among: this thread and the helpers.
pub fn cores() -> usize {
    helpers() + 1
}

/// How many parts to cut `work` multiply-adds into: two per core (so that a helper waking late
/// still takes a share; more parts measured slower, each packing its own panels), none smaller
/// than `min_part`; 1 without helpers. One per core once each core's share reaches
/// [`LONG_SHARE`]: a late helper's ~30 µs then costs less than a second set of packed panels and
/// copies (sgemm 1024³ on the 2-core machine: 10.9–11.3 ms with four parts, against 10.2–10.4
/// ms for a3d4f3e's two).
pub fn parts(work: usize, min_part: usize) -> usize {
    if helpers() == 0 {
        return 1;
    }
    if work / cores() >= LONG_SHARE {
        return cores();
    }
    (work / min_part.max(1)).clamp(1, 2 * cores())
}

/// Multiply-adds per core from which a product is cut into one part per core (~0.5 ms of one
/// core's work).
const LONG_SHARE: usize = 1 << 25;

/// Runs `f(0..n)` on this thread and whichever helpers wake in time; returns the results in
/// order, or `None` if a part panicked (after every part has finished, so no helper still
/// holds the operands).
pub fn run<R, F>(n: usize, f: F) -> Option<Vec<R>>
where
    R: Send + 'static,
    F: Fn(usize) -> R + Send + Sync + 'static,
{
    run_parts(n, f, None::<fn()>)
}

/// [`run`], with `mine` run on this thread first, while the helpers start on `f`'s parts: work
/// that borrows from the caller (a product's first part, written straight into its output).
pub fn run_beside<R, F>(n: usize, f: F, mine: impl FnOnce()) -> Option<Vec<R>>
where
    R: Send + 'static,
    F: Fn(usize) -> R + Send + Sync + 'static,
{
    run_parts(n, f, Some(mine))
}

/// [`run`] and [`run_beside`]: the parts are offered to the helpers when some other thread
/// could take one (more than one part, or one beside `mine`).
fn run_parts<R, F>(n: usize, f: F, mine: Option<impl FnOnce()>) -> Option<Vec<R>>
where
    R: Send + 'static,
    F: Fn(usize) -> R + Send + Sync + 'static,
{
    let others = if mine.is_some() {
        n
    } else {
        n.saturating_sub(1)
    };
    let job = Arc::new(Job {
        f,
        n,
        claimed: (0..n).map(|_| AtomicBool::new(false)).collect(),
        done: AtomicUsize::new(0),
        results: Mutex::new((0..n).map(|_| None).collect()),
        caller: std::thread::current(),
    });
    let serial = (others > 0 && helpers() > 0).then(|| {
        let mut posted = POSTED.lock().unwrap_or_else(|e| e.into_inner());
        posted.job = Some(job.clone());
        posted.serial += 1;
        let serial = posted.serial;
        SERIAL.store(serial, Ordering::Release);
        let sleeping = SLEEPING.load(Ordering::Relaxed);
        drop(posted);
        if sleeping > 0 {
            WAKE.notify_all();
        }
        serial
    });
    if let Some(mine) = mine {
        mine();
    }
    job.work(0);
    if let Some(serial) = serial {
        // Unpost it, so that the operands' memory does not outlive the product.
        let mut posted = POSTED.lock().unwrap_or_else(|e| e.into_inner());
        if posted.serial == serial {
            posted.job = None;
        }
    }
    // What is left is at most one part per helper, already running: wait briefly, then sleep
    // until the last one unparks this thread.
    let spin = Instant::now();
    while job.done.load(Ordering::Acquire) < n {
        if spin.elapsed() < Duration::from_micros(20) {
            std::hint::spin_loop();
        } else {
            std::thread::park_timeout(Duration::from_millis(1));
        }
    }
    let results = std::mem::take(&mut *job.results.lock().ok()?);
    results.into_iter().map(|r| r?.ok()).collect()
}

/// `0..len` in `parts` ranges of whole multiples of `align` (the last one shorter).
pub(crate) fn cut(len: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let per = len.div_ceil(parts.max(1)).next_multiple_of(align).max(1);
    (0..len)
        .step_by(per)
        .map(|s| s..(s + per).min(len))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_and_results_come_in_order() {
        // Many small products in a row: the helpers (watching or woken) claim some parts,
        // starting at their own shares; each part must still run exactly once.
        for n in [1, 2, 3, 4, 7] {
            for _ in 0..200 {
                let runs: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let counted = runs.clone();
                let out = run(n, move |i| {
                    counted[i].fetch_add(1, Ordering::Relaxed);
                    i * 10
                });
                assert_eq!(out, Some((0..n).map(|i| i * 10).collect::<Vec<_>>()));
                assert!(
                    runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                    "n = {n}"
                );
            }
        }
    }

    #[test]
    fn a_panicking_part_gives_none_and_the_pool_stays_usable() {
        let bad = run(4, |i| {
            if i == 3 {
                panic!("part 3 (expected)")
            } else {
                i
            }
        });
        assert_eq!(bad, None);
        assert_eq!(run(4, |i| i + 1), Some(vec![1, 2, 3, 4]));
    }
}
