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
//! Runtime layer, below the device state: it knows source text only (`sources.rs`), no device,
//! no generator. (Memoization per device lives in `device/kernels.rs`.)

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys as nvrtc;

use crate::sources::{Group, Module};

/// The CUBIN of `group` of our kernel file `module` for `sm_{arch}` (disk cache, else NVRTC).
pub fn load_or_compile(module: Module, group: Group, arch: u32) -> Result<Vec<u8>, String> {
    load_or_compile_source(module.file_name(), &module.group_source(group), arch)
}

/// Compiles `group` of our kernel file `module` for `sm_{arch}`, bypassing the disk cache.
pub fn compile(module: Module, group: Group, arch: u32) -> Result<Vec<u8>, String> {
    compile_source(module.file_name(), &module.group_source(group), arch)
}

/// NVRTC options for compute capability `arch` (e.g. 90). No fast-math: results match the
/// CPU backend to the usual float tolerances, and the random kernels use explicit `_rn`
/// intrinsics where bit-exactness matters.
pub fn options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".to_string(),
    ]
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
pub fn compile_source(file: &str, source: &str, arch: u32) -> Result<Vec<u8>, String> {
    if !nvrtc_available() {
        return Err("libnvrtc not found".into());
    }
    let src = CString::new(source).map_err(|e| e.to_string())?;
    let name = CString::new(file).map_err(|e| e.to_string())?;
    let prog = cudarc::nvrtc::result::create_program(&src, Some(&name))
        .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    let opts = options(arch);
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

/// The cache file for the full `source` named `file`.
pub fn source_cache_path(
    dir: &std::path::Path,
    file: &str,
    source: &str,
    arch: u32,
    version: (i32, i32),
) -> PathBuf {
    let key = fnv128(&[
        source.as_bytes(),
        options(arch).join(" ").as_bytes(),
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
pub fn load_or_compile_source(file: &str, source: &str, arch: u32) -> Result<Vec<u8>, String> {
    let version = nvrtc_version()?;
    let path = cache_dir().map(|d| source_cache_path(&d, file, source, arch, version));
    if let Some(bin) = path.as_deref().and_then(read_cached) {
        return Ok(bin);
    }
    let bin = compile_source(file, source, arch)?;
    if let Some(p) = &path {
        write_cached(p, &bin);
    }
    Ok(bin)
}
