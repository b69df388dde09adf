//! # kiln-nn
//!
//! The building blocks of a model, generic over the backend `B`, so one model definition
//! trains on the CPU or on a GPU:
//!
//! - [`Module`] (forward, named parameters and buffers, train/eval) and [`ModuleExt`] (`to_device`,
//!   `save`/`load`, `state_dict`), implemented by every layer;
//! - layers: [`Linear`], [`Conv2d`] (grouped and depthwise too), [`ConvBnAct`] (a convolution,
//!   a batch norm and an activation, folded into one convolution in eval mode), [`MaxPool2d`], [`AvgPool2d`],
//!   [`AdaptiveAvgPool2d`], [`Flatten`], [`Dropout`], [`LayerNorm`], [`RMSNorm`],
//!   [`BatchNorm`] (`BatchNorm1d`/`BatchNorm2d`, with running statistics as buffers),
//!   [`GroupNorm`], [`Embedding`], [`MultiheadAttention`] (with the functional
//!   [`multi_head_attention`]), activations ([`Relu`], [`Sigmoid`], [`Tanh`], [`Gelu`],
//!   [`GeluTanh`]) and the [`Sequential`] container;
//! - losses ([`loss::cross_entropy`] fused with log-softmax, [`loss::mse`],
//!   [`loss::bce_with_logits`]) and [`loss::accuracy`];
//! - initializers ([`Init`]) with PyTorch's formulas and defaults, drawing from a
//!   [`kiln_core::Generator`];
//! - safetensors I/O ([`serialize`]).
//!
//! Layers are built Burn-style from a config: `LinearConfig::new(784, 100).with_bias(true)
//! .init::<B>(&device, &mut generator)`, drawing from the [`kiln_core::Generator`] given (as
//! PyTorch's initializers take `generator=`), so a model built from `Generator::new(seed)` does
//! not depend on what else drew: the same seed gives the same weights on every backend
//! (Philox), which is what lets a GPU run be checked against a CPU run. Parameter names and layouts match PyTorch's `state_dict` (`0.weight` is
//! `[out, in]`), so a `.safetensors` file moves between kiln and PyTorch unchanged.
//!
//! ```
//! use kiln_autograd::Var;
//! use kiln_backend_cpu::Cpu;
//! use kiln_core::{Backend, Generator, Reduction, Tensor};
//! use kiln_nn::{LinearConfig, Module, ModuleExt, Relu, Sequential, loss};
//!
//! fn step<B: Backend>(dev: &B::Device, seed: u64) -> kiln_core::Result<f64> {
//!     let mut g = Generator::new(seed); // torch.Generator().manual_seed(seed)
//!     let model = Sequential::new()
//!         .add(LinearConfig::new(784, 100).init::<B>(dev, &mut g)?)
//!         .add(Relu)
//!         .add(LinearConfig::new(100, 10).init::<B>(dev, &mut g)?);
//!     let x = g.rand::<B>([8, 784], dev)?;
//!     let labels = Tensor::<B>::from_slice(&[3i64, 1, 4, 1, 5, 9, 2, 6], [8], dev)?;
//!     let loss = loss::cross_entropy(&model.forward(&Var::constant(x))?, &labels, Reduction::Mean)?;
//!     loss.backward()?;
//!     model.save(std::env::temp_dir().join("kiln-doc-mlp.safetensors"))?;
//!     loss.tensor().to_scalar()
//! }
//!
//! let l = step::<Cpu>(&Cpu::device(0), 7)?;
//! assert!(l > 0.0);
//! # Ok::<(), kiln_core::Error>(())
//! ```

mod activation;
mod attention;
mod batch_norm;
mod conv;
mod conv_bn;
mod conv_route;
mod dropout;
mod embedding;
pub mod init;
mod linear;
pub mod loss;
mod module;
mod norm;
mod pool;
mod sequential;
pub mod serialize;

pub use activation::{Flatten, Gelu, GeluTanh, Relu, Sigmoid, Tanh};
pub use attention::{
    MhaWeights, MultiheadAttention, MultiheadAttentionConfig, multi_head_attention,
};
pub use batch_norm::{
    BatchNorm, BatchNorm1d, BatchNorm2d, BatchNormConfig, GroupNorm, GroupNormConfig,
};
pub use conv::{
    Conv2d, Conv2dConfig, MaxPool2d, Window, conv2d, conv2d_grouped, conv2d_im2col_path,
    max_pool2d, max_pool2d_ceil,
};
pub use conv_bn::ConvBnAct;
pub use conv_route::{conv_routes_measured, conv_routing, set_conv_routing};
pub use dropout::Dropout;
pub use embedding::{Embedding, EmbeddingConfig};
pub use init::Init;
pub use linear::{Linear, LinearConfig};
pub use module::{Module, ModuleExt};
pub use norm::{LayerNorm, LayerNormConfig, RMSNorm, RMSNormConfig};
pub use pool::{AdaptiveAvgPool2d, AvgPool2d};
pub use sequential::Sequential;
pub use serialize::{load_safetensors, save_safetensors};
