//! Times the GPU kernels a GEMM-bound training step is made of (f32, TF32 off): 4096² matrix
//! products in each operand layout (N = row-major, T = a transposed view), the bias-gradient
//! column sum and a transposing copy. `bench/gemm_layouts.py` times the same in PyTorch.
//!
//! ```sh
//! cargo run --release --example gemm_layouts -- --device cuda
//! ```

use std::time::Instant;

use clap::Parser;
use kiln_core::{Backend, Generator, Result, Tensor};
use kiln_examples::{Job, dispatch};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long, default_value_t = 4096)]
    n: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

struct Layouts {
    n: usize,
    iters: usize,
}

fn time<B: Backend>(
    dev: &B::Device,
    iters: usize,
    f: impl Fn() -> Result<Tensor<B>>,
) -> Result<f64> {
    f()?;
    B::synchronize(dev)?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    B::synchronize(dev)?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

impl Job for Layouts {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        let n = self.n;
        let a = Generator::new(1).randn::<B>([n, n], &dev)?;
        let b = Generator::new(2).randn::<B>([n, n], &dev)?;
        let flop = 2.0 * (n as f64).powi(3);
        let cases: [(&str, Tensor<B>, Tensor<B>); 4] = [
            ("NN", a.clone(), b.clone()),
            ("NT", a.clone(), b.t()?),
            ("TN", a.t()?, b.clone()),
            ("TT", a.t()?, b.t()?),
        ];
        for (name, x, y) in &cases {
            let ms = time(&dev, self.iters, || x.matmul(y))?;
            println!(
                "kiln gemm {name} n={n} ms={ms:.3} tflops={:.2}",
                flop / ms / 1e9
            );
        }
        let ms = time(&dev, self.iters, || a.sum(&[0], false))?;
        println!("kiln sum_axis0 n={n} ms={ms:.3}");
        let ms = time(&dev, self.iters, || a.t()?.contiguous())?;
        println!("kiln transpose_copy n={n} ms={ms:.3}");
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    dispatch(
        &args.device,
        Layouts {
            n: args.n,
            iters: args.iters,
        },
    )
}
