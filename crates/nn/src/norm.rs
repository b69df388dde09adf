//! Normalization layers: [`LayerNorm`] (`torch.nn.LayerNorm`) and [`RMSNorm`]
//! (`torch.nn.RMSNorm`), over the trailing dims of their input.
//!
//! Parameters and their names are PyTorch's (`weight` of the normalized shape, initialized to
//! ones; `bias`, zeros), so a PyTorch state dict loads unchanged. The math is
//! [`Var::layer_norm`] / [`Var::rms_norm`]: one recorded op each, whose forward and backward
//! run as kiln expression programs on every backend.

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Result, Tensor};

use crate::module::Module;

/// Configuration of a [`LayerNorm`] (`LayerNormConfig::new(vec![384]).init::<B>(&dev)`), with
/// PyTorch's defaults: `eps = 1e-5`, an affine weight and bias.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormConfig {
    /// The normalized shape: the trailing dims of the input (PyTorch's `normalized_shape`).
    pub dims: Vec<usize>,
    pub eps: f64,
    /// A learned weight (PyTorch's `elementwise_affine`).
    pub affine: bool,
    /// A learned bias too (only with `affine`; PyTorch's `bias`).
    pub bias: bool,
    pub dtype: DType,
}

impl LayerNormConfig {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        LayerNormConfig {
            dims: dims.into(),
            eps: 1e-5,
            affine: true,
            bias: true,
            dtype: DType::F32,
        }
    }
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the parameters on `device`: the weight ones and the bias zeros (nothing is
    /// drawn).
    pub fn init<B: Backend>(self, device: &B::Device) -> Result<LayerNorm<B>> {
        check_config("LayerNormConfig::init", &self.dims, self.eps, self.dtype)?;
        let weight = affine_param::<B>(self.affine, true, &self.dims, self.dtype, device)?;
        let bias = affine_param::<B>(
            self.affine && self.bias,
            false,
            &self.dims,
            self.dtype,
            device,
        )?;
        Ok(LayerNorm {
            dims: self.dims,
            eps: self.eps,
            weight,
            bias,
        })
    }
}

/// `(x - mean) / √(var + eps) · weight + bias` over the trailing [`LayerNorm::dims`] of `x`.
pub struct LayerNorm<B: Backend> {
    dims: Vec<usize>,
    eps: f64,
    /// Of the normalized shape; `None` without `affine`.
    pub weight: Option<Var<B>>,
    /// Of the normalized shape; `None` without `affine` or `bias`.
    pub bias: Option<Var<B>>,
}

impl<B: Backend> LayerNorm<B> {
    /// The normalized shape.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl<B: Backend> Module<B> for LayerNorm<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        x.layer_norm(
            &self.dims,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        named(&self.weight, &self.bias)
    }
    fn describe(&self) -> String {
        format!(
            "LayerNorm({:?}, eps={}, affine={}, bias={})",
            self.dims,
            self.eps,
            self.weight.is_some(),
            self.bias.is_some()
        )
    }
}

/// Configuration of an [`RMSNorm`] (`RMSNormConfig::new(vec![384]).init::<B>(&dev)`), with
/// PyTorch's defaults: `eps = None` (the machine epsilon of the input's dtype, as
/// `torch.finfo(x.dtype).eps`) and an affine weight.
#[derive(Clone, Debug, PartialEq)]
pub struct RMSNormConfig {
    /// The normalized shape: the trailing dims of the input.
    pub dims: Vec<usize>,
    /// `None`: the machine epsilon of the input's dtype.
    pub eps: Option<f64>,
    /// A learned weight (PyTorch's `elementwise_affine`).
    pub affine: bool,
    pub dtype: DType,
}

impl RMSNormConfig {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        RMSNormConfig {
            dims: dims.into(),
            eps: None,
            affine: true,
            dtype: DType::F32,
        }
    }
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = Some(eps);
        self
    }
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the weight (ones) on `device`.
    pub fn init<B: Backend>(self, device: &B::Device) -> Result<RMSNorm<B>> {
        check_config(
            "RMSNormConfig::init",
            &self.dims,
            self.eps.unwrap_or(0.0),
            self.dtype,
        )?;
        Ok(RMSNorm {
            weight: affine_param::<B>(self.affine, true, &self.dims, self.dtype, device)?,
            dims: self.dims,
            eps: self.eps,
        })
    }
}

/// `x / √(mean(x²) + eps) · weight` over the trailing [`RMSNorm::dims`] of `x`.
pub struct RMSNorm<B: Backend> {
    dims: Vec<usize>,
    eps: Option<f64>,
    /// Of the normalized shape; `None` without `affine`.
    pub weight: Option<Var<B>>,
}

impl<B: Backend> RMSNorm<B> {
    /// The normalized shape.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    /// The epsilon used for inputs of `dtype`.
    pub fn eps_for(&self, dtype: DType) -> f64 {
        self.eps.unwrap_or_else(|| machine_eps(dtype))
    }
}

impl<B: Backend> Module<B> for RMSNorm<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        x.rms_norm(&self.dims, self.weight.as_ref(), self.eps_for(x.dtype()))
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        named(&self.weight, &None)
    }
    fn describe(&self) -> String {
        let eps = self.eps.map_or("None".to_string(), |e| e.to_string());
        format!(
            "RMSNorm({:?}, eps={eps}, affine={})",
            self.dims,
            self.weight.is_some()
        )
    }
}

/// `torch.finfo(dtype).eps` (f32's for a dtype that is not a float: the op rejects it).
fn machine_eps(dtype: DType) -> f64 {
    if dtype.is_float() {
        dtype.epsilon()
    } else {
        f32::EPSILON as f64
    }
}

pub(crate) fn check_config(op: &'static str, dims: &[usize], eps: f64, dtype: DType) -> Result<()> {
    if dims.is_empty() || dims.contains(&0) {
        return Err(Error::invalid(
            op,
            format!("the normalized shape must be non-empty with positive dims, got {dims:?}"),
        ));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::invalid(
            op,
            format!("eps must be finite and >= 0, got {eps}"),
        ));
    }
    if !dtype.is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: "a float dtype".into(),
            got: dtype,
        });
    }
    Ok(())
}

/// A parameter of `dims` filled with ones (`weight`) or zeros, if `present`.
pub(crate) fn affine_param<B: Backend>(
    present: bool,
    ones: bool,
    dims: &[usize],
    dtype: DType,
    device: &B::Device,
) -> Result<Option<Var<B>>> {
    if !present {
        return Ok(None);
    }
    let t = if ones {
        Tensor::ones(dims.to_vec(), dtype, device)?
    } else {
        Tensor::zeros(dims.to_vec(), dtype, device)?
    };
    Ok(Some(Var::param(t)))
}

pub(crate) fn named<B: Backend>(w: &Option<Var<B>>, b: &Option<Var<B>>) -> Vec<(String, Var<B>)> {
    let mut v = Vec::new();
    if let Some(w) = w {
        v.push(("weight".to_string(), w.clone()));
    }
    if let Some(b) = b {
        v.push(("bias".to_string(), b.clone()));
    }
    v
}
