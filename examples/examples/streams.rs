//! Streams, events and pinned memory on a GPU (CuPy's `Stream`/`Event`, PyTorch's
//! `pin_memory` and `non_blocking`): the transfers lesson of the seeds, measured.
//!
//! 1. A 256 MB copy to the GPU from ordinary memory, and from pinned memory (asynchronous: the
//!    call returns at once, the copy is ordered before every later use).
//! 2. Reading a GPU tensor back into a fresh `Vec`, into a buffer the loop reuses, and into a
//!    pinned CPU tensor.
//! 3. Two independent matrix products on two streams, timed with events, against the same
//!    work on one stream.
//!
//! ```sh
//! cargo run --release --example streams      # needs a GPU; says so and exits without one
//! ```

use std::time::Instant;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, Event, Stream, try_gpu, unavailable_reason};
use kiln_core::{DType, Result, Tensor};

fn main() -> Result<()> {
    let Some(dev) = try_gpu(0) else {
        println!(
            "streams: no GPU here ({}); this example needs one",
            unavailable_reason().unwrap_or_default()
        );
        return Ok(());
    };
    let cpu = Cpu::device(0);
    println!("{} ({dev})", dev.name()?);

    // 1. Host to device.
    let n = 64 << 20; // 256 MB of f32
    let data: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let gbs = |s: f64| (n * 4) as f64 / s / 1e9;
    let t = Instant::now();
    let g = Tensor::<Cuda>::from_slice(&data, [n], &dev)?;
    kiln_backend_cuda::synchronize(&dev)?;
    println!(
        "from_slice (ordinary memory):  {:6.1} GB/s",
        gbs(t.elapsed().as_secs_f64())
    );

    let pinned = Tensor::<Cpu>::from_slice(&data, [n], &cpu)?.pin_memory()?;
    let t = Instant::now();
    let g2 = pinned.to_backend::<Cuda>(&dev)?; // returns before the copy is done
    let call = t.elapsed().as_secs_f64();
    kiln_backend_cuda::synchronize(&dev)?;
    println!(
        "to_backend (pinned memory):    {:6.1} GB/s (the call itself took {:.3} ms)",
        gbs(t.elapsed().as_secs_f64()),
        call * 1e3
    );
    drop((g2, pinned)); // the copy keeps its source alive on its own

    // 2. Device to host.
    let t = Instant::now();
    let v = g.to_vec::<f32>()?;
    println!(
        "to_vec (fresh Vec):            {:6.1} GB/s",
        gbs(t.elapsed().as_secs_f64())
    );
    let mut buf = v; // reuse that memory
    let t = Instant::now();
    g.copy_to_slice(&mut buf)?;
    println!(
        "copy_to_slice (reused buffer): {:6.1} GB/s",
        gbs(t.elapsed().as_secs_f64())
    );
    let mut host = Tensor::<Cpu>::zeros([n], DType::F32, &cpu)?.pin_memory()?;
    let t = Instant::now();
    host.copy_from(&g)?;
    println!(
        "copy_from into pinned:         {:6.1} GB/s",
        gbs(t.elapsed().as_secs_f64())
    );
    assert!(buf == data && host.to_vec::<f32>()? == data);

    // 3. Two streams. Each product is small enough to leave SMs idle, so two can share the GPU.
    let a = Tensor::<Cuda>::rand([512, 512], -1.0, 1.0, 1, DType::F32, &dev)?;
    let b = Tensor::<Cuda>::rand([512, 512], -1.0, 1.0, 2, DType::F32, &dev)?;
    let (s1, s2) = (Stream::new(&dev)?, Stream::new(&dev)?);
    let work = |x: &Tensor<Cuda>| -> Result<()> {
        let mut y = x.clone();
        for _ in 0..200 {
            y = y.matmul(x)?.tanh()?;
        }
        y.realize()
    };
    work(&a)?; // warm-up: kernels compiled, memory cached
    let (start, end) = (Event::timing(&dev)?, Event::timing(&dev)?);
    start.record()?;
    work(&a)?;
    work(&b)?;
    end.record()?;
    let one = start.elapsed_ms(&end)?;
    let default = Stream::current(&dev)?;
    start.record()?;
    s1.wait_stream(&default)?;
    s2.wait_stream(&default)?;
    s1.scope(|| work(&a))?;
    s2.scope(|| work(&b))?;
    default.wait_stream(&s1)?;
    default.wait_stream(&s2)?;
    end.record()?;
    let two = start.elapsed_ms(&end)?;
    println!(
        "two chains of 200 (512x512 matmul + tanh): one stream {one:.2} ms, two streams {two:.2} ms ({:.2}x)",
        one / two
    );
    Ok(())
}
