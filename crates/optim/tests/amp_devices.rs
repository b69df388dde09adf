//! f16 training with the GradScaler survives a planted overflow, on the CPU and on a GPU (the
//! same generic code): the step with an infinite gradient is skipped (every parameter keeps its
//! bits), the scale halves, and training goes on to the accuracy of the same run without the
//! overflow. Without a GPU the CUDA test prints `skipped: no CUDA device ...`.

use kiln_autograd::{Var, autocast};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType, Generator, RandDist, Reduction, Tensor};
use kiln_nn::{LinearConfig, Module, Relu, Sequential};
use kiln_optim::{AdamConfig, GradScaler, GradScalerConfig, Optimizer};

/// Four Gaussian blobs in 16 dimensions (noise drawn with `seed`), labels `i64`.
fn blobs<B: Backend>(dev: &B::Device, seed: u64, n: usize) -> (Tensor<B>, Tensor<B>) {
    let normal = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    let centers = Generator::new(1)
        .sample::<B>([4, 16], normal, DType::F32, dev)
        .unwrap()
        .mul_scalar(1.5)
        .unwrap();
    let labels: Vec<i64> = (0..n).map(|i| (i % 4) as i64).collect();
    let y = Tensor::<B>::from_vec(labels, [n], dev).unwrap();
    let noise = Generator::new(seed)
        .sample::<B>([n, 16], normal, DType::F32, dev)
        .unwrap();
    (centers.index_select(0, &y).unwrap().add(&noise).unwrap(), y)
}

fn bits<B: Backend>(params: &[Var<B>]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| {
            let v = p.tensor().to_vec::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

/// Trains a 16-64-4 MLP for 150 Adam steps under f16 autocast with a GradScaler (scale 2^16),
/// planting an infinite gradient at step `plant` when given; returns the test accuracy and the
/// scales seen after each step.
fn train_f16<B: Backend>(dev: &B::Device, plant: Option<usize>) -> (f64, Vec<f64>) {
    let (x, y) = blobs::<B>(dev, 7, 512);
    let (xt, yt) = blobs::<B>(dev, 8, 512);
    let mut g = Generator::new(3);
    let model = Sequential::new()
        .add(LinearConfig::new(16, 64).init::<B>(dev, &mut g).unwrap())
        .add(Relu)
        .add(LinearConfig::new(64, 4).init::<B>(dev, &mut g).unwrap());
    let params = model.parameters();
    let mut opt = AdamConfig::new(1e-2).init(params.clone()).unwrap();
    let mut scaler: GradScaler<B> = GradScalerConfig::new().init().unwrap();
    let x = Var::constant(x);
    let mut scales = Vec::new();
    for step in 0..150 {
        let loss = {
            let _amp = autocast(DType::F16).unwrap();
            model
                .forward(&x)
                .unwrap()
                .cross_entropy(&y, Reduction::Mean)
                .unwrap()
        };
        scaler.scale(&loss).unwrap().backward().unwrap();
        let before = bits(&params);
        if plant == Some(step) {
            let g = params[2].grad().unwrap();
            let mut v = g.to_vec::<f32>().unwrap();
            v[5] = f32::INFINITY;
            params[2]
                .set_grad(Some(Tensor::from_vec(v, g.dims().to_vec(), dev).unwrap()))
                .unwrap();
        }
        let stepped = scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        opt.zero_grad();
        assert_eq!(
            stepped,
            plant != Some(step),
            "step {step} stepped: {stepped}"
        );
        if !stepped {
            assert_eq!(bits(&params), before, "a skipped step changed a parameter");
        }
        scales.push(scaler.get_scale());
    }
    let logits = kiln_autograd::no_grad(|| {
        let _amp = autocast(DType::F16).unwrap();
        model.forward(&Var::constant(xt)).unwrap().tensor()
    });
    let pred = logits.argmax(-1, false).unwrap().to_f64_vec().unwrap();
    let want = yt.to_f64_vec().unwrap();
    let acc = pred.iter().zip(&want).filter(|(a, b)| a == b).count() as f64 / want.len() as f64;
    (acc, scales)
}

fn planted_overflow_is_survived<B: Backend>(dev: &B::Device) {
    let (clean, clean_scales) = train_f16::<B>(dev, None);
    let (planted, scales) = train_f16::<B>(dev, Some(40));
    eprintln!("{dev}: accuracy clean {clean}, with a planted overflow {planted}");
    assert!(clean > 0.9, "the problem is learnable: {clean}");
    assert!(
        clean_scales.iter().all(|&s| s == 65536.0),
        "{clean_scales:?}"
    );
    assert_eq!(scales[39], 65536.0);
    assert_eq!(scales[40], 32768.0, "the scale halves at the planted step");
    assert!(planted >= clean - 0.02, "{planted} vs {clean}");
}

#[test]
fn f16_scaler_survives_a_planted_overflow_on_the_cpu() {
    planted_overflow_is_survived::<Cpu>(&Cpu::device(0));
}

#[test]
fn f16_scaler_survives_a_planted_overflow_on_the_gpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    planted_overflow_is_survived::<Cuda>(&dev);
}
