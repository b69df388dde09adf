//! A character-level GPT on Shakespeare: nanoGPT's `shakespeare_char` configuration, trained
//! on the CPU or a GPU by one generic program (issue 31).
//!
//! ```text
//! cargo run --release --example gpt -- --device cpu            # tiny model, under a minute
//! cargo run --release --example gpt -- --device cuda           # 6 layers x 384, 5000 iters
//! cargo run --release --example gpt -- --device cuda --precision tf32 --iters 2000
//! cargo run --release --example gpt -- --device cuda --precision bf16 --iters 2000
//! ```
//!
//! The model, data and loop live in `kiln_examples::gpt` (shared with the integration test);
//! this file is the command line. Defaults are nanoGPT's `config/train_shakespeare_char.py`
//! (6 layers, 6 heads, width 384, context 256, batch 64, dropout 0.2, AdamW lr 1e-3 betas
//! (0.9, 0.99) weight decay 0.1, clipping at 1.0, warmup 100 then cosine to 1e-4 at the last
//! iteration). On the CPU, unless a size is given, `--tiny` is implied: the full model would
//! take hours there. `bench/gpt_torch.py` is the PyTorch twin, with the same flags and output.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use kiln_core::{Backend, Error, Generator, Result};
use kiln_examples::gpt::{CharData, Gpt, GptConfig, TrainConfig, bundled_corpus, generate, train};
use kiln_examples::{DEVICE_HELP, Job, dispatch};
use kiln_nn::ModuleExt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    /// f32 everywhere (TF32 off).
    F32,
    /// f32 storage, TF32 tensor-core products (GPU only).
    Tf32,
    /// bf16 autocast: products in bf16 on tensor cores, softmax/losses/norms in f32, f32
    /// weights and optimizer (`kiln_autograd::autocast`).
    Bf16,
}

/// Train a character-level GPT on Shakespeare with kiln.
#[derive(Parser, Debug, Clone)]
#[command(name = "gpt", about, long_about = None)]
struct Args {
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    /// Training iterations (default 5000; 1000 with --tiny).
    #[arg(long)]
    iters: Option<usize>,
    /// Evaluate every this many iterations (default 250; 200 with --tiny).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    eval_interval: Option<u64>,
    /// Batches per split in an evaluation (default 200; 20 with --tiny).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    eval_iters: Option<u64>,
    /// Sequences per batch (default 64; 16 with --tiny).
    #[arg(long)]
    batch: Option<usize>,
    /// Context length (default 256; 32 with --tiny).
    #[arg(long)]
    block: Option<usize>,
    /// Transformer blocks (default 6; 2 with --tiny).
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads (default 6; 2 with --tiny).
    #[arg(long)]
    heads: Option<usize>,
    /// Model width (default 384; 64 with --tiny).
    #[arg(long)]
    width: Option<usize>,
    /// Dropout (default 0.2; 0 with --tiny).
    #[arg(long)]
    dropout: Option<f64>,
    /// Peak learning rate (the minimum is a tenth of it).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Seed of the initial weights, the batches and the dropout masks.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
    /// Characters to generate after training (0: none).
    #[arg(long, default_value_t = 500)]
    sample: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k likeliest characters only.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    top_k: u64,
    /// A small configuration that trains in under a minute on two CPU cores (2 layers, 2
    /// heads, width 64, context 32, batch 16, no dropout, 1000 iterations). Implied on the CPU
    /// when no size is given.
    #[arg(long)]
    tiny: bool,
    /// The corpus (UTF-8 text, gzipped or not). Default: the bundled Shakespeare.
    #[arg(long)]
    data: Option<PathBuf>,
}

impl Args {
    fn sizes_given(&self) -> bool {
        self.batch.is_some()
            || self.block.is_some()
            || self.layers.is_some()
            || self.heads.is_some()
            || self.width.is_some()
    }

    /// The run's configuration: nanoGPT's, or the tiny one when asked (or implied on the CPU),
    /// with the flags given on top.
    fn config(&self, vocab_size: usize, on_cpu: bool) -> TrainConfig {
        let tiny = self.tiny || (on_cpu && !self.sizes_given());
        let (b, t, l, h, w, d, it, ei, en) = if tiny {
            (16, 32, 2, 2, 64, 0.0, 1000, 200, 20)
        } else {
            (64, 256, 6, 6, 384, 0.2, 5000, 250, 200)
        };
        let model = GptConfig {
            vocab_size,
            block: self.block.unwrap_or(t),
            n_layer: self.layers.unwrap_or(l),
            n_head: self.heads.unwrap_or(h),
            n_embd: self.width.unwrap_or(w),
            dropout: self.dropout.unwrap_or(d),
        };
        let mut c = TrainConfig::nanogpt(model, self.batch.unwrap_or(b), self.iters.unwrap_or(it));
        c.eval_interval = self.eval_interval.map_or(ei, |v| v as usize);
        c.eval_iters = self.eval_iters.map_or(en, |v| v as usize);
        c.lr = self.lr;
        c.min_lr = self.lr / 10.0;
        c.seed = self.seed;
        c.autocast = (self.precision == Precision::Bf16).then_some(kiln_core::DType::BF16);
        c
    }
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
    let path = args.data.clone().unwrap_or_else(bundled_corpus);
    let data = CharData::load(&path)?;
    let on_cpu = B::NAME == "cpu";
    let c = args.config(data.vocab_size(), on_cpu);
    if c.model.block > data.max_block() {
        return Err(Error::invalid(
            "gpt",
            format!(
                "--block {} exceeds the corpus ({})",
                c.model.block,
                data.max_block()
            ),
        ));
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        return Err(Error::invalid(
            "gpt",
            format!("--temperature must be positive, got {}", args.temperature),
        ));
    }
    if !(c.lr.is_finite() && c.lr > 0.0) {
        return Err(Error::invalid(
            "gpt",
            format!("--lr must be positive, got {}", c.lr),
        ));
    }
    let tf32 = args.precision == Precision::Tf32;
    if B::NAME == "cuda" {
        kiln_backend_cuda::set_allow_tf32(tf32);
    } else if tf32 {
        eprintln!("note: --precision tf32 applies to GPU products only; the CPU computes in f32");
    } else if args.precision == Precision::Bf16 {
        eprintln!(
            "note: --precision bf16 on the CPU is autocast with f32 arithmetic inside every kernel: for testing, not speed"
        );
    }
    let mut g = Generator::new(c.seed);
    let mut model = Gpt::<B>::new(c.model, &dev, &mut g)?;
    let m = &c.model;
    println!(
        "gpt: {} characters ({} train / {} val), vocabulary {}, from {}",
        data.train.len() + data.val.len(),
        data.train.len(),
        data.val.len(),
        data.vocab_size(),
        path.display()
    );
    println!(
        "{} layers, {} heads, width {}, context {}, dropout {}: {:.2}M parameters on {dev} ({:?})",
        m.n_layer,
        m.n_head,
        m.n_embd,
        m.block,
        m.dropout,
        model.num_params() as f64 / 1e6,
        args.precision
    );
    println!(
        "AdamW lr {} -> {} (warmup {}, cosine), betas {:?}, weight decay {}, clip {}, \
         batch {}, {} iterations, seed {}",
        c.lr, c.min_lr, c.warmup, c.betas, c.weight_decay, c.grad_clip, c.batch, c.iters, c.seed
    );
    let tokens = (c.batch * m.block) as f64;
    let start = std::time::Instant::now();
    train(&mut model, &data, &c, &dev, |p| {
        let speed = p.ms_per_iter.map_or(String::new(), |ms| {
            format!(
                ", {ms:.2} ms per iteration, {:.0} tokens/s",
                tokens / ms * 1e3
            )
        });
        println!(
            "iter {:>5}: train loss {:.4}, val loss {:.4}{speed}",
            p.iter, p.train_loss, p.val_loss
        );
    })?;
    println!("trained in {:.1} s", start.elapsed().as_secs_f64());
    if B::NAME == "cuda" {
        // Bytes in tensors at the peak, as PyTorch's `max_memory_allocated`.
        let peak = B::memory_stats(&dev)?.peak as f64 / (1 << 20) as f64;
        println!("peak GPU memory {peak:.0} MiB");
    }
    if args.sample > 0 {
        let mut sg = Generator::new(c.seed.wrapping_add(1));
        let settings = (args.temperature, Some(args.top_k as usize));
        let text = generate(
            &mut model,
            &data,
            "\n",
            args.sample,
            settings,
            &mut sg,
            &dev,
        )?;
        println!(
            "--- sample (temperature {}, top-k {}) ---{text}",
            args.temperature, args.top_k
        );
    }
    Ok(())
}
