//! Model parallelism, Chainer's `train_mnist_model_parallel`: two towers of six Linear layers
//! (784-1000-1000-2000-1000-1000-10), one tower per GPU, exchanging activations after the
//! third and the sixth layer through differentiable copies (`Var::to_device`, Chainer's
//! `F.copy`: forward is a peer copy, backward copies the gradient back to the source GPU).
//!
//! ```text
//! model_parallel                        # cuda:0 and cuda:1
//! model_parallel --epochs 5 --data-dir data/mnist
//! model_parallel --device cpu           # two virtual CPU devices (a smoke test)
//! ```
//!
//! On a machine with one GPU it says so and runs both towers on that GPU. Prints the test
//! accuracy after each epoch and the mean step time.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kiln_autograd::{Var, no_grad};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::Cuda;
use kiln_core::{Backend, Generator, Reduction, Result, Tensor};
use kiln_data::{Dataset, Mnist, permutation};
use kiln_nn::loss::{correct_count, cross_entropy};
use kiln_nn::{Linear, LinearConfig, Module};
use kiln_optim::{AdamConfig, Optimizer};

#[derive(Parser, Debug)]
#[command(
    name = "model_parallel",
    about = "two towers on two GPUs (see the file docs)"
)]
struct Args {
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Adam's learning rate (Chainer's example trains with Adam's defaults).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// MNIST IDX files (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// `cuda` (default) or `cpu` (two virtual CPU devices).
    #[arg(long, default_value = "cuda")]
    device: String,
}

const DIMS: [usize; 7] = [784, 1000, 1000, 2000, 1000, 1000, 10];

/// One tower: six Linear layers on one device.
struct Tower<B: Backend> {
    layers: Vec<Linear<B>>,
    dev: B::Device,
}

impl<B: Backend> Tower<B> {
    fn new(dev: &B::Device, g: &mut Generator) -> Result<Self> {
        let layers = DIMS
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init::<B>(dev, g))
            .collect::<Result<_>>()?;
        Ok(Tower {
            layers,
            dev: dev.clone(),
        })
    }
    /// Layers `range` with ReLU between (and after, except after the last layer).
    fn run(&self, x: &Var<B>, range: std::ops::Range<usize>) -> Result<Var<B>> {
        let mut h = x.clone();
        for i in range {
            h = self.layers[i].forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
    fn params(&self) -> Vec<Var<B>> {
        self.layers.iter().flat_map(|l| l.parameters()).collect()
    }
}

/// The two-tower network: `x` lives on tower 0's device; the output too.
fn forward<B: Backend>(t: &[Tower<B>; 2], x: &Var<B>) -> Result<Var<B>> {
    let x1 = x.to_device(&t[1].dev)?;
    let a0 = t[0].run(x, 0..3)?;
    let a1 = t[1].run(&x1, 0..3)?;
    // Exchange after layer 3: each tower continues from the sum of both towers' activations.
    let h0 = a0.add(&a1.to_device(&t[0].dev)?)?;
    let h1 = a1.add(&a0.to_device(&t[1].dev)?)?;
    let y0 = t[0].run(&h0, 3..6)?;
    let y1 = t[1].run(&h1, 3..6)?;
    // Exchange after layer 6: the logits are the sum of both towers' outputs.
    y0.add(&y1.to_device(&t[0].dev)?)
}

fn train<B: Backend>(args: &Args, d0: B::Device, d1: B::Device) -> Result<()> {
    let mut g = Generator::new(args.seed);
    let towers = [Tower::<B>::new(&d0, &mut g)?, Tower::<B>::new(&d1, &mut g)?];
    let mut params = towers[0].params();
    params.extend(towers[1].params());
    let mut opt = AdamConfig::new(args.lr).init(params)?;
    let m = Mnist::load(args.data_dir.clone().unwrap_or_else(Mnist::bundled_dir))?;
    let n = m.train.len();
    let tx = Tensor::<B>::from_host(m.train.features(), [n, 784], &d0)?;
    let ty = Tensor::<B>::from_host(m.train.labels(), [n], &d0)?;
    let nt = m.test.len();
    let ex = Tensor::<B>::from_host(m.test.features(), [nt, 784], &d0)?;
    let ey = Tensor::<B>::from_host(m.test.labels(), [nt], &d0)?;
    let steps = n / args.batch;
    let mut acc = 0.0;
    let mut step_time = 0.0;
    let mut last_loss = f32::NAN;
    for epoch in 1..=args.epochs {
        B::synchronize(&d0)?;
        B::synchronize(&d1)?;
        let t0 = Instant::now();
        // A new order each epoch (the bundled subset is sorted by digit).
        let order: Vec<i64> = permutation(n, args.seed, epoch as u64)
            .into_iter()
            .map(|i| i as i64)
            .collect();
        let ids = Tensor::<B>::from_slice(&order, [n], &d0)?;
        let (sx, sy) = (tx.index_select(0, &ids)?, ty.index_select(0, &ids)?);
        for s in 0..steps {
            let x = Var::constant(sx.narrow(0, s * args.batch, args.batch)?);
            let y = sy.narrow(0, s * args.batch, args.batch)?;
            opt.zero_grad();
            let loss = cross_entropy(&forward(&towers, &x)?, &y, Reduction::Mean)?;
            loss.backward()?;
            opt.step()?;
            if s + 1 == steps {
                last_loss = loss.tensor().to_vec::<f32>()?[0];
            }
        }
        B::synchronize(&d0)?;
        B::synchronize(&d1)?;
        step_time = t0.elapsed().as_secs_f64() / steps as f64;
        let logits = no_grad(|| forward(&towers, &Var::constant(ex.clone())))?;
        acc = correct_count(&logits.tensor(), &ey)? as f64 / nt as f64;
        println!(
            "epoch {epoch}: last train loss {last_loss:.4}, test accuracy {acc:.4}, {:.2} ms/step",
            step_time * 1e3
        );
    }
    println!(
        "kiln model_parallel devices={d0},{d1} epochs={} batch={} step_ms={:.3} test_accuracy={acc:.4}",
        args.epochs,
        args.batch,
        step_time * 1e3
    );
    Ok(())
}

fn main() {
    let args = Args::parse();
    let r = if args.device == "cpu" {
        match (Cpu::parse_device("cpu:0"), Cpu::parse_device("cpu:1")) {
            (Ok(a), Ok(b)) => train::<Cpu>(&args, a, b),
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    } else {
        match kiln_backend_cuda::device_count() {
            0 => Err(kiln_core::Error::invalid(
                "model_parallel",
                format!(
                    "no CUDA device ({}); use --device cpu",
                    kiln_backend_cuda::unavailable_reason().unwrap_or_default()
                ),
            )),
            1 => {
                println!("model_parallel: one GPU visible: both towers run on cuda:0");
                let d = kiln_backend_cuda::CudaDevice::new(0);
                train::<Cuda>(&args, d, d)
            }
            _ => train::<Cuda>(
                &args,
                kiln_backend_cuda::CudaDevice::new(0),
                kiln_backend_cuda::CudaDevice::new(1),
            ),
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
