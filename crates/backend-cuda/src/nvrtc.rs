//! NVRTC compilation and the on-disk kernel cache: CUDA C source in, CUBIN out.
//!
//! Every kernel — ours under `kernels/`, the generated ones, users' — is compiled by NVRTC to a
//! CUBIN for the exact architecture of the device (`sm_XY`), so the driver loads machine code
//! with no PTX JIT step. Results are cached on disk, keyed by a hash of the source, the NVRTC
//! options, the architecture and the NVRTC version, in `$KILN_KERNEL_CACHE` (default:
//! `$XDG_CACHE_HOME/kiln/kernels` or `~/.cache/kiln/kernels`). A cache entry carries a
//! checksum; a corrupt, truncated or unwritable cache only costs a recompilation, never an
//! error. Errors are NVRTC's log (with file and line) as a `String`; callers wrap it in the
//! typed error of their op.
//!
//! Our fixed files may skip NVRTC altogether: their CUBINs for common architectures are built
//! into the binary (`prebuilt.rs`), and compiled at most once per process otherwise
//! (`fixed_cubins.rs`). `KILN_CUDA_COMPILE_LOG=1` prints one stderr line per compile, cache hit
//! or prebuilt load ([`log_line`]): where a cold start's seconds go.
//!
//! Runtime layer, below the device state: it knows source text only (`sources.rs`), no device,
//! no generator. (Memoization per device lives in `device/kernels.rs`.)

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::time::Instant;

use cudarc::nvrtc::sys as nvrtc;

use crate::sources::{Group, Module};

/// The CUBIN of `group` of our kernel file `module` for `sm_{arch}` (disk cache, else NVRTC;
/// the prebuilt table is the caller's to try first).
pub fn load_or_compile(module: Module, group: Group, arch: u32) -> Result<Vec<u8>, String> {
    cached_or_compiled(
        Flavor::File(module),
        module.file_name(),
        group.label(),
        &module.group_source(group),
        arch,
    )
}

/// Whether the disk cache holds an entry for `group` of `module` on `sm_{arch}` (not read:
/// a corrupt entry is found out when it is loaded, and then costs a compile).
pub fn is_cached(module: Module, group: Group, arch: u32) -> bool {
    let (Some(dir), Ok(version)) = (cache_dir(), nvrtc_version()) else {
        return false;
    };
    let src = module.group_source(group);
    let opts = module.options(arch, version);
    source_cache_path(&dir, module.file_name(), &src, &opts, arch, version).exists()
}

/// Whether the disk cache holds an entry for the full `source` named `file` of `flavor` on
/// `sm_{arch}` (not read: a corrupt entry is found out when it is loaded).
pub fn is_source_cached(flavor: Flavor, file: &str, source: &str, arch: u32) -> bool {
    let (Some(dir), Ok(version), Ok(opts)) = (cache_dir(), nvrtc_version(), flavor.options(arch))
    else {
        return false;
    };
    source_cache_path(&dir, file, source, &opts, arch, version).exists()
}

/// Whether `KILN_CUDA_COMPILE_LOG=1` (read once): one stderr line per NVRTC compile, disk-cache
/// hit or prebuilt load.
pub fn log_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUDA_COMPILE_LOG").is_ok_and(|v| v.trim() == "1"))
}

/// One compile-log line (when [`log_enabled`]): the file, its group (a dtype, `*` for the
/// whole file, or a generated source's short hash), the architecture, where the CUBIN came
/// from (`prebuilt`, `disk`, `nvrtc`, ...), the milliseconds since `since`, and the thread
/// when it is a background one.
pub fn log_line(file: &str, group: &str, arch: u32, how: &str, since: Instant) {
    if !log_enabled() {
        return;
    }
    let ms = since.elapsed().as_secs_f64() * 1e3;
    let thread = std::thread::current();
    let on = thread
        .name()
        .filter(|n| n.starts_with("kiln-"))
        .map(|n| format!(" (on {n})"))
        .unwrap_or_default();
    eprintln!("kiln-cuda compile: {file} [{group}] sm_{arch} {how} {ms:.1} ms{on}");
}

/// Compiles `group` of our kernel file `module` for `sm_{arch}`, bypassing the disk cache.
pub fn compile(module: Module, group: Group, arch: u32) -> Result<Vec<u8>, String> {
    compile_source(
        Flavor::File(module),
        module.file_name(),
        &module.group_source(group),
        arch,
    )
}

/// Whose kernel a source is, which decides its NVRTC options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// Our kernels' options ([`crate::kernel_files::options`]).
    Kiln,
    /// One of our fixed files, with its own options ([`Module::options`]).
    File(Module),
    /// Our generated programs (expression programs, lazy chains, lone ops):
    /// `generated_options`.
    Generated,
    /// Our generated elementwise programs (no reduction): `generated_options` and
    /// `--fmad=false` (no multiply and add contracted into one rounding), as the interpreter
    /// (`tier.rs`) compiles, so an elementwise program gives the same bits interpreted or
    /// compiled, fused or op by op. They are bound by memory, not by the extra instruction;
    /// reductions and the optimizers' updates keep the contraction (measured: a small norm
    /// loop's GPU time 9.7 → 12.8 µs without it, H200, 2026-11-28).
    Elementwise,
    /// A user's (`ElementwiseKernel`, `RawKernel`, ...): [`crate::kernel_files::user_options`].
    User,
}

impl Flavor {
    /// The NVRTC options for `sm_{arch}` with the NVRTC loaded now.
    pub fn options(self, arch: u32) -> Result<Vec<String>, String> {
        Ok(match self {
            Flavor::Kiln => crate::kernel_files::options(arch, nvrtc_version()?),
            Flavor::File(m) => m.options(arch, nvrtc_version()?),
            Flavor::Generated => generated_options(arch, nvrtc_version()?),
            Flavor::Elementwise => {
                let mut o = generated_options(arch, nvrtc_version()?);
                o.push(crate::kernel_files::NO_FMAD.to_string());
                o
            }
            Flavor::User => crate::kernel_files::user_options(arch),
        })
    }
}

/// NVRTC options for a generated program: [`crate::kernel_files::options`], plus
/// `--Ofast-compile=<level>` (NVRTC 12.8+) when `KILN_CUDA_FAST_COMPILE` is `min`, `mid` or
/// `max`; none by default. ([`Flavor::Elementwise`] adds `--fmad=false`.)
///
/// Why not by default: a generated program is compiled the first time a process needs it,
/// while the user waits, so a faster compile would shorten a fresh machine's first steps; but
/// measured on an H100 (2026-11-27, NVRTC 13.0, BENCHMARKS.md "Fast compile of generated
/// programs"), `mid` cut the main job's NVRTC time from 859 to 540 ms and made elementwise
/// chains 30–40 % slower for the rest of the run, and `min` changed neither (720 against
/// 722 ms). The switch stays for runs that are all first steps (short tests).
pub fn generated_options(arch: u32, nvrtc: (i32, i32)) -> Vec<String> {
    static LEVEL: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let level = LEVEL.get_or_init(|| {
        std::env::var("KILN_CUDA_FAST_COMPILE")
            .ok()
            .map(|v| v.trim().to_string())
            .filter(|v| ["min", "mid", "max"].contains(&v.as_str()))
    });
    let mut o = crate::kernel_files::options(arch, nvrtc);
    if let (Some(level), true) = (level, nvrtc >= (12, 8)) {
        o.push(format!("--Ofast-compile={level}"));
    }
    o
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { nvrtc::is_culib_present() }
}

/// NVRTC's `(major, minor)` version.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    if !nvrtc_available() {
        return Err("libnvrtc not found".into());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {r:?}"));
    }
    Ok((major, minor))
}

/// Compiles CUDA C `source` (named `file` in diagnostics) for `sm_{arch}` to a CUBIN.
pub fn compile_source(
    flavor: Flavor,
    file: &str,
    source: &str,
    arch: u32,
) -> Result<Vec<u8>, String> {
    let opts = flavor.options(arch)?;
    let src = CString::new(source).map_err(|e| e.to_string())?;
    let name = CString::new(file).map_err(|e| e.to_string())?;
    let prog = cudarc::nvrtc::result::create_program(&src, Some(&name))
        .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is a live program; `src` and `name` outlive it (destroyed below).
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => cubin(prog),
        Err(e) => {
            // SAFETY: `prog` is live.
            let log = unsafe { cudarc::nvrtc::result::get_program_log(prog) }
                .map(|l| {
                    // SAFETY: NVRTC returns a NUL-terminated C string.
                    unsafe { CStr::from_ptr(l.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            Err(format!("{e:?}\n{log}"))
        }
    };
    // SAFETY: `prog` is live and not used afterwards.
    let _ = unsafe { cudarc::nvrtc::result::destroy_program(prog) };
    out
}

/// Compiles an empty kernel for `sm_{arch}` and discards it (errors too): NVRTC sets up what
/// it builds on first use, and registers its exit handlers, on this thread now (see
/// `fixed_cubins::hook_exit`, which needs them registered before its own).
pub(crate) fn warm_up(arch: u32) {
    let _ = compile_source(
        Flavor::Generated,
        "warm_up.cu",
        "extern \"C\" __global__ void kiln_warm_up() {}",
        arch,
    );
}

fn cubin(prog: nvrtc::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `prog` was compiled successfully; `size` is a valid out-pointer.
    let r = unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut size) };
    if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcGetCUBINSize: {r:?}"));
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has the size NVRTC asked for.
    let r = unsafe { nvrtc::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _) };
    if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcGetCUBIN: {r:?}"));
    }
    Ok(buf)
}

// ---- disk cache ------------------------------------------------------------------------------

const MAGIC: &[u8; 8] = b"KILNBIN1";

/// 128-bit FNV-1a: a stable (across Rust versions and platforms) content hash for cache keys.
pub use kiln_core::fasthash::fnv1a_128 as fnv128;

/// The cache directory: `$KILN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/kiln/kernels`, else
/// `$HOME/.cache/kiln/kernels`; `None` when none can be named (then nothing is cached).
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = env("KILN_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln").join("kernels"))
}

/// The cache file for the full `source` named `file`, compiled with NVRTC options `opts`.
pub fn source_cache_path(
    dir: &std::path::Path,
    file: &str,
    source: &str,
    opts: &[String],
    arch: u32,
    version: (i32, i32),
) -> PathBuf {
    let key = fnv128(&[
        source.as_bytes(),
        opts.join(" ").as_bytes(),
        format!("sm_{arch}").as_bytes(),
        format!("nvrtc {}.{}", version.0, version.1).as_bytes(),
    ]);
    dir.join(format!("{file}-sm{arch}-{key:032x}.cubin"))
}

/// Reads a cache entry; `None` when missing, truncated or corrupt.
pub fn read_cached(path: &std::path::Path) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    if data.len() < 24 || &data[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(data[8..16].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(data[16..24].try_into().ok()?);
    let payload = &data[24..];
    if payload.len() != len || (fnv128(&[payload]) as u64) != sum {
        return None;
    }
    Some(payload.to_vec())
}

/// Writes a cache entry atomically (temp file + rename); failures are ignored.
pub fn write_cached(path: &std::path::Path, payload: &[u8]) {
    let write = || -> std::io::Result<()> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let mut data = Vec::with_capacity(payload.len() + 24);
        data.extend_from_slice(MAGIC);
        data.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        data.extend_from_slice(&(fnv128(&[payload]) as u64).to_le_bytes());
        data.extend_from_slice(payload);
        std::fs::write(&tmp, &data)?;
        std::fs::rename(&tmp, path)
    };
    let _ = write();
}

/// The CUBIN of the full `source` (named `file` in diagnostics) for `sm_{arch}`: from the disk
/// cache when a valid entry exists, else compiled (and then cached).
pub fn load_or_compile_source(
    flavor: Flavor,
    file: &str,
    source: &str,
    arch: u32,
) -> Result<Vec<u8>, String> {
    let label = format!("{:08x}", fnv128(&[source.as_bytes()]) as u32);
    cached_or_compiled(flavor, file, &label, source, arch)
}

/// [`load_or_compile_source`], logged under `file [label]`.
fn cached_or_compiled(
    flavor: Flavor,
    file: &str,
    label: &str,
    source: &str,
    arch: u32,
) -> Result<Vec<u8>, String> {
    let t0 = Instant::now();
    let version = nvrtc_version()?;
    let opts = flavor.options(arch)?;
    let path = cache_dir().map(|d| source_cache_path(&d, file, source, &opts, arch, version));
    if let Some(bin) = path.as_deref().and_then(read_cached) {
        log_line(file, label, arch, "disk", t0);
        return Ok(bin);
    }
    let bin = compile_source(flavor, file, source, arch);
    log_line(
        file,
        label,
        arch,
        if bin.is_ok() { "nvrtc" } else { "nvrtc FAILED" },
        t0,
    );
    let bin = bin?;
    if let Some(p) = &path {
        write_cached(p, &bin);
    }
    Ok(bin)
}
