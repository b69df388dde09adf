//! End-to-end training benchmarks (issues 4 and 5), the kiln half of a side-by-side run with
//! PyTorch (`bench/train_torch.py`, GPU) or numpy (`bench/train_numpy.py`, CPU);
//! `bench/run_train.sh` runs both halves and prints the comparison table.
//!
//! ```text
//! cargo build --release --example bench_train
//! target/release/examples/bench_train --device cpu --which mlp-small
//! target/release/examples/bench_train --device cuda --which all      # logreg + both MLPs
//! target/release/examples/bench_train --device cuda --which mlp-large --precision bf16
//! ```
//!
//! Workloads (each one parsable line on stdout, `kiln <workload> <device> key=value ...`):
//!
//! - `logreg`: Theano's logistic-regression exercise, N=400 samples of 784 features, full
//!   batch: `p = sigmoid(x·w + b)`, `cost = mean(-y log p - (1-y) log(1-p)) + 0.01 Σw²`,
//!   gradient descent with lr 0.01, written with kiln-autograd `Var`s and a hand-written update
//!   (Theano's `updates=`). One repeat is the whole loop (default 10,000 steps) from `w = 0,
//!   b = 0`, so every repeat ends at the same cost, which the PyTorch and numpy scripts
//!   reproduce from the same data (`final_cost`).
//! - `mlp-small`: one training step (forward, fused softmax cross-entropy, backward, SGD lr
//!   0.1) of the 784-100-100-10 ReLU MLP at batch 100, built from kiln-nn's `Linear`/`Relu`/
//!   `Sequential` and kiln-optim's `Sgd`.
//! - `mlp-large`: the same step for 784-4096-4096-4096-10 at batch 4096 (GEMM-bound; TF32 is
//!   off, kiln's default). Skipped by `--which all` on a CPU device (about ten seconds a step
//!   on two cores); ask for it by name to run it anyway.
//! - `resnet18`: one training step (forward, cross-entropy, backward, SGD lr 0.05 momentum 0.9
//!   weight decay 5e-4) of ResNet-18 in its CIFAR form (`kiln_examples::resnet`, width 64, 3
//!   input channels, 10 classes) on CIFAR-shaped data at batch 256 (`[256, 3, 32, 32]`, the
//!   same hashed values as the MLPs), BatchNorm in training mode. Only by name; its line also
//!   gives the device's peak bytes in tensors since the process started (`peak_mib`), which
//!   `bench/train_torch.py` reports as `torch.cuda.max_memory_allocated`, and on CUDA the peak
//!   of the timed steps alone (`step_peak_mib`: the peak is reset after the warm-up, whose
//!   cuDNN algorithm search holds workspaces a steady step does not; the same in the twin).
//!
//! - `resnet18-eval`: the same model's eval-mode forward under `no_grad` at batch 256 (after
//!   two training-mode forwards that move the running statistics), twice: `fold=on`, each
//!   batch norm folded into its convolution (`kiln_nn::ConvBnAct`; on CUDA the bias and ReLU
//!   in cuDNN's fused graph where it serves the dtype, `KILN_CUDNN_FUSION=0` to compare), and
//!   `fold=off`, convolution, batch norm and ReLU one after the other. `checksum` (the sum of
//!   the logits' magnitudes) should agree between the two lines. Only by name.
//!
//! `--precision` (`f32` default, `tf32`, `bf16`, `f16`; [`kiln_examples::Precision`]) applies to
//! the MLP and ResNet steps: `bf16` and `f16` run the forward and the loss under `autocast` (f32 weights
//! and SGD), `f16` with a `GradScaler` (whose overflow check reads one flag back per step, as
//! PyTorch's `scaler.step` does); `tf32` turns TF32 on. The line gets `precision=...`. The
//! logreg loop is always f32.
//!
//! Timing: warm-up steps first (kernel compilation, allocator pools), then `--repeats` timed
//! runs of `--steps` steps each, the device synchronized before each clock read; the line gives
//! the median. Nothing is read back to the host inside the timed loop. The data are not random
//! but a fixed hash of the element index (`data_value`), computed identically by the Python
//! scripts, so `final_cost` of `logreg` can be compared across the three implementations.
//!
//! On CUDA, elementwise ops are deferred and fused into one generated kernel per chain
//! (kiln-backend-cuda's `lazy` module); the logreg step realizes its cost every step, as
//! Theano's `train` returns it, so no work is skipped. `KILN_CUDA_FUSE=0` runs every op on its
//! own kernel instead; `KILN_CUDA_LAUNCH_STATS=1` adds launches per step to the logreg line.

use std::time::Instant;

use clap::{Parser, ValueEnum};
use kiln_autograd::{Var, autocast, no_grad};
use kiln_core::{Backend, BinaryOp, DType, Generator, Reduction, Result, Shape, Tensor};
use kiln_examples::resnet::{ResNet, ResNetConfig};
use kiln_examples::{
    DEVICE_HELP, Job, Precision, dispatch, fused_program_stats, launch_stats, take_peak_memory,
};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{LinearConfig, Module, ModuleExt, Relu, Sequential};
use kiln_optim::{GradScaler, GradScalerConfig, Optimizer, SgdConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Which {
    /// Theano's logistic regression loop (issue 4).
    Logreg,
    /// 784-100-100-10 MLP step at batch 100 (issue 5).
    MlpSmall,
    /// 784-4096-4096-4096-10 MLP step at batch 4096 (issue 5).
    MlpLarge,
    /// All three (mlp-large only on a GPU).
    All,
    /// ResNet-18 (CIFAR form) step at batch 256 (issue 33); only by name.
    Resnet18,
    /// ResNet-18 (CIFAR form) eval forward at batch 256, batch norms folded and not; only by
    /// name.
    Resnet18Eval,
}

/// kiln's side of the training benchmarks (see the file docs).
#[derive(Parser, Debug, Clone)]
#[command(name = "bench_train", about, long_about = None)]
struct Args {
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    #[arg(long, value_enum, default_value_t = Which::All)]
    which: Which,
    /// Steps per timed repeat (default: logreg 10000, mlp-small 200, mlp-large 20).
    #[arg(long)]
    steps: Option<usize>,
    /// Timed repeats; the median is reported (default: logreg 3, the MLPs 5).
    #[arg(long)]
    repeats: Option<usize>,
    /// Untimed warm-up steps (default: logreg 200, mlp-small 20, mlp-large 3).
    #[arg(long)]
    warmup: Option<usize>,
    /// Arithmetic of the MLP steps: f32, tf32, bf16 autocast, f16 autocast + loss scaling.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
}

fn main() {
    let args = Args::parse();
    let device = args.device.clone();
    let r = dispatch(&device, Bench(args));
    // With `KILN_PROFILE=1`, where the time went (warm-up included).
    kiln_core::profile::report();
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Bench(Args);

impl Job for Bench {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        let a = self.0;
        let on_cpu = B::NAME == "cpu";
        a.precision.apply::<B>();
        if B::NAME == "cuda" {
            eprintln!(
                "kiln on {dev}: TF32 {}",
                if kiln_backend_cuda::allow_tf32() {
                    "on"
                } else {
                    "off"
                }
            );
        }
        let run = |w: Which| a.which == w || a.which == Which::All;
        if run(Which::Logreg) {
            let s = Sizes::pick(&a, 10_000, 3, 200);
            logreg::<B>(&dev, s)?;
        }
        if run(Which::MlpSmall) {
            let s = Sizes::pick(&a, 200, 5, 20);
            mlp::<B>(&dev, "mlp-small", &[784, 100, 100, 10], 100, s, a.precision)?;
        }
        if a.which == Which::MlpLarge || (a.which == Which::All && !on_cpu) {
            let s = Sizes::pick(&a, 20, 5, 3);
            mlp::<B>(
                &dev,
                "mlp-large",
                &[784, 4096, 4096, 4096, 10],
                4096,
                s,
                a.precision,
            )?;
        } else if a.which == Which::All {
            eprintln!("skipping mlp-large on {dev} (ask for it with --which mlp-large)");
        }
        if a.which == Which::Resnet18 {
            resnet18::<B>(&dev, Sizes::pick(&a, 10, 5, 3), a.precision)?;
        }
        if a.which == Which::Resnet18Eval {
            resnet18_eval::<B>(&dev, Sizes::pick(&a, 20, 5, 3), a.precision)?;
        }
        Ok(())
    }
}

/// How many steps to time, how often, after how many warm-up steps.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    steps: usize,
    repeats: usize,
    warmup: usize,
}

impl Sizes {
    fn pick(a: &Args, steps: usize, repeats: usize, warmup: usize) -> Self {
        Sizes {
            steps: a.steps.unwrap_or(steps).max(1),
            repeats: a.repeats.unwrap_or(repeats).max(1),
            warmup: a.warmup.unwrap_or(warmup),
        }
    }
}

/// Element `k` of the benchmark data: a multiplicative hash of the index mapped onto
/// `[-1, 1)`. `bench/train_torch.py` and `bench/train_numpy.py` compute the same values
/// (`(k * 2654435761) mod 2^32 / 2^32 * 2 - 1`, in f64, then rounded to f32).
fn data_value(k: u64) -> f32 {
    let h = k.wrapping_mul(2_654_435_761) & 0xffff_ffff;
    (h as f64 / 4_294_967_296.0 * 2.0 - 1.0) as f32
}

/// `rows x cols` values of [`data_value`], row-major.
fn data(rows: usize, cols: usize) -> Vec<f32> {
    (0..(rows * cols) as u64).map(data_value).collect()
}

/// What one timed repeat took.
#[derive(Clone, Copy, Debug)]
struct Timing {
    /// Wall-clock milliseconds, the device synchronized before both clock reads.
    wall_ms: f64,
    /// CPU milliseconds of this process over the same interval (all threads), where the OS
    /// tells (Linux): on a shared machine, the part of the wall time that is our own work.
    cpu_ms: Option<f64>,
}

/// Times `f`.
fn time_ms<B: Backend>(dev: &B::Device, f: impl FnOnce() -> Result<()>) -> Result<Timing> {
    B::synchronize(dev)?;
    let c = process_cpu_ms();
    let t = Instant::now();
    f()?;
    B::synchronize(dev)?;
    let wall_ms = t.elapsed().as_secs_f64() * 1e3;
    let cpu_ms = c.zip(process_cpu_ms()).map(|(a, b)| b - a);
    Ok(Timing { wall_ms, cpu_ms })
}

/// CPU time used so far by every live thread of this process, in milliseconds: the sum of the
/// first field (nanoseconds on a CPU) of `/proc/self/task/*/schedstat`. `None` off Linux.
fn process_cpu_ms() -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e6)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Prints the workload's result line (the format `bench/run_train.sh` parses).
fn report(workload: &str, dev: &impl std::fmt::Display, s: Sizes, runs: &[Timing], extra: &str) {
    let per = |ms: f64| ms / s.steps as f64;
    let total = median(runs.iter().map(|r| r.wall_ms).collect());
    let ms = per(total);
    let min = per(runs.iter().map(|r| r.wall_ms).fold(f64::INFINITY, f64::min));
    let cpu = runs
        .iter()
        .map(|r| r.cpu_ms)
        .collect::<Option<Vec<f64>>>()
        .map(|v| format!(" cpu_ms_per_step={:.6}", per(median(v))))
        .unwrap_or_default();
    println!(
        "kiln {workload} {dev} steps={} repeats={} total_ms={total:.3} ms_per_step={ms:.6} \
         min_ms_per_step={min:.6} steps_per_s={:.1}{cpu}{extra}",
        s.steps,
        s.repeats,
        1e3 / ms,
    );
}

// ---- logreg ---------------------------------------------------------------------------------

const LR_N: usize = 400;
const LR_FEATS: usize = 784;

/// Theano's logistic regression: full-batch gradient descent, `steps` steps from zeros.
fn logreg<B: Backend>(dev: &B::Device, s: Sizes) -> Result<()> {
    let xs = data(LR_N, LR_FEATS);
    // Label: the sign of the first feature (a separable problem; the cost keeps falling).
    let ys: Vec<f32> = (0..LR_N)
        .map(|i| f32::from(xs[i * LR_FEATS] > 0.0))
        .collect();
    let x = Var::constant(Tensor::<B>::from_vec(xs, [LR_N, LR_FEATS], dev)?);
    let y = Tensor::<B>::from_vec(ys, [LR_N], dev)?;
    // Constants of the cost, computed once (both sides do the same): -y and 1 - y.
    let neg_y = Var::constant(y.neg()?);
    let one_minus_y = Var::constant(y.scalar_binary(BinaryOp::Sub, 1.0)?);
    let w = Var::param(Tensor::<B>::zeros([LR_FEATS], DType::F32, dev)?);
    let b = Var::param(Tensor::<B>::zeros(Shape::scalar(), DType::F32, dev)?);
    let (lr, l2) = (0.01, 0.01);

    let step = || -> Result<Var<B>> {
        let p = x.matmul(&w)?.add(&b)?.sigmoid()?;
        let xent = neg_y
            .mul(&p.log()?)?
            .sub(&one_minus_y.mul(&p.scalar_binary(BinaryOp::Sub, 1.0)?.log()?)?)?;
        let cost = xent
            .mean_all()?
            .add(&w.square()?.sum_all()?.mul_scalar(l2)?)?;
        cost.backward()?;
        // Theano's `train` computes the cost every step; make sure a backend that defers
        // elementwise work (CUDA) does not skip it because nothing reads it.
        cost.tensor().realize()?;
        for v in [&w, &b] {
            if let Some(g) = v.take_grad() {
                v.update_data(|t| t.sub(&g.mul_scalar(lr)?))?;
            }
        }
        Ok(cost)
    };
    let reset = || -> Result<()> {
        w.set_tensor(Tensor::zeros([LR_FEATS], DType::F32, dev)?)?;
        b.set_tensor(Tensor::zeros(Shape::scalar(), DType::F32, dev)?)
    };

    for _ in 0..s.warmup {
        step()?;
    }
    let mut totals = Vec::with_capacity(s.repeats);
    let mut last = None;
    let launches0 = launch_stats::<B>();
    for _ in 0..s.repeats {
        reset()?;
        totals.push(time_ms::<B>(dev, || {
            for _ in 0..s.steps {
                last = Some(step()?);
            }
            Ok(())
        })?);
    }
    // The cost of the last step's forward pass (before its update), as Theano's `train` returns.
    let cost = last.map(|c| c.tensor().to_scalar()).transpose()?;
    let mut extra = format!(" final_cost={:.6}", cost.unwrap_or(f64::NAN));
    let (programs, compile_ns) = fused_program_stats::<B>();
    if programs > 0 {
        extra += &format!(
            " fused_programs={programs} fused_compile_ms={:.1}",
            compile_ns as f64 / 1e6
        );
    }
    let (l, ns) = launch_stats::<B>();
    if l > launches0.0 {
        let steps = (s.steps * s.repeats) as f64;
        extra += &format!(
            " launches_per_step={:.1} us_in_cuLaunchKernel_per_step={:.1}",
            (l - launches0.0) as f64 / steps,
            (ns - launches0.1) as f64 / 1e3 / steps
        );
    }
    report("logreg", dev, s, &totals, &extra);
    Ok(())
}

// ---- MLP training step ----------------------------------------------------------------------

/// A `Linear`/`Relu` stack with the given widths (ReLU between, none after the last layer).
fn build_mlp<B: Backend>(widths: &[usize], dev: &B::Device) -> Result<Sequential<B>> {
    let mut g = Generator::new(0);
    let mut m = Sequential::new();
    let n = widths.len() - 1;
    for i in 0..n {
        m = m.add(LinearConfig::new(widths[i], widths[i + 1]).init::<B>(dev, &mut g)?);
        if i + 1 < n {
            m = m.add(Relu);
        }
    }
    Ok(m)
}

/// One SGD training step of an MLP on a fixed batch, timed over many steps.
fn mlp<B: Backend>(
    dev: &B::Device,
    name: &str,
    widths: &[usize],
    batch: usize,
    s: Sizes,
    precision: Precision,
) -> Result<()> {
    let classes = *widths.last().expect("widths");
    let x = Var::constant(Tensor::<B>::from_vec(
        data(batch, widths[0]),
        [batch, widths[0]],
        dev,
    )?);
    let labels: Vec<i64> = (0..batch).map(|i| (i % classes) as i64).collect();
    let labels = Tensor::<B>::from_vec(labels, [batch], dev)?;
    let model = build_mlp::<B>(widths, dev)?;
    let opt = SgdConfig::new(0.1).init(model.parameters())?;
    let (totals, loss, _) = train_steps(dev, &model, opt, &x, &labels, precision, s)?;
    let extra = format!(
        " batch={batch} arch={} loss={:.6} precision={}",
        widths
            .iter()
            .map(|w| w.to_string())
            .collect::<Vec<_>>()
            .join("-"),
        loss.unwrap_or(f64::NAN),
        format!("{precision:?}").to_lowercase()
    );
    report(name, dev, s, &totals, &extra);
    Ok(())
}

/// The `resnet18` workload (see the file docs).
fn resnet18<B: Backend>(dev: &B::Device, s: Sizes, precision: Precision) -> Result<()> {
    let (batch, classes) = (256, 10);
    let x = Tensor::<B>::from_vec(data(batch, 3 * 32 * 32), [batch, 3 * 32 * 32], dev)?;
    let x = Var::constant(x.reshape([batch, 3, 32, 32])?);
    let labels: Vec<i64> = (0..batch).map(|i| (i % classes) as i64).collect();
    let labels = Tensor::<B>::from_vec(labels, [batch], dev)?;
    let model = ResNet::<B>::new(
        ResNetConfig::resnet18(3, classes, 64),
        dev,
        &mut Generator::new(0),
    )?;
    let opt = SgdConfig::new(0.05)
        .with_momentum(0.9)
        .with_weight_decay(5e-4)
        .init(model.parameters())?;
    let (totals, loss, warm_peak) = train_steps(dev, &model, opt, &x, &labels, precision, s)?;
    // `peak_mib` over the whole run (as PyTorch's max_memory_allocated without a reset), and
    // `step_peak_mib` over the timed steps only, where the backend can reset its peak (CUDA).
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let step_peak = B::memory_stats(dev)?.peak;
    let extra = format!(
        " batch={batch} arch=resnet18-cifar-w64 loss={:.6} precision={} peak_mib={:.0} \
         step_peak_mib={:.0}",
        loss.unwrap_or(f64::NAN),
        format!("{precision:?}").to_lowercase(),
        mib(warm_peak.max(step_peak)),
        mib(step_peak)
    );
    report("resnet18", dev, s, &totals, &extra);
    Ok(())
}

/// The `resnet18-eval` workload (see the file docs): one line with the batch norms folded
/// into the convolutions (`fold=on`), one with convolution, batch norm and ReLU apart
/// (`fold=off`), the same model and input.
fn resnet18_eval<B: Backend>(dev: &B::Device, s: Sizes, precision: Precision) -> Result<()> {
    let (batch, classes) = (256, 10);
    let x = Tensor::<B>::from_vec(data(batch, 3 * 32 * 32), [batch, 3 * 32 * 32], dev)?;
    let x = Var::constant(x.reshape([batch, 3, 32, 32])?);
    let mut model = ResNet::<B>::new(
        ResNetConfig::resnet18(3, classes, 64),
        dev,
        &mut Generator::new(0),
    )?;
    // A few training-mode forwards, so the running statistics are not the initial ones.
    for _ in 0..2 {
        no_grad(|| model.forward(&x))?;
    }
    model.eval();
    for fold in [true, false] {
        model.set_fold(fold);
        let forward = || -> Result<Var<B>> {
            let _amp = precision.autocast().map(autocast).transpose()?;
            no_grad(|| model.forward(&x))
        };
        for _ in 0..s.warmup {
            forward()?;
        }
        let mut totals = Vec::with_capacity(s.repeats);
        let mut last = None;
        for _ in 0..s.repeats {
            totals.push(time_ms::<B>(dev, || {
                for _ in 0..s.steps {
                    last = Some(forward()?);
                }
                Ok(())
            })?);
        }
        let checksum = match last {
            Some(y) => y
                .tensor()
                .to_dtype(DType::F64)?
                .abs()?
                .sum_all()?
                .to_scalar()?,
            None => f64::NAN,
        };
        let extra = format!(
            " batch={batch} arch=resnet18-cifar-w64 fold={} precision={} checksum={checksum:.4}",
            if fold { "on" } else { "off" },
            format!("{precision:?}").to_lowercase(),
        );
        report("resnet18-eval", dev, s, &totals, &extra);
    }
    Ok(())
}

/// Times `s` of `model`'s training step (forward under `precision`'s autocast, cross-entropy,
/// backward, `opt`'s step; with a `GradScaler` for f16) after the warm-up steps: the repeats'
/// timings, the last loss and the peak memory of the warm-up (after which the peak is reset
/// where the backend can: [`take_peak_memory`]).
fn train_steps<B: Backend, M: Module<B>, O: Optimizer<B>>(
    dev: &B::Device,
    model: &M,
    mut opt: O,
    x: &Var<B>,
    labels: &Tensor<B>,
    precision: Precision,
    s: Sizes,
) -> Result<(Vec<Timing>, Option<f64>, usize)> {
    let mut scaler: GradScaler<B> = GradScalerConfig::new()
        .with_enabled(precision.needs_scaler())
        .init()?;
    let mut step = || -> Result<Var<B>> {
        let loss = {
            let _amp = precision.autocast().map(autocast).transpose()?;
            cross_entropy(&model.forward(x)?, labels, Reduction::Mean)?
        };
        opt.zero_grad();
        scaler.scale(&loss)?.backward()?;
        // `opt.step()` unless f16 (then skipped on overflow; one flag read per step).
        scaler.step(&mut opt)?;
        scaler.update()?;
        Ok(loss)
    };
    for _ in 0..s.warmup {
        step()?;
    }
    B::synchronize(dev)?;
    let warm_peak = take_peak_memory::<B>(dev)?;
    let mut totals = Vec::with_capacity(s.repeats);
    let mut last = None;
    for _ in 0..s.repeats {
        totals.push(time_ms::<B>(dev, || {
            for _ in 0..s.steps {
                last = Some(step()?);
            }
            Ok(())
        })?);
    }
    let loss = last.map(|l| l.tensor().to_scalar()).transpose()?;
    Ok((totals, loss, warm_peak))
}
