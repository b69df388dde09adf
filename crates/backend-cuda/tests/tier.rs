//! Tiered execution (`src/tier.rs`): a program the interpreter runs gives the bits its compiled
//! kernel gives, and a program not compiled yet runs interpreted until its background compile
//! lands, then compiled. Its own test binary: the tiering switch is process-wide.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use std::sync::Mutex;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, Tiering, gpu_or_skip, set_tiering, tier_stats};
use kiln_core::expr::{Expr, Program};
use kiln_core::testing::expr::{Input, input, shape, tree};
use kiln_core::{CmpOp, DType, Generator, RandDist, Tensor, UnaryOp};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

type G = Tensor<Cuda>;

/// The tests change the process-wide switch: one at a time.
static SWITCH: Mutex<()> = Mutex::new(());

/// Input `spec` on the GPU in f32: random values made on the CPU, uploaded, then viewed.
fn make(dev: &CudaDevice, spec: &Input, shape: &[usize]) -> G {
    spec.make(shape, |d| {
        let c = Generator::new(spec.seed)
            .sample::<Cpu>(
                d.clone(),
                RandDist::Uniform {
                    low: -3.0,
                    high: 3.0,
                },
                DType::F32,
                &Cpu::device(0),
            )
            .unwrap();
        G::from_host(&c.to_host().unwrap(), d, dev).unwrap()
    })
}

/// Uniform values in [-3, 3) of `shape` on `dev`.
fn uniform(dev: &CudaDevice, shape: &[usize]) -> G {
    Generator::new(7)
        .uniform::<Cuda>(shape, -3.0, 3.0, dev)
        .unwrap()
}

/// Every output's bytes.
fn bytes(outs: &[G]) -> Vec<Vec<u8>> {
    outs.iter()
        .map(|t| t.to_host().unwrap().as_bytes().to_vec())
        .collect()
}

/// `Err` with the first difference unless `a` and `b` hold the same bits, any NaN matching any
/// NaN: a NaN's sign and payload are not kept by the compiler (`-pow(-2.22, -0.224)` came out
/// with other NaN bits interpreted than compiled), and nothing reads them.
fn same_bits(a: &G, b: &G) -> Result<(), String> {
    if a.dtype() != DType::F32 {
        return match a.to_host().unwrap().as_bytes() == b.to_host().unwrap().as_bytes() {
            true => Ok(()),
            false => Err(format!("{} outputs differ", a.dtype())),
        };
    }
    let (x, y) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    match x
        .iter()
        .zip(&y)
        .position(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
    {
        None if x.len() == y.len() => Ok(()),
        None => Err("lengths differ".into()),
        Some(i) => Err(format!(
            "element {i}: {} ({:08x}) against {} ({:08x})",
            x[i],
            x[i].to_bits(),
            y[i],
            y[i].to_bits()
        )),
    }
}

/// `p` run interpreted (`Tiering::Always`) and compiled (`Tiering::Off`): the same bits
/// ([`same_bits`]).
fn same_both_ways(p: &Program, xs: &[&G], params: &[f64]) -> Result<(), String> {
    set_tiering(Tiering::Always);
    let interpreted = p.run(xs, params).map_err(|e| e.to_string());
    set_tiering(Tiering::Off);
    let compiled = p.run(xs, params).map_err(|e| e.to_string())?;
    let interpreted = interpreted?;
    for (k, (a, b)) in interpreted.iter().zip(&compiled).enumerate() {
        same_bits(a, b).map_err(|e| {
            format!("interpreted and compiled differ, output {k}, {e}\nprogram:\n{p}")
        })?;
    }
    Ok(())
}

/// Random f32 programs over contiguous, broadcast, transposed and sliced inputs, built from
/// every unary op of the table that takes f32 (the piecewise-constant ones too: the bits are
/// compared), binary ops, comparisons and selections, constants and a parameter; a second
/// output; and a fixed program with u8 inputs, casts and a u8 output.
#[test]
fn interpreted_programs_give_the_compiled_bits() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let _restore = SWITCH_ON;
    let ops: Vec<UnaryOp> = (UnaryOp::ALL.into_iter())
        .filter(|op| op.supports(DType::F32))
        .collect();
    let (before, _) = tier_stats();
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        tree(3, &ops),
        shape(),
        prop::collection::vec(input(3), 3),
        -2.0f64..2.0,
    );
    let result = runner.run(&strategy, |(t, shp, ins, param)| {
        let rank = shp.len();
        let xs: Vec<G> = (ins.iter())
            .map(|i| {
                let mut i = i.clone();
                i.ones.resize(rank, false);
                i.drop = i.drop.min(rank);
                make(&dev, &i, &shp)
            })
            .collect();
        let e = t.build(DType::F32, DType::F32);
        let second = Expr::input(0) * 2.0 - Expr::input(1);
        let p = Program::from_exprs(&[DType::F32; 3], &[e, second]).unwrap();
        let params: Vec<f64> = (0..p.params().len()).map(|_| param).collect();
        let refs: Vec<&G> = xs.iter().collect();
        same_both_ways(&p, &refs, &params).map_err(TestCaseError::fail)
    });
    result.unwrap();
    // The interpreter ran (programs over no element launch nothing).
    let (after, _) = tier_stats();
    assert!(
        after - before >= 24,
        "only {} interpreted launches",
        after - before
    );

    // u8 inputs: a mask selecting, a mask cast to f32 and multiplied, and a u8 output.
    let x = uniform(&dev, &[37, 50]);
    let y = x.neg().unwrap().exp().unwrap();
    let gt = Expr::input(0).compare(CmpOp::Gt, Expr::constant(0.25));
    let mask = Program::from_exprs(&[DType::F32], &[gt]).unwrap();
    let mask = mask.run(&[&x], &[]).unwrap().remove(0);
    assert_eq!(mask.dtype(), DType::U8);
    let (a, b, m) = (Expr::input(0), Expr::input(1), Expr::input(2));
    let outs = [
        m.where_cond(&a, &b),
        m.to_dtype(DType::F32) * &a + Expr::param(0),
        a.compare(CmpOp::Lt, &b),
        m.clone(),
    ];
    let p = Program::from_exprs(&[DType::F32, DType::F32, DType::U8], &outs).unwrap();
    same_both_ways(&p, &[&x, &y, &mask], &[0.75]).unwrap();
}

/// Puts the switch back to its default when a test ends (also when it fails).
struct On;
const SWITCH_ON: On = On;
impl Drop for On {
    fn drop(&mut self) {
        set_tiering(Tiering::On);
    }
}

/// A program no process has compiled (a constant of this run's clock in it) runs in the
/// interpreter at once, its compile starts in the background, and once that lands the same
/// program runs its compiled kernel; every run gives the same bits.
#[test]
fn a_new_program_runs_interpreted_until_its_compile_lands() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let _restore = SWITCH_ON;
    set_tiering(Tiering::On);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let c = 1.0 + nanos as f64 * 1e-10;
    let x = uniform(&dev, &[1000, 3]);
    let e = (Expr::input(0) * c).tanh() + Expr::param(0);
    let p = Program::from_exprs(&[DType::F32], &[e]).unwrap();
    let run = || bytes(&p.run(&[&x], &[0.5]).unwrap());
    let (i0, b0) = tier_stats();
    let first = run();
    let (i1, b1) = tier_stats();
    assert_eq!(
        (i1 - i0, b1 - b0),
        (1, 1),
        "interpreted once, one compile started"
    );
    let t0 = std::time::Instant::now();
    loop {
        let (before, _) = tier_stats();
        assert_eq!(run(), first, "the same bits on every run");
        if tier_stats().0 == before {
            break; // compiled
        }
        assert!(
            t0.elapsed().as_secs() < 120,
            "still interpreted after 120 s: the background compile never landed"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(tier_stats().1, b1, "no second compile of the same program");
}

/// A process that exits while a background compile runs exits cleanly: the exit waits for
/// the compile. Run as child processes of this test binary (the same test, with
/// `KILN_TIER_EXIT_CHILD=1`), each starting a compile nobody has cached and exiting 0 to 45
/// ms later, while it runs. Before the exiting thread waited for the compile ahead of its
/// thread-local destructors (`fixed_cubins::wait_at_thread_exit`), children exiting 15-30 ms
/// into the compile crashed inside NVRTC (H200) or hung until the exit hook gave up.
#[test]
fn exiting_while_a_background_compile_runs_is_clean() {
    let child = std::env::var("KILN_TIER_EXIT_CHILD").is_ok();
    let Some(dev) = gpu_or_skip(0) else { return };
    if child {
        set_tiering(Tiering::On);
        let x = uniform(&dev, &[1000]);
        let c = std::env::var("KILN_TIER_EXIT_CONST")
            .unwrap()
            .parse::<f64>()
            .unwrap();
        let p = Program::from_exprs(&[DType::F32], &[(Expr::input(0) * c).exp()]).unwrap();
        p.run(&[&x], &[]).unwrap();
        assert_eq!(tier_stats().1, 1, "one compile started");
        let ms = std::env::var("KILN_TIER_EXIT_MS").unwrap().parse().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(ms));
        std::process::exit(0);
    }
    let cache = std::env::temp_dir().join(format!("kiln-tier-exit-{}", std::process::id()));
    for (run, ms) in [0, 5, 10, 15, 20, 30, 45].into_iter().enumerate() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "exiting_while_a_background_compile_runs_is_clean",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env("KILN_TIER_EXIT_CHILD", "1")
            .env_remove("KILN_CUDA_TIER")
            .env(
                "KILN_TIER_EXIT_CONST",
                format!("{}", 1.0 + run as f64 * 1e-3),
            )
            .env("KILN_TIER_EXIT_MS", ms.to_string())
            .env("KILN_KERNEL_CACHE", &cache)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "child {run} (exit {ms} ms after starting a compile): {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
}
