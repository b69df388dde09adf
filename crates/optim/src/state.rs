//! Optimizer state as named tensors, saved as safetensors.
//!
//! Names follow the index of each parameter in the optimizer (as PyTorch's optimizer
//! `state_dict` does): `"3.exp_avg"`, `"3.exp_avg_sq"`, `"3.step"`, `"0.momentum_buffer"`.
//! The metadata holds the optimizer's name and hyperparameters, as strings. A parameter that
//! has never been stepped has no entries.
//!
//! A 16-bit (f16/bf16) parameter also has `"3.master_weight"`: its f32 master copy (the
//! weights the optimizer updates, of which the parameter is the rounding; see `fused.rs`),
//! f32 with the parameter's shape, like its other state. It is optional when loading: a state
//! saved without it (by an older kiln, or for a parameter whose master was not current) loads,
//! and the next step widens the 16-bit parameter to f32 instead, so such a run resumes from
//! the rounded weights. A master for an f32/f64 parameter is an error.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Result, Tensor};
use kiln_nn::serialize::{from_safetensors_bytes, save_safetensors};

/// The name of a 16-bit parameter's f32 master copy in the state (module docs).
pub(crate) const MASTER: &str = "master_weight";

/// One parameter's validated saved state, moved to the parameter's device.
pub(crate) struct Saved<B: Backend> {
    /// The optimizer's buffers, in the order asked for.
    pub buffers: Vec<Tensor<B>>,
    pub step: u64,
    /// The f32 master copy of a 16-bit parameter, when the state has one.
    pub master: Option<Tensor<B>>,
}

/// Per parameter: its saved state, or `None` when it has none.
pub(crate) type ParamState<B> = Option<Saved<B>>;

/// Named state tensors plus string metadata (see the module docs for the naming).
pub struct OptimizerState<B: Backend> {
    pub tensors: BTreeMap<String, Tensor<B>>,
    pub metadata: BTreeMap<String, String>,
}

impl<B: Backend> Clone for OptimizerState<B> {
    fn clone(&self) -> Self {
        OptimizerState {
            tensors: self.tensors.clone(),
            metadata: self.metadata.clone(),
        }
    }
}

impl<B: Backend> OptimizerState<B> {
    /// Writes the state to a safetensors file, atomically (see [`save_safetensors`]): a failed
    /// or interrupted save leaves the previous file as it was.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let named: Vec<(String, Tensor<B>)> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        save_safetensors(path, &named, Some(self.metadata.clone()))
    }

    /// Reads a state file; tensors are uploaded to the first parameter's device (and moved to
    /// each parameter's own device when loaded into an optimizer).
    pub fn load(path: impl AsRef<Path>, params: &[Var<B>]) -> Result<Self> {
        let path = path.as_ref();
        let device = match params.first() {
            Some(p) => p.device(),
            None => B::devices()
                .into_iter()
                .next()
                .ok_or_else(|| Error::invalid("load_optimizer_state", "no device to load onto"))?,
        };
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let f = from_safetensors_bytes(&bytes, &path.display().to_string(), &device)?;
        Ok(OptimizerState {
            tensors: f.tensors,
            metadata: f.metadata,
        })
    }

    /// Checks the saved optimizer name, every tensor name against `buffers` (the per-parameter
    /// buffer names this optimizer keeps, besides `step` and the optional `master_weight`)
    /// and every shape and dtype against the parameters. Returns, per parameter, its buffers
    /// and master (moved to the parameter's device) and step count, or `None` when the
    /// parameter has no saved state. One error, naming `op`, lists everything wrong.
    pub(crate) fn validate(
        &self,
        op: &'static str,
        name: &str,
        params: &[Var<B>],
        buffers: &[&str],
    ) -> Result<Vec<ParamState<B>>> {
        let mut problems = Vec::new();
        match self.metadata.get("optimizer") {
            Some(n) if n == name => {}
            other => problems.push(format!(
                "state is for optimizer {:?}, not `{name}`",
                other.map(String::as_str).unwrap_or("<unnamed>")
            )),
        }
        for k in self.tensors.keys() {
            let ok = k.split_once('.').is_some_and(|(i, b)| {
                i.parse::<usize>().is_ok_and(|i| i < params.len())
                    && (b == "step" || b == MASTER || buffers.contains(&b))
            });
            if !ok {
                problems.push(format!("unexpected tensor `{k}`"));
            }
        }
        let mut out = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let step = self.tensors.get(&format!("{i}.step"));
            let bufs: Vec<Option<&Tensor<B>>> = buffers
                .iter()
                .map(|b| self.tensors.get(&format!("{i}.{b}")))
                .collect();
            let master = self.tensors.get(&format!("{i}.{MASTER}"));
            if step.is_none() && master.is_none() && bufs.iter().all(Option::is_none) {
                out.push(None);
                continue;
            }
            let pt = p.tensor();
            let master = match master {
                None => None,
                Some(_) if !pt.dtype().is_half() => {
                    problems.push(format!(
                        "`{i}.{MASTER}`: parameter {i} is {} and has no master copy",
                        pt.dtype()
                    ));
                    None
                }
                Some(t) if t.shape() != pt.shape() || t.dtype() != DType::F32 => {
                    problems.push(format!(
                        "`{i}.{MASTER}`: expected f32 {} like the parameter, got {} {}",
                        pt.shape(),
                        t.dtype(),
                        t.shape()
                    ));
                    None
                }
                Some(t) => Some(t.to_device(pt.device())?),
            };
            let mut got = Vec::new();
            for (b, t) in buffers.iter().zip(&bufs) {
                match t {
                    None => problems.push(format!("missing tensor `{i}.{b}`")),
                    // State is kept in the compute dtype: f32 for 16-bit parameters (their
                    // master weights' dtype, see `fused.rs`).
                    Some(t)
                        if t.shape() != pt.shape() || t.dtype() != pt.dtype().compute_dtype() =>
                    {
                        problems.push(format!(
                            "`{i}.{b}`: expected {} {} like the parameter, got {} {}",
                            pt.dtype().compute_dtype(),
                            pt.shape(),
                            t.dtype(),
                            t.shape()
                        ))
                    }
                    Some(t) => got.push(t.to_device(pt.device())?),
                }
            }
            let step = match step {
                None => {
                    problems.push(format!("missing tensor `{i}.step`"));
                    0
                }
                Some(s) if s.elem_count() != 1 => {
                    problems.push(format!("`{i}.step` must hold one value"));
                    0
                }
                Some(s) => s.to_scalar()? as u64,
            };
            out.push(Some(Saved {
                buffers: got,
                step,
                master,
            }));
        }
        if !problems.is_empty() {
            return Err(Error::invalid(
                op,
                format!("cannot load {name} state: {}", problems.join("; ")),
            ));
        }
        Ok(out)
    }
}

/// A 0-d f64 tensor holding a step count, on `like`'s device.
pub(crate) fn step_tensor<B: Backend>(step: u64, like: &Tensor<B>) -> Result<Tensor<B>> {
    Tensor::full(
        kiln_core::Shape::scalar(),
        step as f64,
        DType::F64,
        like.device(),
    )
}

/// Gives `t` the device of `p` (a no-op when already there): optimizer state follows a model
/// moved with `to_device` after the optimizer was built.
pub(crate) fn follow<B: Backend>(t: &Tensor<B>, p: &Tensor<B>) -> Result<Tensor<B>> {
    t.to_device(p.device())
}
