//! MNIST training with each step captured in a CUDA graph, beside the same training run
//! eagerly: the time per step of each (the whole loop, DataLoader included) and the test
//! accuracy each reaches, which must agree.
//!
//! The graph form is what a PyTorch user writes with `torch.cuda.graph`: static input tensors,
//! one eager warm-up step (it creates the momentum buffers), a capture of one step, then per
//! batch `write_static` of the batch into the inputs and one `replay`. The loss is summed into
//! a static accumulator inside the graph, so the loop reads nothing back until the epoch ends.
//!
//! ```sh
//! cargo run --release --example cuda_graph -- --epochs 2
//! ```

use std::time::Instant;

use clap::Parser;
use kiln_autograd::{Var, no_grad};
use kiln_backend_cuda::{Cuda, CudaDevice, CudaGraph, try_gpu, unavailable_reason, write_static};
use kiln_core::{DType, Generator, Reduction, Result, Tensor};
use kiln_data::{DataLoader, Mnist};
use kiln_examples::models::mlp;
use kiln_nn::loss::{correct_count, cross_entropy};
use kiln_nn::{Module, Sequential};
use kiln_optim::{Optimizer, Sgd, SgdConfig};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    #[arg(long, default_value_t = 100)]
    batch: usize,
    #[arg(long, default_value_t = 100)]
    hidden: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The MNIST files (default: the repository's `data/mnist`).
    #[arg(long)]
    data_dir: Option<std::path::PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({}); CUDA graphs need a GPU",
            unavailable_reason().unwrap_or_default()
        );
        return Ok(());
    };
    println!(
        "cuda_graph: MLP 784-{h}-{h}-10, SGD lr 0.1 momentum 0.9, batch {}, on {}",
        args.batch,
        dev.name()?,
        h = args.hidden
    );
    let eager = run(&args, &dev, false)?;
    let graph = run(&args, &dev, true)?;
    println!(
        "per step: eager {:.4} ms, graph {:.4} ms ({:.2}x); test accuracy: eager {:.2} %, graph {:.2} %",
        eager.0,
        graph.0,
        eager.0 / graph.0,
        eager.1 * 100.0,
        graph.1 * 100.0
    );
    Ok(())
}

/// Trains a fresh model for `args.epochs`; returns (ms per step over the last epoch, test
/// accuracy). The first epoch of the graph form includes its warm-up step and capture.
fn run(args: &Args, dev: &CudaDevice, captured: bool) -> Result<(f64, f64)> {
    let data = Mnist::load(args.data_dir.clone().unwrap_or_else(Mnist::bundled_dir))?;
    let mut train = DataLoader::<Cuda>::new(data.train, args.batch, dev)?
        .shuffle(args.seed)
        .drop_last(true)
        .sample_shape(vec![784])?;
    let mut test = DataLoader::<Cuda>::new(data.test, 1000, dev)?.sample_shape(vec![784])?;
    let model = mlp::<Cuda>(args.hidden, dev, &mut Generator::new(args.seed))?;
    let mut opt = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .init(model.parameters())?;
    let b = args.batch;
    // Static inputs and the loss accumulator (labels uploaded from the host, so the loss
    // knows they are in range without reading them back during the capture).
    let x = Tensor::<Cuda>::zeros([b, 784], DType::F32, dev)?;
    let y = Tensor::<Cuda>::from_vec(vec![0i64; b], [b], dev)?;
    let acc = Tensor::<Cuda>::zeros([], DType::F32, dev)?;
    let step =
        |model: &Sequential<Cuda>, opt: &mut Sgd<Cuda>, x: &Tensor<Cuda>, y: &Tensor<Cuda>| {
            let loss = cross_entropy(
                &model.forward(&Var::constant(x.clone()))?,
                y,
                Reduction::Mean,
            )?;
            opt.zero_grad();
            loss.backward()?;
            opt.step()?;
            Ok::<_, kiln_core::Error>(loss.tensor())
        };
    let mut graph = None;
    let mut ms = 0.0;
    for epoch in 1..=args.epochs {
        write_static(&acc, &Tensor::<Cuda>::zeros([], DType::F32, dev)?)?;
        kiln_backend_cuda::synchronize(dev)?;
        let t0 = Instant::now();
        let mut steps = 0;
        for batch in train.iter() {
            let (bx, by) = batch?;
            if !captured {
                let loss = step(&model, &mut opt, &bx, &by)?;
                write_static(&acc, &acc.add(&loss)?)?;
            } else if let Some(g) = &graph {
                write_static(&x, &bx)?;
                write_static(&y, &by)?;
                CudaGraph::replay(g)?;
            } else {
                // The first batch: one eager step (it creates the momentum buffers, which
                // a graph cannot), then the capture of the next one's step.
                let loss = step(&model, &mut opt, &bx, &by)?;
                write_static(&acc, &acc.add(&loss)?)?;
                graph = Some(
                    CudaGraph::capture(dev, || {
                        let loss = step(&model, &mut opt, &x, &y)?;
                        write_static(&acc, &acc.add(&loss)?)
                    })?
                    .0,
                );
            }
            steps += 1;
        }
        let mean = acc.to_scalar()? / steps as f64;
        ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let form = if captured { "graph" } else { "eager" };
        println!("{form} epoch {epoch}: mean loss {mean:.4}, {ms:.4} ms per step ({steps} steps)");
    }
    let accuracy = no_grad(|| {
        let (mut correct, mut n) = (0, 0);
        for batch in test.iter() {
            let (tx, ty) = batch?;
            correct += correct_count(&model.forward(&Var::constant(tx))?.tensor(), &ty)?;
            n += ty.elem_count();
        }
        Ok::<_, kiln_core::Error>(correct as f64 / n as f64)
    })?;
    Ok((ms, accuracy))
}
