//! Parameter initializers with PyTorch's formulas, drawing from a [`Generator`].
//!
//! Every initializer that draws takes the generator to draw from (`torch.nn.init`'s
//! `generator=`), one draw per tensor, so one `Generator::new(seed)` gives the same weights on
//! every backend and every run: a model built on the GPU starts from exactly the numbers the
//! CPU run starts from. A layer draws its weight, then its bias, from the generator it is given,
//! so the layers of a model built from one generator never share numbers; pass
//! `&mut kiln_core::default_generator()` to draw from the process-wide one (`torch.manual_seed`).
//!
//! Fans follow `torch.nn.init._calculate_fan_in_and_fan_out`: for a weight of shape
//! `[out, in, k...]`, `fan_in = in * prod(k)` and `fan_out = out * prod(k)`.

use kiln_core::{Backend, DType, Error, Generator, RandDist, Result, Shape, Tensor};

/// How to fill a new parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    Constant(f64),
    /// `U(low, high)`.
    Uniform {
        low: f64,
        high: f64,
    },
    /// `N(mean, std²)`.
    Normal {
        mean: f64,
        std: f64,
    },
    /// `torch.nn.init.kaiming_uniform_(w, a, mode='fan_in', nonlinearity='leaky_relu')`:
    /// `U(-b, b)` with `b = gain * sqrt(3 / fan_in)`, `gain = sqrt(2 / (1 + a²))`.
    /// With `a = √5` (PyTorch's Linear/Conv default) `b = 1 / sqrt(fan_in)`.
    KaimingUniform {
        a: f64,
    },
    /// `torch.nn.init.kaiming_normal_(w, a, mode='fan_in', nonlinearity='leaky_relu')`:
    /// `N(0, (gain / sqrt(fan_in))²)`; `a = 0` is He init for ReLU.
    KaimingNormal {
        a: f64,
    },
    /// `torch.nn.init.xavier_uniform_(w, gain)`: `U(-b, b)`, `b = gain * sqrt(6 / (fan_in + fan_out))`.
    XavierUniform {
        gain: f64,
    },
    /// `torch.nn.init.xavier_normal_(w, gain)`: `N(0, (gain * sqrt(2 / (fan_in + fan_out)))²)`.
    XavierNormal {
        gain: f64,
    },
    /// PyTorch's default bias of Linear and Conv: `U(-1/sqrt(fan_in), 1/sqrt(fan_in))`, where
    /// `fan_in` is that of the layer's weight (the bias itself is 1-d), given here.
    BiasUniform {
        fan_in: usize,
    },
}

impl Init {
    /// PyTorch's default for Linear and Conv weights: Kaiming uniform with `a = √5`.
    pub fn torch_default() -> Self {
        Init::KaimingUniform { a: 5f64.sqrt() }
    }

    /// A new tensor of `shape` filled as `self` says, drawn from `generator` (one draw; none
    /// for the constant fills).
    pub fn init<B: Backend>(
        self,
        shape: impl Into<Shape>,
        generator: &mut Generator,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B>> {
        let shape = shape.into();
        if !dtype.is_float() {
            return Err(Error::DTypeMismatch {
                op: "init",
                expected: "a float dtype (f32, f64, f16, bf16)".into(),
                got: dtype,
            });
        }
        let mut draw = |dist: RandDist| generator.sample(shape.clone(), dist, dtype, device);
        match self {
            Init::Zeros => Tensor::zeros(shape, dtype, device),
            Init::Ones => Tensor::ones(shape, dtype, device),
            Init::Constant(c) => Tensor::full(shape, c, dtype, device),
            Init::Uniform { low, high } => draw(RandDist::Uniform { low, high }),
            Init::Normal { mean, std } => draw(RandDist::Normal { mean, std }),
            Init::KaimingUniform { a } => {
                let (fan_in, _) = fans(&shape)?;
                draw(uniform(leaky_gain(a) * (3.0 / fan_in as f64).sqrt()))
            }
            Init::KaimingNormal { a } => {
                let (fan_in, _) = fans(&shape)?;
                draw(normal(leaky_gain(a) / (fan_in as f64).sqrt()))
            }
            Init::XavierUniform { gain } => {
                let (fi, fo) = fans(&shape)?;
                draw(uniform(gain * (6.0 / (fi + fo) as f64).sqrt()))
            }
            Init::XavierNormal { gain } => {
                let (fi, fo) = fans(&shape)?;
                draw(normal(gain * (2.0 / (fi + fo) as f64).sqrt()))
            }
            Init::BiasUniform { fan_in } => {
                let b = if fan_in == 0 {
                    0.0
                } else {
                    1.0 / (fan_in as f64).sqrt()
                };
                draw(uniform(b))
            }
        }
    }
}

/// `torch.nn.init.calculate_gain('leaky_relu', a)`.
fn leaky_gain(a: f64) -> f64 {
    (2.0 / (1.0 + a * a)).sqrt()
}

/// `(fan_in, fan_out)` of a weight of shape `[out, in, k...]`, as PyTorch computes them.
pub fn fans(shape: &Shape) -> Result<(usize, usize)> {
    let d = shape.dims();
    if d.len() < 2 {
        return Err(Error::invalid(
            "init",
            format!("fan in and fan out need a shape of rank >= 2, got {shape}"),
        ));
    }
    let receptive: usize = d[2..].iter().product();
    let (fi, fo) = (d[1] * receptive, d[0] * receptive);
    if fi == 0 || fo == 0 {
        return Err(Error::invalid(
            "init",
            format!("cannot initialize an empty weight of shape {shape}"),
        ));
    }
    Ok((fi, fo))
}

/// `U(-b, b)`.
fn uniform(b: f64) -> RandDist {
    RandDist::Uniform { low: -b, high: b }
}

/// `N(0, std²)`.
fn normal(std: f64) -> RandDist {
    RandDist::Normal { mean: 0.0, std }
}
