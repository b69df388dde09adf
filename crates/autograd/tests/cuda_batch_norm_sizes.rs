//! Batch norm on CUDA at the sizes that pick each way its generated kernels address
//! `[n, c, h, w]`, against the CPU: the statistics over `(n, h, w)` split across blocks with
//! rows of `h·w` loaded in groups of 4 (`[80, 4, 32, 32]`; `[256, 64, 16, 16]`, split only to
//! fill the device), one block per channel with groups of 4 (`[64, 32, 16, 16]`,
//! `[16, 8, 4, 4]`), element by element (`h·w` of 25; a view whose rows are not aligned to 4);
//! and the per-channel scale of the normalization and of `dx` read once per vector. Forward
//! (`y`, mean, variance) and backward (`dx`, `dw`, `db`), in f32 and bf16.
//!
//! Without a GPU the test prints `skipped: no CUDA device 0 (<reason>)` and returns.

mod common;

use common::{assert_close, f64s, normal};
use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType, Tensor};

const EPS: f64 = 1e-5;

/// `y`, mean, biased variance, `dx`, `dw`, `db` of batch norm over `x` with weight and bias
/// and the output gradient `g`, all as f64.
fn run<B: Backend>(x: &Tensor<B>, w: &Tensor<B>, b: &Tensor<B>, g: &Tensor<B>) -> Vec<Vec<f64>> {
    let (xv, wv, bv) = (
        Var::leaf(x.clone()),
        Var::param(w.clone()),
        Var::param(b.clone()),
    );
    let (y, stats) = xv.batch_norm_train(Some(&wv), Some(&bv), EPS).unwrap();
    y.backward_with(g).unwrap();
    let grad = |v: &Var<B>| f64s(&v.grad().expect("a gradient"));
    vec![
        f64s(&y.tensor()),
        f64s(&stats.mean),
        f64s(&stats.var),
        grad(&xv),
        grad(&wv),
        grad(&bv),
    ]
}

/// `x` of `dims` on the host, and the tensor it is a view of: with `view`, one wider along
/// the last axis and narrowed by one, so that its rows start one element off alignment.
fn input(dims: &[usize], view: bool, dtype: DType) -> (Tensor<Cpu>, Tensor<Cpu>) {
    let mut full = dims.to_vec();
    full[3] += usize::from(view);
    let full = normal::<Cpu>(&full, 1, DType::F32, &Default::default())
        .to_dtype(dtype)
        .unwrap();
    let x = full.narrow(-1, usize::from(view), dims[3]).unwrap();
    (x, full)
}

#[test]
fn batch_norm_matches_the_cpu_at_every_kernel_size() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cases: &[(&[usize], bool)] = &[
        (&[80, 4, 32, 32], false),
        (&[256, 64, 16, 16], false),
        (&[64, 32, 16, 16], false),
        (&[16, 8, 4, 4], false),
        (&[8, 6, 5, 5], false),
        (&[8, 4, 8, 8], true),
    ];
    for dtype in [DType::F32, DType::BF16] {
        // f32: sums of up to 80K values in another order; bf16: one rounding of y and dx.
        let tol = if dtype == DType::F32 { 2e-4 } else { 2e-2 };
        for &(dims, view) in cases {
            let (x, full) = input(dims, view, dtype);
            let c = dims[1];
            let w = normal::<Cpu>(&[c], 3, DType::F32, &Default::default());
            let b = normal::<Cpu>(&[c], 4, DType::F32, &Default::default());
            let g = normal::<Cpu>(dims, 2, DType::F32, &Default::default())
                .to_dtype(dtype)
                .unwrap();
            let want = run(&x, &w, &b, &g);
            let to = |t: &Tensor<Cpu>| t.to_backend::<Cuda>(&dev).unwrap();
            // The view stays a view on the GPU: the wider tensor copied, then narrowed there.
            let xg = to(&full).narrow(-1, usize::from(view), dims[3]).unwrap();
            let got = run(&xg, &to(&w), &to(&b), &to(&g));
            for (k, name) in ["y", "mean", "var", "dx", "dw", "db"].iter().enumerate() {
                let what = format!("{name} of {dtype} {dims:?} (view {view})");
                assert_close(&what, &got[k], &want[k], tol);
            }
        }
    }
}
