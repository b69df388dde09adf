//! Helper threads that share one matrix product with the calling thread, and sleep between
//! products.
//!
//! A product is cut into more parts than there are cores, which the calling thread and the
//! helpers claim one at a time from a shared counter ([`run`]). The caller starts on the parts
//! at once and wakes the helpers (one futex wake); a helper that wakes late (an idle vCPU takes
//! tens of µs to resume on a virtual machine) finds fewer parts left, and one that wakes after
//! the last part was claimed finds none and goes back to sleep. So a product never waits for a
//! wake-up, and no core is burned between products: the previous pool kept its helpers polling
//! for a millisecond after each product (OpenBLAS's habit), which made a small MLP step cost
//! 2.4× numpy's process CPU time and slowed everything else on a shared machine.
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// The parts of one product, claimed by index.
trait Parts: Send + Sync {
    /// Claims and runs parts until none is left.
    fn work(&self);
}

struct Job<R, F> {
    f: F,
    n: usize,
    /// The next part to claim.
    next: AtomicUsize,
    /// Parts finished (their results stored).
    done: AtomicUsize,
    results: Mutex<Vec<Option<std::thread::Result<R>>>>,
    /// The caller, unparked by whoever finishes the last part.
    caller: Thread,
}

impl<R: Send, F: Fn(usize) -> R + Send + Sync> Parts for Job<R, F> {
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
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

/// The helper threads started (one per core beyond the first), started on first use.
fn helpers() -> usize {
    static HELPERS: OnceLock<usize> = OnceLock::new();
    *HELPERS.get_or_init(|| {
        let wanted = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
        (0..wanted)
            .filter(|i| {
                // A helper that cannot start is simply not there: callers compute its share.
                std::thread::Builder::new()
                    .name(format!("kiln-gemm-{i}"))
                    .spawn(serve)
                    .is_ok()
            })
            .count()
    })
}

/// A helper's life: sleep until a product is posted, work on it, sleep again.
fn serve() {
    let mut seen = 0;
    loop {
        let job = {
            let mut posted = POSTED.lock().unwrap_or_else(|e| e.into_inner());
            while posted.serial == seen {
                posted = WAKE.wait(posted).unwrap_or_else(|e| e.into_inner());
            }
            seen = posted.serial;
            posted.job.clone()
        };
        if let Some(job) = job {
            job.work();
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
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        results: Mutex::new((0..n).map(|_| None).collect()),
        caller: std::thread::current(),
    });
    let serial = (others > 0 && helpers() > 0).then(|| {
        let mut posted = POSTED.lock().unwrap_or_else(|e| e.into_inner());
        posted.job = Some(job.clone());
        posted.serial += 1;
        let serial = posted.serial;
        drop(posted);
        WAKE.notify_all();
        serial
    });
    if let Some(mine) = mine {
        mine();
    }
    job.work();
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
