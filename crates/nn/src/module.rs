//! The `Module` trait: what every layer and model implements.
//!
//! A module owns its parameters as [`Var`]s made with [`Var::param`]. It hands out clones of
//! them (the same variables: an optimizer that updates them updates the model) with stable,
//! PyTorch-compatible names: a layer names its own tensors (`weight`, `bias`), and a container
//! prefixes its children's names with their index or field name (`0.weight`, `2.bias`), exactly
//! as `torch.nn.Module.state_dict` does. So a kiln model and the same PyTorch architecture
//! exchange weights through one safetensors file with no renaming.
//!
//! Besides parameters a module may hold **buffers** ([`Module::named_buffers`]): state that is
//! saved and loaded with the parameters but never trained, as BatchNorm's running statistics
//! (PyTorch's `register_buffer`). Buffers are constant [`Var`]s that the module itself updates
//! with [`Var::set_tensor`]; they appear in [`ModuleExt::state_dict`] under PyTorch's names,
//! move with [`ModuleExt::to_device`], and are absent from [`Module::parameters`], so
//! optimizers, gradient clipping and parameter counts never see them.
//!
//! The trait is object safe (a [`Sequential`](crate::Sequential) holds `Box<dyn Module<B>>`);
//! whole-module helpers that need `Self: Sized` or generic arguments live in [`ModuleExt`],
//! implemented for every module.

use std::path::Path;

use kiln_autograd::Var;
use kiln_core::{Activation, Backend, Error, Result, Tensor};

use crate::serialize::{check_state_dict, load_safetensors, save_safetensors};

/// A layer or a model: a differentiable function with named parameters.
pub trait Module<B: Backend>: Send + Sync {
    /// Applies the module to a batch.
    fn forward(&self, x: &Var<B>) -> Result<Var<B>>;

    /// Every parameter with its name relative to this module, in a fixed order (the order
    /// [`Module::parameters`] and optimizers use).
    fn named_parameters(&self) -> Vec<(String, Var<B>)>;

    /// Every buffer (state that is saved but not trained, e.g. BatchNorm's `running_mean`) with
    /// its name relative to this module, as PyTorch's `named_buffers`. None by default; a
    /// container lists its children's, prefixed as their parameters are.
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }

    /// Every parameter once, in [`Module::named_parameters`] order: a parameter listed under
    /// several names (a tied weight, see [`Linear::tie_weight`](crate::Linear::tie_weight))
    /// appears at its first name's place only ([`Var::unique`]), as PyTorch's `parameters()`.
    fn parameters(&self) -> Vec<Var<B>> {
        Var::unique(self.named_parameters().into_iter().map(|(_, v)| v))
    }

    /// Switches training behaviour (Dropout) on or off; [`ModuleExt::train`] and
    /// [`ModuleExt::eval`] call it. Modules start in training mode; those that behave the same
    /// in both modes ignore it. A module that holds other modules forwards it to each of them,
    /// as [`Sequential`](crate::Sequential) does; a user's model struct does the same for its
    /// fields (kiln has no registry of children, so a field it is not forwarded to keeps its
    /// mode):
    ///
    /// ```
    /// use kiln_autograd::Var;
    /// use kiln_backend_cpu::Cpu;
    /// use kiln_core::{Backend, Generator, Result, Tensor};
    /// use kiln_nn::{Dropout, LinearConfig, Module, ModuleExt, Sequential};
    ///
    /// struct Model<B: Backend> {
    ///     body: Sequential<B>,
    ///     dropout: Dropout,
    /// }
    ///
    /// impl<B: Backend> Module<B> for Model<B> {
    ///     fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
    ///         self.dropout.forward(&self.body.forward(x)?)
    ///     }
    ///     fn named_parameters(&self) -> Vec<(String, Var<B>)> {
    ///         self.body.named_parameters()
    ///     }
    ///     fn set_training(&mut self, training: bool) {
    ///         self.body.set_training(training);
    ///         self.dropout.set_training(training);
    ///     }
    ///     fn describe(&self) -> String {
    ///         "Model".into()
    ///     }
    /// }
    ///
    /// let (dev, mut g) = (Cpu::device(0), Generator::new(0));
    /// let mut m = Model::<Cpu> {
    ///     body: Sequential::new().add(LinearConfig::new(4, 4).init::<Cpu>(&dev, &mut g)?),
    ///     dropout: Dropout::new(0.5, &mut g)?,
    /// };
    /// let x = Var::constant(Tensor::<Cpu>::ones([2, 4], kiln_core::DType::F32, &dev)?);
    /// m.eval(); // the dropout is the identity now
    /// let a = m.forward(&x)?.tensor().to_vec::<f32>()?;
    /// assert_eq!(a, m.forward(&x)?.tensor().to_vec::<f32>()?);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    fn set_training(&mut self, _training: bool) {}

    /// A one-line description, e.g. `Linear(in=784, out=100, bias=true)`.
    fn describe(&self) -> String;

    /// The activation this module applies, when that is all it does (`Relu`, `Gelu`,
    /// `GeluTanh`): lets [`Sequential`](crate::Sequential) fuse it into the layer before it.
    /// Default: `None`.
    fn as_activation(&self) -> Option<Activation> {
        None
    }

    /// This module followed by `act`, as one op, when it can fuse them (`Linear`: the
    /// backend's bias-and-activation epilogue, `Var::linear_act`); the result must equal
    /// `act(self.forward(x))`. Default: `None` (the caller applies them one after the other).
    fn forward_then(&self, x: &Var<B>, act: Activation) -> Option<Result<Var<B>>> {
        let _ = (x, act);
        None
    }
}

impl<B: Backend, M: Module<B> + ?Sized> Module<B> for Box<M> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        (**self).forward(x)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        (**self).named_parameters()
    }
    fn parameters(&self) -> Vec<Var<B>> {
        (**self).parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        (**self).named_buffers()
    }
    fn set_training(&mut self, training: bool) {
        (**self).set_training(training)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn as_activation(&self) -> Option<Activation> {
        (**self).as_activation()
    }
    fn forward_then(&self, x: &Var<B>, act: Activation) -> Option<Result<Var<B>>> {
        (**self).forward_then(x, act)
    }
}

/// Whole-module operations, available on every [`Module`] (including `dyn Module`).
pub trait ModuleExt<B: Backend>: Module<B> {
    /// Moves every parameter and buffer to `device` (in place: every clone of a parameter, e.g.
    /// the one an optimizer holds, sees the move) and returns the module, as `model.to(device)`
    /// in PyTorch. Tensors already there are not copied.
    fn to_device(self, device: &B::Device) -> Result<Self>
    where
        Self: Sized,
    {
        self.move_to_device(device)?;
        Ok(self)
    }

    /// [`ModuleExt::to_device`] for a module behind a reference or a `dyn`.
    fn move_to_device(&self, device: &B::Device) -> Result<()> {
        let buffers = self.named_buffers().into_iter().map(|(_, v)| v);
        for p in Var::unique(self.parameters().into_iter().chain(buffers)) {
            let t = p.tensor();
            if t.device() != device {
                p.set_tensor(t.to_device(device)?)?;
            }
        }
        Ok(())
    }

    /// Training mode (Dropout active).
    fn train(&mut self) {
        self.set_training(true)
    }
    /// Evaluation mode (Dropout is the identity).
    fn eval(&mut self) {
        self.set_training(false)
    }

    /// The number of scalar parameters.
    fn num_params(&self) -> usize {
        self.parameters().iter().map(|p| p.elem_count()).sum()
    }

    /// The current parameter and buffer tensors by name (PyTorch's `state_dict`): the
    /// parameters first, then the buffers; a tied parameter is listed under each of its names,
    /// as PyTorch lists it.
    fn state_dict(&self) -> Vec<(String, Tensor<B>)> {
        self.named_state()
            .into_iter()
            .map(|(n, v)| (n, v.tensor()))
            .collect()
    }

    /// [`Module::named_parameters`] followed by [`Module::named_buffers`]: everything a state
    /// dict holds.
    fn named_state(&self) -> Vec<(String, Var<B>)> {
        let mut all = self.named_parameters();
        all.extend(self.named_buffers());
        all
    }

    /// Writes the parameters to a safetensors file that `safetensors.torch.load_file` +
    /// `load_state_dict` read into the same PyTorch architecture.
    fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut meta = std::collections::BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        meta.insert("kiln_model".to_string(), self.describe());
        save_safetensors(path, &self.state_dict(), Some(meta))
    }

    /// Loads parameters from a safetensors file (kiln's or PyTorch's). The file must hold
    /// exactly this module's tensors with the same shapes and dtypes; otherwise an error lists
    /// every missing, unexpected and mismatched tensor, and the module is left unchanged.
    fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let named = self.state_dict();
        let Some((_, first)) = named.first() else {
            return Err(Error::invalid(
                "load",
                format!("{}: the module has no parameters to load", path.display()),
            ));
        };
        let file = load_safetensors::<B>(path, first.device())?;
        self.load_tensors(&path.display().to_string(), file.tensors)
    }

    /// Loads parameters and buffers from named tensors (see [`ModuleExt::load`]); `origin` names
    /// the source
    /// in errors. A tied parameter (one variable under several names) may be given under all
    /// its names (PyTorch's `state_dict`; each is assigned, the same tensor in PyTorch's files)
    /// or under only some of them (files written without duplicates, as
    /// `safetensors.torch.save_model` writes them).
    fn load_tensors(
        &self,
        origin: &str,
        tensors: std::collections::BTreeMap<String, Tensor<B>>,
    ) -> Result<()> {
        let all = self.named_state();
        let given: std::collections::HashSet<_> = all
            .iter()
            .filter(|(n, _)| tensors.contains_key(n))
            .map(|(_, v)| v.id())
            .collect();
        // A name may be absent when its variable comes in under another name.
        let named: Vec<(String, Var<B>)> = all
            .into_iter()
            .filter(|(n, v)| tensors.contains_key(n) || !given.contains(&v.id()))
            .collect();
        let expected: Vec<(String, Tensor<B>)> =
            named.iter().map(|(n, v)| (n.clone(), v.tensor())).collect();
        check_state_dict("load", origin, &expected, &tensors)?;
        // Validation passed: move each tensor to its parameter's device first, so a failing
        // copy cannot leave the model half loaded, then assign.
        let mut staged = Vec::with_capacity(named.len());
        for ((name, p), (_, cur)) in named.iter().zip(&expected) {
            staged.push((p, tensors[name].to_device(cur.device())?));
        }
        for (p, t) in staged {
            p.set_tensor(t)?;
        }
        Ok(())
    }
}

impl<B: Backend, M: Module<B> + ?Sized> ModuleExt<B> for M {}

/// Prefixes child parameter names: `prefix.name`.
pub(crate) fn prefixed<B: Backend>(
    prefix: &str,
    named: Vec<(String, Var<B>)>,
) -> Vec<(String, Var<B>)> {
    named
        .into_iter()
        .map(|(n, v)| (format!("{prefix}.{n}"), v))
        .collect()
}
