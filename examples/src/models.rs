//! The MNIST models the examples share (Chainer's MLP and a LeNet-style conv net) and their
//! evaluation loop.

use kiln_autograd::{Var, no_grad};
use kiln_core::{Backend, Generator, Reduction, Result};
use kiln_data::DataLoader;
use kiln_nn::loss::{correct_count, cross_entropy};
use kiln_nn::{Conv2dConfig, Flatten, LinearConfig, MaxPool2d, Module, Relu, Sequential};

/// Mean loss and accuracy of a classifier over `loader`, in evaluation mode (dropout off,
/// running statistics) without recording a graph; the model is left in evaluation mode.
pub fn evaluate<B: Backend>(
    model: &mut dyn Module<B>,
    loader: &mut DataLoader<B>,
) -> Result<(f64, f64)> {
    model.set_training(false);
    no_grad(|| {
        let (mut loss, mut correct, mut n) = (0.0, 0usize, 0usize);
        for batch in loader.iter() {
            let (x, y) = batch?;
            let logits = model.forward(&Var::constant(x))?;
            let b = y.elem_count();
            loss += cross_entropy(&logits, &y, Reduction::Mean)?
                .tensor()
                .to_scalar()?
                * b as f64;
            correct += correct_count(&logits.tensor(), &y)?;
            n += b;
        }
        let n = n.max(1) as f64;
        Ok((loss / n, correct as f64 / n))
    })
}

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
