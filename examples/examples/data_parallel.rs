//! Data-parallel training on several GPUs, three ways, with the same training code:
//!
//! - `--mode ddp-threads`: PyTorch DDP's scheme, one thread per GPU in this process, NCCL
//!   communicators from `ncclCommInitAll`;
//! - `--mode ddp-procs`: the same, one process per GPU. The process learns its place from
//!   `RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`MASTER_ADDR`/`MASTER_PORT`, so it runs under
//!   `torchrun --nproc_per_node 2 --no-python`, `srun`, or kiln's launcher: `--nproc N`
//!   starts N copies of this program (NVLink multicast off in each) and ends the others
//!   when one fails;
//! - `--mode chainer`: Chainer's master/replica scheme, no NCCL: replicas compute gradients on
//!   their slices in threads, the master accumulates them (`accumulate_grads_from`), steps,
//!   and refreshes the replicas (`copy_parameters_from`).
//!
//! ```text
//! data_parallel --mode ddp-threads --gpus 2 --model big          # 784-4096x3-10, batch 8192
//! data_parallel --mode ddp-procs --nproc 2 --model big
//! torchrun --nproc_per_node 2 --no-python data_parallel --mode ddp-procs --model big
//! data_parallel --mode chainer --gpus 2 --model mnist --epochs 3 --data-dir data/mnist
//! data_parallel --mode ddp-threads --gpus 2 --verify 20          # parameters vs one GPU
//! ```
//!
//! Every run prints `kiln data_parallel mode=... gpus=N ... step_ms=... samples_per_s=...`
//! (`--gpus 1` gives the one-GPU baseline with the same code path). `--verify S` trains S
//! steps, then trains the same model with the same seed and global batch on one device and
//! prints `verify ... max_rel_diff=... ok|FAIL` (exit status 1 on FAIL; tolerance 1e-4
//! relative, per parameter tensor in the L2 norm). `--fail-rank R --fail-step K` plants a
//! fault: rank R exits at step K (process mode), to show the survivors stop with an error naming the cause. TF32 stays off.
//! `--device cpu` runs the thread and Chainer modes on virtual CPU devices (smoke tests).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use kiln_autograd::{Var, no_grad};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::Cuda;
use kiln_core::{Backend, Error, Generator, Reduction, Result, Tensor};
use kiln_data::{Dataset, Mnist};
use kiln_dist::{
    Ddp, DistEnv, LocalGroup, NcclGroup, ProcessGroup, accumulate_grads_from, copy_parameters_from,
    scale_grads,
};
use kiln_nn::loss::{correct_count, cross_entropy};
use kiln_nn::{LinearConfig, Module, Relu, Sequential};
use kiln_optim::{Optimizer, SgdConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    DdpThreads,
    DdpProcs,
    Chainer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Model {
    /// 784-100-100-10 on MNIST (Chainer's MLP), test accuracy at the end.
    Mnist,
    /// 784-4096-4096-4096-10 on fixed synthetic data (compute-bound; the benchmark).
    Big,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "data_parallel",
    about = "kiln data-parallel training (see the file docs)"
)]
struct Args {
    #[arg(long, value_enum, default_value_t = Mode::DdpThreads)]
    mode: Mode,
    /// GPUs to use (thread and Chainer modes; default: all visible).
    #[arg(long)]
    gpus: Option<usize>,
    /// Launch this many processes (one per GPU) running `--mode ddp-procs`.
    #[arg(long)]
    nproc: Option<usize>,
    #[arg(long, value_enum, default_value_t = Model::Big)]
    model: Model,
    /// Global batch (default: 8192 for big, 200 for mnist).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Timed steps (big) after --warmup untimed ones.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Epochs over the MNIST training set (mnist).
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train this many steps, then compare with a one-device run (see the file docs).
    #[arg(long)]
    verify: Option<usize>,
    /// Planted fault: this rank exits (status 1) at --fail-step.
    #[arg(long)]
    fail_rank: Option<usize>,
    #[arg(long, default_value_t = 3)]
    fail_step: usize,
    /// MNIST IDX files (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// `cuda` (default) or `cpu` (virtual CPU devices; thread and Chainer modes only).
    #[arg(long, default_value = "cuda")]
    device: String,
}

impl Args {
    fn global_batch(&self) -> usize {
        self.global_batch.unwrap_or(match self.model {
            Model::Big => 8192,
            Model::Mnist => 200,
        })
    }
}

fn main() {
    DistEnv::apply_nvls_off();
    let args = Args::parse();
    kiln_backend_cuda::set_allow_tf32(false);
    let r = run(args);
    // With KILN_PROFILE=1: the table (and KILN_PROFILE_TRACE's Chrome trace) of this process.
    kiln_core::profile::report();
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    if let Some(n) = args.nproc
        && DistEnv::from_env()?.is_none()
    {
        // The launcher: re-run this program once per GPU as `--mode ddp-procs`.
        let exe = std::env::current_exe()
            .map_err(|e| Error::invalid("launch", format!("cannot find this program: {e}")))?;
        let mut child_args: Vec<String> = Vec::new();
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            if a == "--nproc" || a == "--mode" {
                it.next();
            } else if !(a.starts_with("--nproc=") || a.starts_with("--mode=")) {
                child_args.push(a);
            }
        }
        child_args.extend(["--mode".into(), "ddp-procs".into()]);
        return kiln_dist::launch::launch(
            &exe,
            &child_args,
            &kiln_dist::launch::LaunchConfig::new(n),
        );
    }
    match args.device.as_str() {
        "cpu" => {
            let n = args.gpus.unwrap_or(2);
            let devs: Vec<_> = (0..n)
                .map(|i| Cpu::parse_device(&format!("cpu:{i}")))
                .collect::<Result<_>>()?;
            match args.mode {
                Mode::DdpThreads => {
                    let groups = LocalGroup::<Cpu>::new(
                        &devs,
                        DistEnv::from_env()?
                            .map(|e| e.timeout)
                            .unwrap_or(std::time::Duration::from_secs(300)),
                    );
                    let groups = groups
                        .into_iter()
                        .map(|g| Arc::new(g) as Arc<dyn ProcessGroup<Cpu>>)
                        .collect();
                    ddp_threads::<Cpu>(&args, devs, groups)
                }
                Mode::Chainer => chainer::<Cpu>(&args, devs),
                Mode::DdpProcs => Err(Error::invalid(
                    "data_parallel",
                    "ddp-procs needs CUDA (NCCL)",
                )),
            }
        }
        _ => {
            let visible = kiln_backend_cuda::device_count();
            if visible == 0 {
                return Err(Error::invalid(
                    "data_parallel",
                    format!(
                        "no CUDA device ({}); use --device cpu",
                        kiln_backend_cuda::unavailable_reason().unwrap_or_default()
                    ),
                ));
            }
            match args.mode {
                Mode::DdpProcs => ddp_procs(&args),
                mode => {
                    let n = args.gpus.unwrap_or(visible);
                    if n > visible {
                        return Err(Error::invalid(
                            "data_parallel",
                            format!("--gpus {n}, but {visible} GPU(s) are visible"),
                        ));
                    }
                    let devs = kiln_backend_cuda::try_all_gpus()[..n].to_vec();
                    if mode == Mode::Chainer {
                        return chainer::<Cuda>(&args, devs);
                    }
                    let groups: Vec<Arc<dyn ProcessGroup<Cuda>>> = if n > 1 {
                        NcclGroup::init_all(&devs)?
                            .into_iter()
                            .map(|g| Arc::new(g) as Arc<dyn ProcessGroup<Cuda>>)
                            .collect()
                    } else {
                        Vec::new()
                    };
                    ddp_threads::<Cuda>(&args, devs, groups)
                }
            }
        }
    }
}

// ---- model and data ---------------------------------------------------------------------

fn build<B: Backend>(args: &Args, dev: &B::Device) -> Result<Sequential<B>> {
    let mut g = Generator::new(args.seed);
    let dims: &[usize] = match args.model {
        Model::Big => &[784, 4096, 4096, 4096, 10],
        Model::Mnist => &[784, 100, 100, 10],
    };
    let mut m = Sequential::new();
    for (i, w) in dims.windows(2).enumerate() {
        if i > 0 {
            m = m.add(Relu);
        }
        m = m.add(LinearConfig::new(w[0], w[1]).init::<B>(dev, &mut g)?);
    }
    Ok(m)
}

/// The global batches: MNIST's training set in order (one epoch), or 4 fixed synthetic
/// batches (Philox, so every device makes the same numbers).
struct Data<B: Backend> {
    x: Vec<Tensor<B>>,
    y: Vec<Tensor<B>>,
    test: Option<(Tensor<B>, Tensor<B>)>,
}

fn mnist_dir(args: &Args) -> PathBuf {
    args.data_dir.clone().unwrap_or_else(Mnist::bundled_dir)
}

fn data<B: Backend>(args: &Args, dev: &B::Device) -> Result<Data<B>> {
    let gb = args.global_batch();
    match args.model {
        Model::Big => {
            let mut x = Vec::new();
            let mut y = Vec::new();
            // A generator of its own (the model's is `Generator::new(args.seed)`).
            let mut g = Generator::new(args.seed.wrapping_add(1));
            for b in 0..4u64 {
                x.push(g.randn::<B>([gb, 784], dev)?);
                let labels: Vec<i64> = (0..gb)
                    .map(|i| ((i as u64 * 7 + b * 3) % 10) as i64)
                    .collect();
                y.push(Tensor::from_slice(&labels, [gb], dev)?);
            }
            Ok(Data { x, y, test: None })
        }
        Model::Mnist => {
            let m = Mnist::load(mnist_dir(args))?;
            let up = |d: &kiln_data::ArrayDataset| -> Result<(Tensor<B>, Tensor<B>)> {
                let n = d.len();
                Ok((
                    Tensor::from_host(d.features(), [n, 784], dev)?,
                    Tensor::from_host(d.labels(), [n], dev)?,
                ))
            };
            let (tx, ty) = up(&m.train)?;
            // One fixed shuffle (the bundled subset is sorted by digit): every rank and the
            // one-device reference see the same batches.
            let n = tx.dims()[0];
            let order: Vec<i64> = kiln_data::permutation(n, args.seed, 0)
                .into_iter()
                .map(|i| i as i64)
                .collect();
            let ids = Tensor::<B>::from_slice(&order, [n], dev)?;
            let (tx, ty) = (tx.index_select(0, &ids)?, ty.index_select(0, &ids)?);
            let test = up(&m.test)?;
            let steps = tx.dims()[0] / gb;
            let mut x = Vec::new();
            let mut y = Vec::new();
            for s in 0..steps {
                x.push(tx.narrow(0, s * gb, gb)?);
                y.push(ty.narrow(0, s * gb, gb)?);
            }
            Ok(Data {
                x,
                y,
                test: Some(test),
            })
        }
    }
}

/// Steps to run: `--verify S`, or epochs × batches per epoch (mnist), or warmup + steps (big).
fn total_steps(args: &Args, batches: usize) -> usize {
    match (args.verify, args.model) {
        (Some(s), _) => s,
        (None, Model::Mnist) => args.epochs * batches,
        (None, Model::Big) => args.warmup + args.steps,
    }
}

fn params_of<B: Backend>(m: &Sequential<B>) -> Result<Vec<Vec<f64>>> {
    m.parameters()
        .iter()
        .map(|p| p.tensor().to_f64_vec())
        .collect()
}

fn accuracy<B: Backend>(m: &Sequential<B>, test: &(Tensor<B>, Tensor<B>)) -> Result<f64> {
    let logits = no_grad(|| m.forward(&Var::constant(test.0.clone())))?;
    Ok(correct_count(&logits.tensor(), &test.1)? as f64 / test.1.dims()[0] as f64)
}

/// What one rank (or the master) reports.
struct Report {
    step_s: f64,
    params: Vec<Vec<f64>>,
    accuracy: Option<f64>,
}

/// One rank's training loop (also the one-device reference when `group` is `None`).
fn train_rank<B: Backend>(
    args: &Args,
    dev: B::Device,
    group: Option<Arc<dyn ProcessGroup<B>>>,
    process_mode: bool,
) -> Result<Report> {
    let (rank, world) = group
        .as_ref()
        .map(|g| (g.rank(), g.world_size()))
        .unwrap_or((0, 1));
    let model = build::<B>(args, &dev)?;
    let ddp = match &group {
        Some(g) => Some(Ddp::new(&model, g.clone())?),
        None => None,
    };
    let mut opt = SgdConfig::new(args.lr).init(model.parameters())?;
    let data = data::<B>(args, &dev)?;
    let gb = args.global_batch();
    if !gb.is_multiple_of(world) {
        return Err(Error::invalid(
            "data_parallel",
            format!("global batch {gb} is not divisible by {world} ranks"),
        ));
    }
    let local = gb / world;
    let steps = total_steps(args, data.x.len());
    let timed_from = if args.verify.is_none() && args.model == Model::Big {
        args.warmup
    } else {
        0
    };
    let mut t0 = Instant::now();
    for s in 0..steps {
        if s == timed_from {
            B::synchronize(&dev)?;
            t0 = Instant::now();
        }
        if process_mode && args.fail_rank == Some(rank) && s == args.fail_step {
            eprintln!("rank {rank}: planted fault: exiting at step {s}");
            std::process::exit(1);
        }
        let b = s % data.x.len();
        let x = data.x[b].narrow(0, rank * local, local)?;
        let y = data.y[b].narrow(0, rank * local, local)?;
        opt.zero_grad();
        let loss = cross_entropy(&model.forward(&Var::constant(x))?, &y, Reduction::Mean)?;
        match &ddp {
            Some(d) => d.backward(&loss)?,
            None => loss.backward()?,
        }
        opt.step()?;
    }
    B::synchronize(&dev)?;
    let timed = steps.saturating_sub(timed_from).max(1);
    let step_s = t0.elapsed().as_secs_f64() / timed as f64;
    if let Some(g) = &group {
        g.synchronize()?;
        g.check()?;
    }
    let accuracy = match &data.test {
        Some(t) if rank == 0 => Some(accuracy(&model, t)?),
        _ => None,
    };
    Ok(Report {
        step_s,
        params: params_of(&model)?,
        accuracy,
    })
}

fn print_report(args: &Args, mode: &str, gpus: usize, r: &Report) {
    let gb = args.global_batch();
    println!(
        "kiln data_parallel mode={mode} model={:?} gpus={gpus} global_batch={gb} step_ms={:.3} samples_per_s={:.0}{}",
        args.model,
        r.step_s * 1e3,
        gb as f64 / r.step_s,
        r.accuracy
            .map(|a| format!(" test_accuracy={a:.4}"))
            .unwrap_or_default()
    );
}

/// Compares `got` with a one-device run of the same steps; prints the verdict.
fn verify<B: Backend>(args: &Args, mode: &str, dev: B::Device, got: &[Vec<f64>]) -> Result<()> {
    let Some(steps) = args.verify else {
        return Ok(());
    };
    let reference = train_rank::<B>(args, dev, None, false)?;
    // Per parameter tensor, |a - b| / |b| in the L2 norm (elementwise ratios would divide
    // f32 rounding by weights near zero); the worst tensor counts.
    let mut worst = 0f64;
    for (a, b) in got.iter().zip(&reference.params) {
        let diff: f64 = a.iter().zip(b).map(|(u, v)| (u - v) * (u - v)).sum();
        let norm: f64 = b.iter().map(|v| v * v).sum();
        worst = worst.max((diff / norm.max(f64::MIN_POSITIVE)).sqrt());
    }
    let ok = worst <= 1e-4;
    println!(
        "verify mode={mode} model={:?} steps={steps} global_batch={} max_rel_diff={worst:.3e} {}",
        args.model,
        args.global_batch(),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        return Err(Error::invalid(
            "verify",
            format!(
                "{mode}: parameters differ from the one-device run by {worst:.3e} relative (> 1e-4)"
            ),
        ));
    }
    Ok(())
}

// ---- the three modes ----------------------------------------------------------------------

fn ddp_threads<B: Backend>(
    args: &Args,
    devs: Vec<B::Device>,
    groups: Vec<Arc<dyn ProcessGroup<B>>>,
) -> Result<()> {
    let n = devs.len();
    let reports: Vec<Result<Report>> = if groups.is_empty() {
        vec![train_rank::<B>(args, devs[0].clone(), None, false)]
    } else {
        std::thread::scope(|s| {
            let hs: Vec<_> = devs
                .iter()
                .cloned()
                .zip(groups)
                .map(|(d, g)| s.spawn(move || train_rank::<B>(args, d, Some(g), false)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::invalid("data_parallel", "a rank's thread panicked"))
                    })
                })
                .collect()
        })
    };
    let reports: Vec<Report> = reports.into_iter().collect::<Result<_>>()?;
    let slowest = reports.iter().map(|r| r.step_s).fold(0.0, f64::max);
    let r0 = &reports[0];
    print_report(
        args,
        "ddp-threads",
        n,
        &Report {
            step_s: slowest,
            params: Vec::new(),
            accuracy: r0.accuracy,
        },
    );
    verify::<B>(args, "ddp-threads", devs[0].clone(), &r0.params)
}

fn ddp_procs(args: &Args) -> Result<()> {
    let env = DistEnv::from_env()?.ok_or_else(|| {
        Error::invalid("data_parallel", "--mode ddp-procs needs RANK and WORLD_SIZE (run it under torchrun, srun, or with --nproc N)")
    })?;
    let group = NcclGroup::from_env(&env)?;
    let dev = group.device();
    let group: Arc<dyn ProcessGroup<Cuda>> = Arc::new(group);
    let r = train_rank::<Cuda>(args, dev, Some(group.clone()), true)?;
    // Every rank's slowest step: the max over ranks.
    let t = Tensor::<Cuda>::from_slice(&[r.step_s], [1], &dev)?;
    let all = group.all_gather(&t)?.wait()?.to_f64_vec()?;
    let slowest = all.iter().copied().fold(0.0, f64::max);
    if env.rank == 0 {
        print_report(
            args,
            "ddp-procs",
            env.world_size,
            &Report {
                step_s: slowest,
                params: Vec::new(),
                accuracy: r.accuracy,
            },
        );
        verify::<Cuda>(args, "ddp-procs", dev, &r.params)?;
    }
    drop(group);
    Ok(())
}

fn chainer<B: Backend>(args: &Args, devs: Vec<B::Device>) -> Result<()> {
    let n = devs.len();
    let models: Vec<Sequential<B>> = devs
        .iter()
        .map(|d| build::<B>(args, d))
        .collect::<Result<_>>()?;
    let master = &models[0];
    for r in &models[1..] {
        copy_parameters_from(r, master)?;
    }
    let mut opt = SgdConfig::new(args.lr).init(master.parameters())?;
    let datas: Vec<Data<B>> = devs
        .iter()
        .map(|d| data::<B>(args, d))
        .collect::<Result<_>>()?;
    let gb = args.global_batch();
    if !gb.is_multiple_of(n) {
        return Err(Error::invalid(
            "data_parallel",
            format!("global batch {gb} is not divisible by {n} devices"),
        ));
    }
    let local = gb / n;
    let steps = total_steps(args, datas[0].x.len());
    let timed_from = if args.verify.is_none() && args.model == Model::Big {
        args.warmup
    } else {
        0
    };
    let sync_all = || -> Result<()> { devs.iter().try_for_each(|d| B::synchronize(d)) };
    let mut t0 = Instant::now();
    for s in 0..steps {
        if s == timed_from {
            sync_all()?;
            t0 = Instant::now();
        }
        opt.zero_grad();
        for m in &models[1..] {
            m.parameters().iter().for_each(|p| p.zero_grad());
        }
        let b = s % datas[0].x.len();
        std::thread::scope(|sc| -> Result<()> {
            let hs: Vec<_> = models
                .iter()
                .zip(&datas)
                .enumerate()
                .map(|(i, (m, d))| {
                    sc.spawn(move || -> Result<()> {
                        let x = d.x[b].narrow(0, i * local, local)?;
                        let y = d.y[b].narrow(0, i * local, local)?;
                        cross_entropy(&m.forward(&Var::constant(x))?, &y, Reduction::Mean)?
                            .backward()
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap_or_else(|_| {
                    Err(Error::invalid("chainer", "a replica's thread panicked"))
                })?;
            }
            Ok(())
        })?;
        for r in &models[1..] {
            accumulate_grads_from(master, r)?;
        }
        if n > 1 {
            scale_grads(master, 1.0 / n as f64)?;
        }
        opt.step()?;
        for r in &models[1..] {
            copy_parameters_from(r, master)?;
        }
    }
    sync_all()?;
    let step_s = t0.elapsed().as_secs_f64() / steps.saturating_sub(timed_from).max(1) as f64;
    let accuracy = match &datas[0].test {
        Some(t) => Some(accuracy(master, t)?),
        None => None,
    };
    print_report(
        args,
        "chainer",
        n,
        &Report {
            step_s,
            params: Vec::new(),
            accuracy,
        },
    );
    verify::<B>(args, "chainer", devs[0].clone(), &params_of(master)?)
}
