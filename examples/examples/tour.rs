//! The device tour of the README: arrays on devices, `to_device` vs `copy_to`, and the error
//! you get when an op mixes devices. Written once, generic over the backend.
//!
//! ```sh
//! cargo run --example tour                 # cpu and cpu:1 (virtual CPU devices)
//! cargo run --example tour -- --device cuda  # cuda:0 and, when present, cuda:1
//! ```

use clap::Parser;
use kiln_core::{Backend, Generator, Result, Tensor};
use kiln_examples::{Job, dispatch};

#[derive(Parser)]
#[command(about = "kiln's device tour")]
struct Args {
    /// Device: cpu, cpu:N, cuda, cuda:N (falls back to the CPU when no GPU is found).
    #[arg(long, default_value = "cpu")]
    device: String,
}

struct Tour;

impl Job for Tour {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        println!(
            "backend {}, devices available now: {:?}",
            B::NAME,
            B::devices()
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
        );
        // Create on a device; every tensor prints where it lives.
        let x = Tensor::<B>::from_vec(vec![1f32, 2., 3.], [1, 3], &dev)?;
        println!("x = {x}");

        // to_device to where it already is: the same buffer, no copy. copy_to always copies.
        let same = x.to_device(&dev)?;
        let copy = x.copy_to(&dev)?;
        println!(
            "x.to_device({dev}) shares x's buffer: {}",
            same.same_storage(&x)
        );
        println!(
            "x.copy_to({dev}) shares x's buffer:   {}",
            copy.same_storage(&x)
        );

        // A second device of the same backend (cpu:1 always exists; cuda:1 needs two GPUs).
        let second = format!("{}:1", dev.to_string().split(':').next().unwrap_or("cpu"));
        match B::parse_device(&second) {
            Ok(other) => {
                let y = x.copy_to(&other)?;
                println!("y = x.copy_to({other}) = {y}");
                match &x + &y {
                    Ok(_) => println!("unexpected: mixing devices worked"),
                    Err(e) => println!("x + y fails: {e}"),
                }
                let z = (&x + &y.to_device(&dev)?)?;
                println!("x + y.to_device({dev}) = {z}");
            }
            Err(e) => println!("no second device to mix with ({e})"),
        }

        // Work stays on the device; only printing or to_vec reads back.
        let w = Generator::new(42).randn::<B>([3, 2], &dev)?;
        let h = x.matmul(&w)?.relu()?;
        println!("relu(x @ w) = {h}");
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    dispatch(&args.device, Tour)
}
