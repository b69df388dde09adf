//! The CUDA backend's fused layer norm and RMS norm (`kernels/norm.cu`) against the composed
//! path: the output and the gradients of the input, the weight and the bias, for rows 1, 7 and
//! 16,384, row lengths 1, 3, 64, 384, 1000, 4096 and 8192 (off the vector width too), with and
//! without weight and bias, in f32 (tight: the reference is the composed path on the CPU in
//! f64) and bf16/f16 (loose: the same f64 reference on the same rounded inputs). The inputs
//! have a mean of 3 (a tenth of their spread is far outside the tolerances, so a wrong mean or
//! a wrong variance fails). Also: the fused path is taken (one launch forward, three backward),
//! a residual connection's gradient is added inside the dx kernel (no launch of its own), it
//! equals the GPU's own composed path in f32, a transposed input and several normalized
//! axes work, `check_backward` passes in f32, and what is not offered (f64, rows over 8192)
//! still runs composed. `cargo xtask test-gpu` carries this binary to the GPU.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

mod common;

use common::{assert_close, f64s, normal_with};
use kiln_autograd::{CheckOptions, Var, check_backward, composed_norm};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, gpu_or_skip, thread_launches};
use kiln_core::{Backend, DType, Tensor};

const EPS: f64 = 1e-5;

/// Which affine parameters a case has.
#[derive(Clone, Copy, Debug)]
enum Affine {
    None,
    Weight,
    WeightBias,
}

/// One case's inputs: `x`, `g` of the input's shape, and the parameters of the normalized
/// shape.
struct Case<B: Backend> {
    x: Tensor<B>,
    g: Tensor<B>,
    w: Option<Tensor<B>>,
    b: Option<Tensor<B>>,
    normalized: Vec<usize>,
}

impl<B: Backend> Case<B> {
    /// The output and the gradients `[y, dx, dw?, db?]` (what exists) as f64 vectors.
    fn run(&self, centered: bool) -> Vec<(&'static str, Vec<f64>)> {
        let x = Var::param(self.x.clone());
        let w = self.w.clone().map(Var::param);
        let b = self.b.clone().map(Var::param);
        let y = if centered {
            x.layer_norm(&self.normalized, w.as_ref(), b.as_ref(), EPS)
        } else {
            x.rms_norm(&self.normalized, w.as_ref(), EPS)
        }
        .unwrap();
        y.backward_with(&self.g).unwrap();
        let grad = |v: &Var<B>| f64s(&v.grad().expect("a gradient"));
        let mut out = vec![("y", f64s(&y.tensor())), ("dx", grad(&x))];
        if let Some(w) = &w {
            out.push(("dw", grad(w)));
        }
        if let Some(b) = &b {
            out.push(("db", grad(b)));
        }
        out
    }
}

/// The same values as an f64 CPU tensor.
fn on_cpu(t: &Tensor<Cuda>) -> Tensor<Cpu> {
    Tensor::<Cpu>::from_vec(f64s(t), t.dims().to_vec(), &Cpu::device(0)).unwrap()
}

/// A case on the GPU in `dtype` (x with mean 3), and the same rounded values on the CPU in f64.
fn case(
    dev: &CudaDevice,
    dims: &[usize],
    k: usize,
    affine: Affine,
    dtype: DType,
) -> (Case<Cuda>, Case<Cpu>) {
    let seed = dims.iter().product::<usize>() as u64 + k as u64;
    let normalized = dims[dims.len() - k..].to_vec();
    let x = normal_with::<Cuda>(dims, seed, (3.0, 2.0), dtype, dev);
    let g = normal_with::<Cuda>(dims, seed + 1, (0.0, 1.0), dtype, dev);
    let w = matches!(affine, Affine::Weight | Affine::WeightBias)
        .then(|| normal_with::<Cuda>(&normalized, seed + 2, (1.0, 0.5), dtype, dev));
    let b = matches!(affine, Affine::WeightBias)
        .then(|| normal_with::<Cuda>(&normalized, seed + 3, (0.0, 1.0), dtype, dev));
    let cpu = Case {
        x: on_cpu(&x),
        g: on_cpu(&g),
        w: w.as_ref().map(on_cpu),
        b: b.as_ref().map(on_cpu),
        normalized: normalized.clone(),
    };
    let gpu = Case {
        x,
        g,
        w,
        b,
        normalized,
    };
    (gpu, cpu)
}

/// Fused on the GPU in `dtype` against the composed path on the CPU in f64, layer norm with
/// each affine variant and RMS norm with and without a weight.
fn against_cpu(dev: &CudaDevice, dims: &[usize], k: usize, dtype: DType, tol: f64) {
    let variants = [
        (true, Affine::None),
        (true, Affine::Weight),
        (true, Affine::WeightBias),
        (false, Affine::None),
        (false, Affine::Weight),
    ];
    for (centered, affine) in variants {
        let (gpu, cpu) = case(dev, dims, k, affine, dtype);
        let (got, want) = (gpu.run(centered), cpu.run(centered));
        for ((name, got), (_, want)) in got.iter().zip(&want) {
            assert_close(
                &format!("{dtype} {dims:?} k {k} centered {centered} {affine:?}: {name}"),
                got,
                want,
                tol,
            );
        }
    }
}

/// (shape, normalized axes): rows 1, 7 and 16,384; lengths on and off the vector width, and
/// on either side of the warp-per-row kernels' limit (512 f32, 1024 16-bit elements).
const SHAPES: [(&[usize], usize); 19] = [
    (&[7, 512], 1),
    (&[7, 520], 1),
    (&[5, 1024], 1),
    (&[5, 1032], 1),
    (&[3001, 40], 1),
    (&[1, 1], 1),
    (&[1, 3], 1),
    (&[7, 1], 1),
    (&[7, 3], 1),
    (&[7, 64], 1),
    (&[7, 384], 1),
    (&[7, 1000], 1),
    (&[7, 4096], 1),
    (&[1, 4096], 1),
    (&[7, 1002], 1),
    (&[3, 8192], 1),
    (&[64, 256, 384], 1),
    (&[16384, 3], 1),
    (&[2, 7, 5, 64], 2),
];

#[test]
fn fused_f32_matches_composed_f64_on_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dims, k) in SHAPES {
        let n: usize = dims[dims.len() - k..].iter().product();
        // Rows of a few elements: among 16,384 rows of three, some have a tiny variance whose
        // large rstd amplifies f32 rounding in dx (2.2e-4 relative on an H100, the composed
        // f32 path alike); a wrong mean or formula is off by far more.
        let tol = if n < 8 { 1e-3 } else { 1e-4 };
        against_cpu(&dev, dims, k, DType::F32, tol);
    }
}

#[test]
fn fused_bf16_and_f16_match_within_their_precision() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dims, k) in SHAPES {
        against_cpu(&dev, dims, k, DType::BF16, 2e-2);
        against_cpu(&dev, dims, k, DType::F16, 4e-3);
    }
}

/// One kernel forward; backward two for short rows (dx with the column partials, their sum)
/// and three for long ones (dx, the partials, their sum); the statistics do not leave the
/// kernels as extra launches.
#[test]
fn fused_path_is_taken() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dtype, cols, backward) in [
        (DType::F32, 384, 2),
        (DType::BF16, 384, 2),
        (DType::F16, 384, 2),
        (DType::F32, 1000, 3),
        (DType::BF16, 2000, 3),
    ] {
        let (gpu, _) = case(&dev, &[16, cols], 1, Affine::WeightBias, dtype);
        for t in [
            &gpu.x,
            &gpu.g,
            gpu.w.as_ref().unwrap(),
            gpu.b.as_ref().unwrap(),
        ] {
            t.realize().unwrap();
        }
        let x = Var::param(gpu.x.clone());
        let (w, b) = (
            Var::param(gpu.w.clone().unwrap()),
            Var::param(gpu.b.clone().unwrap()),
        );
        let before = thread_launches();
        let y = x.layer_norm(&[cols], Some(&w), Some(&b), EPS).unwrap();
        y.tensor().realize().unwrap();
        assert_eq!(thread_launches() - before, 1, "{dtype} layer_norm forward");
        let before = thread_launches();
        let grads = y.backward_with(&gpu.g);
        grads.unwrap();
        for v in [&x, &w, &b] {
            v.grad().unwrap().realize().unwrap();
        }
        assert_eq!(
            thread_launches() - before,
            backward,
            "{dtype} {cols} layer_norm backward"
        );
    }
}

/// A residual connection `y = h + layer_norm(h)` with `h` an op output: the add's gradient for
/// `h` rides into the norm's dx kernel (the engine's fold), so the backward takes the norm's
/// launches plus one for `h`'s own backward (`2 g'`), no separate add; and the gradients agree
/// with the composed path on the CPU in f64. Short rows (the warp kernel) and long ones (the
/// block kernel), f32 and bf16.
#[test]
fn residual_gradient_folds_into_dx() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dtype, cols, norm_launches, tol) in [
        (DType::F32, 384, 2, 1e-4),
        (DType::BF16, 384, 2, 3e-2),
        (DType::F32, 1000, 3, 1e-4),
        (DType::BF16, 2000, 3, 3e-2),
    ] {
        let (gpu, cpu) = case(&dev, &[16, cols], 1, Affine::WeightBias, dtype);
        let (got, launches) = residual_grads(&gpu, thread_launches);
        assert_eq!(
            launches,
            norm_launches + 1,
            "{dtype} {cols}: the residual backward's launches"
        );
        let (want, _) = {
            let _c = composed_norm();
            residual_grads(&cpu, || 0)
        };
        for (name, (g, w)) in ["dp", "dw", "db"].iter().zip(got.iter().zip(&want)) {
            assert_close(&format!("{dtype} {cols}: {name}"), g, w, tol);
        }
    }
}

/// The gradients of `p`, `w`, `b` for `y = h + layer_norm(h, w, b)`, `h = 2 p`, with `p =
/// c.x` and the cotangent `c.g`, and how far `launches` moved from the backward's start to the
/// gradients' realization.
fn residual_grads<B: Backend>(c: &Case<B>, launches: fn() -> u64) -> ([Vec<f64>; 3], u64) {
    let p = Var::param(c.x.clone());
    let w = Var::param(c.w.clone().unwrap());
    let b = Var::param(c.b.clone().unwrap());
    let h = p.mul_scalar(2.0).unwrap();
    let normed = h.layer_norm(&c.normalized, Some(&w), Some(&b), EPS);
    let y = h.add(&normed.unwrap()).unwrap();
    y.tensor().realize().unwrap();
    c.g.realize().unwrap();
    let before = launches();
    y.backward_with(&c.g).unwrap();
    let grads = [&p, &w, &b].map(|v| v.grad().unwrap());
    for t in &grads {
        t.realize().unwrap();
    }
    let moved = launches() - before;
    (grads.map(|t| f64s(&t)), moved)
}

/// The fused kernels equal the GPU's own composed programs in f32.
#[test]
fn fused_equals_the_gpu_composed_path_in_f32() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dims, k) in [(&[64usize, 384][..], 1), (&[7, 1000], 1), (&[5, 3, 64], 2)] {
        for (centered, affine) in [(true, Affine::WeightBias), (false, Affine::Weight)] {
            let (gpu, _) = case(&dev, dims, k, affine, DType::F32);
            let fused = gpu.run(centered);
            let composed = {
                let _c = composed_norm();
                gpu.run(centered)
            };
            for ((name, f), (_, c)) in fused.iter().zip(&composed) {
                assert_close(&format!("{dims:?} {centered}: {name}"), f, c, 1e-4);
            }
        }
    }
}

/// A transposed (not contiguous) input is normalized as its values say.
#[test]
fn transposed_input() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let xt = normal_with::<Cuda>(&[384, 33], 5, (3.0, 2.0), DType::F32, &dev);
    let x = xt.transpose(0, 1).unwrap();
    assert!(!x.is_contiguous());
    let g = normal_with::<Cuda>(&[33, 384], 6, (0.0, 1.0), DType::F32, &dev);
    let w = normal_with::<Cuda>(&[384], 7, (1.0, 0.5), DType::F32, &dev);
    let gpu = Case {
        x: x.clone(),
        g: g.clone(),
        w: Some(w.clone()),
        b: None,
        normalized: vec![384],
    };
    let cpu = Case {
        x: on_cpu(&x.contiguous().unwrap()),
        g: on_cpu(&g),
        w: Some(on_cpu(&w)),
        b: None,
        normalized: vec![384],
    };
    for centered in [true, false] {
        for ((name, got), (_, want)) in gpu.run(centered).iter().zip(&cpu.run(centered)) {
            assert_close(&format!("transposed {centered}: {name}"), got, want, 1e-4);
        }
    }
}

/// Chainer's numerical gradient check through the fused kernels, in f32.
#[test]
fn fused_passes_check_backward_in_f32() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let inputs = [
        normal_with::<Cuda>(&[5, 40], 21, (1.0, 1.0), DType::F32, &dev),
        normal_with::<Cuda>(&[40], 22, (1.0, 0.5), DType::F32, &dev),
        normal_with::<Cuda>(&[40], 23, (0.0, 1.0), DType::F32, &dev),
    ];
    let opts = CheckOptions::f32().with_tolerances(5e-3, 5e-2);
    check_backward(
        |x| x[0].layer_norm(&[40], Some(&x[1]), Some(&x[2]), EPS),
        &inputs,
        &opts,
    )
    .unwrap();
    check_backward(
        |x| x[0].rms_norm(&[40], Some(&x[1]), EPS),
        &inputs[..2],
        &opts,
    )
    .unwrap();
}

/// What the kernels do not take runs composed and still agrees with the CPU: f64, rows over
/// 8192 elements.
#[test]
fn cases_not_offered_run_composed() {
    let Some(dev) = gpu_or_skip(0) else { return };
    against_cpu(&dev, &[7, 384], 1, DType::F64, 1e-10);
    against_cpu(&dev, &[3, 8193], 1, DType::F32, 1e-4);
}
