//! The CUDA backend's fused attention (flash-style forward, recomputing backward) against the
//! composed path: output and the gradients of q, k and v, for shapes whose sequence lengths are
//! not multiples of the kernels' tile of 32, `Tq != Tk`, head sizes 32/64/80/128 (and
//! `dv != d`), causal or not, several batch entries and heads, in f32 (tight: the reference is
//! the composed path on the CPU in f64) and f16/bf16 (loose: the reference is the f64 composed
//! path on the same rounded inputs). Also: the fused path is taken (one kernel launch), it
//! equals the GPU's own composed path, with dropout too (the same mask from the same generator), head views of a packed projection are read in place,
//! `check_backward` passes in f32, and what is not offered (f64, masks other than causal, heads
//! over 128) still runs composed. `cargo xtask test-gpu` carries this binary to the GPU.
//!
//! On sm_80+ f32 runs the TF32 tensor-core kernels (3xTF32 by default, 1xTF32 under
//! `set_allow_tf32(true)`): the f32 tests above check them, and the `f32_tensor_core_*` tests
//! check them against the f64 composed path at their own precision and against the FMA kernels.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

mod common;

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use common::{assert_close, f64s};
use kiln_autograd::{AttnMask, CheckOptions, Var, check_backward, composed_attention};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, CudaStorage, gpu_or_skip, thread_launches};
use kiln_core::{AttentionSpec, AttnMaskOperand, Backend, DType, Generator, Layout, Tensor};

/// Standard normal values drawn from `seed`.
fn normal<B: Backend>(dims: &[usize], seed: u64, dtype: DType, dev: &B::Device) -> Tensor<B> {
    common::normal_with(dims, seed, (0.0, 1.0), dtype, dev)
}

/// A problem: batch, heads, Tq, Tk, d, dv.
type Dims6 = (usize, usize, usize, usize, usize, usize);

/// Attention and the gradients of q, k, v for the output gradient `g`, as f64 vectors:
/// `[out, dq, dk, dv]`.
fn run<B: Backend>(
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    g: &Tensor<B>,
    causal: bool,
) -> [Vec<f64>; 4] {
    run_dropout(q, k, v, g, causal, None)
}

/// [`run`] with dropout `(p, generator)`.
fn run_dropout<B: Backend>(
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    g: &Tensor<B>,
    causal: bool,
    dropout: Option<(f64, &mut Generator)>,
) -> [Vec<f64>; 4] {
    let mask = if causal {
        AttnMask::Causal
    } else {
        AttnMask::None
    };
    run_masked(q, k, v, g, &mask, dropout)
}

/// [`run_dropout`] with any mask.
fn run_masked<B: Backend>(
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    g: &Tensor<B>,
    mask: &AttnMask<B>,
    dropout: Option<(f64, &mut Generator)>,
) -> [Vec<f64>; 4] {
    let (p, generator) = match dropout {
        Some((p, rng)) => (p, Some(rng)),
        None => (0.0, None),
    };
    let (qv, kv, vv) = (
        Var::param(q.clone()),
        Var::param(k.clone()),
        Var::param(v.clone()),
    );
    let y = qv
        .scaled_dot_product_attention(&kv, &vv, mask, p, None, generator)
        .unwrap();
    y.backward_with(g).unwrap();
    let grad = |x: &Var<B>| f64s(&x.grad().expect("a gradient"));
    [f64s(&y.tensor()), grad(&qv), grad(&kv), grad(&vv)]
}

/// The output and the gradients of `q`, `k`, `v` (for the output gradient `g`) under `mask`
/// on the GPU, checked within `tol` against the composed path in f64 on the CPU from the same
/// (rounded) inputs under `on_host`, the same mask there; returns the GPU's, as [`run`].
fn masked_against_cpu(
    what: &str,
    [q, k, v, g]: [&Tensor<Cuda>; 4],
    (mask, on_host): (&AttnMask<Cuda>, &AttnMask<Cpu>),
    tol: f64,
) -> [Vec<f64>; 4] {
    let got = run_masked(q, k, v, g, mask, None);
    let want = composed_on_cpu([q, k, v, g], on_host);
    for (name, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        assert_close(&format!("{what}: {name}"), got, want, tol);
    }
    got
}

/// [`run_masked`] on the CPU in f64 from the same (rounded) values of `q`, `k`, `v`, `g`,
/// under `on_host`: the composed path's reference.
fn composed_on_cpu([q, k, v, g]: [&Tensor<Cuda>; 4], on_host: &AttnMask<Cpu>) -> [Vec<f64>; 4] {
    run_masked(
        &on_cpu(q),
        &on_cpu(k),
        &on_cpu(v),
        &on_cpu(g),
        on_host,
        None,
    )
}

/// The same values as an f64 CPU tensor.
fn on_cpu(t: &Tensor<Cuda>) -> Tensor<Cpu> {
    Tensor::<Cpu>::from_vec(f64s(t), t.dims().to_vec(), &Cpu::device(0)).unwrap()
}

/// Fused on the GPU in `dtype` against the composed path on the CPU in f64 from the same
/// (rounded) inputs.
fn against_cpu(dev: &CudaDevice, dtype: DType, dims: Dims6, causal: bool, tol: f64) {
    let (b, h, tq, tk, d, dv) = dims;
    let seed = (tq * 7 + tk * 3 + d) as u64;
    let q = normal::<Cuda>(&[b, h, tq, d], seed, dtype, dev);
    let k = normal::<Cuda>(&[b, h, tk, d], seed + 1, dtype, dev);
    let v = normal::<Cuda>(&[b, h, tk, dv], seed + 2, dtype, dev);
    let g = normal::<Cuda>(&[b, h, tq, dv], seed + 3, dtype, dev);
    let got = run(&q, &k, &v, &g, causal);
    let want = run(&on_cpu(&q), &on_cpu(&k), &on_cpu(&v), &on_cpu(&g), causal);
    for (name, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        assert_close(
            &format!("{dtype} {dims:?} causal {causal}: {name}"),
            got,
            want,
            tol,
        );
    }
}

/// Sequence lengths off the tile of 32, Tq != Tk both ways, head sizes 32/64/80/128, dv != d.
const SHAPES: [Dims6; 7] = [
    (2, 3, 37, 37, 64, 64),
    (1, 2, 70, 45, 32, 32),
    (2, 1, 45, 70, 80, 80),
    (1, 2, 100, 100, 128, 128),
    (2, 2, 33, 33, 64, 48),
    (1, 1, 1, 5, 64, 64),
    (3, 2, 64, 64, 64, 64),
];

#[test]
fn fused_f32_matches_composed_f64_on_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    for dims in SHAPES {
        for causal in [false, true] {
            against_cpu(&dev, DType::F32, dims, causal, 1e-4);
        }
    }
}

/// Serializes the tests that flip the process-wide switches (`set_fused_attention_16bit`,
/// `set_attention_tensor_cores`, `set_attention_tensor_cores_f32`, `set_allow_tf32`; they hold
/// it for writing) against each other and against the f32 tests whose tolerance assumes the
/// defaults (they hold it for reading): tests run on parallel threads.
static SWITCHES: RwLock<()> = RwLock::new(());

/// Holds [`SWITCHES`] for reading: the switches stay at their defaults meanwhile.
fn defaults() -> RwLockReadGuard<'static, ()> {
    SWITCHES.read().unwrap_or_else(|e| e.into_inner())
}

/// Holds [`SWITCHES`] with fused 16-bit attention on (tensor cores where the device has them)
/// and, when dropped, turns it off (the other tests ask for what they compare) and tensor
/// cores back on.
struct Fused16(#[allow(dead_code)] RwLockWriteGuard<'static, ()>);

impl Fused16 {
    fn on() -> Self {
        let guard = SWITCHES.write().unwrap_or_else(|e| e.into_inner());
        kiln_backend_cuda::set_fused_attention_16bit(true);
        kiln_backend_cuda::set_attention_tensor_cores(true);
        // kiln's own kernels: cuDNN's engines have tests of their own (below).
        kiln_backend_cuda::set_cudnn_attention(Some(false));
        Fused16(guard)
    }
}

impl Drop for Fused16 {
    fn drop(&mut self) {
        kiln_backend_cuda::set_fused_attention_16bit(false);
        kiln_backend_cuda::set_attention_tensor_cores(true);
        kiln_backend_cuda::set_cudnn_attention(None);
    }
}

#[test]
fn fused_bf16_and_f16_match_within_their_precision() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _on = Fused16::on();
    // Ask for the fused kernels explicitly (by default they run only where the tensor-core
    // family does), and check they were taken.
    let q = Var::constant(normal::<Cuda>(&[1, 1, 40, 64], 1, DType::BF16, &dev));
    q.tensor().realize().unwrap();
    let before = thread_launches();
    let y = q.scaled_dot_product_attention(&q, &q, &AttnMask::Causal, 0.0, None, None);
    assert_eq!(thread_launches() - before, 1, "bf16 attention did not fuse");
    drop(y);
    for dims in SHAPES {
        for causal in [false, true] {
            against_cpu(&dev, DType::BF16, dims, causal, 3e-2);
            against_cpu(&dev, DType::F16, dims, causal, 1e-2);
        }
    }
}

/// Shapes for the tensor-core kernels (64 queries or keys per block, 32 or 64 on the other
/// side): one query, lengths off the tiles and on them (37, 100, 200, 256), `Tq != Tk` both
/// ways, head sizes 64, 128 and the padded 48.
const TC_SHAPES: [Dims6; 7] = [
    (1, 2, 1, 1, 64, 64),
    (2, 2, 200, 200, 64, 64),
    (1, 2, 256, 256, 64, 64),
    (1, 1, 256, 256, 128, 128),
    (2, 1, 37, 200, 128, 128),
    (1, 2, 200, 100, 48, 48),
    (2, 1, 100, 37, 48, 64),
];

/// The tensor-core kernels (fused 16-bit attention on sm_80+) against the f64 composed path on
/// the CPU, forward and the three gradients, within bf16's and f16's precision.
#[test]
fn tensor_core_kernels_match_within_their_precision() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _on = Fused16::on();
    for dims in TC_SHAPES {
        for causal in [false, true] {
            against_cpu(&dev, DType::BF16, dims, causal, 3e-2);
            against_cpu(&dev, DType::F16, dims, causal, 1e-2);
        }
    }
}

/// The tensor-core and the f32-FMA kernels agree (up to the tensor-core path's 16-bit weights)
/// with dropout, from the same generator state: the same Philox mask. They are distinct
/// kernels (the results differ in the last bits without dropout), and dropout does change the
/// result.
#[test]
fn tensor_core_dropout_equals_the_fma_kernels() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _on = Fused16::on();
    for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 1e-2)] {
        for (b, h, tq, tk, d) in [(2, 3, 45, 70, 64), (1, 2, 200, 130, 128)] {
            let q = normal::<Cuda>(&[b, h, tq, d], 51, dtype, &dev);
            let k = normal::<Cuda>(&[b, h, tk, d], 52, dtype, &dev);
            let v = normal::<Cuda>(&[b, h, tk, d], 53, dtype, &dev);
            let g = normal::<Cuda>(&[b, h, tq, d], 54, dtype, &dev);
            for causal in [false, true] {
                let drop = |tc: bool| {
                    kiln_backend_cuda::set_attention_tensor_cores(tc);
                    let mut rng = Generator::new(99);
                    let r = run_dropout(&q, &k, &v, &g, causal, Some((0.2, &mut rng)));
                    kiln_backend_cuda::set_attention_tensor_cores(true);
                    r
                };
                let (tc, fma) = (drop(true), drop(false));
                let what = format!("{dtype} {tq}x{tk} d {d} causal {causal}");
                for (name, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(tc.iter().zip(&fma)) {
                    assert_close(&format!("{what}, dropout: {name}"), a, b, tol);
                }
                let plain = run(&q, &k, &v, &g, causal);
                assert!(
                    plain[0]
                        .iter()
                        .zip(&tc[0])
                        .any(|(a, b)| (a - b).abs() > 1e-2),
                    "{what}: dropout changed nothing"
                );
                kiln_backend_cuda::set_attention_tensor_cores(false);
                let plain_fma = run(&q, &k, &v, &g, causal);
                kiln_backend_cuda::set_attention_tensor_cores(true);
                assert!(
                    plain != plain_fma,
                    "{what}: the tensor-core path gave the FMA kernels' bits (was it taken?)"
                );
            }
        }
    }
}

/// Head views of a packed bf16 `[b, t, 3·h·d + 8]` projection through the tensor-core kernels:
/// aligned (16-byte loads) and one element off (element loads), both equal to the contiguous
/// inputs' results bit for bit (loads are exact; the products are the same).
#[test]
fn tensor_core_head_views_of_a_packed_projection() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _on = Fused16::on();
    let (b, t, h, d) = (2, 70, 3, 64);
    let e = h * d;
    // Row stride 3·h·d + 8 (a multiple of 8 elements): from 0 every row starts 16-byte aligned.
    let qkv = normal::<Cuda>(&[b, t, 3 * e + 8], 19, DType::BF16, &dev);
    let g = normal::<Cuda>(&[b, h, t, d], 20, DType::BF16, &dev);
    for start in [0, 1] {
        let heads = |i: usize| {
            qkv.narrow(2, start + i * e, e)
                .unwrap()
                .reshape([b, t, h, d])
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let viewed = run(&q, &k, &v, &g, true);
        let packed = |x: &Tensor<Cuda>| x.contiguous().unwrap();
        let dense = run(&packed(&q), &packed(&k), &packed(&v), &g, true);
        for (name, (a, b)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(viewed.iter().zip(&dense))
        {
            assert_close(&format!("bf16 head views from {start}: {name}"), a, b, 0.0);
        }
    }
}

/// The fused path is one kernel launch for the forward (the composed path needs a mask, a
/// softmax and products), and it agrees with the GPU's own composed path.
#[test]
fn fused_is_one_launch_and_equals_the_gpu_composed_path() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    let (b, h, t, d) = (2, 3, 50, 64);
    let q = normal::<Cuda>(&[b, h, t, d], 1, DType::F32, &dev);
    let k = normal::<Cuda>(&[b, h, t, d], 2, DType::F32, &dev);
    let v = normal::<Cuda>(&[b, h, t, d], 3, DType::F32, &dev);
    let g = normal::<Cuda>(&[b, h, t, d], 4, DType::F32, &dev);
    for x in [&q, &k, &v, &g] {
        x.realize().unwrap();
    }
    let (qv, kv, vv) = (
        Var::constant(q.clone()),
        Var::constant(k.clone()),
        Var::constant(v.clone()),
    );
    let before = thread_launches();
    let y = qv
        .scaled_dot_product_attention(&kv, &vv, &AttnMask::Causal, 0.0, None, None)
        .unwrap();
    assert_eq!(
        thread_launches() - before,
        1,
        "the fused forward is one kernel"
    );
    drop(y);
    let fused = run(&q, &k, &v, &g, true);
    let composed = {
        let _off = composed_attention();
        run(&q, &k, &v, &g, true)
    };
    for (name, (a, b)) in ["out", "dq", "dk", "dv"]
        .iter()
        .zip(fused.iter().zip(&composed))
    {
        assert_close(&format!("fused vs composed on the GPU: {name}"), a, b, 1e-4);
    }
}

/// Dropout inside the kernels draws the composed path's mask (Philox, the generator's next
/// key, f32 uniforms): with the same generator state the fused and the composed path agree in
/// f32, forward and backward, and each advances the generator by one draw. Key lengths off and
/// on a multiple of 4 (where the tensor-core forward shares each Philox call's four words
/// between two lanes).
#[test]
fn fused_dropout_draws_the_composed_mask() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    for (b, h, tq, tk, d, causal) in [
        (2, 3, 45, 70, 64, false),
        (2, 3, 45, 70, 64, true),
        (2, 3, 45, 72, 64, false),
        (1, 2, 130, 132, 64, true),
    ] {
        let q = normal::<Cuda>(&[b, h, tq, d], 41, DType::F32, &dev);
        let k = normal::<Cuda>(&[b, h, tk, d], 42, DType::F32, &dev);
        let v = normal::<Cuda>(&[b, h, tk, d], 43, DType::F32, &dev);
        let g = normal::<Cuda>(&[b, h, tq, d], 44, DType::F32, &dev);
        let mut rng = Generator::new(77);
        let fused = run_dropout(&q, &k, &v, &g, causal, Some((0.25, &mut rng)));
        assert_eq!(rng.draws(), 1, "the fused path takes one draw");
        let mut rng = Generator::new(77);
        let composed = {
            let _off = composed_attention();
            run_dropout(&q, &k, &v, &g, causal, Some((0.25, &mut rng)))
        };
        assert_eq!(rng.draws(), 1);
        let plain = run(&q, &k, &v, &g, causal);
        assert!(
            fused[0]
                .iter()
                .zip(&plain[0])
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "dropout changed nothing"
        );
        for (name, (a, b)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&composed))
        {
            assert_close(
                &format!("dropout, {tq}x{tk}, causal {causal}: {name}"),
                a,
                b,
                1e-4,
            );
        }
    }
}

/// Heads as a view of a packed `[b, t, 3·h·d]` projection (as multi-head attention makes them:
/// row stride 3·h·d, head stride d) are read in place and give the contiguous inputs' results.
#[test]
fn head_views_of_a_packed_projection() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    let (b, t, h, d) = (2, 45, 3, 64);
    let e = h * d;
    let qkv = normal::<Cuda>(&[b, t, 3 * e], 9, DType::F32, &dev);
    let g = normal::<Cuda>(&[b, h, t, d], 10, DType::F32, &dev);
    let heads = |i: usize| {
        qkv.narrow(2, i * e, e)
            .unwrap()
            .reshape([b, t, h, d])
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let viewed = run(&q, &k, &v, &g, true);
    let packed = |x: &Tensor<Cuda>| x.contiguous().unwrap();
    let dense = run(&packed(&q), &packed(&k), &packed(&v), &g, true);
    for (name, (a, b)) in ["out", "dq", "dk", "dv"]
        .iter()
        .zip(viewed.iter().zip(&dense))
    {
        assert_close(&format!("head views: {name}"), a, b, 1e-6);
    }
}

/// Chainer's numerical gradient check through the fused kernels, in f32.
#[test]
fn fused_passes_check_backward_in_f32() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    let inputs = [
        normal::<Cuda>(&[1, 2, 35, 32], 21, DType::F32, &dev),
        normal::<Cuda>(&[1, 2, 40, 32], 22, DType::F32, &dev),
        normal::<Cuda>(&[1, 2, 40, 16], 23, DType::F32, &dev),
    ];
    let opts = CheckOptions::f32().with_tolerances(5e-3, 5e-2);
    for mask in [AttnMask::None, AttnMask::Causal] {
        check_backward(
            |x| x[0].scaled_dot_product_attention(&x[1], &x[2], &mask, 0.0, None, None),
            &inputs,
            &opts,
        )
        .unwrap();
    }
}

/// What the kernels do not take runs composed and still agrees with the CPU: f64, heads of 160;
/// and a boolean mask (fused) agrees too.
#[test]
fn cases_not_offered_run_composed() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    against_cpu(&dev, DType::F64, (1, 2, 37, 37, 64, 64), true, 1e-10);
    against_cpu(&dev, DType::F32, (1, 1, 20, 20, 160, 160), true, 1e-4);
    let (q, k, v) = (
        normal::<Cuda>(&[1, 2, 9, 8], 31, DType::F32, &dev),
        normal::<Cuda>(&[1, 2, 11, 8], 32, DType::F32, &dev),
        normal::<Cuda>(&[1, 2, 11, 8], 33, DType::F32, &dev),
    );
    let keep: Vec<u8> = (0..9 * 11).map(|x| u8::from(x % 4 != 1)).collect();
    let keep_gpu = Tensor::<Cuda>::from_slice(&keep, [9, 11], &dev).unwrap();
    let keep_cpu = Tensor::<Cpu>::from_slice(&keep, [9, 11], &Cpu::device(0)).unwrap();
    let y = Var::constant(q.clone())
        .scaled_dot_product_attention(
            &Var::constant(k.clone()),
            &Var::constant(v.clone()),
            &AttnMask::Keep(keep_gpu),
            0.0,
            None,
            None,
        )
        .unwrap();
    let want = Var::constant(on_cpu(&q))
        .scaled_dot_product_attention(
            &Var::constant(on_cpu(&k)),
            &Var::constant(on_cpu(&v)),
            &AttnMask::Keep(keep_cpu),
            0.0,
            None,
            None,
        )
        .unwrap();
    assert_close(
        "boolean mask",
        &f64s(&y.tensor()),
        &f64s(&want.tensor()),
        1e-4,
    );
}

/// Holds [`SWITCHES`] for writing with the f32 defaults (TF32 tensor cores on, `allow_tf32`
/// off) and restores them when dropped, also after a failed assertion.
struct F32Switches(#[allow(dead_code)] RwLockWriteGuard<'static, ()>, bool);

impl F32Switches {
    fn take() -> Self {
        let guard = SWITCHES.write().unwrap_or_else(|e| e.into_inner());
        let tf32 = kiln_backend_cuda::allow_tf32();
        kiln_backend_cuda::set_allow_tf32(false);
        kiln_backend_cuda::set_attention_tensor_cores_f32(true);
        F32Switches(guard, tf32)
    }
}

impl Drop for F32Switches {
    fn drop(&mut self) {
        kiln_backend_cuda::set_allow_tf32(self.1);
        kiln_backend_cuda::set_attention_tensor_cores_f32(true);
    }
}

/// The f32 tensor-core kernels (TF32 `mma.sync` on sm_80+) against the f64 composed path on
/// the CPU, forward and the three gradients: 3xTF32 (the default) near f32, 1xTF32 (under
/// `allow_tf32`) within TF32's precision. Elsewhere (no sm_80) the FMA kernels meet both.
#[test]
fn f32_tensor_core_kernels_match_within_their_precision() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _switches = F32Switches::take();
    for dims in TC_SHAPES {
        for causal in [false, true] {
            against_cpu(&dev, DType::F32, dims, causal, 1e-5);
        }
    }
    kiln_backend_cuda::set_allow_tf32(true);
    for dims in TC_SHAPES {
        for causal in [false, true] {
            against_cpu(&dev, DType::F32, dims, causal, 1e-2);
        }
    }
}

/// The f32 tensor-core kernels (3xTF32 and 1xTF32) and the FMA kernels agree with dropout
/// from the same generator state (the same Philox mask), the tensor-core results are not the
/// FMA kernels' bits (the path was taken), 1xTF32's not 3xTF32's, and dropout changes the
/// result.
#[test]
fn f32_tensor_core_dropout_equals_the_fma_kernels() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _switches = F32Switches::take();
    for (b, h, tq, tk, d) in [
        (2, 3, 45, 70, 64),
        (1, 2, 200, 130, 128),
        (2, 2, 70, 96, 64),
    ] {
        let q = normal::<Cuda>(&[b, h, tq, d], 61, DType::F32, &dev);
        let k = normal::<Cuda>(&[b, h, tk, d], 62, DType::F32, &dev);
        let v = normal::<Cuda>(&[b, h, tk, d], 63, DType::F32, &dev);
        let g = normal::<Cuda>(&[b, h, tq, d], 64, DType::F32, &dev);
        for causal in [false, true] {
            // (tensor cores, 1xTF32): results with and without dropout.
            let go = |tc: bool, tf32: bool| {
                kiln_backend_cuda::set_attention_tensor_cores_f32(tc);
                kiln_backend_cuda::set_allow_tf32(tf32);
                let mut rng = Generator::new(99);
                let dropped = run_dropout(&q, &k, &v, &g, causal, Some((0.2, &mut rng)));
                let plain = run(&q, &k, &v, &g, causal);
                kiln_backend_cuda::set_attention_tensor_cores_f32(true);
                kiln_backend_cuda::set_allow_tf32(false);
                (dropped, plain)
            };
            let (fma, fma_plain) = go(false, false);
            let what = format!("f32 {tq}x{tk} d {d} causal {causal}");
            for (tf32, tol) in [(false, 1e-5), (true, 1e-2)] {
                let (tc, tc_plain) = go(true, tf32);
                for (name, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(tc.iter().zip(&fma)) {
                    assert_close(&format!("{what} tf32 {tf32}, dropout: {name}"), a, b, tol);
                }
                assert!(
                    tc_plain != fma_plain,
                    "{what} tf32 {tf32}: the tensor-core path gave the FMA kernels' bits (was it taken?)"
                );
                assert!(
                    tc_plain[0]
                        .iter()
                        .zip(&tc[0])
                        .any(|(a, b)| (a - b).abs() > 1e-2),
                    "{what}: dropout changed nothing"
                );
            }
            assert!(
                go(true, false).1 != go(true, true).1,
                "{what}: 1xTF32 gave 3xTF32's bits"
            );
        }
    }
}

/// Head views of a packed f32 `[b, t, 3·h·d + 4]` projection through the f32 tensor-core
/// kernels: aligned (16-byte cp.async loads) and one element off (element loads), both equal
/// to the contiguous inputs' results bit for bit.
#[test]
fn f32_tensor_core_head_views_of_a_packed_projection() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _defaults = defaults();
    let (b, t, h, d) = (2, 70, 3, 64);
    let e = h * d;
    let qkv = normal::<Cuda>(&[b, t, 3 * e + 4], 29, DType::F32, &dev);
    let g = normal::<Cuda>(&[b, h, t, d], 30, DType::F32, &dev);
    for start in [0, 1] {
        let heads = |i: usize| {
            qkv.narrow(2, start + i * e, e)
                .unwrap()
                .reshape([b, t, h, d])
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let viewed = run(&q, &k, &v, &g, true);
        let packed = |x: &Tensor<Cuda>| x.contiguous().unwrap();
        let dense = run(&packed(&q), &packed(&k), &packed(&v), &g, true);
        for (name, (a, b)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(viewed.iter().zip(&dense))
        {
            assert_close(&format!("f32 head views from {start}: {name}"), a, b, 0.0);
        }
    }
}

/// Which kernels a heads-last test runs: f32 on the FMA kernels (tensor cores off), f32 on the
/// TF32 tensor cores (3xTF32), bf16 and f16 on the 16-bit tensor cores.
const FAMILIES: [(&str, DType); 4] = [
    ("f32 fma", DType::F32),
    ("f32 tensor cores", DType::F32),
    ("bf16 tensor cores", DType::BF16),
    ("f16 tensor cores", DType::F16),
];

/// Holds [`SWITCHES`] with the switches set for `family` (one of [`FAMILIES`]) and the
/// defaults restored when dropped.
struct FamilySwitches(#[allow(dead_code)] RwLockWriteGuard<'static, ()>, bool);

impl FamilySwitches {
    fn take(family: &str) -> Self {
        let guard = SWITCHES.write().unwrap_or_else(|e| e.into_inner());
        let tf32 = kiln_backend_cuda::allow_tf32();
        kiln_backend_cuda::set_allow_tf32(false);
        kiln_backend_cuda::set_attention_tensor_cores_f32(family != "f32 fma");
        kiln_backend_cuda::set_attention_tensor_cores(true);
        kiln_backend_cuda::set_fused_attention_16bit(true);
        kiln_backend_cuda::set_cudnn_attention(Some(false));
        FamilySwitches(guard, tf32)
    }
}

impl Drop for FamilySwitches {
    fn drop(&mut self) {
        kiln_backend_cuda::set_allow_tf32(self.1);
        kiln_backend_cuda::set_attention_tensor_cores_f32(true);
        kiln_backend_cuda::set_attention_tensor_cores(true);
        kiln_backend_cuda::set_fused_attention_16bit(false);
        kiln_backend_cuda::set_cudnn_attention(None);
    }
}

/// The `[b, h, t, d]` head view `i` of a `[b, t, w]` projection whose thirds start at `start`.
fn head_view(qkv: &Tensor<Cuda>, (start, i, h, d): (usize, usize, usize, usize)) -> Tensor<Cuda> {
    let (b, t) = (qkv.dims()[0], qkv.dims()[1]);
    let e = h * d;
    qkv.narrow(2, start + i * e, e)
        .unwrap()
        .reshape([b, t, h, d])
        .unwrap()
        .transpose(1, 2)
        .unwrap()
}

/// With dropout the tensor-core forward returns the bits it kept (none without dropout), and
/// the backward reads them: given them it equals a backward that draws the mask again, to the
/// bit, and given another draw's bits it does not.
#[test]
fn tensor_core_forward_keeps_its_dropout_bits_for_the_backward() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _on = Fused16::on();
    let dtype = DType::BF16;
    let (b, h, t, d) = (2, 3, 70, 64);
    let x = |seed| normal::<Cuda>(&[b, h, t, d], seed, dtype, &dev);
    let (q, k, v, g) = (x(61), x(62), x(63), x(64));
    fn op(t: &Tensor<Cuda>) -> (&CudaStorage, &Layout) {
        (t.storage(), t.layout())
    }
    let spec = |p, key| AttentionSpec {
        scale: 0.125,
        causal: true,
        dropout_p: p,
        dropout_key: key,
    };
    let forward = |s| {
        Cuda::attention_forward(op(&q), op(&k), op(&v), None, dtype, s)
            .unwrap()
            .expect("fused")
    };
    assert!(
        forward(spec(0.0, 7)).2.is_none(),
        "bits kept without dropout"
    );
    let ((o, ol), lse, mask) = forward(spec(0.3, 7));
    let other = forward(spec(0.3, 8)).2.expect("bits of the second draw");
    let lse_l = Layout::contiguous(&ol.dims()[..ol.rank() - 1]);
    let grads = |m: Option<&CudaStorage>| -> Vec<Vec<f64>> {
        let r = Cuda::attention_backward(
            op(&q),
            op(&k),
            op(&v),
            None,
            (&o, &ol),
            (&lse, &lse_l),
            m,
            op(&g),
            dtype,
            spec(0.3, 7),
        )
        .unwrap()
        .expect("fused");
        let storages: Vec<_> = r.storages.into_iter().map(std::sync::Arc::new).collect();
        r.grads
            .iter()
            .map(|(i, l)| {
                f64s(&Tensor::<Cuda>::from_parts(
                    storages[*i].clone(),
                    l.clone(),
                    dtype,
                ))
            })
            .collect()
    };
    let drawn = grads(None);
    assert_eq!(
        grads(mask.as_ref()),
        drawn,
        "the kept bits are not the drawn mask"
    );
    assert_ne!(
        grads(Some(&other)),
        drawn,
        "the backward ignored the bits it was given"
    );
}

/// The layouts the backend returns for `(q, k, v)` with the output gradient `g` (causal): the
/// output's, then for each gradient whether the three share one storage, and its layout.
fn backend_layouts(qkv: [&Tensor<Cuda>; 3], g: &Tensor<Cuda>) -> [(bool, Layout); 4] {
    fn op(t: &Tensor<Cuda>) -> (&CudaStorage, &Layout) {
        (t.storage(), t.layout())
    }
    let [q, k, v] = qkv;
    let spec = AttentionSpec {
        scale: 0.125,
        causal: true,
        dropout_p: 0.0,
        dropout_key: 0,
    };
    let dtype = q.dtype();
    let ((o, ol), lse, mask) = Cuda::attention_forward(op(q), op(k), op(v), None, dtype, spec)
        .unwrap()
        .expect("fused");
    let lse_l = Layout::contiguous(&ol.dims()[..ol.rank() - 1]);
    let grads = Cuda::attention_backward(
        op(q),
        op(k),
        op(v),
        None,
        (&o, &ol),
        (&lse, &lse_l),
        mask.as_ref(),
        op(g),
        dtype,
        spec,
    )
    .unwrap()
    .expect("fused");
    let one = grads.storages.len() == 1;
    let [a, b, c] = grads.grads.map(|(_, l)| (one, l));
    [(false, ol), a, b, c]
}

/// Whether a `[b, h, t, d]` layout is the view of a row-major `[b, t, h, d]` buffer.
fn heads_last(l: &Layout) -> bool {
    let (h, t, d) = (l.dims()[1], l.dims()[2], l.dims()[3]);
    l.strides() == [t * h * d, d, h * d, 1]
}

/// Every kernel family, heads-last operands (the `[b, h, t, d]` head views of a `[b, t, 3hd]`
/// projection, and of one padded so that the three do not tile one buffer): the output and
/// the gradients are the contiguous operands' bit for bit (the arithmetic is the same; only the
/// stores move), come back heads-last (the output and, for separate operands, each gradient;
/// for the tiled projection the three gradients lie in one buffer of the projection's layout),
/// and match the f64 composed path on the CPU within the family's tolerance.
#[test]
fn heads_last_operands_give_heads_last_outputs_in_every_family() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (b, t, h, d) = (2, 70, 3, 64);
    let e = h * d;
    for (family, dtype) in FAMILIES {
        let _switches = FamilySwitches::take(family);
        let tol = match dtype {
            DType::F32 => 1e-4,
            DType::BF16 => 3e-2,
            _ => 1e-2,
        };
        for pad in [0, 8] {
            let qkv = normal::<Cuda>(&[b, t, 3 * e + pad], 71, dtype, &dev);
            let g = normal::<Cuda>(&[b, t, h, d], 72, dtype, &dev)
                .transpose(1, 2)
                .unwrap();
            let (q, k, v) = (
                head_view(&qkv, (0, 0, h, d)),
                head_view(&qkv, (0, 1, h, d)),
                head_view(&qkv, (0, 2, h, d)),
            );
            let what = format!("{family}, padding {pad}");
            // The backend's layouts for the output and the gradients.
            let layouts = backend_layouts([&q, &k, &v], &g);
            assert!(heads_last(&layouts[0].1), "{what}: output {:?}", layouts[0]);
            for (x, (one, l)) in [&q, &k, &v].iter().zip(&layouts[1..]) {
                if pad == 0 {
                    // One buffer, each gradient in its operand's layout.
                    assert!(*one, "{what}: the gradients share one buffer");
                    assert_eq!(l.strides(), x.layout().strides(), "{what}");
                } else {
                    assert!(!*one, "{what}: separate gradients");
                    assert!(heads_last(l), "{what}: gradient {l:?}");
                }
            }
            // Bit for bit the contiguous operands' results.
            let viewed = run(&q, &k, &v, &g, true);
            let dense = |x: &Tensor<Cuda>| x.contiguous().unwrap();
            let contiguous = run(&dense(&q), &dense(&k), &dense(&v), &dense(&g), true);
            for (name, (a, c)) in ["out", "dq", "dk", "dv"]
                .iter()
                .zip(viewed.iter().zip(&contiguous))
            {
                assert_close(&format!("{what}: {name} vs contiguous"), a, c, 0.0);
            }
            // And the f64 reference.
            let want = run(&on_cpu(&q), &on_cpu(&k), &on_cpu(&v), &on_cpu(&g), true);
            for (name, (a, w)) in ["out", "dq", "dk", "dv"]
                .iter()
                .zip(viewed.iter().zip(&want))
            {
                assert_close(&format!("{what}: {name} vs f64"), a, w, tol);
            }
        }
    }
}

/// Packed self-attention's output and gradient `[b, t, 3E]` through the narrow-based
/// composition (three narrowed head views into `scaled_dot_product_attention`, fused too).
fn narrow_path(
    x: &Tensor<Cuda>,
    h: usize,
    g: &Tensor<Cuda>,
    dropout: Option<(f64, &mut Generator)>,
) -> [Vec<f64>; 2] {
    let (b, t, e) = (x.dims()[0], x.dims()[1], x.dims()[2] / 3);
    let xv = Var::param(x.clone());
    let (p, rng) = dropout.map_or((0.0, None), |(p, r)| (p, Some(r)));
    let view = |i: usize| {
        xv.narrow(-1, i * e, e)
            .unwrap()
            .reshape([b, t, h, e / h])
            .unwrap()
            .transpose(-3, -2)
            .unwrap()
    };
    let y = view(0)
        .scaled_dot_product_attention(&view(1), &view(2), &AttnMask::Causal, p, None, rng)
        .unwrap()
        .transpose(-3, -2)
        .unwrap()
        .reshape([b, t, e])
        .unwrap();
    y.backward_with(g).unwrap();
    [f64s(&y.tensor()), f64s(&xv.grad().unwrap())]
}

/// `packed_self_attention`'s output and gradient, and the kernel launches of its backward.
fn packed_path(
    x: &Tensor<Cuda>,
    h: usize,
    g: &Tensor<Cuda>,
    dropout: Option<(f64, &mut Generator)>,
) -> ([Vec<f64>; 2], u64) {
    let xv = Var::param(x.clone());
    let (p, rng) = dropout.map_or((0.0, None), |(p, r)| (p, Some(r)));
    let y = xv
        .packed_self_attention(h, &AttnMask::Causal, p, None, rng)
        .unwrap();
    assert!(
        y.tensor().is_contiguous(),
        "the output [b, t, E] is the heads-last buffer as is"
    );
    let before = thread_launches();
    y.backward_with(g).unwrap();
    let launches = thread_launches() - before;
    ([f64s(&y.tensor()), f64s(&xv.grad().unwrap())], launches)
}

/// The packed self-attention node equals the narrow-based path bit for bit (the narrow path's
/// zero padding and sums add zeros), with dropout too (the same draw), in every kernel family;
/// and its backward is the attention's three kernels (Dr, dK/dV, dQ) writing one buffer: no
/// zero-fill, no slice assignment, no sum.
#[test]
fn packed_self_attention_equals_the_narrow_path_with_one_buffer() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (b, t, h, d) = (2, 70, 3, 64);
    let e = h * d;
    for (family, dtype) in FAMILIES {
        let _switches = FamilySwitches::take(family);
        let x = normal::<Cuda>(&[b, t, 3 * e], 81, dtype, &dev);
        let g = normal::<Cuda>(&[b, t, e], 82, dtype, &dev);
        x.realize().unwrap();
        g.realize().unwrap();
        for p in [0.0, 0.2] {
            let mut r1 = Generator::new(5);
            let mut r2 = Generator::new(5);
            let drop1 = (p > 0.0).then_some((p, &mut r1));
            let (packed, launches) = packed_path(&x, h, &g, drop1);
            let drop2 = (p > 0.0).then_some((p, &mut r2));
            let narrow = narrow_path(&x, h, &g, drop2);
            assert_eq!(r1.draws(), r2.draws(), "{family}: the same draws");
            for (name, (a, c)) in ["out", "dx"].iter().zip(packed.iter().zip(&narrow)) {
                assert_close(&format!("{family} dropout {p}: {name}"), a, c, 0.0);
            }
            assert_eq!(
                launches, 3,
                "{family}: the packed backward is the three attention kernels"
            );
        }
    }
}

/// Holds [`SWITCHES`] with 16-bit attention on cuDNN's fused engines wherever cuDNN serves it
/// and on kiln's fused kernels elsewhere (`None` when cuDNN is not loadable: the test says so
/// and returns); when dropped, cuDNN back to its default and kiln's 16-bit kernels off, as
/// [`Fused16`] leaves them.
struct OnCudnn(#[allow(dead_code)] RwLockWriteGuard<'static, ()>);

impl OnCudnn {
    fn on() -> Option<Self> {
        let guard = SWITCHES.write().unwrap_or_else(|e| e.into_inner());
        if !kiln_backend_cuda::cudnn_available() {
            println!("skipped: cuDNN not loadable, so no cuDNN attention to test");
            return None;
        }
        kiln_backend_cuda::set_cudnn_attention(Some(true));
        // kiln's 16-bit kernels where a test turns cuDNN off (an earlier test may have left
        // them off).
        kiln_backend_cuda::set_fused_attention_16bit(true);
        Some(OnCudnn(guard))
    }
}

impl Drop for OnCudnn {
    fn drop(&mut self) {
        kiln_backend_cuda::set_cudnn_attention(None);
        kiln_backend_cuda::set_fused_attention_16bit(false);
    }
}

/// Shapes cuDNN's engines serve (d = dv, multiples of 8 up to 128): lengths off every tile,
/// `Tq != Tk` both ways (top-left causal mask), one query, head sizes 32, 64 and 80. Few: each
/// new shape builds two graphs per dtype (about half a second each on an H200).
const CUDNN_SHAPES: [Dims6; 4] = [
    (2, 3, 37, 37, 64, 64),
    (1, 2, 70, 45, 32, 32),
    (2, 1, 45, 70, 80, 80),
    (1, 2, 1, 77, 64, 64),
];

/// cuDNN's fused attention (forward and backward) against the f64 composed path on the CPU,
/// within bf16's precision for every shape and f16's for the first; each call is counted as
/// run on cuDNN.
#[test]
fn cudnn_attention_matches_within_bf16_and_f16_precision() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    for (i, dims) in CUDNN_SHAPES.into_iter().enumerate() {
        for causal in [false, true] {
            let before = kiln_backend_cuda::cudnn_attention_calls();
            against_cpu(&dev, DType::BF16, dims, causal, 3e-2);
            let mut want = 2;
            if i == 0 {
                against_cpu(&dev, DType::F16, dims, causal, 1e-2);
                want += 2;
            }
            let calls = kiln_backend_cuda::cudnn_attention_calls() - before;
            assert_eq!(calls, want, "{dims:?} causal {causal}: fwd + bwd on cuDNN");
        }
    }
}

/// A forward on cuDNN and a backward on kiln's kernels (and the reverse) give the gradients of
/// both on one path: the saved log-sum-exps mean the same on both.
#[test]
fn cudnn_and_kiln_kernels_share_the_saved_statistics() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    let (b, h, t, d) = (2, 3, 100, 64);
    let x = |seed, dims: &[usize]| normal::<Cuda>(dims, seed, DType::BF16, &dev);
    let (q, k, v, g) = (
        x(1, &[b, h, t, d]),
        x(2, &[b, h, t, d]),
        x(3, &[b, h, t, d]),
        x(4, &[b, h, t, d]),
    );
    let want = run(&on_cpu(&q), &on_cpu(&k), &on_cpu(&v), &on_cpu(&g), true);
    for forward_on_cudnn in [true, false] {
        kiln_backend_cuda::set_cudnn_attention(Some(forward_on_cudnn));
        let (qv, kv, vv) = (
            Var::param(q.clone()),
            Var::param(k.clone()),
            Var::param(v.clone()),
        );
        let y = qv
            .scaled_dot_product_attention(&kv, &vv, &AttnMask::Causal, 0.0, None, None)
            .unwrap();
        y.tensor().realize().unwrap();
        kiln_backend_cuda::set_cudnn_attention(Some(!forward_on_cudnn));
        let before = kiln_backend_cuda::cudnn_attention_calls();
        y.backward_with(&g).unwrap();
        let on_cudnn = kiln_backend_cuda::cudnn_attention_calls() - before;
        assert_eq!(
            on_cudnn,
            u64::from(!forward_on_cudnn),
            "the backward's path"
        );
        let grad = |x: &Var<Cuda>| f64s(&x.grad().expect("a gradient"));
        let got = [f64s(&y.tensor()), grad(&qv), grad(&kv), grad(&vv)];
        for (name, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let what = format!("forward on cuDNN {forward_on_cudnn}: {name}");
            assert_close(&what, got, want, 3e-2);
        }
    }
}

/// Head views of a packed bf16 `[b, t, 3·h·d]` projection (self-attention's layout) on cuDNN:
/// read in place, the gradients in one buffer, equal to the contiguous inputs' results within
/// bf16's precision.
#[test]
fn cudnn_attention_reads_head_views_of_a_packed_projection() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    let (b, t, h, d) = (2, 70, 3, 64);
    let e = h * d;
    let qkv = normal::<Cuda>(&[b, t, 3 * e], 19, DType::BF16, &dev);
    let g = normal::<Cuda>(&[b, h, t, d], 20, DType::BF16, &dev);
    let heads = |i: usize| {
        qkv.narrow(2, i * e, e)
            .unwrap()
            .reshape([b, t, h, d])
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let before = kiln_backend_cuda::cudnn_attention_calls();
    let viewed = run(&q, &k, &v, &g, true);
    assert_eq!(kiln_backend_cuda::cudnn_attention_calls() - before, 2);
    let want = run(&on_cpu(&q), &on_cpu(&k), &on_cpu(&v), &on_cpu(&g), true);
    for (name, (a, b)) in ["out", "dq", "dk", "dv"]
        .iter()
        .zip(viewed.iter().zip(&want))
    {
        assert_close(&format!("cuDNN bf16 head views: {name}"), a, b, 3e-2);
    }
}

/// Dropout on cuDNN: the mask is cuDNN's generator's (seeded with the call's key), the same in
/// the forward and the backward. With `V = I` (`Tk = dv`) the output is the dropped weights
/// themselves, which reveals the mask: about `1 - p` of the weights kept, each `P / (1 - p)`,
/// the same draws for the same key, and the gradients equal the f64 formulas with that mask.
#[test]
fn cudnn_dropout_draws_one_mask_for_forward_and_backward() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    let (b, h, t) = (2, 2, 64);
    let (d, p) = (64, 0.3);
    let dtype = DType::BF16;
    let q = normal::<Cuda>(&[b, h, t, d], 31, dtype, &dev);
    let k = normal::<Cuda>(&[b, h, t, d], 32, dtype, &dev);
    let g = normal::<Cuda>(&[b, h, t, t], 33, dtype, &dev);
    let eye: Vec<f32> = (0..b * h * t * t)
        .map(|i| f32::from(i % (t * t) / t == i % t))
        .collect();
    let v = Tensor::<Cuda>::from_vec(eye, [b, h, t, t], &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let before = kiln_backend_cuda::cudnn_attention_calls();
    let got = run_dropout(&q, &k, &v, &g, true, Some((p, &mut Generator::new(7))));
    assert_eq!(
        kiln_backend_cuda::cudnn_attention_calls() - before,
        2,
        "fwd + bwd on cuDNN"
    );
    let again = run_dropout(&q, &k, &v, &g, true, Some((p, &mut Generator::new(7))));
    assert_eq!(got[0], again[0], "the same key draws the same mask");
    let other = run_dropout(&q, &k, &v, &g, true, Some((p, &mut Generator::new(8))));
    assert_ne!(got[0], other[0], "another key draws another mask");

    // The f64 reference from the same bf16 inputs, with the mask the output reveals.
    let (qh, kh, gh) = (f64s(&q), f64s(&k), f64s(&g));
    let scale = 1.0 / (d as f64).sqrt();
    let (mut kept, mut allowed) = (0usize, 0usize);
    let n = b * h * t * t;
    let (mut pr, mut mask) = (vec![0.0; n], vec![0.0; n]);
    for bh in 0..b * h {
        for i in 0..t {
            let row = &mut pr[(bh * t + i) * t..][..t];
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let qi = &qh[(bh * t + i) * d..][..d];
                    let kj = &kh[(bh * t + j) * d..][..d];
                    scale * qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f64>()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (j, x) in s.iter().enumerate() {
                row[j] = (x - m).exp() / z;
                let o = got[0][(bh * t + i) * t + j];
                allowed += 1;
                if o != 0.0 {
                    kept += 1;
                    mask[(bh * t + i) * t + j] = 1.0;
                    let want = row[j] / (1.0 - p);
                    assert!(
                        (o - want).abs() <= 3e-2 * (1e-3 + want),
                        "kept weight {o} vs {want}"
                    );
                }
            }
            for j in i + 1..t {
                assert_eq!(got[0][(bh * t + i) * t + j], 0.0, "a masked key");
            }
        }
    }
    let frac = kept as f64 / allowed as f64;
    assert!(
        (frac - (1.0 - p)).abs() < 0.03,
        "kept {frac} of the weights, want {}",
        1.0 - p
    );

    // dV = Dᵀ·g, dP = mask ∘ g / (1 - p) (V = I), dS = P ∘ (dP - rowsum(dP ∘ P)),
    // dQ = scale·dS·K, dK = scale·dSᵀ·Q.
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; b * h * t * d],
        vec![0.0; b * h * t * d],
        vec![0.0; n],
    );
    for bh in 0..b * h {
        let at = |i: usize, j: usize| (bh * t + i) * t + j;
        let mut ds = vec![0.0; t * t];
        for i in 0..t {
            let dp: Vec<f64> = (0..t)
                .map(|j| mask[at(i, j)] * gh[at(i, j)] / (1.0 - p))
                .collect();
            let r: f64 = (0..t).map(|j| dp[j] * pr[at(i, j)]).sum();
            for j in 0..t {
                ds[i * t + j] = pr[at(i, j)] * (dp[j] - r);
                let dd = mask[at(i, j)] * pr[at(i, j)] / (1.0 - p);
                for c in 0..t {
                    dv[at(j, c)] += dd * gh[at(i, c)];
                }
            }
        }
        for i in 0..t {
            for j in 0..t {
                let w = scale * ds[i * t + j];
                for c in 0..d {
                    dq[(bh * t + i) * d + c] += w * kh[(bh * t + j) * d + c];
                    dk[(bh * t + j) * d + c] += w * qh[(bh * t + i) * d + c];
                }
            }
        }
    }
    assert_close("cuDNN dropout: dq", &got[1], &dq, 5e-2);
    assert_close("cuDNN dropout: dk", &got[2], &dk, 5e-2);
    assert_close("cuDNN dropout: dv", &got[3], &dv, 5e-2);
}

/// A forward + backward on cuDNN's engines captured in a CUDA graph (its graphs measured by an
/// eager call first) replays to the eager call's bits: the plans, their workspaces from the
/// capture's pool and the by-value scalars are captured like kernels.
#[test]
fn cudnn_attention_replays_in_a_cuda_graph() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    let dims = [2, 3, 128, 64];
    let x = |seed| normal::<Cuda>(&dims, seed, DType::BF16, &dev);
    let (q, k, v) = (Var::param(x(41)), Var::param(x(42)), Var::param(x(43)));
    let g = x(44);
    let step = || -> kiln_core::Result<[Tensor<Cuda>; 4]> {
        for p in [&q, &k, &v] {
            p.zero_grad();
        }
        let y = q.scaled_dot_product_attention(&k, &v, &AttnMask::Causal, 0.0, None, None)?;
        y.backward_with(&g)?;
        let grad = |p: &Var<Cuda>| p.grad().expect("a gradient");
        Ok([y.tensor(), grad(&q), grad(&k), grad(&v)])
    };
    let eager = step().unwrap().map(|t| f64s(&t));
    let before = kiln_backend_cuda::cudnn_attention_calls();
    let (graph, outs) = kiln_backend_cuda::CudaGraph::capture(&dev, step).unwrap();
    assert_eq!(
        kiln_backend_cuda::cudnn_attention_calls() - before,
        2,
        "captured on cuDNN"
    );
    graph.replay().unwrap();
    for (name, (t, want)) in ["out", "dq", "dk", "dv"]
        .iter()
        .zip(outs.iter().zip(&eager))
    {
        assert_eq!(&f64s(t), want, "replayed {name}");
    }
}

/// The boolean masks of [`masks_fuse_on_kiln_kernels_and_match_the_composed_path`] for
/// `[b, h, tq, tk]` scores, as `u8` values with their shapes: a key-padding mask `[b, tk]` (PyTorch's `True` =
/// padding; sequence 0 pads its last third, the last sequence is all padding: its queries see
/// no key), a per-head mask `[b, h, tq, tk]` (about three in four kept; query 5 of entry (0, 1)
/// sees nothing), and one `[tq, tk]` mask shared by every head.
fn boolean_masks((b, h, tq, tk): (usize, usize, usize, usize)) -> [(bool, Vec<u8>, Vec<usize>); 3] {
    let padding = (0..b * tk)
        .map(|x| {
            let (n, j) = (x / tk, x % tk);
            u8::from(n == b - 1 || (n == 0 && j >= 2 * tk / 3))
        })
        .collect();
    let per_head = (0..b * h * tq * tk)
        .map(|x| {
            let row = x / tk;
            u8::from(row != tq + 5 && (x.wrapping_mul(2654435761) >> 7) % 4 != 0)
        })
        .collect();
    let shared = (0..tq * tk).map(|x| u8::from(x % 5 != 2)).collect();
    [
        (true, padding, vec![b, tk]),
        (false, per_head, vec![b, h, tq, tk]),
        (false, shared, vec![tq, tk]),
    ]
}

/// The mask `(padding, values, dims)` of [`boolean_masks`] on `dev`, realized.
fn keep_mask<B: Backend>(
    (padding, values, dims): &(bool, Vec<u8>, Vec<usize>),
    dev: &B::Device,
) -> AttnMask<B> {
    let t = Tensor::<B>::from_slice(values, dims.clone(), dev).unwrap();
    let mask = if *padding {
        AttnMask::key_padding(&t).unwrap()
    } else {
        AttnMask::Keep(t)
    };
    if let AttnMask::Keep(t) = &mask {
        t.realize().unwrap();
    }
    mask
}

/// Boolean and additive masks fuse on kiln's kernels (the forward is one kernel launch, two on
/// the tensor-core kernels, which first summarize the mask per block) — f32 on the 3xTF32
/// kernels (also under `allow_tf32`) and the FMA ones, bf16 and f16 on the tensor-core kernels
/// (cuDNN's engines off: `masks_on_cudnn_match_the_composed_path` has them) — and agree with the
/// f64 composed path on the CPU, forward and gradients, for a key-padding mask with a sequence
/// that is all padding, a per-head mask with a fully masked row, and a 2-D mask, each as a `u8`
/// mask and as an additive one (`-inf` where masked, small values elsewhere); rows that see no
/// key give exact zeros.
#[test]
fn masks_fuse_on_kiln_kernels_and_match_the_composed_path() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _switches = F32Switches::take();
    // kiln's own 16-bit kernels, whatever an earlier test left the switches at.
    struct OwnKernels16;
    impl Drop for OwnKernels16 {
        fn drop(&mut self) {
            kiln_backend_cuda::set_fused_attention_16bit(false);
            kiln_backend_cuda::set_cudnn_attention(None);
        }
    }
    let _own = OwnKernels16;
    kiln_backend_cuda::set_fused_attention_16bit(true);
    kiln_backend_cuda::set_cudnn_attention(Some(false));
    let cpu = Cpu::device(0);
    let cases: [(Dims6, [(DType, f64); 3]); 2] = [
        (
            (2, 3, 50, 70, 64, 64),
            [(DType::F32, 1e-5), (DType::BF16, 3e-2), (DType::F16, 1e-2)],
        ),
        (
            (2, 2, 100, 37, 128, 128),
            [(DType::F32, 1e-5), (DType::BF16, 3e-2), (DType::F16, 1e-2)],
        ),
    ];
    // (fma, allow_tf32): f32 with a mask runs 3xTF32 even under allow_tf32 (its tolerance
    // holds), the FMA kernels where tensor cores are off.
    for (fma, tf32) in [(false, false), (true, false), (false, true)] {
        kiln_backend_cuda::set_attention_tensor_cores_f32(!fma);
        kiln_backend_cuda::set_allow_tf32(tf32);
        for ((b, h, tq, tk, d, dv), dtypes) in cases {
            for (dtype, tol) in dtypes {
                if (fma || tf32) && dtype != DType::F32 {
                    continue;
                }
                let seed = (tq * 5 + tk + d) as u64;
                let q = normal::<Cuda>(&[b, h, tq, d], seed, dtype, &dev);
                let k = normal::<Cuda>(&[b, h, tk, d], seed + 1, dtype, &dev);
                let v = normal::<Cuda>(&[b, h, tk, dv], seed + 2, dtype, &dev);
                let g = normal::<Cuda>(&[b, h, tq, dv], seed + 3, dtype, &dev);
                for x in [&q, &k, &v, &g] {
                    x.realize().unwrap();
                }
                for (m, additive) in boolean_masks((b, h, tq, tk))
                    .into_iter()
                    .flat_map(|m| [(m.clone(), false), (m, true)])
                {
                    let what = format!(
                        "{dtype} fma {fma} tf32 {tf32} {:?} mask {:?} additive {additive}",
                        (b, h, tq, tk, d),
                        m.2
                    );
                    let (mask, on_host) = if additive {
                        additive_mask(&m, dtype, &dev)
                    } else {
                        (keep_mask::<Cuda>(&m, &dev), keep_mask::<Cpu>(&m, &cpu))
                    };
                    let before = thread_launches();
                    let y = Var::constant(q.clone())
                        .scaled_dot_product_attention(
                            &Var::constant(k.clone()),
                            &Var::constant(v.clone()),
                            &mask,
                            0.0,
                            None,
                            None,
                        )
                        .unwrap();
                    // The kernel, after the mask's summary per block on the tensor-core ones.
                    let tensor_cores =
                        dev.compute_capability().unwrap() >= 80 && (dtype != DType::F32 || !fma);
                    assert_eq!(
                        thread_launches() - before,
                        1 + u64::from(tensor_cores),
                        "{what}: the forward did not fuse"
                    );
                    drop(y);
                    let got = masked_against_cpu(&what, [&q, &k, &v, &g], (&mask, &on_host), tol);
                    if m.0 {
                        // The last sequence is all padding: its outputs and dQ are exactly 0.
                        let per_seq = h * tq * dv;
                        let last = &got[0][(b - 1) * per_seq..b * per_seq];
                        assert!(
                            last.iter().all(|&x| x == 0.0),
                            "{what}: a row that sees no key is not 0"
                        );
                        let per_seq = h * tq * d;
                        let last = &got[1][(b - 1) * per_seq..b * per_seq];
                        assert!(last.iter().all(|&x| x == 0.0), "{what}: its dq is not 0");
                    }
                }
            }
        }
    }
}

/// The mask `(padding, values, dims)` of [`boolean_masks`] as an additive mask of `dtype` on
/// `dev` (`-inf` where masked, small values in `[-0.5, 0.5]` elsewhere; a padding mask as
/// `[n, 1, 1, s]`), and the same values in f64 on the CPU.
fn additive_mask(
    (padding, values, dims): &(bool, Vec<u8>, Vec<usize>),
    dtype: DType,
    dev: &CudaDevice,
) -> (AttnMask<Cuda>, AttnMask<Cpu>) {
    let dims = match (padding, dims.as_slice()) {
        (true, &[n, s]) => vec![n, 1, 1, s],
        _ => dims.clone(),
    };
    let vals: Vec<f64> = values
        .iter()
        .enumerate()
        .map(|(i, &x)| match (x != 0) != *padding {
            true => ((i * 7) % 11) as f64 * 0.1 - 0.5,
            false => f64::NEG_INFINITY,
        })
        .collect();
    let t = Tensor::<Cuda>::from_vec(vals, dims.clone(), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    t.realize().unwrap();
    let c = Tensor::<Cpu>::from_vec(f64s(&t), dims, &Cpu::device(0)).unwrap();
    (AttnMask::Additive(t), AttnMask::Additive(c))
}

/// The row log-sum-exps of the backend's fused forward of `q`, `k`, `v` under `mask` (a `Keep`
/// or `Additive` one), unscaled, no dropout.
fn masked_lse(
    q: &Tensor<Cuda>,
    k: &Tensor<Cuda>,
    v: &Tensor<Cuda>,
    mask: &AttnMask<Cuda>,
) -> Vec<f64> {
    let mut scores = q.dims().to_vec();
    *scores.last_mut().unwrap() = k.dims()[k.rank() - 2];
    fn op(t: &Tensor<Cuda>) -> (&CudaStorage, &Layout) {
        (t.storage(), t.layout())
    }
    let spec = AttentionSpec {
        scale: 1.0 / (q.dims()[q.rank() - 1] as f64).sqrt(),
        causal: false,
        dropout_p: 0.0,
        dropout_key: 0,
    };
    let (AttnMask::Keep(m) | AttnMask::Additive(m)) = mask else {
        panic!("a tensor mask")
    };
    let m = m.broadcast_to(scores).unwrap();
    let mo = match mask {
        AttnMask::Keep(_) => AttnMaskOperand::Keep(op(&m)),
        _ => AttnMaskOperand::Additive(op(&m)),
    };
    let (_, lse, _) = Cuda::attention_forward(op(q), op(k), op(v), Some(mo), q.dtype(), spec)
        .unwrap()
        .expect("fused");
    let rows = q.elem_count() / q.dims()[q.rank() - 1];
    f64s(&Tensor::<Cuda>::from_storage(lse, [rows], DType::F32))
}

/// Boolean and additive masks on cuDNN's engines (which take them as a bias added to the
/// scores): forward and backward one cuDNN call each, against the f64 composed path on the CPU
/// within bf16's and f16's precision, for a key-padding mask with a sequence that is all padding
/// (its outputs and dQ exactly 0, as on kiln's kernels), a per-head mask with a fully masked
/// row and a 2-D mask, each as a `u8` mask and as an additive one (f16: the padding mask); at a
/// second shape whose rows are 16-byte aligned the additive mask is read in place; and under
/// bf16 autocast, an f32 additive mask (cast to bf16 for the fused call).
#[test]
fn masks_on_cudnn_match_the_composed_path() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    let cpu = Cpu::device(0);
    for (i, (b, h, tq, tk, d)) in [(2, 3, 50, 70, 64), (2, 2, 64, 128, 64)]
        .into_iter()
        .enumerate()
    {
        // Each new mask layout builds two graphs (about half a second each): f16 and the second
        // shape take the padding mask only.
        for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 1e-2)] {
            if i > 0 && dtype == DType::F16 {
                continue;
            }
            let x = |seed, dims: &[usize]| normal::<Cuda>(dims, seed, dtype, &dev);
            let (q, k, v, g) = (
                x(11, &[b, h, tq, d]),
                x(12, &[b, h, tk, d]),
                x(13, &[b, h, tk, d]),
                x(14, &[b, h, tq, d]),
            );
            for t in [&q, &k, &v, &g] {
                t.realize().unwrap();
            }
            let masks = boolean_masks((b, h, tq, tk));
            let all = i == 0 && dtype == DType::BF16;
            for m in masks.iter().take(if all { 3 } else { 1 }) {
                for additive in [false, true] {
                    if i > 0 && !additive {
                        continue;
                    }
                    let what = format!(
                        "{dtype} {:?} mask {:?} additive {additive}",
                        (b, h, tq, tk, d),
                        m.2
                    );
                    let (on_gpu, on_host) = if additive {
                        additive_mask(m, dtype, &dev)
                    } else {
                        (keep_mask::<Cuda>(m, &dev), keep_mask::<Cpu>(m, &cpu))
                    };
                    let before = kiln_backend_cuda::cudnn_attention_calls();
                    let got = masked_against_cpu(&what, [&q, &k, &v, &g], (&on_gpu, &on_host), tol);
                    let calls = kiln_backend_cuda::cudnn_attention_calls() - before;
                    assert_eq!(calls, 2, "{what}: forward and backward on cuDNN");
                    if m.0 {
                        // The last sequence is all padding: its outputs and dQ are exactly 0,
                        // and the backend's log-sum-exps of its rows kiln's +inf (cuDNN writes
                        // -inf there).
                        let per_seq = h * tq * d;
                        for (name, x) in [("out", &got[0]), ("dq", &got[1])] {
                            let last = &x[(b - 1) * per_seq..b * per_seq];
                            assert!(
                                last.iter().all(|&x| x == 0.0),
                                "{what}: {name} of a row that sees no key is not 0"
                            );
                        }
                        let lse = masked_lse(&q, &k, &v, &on_gpu);
                        let last = &lse[(b - 1) * h * tq..];
                        assert!(
                            last.iter().all(|&x| x == f64::INFINITY),
                            "{what}: the log-sum-exp of a row that sees no key is not +inf"
                        );
                    }
                }
            }
        }
    }
    // Under autocast an f32 additive mask follows the kernels' dtype (cast before it is
    // broadcast, as the composed path casts it to the scores' f32).
    let (b, h, tq, tk, d) = (2, 3, 50, 70, 64);
    let x = |seed, dims: &[usize]| normal::<Cuda>(dims, seed, DType::F32, &dev);
    let (q, k, v, g) = (
        x(21, &[b, h, tq, d]),
        x(22, &[b, h, tk, d]),
        x(23, &[b, h, tk, d]),
        x(24, &[b, h, tq, d]),
    );
    let (on_gpu, on_host) = additive_mask(&boolean_masks((b, h, tq, tk))[0], DType::F32, &dev);
    let before = kiln_backend_cuda::cudnn_attention_calls();
    let got = {
        let _amp = kiln_autograd::autocast(DType::BF16).unwrap();
        run_masked(&q, &k, &v, &g.to_dtype(DType::BF16).unwrap(), &on_gpu, None)
    };
    let calls = kiln_backend_cuda::cudnn_attention_calls() - before;
    assert_eq!(calls, 2, "autocast: forward and backward on cuDNN");
    let want = composed_on_cpu([&q, &k, &v, &g], &on_host);
    for (name, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        assert_close(
            &format!("autocast, f32 additive mask: {name}"),
            got,
            want,
            3e-2,
        );
    }
}

/// Rows whose log-sum-exps fall below `-ln(f32::MAX)` (~ -88.7) on cuDNN: every score about
/// -120 (query feature 0 is 1, key feature 0 is -120·√d, as a "massive activation" head gives)
/// with no mask, a keep-all boolean mask and an all-zero additive one, at Tk 192, 128 and 320
/// and at one query over 128 keys. pytorch/pytorch#196678: cuDNN's Hopper backward scores the
/// padded half of its last 128-wide key tile 0 under a bias, and `exp(0 - lse)` overflows into
/// NaN in dQ when `Tk % 128 == 64`; PyTorch 2.11's cuDNN path gave 12288 NaN in dQ on this
/// construction at L 192 on the H200 (cuDNN 9.19, 2026-11-28), kiln's graph on the same library
/// none. NVIDIA/cudnn-frontend#1072 (cuDNN 9.25/9.26): NaN in dK and dV at one query over 128
/// keys without a mask. This keeps kiln clear of both: forward and backward on cuDNN, every
/// value finite and within bf16's precision of the f64 composed path on the CPU.
#[test]
fn very_negative_scores_keep_finite_gradients_on_cudnn() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(_on) = OnCudnn::on() else { return };
    let cpu = Cpu::device(0);
    let (b, h, d) = (2, 2, 64);
    for (tq, tk) in [(192, 192), (128, 128), (100, 320), (1, 128)] {
        // Small normal values with feature 0 set to `first`, as bf16 on the GPU.
        let x = |seed, t: usize, first: Option<f64>| {
            let n = normal::<Cpu>(&[b, h, t, d], seed, DType::F64, &cpu);
            let mut vals = f64s(&n);
            for (i, x) in vals.iter_mut().enumerate() {
                *x = match first {
                    Some(f) if i % d == 0 => f,
                    Some(_) => *x * 0.1,
                    None => *x,
                };
            }
            let t = Tensor::<Cuda>::from_vec(vals, [b, h, t, d], &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            t.realize().unwrap();
            t
        };
        let (q, k, v, g) = (
            x(31, tq, Some(1.0)),
            x(32, tk, Some(-120.0 * (d as f64).sqrt())),
            x(33, tk, None),
            x(34, tq, None),
        );
        let keep = (false, vec![1u8; tq * tk], vec![tq, tk]);
        let zeros = |dtype| Tensor::<Cuda>::zeros([tq, tk], dtype, &dev).unwrap();
        let masks = [
            ("no", (AttnMask::None, AttnMask::None)),
            (
                "keep-all boolean",
                (
                    keep_mask::<Cuda>(&keep, &dev),
                    keep_mask::<Cpu>(&keep, &cpu),
                ),
            ),
            (
                "all-zero additive",
                (
                    AttnMask::Additive(zeros(DType::BF16)),
                    AttnMask::Additive(on_cpu(&zeros(DType::F64))),
                ),
            ),
        ];
        for (name, (on_gpu, on_host)) in &masks {
            let what = format!("bf16 {:?}, {name} mask", (b, h, tq, tk, d));
            let before = kiln_backend_cuda::cudnn_attention_calls();
            let got = run_masked(&q, &k, &v, &g, on_gpu, None);
            let calls = kiln_backend_cuda::cudnn_attention_calls() - before;
            assert_eq!(calls, 2, "{what}: forward and backward on cuDNN");
            let want = composed_on_cpu([&q, &k, &v, &g], on_host);
            for (name, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                let bad = got.iter().filter(|x| !x.is_finite()).count();
                assert_eq!(bad, 0, "{what}: {bad} values of {name} are not finite");
                if *name == "dq" {
                    // Feature 0 sums dS against keys of -960: zero in exact arithmetic, bf16's
                    // rounding of dS times 120 on either side; the other features as usual.
                    let rest = |x: &[f64]| {
                        x.iter()
                            .enumerate()
                            .filter(|(i, _)| i % d != 0)
                            .map(|(_, &x)| x)
                            .collect::<Vec<_>>()
                    };
                    assert_close(&format!("{what}: dq"), &rest(got), &rest(want), 3e-2);
                } else {
                    assert_close(&format!("{what}: {name}"), got, want, 3e-2);
                }
            }
        }
    }
}
