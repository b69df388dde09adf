//! Training steps and the seeds' small-op loops on the GPU, beside `bench/gpu_torch.py`
//! (PyTorch eager, and the small steps captured in a CUDA graph): prints `BENCH kiln <name>
//! <value> <unit>` lines for `bench/compare.py`. Run through `cargo xtask bench-gpu`.
//!
//! - `mlp_small_sgd_step`: 784-100-100-10 ReLU MLP, batch 100, softmax cross-entropy,
//!   backward, SGD (lr 0.1); ms per step, CUDA-event timed over 200 steps, median of 9.
//!   `mlp_small_sgd_step_profiled` is the same step with the profiler on (the two alternate);
//!   `mlp_small_sgd_profile_on_overhead` the median of each pair's ratio, in percent, and
//!   `mlp_small_sgd_profile_off_overhead` an estimate of what the profiler's hooks cost when
//!   off (hooks per step × the measured cost of one off check, over the step time): both are
//!   reported, never asserted.
//! - `mlp_small_sgd_step_graph`: the same step captured in a [`CudaGraph`] (after three eager
//!   steps) and replayed; `mlp_deep_sgd_step_graph` likewise (PyTorch: its captured step).
//! - `mlp_small_adam_step`: the same with Adam (lr 1e-3).
//! - `mlp_deep_sgd_step`: 784-1000-1000-2000-1000-1000-10, batch 100, SGD.
//! - `d2l_matmul_norm_x1000_host` / `_gpu`: d2l's exercise, 1000 × (100×100 matmul, then its
//!   Frobenius norm), the norm read back to the host every step, or kept on the GPU (read
//!   once at the end); wall-clock ms for the whole loop, median of 5.
//!
//! With `KILN_BENCH_PROFILE=1` it also prints the profiler's table for a few steps of each
//! workload (stderr), which is how BENCHMARKS.md explains a row.
//!
//! Without a GPU it prints `skipped: no CUDA device (...)` and exits 0.

mod common;
use common::report;

use std::time::Instant;

use kiln_autograd::Var;
use kiln_backend_cuda::{
    Cuda, CudaDevice, CudaGraph, raw, set_allow_tf32, try_gpu, unavailable_reason,
};
use kiln_core::{Backend, DType, Generator, Reduction, Result, Tensor, profile};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{LinearConfig, Module, Relu, Sequential};
use kiln_optim::{AdamConfig, Optimizer, SgdConfig};

/// Median over `reps` of the event-timed milliseconds per call of `f` (`iters` calls), each
/// repeat wrapped by `around` (which may open and close a profiling session).
fn time(
    dev: &CudaDevice,
    reps: usize,
    iters: usize,
    f: &mut dyn FnMut() -> Result<()>,
    profiled: bool,
) -> f64 {
    for _ in 0..3 {
        f().unwrap();
    }
    Cuda::synchronize(dev).unwrap();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let session = profiled.then(profile::start);
            let ms = raw::time_ms(dev, || {
                for _ in 0..iters {
                    f()?;
                }
                Ok(())
            })
            .unwrap() as f64
                / iters as f64;
            // Collecting (resolving the events) happens outside the timed region.
            drop(session.map(|s| s.finish()));
            ms
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median wall-clock milliseconds of `f` (which synchronizes at its end) over 5 runs.
fn wall(dev: &CudaDevice, f: &mut dyn FnMut() -> Result<()>) -> f64 {
    f().unwrap();
    Cuda::synchronize(dev).unwrap();
    let mut v: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            f().unwrap();
            Cuda::synchronize(dev).unwrap();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[2]
}

fn build_mlp(widths: &[usize], dev: &CudaDevice) -> Result<Sequential<Cuda>> {
    let mut g = Generator::new(0);
    let mut m = Sequential::new();
    let n = widths.len() - 1;
    for i in 0..n {
        m = m.add(LinearConfig::new(widths[i], widths[i + 1]).init::<Cuda>(dev, &mut g)?);
        if i + 1 < n {
            m = m.add(Relu);
        }
    }
    Ok(m)
}

/// A training step of an MLP with `widths` at batch 100 on fixed data.
fn mlp_step(
    dev: &CudaDevice,
    widths: &[usize],
    adam: bool,
) -> Result<Box<dyn FnMut() -> Result<()>>> {
    let batch = 100;
    let x = Var::constant(Generator::new(7).rand::<Cuda>([batch, widths[0]], dev)?);
    let classes = *widths.last().unwrap();
    let labels: Vec<i64> = (0..batch).map(|i| (i % classes) as i64).collect();
    let labels = Tensor::<Cuda>::from_vec(labels, [batch], dev)?;
    let model = build_mlp(widths, dev)?;
    let mut opt: Box<dyn Optimizer<Cuda>> = if adam {
        Box::new(AdamConfig::new(1e-3).init(model.parameters())?)
    } else {
        Box::new(SgdConfig::new(0.1).init(model.parameters())?)
    };
    Ok(Box::new(move || {
        let loss = cross_entropy(&model.forward(&x)?, &labels, Reduction::Mean)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()
    }))
}

/// `step` captured in a CUDA graph after three eager warm-up steps.
fn captured(dev: &CudaDevice, step: &mut dyn FnMut() -> Result<()>) -> CudaGraph {
    for _ in 0..3 {
        step().unwrap();
    }
    CudaGraph::capture(dev, step).unwrap().0
}

/// Prints the profiler's table for `n` calls of `f` (stderr), and returns the records per call.
fn profile_of(name: &str, n: usize, f: &mut dyn FnMut() -> Result<()>, print: bool) -> f64 {
    let (r, p) = profile::profile(|| -> Result<()> {
        let _r = profile::range(name);
        for _ in 0..n {
            f()?;
        }
        Ok(())
    });
    r.unwrap();
    if print {
        eprintln!("== {name}: {n} calls ==\n{p}");
    }
    p.records().len() as f64 / n as f64
}

/// Nanoseconds per off-profiler check (`profile::enabled()` when off, as every hook runs it).
fn off_check_ns() -> f64 {
    assert!(!profile::enabled(), "the profiler is off here");
    let n = 50_000_000u64;
    let t = Instant::now();
    let mut k = 0u64;
    for _ in 0..n {
        k += std::hint::black_box(profile::enabled()) as u64;
    }
    std::hint::black_box(k);
    t.elapsed().as_secs_f64() * 1e9 / n as f64
}

/// Nanoseconds per profiler clock read, per recorded event and per op span while the
/// profiler is on (host work only: what each of a step's records costs before any device
/// timing; collection runs outside the timed loops). The second of two rounds: the first grows
/// the per-thread buffers (fresh pages), which a profiled training loop does only in its first
/// steps.
fn on_costs_ns() -> (f64, f64, f64) {
    on_costs_round();
    on_costs_round()
}

fn on_costs_round() -> (f64, f64, f64) {
    let n = 200_000u32;
    let per = |t: Instant| t.elapsed().as_secs_f64() * 1e9 / n as f64;
    let t = Instant::now();
    let mut k = 0u64;
    for _ in 0..n {
        k = k.wrapping_add(std::hint::black_box(profile::now_ns()));
    }
    std::hint::black_box(k);
    let clock = per(t);
    let session = profile::start();
    let t = Instant::now();
    for _ in 0..n {
        profile::record(profile::Event::new(profile::Kind::Alloc, "probe", "cpu"));
    }
    let record = per(t);
    let t = Instant::now();
    for _ in 0..n {
        drop(profile::op(
            "probe",
            "cpu",
            profile::OpDetail::new(DType::F32),
            0,
            false,
        ));
    }
    let span = per(t);
    drop(session.finish());
    (clock, record, span)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test` runs benches as tests: nothing to do
    }
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return;
    };
    if profile::enabled() {
        println!("skipped: KILN_PROFILE=1 would profile every row (use KILN_BENCH_PROFILE=1)");
        return;
    }
    set_allow_tf32(false);
    println!("kiln device: {}", dev.name().unwrap());
    let show = std::env::var("KILN_BENCH_PROFILE").is_ok_and(|v| v == "1");

    // The small MLP, SGD: off, on, and the profiler's cost.
    // Off and on alternate, one repeat each, 9 times: the overhead is the median of each
    // pair's ratio, so drift on the host between repeats (seen as ±20 % on some machines)
    // cancels.
    let mut step = mlp_step(&dev, &[784, 100, 100, 10], false).unwrap();
    let (mut offs, mut ons, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..9 {
        let off = time(&dev, 1, 200, &mut *step, false);
        let on = time(&dev, 1, 200, &mut *step, true);
        offs.push(off);
        ons.push(on);
        ratios.push(on / off);
    }
    let (off, on, ratio) = (median(offs), median(ons), median(ratios));
    report("mlp_small_sgd_step", off, "ms");
    report("mlp_small_sgd_step_profiled", on, "ms");
    report(
        "mlp_small_sgd_profile_on_overhead",
        (ratio - 1.0) * 100.0,
        "%",
    );
    let hooks = profile_of("mlp_small_sgd_step", 10, &mut *step, show);
    let check = off_check_ns();
    report(
        "mlp_small_sgd_profile_off_overhead",
        hooks * check / (off * 1e6) * 100.0,
        "%",
    );
    let (clock, record, span) = on_costs_ns();
    println!(
        "kiln note: {hooks:.0} profiler records per small SGD step, {check:.2} ns per off check; \
         profiler on: {clock:.0} ns per clock read ({}), {record:.0} ns per event, {span:.0} ns per op \
         span",
        profile::clock_source()
    );
    drop(step);

    // The same step captured in a CUDA graph (after warm-up steps, as PyTorch's), replayed.
    let mut step = mlp_step(&dev, &[784, 100, 100, 10], false).unwrap();
    let graph = captured(&dev, &mut *step);
    let mut replay = || graph.replay();
    report(
        "mlp_small_sgd_step_graph",
        time(&dev, 9, 200, &mut replay, false),
        "ms",
    );
    println!(
        "kiln note: the captured small SGD step is {} graph nodes",
        graph.node_count()
    );
    drop((graph, step));

    let mut step = mlp_step(&dev, &[784, 100, 100, 10], true).unwrap();
    report(
        "mlp_small_adam_step",
        time(&dev, 5, 200, &mut *step, false),
        "ms",
    );
    profile_of("mlp_small_adam_step", 10, &mut *step, show);
    drop(step);

    let mut step = mlp_step(&dev, &[784, 1000, 1000, 2000, 1000, 1000, 10], false).unwrap();
    report(
        "mlp_deep_sgd_step",
        time(&dev, 5, 50, &mut *step, false),
        "ms",
    );
    profile_of("mlp_deep_sgd_step", 5, &mut *step, show);
    let graph = captured(&dev, &mut *step);
    let mut replay = || graph.replay();
    report(
        "mlp_deep_sgd_step_graph",
        time(&dev, 5, 50, &mut replay, false),
        "ms",
    );
    drop((graph, step));

    // d2l: 1000 x (100x100 matmul, Frobenius norm), logged to the host or kept on the GPU.
    let a = Generator::new(11)
        .uniform::<Cuda>([100, 100], -1.0, 1.0, &dev)
        .unwrap();
    let norm = |a: &Tensor<Cuda>| -> Result<Tensor<Cuda>> { a.matmul(a)?.norm() };
    let mut host = || -> Result<()> {
        let mut log = Vec::with_capacity(1000);
        for _ in 0..1000 {
            log.push(norm(&a)?.to_scalar()?);
        }
        std::hint::black_box(log);
        Ok(())
    };
    report("d2l_matmul_norm_x1000_host", wall(&dev, &mut host), "ms");
    let mut gpu = || -> Result<()> {
        let mut log = Vec::with_capacity(1000);
        for _ in 0..1000 {
            let n = norm(&a)?;
            n.realize()?;
            log.push(n);
        }
        std::hint::black_box(log);
        Ok(())
    };
    report("d2l_matmul_norm_x1000_gpu", wall(&dev, &mut gpu), "ms");
    let mut one = || -> Result<()> { norm(&a)?.realize() };
    profile_of("d2l_matmul_norm_gpu_step", 20, &mut one, show);
    let mut one = || -> Result<()> { norm(&a)?.to_scalar().map(drop) };
    profile_of("d2l_matmul_norm_host_step", 20, &mut one, show);
}
