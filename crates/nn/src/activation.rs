//! Parameter-free elementwise layers, so activations can sit in a [`Sequential`](crate::Sequential)
//! (and take an index there, keeping names aligned with PyTorch's `nn.Sequential`).

use kiln_autograd::Var;
use kiln_core::{Activation, Backend, Result};

use crate::module::Module;

macro_rules! activation {
    ($(#[$doc:meta])* $name:ident, $method:ident) => {
        activation!($(#[$doc])* $name, $method, None);
    };
    ($(#[$doc:meta])* $name:ident, $method:ident, $act:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name;

        impl<B: Backend> Module<B> for $name {
            fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
                x.$method()
            }
            fn named_parameters(&self) -> Vec<(String, Var<B>)> {
                Vec::new()
            }
            fn describe(&self) -> String {
                concat!(stringify!($name), "()").to_string()
            }
            fn as_activation(&self) -> Option<Activation> {
                $act
            }
        }
    };
}

activation!(
    /// `max(x, 0)`.
    Relu, relu, Some(Activation::Relu)
);
activation!(
    /// `1 / (1 + exp(-x))`.
    Sigmoid, sigmoid
);
activation!(
    /// `tanh(x)`.
    Tanh, tanh
);
activation!(
    /// The exact GELU, `x Φ(x)` (PyTorch's default, not the tanh approximation).
    Gelu, gelu, Some(Activation::Gelu)
);
activation!(
    /// GELU in its tanh form, `x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))` (PyTorch's
    /// `nn.GELU(approximate="tanh")`, GPT-2's activation).
    GeluTanh, gelu_tanh, Some(Activation::GeluTanh)
);

/// Collapses every axis after the first into one: `[n, c, h, w] -> [n, c*h*w]`
/// (`torch.nn.Flatten()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flatten;

impl<B: Backend> Module<B> for Flatten {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        x.flatten_from(1)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }
    fn describe(&self) -> String {
        "Flatten()".to_string()
    }
}
