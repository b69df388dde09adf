//! The GradScaler's multi-tensor unscale and inf/NaN check (`kernels/amp.cu`, `amp.rs`) on a
//! GPU: kiln-core's planted inf/-inf/NaN checks (first, middle, last element; small gradients
//! and ones larger than a grid-stride pass; f32/f64/f16/bf16; more gradients than one launch
//! takes), the kernel against the composed default on the same device, bit for bit, the
//! launch count, and a CUDA graph capture. Gradient clipping's squared norm (`Tensor::sq_sum`,
//! the same file's multi-tensor kernel): exact sums, the same bits on every call, its launches.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cuda::{Cuda, CudaGraph, gpu_or_skip, thread_launches, write_static};
use kiln_core::backend::{sq_sum_composed, unscale_check_composed};
use kiln_core::testing::{
    check_sq_sum, check_sq_sum_errors, check_unscale_check, check_unscale_check_errors,
};
use kiln_core::{Backend, DType, Generator, RandDist, Tensor, UnscaleSlot};

/// More than one grid-stride pass of the kernel on any current GPU (an H100's grid covers
/// about 1.1M elements of 256-thread blocks).
const LARGE: usize = 3_000_017;

#[test]
fn planted_inf_and_nan_are_found_and_values_are_exact() {
    let Some(dev) = gpu_or_skip(0) else { return };
    check_unscale_check::<Cuda>(&dev, LARGE);
    check_unscale_check_errors::<Cuda>(&dev);
    println!("unscale_check: planted inf/-inf/NaN found in f32/f64/f16/bf16, values exact");
}

/// Normal gradients scaled up to overflow now and then in 16 bits (`std` 3e4 in f16: a few in
/// a thousand pass 65504), sizes 0, 1, odd and large.
fn grads(dev: &<Cuda as Backend>::Device, dtype: DType, std: f64) -> Vec<Tensor<Cuda>> {
    [0usize, 1, 3, 1000, 4097, 65_537, LARGE]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let d = RandDist::Normal { mean: 0.0, std };
            Generator::new(40 + i as u64)
                .sample::<Cuda>([n], d, DType::F32, dev)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
        })
        .collect()
}

#[test]
fn the_kernel_equals_the_composed_default_bit_for_bit() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (std, inv) in [(1.0, 1.0 / 3.0), (3e4, 2.0), (1.0, 2f64.powi(-16))] {
            let gs = grads(&dev, dtype, std);
            let (outs, flag) = Tensor::unscale_check(&gs, inv).unwrap();
            let slots: Vec<UnscaleSlot<'_, _>> = gs
                .iter()
                .map(|g| UnscaleSlot {
                    grad: g.storage(),
                    len: g.elem_count(),
                })
                .collect();
            let (couts, cflag) = unscale_check_composed::<Cuda>(dtype, inv, &slots).unwrap();
            let what = format!("{dtype} std {std} inv {inv}");
            let cflag = Tensor::<Cuda>::from_storage(cflag, [1], DType::F32);
            assert_eq!(
                flag.to_scalar().unwrap(),
                cflag.to_f64_vec().unwrap()[0],
                "{what}: flag"
            );
            for (k, (o, c)) in outs.iter().zip(couts).enumerate() {
                let c = Tensor::<Cuda>::from_storage(c, [o.elem_count()], dtype);
                let (a, b) = (o.to_f64_vec().unwrap(), c.to_f64_vec().unwrap());
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "{what}: gradient {k} element {i}: kernel {x} vs composed {y}"
                    );
                }
            }
        }
    }
    println!("unscale_check: kernel == composed default on the GPU, 4 dtypes");
}

#[test]
fn one_launch_for_sixty_two_gradients() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // A ResNet-18's parameter count; realized first, so that only the check launches.
    let gs: Vec<Tensor<Cuda>> = (0..62)
        .map(|i| Tensor::<Cuda>::full([100 + i * 37], 0.5, DType::F16, &dev).unwrap())
        .collect();
    for g in &gs {
        Cuda::realize(g.storage()).unwrap();
    }
    let before = thread_launches();
    let (_, flag) = Tensor::unscale_check(&gs, 0.25).unwrap();
    let launches = thread_launches() - before;
    assert!(launches <= 2, "62 gradients: {launches} launches");
    assert_eq!(flag.to_scalar().unwrap(), 0.0);
    // 300 gradients: one launch per 128.
    let gs: Vec<Tensor<Cuda>> = (0..300)
        .map(|_| Tensor::<Cuda>::full([5], 1.0, DType::F32, &dev).unwrap())
        .collect();
    for g in &gs {
        Cuda::realize(g.storage()).unwrap();
    }
    let before = thread_launches();
    let _ = Tensor::unscale_check(&gs, 0.25).unwrap();
    assert_eq!(
        thread_launches() - before,
        3,
        "300 gradients: three launches"
    );
    println!("unscale_check: 62 gradients in {launches} launch(es), 300 in 3");
}

#[test]
fn a_captured_check_replays_with_new_gradients() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let g0 = Tensor::<Cuda>::full([1000], 2.0, DType::F16, &dev).unwrap();
    let g1 = Tensor::<Cuda>::full([70_000], 4.0, DType::F16, &dev).unwrap();
    Cuda::realize(g0.storage()).unwrap();
    Cuda::realize(g1.storage()).unwrap();
    // Loads the f16 kernel before the capture (a capture records launches, not module loads).
    Tensor::unscale_check(std::slice::from_ref(&g0), 0.5).unwrap();
    let (graph, (outs, flag)) = CudaGraph::capture(&dev, || {
        Tensor::unscale_check(&[g0.clone(), g1.clone()], 0.5)
    })
    .unwrap();
    graph.replay().unwrap();
    assert_eq!(flag.to_scalar().unwrap(), 0.0, "clean replay");
    assert_eq!(outs[1].to_f64_vec().unwrap()[69_999], 2.0);
    let mut bad = vec![4.0f32; 70_000];
    bad[35_000] = f32::INFINITY;
    let src = Tensor::<Cuda>::from_slice(&bad, [70_000], &dev)
        .and_then(|t| t.to_dtype(DType::F16))
        .unwrap();
    write_static(&g1, &src).unwrap();
    graph.replay().unwrap();
    assert_eq!(flag.to_scalar().unwrap(), 1.0, "replay with an inf planted");
    // The memset is part of the graph: a clean replay lowers the flag again.
    write_static(
        &g1,
        &Tensor::<Cuda>::full([70_000], 4.0, DType::F16, &dev).unwrap(),
    )
    .unwrap();
    graph.replay().unwrap();
    assert_eq!(
        flag.to_scalar().unwrap(),
        0.0,
        "clean replay after a bad one"
    );
    println!("unscale_check: captured once, replayed clean, with an inf, clean again");
}

#[test]
fn squared_norms_are_exact_repeatable_and_take_two_launches() {
    let Some(dev) = gpu_or_skip(0) else { return };
    check_sq_sum::<Cuda>(&dev, LARGE);
    check_sq_sum_errors::<Cuda>(&dev);
    // Normal values (inexact sums): the same bits on every call, and close to the composed
    // default's (another order of summation).
    for dtype in [DType::F32, DType::F16] {
        let gs = grads(&dev, dtype, 1.0);
        let a = Tensor::sq_sum(&gs).unwrap().to_scalar().unwrap();
        let b = Tensor::sq_sum(&gs).unwrap().to_scalar().unwrap();
        assert_eq!(a.to_bits(), b.to_bits(), "{dtype}: two calls");
        let slots: Vec<UnscaleSlot<'_, _>> = gs
            .iter()
            .map(|g| UnscaleSlot {
                grad: g.storage(),
                len: g.elem_count(),
            })
            .collect();
        let c = sq_sum_composed::<Cuda>(dtype, &slots).unwrap();
        let c = Tensor::<Cuda>::from_storage(c, [1], DType::F64)
            .to_f64_vec()
            .unwrap()[0];
        assert!(
            (a - c).abs() <= 1e-12 * c,
            "{dtype}: kernel {a} vs composed {c}"
        );
    }
    // The GPT example's 39 gradients: one kernel and one fold.
    let gs: Vec<Tensor<Cuda>> = (0..39)
        .map(|i| Tensor::<Cuda>::full([100 + i * 1000], 0.5, DType::F32, &dev).unwrap())
        .collect();
    for g in &gs {
        Cuda::realize(g.storage()).unwrap();
    }
    let before = thread_launches();
    let s = Tensor::sq_sum(&gs).unwrap();
    assert_eq!(thread_launches() - before, 2, "39 tensors: two launches");
    let n: usize = (0..39).map(|i| 100 + i * 1000).sum();
    assert_eq!(s.to_scalar().unwrap(), 0.25 * n as f64);
    println!("sq_sum: exact in 4 dtypes, repeatable, 39 tensors in 2 launches");
}
