//! Kernel compilation as a tool: the public face of `nvrtc.rs` plus [`check_all`].
//!
//! # Why a module of its own
//!
//! `cargo xtask check-kernels` compiles every kernel kiln can run without a GPU (NVRTC needs
//! none): our files under `kernels/` and sample sources of every code generator (`codegen/`,
//! `user_kernel/`). That needs every generator in view, so it sits above them;
//! the runtime below (`nvrtc.rs`: NVRTC + disk cache; `device/`: per-device memo) imports
//! only source text. Nothing inside the crate imports this module.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use crate::kernel_files::{options, user_options};
pub use crate::nvrtc::{
    Flavor, cache_dir, compile, compile_source, fnv128, load_or_compile, load_or_compile_source,
    nvrtc_available, nvrtc_version, read_cached, source_cache_path, write_cached,
};
pub use crate::sources::{COMMON, Group, Module, scalar_ops};

/// The fixed kernels' CUBINs built into this binary (`build.rs`): how many, the NVRTC version
/// that built them (`(0, 0)` if none), and a note saying for which architectures, or why
/// there are none (no NVRTC at build time, `KILN_PREBUILT=0`).
pub fn prebuilt() -> (usize, (i32, i32), &'static str) {
    crate::prebuilt::summary()
}

/// The cache file for `module` on `sm_{arch}` with NVRTC `version`.
pub fn cache_path(dir: &Path, module: Module, arch: u32, version: (i32, i32)) -> PathBuf {
    source_cache_path(
        dir,
        module.file_name(),
        &module.full_source(),
        &module.options(arch, version),
        arch,
        version,
    )
}

/// One source's outcome: its file name, the CUBIN size or NVRTC's log, and how long NVRTC took
/// (what a fresh machine waits for that kernel).
pub type CheckResult = (String, Result<usize, String>, Duration);

/// `f`'s result and how long it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t0 = Instant::now();
    let r = f();
    (r, t0.elapsed())
}

/// Compiles every kernel source for `sm_{arch}`, and sample programs of the code generators
/// (lazy chains, expression programs, user kernels): `(name, Ok or NVRTC's log)`. An outer
/// error means NVRTC itself is unavailable.
pub fn check_all(arch: u32) -> Result<Vec<CheckResult>, String> {
    nvrtc_version()?;
    let files = Module::ALL.iter().flat_map(|&m| {
        m.groups().into_iter().map(move |g| {
            let (r, t) = timed(|| compile(m, g, arch).map(|c| c.len()));
            let part = match g {
                Group::Dtype(d) => format!(" [{d}]"),
                Group::All => String::new(),
            };
            (format!("kernels/{}{part}", m.file_name()), r, t)
        })
    });
    let generated = [
        (
            "expr.cu",
            Flavor::Generated,
            crate::codegen::sample_sources(),
        ),
        (
            "user.cu",
            Flavor::User,
            crate::user_kernel::sample_sources(),
        ),
    ];
    let generated = generated.into_iter().flat_map(|(file, flavor, samples)| {
        samples.into_iter().map(move |(name, src)| {
            let (r, t) = timed(|| compile_source(flavor, file, &src, arch).map(|c| c.len()));
            (name, r, t)
        })
    });
    Ok(files.chain(generated).collect())
}
