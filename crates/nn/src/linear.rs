//! Fully connected layer, `y = x W^T + b`, with PyTorch's layout (`weight` is `[out, in]`) and
//! default initialization, so weights transfer to and from `torch.nn.Linear` unchanged.

use kiln_autograd::Var;
use kiln_core::{Activation, Backend, DType, Error, Generator, Result};

use crate::init::Init;
use crate::module::Module;

/// Configuration of a [`Linear`] layer (`LinearConfig::new(784, 100).init::<B>(&dev, &mut generator)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearConfig {
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
    /// Weight initializer; default PyTorch's Kaiming uniform with `a = √5`.
    pub weight_init: Init,
    /// Bias initializer; default PyTorch's `U(-1/√in, 1/√in)`.
    pub bias_init: Init,
    pub dtype: DType,
}

impl LinearConfig {
    pub fn new(in_features: usize, out_features: usize) -> Self {
        LinearConfig {
            in_features,
            out_features,
            bias: true,
            weight_init: Init::torch_default(),
            bias_init: Init::BiasUniform {
                fan_in: in_features,
            },
            dtype: DType::F32,
        }
    }
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = init;
        self
    }
    pub fn with_bias_init(mut self, init: Init) -> Self {
        self.bias_init = init;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the parameters on `device`, the weight and then the bias drawn from
    /// `generator` (the same numbers on every backend).
    pub fn init<B: Backend>(
        self,
        device: &B::Device,
        generator: &mut Generator,
    ) -> Result<Linear<B>> {
        if self.in_features == 0 || self.out_features == 0 {
            return Err(Error::invalid(
                "LinearConfig::init",
                format!(
                    "features must be positive, got in={} out={}",
                    self.in_features, self.out_features
                ),
            ));
        }
        let w = self.weight_init.init::<B>(
            [self.out_features, self.in_features],
            generator,
            self.dtype,
            device,
        )?;
        let b = if self.bias {
            Some(Var::param(self.bias_init.init::<B>(
                [self.out_features],
                generator,
                self.dtype,
                device,
            )?))
        } else {
            None
        };
        Ok(Linear {
            weight: Var::param(w),
            bias: b,
        })
    }
}

/// `y = x W^T + b` over the last axis of `x` (any leading batch axes).
pub struct Linear<B: Backend> {
    /// `[out_features, in_features]`.
    pub weight: Var<B>,
    /// `[out_features]`.
    pub bias: Option<Var<B>>,
}

impl<B: Backend> Linear<B> {
    pub fn in_features(&self) -> usize {
        self.weight.dim(1)
    }
    pub fn out_features(&self) -> usize {
        self.weight.dim(0)
    }

    /// The input's last axis must be `in_features` (a typed error naming the layer).
    fn check_input(&self, x: &Var<B>) -> Result<()> {
        let in_f = self.in_features();
        if x.rank() == 0 || x.dim(x.rank() - 1) != in_f {
            return Err(Error::invalid(
                "Linear",
                format!(
                    "expects inputs whose last axis is {in_f}, got shape {}",
                    x.shape()
                ),
            ));
        }
        Ok(())
    }

    /// Ties this layer's weight to `weight`: the layer uses that very variable from now on (its
    /// own is dropped), so both users' gradients accumulate into one `.grad()` and one update
    /// moves both. This is nanoGPT's `lm_head.weight = wte.weight`:
    ///
    /// ```
    /// use kiln_backend_cpu::Cpu;
    /// use kiln_core::Generator;
    /// use kiln_nn::{EmbeddingConfig, LinearConfig};
    ///
    /// let (dev, mut g) = (Cpu::device(0), Generator::new(0));
    /// let wte = EmbeddingConfig::new(65, 32).init::<Cpu>(&dev, &mut g)?;
    /// let mut lm_head = LinearConfig::new(32, 65).with_bias(false).init::<Cpu>(&dev, &mut g)?;
    /// lm_head.tie_weight(&wte.weight)?;
    /// assert!(lm_head.weight.ptr_eq(&wte.weight));
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    ///
    /// A model holding both lists the parameter under both names in `named_parameters` and
    /// `state_dict` (as PyTorch does), while [`Module::parameters`], optimizers and gradient
    /// norms see it once; loading accepts a state dict with both names or either one. The
    /// weight must have this layer's shape `[out, in]` and dtype, or the layer is unchanged and
    /// the error says why.
    pub fn tie_weight(&mut self, weight: &Var<B>) -> Result<()> {
        let own = &self.weight;
        if weight.shape() != own.shape() || weight.dtype() != own.dtype() {
            return Err(Error::invalid(
                "Linear::tie_weight",
                format!(
                    "the weight must be {} {} like the layer's, got {} {}",
                    own.dtype(),
                    own.shape(),
                    weight.dtype(),
                    weight.shape()
                ),
            ));
        }
        self.weight = weight.clone();
        Ok(())
    }
}

impl<B: Backend> Module<B> for Linear<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.check_input(x)?;
        // One node with the parameters as direct inputs (see `Var::linear`); the backend's
        // GEMM reads W column-major through a transposed view, no copy.
        x.linear(&self.weight, self.bias.as_ref())
    }

    fn forward_then(&self, x: &Var<B>, act: Activation) -> Option<Result<Var<B>>> {
        Some(
            self.check_input(x)
                .and_then(|()| x.linear_act(&self.weight, self.bias.as_ref(), act)),
        )
    }

    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }

    fn describe(&self) -> String {
        format!(
            "Linear(in={}, out={}, bias={})",
            self.in_features(),
            self.out_features(),
            self.bias.is_some()
        )
    }
}
