//! What recording costs: the time per op of a chain of tiny elementwise ops on the CPU, with
//! plain tensors, with `Var`s under `no_grad`, with `Var`s recording, and the backward pass.
//! Tiny tensors make the kernels negligible, so the differences are the autograd bookkeeping
//! (an `Arc` node, a boxed closure, the saved handles, the topological walk).
//!
//! `cargo bench -p kiln-autograd --bench overhead` prints one line per measurement. Not a test:
//! nothing here asserts a time.

use std::time::Instant;

use kiln_autograd::{Var, no_grad};
use kiln_backend_cpu::Cpu;
use kiln_core::{DType, Result, Tensor};

const OPS: usize = 1000;
const REPS: usize = 20;

fn per_op(label: &str, mut f: impl FnMut() -> Result<()>) -> Result<()> {
    f()?; // warm up
    let start = Instant::now();
    for _ in 0..REPS {
        f()?;
    }
    let ns = start.elapsed().as_nanos() as f64 / (REPS * OPS) as f64;
    println!("BENCH autograd/{label} {ns:.0} ns/op");
    Ok(())
}

fn main() -> Result<()> {
    let dev = Cpu::device(0);
    let t = Tensor::<Cpu>::full([4], 0.5, DType::F32, &dev)?;
    per_op("tensor_forward", || {
        let mut h = t.clone();
        for _ in 0..OPS {
            h = h.tanh()?;
        }
        Ok(())
    })?;
    let x = Var::param(t.clone());
    per_op("var_forward_no_grad", || {
        no_grad(|| {
            let mut h = x.clone();
            for _ in 0..OPS {
                h = h.tanh()?;
            }
            Ok(())
        })
    })?;
    per_op("var_forward_recording", || {
        let mut h = x.clone();
        for _ in 0..OPS {
            h = h.tanh()?;
        }
        Ok(())
    })?;
    per_op("var_forward_and_backward", || {
        let mut h = x.clone();
        for _ in 0..OPS {
            h = h.tanh()?;
        }
        h.sum_all()?.backward()?;
        x.zero_grad();
        Ok(())
    })?;
    Ok(())
}
