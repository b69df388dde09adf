//! ResNet-18 (CIFAR form) on MNIST padded to 32×32, trained on the CPU or a GPU by one generic
//! program (issue 33).
//!
//! ```text
//! cargo run --release --example resnet -- --device cpu        # width 8, 1 epoch: about a minute
//! cargo run --release --example resnet -- --device cuda       # ResNet-18 (width 64), 10 epochs
//! cargo run --release --example resnet -- --device cuda --width 16 --epochs 3
//! ```
//!
//! The model and the loop live in `kiln_examples::resnet` (shared with the integration test);
//! this file is the command line. Data: the 4,000 training and 1,000 test digits bundled in
//! `data/mnist` (or `--data-dir`), zero-padded to 32×32 once on the host. SGD with momentum 0.9
//! and weight decay 5e-4 at a constant learning rate; BatchNorm in training mode while training
//! and in evaluation mode (running statistics) for the test set. On the CPU, unless a width is
//! given, a width of 8 and one epoch are implied: the real width would take an hour there.
//! `bench/resnet_torch.py` is the PyTorch twin, with the same flags and output lines.
//!
//! The state dict moves both ways with PyTorch (safetensors, torchvision's names, BatchNorm's
//! running statistics and `num_batches_tracked`): `--save` after training, `--load` before it
//! (`--epochs 0` only evaluates), and `--dump-logits` writes 100 test inputs and their
//! eval-mode logits, which `bench/resnet_torch.py --load W --check-logits F` recomputes.
//!
//! On a GPU convolutions run through cuDNN when it can be loaded (the graph API for TF32 and
//! 16-bit math, the legacy one for strict f32; see kiln-backend-cuda's `cudnn` module), and as
//! im2col + GEMM otherwise, as on the CPU; the backend says once which it uses.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kiln_autograd::{Var, no_grad};
use kiln_core::{Backend, Error, Generator, Result};
use kiln_data::{DataLoader, Dataset, Mnist};
use kiln_examples::models::evaluate;
use kiln_examples::resnet::{ResNet, ResNetConfig, pad_to_32, train_epoch};
use kiln_examples::{DEVICE_HELP, Job, dispatch};
use kiln_nn::{Module, ModuleExt, save_safetensors};
use kiln_optim::SgdConfig;

/// Train ResNet-18 (CIFAR form) on MNIST padded to 32x32 with kiln.
#[derive(Parser, Debug, Clone)]
#[command(name = "resnet", about, long_about = None)]
struct Args {
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    /// Width of the first stage; the stages are w, 2w, 4w, 8w (default 64, ResNet-18; 8 on the
    /// CPU).
    #[arg(long)]
    width: Option<usize>,
    /// Passes over the training set (default 10; 1 on the CPU when no width is given).
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// Train on the first N training digits only (default: all).
    #[arg(long)]
    train_samples: Option<usize>,
    /// Seed of the initial weights and the batch order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A directory with the four MNIST IDX files (default: the bundled subset).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Load weights before training (a file from --save, or PyTorch's state dict).
    #[arg(long)]
    load: Option<PathBuf>,
    /// Save the weights and BatchNorm buffers after training (safetensors).
    #[arg(long)]
    save: Option<PathBuf>,
    /// After training, write 100 test inputs and their eval-mode logits (safetensors `x`,
    /// `logits`), for bench/resnet_torch.py --check-logits.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let device = args.device.clone();
    let r = dispatch(&device, Run(args));
    kiln_core::profile::report();
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Run(Args);

impl Job for Run {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        run::<B>(self.0, dev)
    }
}

fn run<B: Backend>(args: Args, dev: B::Device) -> Result<()> {
    let tiny = B::NAME == "cpu" && args.width.is_none();
    let width = args.width.unwrap_or(if tiny { 8 } else { 64 });
    let epochs = args.epochs.unwrap_or(if tiny { 1 } else { 10 });
    if args.batch_size == 0 || !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(Error::invalid(
            "resnet",
            format!(
                "--batch-size and --lr must be positive, got {} and {}",
                args.batch_size, args.lr
            ),
        ));
    }
    let dir = args.data_dir.clone().unwrap_or_else(Mnist::bundled_dir);
    let dir = dir.canonicalize().unwrap_or(dir);
    let data = Mnist::load(&dir)?;
    let train_set = match args.train_samples {
        Some(n) => data.train.take(n),
        None => data.train,
    };
    let (train_set, test_set) = (pad_to_32(&train_set)?, pad_to_32(&data.test)?);
    let (n_train, n_test) = (train_set.len(), test_set.len());
    let mut train = DataLoader::<B>::new(train_set, args.batch_size, &dev)?.shuffle(args.seed);
    let mut test = DataLoader::<B>::new(test_set, 500, &dev)?;

    let cfg = ResNetConfig::resnet18(1, 10, width);
    let mut model = ResNet::<B>::new(cfg, &dev, &mut Generator::new(args.seed))?;
    if let Some(p) = &args.load {
        model.load(p)?;
        println!("loaded weights from {}", p.display());
    }
    let mut opt = SgdConfig::new(args.lr)
        .with_momentum(args.momentum)
        .with_weight_decay(args.weight_decay)
        .init(model.parameters())?;
    println!(
        "resnet: ResNet-18 (CIFAR form, width {width}), {} parameters on {dev}, {n_train} train / \
         {n_test} test digits padded to 32x32 from {}",
        model.num_params(),
        dir.display()
    );
    println!(
        "SGD lr {}, momentum {}, weight decay {}, batch {}, {epochs} epochs, seed {}",
        args.lr, args.momentum, args.weight_decay, args.batch_size, args.seed
    );
    let start = Instant::now();
    for epoch in 1..=epochs {
        let t0 = Instant::now();
        let (train_loss, seen) = train_epoch(&mut model, &mut train, &mut opt)?;
        B::synchronize(&dev)?;
        let secs = t0.elapsed().as_secs_f64();
        let (test_loss, acc) = evaluate(&mut model, &mut test)?;
        println!(
            "epoch {epoch:>3}  train loss {train_loss:.4}  test loss {test_loss:.4}  \
             test acc {:>6.2}%  {:>8.0} samples/s",
            acc * 100.0,
            seen as f64 / secs
        );
    }
    if epochs == 0 {
        let (test_loss, acc) = evaluate(&mut model, &mut test)?;
        println!("test loss {test_loss:.4}  test acc {:.2}%", acc * 100.0);
    } else {
        println!("trained in {:.1} s", start.elapsed().as_secs_f64());
    }
    if let Some(p) = &args.save {
        model.save(p)?;
        println!("saved weights to {}", p.display());
    }
    if let Some(p) = &args.dump_logits {
        model.set_training(false);
        let (x, _) = test.iter().next().expect("the test set is not empty")?;
        let x = x.narrow(0, 0, x.dims()[0].min(100))?.contiguous()?;
        let logits = no_grad(|| model.forward(&Var::constant(x.clone())))?.tensor();
        let n = x.dims()[0];
        save_safetensors(p, &[("x".into(), x), ("logits".into(), logits)], None)?;
        println!("wrote {n} inputs and their logits to {}", p.display());
    }
    Ok(())
}
