//! Where the host time of a small-op workload goes: the cost per call of a few tiny ops (400
//! elements, so the device work is negligible and what remains is kiln's own overhead plus the
//! kernel launch), without and with autograd, and of a chain of elementwise ops (which the CUDA
//! backend runs as one fused kernel; `KILN_CUDA_FUSE=0` to compare). On CUDA,
//! `KILN_CUDA_LAUNCH_STATS=1` adds the launches per op and the part of each op's time spent
//! inside `cuLaunchKernel`.
//!
//! ```sh
//! cargo run --release --example op_overhead -- --device cuda
//! ```

use std::time::Instant;

use clap::Parser;
use kiln_autograd::Var;
use kiln_core::{Backend, DType, Generator, Result, Shape, Tensor};
use kiln_examples::{DEVICE_HELP, Job, dispatch, launch_stats};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    /// Calls per measurement.
    #[arg(long, default_value_t = 20_000)]
    iters: usize,
}

fn main() {
    let a = Args::parse();
    let device = a.device.clone();
    if let Err(e) = dispatch(&device, Overhead(a.iters)) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Overhead(usize);

/// Times `iters` calls of `f`, each making `ops` kiln ops, and prints one line.
fn measure<B: Backend>(
    dev: &B::Device,
    name: &str,
    iters: usize,
    ops: usize,
    f: &dyn Fn() -> Result<()>,
) -> Result<()> {
    for _ in 0..iters / 10 {
        f()?;
    }
    B::synchronize(dev)?;
    let (l0, n0) = launch_stats::<B>();
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    B::synchronize(dev)?;
    let us = t.elapsed().as_secs_f64() * 1e6 / (iters * ops) as f64;
    let (l1, n1) = launch_stats::<B>();
    let stats = if l1 > l0 {
        let per_op = (l1 - l0) as f64 / (iters * ops) as f64;
        let in_launch = (n1 - n0) as f64 / 1e3 / (iters * ops) as f64;
        format!(" launches/op={per_op:.2} us_in_cuLaunchKernel/op={in_launch:.2}")
    } else {
        String::new()
    };
    println!("overhead {name:<34} us/op={us:.2}{stats}");
    Ok(())
}

impl Job for Overhead {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        let n = self.0;
        let x = Generator::new(1).uniform::<B>([400], -1.0, 1.0, &dev)?;
        let y = Generator::new(2).uniform::<B>([400], -1.0, 1.0, &dev)?;
        let s = Tensor::<B>::full(Shape::scalar(), 0.5, DType::F32, &dev)?;
        println!("device {dev}, 400-element f32 tensors, {n} calls per line");
        // Each result is realized: a backend that defers elementwise work (CUDA) runs it.
        measure::<B>(&dev, "tensor add_scalar", n, 1, &|| {
            x.add_scalar(1.0)?.realize()
        })?;
        measure::<B>(&dev, "tensor add (same shape)", n, 1, &|| {
            x.add(&y)?.realize()
        })?;
        measure::<B>(&dev, "tensor add (0-d broadcast)", n, 1, &|| {
            x.add(&s)?.realize()
        })?;
        measure::<B>(&dev, "tensor sigmoid", n, 1, &|| x.sigmoid()?.realize())?;
        measure::<B>(&dev, "tensor sum_all", n, 1, &|| x.sum_all()?.realize())?;
        // On CUDA: eight deferred ops, then one fused launch.
        measure::<B>(&dev, "tensor 8-op elementwise chain", n / 8, 8, &|| {
            let a = x.mul(&y)?.add_scalar(1.0)?.sigmoid()?.mul(&x)?;
            a.sub(&y)?.square()?.mul_scalar(0.5)?.add(&s)?.realize()
        })?;
        let (vx, vy) = (Var::param(x.clone()), Var::constant(y.clone()));
        // forward: mul, sigmoid, sum = 3 ops; backward: seed, sum (view), sigmoid, mul = 3 ops
        measure::<B>(
            &dev,
            "var mul+sigmoid+sum fwd+bwd (6 ops)",
            n / 4,
            6,
            &|| {
                let l = vx.mul(&vy)?.sigmoid()?.sum_all()?;
                l.backward()?;
                vx.take_grad().map_or(Ok(()), |g| g.realize())
            },
        )?;
        Ok(())
    }
}
