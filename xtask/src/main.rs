//! kiln's build tasks, run as `cargo xtask <task>`:
//!
//! - `test`: `cargo test --workspace`.
//! - `bench`: the CPU criterion benches.
//! - `check-kernels`: compiles every CUDA kernel with NVRTC for sm_90 (no GPU needed) and
//!   reports errors with file and line. Without libnvrtc it prints `skipped: libnvrtc not
//!   found` and succeeds locally, but fails under CI (`CI=true`).
//! - `test-gpu [--run]`: builds the GPU test binaries (release, stripped) listed in [`GPU_TESTS`]
//!   into `target/gpu-bundle/tests.tar.gz` with a `run.sh` that unpacks them, runs them
//!   (`KILN_TEST_JOBS` binaries at a time, default 6) and prints one summary line; those two files are what travels to a GPU machine (packed, since
//!   the binaries alone are over the device tool's carry limit). Past 52 MiB packed, the
//!   binaries go in parts (`tests-1.tar.gz`, `tests-2.tar.gz`, ...), one call carrying `run.sh`
//!   and one part. `--run` also runs it here.
//! - `bench-gpu [--run]`: the same for the GPU benches (packed into `benches.tar.gz`) plus
//!   `bench/gpu_torch.py`, `bench/gpu_cupy.py` and the whole-model twins, whose run prints one
//!   kiln-vs-PyTorch/CuPy table (`target/gpu-bundle/bench.sh`); it also carries the `mnist`,
//!   `gpt` and `bench_train` examples (packed into `examples.tar.gz`: the first minute, the
//!   GPT and ResNet-18 rows of `bench/models_gpu.py`) and `profile.sh`, which runs `mnist` on
//!   the GPU with `KILN_PROFILE=1`.
//!
//! - `multi-gpu`: the two-GPU bundle: the `data_parallel`, `model_parallel` and
//!   `two_gpu_matmul` examples, the NCCL test binary, the bundled MNIST files,
//!   `bench/ddp_torch.py` (PyTorch DDP twin) and `multi_gpu.sh` (from `bench/`), which runs
//!   every check and benchmark and prints a summary: `bash target/gpu-bundle/multi_gpu.sh`.
//!
//! Why a bundle: the GPU machine has no Rust toolchain, so binaries are built here and carried.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// GPU integration tests: (package, test targets; empty = every test target of the package).
/// Add a crate's GPU tests here with one line.
const GPU_TESTS: &[(&str, &[&str])] = &[
    ("kiln-backend-cuda", &[]),
    (
        "kiln-autograd",
        &[
            "cuda_gradients",
            "cuda_attention",
            "cuda_norm",
            "cuda_concurrent",
            "batch_norm_half",
            "cuda_batch_norm_sizes",
        ],
    ),
    (
        "kiln-nn",
        &[
            "cuda",
            "cuda_conv",
            "cuda_conv_route",
            "cuda_conv_graph",
            "cuda_conv_bn",
        ],
    ),
    ("kiln-optim", &["amp_devices", "clip_update"]),
];
/// GPU benches (harnesses that print `BENCH kiln <name> <value> <unit>` lines).
const GPU_BENCHES: &[(&str, &[&str])] = &[(
    "kiln-backend-cuda",
    &["gpu", "transfer", "fuse", "steps", "ops", "conv"],
)];
/// Examples carried by the bench bundle, packed into `examples.tar.gz`: `mnist` for the first
/// minute (`cold_start.py`) and `profile.sh`, `gpt` and `bench_train` for the whole-model rows
/// (`bench/models_gpu.py`), `loader_overlap` to run by hand.
const GPU_EXAMPLES: &[&str] = &["mnist", "loader_overlap", "gpt", "bench_train"];
/// The lines of `run.sh` and `bench.sh` that find cuDNN, which convolutions use and which is
/// not part of the driver: where it is only inside PyTorch's wheel, its directory
/// (`site-packages/nvidia/cudnn/lib`, or `torch/lib` when that holds it) goes first on
/// `LD_LIBRARY_PATH`. Nothing happens when neither is there (convolutions then say once that
/// they use kiln's im2col path).
const CUDNN_PATH: &str = r#"# cuDNN for convolutions: PyTorch's wheel's copy first on the library path, where there is one.
cudnn_lib=$(python3 -c 'import os, nvidia.cudnn as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
if [ -z "$cudnn_lib" ] || ! ls "$cudnn_lib"/libcudnn.so* >/dev/null 2>&1; then
    cudnn_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
fi
if [ -n "$cudnn_lib" ] && ls "$cudnn_lib"/libcudnn.so* >/dev/null 2>&1; then
    export LD_LIBRARY_PATH="$cudnn_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # cudarc asks the loader for `libcudnn.so` before `libcudnn.so.9`; the wheel has only the
    # latter, so a system `libcudnn.so` (another version) would win: name PyTorch's copy.
    if [ ! -e "$cudnn_lib/libcudnn.so" ] && [ -e "$cudnn_lib/libcudnn.so.9" ]; then
        mkdir -p .cudnn && ln -sf "$cudnn_lib/libcudnn.so.9" .cudnn/libcudnn.so
        export LD_LIBRARY_PATH="$PWD/.cudnn:$LD_LIBRARY_PATH"
    fi
    echo "cuDNN from $cudnn_lib"
fi
"#;
/// The bundle must fit the device tool's carry limit.
const BUNDLE_LIMIT: u64 = 64 << 20;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let run = args.iter().any(|a| a == "--run");
    let r = match args.first().map(String::as_str) {
        Some("test") => cargo(&["test", "--workspace"]),
        Some("bench") => cpu_bench(),
        Some("check-kernels") => check_kernels(),
        Some("test-gpu") => bundle(Kind::Test, run),
        Some("bench-gpu") => bundle(Kind::Bench, run),
        Some("multi-gpu") => multi_gpu_bundle(run),
        _ => {
            eprintln!(
                "usage: cargo xtask <test | bench | check-kernels | test-gpu [--run] | bench-gpu [--run] | multi-gpu [--run]>"
            );
            Err("unknown task".into())
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo(args: &[&str]) -> Result<(), String> {
    let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(root())
        .status()
        .map_err(|e| e.to_string())?;
    st.success()
        .then_some(())
        .ok_or_else(|| format!("cargo {} failed", args.join(" ")))
}

/// The CPU benchmarks beside numpy in the same run: `bench/cpu_compare.sh` and
/// `bench/fuse_compare.sh`, one round each (each builds its criterion bench, then alternates
/// kiln and numpy). Criterion alone, saying why, where python3 cannot import numpy.
fn cpu_bench() -> Result<(), String> {
    let numpy = Command::new("python3")
        .args(["-c", "import numpy"])
        .status()
        .is_ok_and(|s| s.success());
    if !numpy {
        eprintln!("xtask bench: python3 cannot import numpy; running kiln's side only");
        return cargo(&["bench", "-p", "kiln-backend-cpu"]);
    }
    for script in ["cpu_compare.sh", "fuse_compare.sh"] {
        let st = Command::new("bash")
            .arg(root().join("bench").join(script))
            .arg("1")
            .current_dir(root())
            .status()
            .map_err(|e| format!("bench/{script}: {e}"))?;
        if !st.success() {
            return Err(format!("bench/{script} failed"));
        }
    }
    Ok(())
}

fn check_kernels() -> Result<(), String> {
    use kiln_backend_cuda::compile;
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    if !compile::nvrtc_available() {
        if ci {
            return Err(
                "libnvrtc not found (CI=true: install it with .ci/install-nvrtc.sh and put its \
                 output on LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        println!("skipped: libnvrtc not found");
        return Ok(());
    }
    let (major, minor) = compile::nvrtc_version()?;
    println!("NVRTC {major}.{minor}, target sm_90");
    let mut failed = 0;
    let mut total = std::time::Duration::ZERO;
    for (file, r, took) in compile::check_all(90)? {
        total += took;
        match r {
            Ok(bytes) => println!(
                "ok   {file} ({bytes} bytes of CUBIN, {} ms)",
                took.as_millis()
            ),
            Err(log) => {
                failed += 1;
                println!("FAIL {file}");
                for line in log.lines().filter(|l| !l.trim().is_empty()) {
                    println!("     {line}");
                }
            }
        }
    }
    println!("NVRTC time, all sources: {} ms", total.as_millis());
    if failed > 0 {
        return Err(format!("{failed} kernel source(s) failed to compile"));
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Test,
    Bench,
}

/// Builds the test (or bench) executables with `--message-format=json` and returns their paths.
fn build_executables(kind: Kind) -> Result<Vec<(String, PathBuf)>, String> {
    let targets = match kind {
        Kind::Test => GPU_TESTS,
        Kind::Bench => GPU_BENCHES,
    };
    let mut exes = Vec::new();
    for (pkg, names) in targets {
        let mut args: Vec<&str> = match kind {
            Kind::Test => vec!["test", "--release", "--no-run"],
            Kind::Bench => vec!["bench", "--no-run"],
        };
        args.extend(["--message-format=json-render-diagnostics", "-p", pkg]);
        let flag = match kind {
            Kind::Test => "--test",
            Kind::Bench => "--bench",
        };
        if names.is_empty() {
            args.push(match kind {
                Kind::Test => "--tests",
                Kind::Bench => "--benches",
            });
        }
        for n in names.iter() {
            args.extend([flag, n]);
        }
        let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(&args)
            .current_dir(root())
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
            .env("CARGO_PROFILE_BENCH_STRIP", "symbols")
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("cargo {} failed", args.join(" ")));
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if !line.contains("\"reason\":\"compiler-artifact\"") {
                continue;
            }
            let Some(exe) = json_str(line, "executable") else {
                continue;
            };
            // Integration tests / benches only (each target is its own binary), not lib tests.
            let is_kind = match kind {
                Kind::Test => line.contains("\"kind\":[\"test\"]"),
                Kind::Bench => line.contains("\"kind\":[\"bench\"]"),
            };
            if !is_kind {
                continue;
            }
            let name = json_str(line, "name").unwrap_or_else(|| "bin".into());
            exes.push((format!("{pkg}-{name}"), PathBuf::from(exe)));
        }
    }
    Ok(exes)
}

/// The first `"key":"value"` string in a JSON line (no escapes in our paths and names).
fn json_str(line: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\":\"");
    let start = line.find(&pat)? + pat.len();
    let end = line[start..].find('"')? + start;
    Some(line[start..end].replace("\\\\", "\\"))
}

fn bundle(kind: Kind, run: bool) -> Result<(), String> {
    let exes = build_executables(kind)?;
    if exes.is_empty() {
        return Err("no executables were built".into());
    }
    let dir = root().join("target").join("gpu-bundle");
    let sub = match kind {
        Kind::Test => "tests",
        Kind::Bench => "benches",
    };
    let bin_dir = dir.join(sub);
    let _ = std::fs::remove_dir_all(&bin_dir);
    std::fs::create_dir_all(&bin_dir).map_err(|e| e.to_string())?;
    for (name, exe) in &exes {
        std::fs::copy(exe, bin_dir.join(name)).map_err(|e| format!("{}: {e}", exe.display()))?;
    }
    let script = match kind {
        Kind::Test => {
            r#"#!/usr/bin/env bash
# Runs every GPU test binary of the bundle and prints one summary line.
# Usage (on a GPU machine): bash target/gpu-bundle/run.sh [test-filter...]
cd "$(dirname "$0")"
@CUDNN_PATH@
# The binaries travel packed (the device tool's carry limit), in parts when they are many
# (tests-1.tar.gz, tests-2.tar.gz, ...: carry one per call); each run unpacks what is here.
rm -rf tests && mkdir tests
parts=""
for a in tests.tar.gz tests-*.tar.gz; do
    [ -e "$a" ] || continue
    tar xzf "$a" || exit 1
    parts="$parts ${a%.tar.gz}"
done
[ -n "$parts" ] || { echo "no tests*.tar.gz here"; exit 1; }
export KILN_KERNEL_CACHE="${KILN_KERNEL_CACHE:-$PWD/.kernel-cache}"
# Binaries run KILN_TEST_JOBS at a time (default 6: most of their time is NVRTC compiling on
# the host's cores, one core each), each test of a binary one after another (launch counts
# are per process, memory checks per device). The out-of-memory test of `kiln-backend-cuda-gpu`
# fills most of the card, so it runs alone, first; that binary's other tests join the rest.
# Each binary's output is printed whole when it ends, with its wall time.
jobs="${KILN_TEST_JOBS:-6}"
oom=out_of_memory_is_a_typed_error_and_the_device_recovers
rm -rf logs && mkdir logs
one() {
    local t=$1 n=$2; shift 2
    local s; s=$(date +%s)
    timeout "${KILN_TEST_TIMEOUT:-400}" "$t" --test-threads=1 "$@" > "logs/$n.log" 2>&1
    local rc=$?
    echo "$rc $(( $(date +%s) - s ))" > "logs/$n.rc"
    { echo "=== $t $*"; cat "logs/$n.log"; }
}
start=$(date +%s)
if [ $# -eq 0 ] && [ -e tests/kiln-backend-cuda-gpu ]; then
    one tests/kiln-backend-cuda-gpu kiln-backend-cuda-gpu-oom --exact "$oom"
fi
# The longest binaries first (with empty caches: the conformance suite, the expression
# kernels, the gradient checks), then the rest.
long="tests/kiln-backend-cuda-gpu tests/kiln-backend-cuda-expr tests/kiln-autograd-cuda_gradients"
for t in $long tests/*; do
    [ -e "$t" ] || continue
    case " $started " in *" $t "*) continue ;; esac
    started="$started $t"
    args=("$@")
    [ $# -eq 0 ] && [ "$t" = tests/kiln-backend-cuda-gpu ] && args=(--skip "$oom")
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    one "$t" "$(basename "$t")" "${args[@]}" &
done
wait
pass=0; fail=0; failed=""; times=""
for r in logs/*.rc; do
    n=$(basename "$r" .rc); read -r rc secs < "$r"
    times="$times $n=${secs}s"
    if [ "$rc" -eq 0 ]; then pass=$((pass+1)); else fail=$((fail+1)); failed="$failed $n"; fi
done
echo "per binary:$times"
echo "GPU TEST SUMMARY:$parts: $pass runs passed, $fail failed${failed:+ (failed:$failed)}, $(( $(date +%s) - start )) s with $jobs jobs"
[ "$fail" -eq 0 ]
"#
        }
        Kind::Bench => {
            r#"#!/usr/bin/env bash
# Runs the GPU benches and bench/gpu_torch.py (PyTorch, same workloads, same device) and prints
# one comparison table, with the first minute (bench/cold_start.py: the main job's first run with
# empty caches) and whole models beside their twins (bench/models_gpu.py: the GPT, ResNet-18;
# KILN_BENCH_MODELS=0 skips them). Usage (on a GPU machine, from the repository root):
# bash target/gpu-bundle/bench.sh
export MNIST_DIR="${MNIST_DIR:-$PWD/data/mnist}"
export GPT_DATA="${GPT_DATA:-$PWD/data/shakespeare.txt.gz}"
cd "$(dirname "$0")"
@CUDNN_PATH@
# The binaries travel packed (the device tool's carry limit) and are unpacked on each run.
rm -rf benches examples && for a in benches.tar.gz examples*.tar.gz; do tar xzf "$a" || exit 1; done
export KILN_KERNEL_CACHE="${KILN_KERNEL_CACHE:-$PWD/.kernel-cache}"
out=$(mktemp)
for b in benches/*; do timeout "${KILN_BENCH_TIMEOUT:-300}" "$b" --bench | tee -a "$out"; done
PYTHONUNBUFFERED=1 python3 gpu_torch.py | tee -a "$out"
PYTHONUNBUFFERED=1 python3 gpu_cupy.py | tee -a "$out"
PYTHONUNBUFFERED=1 python3 cold_start.py ./examples/mnist "${KILN_COLD_ROUNDS:-3}" | tee -a "$out"
[ "${KILN_BENCH_MODELS:-1}" = 0 ] || PYTHONUNBUFFERED=1 python3 models_gpu.py ./examples | tee -a "$out"
python3 compare.py "$out"
"#
        }
    };
    let script = script.replace("@CUDNN_PATH@", CUDNN_PATH.trim_end());
    let script_name = match kind {
        Kind::Test => "run.sh",
        Kind::Bench => "bench.sh",
    };
    std::fs::write(dir.join(script_name), script).map_err(|e| e.to_string())?;
    if kind == Kind::Bench {
        bundle_examples(&dir)?;
        for f in BENCH_SCRIPTS {
            let src = root().join("bench").join(f);
            std::fs::copy(&src, dir.join(f)).map_err(|e| format!("{}: {e}", src.display()))?;
        }
    }
    // What one `run` carries for this kind (the other kinds' parts of the folder stay home).
    // Stripped, the test binaries are ~200 MiB and the benches ~40 (each holds the prebuilt
    // kernels), over the carry limit; gzip makes them a third of that, and the tests still go
    // in parts that one call each can carry (`run.sh` runs the parts it finds).
    let parts = pack_parts(&dir, sub)?;
    let mut carried: Vec<PathBuf> = vec![parts[0].clone(), dir.join(script_name)];
    if kind == Kind::Bench {
        for f in BENCH_SCRIPTS.iter().chain(&["profile.sh"]) {
            carried.push(dir.join(f));
        }
        carried.extend(pack_parts(&dir, "examples")?);
    }
    let mut total = carry_size(&carried)?;
    for part in &parts[1..] {
        total = total.max(carry_size(&[part.clone(), dir.join(script_name)])?);
    }
    let names: Vec<String> = parts
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    println!(
        "bundle: {} ({} binaries in {}; at most {:.1} MiB to carry per call)",
        dir.display(),
        exes.len(),
        names.join(", "),
        total as f64 / (1 << 20) as f64
    );
    // What xtask's own build of the CUDA crate got (same environment as the bundle's): a bundle
    // built where NVRTC cannot be loaded compiles every fixed kernel on the GPU machine.
    let (n, _, note) = kiln_backend_cuda::compile::prebuilt();
    println!("prebuilt fixed kernels: {n} ({note})");
    if run {
        run_script(&dir.join(script_name))?;
    }
    Ok(())
}

/// The largest archive one part may be: with its script and the working tree (~7.4 MiB), one
/// call can carry it (64 MiB in all). Parts are cut to 90 % of it; fewer parts, fewer calls,
/// and fewer cold compiles of the kernels every part's tests share: the test bundle's ~133 MiB
/// (2026-11-29) goes in three (at 48 MiB it went in four: 132 s of runs together on an H200,
/// against 82–95 s for the three parts of the days before).
const PART_LIMIT: u64 = 52 << 20;

/// Packs `dir/sub` into `dir/sub.tar.gz`, or, when that is over [`PART_LIMIT`], into
/// `sub-1.tar.gz`, `sub-2.tar.gz`, ... (binaries spread by size, largest first into the
/// lightest part), each holding `sub/<binaries>`; removes the folder and any older archives.
fn pack_parts(dir: &Path, sub: &str) -> Result<Vec<PathBuf>, String> {
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(sub) && name.ends_with(".tar.gz") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let mut files: Vec<(u64, String)> = std::fs::read_dir(dir.join(sub))
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| {
            (
                path_size(&e.path()),
                e.file_name().to_string_lossy().into_owned(),
            )
        })
        .collect();
    files.sort();
    files.reverse();
    let whole = tar(dir, &format!("{sub}.tar.gz"), sub, &[])?;
    let size = path_size(&whole);
    if size <= PART_LIMIT {
        std::fs::remove_dir_all(dir.join(sub)).map_err(|e| e.to_string())?;
        return Ok(vec![whole]);
    }
    std::fs::remove_file(&whole).map_err(|e| e.to_string())?;
    let k = size.div_ceil(PART_LIMIT * 9 / 10) as usize;
    let mut groups: Vec<(u64, Vec<String>)> = vec![(0, Vec::new()); k];
    for (bytes, name) in files {
        let lightest = groups.iter_mut().min_by_key(|g| g.0).expect("k >= 1");
        lightest.0 += bytes;
        lightest.1.push(format!("{sub}/{name}"));
    }
    let mut parts = Vec::new();
    for (i, (_, names)) in groups.iter().enumerate() {
        let part = tar(dir, &format!("{sub}-{}.tar.gz", i + 1), "", names)?;
        if path_size(&part) > PART_LIMIT {
            return Err(format!(
                "{} is over {} MiB",
                part.display(),
                PART_LIMIT >> 20
            ));
        }
        parts.push(part);
    }
    std::fs::remove_dir_all(dir.join(sub)).map_err(|e| e.to_string())?;
    Ok(parts)
}

/// `tar czf dir/archive -C dir <what or names>`; the archive's path.
fn tar(dir: &Path, archive: &str, what: &str, names: &[String]) -> Result<PathBuf, String> {
    let path = dir.join(archive);
    let mut cmd = Command::new("tar");
    cmd.arg("czf").arg(&path).arg("-C").arg(dir);
    if names.is_empty() {
        cmd.arg(what);
    } else {
        cmd.args(names);
    }
    let st = cmd.status().map_err(|e| format!("tar: {e}"))?;
    if !st.success() {
        return Err(format!("tar czf {} failed: {st}", path.display()));
    }
    Ok(path)
}

/// The bench bundle's Python scripts, copied from `bench/`.
const BENCH_SCRIPTS: &[&str] = &[
    "gpu_torch.py",
    "gpu_cupy.py",
    "compare.py",
    "cold_start.py",
    "models_gpu.py",
    "gpt_torch.py",
    "train_torch.py",
];

/// Builds [`GPU_EXAMPLES`] (release, stripped) into `dir/examples/` (packed by the caller) with
/// `profile.sh`, which runs one MNIST epoch on the GPU with the profiler on and writes a Chrome
/// trace.
fn bundle_examples(dir: &Path) -> Result<(), String> {
    let mut args = vec!["build", "--release", "-p", "kiln-examples"];
    for e in GPU_EXAMPLES {
        args.extend(["--example", e]);
    }
    let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(&args)
        .current_dir(root())
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("cargo {} failed", args.join(" ")));
    }
    let to = dir.join("examples");
    let _ = std::fs::remove_dir_all(&to);
    std::fs::create_dir_all(&to).map_err(|e| e.to_string())?;
    for e in GPU_EXAMPLES {
        let src = root().join("target/release/examples").join(e);
        std::fs::copy(&src, to.join(e)).map_err(|err| format!("{}: {err}", src.display()))?;
        let _ = std::fs::remove_file(dir.join(e)); // older bundles kept them unpacked
    }
    let script = r#"#!/usr/bin/env bash
# One MNIST epoch on the GPU with kiln's profiler on: prints the per-op table, the "where did it
# run" listing and the memory view, and writes a Chrome trace (open it in Perfetto).
# Usage (on a GPU machine, from the repository root): bash target/gpu-bundle/profile.sh [TRACE]
here="$(cd "$(dirname "$0")" && pwd)"
[ -x "$here/examples/mnist" ] || (cd "$here" && for a in examples*.tar.gz; do tar xzf "$a"; done) || exit 1
export KILN_KERNEL_CACHE="${KILN_KERNEL_CACHE:-$here/.kernel-cache}"
KILN_PROFILE=1 KILN_PROFILE_TRACE="${1:-$here/mnist-trace.json}" \
    "$here/examples/mnist" --device cuda --epochs 1 --data-dir "${MNIST_DIR:-data/mnist}"
"#;
    std::fs::write(dir.join("profile.sh"), script).map_err(|e| e.to_string())
}

/// Examples and test targets of issue 12's two-GPU bundle.
const MULTI_GPU_EXAMPLES: &[&str] = &["data_parallel", "model_parallel", "two_gpu_matmul"];
const MULTI_GPU_TESTS: &[(&str, &str)] = &[("kiln-backend-cuda", "nccl")];

/// Builds `target/gpu-bundle/multi/` and `multi_gpu.sh` (see the crate docs).
fn multi_gpu_bundle(run: bool) -> Result<(), String> {
    let dir = root().join("target").join("gpu-bundle");
    let multi = dir.join("multi");
    let _ = std::fs::remove_dir_all(&multi);
    std::fs::create_dir_all(multi.join("tests")).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(multi.join("mnist")).map_err(|e| e.to_string())?;
    let mut jobs: Vec<(Vec<String>, &str)> = vec![(
        ["build", "--release", "-p", "kiln-examples"]
            .into_iter()
            .map(String::from)
            .chain(
                MULTI_GPU_EXAMPLES
                    .iter()
                    .flat_map(|e| ["--example".to_string(), e.to_string()]),
            )
            .collect(),
        "example",
    )];
    for (pkg, t) in MULTI_GPU_TESTS {
        jobs.push((
            ["test", "--release", "--no-run", "-p", pkg, "--test", t]
                .into_iter()
                .map(String::from)
                .collect(),
            "test",
        ));
    }
    for (mut args, kind) in jobs {
        args.push("--message-format=json-render-diagnostics".into());
        let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(&args)
            .current_dir(root())
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("cargo {} failed", args.join(" ")));
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if !line.contains("\"reason\":\"compiler-artifact\"")
                || !line.contains(&format!("\"kind\":[\"{kind}\"]"))
            {
                continue;
            }
            let (Some(exe), Some(name)) = (json_str(line, "executable"), json_str(line, "name"))
            else {
                continue;
            };
            let dst = if kind == "test" {
                multi.join("tests").join(&name)
            } else {
                multi.join(&name)
            };
            std::fs::copy(&exe, &dst).map_err(|e| format!("{exe}: {e}"))?;
        }
    }
    let mnist = root().join("data").join("mnist");
    for e in std::fs::read_dir(&mnist).map_err(|e| format!("{}: {e}", mnist.display()))? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.extension().is_some_and(|x| x == "gz") {
            std::fs::copy(&p, multi.join("mnist").join(p.file_name().unwrap()))
                .map_err(|e| e.to_string())?;
        }
    }
    for f in ["ddp_torch.py", "multi_gpu.sh"] {
        let src = root().join("bench").join(f);
        std::fs::copy(&src, dir.join(f)).map_err(|e| format!("{}: {e}", src.display()))?;
    }
    let total = carry_size(&[
        multi.clone(),
        dir.join("ddp_torch.py"),
        dir.join("multi_gpu.sh"),
    ])?;
    println!(
        "bundle: {} (multi-GPU part: multi/, ddp_torch.py, multi_gpu.sh, {:.1} MiB to carry); run: bash {}",
        dir.display(),
        total as f64 / (1 << 20) as f64,
        dir.join("multi_gpu.sh").display()
    );
    if run {
        run_script(&dir.join("multi_gpu.sh"))?;
    }
    Ok(())
}

/// Bytes that one `run` carries for `paths`, or an error past the device tool's limit.
fn carry_size(paths: &[PathBuf]) -> Result<u64, String> {
    let total = paths.iter().map(|p| path_size(p)).sum::<u64>();
    if total > BUNDLE_LIMIT {
        return Err(format!(
            "bundle is {} MiB, over the {} MiB carry limit",
            total >> 20,
            BUNDLE_LIMIT >> 20
        ));
    }
    Ok(total)
}

/// Runs a bundle's script with bash (`--run`, where the GPU and the toolchain are one machine).
fn run_script(script: &Path) -> Result<(), String> {
    let st = Command::new("bash")
        .arg(script)
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("{} failed", script.display()));
    }
    Ok(())
}

/// Bytes under `p` (a file or a folder); 0 when it does not exist.
fn path_size(p: &Path) -> u64 {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => dir_size(p),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

fn dir_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| {
                    let m = e.metadata().map(|m| (m.is_dir(), m.len()));
                    match m {
                        Ok((true, _)) => dir_size(&e.path()),
                        Ok((false, l)) => l,
                        Err(_) => 0,
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}
