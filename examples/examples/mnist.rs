//! MNIST: Chainer's MLP (784-100-100-10) or a LeNet-style conv net, trained on the CPU or a
//! GPU by one generic program.
//!
//! ```text
//! cargo run --release --example mnist                       # MLP, Adam, 20 epochs, CPU
//! cargo run --release --example mnist -- --arch lenet       # the conv net, 15 epochs
//! cargo run --release --example mnist -- --device cuda      # on the GPU (CPU if none)
//! cargo run --release --example mnist -- --device cuda --precision bf16   # bf16 autocast
//! cargo run --release --example mnist -- --device cuda --precision f16    # f16 + GradScaler
//! cargo run --release --example mnist -- --save mlp.safetensors
//! cargo run --release --example mnist -- --load mlp.safetensors --epochs 0   # evaluate only
//! ```
//!
//! Everything below `main` is written once against `B: Backend`; [`kiln_examples::dispatch`]
//! turns the `--device` string into a call on the CPU or the CUDA backend. The same `--seed`
//! gives the same initial weights and the same batch order on every backend (Philox), so a GPU
//! run can be compared with a CPU run number for number.
//!
//! The data defaults to the 4,000 training and 1,000 test digits bundled in `data/mnist`
//! (found from this crate's directory, so the command works from the repository root or
//! anywhere inside it); `--data-dir` points at the full MNIST IDX files instead, and is needed
//! by a binary copied to another machine (the bundled path is fixed at build time). Saved weights
//! are named like the equivalent PyTorch `nn.Sequential`'s `state_dict`
//! (`bench/mnist_torch_check.py` loads them into PyTorch and compares logits).
//!
//! `--precision` (`f32`, `tf32`, `bf16`, `f16`; [`kiln_examples::Precision`]) picks mixed
//! precision: the forward and the loss run under `autocast`, weights and the optimizer stay
//! f32, and f16 scales the loss with a `GradScaler` (its skipped steps are counted per epoch).
//! Evaluation runs under the same autocast.
//!
//! `KILN_PROFILE=1` prints kiln's profile at the end (per-op table, where each op ran, memory
//! per op and per range `train_step/forward`, `train_step/backward`, `train_step/step`, `evaluate`);
//! `KILN_PROFILE_TRACE=trace.json` also writes a Chrome trace (open it in Perfetto).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kiln_autograd::{Var, autocast, no_grad};
use kiln_core::profile::range;
use kiln_core::{Backend, Generator, Reduction, Result, Tensor};
use kiln_data::{DataLoader, Mnist};
use kiln_examples::models::{lenet, mlp};
use kiln_examples::{DEVICE_HELP, Job, Precision, dispatch};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{Module, ModuleExt, Sequential, save_safetensors};
use kiln_optim::{AdamConfig, AdamWConfig, GradScaler, GradScalerConfig, Optimizer, SgdConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Arch {
    /// 784-H-H-10 with ReLU (Chainer's MNIST example; H = --hidden).
    Mlp,
    /// conv(6,5x5,pad 2)-pool-conv(16,5x5)-pool-120-84-10 with ReLU.
    Lenet,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Opt {
    /// Plain SGD (default lr 0.1).
    Sgd,
    /// SGD with momentum 0.9 (default lr 0.05).
    Momentum,
    /// Adam (default lr 1e-3; 2e-3 for LeNet).
    Adam,
    /// AdamW, weight decay 1e-2 (default lr as Adam).
    Adamw,
}

/// Train an MNIST classifier with kiln.
#[derive(Parser, Debug)]
#[command(name = "mnist", about, long_about = None)]
struct Args {
    /// Model architecture.
    #[arg(long, value_enum, default_value_t = Arch::Mlp)]
    arch: Arch,
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    /// Passes over the training set (0: only evaluate, e.g. after --load). Default: 20 for the
    /// MLP, 15 for LeNet.
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Learning rate (default depends on --optimizer).
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long, value_enum, default_value_t = Opt::Adam)]
    optimizer: Opt,
    /// Arithmetic: f32, tf32 (GPU products), bf16 autocast, f16 autocast with loss scaling.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
    /// Seed of the initial weights and of the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hidden units per layer of the MLP.
    #[arg(long, default_value_t = 100)]
    hidden: usize,
    /// Directory with the four MNIST IDX files (plain or .gz). Default: the bundled digits.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Keep the training set in page-locked memory (GPU only): the GPU then gathers each
    /// batch itself, reading the pixels as bytes over the bus (`ArrayDataset::pin`). The
    /// batches, and so the training, are the same bit for bit.
    #[arg(long)]
    pin_dataset: bool,
    /// Save the trained weights (safetensors, PyTorch state_dict names).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Load weights before training (a file from --save, or from PyTorch).
    #[arg(long)]
    load: Option<PathBuf>,
    /// After training, write the first 100 test inputs and the model's logits for them
    /// (safetensors `x`, `logits`), for bench/mnist_torch_check.py.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let device = args.device.clone();
    let r = dispatch(&device, Train(args));
    kiln_core::profile::report();
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Train(Args);

impl Job for Train {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        train::<B>(self.0, dev)
    }
}

/// The optimizer; without `--lr`, Adam(W) uses 1e-3 for the MLP and 2e-3 for LeNet (which
/// then reaches 95% in fewer epochs on the small bundled set).
fn optimizer<B: Backend>(
    kind: Opt,
    arch: Arch,
    lr: Option<f64>,
    params: Vec<Var<B>>,
) -> Result<Box<dyn Optimizer<B>>> {
    let adam_lr = lr.unwrap_or(match arch {
        Arch::Mlp => 1e-3,
        Arch::Lenet => 2e-3,
    });
    Ok(match kind {
        Opt::Sgd => Box::new(SgdConfig::new(lr.unwrap_or(0.1)).init(params)?),
        Opt::Momentum => Box::new(
            SgdConfig::new(lr.unwrap_or(0.05))
                .with_momentum(0.9)
                .init(params)?,
        ),
        Opt::Adam => Box::new(AdamConfig::new(adam_lr).init(params)?),
        Opt::Adamw => Box::new(AdamWConfig::new(adam_lr).init(params)?),
    })
}

fn progress(n: usize, epoch: usize, epochs: usize) -> ProgressBar {
    if !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30.cyan/blue}] {pos}/{len} batches  {msg}  {elapsed_precise}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_prefix(format!("epoch {epoch}/{epochs}"));
    pb
}

fn train<B: Backend>(args: Args, dev: B::Device) -> Result<()> {
    let dir = args.data_dir.clone().unwrap_or_else(Mnist::bundled_dir);
    let dir = dir.canonicalize().unwrap_or(dir);
    let mut data = Mnist::load(&dir)?;
    if args.pin_dataset {
        data.train = data.train.pin()?;
    }
    let (n_train, n_test) = (
        kiln_data::Dataset::len(&data.train),
        kiln_data::Dataset::len(&data.test),
    );
    let sample: Vec<usize> = match args.arch {
        Arch::Mlp => vec![784],
        Arch::Lenet => vec![1, 28, 28],
    };
    let mut train = DataLoader::<B>::new(data.train, args.batch_size, &dev)?
        .shuffle(args.seed)
        .sample_shape(sample.clone())?;
    let mut test = DataLoader::<B>::new(data.test, 1000, &dev)?.sample_shape(sample.clone())?;

    let mut model = match args.arch {
        Arch::Mlp => mlp::<B>(args.hidden, &dev, &mut Generator::new(args.seed))?,
        Arch::Lenet => lenet::<B>(&dev, &mut Generator::new(args.seed))?,
    };
    if let Some(p) = &args.load {
        model.load(p)?;
        println!("loaded weights from {}", p.display());
    }
    let mut opt = optimizer(args.optimizer, args.arch, args.lr, model.parameters())?;
    let precision = args.precision;
    precision.apply::<B>();
    let mut scaler: GradScaler<B> = GradScalerConfig::new()
        .with_enabled(precision.needs_scaler())
        .init()?;
    let epochs = args.epochs.unwrap_or(match args.arch {
        Arch::Mlp => 20,
        Arch::Lenet => 15,
    });
    println!(
        "mnist: {:?} ({} parameters) on {dev}, {} train / {n_test} test digits from {}",
        args.arch,
        model.num_params(),
        n_train,
        dir.display()
    );
    println!(
        "{} lr {}, batch {}, {epochs} epochs, seed {}, precision {:?}",
        opt.name(),
        opt.lr(),
        args.batch_size,
        args.seed,
        precision
    );

    let start = Instant::now();
    for epoch in 1..=epochs {
        model.train();
        let pb = progress(train.num_batches(), epoch, epochs);
        let t0 = Instant::now();
        // The loss is summed on the device and read once per epoch (reading it every step
        // would synchronize the GPU every step); the bar shows it every 10 batches.
        let mut loss_sum: Option<Tensor<B>> = None;
        let mut seen = 0usize;
        let mut skipped = 0usize;
        for (i, batch) in train.iter().enumerate() {
            let (x, y) = batch?;
            let n = y.elem_count();
            let _step = range("train_step");
            opt.zero_grad();
            let fwd = range("forward");
            let loss = {
                let _amp = precision.autocast().map(autocast).transpose()?;
                cross_entropy(&model.forward(&Var::constant(x))?, &y, Reduction::Mean)?
            };
            drop(fwd);
            let bwd = range("backward");
            scaler.scale(&loss)?.backward()?;
            drop(bwd);
            let step = range("step");
            // Without a scaler (f32, tf32, bf16) this is `opt.step()`.
            if !scaler.step(&mut opt)? {
                skipped += 1;
            }
            scaler.update()?;
            drop(step);
            let l = loss.tensor().mul_scalar(n as f64)?;
            loss_sum = Some(match loss_sum {
                None => l,
                Some(s) => s.add(&l)?,
            });
            seen += n;
            pb.inc(1);
            if !pb.is_hidden() && i % 10 == 0 {
                pb.set_message(format!("loss {:.4}", loss.tensor().to_scalar()?));
            }
        }
        let train_loss = match loss_sum {
            Some(s) => s.to_scalar()? / seen.max(1) as f64,
            None => f64::NAN,
        };
        B::synchronize(&dev)?;
        let secs = t0.elapsed().as_secs_f64();
        pb.finish_and_clear();
        let (test_loss, acc) = evaluate(&mut model, &mut test, precision)?;
        let scaling = if scaler.is_enabled() {
            format!(
                "  loss scale {} ({skipped} steps skipped)",
                scaler.get_scale()
            )
        } else {
            String::new()
        };
        println!(
            "epoch {epoch:>3}  train loss {train_loss:.4}  test loss {test_loss:.4}  \
             test acc {:>6.2}%  {:>8.0} samples/s{scaling}",
            acc * 100.0,
            seen as f64 / secs
        );
    }
    if epochs == 0 {
        let (test_loss, acc) = evaluate(&mut model, &mut test, precision)?;
        println!("test loss {test_loss:.4}  test acc {:.2}%", acc * 100.0);
    }
    if epochs > 0 {
        println!("trained in {:.1} s", start.elapsed().as_secs_f64());
    }
    if let Some(p) = &args.save {
        model.save(p)?;
        println!("saved weights to {}", p.display());
    }
    if let Some(p) = &args.dump_logits {
        model.eval();
        let (x, _) = test.iter().next().expect("the test set is not empty")?;
        let k = x.dims()[0].min(100);
        let x = x.narrow(0, 0, k)?.contiguous()?;
        let logits = no_grad(|| model.forward(&Var::constant(x.clone())))?.tensor();
        save_safetensors(
            p,
            &[("x".to_string(), x), ("logits".to_string(), logits)],
            None,
        )?;
        println!("wrote {k} inputs and their logits to {}", p.display());
    }
    Ok(())
}

/// Mean test loss and accuracy, in evaluation mode and without recording a graph.
fn evaluate<B: Backend>(
    model: &mut Sequential<B>,
    test: &mut DataLoader<B>,
    precision: Precision,
) -> Result<(f64, f64)> {
    let _r = range("evaluate");
    let _amp = precision.autocast().map(autocast).transpose()?;
    kiln_examples::models::evaluate(model, test)
}
