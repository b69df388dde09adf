//! Streams, events and pinned memory on a GPU (CuPy's `Stream`/`Event`, PyTorch's
//! `pin_memory` and `non_blocking`): the transfers lesson of the seeds, measured.
//!
//! 1. A 256 MB copy to the GPU from ordinary memory, and from pinned memory (asynchronous: the
//!    call returns at once, the copy is ordered before every later use).
//! 2. Reading a GPU tensor back into a fresh `Vec`, into a buffer the loop reuses, and into a
//!    pinned CPU tensor.
//! 3. Uploads from pinned memory overlapping matrix products (the copy stream at work), timed
//!    with events; and work on a user stream, ordered before the default stream's.
//!
//! ```sh
//! cargo run --release --example streams      # needs a GPU; says so and exits without one
//! ```

use std::time::Instant;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, Event, Stream, try_gpu, unavailable_reason};
use kiln_core::{DType, Generator, Result, Tensor};

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

    // 3. Copies overlap compute. Uploads from pinned memory run on the device's copy stream, so
    //    matrix products queued on the default stream and the uploads proceed side by side.
    let a = Generator::new(1).uniform::<Cuda>([4096, 4096], -1.0, 1.0, &dev)?;
    let batch = Tensor::<Cpu>::from_slice(&data[..16 << 20], [16 << 20], &cpu)?.pin_memory()?;
    let compute = || -> Result<()> {
        for _ in 0..10 {
            a.matmul(&a)?.realize()?;
        }
        Ok(())
    };
    let upload = || -> Result<()> {
        for _ in 0..20 {
            drop(batch.to_backend::<Cuda>(&dev)?);
        }
        Ok(())
    };
    compute()?; // warm-up: cuBLAS, memory cached
    upload()?;
    let (start, end) = (Event::timing(&dev)?, Event::timing(&dev)?);
    let timed = |f: &dyn Fn() -> Result<()>| -> Result<f32> {
        kiln_backend_cuda::synchronize(&dev)?;
        start.record()?;
        f()?;
        kiln_backend_cuda::synchronize(&dev)?; // every stream, the copy stream too
        end.record()?;
        start.elapsed_ms(&end)
    };
    let c = timed(&compute)?;
    let u = timed(&upload)?;
    let both = timed(&|| {
        compute()?;
        upload()
    })?;
    println!(
        "10 matmuls 4096^2: {c:.2} ms; 20 uploads of 64 MB pinned: {u:.2} ms; both at once: {both:.2} ms \
         (sum {:.2}: {:.0}% of the shorter one hidden)",
        c + u,
        100.0 * (c + u - both) / c.min(u)
    );

    // 4. A user stream: work in its scope runs there; the default stream waits for it.
    let s = Stream::new(&dev)?;
    let y = s.scope(|| {
        start.record()?;
        let y = a.matmul(&a)?;
        end.record()?;
        Ok::<_, kiln_core::Error>(y)
    })?;
    Stream::current(&dev)?.wait_stream(&s)?;
    println!(
        "one matmul on a user stream: {:.2} ms (sum of the result {:.1})",
        start.elapsed_ms(&end)?,
        y.sum_all()?.to_scalar()?
    );
    Ok(())
}
