//! Tests that need no GPU: device discovery without a driver, the kernel disk cache, the
//! kernel sources, and (when libnvrtc is present) that every kernel compiles.

use kiln_backend_cuda::compile::{self, Group, Module};
use kiln_backend_cuda::{Cuda, device_count, try_all_gpus, try_gpu, unavailable_reason};
use kiln_core::Backend;

#[test]
fn device_discovery_never_panics() {
    let n = device_count();
    assert_eq!(try_all_gpus().len(), n);
    assert_eq!(Cuda::devices().len(), n);
    assert!(
        try_gpu(n).is_none(),
        "try_gpu past the last device must be None"
    );
    if n == 0 {
        let why = unavailable_reason().expect("no device must come with a reason");
        assert!(!why.is_empty());
        let e = Cuda::parse_device("cuda:0").unwrap_err().to_string();
        assert!(e.contains("cuda:0") && e.contains("does not exist"), "{e}");
    } else {
        assert_eq!(try_gpu(0).unwrap().to_string(), "cuda:0");
    }
    assert!(Cuda::parse_device("cpu").is_err());
    assert!(Cuda::parse_device("cuda:x").is_err());
}

#[test]
fn kernel_sources_are_embedded() {
    for m in Module::ALL {
        let src = m.full_source();
        assert!(src.contains("extern \"C\" __global__"), "{}", m.file_name());
        assert!(src.contains(&format!("#line 1 \"{}\"", m.file_name())));
    }
    // Elementwise ops have no hand-written kernels: every one is a generated program
    // (`expr_run::run_single`), compiled when first used. (The interpreter calls the op
    // functions too: it runs those programs while they compile, `src/tier.rs`.)
    for m in Module::ALL.into_iter().filter(|&m| m != Module::Interp) {
        let src = m.source();
        for k in ["op_add<", "op_lt<", "cast_to<"] {
            assert!(
                !src.contains(k),
                "{} has an elementwise kernel ({k})",
                m.file_name()
            );
        }
    }
    // Every op of the table has its device function, written from its entry.
    let ops = compile::scalar_ops();
    for op in kiln_core::UnaryOp::ALL {
        let f = format!("T op_{}(T x) {{ return {}; }}", op.name(), op.cuda().0);
        assert!(ops.contains(&f), "scalar_ops lacks {f}");
    }
}

#[test]
fn cache_key_depends_on_everything_it_must() {
    let d = std::path::Path::new("/tmp/x");
    let base = compile::cache_path(d, Module::Reduce, 90, (13, 0));
    assert_ne!(
        base,
        compile::cache_path(d, Module::Reduce, 80, (13, 0)),
        "arch"
    );
    assert_ne!(
        base,
        compile::cache_path(d, Module::Reduce, 90, (13, 1)),
        "nvrtc version"
    );
    assert_ne!(
        base,
        compile::cache_path(d, Module::Softmax, 90, (13, 0)),
        "source"
    );
    assert_eq!(
        base,
        compile::cache_path(d, Module::Reduce, 90, (13, 0)),
        "stable"
    );
    assert_ne!(
        compile::fnv128(&[b"ab", b"c"]),
        compile::fnv128(&[b"a", b"bc"])
    );
}

#[test]
fn corrupt_or_missing_cache_entries_are_ignored() {
    let dir = std::env::temp_dir().join(format!("kiln-cache-test-{}", std::process::id()));
    let p = dir.join("k.cubin");
    assert!(compile::read_cached(&p).is_none(), "missing");
    compile::write_cached(&p, b"payload bytes");
    assert_eq!(
        compile::read_cached(&p).as_deref(),
        Some(&b"payload bytes"[..])
    );
    // Flip one payload byte: the checksum must reject it.
    let mut data = std::fs::read(&p).unwrap();
    let last = data.len() - 1;
    data[last] ^= 1;
    std::fs::write(&p, &data).unwrap();
    assert!(compile::read_cached(&p).is_none(), "corrupt");
    // Truncated.
    std::fs::write(&p, &data[..10]).unwrap();
    assert!(compile::read_cached(&p).is_none(), "truncated");
    // Unwritable location: silently nothing.
    compile::write_cached(std::path::Path::new("/proc/kiln/none.cubin"), b"x");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cache_dir_follows_the_environment() {
    // Only read here (tests run in parallel; no env mutation).
    let d = compile::cache_dir();
    if let Some(v) = std::env::var_os("KILN_KERNEL_CACHE").filter(|v| !v.is_empty()) {
        assert_eq!(d.unwrap(), std::path::PathBuf::from(v));
    } else if std::env::var_os("HOME").is_some() || std::env::var_os("XDG_CACHE_HOME").is_some() {
        assert!(d.unwrap().ends_with("kiln/kernels"));
    }
}

/// A fresh machine compiles a kernel file per dtype: the group of a kernel keeps the file's
/// instance lines of its dtype (and those naming none), drops the others, and keeps the line
/// numbers NVRTC's messages cite.
#[test]
fn kernel_files_compile_per_dtype() {
    assert_eq!(
        Group::of(&["reduce", "max", "float", "row"]),
        Group::Dtype("float")
    );
    assert_eq!(Group::of(&["spin", "ns"]), Group::All);
    let full = Module::Reduce.full_source();
    let f = Module::Reduce.group_source(Group::Dtype("float"));
    assert!(f.contains("REDUCE_ALL(float)") && f.contains("MATVEC(float)"));
    assert!(!f.contains("REDUCE_ALL(double)") && !f.contains("MATVEC(double)"));
    assert!(f.contains("#define REDUCE_ALL"), "definitions are kept");
    assert_eq!(f.lines().count(), full.lines().count());
    assert_eq!(
        Module::Reduce.groups(),
        ["float", "double", "i64", "u8", "f16", "bf16"].map(Group::Dtype)
    );
    // The 16-bit floats' kernels compile only when a 16-bit tensor needs them.
    assert!(!f.contains("REDUCE_HALF(f16)") && f.contains("#define REDUCE_HALF"));
    assert_eq!(
        Module::Rand.groups(),
        ["float", "f16", "bf16"].map(Group::Dtype)
    );
    let r = Module::Rand.group_source(Group::Dtype("float"));
    assert!(r.contains("RAND_F32(float)") && !r.contains("RAND_F32(bf16)"));
    assert_eq!(Module::Util.groups(), [Group::All]);
}

/// `--minimal` (kiln's own kernels, NVRTC 12.4 on) leaves what NVRTC generates unchanged:
/// the CUBIN of a fixed group is byte for byte the one compiled with users' options.
#[test]
fn minimal_option_changes_no_cubin() {
    if !compile::nvrtc_available() {
        println!("skipped: libnvrtc not found");
        return;
    }
    let version = compile::nvrtc_version().unwrap();
    assert_eq!(
        compile::options(90, version).contains(&"--minimal".to_string()),
        version >= (12, 4)
    );
    let src = Module::Softmax.group_source(Group::Dtype("float"));
    let ours = compile::compile_source(compile::Flavor::Kiln, "softmax.cu", &src, 90).unwrap();
    let users = compile::compile_source(compile::Flavor::User, "softmax.cu", &src, 90).unwrap();
    assert!(
        ours == users,
        "CUBINs differ ({} vs {} bytes)",
        ours.len(),
        users.len()
    );
}

/// NVRTC compiles a kernel source and reports errors with file and line (`cargo xtask
/// check-kernels` compiles every source; this keeps `cargo test` fast).
#[test]
fn nvrtc_compiles_kernels_when_present() {
    if !compile::nvrtc_available() {
        println!("skipped: libnvrtc not found");
        return;
    }
    let bin = compile::compile(Module::Rand, Group::All, 90).expect("rand.cu must compile");
    assert!(
        bin.starts_with(b"\x7fELF"),
        "NVRTC must return a CUBIN (ELF)"
    );
    let e = compile::compile_source(
        compile::Flavor::Kiln,
        "broken.cu",
        "extern \"C\" __global__ void k() { oops; }",
        90,
    )
    .unwrap_err();
    assert!(
        e.contains("broken.cu(1)"),
        "error must name file and line: {e}"
    );
}
