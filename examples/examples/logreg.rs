//! Theano's logistic-regression exercise ("Using the GPU" / the tutorial's `logreg` example),
//! trained by kiln's autograd on the CPU or a GPU by one generic program.
//!
//! ```text
//! cargo run --release --example logreg                      # 10000 steps on the CPU
//! cargo run --release --example logreg -- --device cuda     # on the GPU (CPU if none)
//! cargo run --release --example logreg -- --steps 1000 --dtype f64
//! cargo run --release --example logreg -- --torch-script > logreg_torch.py   # the PyTorch twin
//! python3 logreg_torch.py --device cuda
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
//!
//! `--torch-script` prints the same program for PyTorch (eager autograd, the same ops in the
//! same order, and the same Philox data re-implemented in numpy), so one device call can run both
//! and compare final cost and time per step side by side: what our autograd costs against
//! PyTorch's when the GPU work per step is tiny and the overhead per op is what matters.

use std::time::Instant;

use clap::{Parser, ValueEnum};
use kiln_autograd::{Var, no_grad};
use kiln_core::{Backend, CmpOp, DType, Generator, RandDist, Result, Tensor};
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
    /// Print the equivalent PyTorch program (same data, same ops) and exit.
    #[arg(long)]
    torch_script: bool,
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
        let x = Generator::new(self.seed).sample::<B>(
            [N, FEATS],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            dt,
            &dev,
        )?;
        let y = Generator::new(self.seed.wrapping_add(1))
            .sample::<B>(
                [N],
                RandDist::Uniform {
                    low: 0.0,
                    high: 1.0,
                },
                dt,
                &dev,
            )?
            .compare_scalar(CmpOp::Ge, 0.5)?
            .to_dtype(dt)?;
        let w = Var::param(Generator::new(self.seed.wrapping_add(2)).sample::<B>(
            [FEATS],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
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
    if args.torch_script {
        print!("{TORCH_SCRIPT}");
        return Ok(());
    }
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

/// The PyTorch twin of this program (see the module docs). Takes the same options.
const TORCH_SCRIPT: &str = r#"#!/usr/bin/env python3
# PyTorch twin of kiln's examples/logreg.rs (printed by `logreg --torch-script`): the same
# Philox data, the same ops, eager autograd. Prints the same lines, prefixed with "torch".
import argparse, time
import numpy as np
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
ap.add_argument("--steps", type=int, default=10000)
ap.add_argument("--lr", type=float, default=0.01)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
a = ap.parse_args()
N, FEATS, L2 = 400, 784, 0.01
MASK = np.uint64(0xFFFFFFFF)

def philox_words(seed, n):
    # kiln_core::philox::words(seed, i) for i in 0..n: counter [i_lo, i_hi, 0, 0], key seed.
    i = np.arange(n, dtype=np.uint64)
    c0, c1 = i & MASK, i >> np.uint64(32)
    c2, c3 = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & MASK,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & MASK)
    return c0, c1, c2, c3

def unit53(hi, lo):
    return ((hi << np.uint64(32)) | lo) >> np.uint64(11)

def randn(n, seed, f64):
    w = philox_words(seed, n)
    if f64:
        u1 = (unit53(w[0], w[1]) + np.uint64(1)).astype(np.float64) * 2.0**-53
        u2 = unit53(w[2], w[3]).astype(np.float64) * 2.0**-53
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)
    f = np.float32
    u1 = ((w[0] >> np.uint64(8)) + np.uint64(1)).astype(f) * f(2.0**-24)
    u2 = (w[1] >> np.uint64(8)).astype(f) * f(2.0**-24)
    return np.sqrt(f(-2.0) * np.log(u1)) * np.cos(f(2 * np.pi) * u2)

def rand(n, seed, f64):
    w = philox_words(seed, n)
    if f64:
        return unit53(w[0], w[1]).astype(np.float64) * 2.0**-53
    return (w[0] >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)

f64 = a.dtype == "f64"
dt = torch.float64 if f64 else torch.float32
dev = torch.device(a.device)
M64 = (1 << 64) - 1
x = torch.tensor(randn(N * FEATS, a.seed, f64).reshape(N, FEATS), dtype=dt, device=dev)
y = torch.tensor((rand(N, (a.seed + 1) & M64, f64) >= 0.5), dtype=dt, device=dev)
w = torch.tensor(randn(FEATS, (a.seed + 2) & M64, f64), dtype=dt, device=dev).requires_grad_()
b = torch.zeros((), dtype=dt, device=dev).requires_grad_()

def cost():
    z = x @ w + b
    softplus = torch.relu(z) + torch.log(torch.exp(-z.abs()) + 1.0)
    xent = softplus - y * z
    return xent.mean() + (w * w).sum() * L2, z

def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)

with torch.no_grad():
    print(f"torch logreg on {dev} ({a.dtype}): N={N}, {FEATS} features, {a.steps} steps, lr {a.lr}, L2 {L2}")
    print(f"torch initial cost {cost()[0].item():.6f}")
sync()
t0 = time.perf_counter()
for _ in range(a.steps):
    c, _ = cost()
    c.backward()
    with torch.no_grad():
        for p in (w, b):
            p -= a.lr * p.grad
            p.grad = None
sync()
el = time.perf_counter() - t0
with torch.no_grad():
    c, z = cost()
    acc = ((z > 0).to(dt) == y).to(dt).mean().item()
print(f"torch final cost {c.item():.6f}")
print(f"torch training accuracy {100 * acc:.2f}%")
print(f"torch wall time {el:.3f} s ({el * 1e6 / max(a.steps, 1):.1f} us/step)")
"#;
