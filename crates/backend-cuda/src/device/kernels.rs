//! The kernel cache of one device: the modules of our built-in kernels (`kernels/*.cu`, by
//! [`Module`]) and their functions by name, and the generated kernels (lazy chains, expression
//! programs, user kernels) memoized per generator under a key of the generator's choosing.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Mutex;

use cudarc::driver::sys::{self, CUresult};
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

/// Built-in modules and functions, and generated kernels, of one device.
#[derive(Default)]
pub(crate) struct KernelCache {
    /// Loaded modules, per file and group (a file compiles per dtype on first use).
    modules: Mutex<HashMap<(Module, Group), usize>>,
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
        let f = match lookup(self.module(arch, module, group)?) {
            Ok(f) => f,
            Err(_) if group != Group::All => lookup(self.module(arch, module, Group::All)?)?,
            Err(e) => return Err(e),
        };
        self.funcs.lock().unwrap().insert(key, Func(f));
        Ok(Func(f))
    }

    /// The generated kernel memoized under `key` in the memo of key type `K` (one per
    /// generator; the type is the generator's own, so this module names none of them): on a
    /// miss, `build` returns the CUBIN and the kernel's name, the module is loaded and kept
    /// (unloaded by [`super::clear_kernel_cache`]). `None` when the key is new and this generator
    /// already holds `budget` kernels on this device. The memo is locked while `build` runs,
    /// so two threads never compile the same kernel twice (other generators are not held up).
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
            .or_insert_with(|| {
                std::sync::Arc::new(Mutex::new(Box::new(FastMap::<K, Func>::default())))
            })
            .clone();
        let mut guard = slot.lock().unwrap();
        let map = guard
            .downcast_mut::<FastMap<K, Func>>()
            .expect("a memo slot holds the map of its own key type");
        if let Some(f) = map.get(key) {
            return Ok(Some(*f));
        }
        if map.len() >= budget {
            return Ok(None);
        }
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
        map.insert(key.clone(), Func(f));
        Ok(Some(Func(f)))
    }

    fn module(&self, arch: u32, module: Module, group: Group) -> Result<usize> {
        let mut mods = self.modules.lock().unwrap();
        if let Some(&m) = mods.get(&(module, group)) {
            return Ok(m);
        }
        let bin = crate::nvrtc::load_or_compile(module, group, arch).map_err(|e| {
            Error::backend(
                "nvrtc",
                format!("compiling {} for sm_{}: {e}", module.file_name(), arch),
            )
        })?;
        let mut m = std::ptr::null_mut();
        // SAFETY: `bin` is a CUBIN image for this device's architecture; valid out-pointer.
        let r = unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) };
        if r != CUresult::CUDA_SUCCESS {
            // A stale or corrupt cache entry slipped through: recompile once, bypassing it.
            let bin = crate::nvrtc::compile(module, group, arch)
                .map_err(|e| Error::backend("nvrtc", e))?;
            // SAFETY: as above.
            check(
                unsafe { sys::cuModuleLoadData(&mut m, bin.as_ptr() as *const c_void) },
                "cuModuleLoadData",
            )?;
        }
        mods.insert((module, group), m as usize);
        Ok(m as usize)
    }

    /// Forgets every function and returns every module (built-in and generated) for the
    /// caller to unload, once nothing runs on the device.
    pub fn forget_all(&self) -> Vec<usize> {
        let mut modules: Vec<usize> = self
            .modules
            .lock()
            .unwrap()
            .drain()
            .map(|(_, m)| m)
            .collect();
        self.funcs.lock().unwrap().clear();
        self.generated.slots.lock().unwrap().clear();
        modules.append(&mut self.generated.modules.lock().unwrap());
        modules
    }
}
