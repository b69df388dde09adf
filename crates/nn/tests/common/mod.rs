//! Cross-backend checks shared by `cpu.rs` (CPU against the f64 reference) and `cuda.rs`
//! (CUDA against the CPU): the same seed must give the same weights, Dropout masks and
//! training trajectory on every backend, because every backend draws from the same Philox.

#![allow(dead_code)]

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Generator, RandDist, Reduction, Tensor};
use kiln_nn::{
    Conv2dConfig, Dropout, EmbeddingConfig, Flatten, GeluTanh, LayerNormConfig, LinearConfig,
    MaxPool2d, Module, ModuleExt, RMSNormConfig, Relu, Sequential, loss,
};
use kiln_optim::{AdamConfig, Optimizer};

pub fn host(t: &Tensor<impl Backend>) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

pub use kiln_core::testing::assert_close;

/// A small LeNet-like net (conv with padding, pool, conv, pool, linear) in `dtype`.
pub fn small_net<B: Backend>(dev: &B::Device, dtype: DType) -> Sequential<B> {
    let mut g = Generator::new(7);
    Sequential::new()
        .add(
            Conv2dConfig::new(1, 4, 3)
                .with_padding(1)
                .with_dtype(dtype)
                .init::<B>(dev, &mut g)
                .unwrap(),
        )
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(
            Conv2dConfig::new(4, 6, 3)
                .with_dtype(dtype)
                .init::<B>(dev, &mut g)
                .unwrap(),
        )
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Flatten)
        .add(
            LinearConfig::new(6 * 2 * 2, 5)
                .with_dtype(dtype)
                .init::<B>(dev, &mut g)
                .unwrap(),
        )
}

/// Trains `small_net` for a few Adam steps on fixed random data and returns every loss and the
/// final weights.
pub fn trajectory<B: Backend>(dev: &B::Device) -> (Vec<f64>, Vec<Vec<f64>>) {
    let net = small_net::<B>(dev, DType::F32);
    let x = Generator::new(1).rand::<B>([8, 1, 12, 12], dev).unwrap();
    let y = Tensor::<B>::from_vec((0..8).map(|i| i % 5).collect::<Vec<i64>>(), [8], dev).unwrap();
    let mut opt = AdamConfig::new(1e-2).init(net.parameters()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..5 {
        opt.zero_grad();
        let l = loss::cross_entropy(
            &net.forward(&Var::constant(x.clone())).unwrap(),
            &y,
            Reduction::Mean,
        )
        .unwrap();
        losses.push(l.tensor().to_scalar().unwrap());
        l.backward().unwrap();
        opt.step().unwrap();
    }
    let weights = net.parameters().iter().map(|p| host(&p.tensor())).collect();
    (losses, weights)
}

/// The masks of the first `k` training forwards of a `Dropout(0.3)` built from generator 5.
pub fn dropout_masks<B: Backend>(dev: &B::Device, k: usize) -> Vec<Vec<f64>> {
    let d = Dropout::new(0.3, &mut Generator::new(5)).unwrap();
    let x = Var::constant(Tensor::<B>::ones([3, 257], DType::F32, dev).unwrap());
    (0..k)
        .map(|_| host(&d.forward(&x).unwrap().tensor()))
        .collect()
}

/// Forward of `small_net` (fresh from its seed) on fixed inputs.
pub fn forward<B: Backend>(dev: &B::Device, dtype: DType) -> Vec<f64> {
    let net = small_net::<B>(dev, dtype);
    let x = Generator::new(3)
        .sample::<B>(
            [4, 1, 12, 12],
            RandDist::Uniform {
                low: -1.0,
                high: 1.0,
            },
            dtype,
            dev,
        )
        .unwrap();
    host(&net.forward(&Var::constant(x)).unwrap().tensor())
}

/// The layers of a transformer in a row: embedding (with a padding id), layer norm, MLP with
/// the tanh GELU and dropout, RMS norm, layer norm without bias.
pub fn transformer_layers<B: Backend>(dev: &B::Device, dtype: DType) -> Sequential<B> {
    let mut g = Generator::new(11);
    let ln = |bias| {
        LayerNormConfig::new([8])
            .with_bias(bias)
            .with_dtype(dtype)
            .init::<B>(dev)
            .unwrap()
    };
    Sequential::new()
        .add(
            EmbeddingConfig::new(13, 8)
                .with_padding_idx(Some(0))
                .with_dtype(dtype)
                .init::<B>(dev, &mut g)
                .unwrap(),
        )
        .add(ln(true))
        .add(
            LinearConfig::new(8, 16)
                .with_dtype(dtype)
                .init::<B>(dev, &mut g)
                .unwrap(),
        )
        .add(GeluTanh)
        .add(Dropout::new(0.2, &mut g).unwrap())
        .add(
            LinearConfig::new(16, 8)
                .with_dtype(dtype)
                .init::<B>(dev, &mut g)
                .unwrap(),
        )
        .add(
            RMSNormConfig::new([8])
                .with_dtype(dtype)
                .init::<B>(dev)
                .unwrap(),
        )
        .add(ln(false))
}

/// [`transformer_layers`] on fixed ids (padding ids included), perturbed norm weights, in
/// training or eval mode: the output, then every parameter's gradient of `sum(y · c)` for a
/// fixed `c`.
pub fn transformer_forward_backward<B: Backend>(
    dev: &B::Device,
    dtype: DType,
    training: bool,
) -> Vec<Vec<f64>> {
    let mut net = transformer_layers::<B>(dev, dtype);
    if !training {
        net.eval();
    }
    for (name, p) in net.named_parameters() {
        if !name.starts_with('0') {
            // Ones and zeros would hide a swapped weight and bias. Drawn in `dtype`: f32
            // normals differ between devices by an ulp (their `log`/`cos`), which an f64
            // comparison at 1e-12 would see.
            let normal = RandDist::Normal {
                mean: 0.0,
                std: 0.5,
            };
            let bump = Generator::new(3)
                .sample::<B>(p.dims().to_vec(), normal, dtype, dev)
                .unwrap();
            p.set_tensor(p.tensor().add(&bump).unwrap()).unwrap();
        }
    }
    let ids: Vec<i64> = (0..2 * 5).map(|i| (i * 7) % 13).collect();
    let ids = Tensor::<B>::from_vec(ids, [2, 5], dev).unwrap();
    let y = net.forward(&Var::constant(ids)).unwrap();
    let c = Generator::new(4)
        .sample::<B>(
            [2, 5, 8],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            dtype,
            dev,
        )
        .unwrap();
    y.mul(&Var::constant(c))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut out = vec![host(&y.tensor())];
    out.extend(net.parameters().iter().map(|p| host(&p.grad().unwrap())));
    out
}
