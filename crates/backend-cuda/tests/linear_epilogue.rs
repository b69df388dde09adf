//! `Var::linear_act` through cuBLASLt's bias-and-activation epilogues (`blas_lt.rs`, opt-in:
//! `set_lt_epilogues(true)`) against the composed path (`linear`, then the activation) on the
//! same GPU: values and the gradients of x, w and b, in f32, f32 with TF32, bf16 and f16, for
//! identity, ReLU and tanh-GELU; shapes Lt takes (k and n multiples of 16 bytes) and shapes it
//! must decline (then the composed path runs, so the results still agree). One test: the
//! switches are process-wide.
//!
//! Without a GPU it prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_autograd::{Var, set_linear_epilogues};
use kiln_backend_cuda::{Cuda, gpu_or_skip, set_allow_tf32, set_lt_epilogues};
use kiln_core::{Activation, Backend, DType, Generator, RandDist, Tensor};

fn op(t: &Tensor<Cuda>) -> kiln_core::backend::Operand<'_, kiln_backend_cuda::CudaStorage> {
    (t.storage(), t.layout())
}

fn normal(
    dims: &[usize],
    seed: u64,
    dtype: DType,
    dev: &<Cuda as Backend>::Device,
) -> Tensor<Cuda> {
    let d = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    Generator::new(seed)
        .sample::<Cuda>(dims.to_vec(), d, DType::F32, dev)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap()
}

/// Output, dx, dw, db of `act(x wᵀ + b)` (x `[m, k]`, w `[n, k]`), as f64.
fn run(
    dev: &<Cuda as Backend>::Device,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    act: Activation,
    fused: bool,
) -> Vec<Vec<f64>> {
    set_linear_epilogues(fused);
    let x = Var::param(normal(&[m, k], 1, dtype, dev));
    let w = Var::param(normal(&[n, k], 2, dtype, dev).mul_scalar(0.2).unwrap());
    let b = Var::param(normal(&[n], 3, dtype, dev));
    let y = x.linear_act(&w, Some(&b), act).unwrap();
    let seed = Var::constant(normal(&[m, n], 4, dtype, dev));
    y.mul(&seed).unwrap().sum_all().unwrap().backward().unwrap();
    set_linear_epilogues(true);
    [
        y.tensor(),
        x.grad().unwrap(),
        w.grad().unwrap(),
        b.grad().unwrap(),
    ]
    .iter()
    .map(|t| t.to_f64_vec().unwrap())
    .collect()
}

#[test]
fn lt_epilogues_match_the_composed_path() {
    let Some(dev) = gpu_or_skip(0) else { return };
    set_lt_epilogues(true);
    let cases = [
        (DType::F32, false, 1e-4),
        (DType::F32, true, 2e-2),
        (DType::BF16, false, 6e-2),
        (DType::F16, false, 1e-2),
    ];
    let acts = [Activation::Identity, Activation::Relu, Activation::GeluTanh];
    // Taken by Lt (k, n multiples of 8 elements), and declined (k or n odd).
    let shapes = [(33, 64, 48), (7, 16, 8), (33, 30, 48), (5, 64, 7)];
    for (dtype, tf32, tol) in cases {
        set_allow_tf32(tf32);
        for act in acts {
            for shape in shapes {
                let got = run(&dev, dtype, shape, act, true);
                let want = run(&dev, dtype, shape, act, false);
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    let scale = w.iter().fold(1.0f64, |a, v| a.max(v.abs()));
                    for (i, (a, b)) in g.iter().zip(w).enumerate() {
                        assert!(
                            (a - b).abs() <= tol * scale,
                            "{dtype} tf32 {tf32} {act:?} {shape:?}: tensor {j} element {i}: \
                             lt {a} vs composed {b}"
                        );
                    }
                }
            }
        }
    }
    set_allow_tf32(false);
    // Lt really ran for an aligned shape, and declined an unaligned one.
    let (x, w, b) = (
        normal(&[33, 64], 1, DType::F32, &dev),
        normal(&[48, 64], 2, DType::F32, &dev),
        normal(&[48], 3, DType::F32, &dev),
    );
    let r = Cuda::linear_epilogue(
        op(&x),
        op(&w),
        Some((op(&b), DType::F32)),
        DType::F32,
        Activation::Relu,
        true,
    )
    .unwrap();
    assert!(
        r.is_some_and(|o| o.aux.is_some()),
        "aligned f32 ReLU: Lt offers it, with aux"
    );
    let w30 = normal(&[48, 30], 2, DType::F32, &dev);
    let x30 = normal(&[33, 30], 1, DType::F32, &dev);
    let r = Cuda::linear_epilogue(
        op(&x30),
        op(&w30),
        Some((op(&b), DType::F32)),
        DType::F32,
        Activation::Relu,
        false,
    )
    .unwrap();
    assert!(r.is_none(), "k = 30 f32 is not 16-byte aligned: declined");
    set_lt_epilogues(false);
    println!("linear_epilogue: Lt == composed for f32/tf32/bf16/f16 x identity/relu/gelu_tanh");
}
