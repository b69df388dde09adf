//! Data parallelism in Chainer's manner (`ParallelUpdater`): a master model and replicas on
//! other devices. Each replica computes gradients on its slice of the batch; the master adds
//! them to its own ([`accumulate_grads_from`], Chainer's `addgrads`), steps, and the replicas
//! take the master's new parameters ([`copy_parameters_from`], Chainer's `copyparams`).
//! Everything goes through `copy_to` between devices (peer copies on GPUs); no communication
//! library is involved.

use kiln_autograd::Var;
use kiln_core::{Backend, DistErrorKind, Error, Result};
use kiln_nn::Module;

/// A parameter of the destination and the matching one of the source, with its name.
type Pair<B> = (String, Var<B>, Var<B>);

fn pairs<B: Backend>(
    op: &'static str,
    dst: &dyn Module<B>,
    src: &dyn Module<B>,
) -> Result<Vec<Pair<B>>> {
    let d = dst.named_parameters();
    let s = src.named_parameters();
    if d.len() != s.len() {
        return Err(Error::dist(
            op,
            DistErrorKind::Mismatch,
            format!("the models have {} and {} parameters", d.len(), s.len()),
        ));
    }
    d.into_iter()
        .zip(s)
        .map(|((dn, dp), (sn, sp))| {
            if dn != sn || dp.dims() != sp.dims() || dp.dtype() != sp.dtype() {
                return Err(Error::dist(
                    op,
                    DistErrorKind::Mismatch,
                    format!(
                        "parameter `{dn}` {:?} {} does not match `{sn}` {:?} {}",
                        dp.dims(),
                        dp.dtype(),
                        sp.dims(),
                        sp.dtype()
                    ),
                ));
            }
            Ok((dn, dp, sp))
        })
        .collect()
}

/// `dst.grad += src.grad` for every parameter, copying `src`'s gradients to `dst`'s device
/// (Chainer's `addgrads`). A parameter of `src` without a gradient adds nothing; one of `dst`
/// without a gradient takes `src`'s.
pub fn accumulate_grads_from<B: Backend>(dst: &dyn Module<B>, src: &dyn Module<B>) -> Result<()> {
    for (_, d, s) in pairs("accumulate_grads_from", dst, src)? {
        let Some(sg) = s.grad() else { continue };
        let sg = sg.to_device(&d.device())?;
        let g = match d.grad() {
            Some(dg) => dg.add(&sg)?,
            None => sg,
        };
        d.set_grad(Some(g))?;
    }
    Ok(())
}

/// Copies every parameter of `src` into `dst` (on `dst`'s devices; Chainer's `copyparams`).
pub fn copy_parameters_from<B: Backend>(dst: &dyn Module<B>, src: &dyn Module<B>) -> Result<()> {
    for (_, d, s) in pairs("copy_parameters_from", dst, src)? {
        let dev = d.device();
        d.set_tensor(s.tensor().copy_to(&dev)?)?;
    }
    Ok(())
}

/// Multiplies every gradient by `c` (e.g. `1 / replicas` to turn summed gradients of per-slice
/// mean losses into the gradient of the mean over the whole batch).
pub fn scale_grads<B: Backend>(model: &dyn Module<B>, c: f64) -> Result<()> {
    for p in model.parameters() {
        if let Some(g) = p.grad() {
            p.set_grad(Some(g.mul_scalar(c)?))?;
        }
    }
    Ok(())
}
