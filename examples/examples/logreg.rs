//! Theano's logistic-regression exercise ("Using the GPU" / the tutorial's `logreg` example),
//! trained by kiln's autograd on the CPU or a GPU by one generic program.
//!
//! ```text
//! cargo run --release --example logreg                      # 10000 steps on the CPU
//! cargo run --release --example logreg -- --device cuda     # on the GPU (CPU if none)
//! cargo run --release --example logreg -- --steps 1000 --dtype f64
//! ```
//!
//! N = 400 samples with 784 features drawn from N(0, 1) and labels in {0, 1}, then full-batch
//! gradient descent on
//!
//! ```text
//! p_1  = sigmoid(x·w + b)
//! xent = -y log(p_1) - (1 - y) log(1 - p_1)
//! cost = mean(xent) + 0.01 * sum(w²)
//! w   -= lr * ∂cost/∂w,  b -= lr * ∂cost/∂b       (lr 0.01)
//! ```
//!
//! with `w ~ N(0, 1)` and `b = 0` as in the tutorial. Data and initial weights come from Philox
//! with `--seed`, so every backend trains on the same numbers and the final costs can be
//! compared across devices.
//!
//! With 784 unit-variance features `x·w` starts around ±28, where `sigmoid` rounds to exactly 1
//! in f32 and `log(1 - p_1)` is `-inf`. Theano never sees that: its graph optimizer rewrites
//! `log(sigmoid(z))` into `-softplus(-z)` (and `log(1 - sigmoid(z))` into `-softplus(z)`). We
//! write that stable form directly, `xent = softplus(z) - y z` with
//! `softplus(z) = max(z, 0) + log(1 + exp(-|z|))`, which is the same function and gradient.

use std::time::Instant;

use clap::{Parser, ValueEnum};
use kiln_autograd::{Var, no_grad};
use kiln_core::{Backend, CmpOp, DType, Result, Tensor};
use kiln_examples::{DEVICE_HELP, Job, dispatch};

const N: usize = 400;
const FEATS: usize = 784;
const L2: f64 = 0.01;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    F32,
    F64,
}

/// Theano's logistic regression (N=400, 784 features) trained by gradient descent with kiln.
#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    /// Gradient-descent steps.
    #[arg(long, default_value_t = 10_000)]
    steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// Seed of the data and the initial weights (Philox: the same on every device).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Element type of data, weights and gradients.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    dtype: Precision,
}

struct Logreg {
    steps: usize,
    lr: f64,
    seed: u64,
    dtype: DType,
}

/// `mean(xent) + 0.01 * sum(w²)` and the logits `z = x·w + b`.
fn cost<B: Backend>(x: &Var<B>, y: &Var<B>, w: &Var<B>, b: &Var<B>) -> Result<(Var<B>, Var<B>)> {
    let z = x.matmul(w)?.add(b)?;
    // softplus(z) - y z  ==  -y log(sigmoid z) - (1 - y) log(1 - sigmoid z)
    let softplus = z
        .relu()?
        .add(&z.abs()?.neg()?.exp()?.add_scalar(1.0)?.log()?)?;
    let xent = softplus.sub(&y.mul(&z)?)?;
    let cost = xent
        .mean_all()?
        .add(&w.square()?.sum_all()?.mul_scalar(L2)?)?;
    Ok((cost, z))
}

impl Job for Logreg {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        let dt = self.dtype;
        // D = (randn(N, feats), randint(0, 2, N)); w = randn(feats); b = 0.
        let x = Tensor::<B>::randn([N, FEATS], 0.0, 1.0, self.seed, dt, &dev)?;
        let y = Tensor::<B>::rand([N], 0.0, 1.0, self.seed.wrapping_add(1), dt, &dev)?
            .compare_scalar(CmpOp::Ge, 0.5)?
            .to_dtype(dt)?;
        let w = Var::param(Tensor::<B>::randn(
            [FEATS],
            0.0,
            1.0,
            self.seed.wrapping_add(2),
            dt,
            &dev,
        )?);
        let b = Var::param(Tensor::<B>::zeros([], dt, &dev)?);
        let (x, y) = (Var::constant(x), Var::constant(y));

        let initial = no_grad(|| cost(&x, &y, &w, &b))?.0.tensor().to_scalar()?;
        println!(
            "logreg on {dev} ({}, {dt}): N={N}, {FEATS} features, {} steps, lr {}, L2 {L2}",
            B::NAME,
            self.steps,
            self.lr
        );
        println!("initial cost {initial:.6}");

        B::synchronize(&dev)?;
        let start = Instant::now();
        for _ in 0..self.steps {
            let (c, _) = cost(&x, &y, &w, &b)?;
            c.backward()?;
            for p in [&w, &b] {
                if let Some(g) = p.take_grad() {
                    p.update_data(|t| t.sub(&g.mul_scalar(self.lr)?))?;
                }
            }
        }
        B::synchronize(&dev)?;
        let elapsed = start.elapsed();

        let (c, z) = no_grad(|| cost(&x, &y, &w, &b))?;
        let predicted = z.tensor().compare_scalar(CmpOp::Gt, 0.0)?.to_dtype(dt)?;
        let accuracy = predicted
            .eq(&y.tensor())?
            .to_dtype(dt)?
            .mean_all()?
            .to_scalar()?;
        println!("final cost {:.6}", c.tensor().to_scalar()?);
        println!("training accuracy {:.2}%", 100.0 * accuracy);
        println!(
            "wall time {:.3} s ({:.1} µs/step)",
            elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e6 / self.steps.max(1) as f64
        );
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let job = Logreg {
        steps: args.steps,
        lr: args.lr,
        seed: args.seed,
        dtype: match args.dtype {
            Precision::F32 => DType::F32,
            Precision::F64 => DType::F64,
        },
    };
    dispatch(&args.device, job)
}
