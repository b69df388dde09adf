//! The kernel cache of one device: the modules of our built-in kernels (`kernels/*.cu`, by
//! [`Module`]) and their functions by name, and the generated kernels (lazy chains, expression
//! programs, user kernels) memoized per generator under a key of the generator's choosing.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Mutex;

use cudarc::driver::sys;
use kiln_core::fasthash::FastMap;
use kiln_core::{Error, Result};

use super::check;
use crate::sources::{Group, Module};

/// A kernel's name, as the parts that are joined with `_` to spell it, compared and hashed by
/// the parts' addresses: every call site passes string literals, so one kernel looked up from
/// one site is one key, without reading the strings. (Comparing and hashing their bytes was
/// 12 % of the host time of d2l's matmul-and-norm loop, profiled against a stand-in driver.)
/// The same name spelled by literals at another address is another key for the same kernel:
/// one more entry, found by `cuModuleGetFunction` once.
#[derive(Clone, Copy)]
struct FuncKey([&'static str; 5]);

impl PartialEq for FuncKey {
    fn eq(&self, other: &Self) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .all(|(a, b)| std::ptr::eq(*a, *b))
    }
}

impl Eq for FuncKey {}

impl std::hash::Hash for FuncKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let h = self.0.iter().fold(0u64, |h, s| {
            (h ^ s.as_ptr() as u64 ^ (s.len() as u64) << 48).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        });
        state.write_u64(h);
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Func(pub sys::CUfunction);
// SAFETY: a CUfunction is a handle valid in its context from any thread.
unsafe impl Send for Func {}
// SAFETY: as above; launching is thread-safe in the driver.
unsafe impl Sync for Func {}

/// The generated kernels of one device: per generator (by the `TypeId` of its key type) a
/// `FastMap<K, Func>` behind its own lock (a compilation blocks only its own generator), and
/// the modules they live in.
#[derive(Default)]
struct Generated {
    slots: Mutex<HashMap<std::any::TypeId, Slot>>,
    modules: Mutex<Vec<usize>>,
}

type Slot = std::sync::Arc<Mutex<Box<dyn std::any::Any + Send>>>;

/// One built-in module: empty until loaded; its lock is held while it compiles.
type ModuleCell = std::sync::Arc<Mutex<Option<usize>>>;

/// One generated kernel: empty until built; its lock is held while it builds.
type KernelCell = std::sync::Arc<Mutex<Option<Func>>>;

/// One generator's kernels by key.
type Memo<K> = FastMap<K, KernelCell>;

/// The memo in a generator's slot.
fn memo_of<K: Eq + std::hash::Hash + 'static>(
    slot: &mut Box<dyn std::any::Any + Send>,
) -> &mut Memo<K> {
    slot.downcast_mut::<Memo<K>>()
        .expect("a memo slot holds the map of its own key type")
}

/// Built-in modules and functions, and generated kernels, of one device.
#[derive(Default)]
pub(crate) struct KernelCache {
    /// Loaded modules, per file and group (a file compiles per dtype on first use).
    /// Each behind its own lock, held while it compiles (other modules compile meanwhile).
    modules: Mutex<HashMap<(Module, Group), ModuleCell>>,
    funcs: Mutex<FastMap<FuncKey, Func>>,
    /// Generated kernels, memoized per generator (see [`KernelCache::generated_func`]).
    generated: Generated,
}

impl KernelCache {
    /// The kernel named by `parts` joined with `_` (e.g. `["reduce", "max", "float", "row"]`) in
    /// `module`, compiling (or loading from the disk cache) the part of the module holding it
    /// on first use: the instances of its dtype ([`Group::of`]), or, should the kernel not be
    /// among them, the whole file. Memoized by the parts themselves, so the hot path formats
    /// no string.
    pub fn func(&self, arch: u32, module: Module, parts: &[&'static str]) -> Result<Func> {
        let mut names = [""; 5];
        names[..parts.len()].copy_from_slice(parts);
        let key = FuncKey(names);
        if let Some(f) = self.funcs.lock().unwrap().get(&key) {
            return Ok(*f);
        }
        let name = parts.join("_");
        let cname = CString::new(name.as_str()).map_err(|e| Error::backend("kernel lookup", e))?;
        let lookup = |m: usize| {
            let mut f = std::ptr::null_mut();
            // SAFETY: `m` is a loaded module of this context; valid out-pointer.
            check(
                unsafe { sys::cuModuleGetFunction(&mut f, m as sys::CUmodule, cname.as_ptr()) },
                "cuModuleGetFunction",
            )
            .map(|()| f)
            .map_err(|e| Error::backend("kernel lookup", format!("{name}: {e}")))
        };
        let group = Group::of(parts);
        let f = match lookup(self.module(arch, module, group, &name)?) {
            Ok(f) => f,
            Err(_) if group != Group::All => {
                lookup(self.module(arch, module, Group::All, &name)?)?
            }
            Err(e) => return Err(e),
        };
        self.funcs.lock().unwrap().insert(key, Func(f));
        Ok(Func(f))
    }

    /// The generated kernel memoized under `key` in the memo of key type `K` (one per
    /// generator; the type is the generator's own, so this module names none of them): on a
    /// miss, `build` returns the CUBIN and the kernel's name, the module is loaded and kept
    /// (unloaded by [`super::clear_kernel_cache`]). `None` when the key is new and this generator
    /// already holds `budget` kernels on this device.
    ///
    /// Each key has its own lock, held while `build` runs: two threads never compile the same
    /// kernel twice, and threads that need different kernels compile them in parallel (NVRTC
    /// is thread-safe), which is what a multi-threaded program on a fresh machine waits for.
    pub fn generated_func<K>(
        &self,
        key: &K,
        budget: usize,
        build: impl FnOnce() -> Result<(Vec<u8>, CString)>,
        bind: impl FnOnce() -> Result<()>,
    ) -> Result<Option<Func>>
    where
        K: Clone + Eq + std::hash::Hash + Send + 'static,
    {
        let slot: Slot = self
            .generated
            .slots
            .lock()
            .unwrap()
            .entry(std::any::TypeId::of::<K>())
            .or_insert_with(|| std::sync::Arc::new(Mutex::new(Box::new(Memo::<K>::default()))))
            .clone();
        let cell = {
            let mut guard = slot.lock().unwrap();
            let map = memo_of::<K>(&mut guard);
            match map.get(key) {
                Some(c) => c.clone(),
                None if map.len() >= budget => return Ok(None),
                None => {
                    let c = KernelCell::default();
                    map.insert(key.clone(), c.clone());
                    c
                }
            }
        };
        let mut done = cell.lock().unwrap();
        if let Some(f) = *done {
            return Ok(Some(f));
        }
        let f = self.load_generated(build, bind);
        match f {
            Ok(f) => {
                *done = Some(f);
                Ok(Some(f))
            }
            Err(e) => {
                // Forget the key, so that the failure does not count against the budget.
                drop(done);
                memo_of::<K>(&mut slot.lock().unwrap()).remove(key);
                Err(e)
            }
        }
    }

    /// Whether [`KernelCache::generated_func`] of `key` would answer without building: the
    /// kernel is loaded (or another thread is building it, which it would wait for), or the
    /// key is new and the memo holds `budget` kernels already (`None`).
    pub fn generated_settled<K>(&self, key: &K, budget: usize) -> bool
    where
        K: Eq + std::hash::Hash + 'static,
    {
        let slot = (self.generated.slots.lock().unwrap())
            .get(&std::any::TypeId::of::<K>())
            .cloned();
        let Some(slot) = slot else {
            return budget == 0;
        };
        let mut guard = slot.lock().unwrap();
        let map = memo_of::<K>(&mut guard);
        match map.get(key) {
            Some(c) => c.try_lock().map_or(true, |f| f.is_some()),
            None => map.len() >= budget,
        }
    }

    /// Builds a generated kernel and loads its module (kept until `forget_all`).
    fn load_generated(
        &self,
        build: impl FnOnce() -> Result<(Vec<u8>, CString)>,
        bind: impl FnOnce() -> Result<()>,
    ) -> Result<Func> {
        let (bin, name) = build()?;
        bind()?;
        let mut m = std::ptr::null_mut();
        // SAFETY: `bin` is a CUBIN image (NVRTC output for this device's architecture), alive
        // for the call; valid out-pointer; this device's context is current (`bind` above).
        check(
            unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        let mut f = std::ptr::null_mut();
        // SAFETY: `m` is the module just loaded into this context; the name is NUL-terminated.
        let found = check(
            unsafe { sys::cuModuleGetFunction(&mut f, m, name.as_ptr()) },
            "cuModuleGetFunction",
        );
        if let Err(e) = found {
            // SAFETY: the module was loaded above and none of its functions is known.
            unsafe { sys::cuModuleUnload(m) };
            return Err(Error::backend(
                "cuModuleGetFunction",
                format!(
                    "no kernel `{}` in the compiled module: {e}",
                    name.to_string_lossy()
                ),
            ));
        }
        self.generated.modules.lock().unwrap().push(m as usize);
        Ok(Func(f))
    }

    /// The loaded `group` of `module`, loading it on first use (for kernel `kernel`, named in
    /// a compile error).
    fn module(&self, arch: u32, module: Module, group: Group, kernel: &str) -> Result<usize> {
        let cell = self
            .modules
            .lock()
            .unwrap()
            .entry((module, group))
            .or_default()
            .clone();
        let mut loaded = cell.lock().unwrap();
        if let Some(m) = *loaded {
            return Ok(m);
        }
        let m = load_fixed(arch, module, group, kernel)?;
        *loaded = Some(m);
        Ok(m)
    }

    /// Forgets every function and returns every module (built-in and generated) for the
    /// caller to unload, once nothing runs on the device.
    pub fn forget_all(&self) -> Vec<usize> {
        let mut modules: Vec<usize> = self
            .modules
            .lock()
            .unwrap()
            .drain()
            .filter_map(|(_, m)| *m.lock().unwrap())
            .collect();
        self.funcs.lock().unwrap().clear();
        self.generated.slots.lock().unwrap().clear();
        modules.append(&mut self.generated.modules.lock().unwrap());
        modules
    }
}

/// Loads `group` of the fixed file `module` into the current context: the prebuilt CUBIN when
/// the binary has one for this device that the driver accepts, else the once-per-process
/// CUBIN from the disk cache or NVRTC (`fixed_cubins.rs`), else — the driver refused that one,
/// a stale cache entry — a fresh compile. A refused prebuilt image costs a compile, never an
/// error; a compile error names the file, the group, the architecture and the kernel asked
/// for, with NVRTC's log.
fn load_fixed(arch: u32, module: Module, group: Group, kernel: &str) -> Result<usize> {
    let (file, label) = (module.file_name(), group.label());
    let t0 = std::time::Instant::now();
    if let Some(p) = crate::prebuilt::find(module, group, arch) {
        match load_image(&p.cubin.bytes) {
            Ok(m) => {
                crate::nvrtc::log_line(file, label, arch, "prebuilt", t0);
                return Ok(m);
            }
            Err(e) => {
                let how = format!("prebuilt for sm_{} refused by the driver ({e})", p.arch);
                crate::nvrtc::log_line(file, label, arch, &how, t0);
            }
        }
    }
    let failed = |e: String| {
        Error::backend(
            "nvrtc",
            format!("compiling {file} [{label}] for sm_{arch} (for kernel `{kernel}`): {e}"),
        )
    };
    let bin = crate::fixed_cubins::cubin(module, group, arch).map_err(failed)?;
    match load_image(&bin) {
        Ok(m) => Ok(m),
        Err(_) => {
            // A stale or corrupt cache entry slipped through: recompile once, bypassing it.
            let bin = crate::nvrtc::compile(module, group, arch).map_err(failed)?;
            load_image(&bin)
        }
    }
}

/// Loads a CUBIN image into the current context; the module's handle.
fn load_image(bin: &[u8]) -> Result<usize> {
    let mut m = std::ptr::null_mut();
    // SAFETY: `bin` is a whole CUBIN image (NVRTC output or a prebuilt one; the driver checks
    // it and refuses what it cannot load), alive for the call; valid out-pointer.
    check(
        unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) },
        "cuModuleLoadData",
    )?;
    Ok(m as usize)
}
