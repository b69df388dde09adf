//! The CUBINs of our fixed kernel files that are not prebuilt: compiled at most once per
//! process, and the ones nearly every program needs started in the background when the first
//! device comes up.
//!
//! # Why
//!
//! A fresh machine used to compile each fixed group on the thread that first needed it, one
//! after another. Now:
//!
//! - **Never twice**: [`cubin`] memoizes per (file, group, architecture) in a [`OnceMap`]; a
//!   second requester (another device, a background worker, another thread) waits for the
//!   compile in flight instead of starting its own.
//! - **In parallel, ahead of use**: [`prefetch`] starts, on worker threads, the f32 groups of
//!   the files almost every program uses ([`COMMON_GROUPS`]) unless the binary has them
//!   prebuilt or the disk cache holds them; the first real use then waits on a compile already
//!   under way (NVRTC is thread-safe per program).
//! - **Exit waits**: a process must not exit while a worker is inside NVRTC (its static
//!   destructors would run under the worker's feet), so an `atexit` hook waits, bounded, for
//!   the workers in flight. Workers never panic: a failed compile is a memoized `Err` carrying
//!   NVRTC's log, reported to whoever needs that kernel.
//!
//! Runtime layer: above `nvrtc.rs` and `prebuilt.rs`, below `device/`.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::kernel_files::{Group, Module};

/// A CUBIN shared by everyone who asked for it.
pub(crate) type Cubin = Arc<[u8]>;

/// Once-cells by key: the first caller of a key runs its computation; callers meanwhile wait
/// for that result, and later ones get it at once.
pub(crate) struct OnceMap<K, V> {
    cells: Mutex<HashMap<K, Arc<OnceLock<V>>>>,
}

impl<K: Eq + Hash, V: Clone> OnceMap<K, V> {
    pub fn new() -> Self {
        OnceMap {
            cells: Mutex::new(HashMap::new()),
        }
    }

    /// The value of `key`, computed by `f` if nobody did or does; and whether this call ran
    /// `f` (false: it found the value, or waited for another thread's computation).
    pub fn get_or_compute(&self, key: K, f: impl FnOnce() -> V) -> (V, bool) {
        let cell = self.cells.lock().unwrap().entry(key).or_default().clone();
        let mut ran = false;
        let v = cell.get_or_init(|| {
            ran = true;
            f()
        });
        (v.clone(), ran)
    }

    /// Whether `key`'s value is computed (not merely under way).
    pub fn computed(&self, key: &K) -> bool {
        let cell = self.cells.lock().unwrap().get(key).cloned();
        cell.is_some_and(|c| c.get().is_some())
    }

    /// Whether `key` has a cell (computed, or being computed).
    pub fn has(&self, key: &K) -> bool {
        self.cells.lock().unwrap().contains_key(key)
    }
}

type Key = (Module, Group, u32);

fn memo() -> &'static OnceMap<Key, Result<Cubin, String>> {
    static MEMO: OnceLock<OnceMap<Key, Result<Cubin, String>>> = OnceLock::new();
    MEMO.get_or_init(OnceMap::new)
}

/// The CUBIN of `group` of `module` for `sm_{arch}` from the disk cache or NVRTC, once per
/// process (see the module docs); `Err` is NVRTC's log.
pub(crate) fn cubin(module: Module, group: Group, arch: u32) -> Result<Cubin, String> {
    let t0 = Instant::now();
    let (r, ran) = memo().get_or_compute((module, group, arch), || {
        crate::nvrtc::load_or_compile(module, group, arch).map(Cubin::from)
    });
    if !ran && t0.elapsed() > Duration::from_millis(1) {
        let how = "waited for the compile in flight";
        crate::nvrtc::log_line(module.file_name(), group.label(), arch, how, t0);
    }
    r
}

/// Whether `group` of `module` loads on `sm_{arch}` without waiting for NVRTC: prebuilt, or
/// compiled (or read from the disk cache) by this process already.
pub(crate) fn available(module: Module, group: Group, arch: u32) -> bool {
    crate::prebuilt::find(module, group, arch).is_some() || memo().computed(&(module, group, arch))
}

/// The groups an f32 training program loads: those the main job (`examples/mnist`) loaded, by
/// its compile log (`KILN_CUDA_COMPILE_LOG=1`). Random initialization comes first in a
/// program, so its own thread usually starts that one, and the workers take it last.
/// The interpreter comes first: a program's first runs take it while their kernels compile
/// (`tier.rs`), and it is used only once it is loaded or compiled.
pub(crate) const COMMON_GROUPS: [(Module, Group); 5] = [
    (Module::Interp, Group::All),
    (Module::Reduce, Group::Dtype("float")),
    (Module::Softmax, Group::Dtype("float")),
    (Module::Reduce, Group::Dtype("i64")),
    (Module::Rand, Group::Dtype("float")),
];

/// Starts compiling, on background threads, the [`COMMON_GROUPS`] for `sm_{arch}` that are
/// neither prebuilt nor in the disk cache nor already requested. Once per architecture;
/// returns at once.
pub(crate) fn prefetch(arch: u32) {
    static STARTED: Mutex<Vec<u32>> = Mutex::new(Vec::new());
    if crate::nvrtc::log_enabled() && STARTED.lock().unwrap().is_empty() {
        let (n, _, note) = crate::prebuilt::summary();
        let off = if crate::prebuilt::enabled() {
            ""
        } else {
            ", not used: KILN_PREBUILT=0"
        };
        eprintln!("kiln-cuda compile: {n} prebuilt CUBINs in this binary ({note}{off})");
    }
    {
        let mut started = STARTED.lock().unwrap();
        if started.contains(&arch) || !crate::nvrtc::nvrtc_available() {
            return;
        }
        started.push(arch);
    }
    let todo: Vec<(Module, Group)> = COMMON_GROUPS
        .into_iter()
        .filter(|&(m, g)| {
            crate::prebuilt::find(m, g, arch).is_none()
                && !memo().has(&(m, g, arch))
                && !crate::nvrtc::is_cached(m, g, arch)
        })
        .collect();
    if todo.is_empty() {
        return;
    }
    // Leave a core to the program itself.
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get().saturating_sub(1))
        .clamp(1, todo.len());
    let queue = Arc::new(Mutex::new(todo.into_iter()));
    for i in 0..workers {
        let queue = queue.clone();
        let work = move || {
            loop {
                let next = queue.lock().unwrap().next();
                let Some((m, g)) = next else { break };
                // Started by someone else meanwhile: not worth waiting for here.
                if memo().has(&(m, g, arch)) {
                    continue;
                }
                // The result is memoized for whoever needs it; errors reach them there.
                let _ = cubin(m, g, arch);
                rehook_after_new_libraries();
            }
        };
        hook_exit(arch);
        wait_at_thread_exit();
        in_flight().start();
        let spawned = std::thread::Builder::new()
            .name(format!("kiln-prefetch-{i}"))
            .spawn(move || {
                let _done = Finished;
                work();
            });
        if spawned.is_err() {
            in_flight().finish(); // no thread: the groups compile on first use instead
        }
    }
}

/// Background workers still running, and the `atexit` hook that waits for them.
pub(crate) struct InFlight {
    count: Mutex<usize>,
    zero: Condvar,
    /// Set when the process exits: workers start no new compile.
    exiting: std::sync::atomic::AtomicBool,
}

/// How long process exit waits for background compiles at most (reduce.cu's f16 group takes
/// ~7 s on a small VM; the common f32 groups ~2 s).
const EXIT_WAIT: Duration = Duration::from_secs(20);

unsafe extern "C" {
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// The background workers' count (see [`hook_exit`] for the exit hook that waits for them).
pub(crate) fn in_flight() -> &'static InFlight {
    static IN_FLIGHT: OnceLock<InFlight> = OnceLock::new();
    IN_FLIGHT.get_or_init(InFlight::new)
}

/// Makes process exit wait for background compiles: once per process, on the thread that
/// starts the first one, before it starts.
///
/// Exit runs `atexit` hooks, C++ static destructors and libraries' destructors newest first,
/// so the hook must be registered after everything NVRTC registers, or a worker still
/// compiling runs under torn-down NVRTC state. NVRTC registers handlers of its own during its
/// first compile (statics built on first use): a C program on the development machine whose
/// hook was registered before NVRTC's first compile crashed when it exited 10-20 ms into a
/// compile, and never when an empty kernel was compiled first. So an empty kernel is compiled
/// here first ([`crate::nvrtc::warm_up`], ~10-40 ms once, on this thread), NVRTC's builtins
/// library is loaded, and only then is the hook registered; libraries loaded later (cuBLAS,
/// cuDNN) get it registered once more ([`rehook_after_new_libraries`]). The exiting thread's
/// thread-local destructors run before all of these: [`wait_at_thread_exit`] covers them.
pub(crate) fn hook_exit(arch: u32) {
    static HOOKED: std::sync::Once = std::sync::Once::new();
    HOOKED.call_once(|| {
        preload_nvrtc_builtins();
        crate::nvrtc::warm_up(arch);
        // SAFETY: registers a plain `extern "C" fn()` with the C runtime; it touches only a
        // static (built on first use) and its mutex/condvar.
        unsafe { atexit(wait_at_exit) };
    });
}

/// Makes this thread's exit wait for background compiles before its thread-local
/// destructors run (newest first, so before every one registered until now).
///
/// Why, besides [`hook_exit`]: at process exit the exiting thread's thread-local destructors
/// run before any `atexit` hook (glibc's `exit`), and a test that exited 15-30 ms into a
/// background compile crashed inside NVRTC while kiln's hook was already waiting for it
/// (H200, 2026-11-28, diagnostics printed by the hook and a SIGSEGV handler; with this wait,
/// none in 21 exits). Called on the thread that starts a background compile, once per compile
/// (a small record each, freed when the thread ends). At a plain thread exit it waits for the
/// compiles under way too (tens of ms), and no longer.
pub(crate) fn wait_at_thread_exit() {
    #[cfg(target_os = "linux")]
    {
        unsafe extern "C" {
            fn __cxa_thread_atexit_impl(
                dtor: unsafe extern "C" fn(*mut std::ffi::c_void),
                obj: *mut std::ffi::c_void,
                dso_symbol: *mut std::ffi::c_void,
            ) -> std::ffi::c_int;
        }
        unsafe extern "C" fn wait(_: *mut std::ffi::c_void) {
            in_flight().wait(EXIT_WAIT);
        }
        // SAFETY: registers a destructor for this thread with the C runtime; it takes no
        // object and touches only a static; the DSO symbol is a function of this binary.
        unsafe {
            __cxa_thread_atexit_impl(wait, std::ptr::null_mut(), wait as *mut std::ffi::c_void)
        };
    }
}

/// Registers the exit hook again when libraries were loaded since it last was (cuBLAS, cuDNN,
/// NVRTC's builtins: each loaded on first use). Exit runs the newest registrations first, so
/// a library loaded after the hook would be torn down while a background compile still runs —
/// cuDNN compiles its own kernels through the same NVRTC, and a segfault at the exit of the
/// test binary that runs convolutions and then transformer layers was seen until this was
/// called before each background compile. Waiting again at exit costs nothing.
pub(crate) fn rehook_after_new_libraries() {
    static HOOKED_AT: Mutex<usize> = Mutex::new(0);
    let loaded = loaded_objects();
    let mut at = HOOKED_AT.lock().unwrap();
    if loaded > *at {
        *at = loaded;
        // SAFETY: as in `hook_exit`.
        unsafe { atexit(wait_at_exit) };
    }
}

/// How many shared objects the process has loaded (`dl_iterate_phdr`); 0 where unknown.
fn loaded_objects() -> usize {
    #[cfg(target_os = "linux")]
    {
        unsafe extern "C" {
            fn dl_iterate_phdr(
                cb: unsafe extern "C" fn(
                    *mut std::ffi::c_void,
                    usize,
                    *mut std::ffi::c_void,
                ) -> i32,
                data: *mut std::ffi::c_void,
            ) -> i32;
        }
        unsafe extern "C" fn count(
            _: *mut std::ffi::c_void,
            _: usize,
            n: *mut std::ffi::c_void,
        ) -> i32 {
            // SAFETY: `n` is the `usize` passed below, alive for the call.
            unsafe { *(n as *mut usize) += 1 };
            0
        }
        let mut n = 0usize;
        // SAFETY: the callback only counts into `n`, which outlives the call.
        unsafe { dl_iterate_phdr(count, &mut n as *mut usize as *mut std::ffi::c_void) };
        n
    }
    #[cfg(not(target_os = "linux"))]
    0
}

/// Loads `libnvrtc-builtins.so.<major>.<minor>` (what NVRTC loads at its first compile) now,
/// and keeps it; nothing if it is not found by that name.
fn preload_nvrtc_builtins() {
    #[cfg(target_os = "linux")]
    {
        const RTLD_NOW: std::ffi::c_int = 2;
        const RTLD_GLOBAL: std::ffi::c_int = 0x100;
        unsafe extern "C" {
            fn dlopen(
                file: *const std::ffi::c_char,
                flag: std::ffi::c_int,
            ) -> *mut std::ffi::c_void;
        }
        let Ok((major, minor)) = crate::nvrtc::nvrtc_version() else {
            return;
        };
        let Ok(name) = std::ffi::CString::new(format!("libnvrtc-builtins.so.{major}.{minor}"))
        else {
            return;
        };
        // SAFETY: a NUL-terminated library name; the handle is kept for the process (never
        // closed), and the library's initializers have no preconditions.
        let _ = unsafe { dlopen(name.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
    }
}

impl InFlight {
    fn new() -> Self {
        InFlight {
            count: Mutex::new(0),
            zero: Condvar::new(),
            exiting: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn start(&self) {
        *self.count.lock().unwrap() += 1;
    }

    /// Counts a worker about to compile, unless the process is exiting: the guard marks it
    /// finished when dropped.
    pub(crate) fn enter(&self) -> Option<Finished> {
        self.start();
        let guard = Finished;
        (!self.exiting.load(std::sync::atomic::Ordering::SeqCst)).then_some(guard)
    }

    fn finish(&self) {
        let mut n = self.count.lock().unwrap();
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.zero.notify_all();
        }
    }

    /// Waits until no worker runs, or `limit` passed; whether none runs.
    fn wait(&self, limit: Duration) -> bool {
        let n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let (n, _) = self
            .zero
            .wait_timeout_while(n, limit, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        *n == 0
    }
}

/// Marks a worker finished when dropped (also if it unwound).
pub(crate) struct Finished;

impl Drop for Finished {
    fn drop(&mut self) {
        in_flight().finish();
    }
}

extern "C" fn wait_at_exit() {
    let f = in_flight();
    f.exiting.store(true, std::sync::atomic::Ordering::SeqCst);
    f.wait(EXIT_WAIT);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Eight threads ask for the same key while its computation is slow: it runs once, and
    /// every thread gets its value; another key computes on its own.
    #[test]
    fn once_map_computes_each_key_once_under_concurrent_requests() {
        let map: OnceMap<u32, Result<Arc<[u8]>, String>> = OnceMap::new();
        let calls = AtomicUsize::new(0);
        let ran = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let (v, r) = map.get_or_compute(7, || {
                        calls.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(100));
                        Ok(Arc::from(&b"cubin"[..]))
                    });
                    assert_eq!(&*v.unwrap(), b"cubin");
                    ran.fetch_add(r as usize, Ordering::SeqCst);
                });
            }
        });
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let (v, r) = map.get_or_compute(8, || Err("log".into()));
        assert!(r && v.is_err());
        // An error is kept too: the same failure is not compiled again.
        let (v, r) = map.get_or_compute(8, || unreachable!());
        assert_eq!(v.unwrap_err(), "log");
        assert!(!r && map.has(&8) && !map.has(&9));
    }

    #[test]
    fn in_flight_wait_returns_when_workers_finish_or_the_limit_passes() {
        let f = InFlight::new();
        assert!(f.wait(Duration::ZERO));
        f.start();
        assert!(!f.wait(Duration::from_millis(20)));
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                f.finish();
            });
            assert!(f.wait(Duration::from_secs(10)));
        });
    }

    /// Two threads needing the same fixed group of a file get one compile (needs libnvrtc;
    /// no GPU): the second waits for the first's result, errors included.
    #[test]
    fn a_fixed_group_compiles_once_per_process() {
        if !crate::nvrtc::nvrtc_available() {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        let key = (Module::Copy, Group::Dtype("u8"), 75);
        let results: Vec<Result<Cubin, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|_| s.spawn(|| cubin(key.0, key.1, key.2)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let first = results[0].as_ref().unwrap();
        for r in &results {
            assert!(Arc::ptr_eq(first, r.as_ref().unwrap()), "one shared CUBIN");
        }
    }
}
