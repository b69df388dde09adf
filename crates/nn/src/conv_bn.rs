//! Convolution + BatchNorm (+ activation), folded into one convolution in eval mode.
//!
//! Why: in evaluation mode a batch norm normalizes with its running statistics, so after a
//! convolution it is a fixed affine map per output channel, and `act(bn(conv(x, W) + b))`
//! equals `act(conv(x, W') + b')` with `s = γ / √(running_var + eps)`, `W' = W · s` (per output
//! channel) and `b' = (b − running_mean) · s + β` (`γ = 1`, `β = 0` without affine, `b = 0`
//! without a convolution bias). One convolution then does the work of a convolution and a
//! normalization pass over its whole output; where the backend offers it
//! ([`Backend::conv2d_bias_act`](kiln_core::Backend::conv2d_bias_act): cuDNN's runtime-fusion
//! engines on CUDA, by default for TF32 convolutions, the one math where that measured faster)
//! the bias add and the activation ride in the convolution's epilogue too, one kernel where
//! three passes over the activations ran. Elsewhere the folded convolution, a bias add and the
//! activation run one after the other.
//!
//! Two ways to get it:
//! - [`Conv2d::fold_batch_norm`]: a new `Conv2d` with the folded parameters (PyTorch's
//!   `torch.nn.utils.fusion.fuse_conv_bn_eval`), for a model exported for inference;
//! - [`ConvBnAct`]: the layers as one module that trains as before (convolution, the batch
//!   norm on the batch's statistics, the activation) and in eval mode runs the folded
//!   convolution. Its parameters and buffers are the convolution's and the batch norm's
//!   under their own names (`conv.weight`, `bn.running_mean`, ... or names of the caller's
//!   choosing, [`ConvBnAct::with_names`]), so a PyTorch state dict loads unchanged.
//!
//! The folded weight and bias are computed on the first eval forward and kept while the
//! tensors they come from are the same ones ([`Tensor::same_storage`]): an optimizer step, a
//! loaded state dict or `to_device` sets new tensors, and the next eval forward folds again.
//! (An in-place update inside a CUDA graph capture of a training step is the one change this
//! does not see; call [`ConvBnAct::refold`] after replaying one.)
//!
//! Gradients: the fused kernel is forward only. An eval forward that records for a backward
//! (gradient mode on, and the input or a parameter requiring a gradient, as with fine-tuning
//! on frozen batch statistics) folds with differentiable ops instead, so the convolution's and
//! the batch norm's parameters get their gradients as through the unfused layers. Inference
//! under [`kiln_autograd::no_grad`] (PyTorch's `torch.no_grad()`) takes the cached fold and the
//! fused kernel.

use std::sync::Mutex;

use kiln_autograd::{Var, is_grad_enabled, no_grad};
use kiln_core::{Activation, Backend, DType, Error, Result, Tensor};

use crate::batch_norm::BatchNorm;
use crate::conv::Conv2d;
use crate::module::Module;

/// The fold's arithmetic dtype for operands of `d`: f64 for f64, f32 otherwise (16-bit
/// weights are folded in f32 and rounded once).
fn fold_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Checks that `bn` can follow `conv`: as many channels as it has outputs, float dtypes.
fn check_pair<B: Backend>(op: &'static str, conv: &Conv2d<B>, bn: &BatchNorm<B>) -> Result<()> {
    let (oc, c) = (conv.config().out_channels, bn.config().num_features);
    if oc != c {
        return Err(Error::invalid(
            op,
            format!("the batch norm has {c} channels but the convolution {oc} outputs"),
        ));
    }
    for d in [conv.weight.dtype(), bn.config().dtype] {
        if !d.is_float() {
            return Err(Error::DTypeMismatch {
                op,
                expected: "a float dtype".into(),
                got: d,
            });
        }
    }
    Ok(())
}

/// `(W', b')` (module docs) in `out`, by differentiable ops on the parameters (the running
/// statistics are constants); under [`no_grad`] nothing is recorded. An error naming `op` for
/// a batch norm without running statistics.
fn fold_vars<B: Backend>(
    op: &'static str,
    conv: &Conv2d<B>,
    bn: &BatchNorm<B>,
    out: DType,
) -> Result<(Var<B>, Var<B>)> {
    let (Some(rm), Some(rv)) = (&bn.running_mean, &bn.running_var) else {
        return Err(Error::invalid(
            op,
            "the batch norm tracks no running statistics (track_running_stats = false): it \
             normalizes with each batch's, which no fixed convolution can fold",
        ));
    };
    let fd = fold_dtype(conv.weight.dtype());
    let oc = conv.config().out_channels;
    let inv_std = Var::constant(
        rv.tensor()
            .to_dtype(fd)?
            .add_scalar(bn.config().eps)?
            .rsqrt()?,
    );
    let scale = match &bn.weight {
        Some(g) => g.to_dtype(fd)?.mul(&inv_std)?,
        None => inv_std,
    };
    let mean = Var::constant(rm.tensor().to_dtype(fd)?);
    let w = conv
        .weight
        .to_dtype(fd)?
        .mul(&scale.reshape([oc, 1, 1, 1])?)?;
    let shift = match &conv.bias {
        Some(b) => b.to_dtype(fd)?.sub(&mean)?,
        None => mean.neg()?,
    };
    let mut b = shift.mul(&scale)?;
    if let Some(beta) = &bn.bias {
        b = b.add(&beta.to_dtype(fd)?)?;
    }
    Ok((w.to_dtype(out)?, b.to_dtype(out)?))
}

impl<B: Backend> Conv2d<B> {
    /// This convolution with the eval-mode batch norm `bn` after it folded in (module docs): a
    /// new layer, with a bias, whose output equals `bn(self(x))` with `bn`'s running
    /// statistics (PyTorch's `fuse_conv_bn_eval`). Its parameters are new leaves in this
    /// layer's dtype, computed now: later changes to `self` or `bn` do not reach it.
    ///
    /// Errors: `bn` in training mode (it would normalize with batch statistics, which no fixed
    /// convolution reproduces: call `eval()` first) or tracking no running statistics, a
    /// channel count other than this layer's outputs, a dtype that is not a float.
    pub fn fold_batch_norm(&self, bn: &BatchNorm<B>) -> Result<Conv2d<B>> {
        const OP: &str = "Conv2d::fold_batch_norm";
        check_pair(OP, self, bn)?;
        if bn.is_training() {
            return Err(Error::invalid(
                OP,
                "the batch norm is in training mode; folding uses its running statistics \
                 (call eval() on it first)",
            ));
        }
        let (w, b) = no_grad(|| fold_vars(OP, self, bn, self.weight.dtype()))?;
        Ok(self.with_params(w.tensor(), b.tensor()))
    }
}

/// A fold computed for a dtype, and the tensors it was computed from.
struct Folded<B: Backend> {
    sources: Vec<Tensor<B>>,
    dtype: DType,
    weight: Tensor<B>,
    bias: Tensor<B>,
}

/// [`Conv2d`], then [`BatchNorm`], then an activation, as one module that folds the batch
/// norm into the convolution in eval mode (module docs).
///
/// ```
/// use kiln_autograd::{Var, no_grad};
/// use kiln_backend_cpu::Cpu;
/// use kiln_core::{Activation, Backend, Generator};
/// use kiln_nn::{BatchNormConfig, Conv2dConfig, ConvBnAct, Module, ModuleExt};
///
/// let (dev, mut g) = (Cpu::device(0), Generator::new(0));
/// let conv = Conv2dConfig::new(3, 8, 3).with_padding(1).with_bias(false).init::<Cpu>(&dev, &mut g)?;
/// let bn = BatchNormConfig::new(8).init_2d::<Cpu>(&dev)?;
/// let mut layer = ConvBnAct::new(conv, bn, Activation::Relu)?;
/// let x = Var::constant(g.rand::<Cpu>([2, 3, 6, 6], &dev)?);
/// layer.forward(&x)?; // training mode: batch statistics, running ones updated
/// layer.eval();
/// let y = no_grad(|| layer.forward(&x))?; // one folded convolution (+ bias and ReLU)
/// assert_eq!(y.dims(), [2, 8, 6, 6]);
/// assert!(layer.named_buffers().iter().any(|(n, _)| n == "bn.running_mean"));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub struct ConvBnAct<B: Backend> {
    pub conv: Conv2d<B>,
    pub bn: BatchNorm<B>,
    act: Activation,
    /// The prefixes of the convolution's and the batch norm's names.
    names: [String; 2],
    fold: bool,
    cache: Mutex<Option<Folded<B>>>,
}

impl<B: Backend> ConvBnAct<B> {
    /// `act(bn(conv(x)))`, named `conv.*` and `bn.*`. Errors: a batch norm whose channel
    /// count is not the convolution's output count, a dtype that is not a float.
    pub fn new(conv: Conv2d<B>, bn: BatchNorm<B>, act: Activation) -> Result<Self> {
        check_pair("ConvBnAct::new", &conv, &bn)?;
        Ok(ConvBnAct {
            conv,
            bn,
            act,
            names: ["conv".into(), "bn".into()],
            fold: true,
            cache: Mutex::new(None),
        })
    }

    /// Names the two layers' parameters and buffers `{conv}.weight`, `{bn}.running_mean`, ...
    /// (e.g. `conv1` and `bn1` in a torchvision ResNet), instead of `conv` and `bn`.
    pub fn with_names(mut self, conv: impl Into<String>, bn: impl Into<String>) -> Self {
        self.names = [conv.into(), bn.into()];
        self
    }

    /// Whether eval mode folds (the default) or runs the three layers one after the other
    /// (for comparing the two).
    pub fn set_fold(&mut self, fold: bool) {
        self.fold = fold;
    }

    pub fn activation(&self) -> Activation {
        self.act
    }

    /// Whether a forward now runs the folded convolution: eval mode, folding on, running
    /// statistics tracked.
    pub fn folds(&self) -> bool {
        self.fold && !self.bn.is_training() && self.bn.running_mean.is_some()
    }

    /// Forgets the cached fold: the next eval forward folds again (module docs).
    pub fn refold(&self) {
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The tensors the fold reads, in a fixed order.
    fn sources(&self) -> Vec<Tensor<B>> {
        let bn = &self.bn;
        [
            Some(&self.conv.weight),
            self.conv.bias.as_ref(),
            bn.weight.as_ref(),
            bn.bias.as_ref(),
            bn.running_mean.as_ref(),
            bn.running_var.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(Var::tensor)
        .collect()
    }

    /// The folded weight and bias in `dtype`, from the cache while their sources are the same
    /// tensors, else computed (without recording) and cached.
    fn folded(&self, dtype: DType) -> Result<(Tensor<B>, Tensor<B>)> {
        let sources = self.sources();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = &*cache
            && f.dtype == dtype
            && f.sources.len() == sources.len()
            && f.sources
                .iter()
                .zip(&sources)
                .all(|(a, b)| a.same_storage(b))
        {
            return Ok((f.weight.clone(), f.bias.clone()));
        }
        let (w, b) = no_grad(|| fold_vars("ConvBnAct", &self.conv, &self.bn, dtype))?;
        let (weight, bias) = (w.tensor(), b.tensor());
        weight.realize()?;
        bias.realize()?;
        *cache = Some(Folded {
            sources,
            dtype,
            weight: weight.clone(),
            bias: bias.clone(),
        });
        Ok((weight, bias))
    }

    /// The module's forward with activation `act` in place of its own.
    fn forward_act(&self, x: &Var<B>, act: Activation) -> Result<Var<B>> {
        if !self.folds() {
            return apply(self.bn.forward(&self.conv.forward(x)?)?, act);
        }
        let recording = is_grad_enabled()
            && (x.requires_grad() || self.parameters().iter().any(Var::requires_grad));
        if recording {
            // Differentiable fold: the parameters get their gradients (module docs).
            let (w, b) = fold_vars("ConvBnAct", &self.conv, &self.bn, self.conv.weight.dtype())?;
            return apply(self.conv.forward_with(x, &w, Some(&b))?, act);
        }
        // Inference: the convolution's dtype under autocast is the low one.
        let xl = x.autocast_low()?;
        let cin = self.conv.config().in_channels;
        let (w, b) = self.folded(xl.dtype())?;
        if xl.rank() == 4 && xl.dims()[1] == cin && w.dtype() == xl.dtype() {
            let spec = self.conv.spec();
            if let Some(y) = xl.tensor().conv2d_bias_act_native(&w, &b, spec, act)? {
                return Ok(Var::constant(y));
            }
        }
        let y = self
            .conv
            .forward_with(&xl, &Var::constant(w), Some(&Var::constant(b)))?;
        apply(y, act)
    }
}

/// `act(y)`.
fn apply<B: Backend>(y: Var<B>, act: Activation) -> Result<Var<B>> {
    match act.unary() {
        Some(op) => y.unary(op),
        None => Ok(y),
    }
}

/// `prefix.name` for each of `named`.
fn prefixed<B: Backend>(prefix: &str, named: Vec<(String, Var<B>)>) -> Vec<(String, Var<B>)> {
    named
        .into_iter()
        .map(|(n, v)| (format!("{prefix}.{n}"), v))
        .collect()
}

impl<B: Backend> Module<B> for ConvBnAct<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.forward_act(x, self.act)
    }

    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed(&self.names[0], self.conv.named_parameters());
        v.extend(prefixed(&self.names[1], self.bn.named_parameters()));
        v
    }

    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        prefixed(&self.names[1], self.bn.named_buffers())
    }

    fn set_training(&mut self, training: bool) {
        self.bn.set_training(training);
    }

    fn describe(&self) -> String {
        format!(
            "ConvBnAct({}, {}, {:?})",
            self.conv.describe(),
            self.bn.describe(),
            self.act
        )
    }

    /// A `ConvBnAct` without an activation of its own takes the one after it (in a
    /// [`Sequential`](crate::Sequential)) into its fold.
    fn forward_then(&self, x: &Var<B>, act: Activation) -> Option<Result<Var<B>>> {
        (self.act == Activation::Identity).then(|| self.forward_act(x, act))
    }
}
