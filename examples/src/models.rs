//! The MNIST models the examples share: Chainer's MLP and a LeNet-style conv net.

use kiln_core::{Backend, Generator, Result};
use kiln_nn::{Conv2dConfig, Flatten, LinearConfig, MaxPool2d, Relu, Sequential};

/// 784-`hidden`-`hidden`-10 with ReLUs (Chainer's MNIST MLP with `hidden` = 100), its
/// parameters drawn from `g` layer by layer.
pub fn mlp<B: Backend>(hidden: usize, dev: &B::Device, g: &mut Generator) -> Result<Sequential<B>> {
    Ok(Sequential::new()
        .add(LinearConfig::new(784, hidden).init::<B>(dev, g)?)
        .add(Relu)
        .add(LinearConfig::new(hidden, hidden).init::<B>(dev, g)?)
        .add(Relu)
        .add(LinearConfig::new(hidden, 10).init::<B>(dev, g)?))
}

/// LeNet-style: conv 5×5 (6) → pool → conv 5×5 (16) → pool → 120 → 84 → 10, on `[b, 1, 28, 28]`.
/// Must match `lenet()` in bench/mnist_torch_check.py layer for layer: indices are names.
/// Parameters drawn from `g` layer by layer.
pub fn lenet<B: Backend>(dev: &B::Device, g: &mut Generator) -> Result<Sequential<B>> {
    Ok(Sequential::new()
        .add(
            Conv2dConfig::new(1, 6, 5)
                .with_padding(2)
                .init::<B>(dev, g)?,
        )
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Conv2dConfig::new(6, 16, 5).init::<B>(dev, g)?)
        .add(Relu)
        .add(MaxPool2d::new(2))
        .add(Flatten)
        .add(LinearConfig::new(16 * 5 * 5, 120).init::<B>(dev, g)?)
        .add(Relu)
        .add(LinearConfig::new(120, 84).init::<B>(dev, g)?)
        .add(Relu)
        .add(LinearConfig::new(84, 10).init::<B>(dev, g)?))
}
