//! Dive into Deep Learning's multi-GPU exercise: the same matrix products on two GPUs at once
//! versus one after another on one GPU.
//!
//! ```text
//! two_gpu_matmul                    # 20 products of 4096x4096 per GPU, f32
//! two_gpu_matmul --n 8192 --count 10
//! two_gpu_matmul --device cpu       # two virtual CPU devices (a smoke test)
//! ```
//!
//! kiln launches GPU work asynchronously, so issuing device 0's products and then device 1's
//! from one thread keeps both GPUs busy at once; only the final synchronization waits. Prints
//! `kiln two_gpu_matmul ... one_gpu_ms=... two_gpus_ms=... speedup=...` (median of the repeats;
//! TF32 off), then `kiln copy_peer_256MB ... gb_per_s=...`: a 256 MB tensor copied from the first
//! device to the second with `copy_to` (median of the repeats, from the call until both devices
//! are idle), issue 12's GPU-to-GPU copy row.

use std::time::Instant;

use clap::Parser;
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::Cuda;
use kiln_core::{Backend, DType, Generator, Result, Tensor};

#[derive(Parser, Debug)]
#[command(
    name = "two_gpu_matmul",
    about = "matmuls on two GPUs at once vs one (see the file docs)"
)]
struct Args {
    #[arg(long, default_value_t = 4096)]
    n: usize,
    /// Products per GPU.
    #[arg(long, default_value_t = 20)]
    count: usize,
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// `cuda` (default) or `cpu`.
    #[arg(long, default_value = "cuda")]
    device: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run<B: Backend>(args: &Args, d0: B::Device, d1: B::Device) -> Result<()> {
    let x0 = Generator::new(1).randn::<B>([args.n, args.n], &d0)?;
    let x1 = Generator::new(2).randn::<B>([args.n, args.n], &d1)?;
    let sync = || -> Result<()> {
        B::synchronize(&d0)?;
        B::synchronize(&d1)
    };
    // Sequential: both workloads on device 0, one after the other.
    let one = || -> Result<f64> {
        sync()?;
        let t = Instant::now();
        for _ in 0..2 * args.count {
            x0.matmul(&x0)?.realize()?;
        }
        sync()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // Parallel: device 0's products and device 1's, issued back to back, running at once.
    let two = || -> Result<f64> {
        sync()?;
        let t = Instant::now();
        for _ in 0..args.count {
            x0.matmul(&x0)?.realize()?;
            x1.matmul(&x1)?.realize()?;
        }
        sync()?;
        Ok(t.elapsed().as_secs_f64())
    };
    one()?;
    two()?;
    let t1 = median((0..args.repeats).map(|_| one()).collect::<Result<_>>()?);
    let t2 = median((0..args.repeats).map(|_| two()).collect::<Result<_>>()?);
    let flops = 2.0 * (args.n as f64).powi(3) * 2.0 * args.count as f64;
    println!(
        "kiln two_gpu_matmul devices={d0},{d1} n={} count={} one_gpu_ms={:.2} two_gpus_ms={:.2} speedup={:.3} two_gpus_tflops={:.1}",
        args.n,
        args.count,
        t1 * 1e3,
        t2 * 1e3,
        t1 / t2,
        flops / t2 / 1e12
    );
    copy_peer::<B>(args, &d0, &d1)
}

/// 256 MB from `d0` to `d1` through `copy_to`, as a user calls it: the whole call until both
/// devices are idle.
fn copy_peer<B: Backend>(args: &Args, d0: &B::Device, d1: &B::Device) -> Result<()> {
    let n = 64 << 20;
    let src = Tensor::<B>::ones([n], DType::F32, d0)?;
    let once = || -> Result<f64> {
        B::synchronize(d0)?;
        B::synchronize(d1)?;
        let t = Instant::now();
        let dst = src.copy_to(d1)?;
        B::synchronize(d0)?;
        B::synchronize(d1)?;
        let s = t.elapsed().as_secs_f64();
        drop(dst);
        Ok(s)
    };
    once()?;
    let s = median(
        (0..args.repeats.max(5))
            .map(|_| once())
            .collect::<Result<_>>()?,
    );
    println!(
        "kiln copy_peer_256MB devices={d0},{d1} ms={:.3} gb_per_s={:.1}",
        s * 1e3,
        4.0 * n as f64 / s / 1e9
    );
    Ok(())
}

fn main() {
    let args = Args::parse();
    kiln_backend_cuda::set_allow_tf32(false);
    let r = if args.device == "cpu" {
        match (Cpu::parse_device("cpu:0"), Cpu::parse_device("cpu:1")) {
            (Ok(a), Ok(b)) => run::<Cpu>(&args, a, b),
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    } else if kiln_backend_cuda::device_count() < 2 {
        println!(
            "skipped: two_gpu_matmul needs 2 GPUs, {} visible",
            kiln_backend_cuda::device_count()
        );
        Ok(())
    } else {
        run::<Cuda>(
            &args,
            kiln_backend_cuda::CudaDevice::new(0),
            kiln_backend_cuda::CudaDevice::new(1),
        )
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
