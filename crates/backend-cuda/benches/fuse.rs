//! GPU benchmarks of user-defined fused work and user kernels (issue 13), timed with CUDA
//! events like `benches/gpu.rs`; `bench/gpu_torch.py` and `bench/gpu_cupy.py` run the twins.
//!
//! - `copy_64M`: a plain device-to-device copy of 64M f32 (the bandwidth ceiling, 8 B/element).
//! - `fuse5_64M`: a user-defined five-op chain `(x*y + 0.5).sigmoid() * x - y` over 64M f32 as
//!   one expression program (`kiln_core::expr::Program` → one generated kernel): 12 B/element;
//!   `fuse5_64M_of_copy` is its bandwidth as a fraction of `copy_64M` in the same run.
//! - `user_exp_230400_x1000`: an `ElementwiseKernel` exp over 230,400 f32, 1000 launches (the
//!   output allocated by each call, as CuPy's), beside CuPy's `ElementwiseKernel`.
//! - `lse_8192x8192`: a user-written row-wise log-sum-exp over 8192×8192 f32 as two fused
//!   programs (row max; then `log(sum(exp(x - m))) + m` reading `m` broadcast), beside
//!   PyTorch's `torch.logsumexp` and its manual max/exp/sum/log (`lse_8192x8192_manual`).
//! - `norm_64M`: a user-written L2 norm `sqrt(sum(x * x))` of 64M f32 as one program (a
//!   full reduction, split over many blocks), beside `torch.linalg.vector_norm`; `user_norm_64M`:
//!   the same as a CuPy-style `ReductionKernel` accumulating in double.
//!
//! Without a GPU it prints `skipped: no CUDA device (...)` and exits 0.

mod common;
use common::{report, time};

use std::time::Instant;

use kiln_backend_cuda::{Cuda, ElementwiseKernel, ReductionKernel, try_gpu, unavailable_reason};
use kiln_core::expr::{Expr, Program};
use kiln_core::{Backend, DType, Generator, Result};

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test` runs benches as tests: nothing to do
    }
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return;
    };
    println!("kiln device: {}", dev.name().unwrap());
    let f32t = |shape: &[usize], seed| {
        Generator::new(seed)
            .uniform::<Cuda>(shape, -1.0, 1.0, &dev)
            .unwrap()
    };

    // Copy bandwidth, then the fused five-op chain, in the same run.
    let n = 64 << 20;
    let (x, y) = (f32t(&[n], 1), f32t(&[n], 2));
    let ms = time(&dev, 5, 10, || x.copy_to(&dev).map(drop));
    let copy = 8.0 * n as f64 / (ms * 1e-3) / 1e9;
    report("copy_64M", copy, "GB/s");
    let (ex, ey) = (Expr::input(0), Expr::input(1));
    let chain = ((&ex * &ey + 0.5).sigmoid() * &ex) - &ey;
    let p5 = Program::from_exprs(&[DType::F32, DType::F32], &[chain]).unwrap();
    let ms = time(&dev, 5, 10, || p5.run(&[&x, &y], &[]).map(drop));
    let fuse5 = 12.0 * n as f64 / (ms * 1e-3) / 1e9;
    report("fuse5_64M", fuse5, "GB/s");
    report("fuse5_64M_of_copy", fuse5 / copy, "frac");
    drop(y);

    // A full reduction: the L2 norm of the same 64M f32.
    let pn = Program::from_exprs(&[DType::F32], &[(&ex * &ex).sum(&[0]).sqrt()]).unwrap();
    let ms = time(&dev, 5, 10, || pn.run(&[&x], &[]).map(drop));
    report("norm_64M", ms, "ms");
    // The same as CuPy's L2-norm ReductionKernel (accumulating in double).
    let l2 = ReductionKernel::new("T x", "T y", "x * x", "a + b", "y = sqrt(a)", "0", "l2")
        .unwrap()
        .with_reduce_type("float64")
        .unwrap();
    let ms = time(&dev, 5, 10, || {
        l2.call(&[(&x).into()], None, false).map(drop)
    });
    report("user_norm_64M", ms, "ms");
    drop(x);

    // ElementwiseKernel exp, 1000 launches.
    let kexp = ElementwiseKernel::new("T x", "T y", "y = exp(x)", "kexp").unwrap();
    let x = f32t(&[230_400], 3);
    let ms = time(&dev, 5, 1000, || kexp.call1(&[(&x).into()]).map(drop));
    report("user_exp_230400_x1000", ms * 1000.0, "ms");
    let t0 = Instant::now();
    for _ in 0..1000 {
        drop(kexp.call1(&[(&x).into()]).unwrap());
    }
    Cuda::synchronize(&dev).unwrap();
    report(
        "user_exp_230400_x1000_wall",
        t0.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    drop(x);

    // Row-wise log-sum-exp over 8192 x 8192: the row max, then one fused pass.
    let s = f32t(&[8192, 8192], 4);
    let xm = Expr::input(0);
    let pmax = Program::from_exprs(&[DType::F32], &[xm.max(&[-1])]).unwrap();
    let (xl, m) = (Expr::input(0), Expr::input(1));
    let lse = (&xl - &m).exp().sum(&[-1]).log() + &m;
    let plse = Program::from_exprs(&[DType::F32, DType::F32], &[lse]).unwrap();
    let run = || -> Result<()> {
        let m = pmax.run(&[&s], &[])?.remove(0); // [8192, 1]
        plse.run(&[&s, &m], &[]).map(drop)
    };
    // a correctness spot check against the op-by-op formula on the same GPU
    {
        let m = pmax.run(&[&s], &[]).unwrap().remove(0);
        let got = plse.run(&[&s, &m], &[]).unwrap().remove(0);
        let want = s
            .sub(&m)
            .unwrap()
            .exp()
            .unwrap()
            .sum(&[-1], true)
            .unwrap()
            .log()
            .unwrap()
            .add(&m)
            .unwrap();
        let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
        let err = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("kiln lse max |fused - op by op| = {err:.2e}");
    }
    let ms = time(&dev, 5, 5, run);
    report("lse_8192x8192", ms, "ms");
    report("lse_8192x8192_manual", ms, "ms");
}
