//! The profiler's host clock: nanoseconds since its first use, read from the CPU's time-stamp
//! counter where that is cheaper than the OS clock.
//!
//! # Why
//!
//! A profiled training step reads the clock about 120 times (two reads per op span and launch,
//! one per allocation). `Instant::now` cost 27 ns on the 2-core CI machine and 33–49 ns on the
//! GPU machines' VMs (2026-11-26), about half of what each record costs; `rdtsc` is a single
//! instruction.
//!
//! # How
//!
//! Ticks become nanoseconds by a piecewise-linear map. At first use the counter is paired with
//! [`Instant`] twice, 200 µs apart, for a first rate; then it is paired again at doubling
//! intervals (about 1 ms, 2 ms, … up to ~16 s after the start), each time with the rate
//! measured over the whole time since the start, so the rate's error shrinks to parts per
//! billion. Each new segment starts where the previous one ends, so the clock is continuous
//! and never runs backwards; it may sit a few microseconds away from `Instant`, which nobody
//! compares it with — every host time the profiler and the backends use comes from here.
//!
//! The counter is used only on x86-64, when the CPU says it is invariant (constant rate,
//! running in every power state: CPUID 0x8000_0007, EDX bit 8), and when reading it measured
//! faster than reading `Instant` on this machine. `KILN_PROFILE_CLOCK=os` forces the OS clock.

use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

const UNINIT: u8 = 0;
const OS: u8 = 1;
const TSC: u8 = 2;
static MODE: AtomicU8 = AtomicU8::new(UNINIT);

/// The clock's zero.
static T0: OnceLock<Instant> = OnceLock::new();

/// Nanoseconds since the clock's first use (monotonic).
#[inline]
pub(crate) fn now_ns() -> u64 {
    match MODE.load(Ordering::Acquire) {
        TSC => tsc::now_ns(),
        OS => os_ns(),
        _ => init_then_now(),
    }
}

/// Which clock [`now_ns`] reads: `"tsc"` or `"os"`.
pub(crate) fn source() -> &'static str {
    now_ns();
    if MODE.load(Ordering::Acquire) == TSC {
        "tsc"
    } else {
        "os"
    }
}

fn os_ns() -> u64 {
    T0.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cold]
#[inline(never)]
fn init_then_now() -> u64 {
    static INIT: Mutex<()> = Mutex::new(());
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if MODE.load(Ordering::Acquire) == UNINIT {
        T0.get_or_init(Instant::now);
        let forced_os = std::env::var("KILN_PROFILE_CLOCK").is_ok_and(|v| v == "os");
        let mode = if !forced_os && tsc::start() { TSC } else { OS };
        MODE.store(mode, Ordering::Release);
    }
    drop(_g);
    now_ns()
}

#[cfg(target_arch = "x86_64")]
mod tsc {
    use super::*;
    use std::arch::x86_64::{__cpuid, _rdtsc};

    /// One linear piece of the map: `ns + (ticks - tsc) * mult / 2^32`.
    #[derive(Clone, Copy, Debug)]
    struct Seg {
        tsc: u64,
        ns: u64,
        /// Nanoseconds per tick, 32.32 fixed point.
        mult: u64,
    }

    /// Doublings of the calibration interval: 200 µs × 4 × 2^16 ≈ 52 s at most.
    const SEGS: usize = 18;
    static SEG: [OnceLock<Seg>; SEGS] = [const { OnceLock::new() }; SEGS];
    static CUR: AtomicUsize = AtomicUsize::new(0);
    /// The counter value at which the next calibration is due (`u64::MAX`: none).
    static NEXT: AtomicU64 = AtomicU64::new(u64::MAX);
    /// The first calibration pair: every later rate is measured from it.
    static FIRST: OnceLock<(u64, u64)> = OnceLock::new();
    /// Stop refining once the baseline is this long (the rate is then good to ~1e-8).
    const LONG_NS: u64 = 16_000_000_000;

    #[inline]
    fn ticks() -> u64 {
        // SAFETY: RDTSC exists on every x86-64 CPU and only reads the counter.
        unsafe { _rdtsc() }
    }

    #[inline]
    pub(super) fn now_ns() -> u64 {
        let t = ticks();
        if t >= NEXT.load(Ordering::Relaxed) {
            recalibrate(t);
        }
        let Some(s) = SEG[CUR.load(Ordering::Acquire)].get() else {
            return super::os_ns();
        };
        // A counter a little behind the segment's start (another core, or a race with a
        // recalibration) reads as the start: the clock never goes back.
        let dt = t.saturating_sub(s.tsc) as u128;
        s.ns + ((dt * s.mult as u128) >> 32) as u64
    }

    /// A counter value and the OS clock read between two counter reads close together.
    fn pair() -> (u64, u64) {
        let mut best = (u64::MAX, 0, 0);
        for _ in 0..8 {
            let a = ticks();
            let ns = super::os_ns();
            let b = ticks();
            let width = b.wrapping_sub(a);
            if width < best.0 {
                best = (width, a + width / 2, ns);
            }
        }
        (best.1, best.2)
    }

    /// Nanoseconds per tick between two pairs, 32.32 fixed point (`None` if the counter did
    /// not move forward).
    fn rate(a: (u64, u64), b: (u64, u64)) -> Option<u64> {
        let dt = b.0.checked_sub(a.0).filter(|&d| d > 0)?;
        let dns = b.1.checked_sub(a.1)?;
        Some((((dns as u128) << 32) / dt as u128) as u64)
    }

    // `__cpuid` is safe from Rust 1.94 on, unsafe in the 1.89 this crate supports.
    #[allow(unused_unsafe)]
    fn invariant() -> bool {
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 0x8000_0000 says which extended
        // leaves exist, and 0x8000_0007 is read only when it does.
        unsafe {
            __cpuid(0x8000_0000).eax >= 0x8000_0007 && (__cpuid(0x8000_0007).edx >> 8) & 1 == 1
        }
    }

    /// Median nanoseconds per call of `f` over a few rounds (to compare the two clocks).
    fn cost(f: impl Fn() -> u64) -> u64 {
        let mut v: Vec<u64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                let mut k = 0u64;
                for _ in 0..200 {
                    k = k.wrapping_add(std::hint::black_box(f()));
                }
                std::hint::black_box(k);
                t.elapsed().as_nanos() as u64
            })
            .collect();
        v.sort_unstable();
        v[2]
    }

    /// Decides whether to use the counter and, if so, makes the first segment.
    pub(super) fn start() -> bool {
        if !invariant() || cost(ticks) * 5 > cost(super::os_ns) * 4 {
            return false;
        }
        let p0 = pair();
        let spin = Instant::now();
        while spin.elapsed().as_micros() < 200 {
            std::hint::spin_loop();
        }
        let p1 = pair();
        let Some(mult) = rate(p0, p1) else {
            return false;
        };
        let _ = FIRST.set(p0);
        let _ = SEG[0].set(Seg {
            tsc: p1.0,
            ns: p1.1,
            mult,
        });
        NEXT.store(p1.0 + 4 * (p1.0 - p0.0), Ordering::Relaxed);
        true
    }

    /// A new segment from `t` on, with the rate measured since the first pair.
    #[cold]
    #[inline(never)]
    fn recalibrate(t: u64) {
        static LOCK: Mutex<()> = Mutex::new(());
        let Ok(_g) = LOCK.try_lock() else {
            return; // another thread is at it
        };
        if t < NEXT.load(Ordering::Relaxed) {
            return;
        }
        let cur = CUR.load(Ordering::Acquire);
        let (Some(&first), Some(&old)) = (FIRST.get(), SEG[cur].get()) else {
            return;
        };
        let p = pair();
        let done = cur + 1 == SEGS || p.1.saturating_sub(first.1) >= LONG_NS;
        if let Some(mult) = rate(first, p)
            && cur + 1 < SEGS
        {
            // Continuous at the new segment's start: the old map's value there.
            let dt = p.0.saturating_sub(old.tsc) as u128;
            let ns = old.ns + ((dt * old.mult as u128) >> 32) as u64;
            let _ = SEG[cur + 1].set(Seg { tsc: p.0, ns, mult });
            CUR.store(cur + 1, Ordering::Release);
        }
        let next = if done {
            u64::MAX
        } else {
            p.0.saturating_add(p.0.saturating_sub(first.0))
        };
        NEXT.store(next, Ordering::Relaxed);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_rate_of_two_pairs_is_nanoseconds_per_tick() {
            // 3 GHz: a third of a nanosecond per tick.
            let m = rate((1_000, 0), (3_001_000, 1_000_000)).unwrap();
            assert_eq!(m, (1u64 << 32) / 3);
            assert_eq!(rate((5, 0), (5, 10)), None);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod tsc {
    pub(super) fn now_ns() -> u64 {
        super::os_ns()
    }
    pub(super) fn start() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock runs forward at the OS clock's rate (within 2 % over 30 ms, whatever the
    /// source), and never backwards on one thread.
    #[test]
    fn keeps_pace_with_the_os_clock_and_never_goes_back() {
        let (c0, i0) = (now_ns(), Instant::now());
        let mut last = c0;
        while i0.elapsed().as_millis() < 30 {
            let c = now_ns();
            assert!(c >= last, "went back from {last} to {c}");
            last = c;
        }
        let (c1, i1) = (now_ns(), i0.elapsed().as_nanos() as f64);
        let ratio = (c1 - c0) as f64 / i1;
        assert!((0.98..1.02).contains(&ratio), "{} ({ratio})", source());
    }
}
