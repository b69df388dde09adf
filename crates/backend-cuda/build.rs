//! Prebuilds the CUBINs of kiln's fixed kernel files (`kernels/*.cu`) into the binary.
//!
//! # Why
//!
//! A program's first run on a fresh machine otherwise waits for NVRTC on the first use of each
//! fixed kernel group (seconds for `reduce.cu`). Where NVRTC can be loaded at build time, this
//! script compiles every group of every fixed file (`Module::ALL` × `Module::groups()`) for
//! each architecture of `KILN_PREBUILT_ARCHS` (default `90`; e.g. `80,90`: an `sm_80` CUBIN
//! also runs on `sm_86`/`sm_89`, never on `sm_90`; other architectures compile at run time),
//! on parallel threads, into `OUT_DIR`, and writes the table `src/prebuilt.rs` includes. The
//! text and options are the run time's own: `src/kernel_files.rs` is included here as a module.
//!
//! Where NVRTC cannot be loaded, or with `KILN_PREBUILT=0`, the table is empty and the build
//! succeeds as before (kernels compile at run time). A group NVRTC rejects is left out with a
//! `cargo:warning` (the run time then reports the error with NVRTC's log, as always).
//!
//! NVRTC is looked for at `KILN_NVRTC_LIB` (a path to the library), then by its usual names on
//! the loader's path (`LD_LIBRARY_PATH`, what `.ci/install-nvrtc.sh` prints), then where that
//! script installs it by default (`~/.cache/kiln/nvrtc-*`).

#[allow(dead_code)]
#[path = "src/kernel_files.rs"]
mod kernel_files;

use std::ffi::{CString, c_char, c_int, c_void};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kernel_files::{Group, Module, source_hash};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=src/kernel_files.rs");
    for var in [
        "KILN_PREBUILT",
        "KILN_PREBUILT_ARCHS",
        "KILN_NVRTC_LIB",
        "LD_LIBRARY_PATH",
        "XDG_CACHE_HOME",
        "HOME",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let table = match prebuild(&out) {
        Ok(t) => t,
        Err(note) => table_text(&[], (0, 0), &note),
    };
    std::fs::write(out.join("prebuilt_table.rs"), table).expect("OUT_DIR is writable");
}

/// One compiled group: (module, group, arch, source hash, CUBIN path).
type Built = (Module, Group, u32, u64, PathBuf);

/// Compiles every (module, group, arch) on worker threads; the table's text, or why none.
fn prebuild(out: &Path) -> Result<String, String> {
    if std::env::var("KILN_PREBUILT").is_ok_and(|v| v.trim() == "0") {
        return Err("KILN_PREBUILT=0 at build time".into());
    }
    let archs = archs()?;
    let nvrtc = Nvrtc::load().ok_or("libnvrtc not found at build time")?;
    let version = nvrtc.version()?;
    let dir = out.join("prebuilt");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut jobs: Vec<(Module, Group, u32, String)> = Module::ALL
        .iter()
        .flat_map(|&m| m.groups().into_iter().map(move |g| (m, g)))
        .flat_map(|(m, g)| archs.iter().map(move |&a| (m, g, a, m.group_source(g))))
        .collect();
    // Longest first (the f16 group of reduce.cu takes seconds), so the threads end together.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.3.len()));
    let threads = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse().ok())
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(2)
        .clamp(1, jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let built: Mutex<Vec<Built>> = Mutex::default();
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while let Some((m, g, arch, src)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let name = format!("{}-{}-sm{arch}.cubin", m.file_name(), g.label());
                    let path = dir.join(name.replace('*', "all"));
                    match nvrtc.compile(*m, src, *arch, version) {
                        Ok(cubin) if std::fs::write(&path, &cubin).is_ok() => {
                            let hash = source_hash(*m, src, *arch, version);
                            built.lock().unwrap().push((*m, *g, *arch, hash, path));
                        }
                        Ok(_) => println!("cargo:warning=could not write {}", path.display()),
                        Err(log) => println!(
                            "cargo:warning=prebuilding {} [{}] for sm_{arch} failed (it will \
                             compile at run time): {}",
                            m.file_name(),
                            g.label(),
                            log.lines().take(3).collect::<Vec<_>>().join(" / ")
                        ),
                    }
                }
            });
        }
    });
    let mut built = built.into_inner().unwrap();
    built.sort_by_key(|b| (b.0.file_name(), b.1.label(), b.2));
    let note = format!(
        "{} CUBINs for sm_{} built by NVRTC {}.{}",
        built.len(),
        archs
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join("/sm_"),
        version.0,
        version.1
    );
    // For whoever measures the build's cost (not part of the table: builds stay reproducible).
    let _ = std::fs::write(
        out.join("prebuilt_time.txt"),
        format!(
            "{note}: {} ms on {threads} threads\n",
            t0.elapsed().as_millis()
        ),
    );
    Ok(table_text(&built, version, &note))
}

/// `KILN_PREBUILT_ARCHS` (comma- or space-separated compute capabilities, `sm_` optional).
fn archs() -> Result<Vec<u32>, String> {
    let v = std::env::var("KILN_PREBUILT_ARCHS").unwrap_or_else(|_| "90".into());
    let mut archs = Vec::new();
    for a in v.split([',', ' ']).map(str::trim).filter(|a| !a.is_empty()) {
        let n = a.trim_start_matches("sm_").parse::<u32>();
        match n {
            Ok(n) if (50..=200).contains(&n) => archs.push(n),
            _ => {
                println!("cargo:warning=KILN_PREBUILT_ARCHS: `{a}` is no compute capability");
                return Err(format!("KILN_PREBUILT_ARCHS `{v}` not understood"));
            }
        }
    }
    archs.sort_unstable();
    archs.dedup();
    if archs.is_empty() {
        return Err("KILN_PREBUILT_ARCHS is empty".into());
    }
    Ok(archs)
}

/// The Rust text of the table `src/prebuilt.rs` includes.
fn table_text(built: &[Built], version: (i32, i32), note: &str) -> String {
    let mut s =
        String::from("/// Written by build.rs.\npub(crate) static TABLE: &[Prebuilt] = &[\n");
    for (m, g, arch, hash, path) in built {
        let _ = writeln!(
            s,
            "    Prebuilt {{ file: {:?}, group: {:?}, arch: {arch}, source_hash: {hash:#x}, \
             cubin: &Image {{ _align: [], bytes: *include_bytes!({:?}) }} }},",
            m.file_name(),
            g.label(),
            path.display().to_string()
        );
    }
    let _ = writeln!(
        s,
        "];\npub(crate) const NVRTC: (i32, i32) = ({}, {});\npub(crate) const NOTE: &str = {note:?};",
        version.0, version.1
    );
    s
}

// ---- NVRTC, loaded at build time ---------------------------------------------------------

type Prog = *mut c_void;

/// The few NVRTC entry points the build needs (the run time uses cudarc's bindings).
struct Nvrtc {
    /// libnvrtc, and its builtins library when it was loaded from a path beside it.
    _lib: (libloading::Library, Option<libloading::Library>),
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Prog) -> c_int,
}

/// Where libnvrtc may be: `KILN_NVRTC_LIB`, its names on the loader's path, then the
/// directories `.ci/install-nvrtc.sh` installs it into by default.
fn candidates() -> Vec<PathBuf> {
    let mut c: Vec<PathBuf> = std::env::var_os("KILN_NVRTC_LIB")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    let names: &[&str] = if cfg!(windows) {
        &["nvrtc64_130_0.dll", "nvrtc64_120_0.dll"]
    } else {
        &["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    };
    c.extend(names.iter().map(PathBuf::from));
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    if let Some(Ok(entries)) = cache.map(|d| std::fs::read_dir(d.join("kiln"))) {
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("nvrtc-"))
            })
            .collect();
        dirs.sort_unstable_by(|a, b| b.cmp(a)); // newest version first
        for d in dirs {
            c.push(d.join("nvidia/cu13/lib/libnvrtc.so.13"));
            c.push(d.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
        }
    }
    c
}

/// `libnvrtc-builtins.so.*` in the directory of a libnvrtc given by path (not on the loader's
/// path, so libnvrtc would not find it by name unless it is loaded first).
fn builtins_beside(lib: &Path) -> Option<PathBuf> {
    let dir = lib.parent().filter(|d| !d.as_os_str().is_empty())?;
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libnvrtc-builtins.so"))
        })
}

impl Nvrtc {
    /// The first candidate that loads, binds and compiles a trivial program (an NVRTC that
    /// cannot find its builtins library fails there, and the build silently prebuilds nothing).
    fn load() -> Option<Nvrtc> {
        candidates().into_iter().find_map(|p| {
            let builtins = builtins_beside(&p);
            // SAFETY: loading libnvrtc (and its builtins library, which it would load by
            // name itself) runs their initializers only, which have no preconditions.
            let builtins = builtins.and_then(|b| unsafe { libloading::Library::new(b) }.ok());
            // SAFETY: as above.
            let lib = unsafe { libloading::Library::new(&p) }.ok()?;
            let nvrtc = Nvrtc::bind(lib, builtins)?;
            let probe = "extern \"C\" __global__ void kiln_probe() {}";
            let version = nvrtc.version().ok()?;
            nvrtc
                .compile(Module::Util, probe, 90, version)
                .ok()
                .map(|_| nvrtc)
        })
    }

    fn bind(lib: libloading::Library, builtins: Option<libloading::Library>) -> Option<Nvrtc> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's C signature (nvrtc.h) is the field's type.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.ok()?
            };
        }
        Some(Nvrtc {
            version: sym!("nvrtcVersion"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            destroy: sym!("nvrtcDestroyProgram"),
            _lib: (lib, builtins),
        })
    }

    fn version(&self) -> Result<(i32, i32), String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let r = unsafe { (self.version)(&mut major, &mut minor) };
        (r == 0)
            .then_some((major, minor))
            .ok_or_else(|| format!("nvrtcVersion failed ({r})"))
    }

    /// The CUBIN of `source` (of `module`) for `sm_{arch}`, with the run time's options.
    fn compile(
        &self,
        module: Module,
        source: &str,
        arch: u32,
        version: (i32, i32),
    ) -> Result<Vec<u8>, String> {
        let src = CString::new(source).map_err(|e| e.to_string())?;
        let name = CString::new(module.file_name()).map_err(|e| e.to_string())?;
        let opts: Vec<CString> = module
            .options(arch, version)
            .into_iter()
            .map(|o| CString::new(o).expect("options have no NUL"))
            .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid out-pointer; NUL-terminated source and name; no headers.
        let r = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(format!("nvrtcCreateProgram failed ({r})"));
        }
        // SAFETY: `prog` is live; `opt_ptrs` holds `len` NUL-terminated strings alive here.
        let r = unsafe { (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let out = if r == 0 {
            self.read(prog, self.cubin_size, self.cubin)
        } else {
            let log = self.read(prog, self.log_size, self.log).unwrap_or_default();
            Err(format!(
                "NVRTC error {r}: {}",
                String::from_utf8_lossy(&log).trim_end_matches('\0')
            ))
        };
        // SAFETY: `prog` is live and not used afterwards.
        unsafe { (self.destroy)(&mut prog) };
        out
    }

    /// One of NVRTC's (size, contents) pairs of outputs (the CUBIN, the log) of `prog`.
    fn read(
        &self,
        prog: Prog,
        size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
        get: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    ) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: `prog` is live; valid out-pointer.
        let r = unsafe { size(prog, &mut n) };
        if r != 0 {
            return Err(format!("NVRTC size query failed ({r})"));
        }
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` has the size NVRTC asked for.
        let r = unsafe { get(prog, buf.as_mut_ptr() as *mut c_char) };
        (r == 0)
            .then_some(buf)
            .ok_or_else(|| format!("NVRTC read failed ({r})"))
    }
}
