//! The MNIST models the examples share: Chainer's MLP and a LeNet-style conv net.

use kiln_core::{Backend, Result};
use kiln_nn::{Conv2dConfig, Flatten, LinearConfig, MaxPool2d, Relu, Sequential, derive_seed};

/// 784-`hidden`-`hidden`-10 with ReLUs (Chainer's MNIST MLP with `hidden` = 100).
pub fn mlp<B: Backend>(hidden: usize, dev: &B::Device, seed: u64) -> Result<Sequential<B>> {
    let s = |i| derive_seed(seed, i);
    Ok(Sequential::new()
        .add(LinearConfig::new(784, hidden).init::<B>(dev, s(0))?)
        .add(Relu)
        .add(LinearConfig::new(hidden, hidden).init::<B>(dev, s(2))?)
        .add(Relu)
        .add(LinearConfig::new(hidden, 10).init::<B>(dev, s(4))?))
}

/// LeNet-style: conv 5×5 (6) → pool → conv 5×5 (16) → pool → 120 → 84 → 10, on `[b, 1, 28, 28]`.
/// Must match `lenet()` in bench/mnist_torch_check.py layer for layer: indices are names.
pub fn lenet<B: Backend>(dev: &B::Device, seed: u64) -> Result<Sequential<B>> {
    let s = |i| derive_seed(seed, i);
    Ok(Sequential::new()
        .add(
            Conv2dConfig::new(1, 6, 5)
                .with_padding(2)
                .init::<B>(dev, s(0))?,
        )
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Conv2dConfig::new(6, 16, 5).init::<B>(dev, s(3))?)
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Flatten)
        .add(LinearConfig::new(16 * 5 * 5, 120).init::<B>(dev, s(7))?)
        .add(Relu)
        .add(LinearConfig::new(120, 84).init::<B>(dev, s(9))?)
        .add(Relu)
        .add(LinearConfig::new(84, 10).init::<B>(dev, s(11))?))
}
