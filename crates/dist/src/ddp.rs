//! Data parallelism in PyTorch DDP's manner, over any [`ProcessGroup`].
//!
//! Each rank holds a full replica of the model and trains on its slice of every batch:
//! - at construction, rank 0's parameters and buffers are broadcast to every rank;
//! - buffers (BatchNorm's running statistics, [`Module::named_buffers`]) are rank 0's again
//!   after every synchronized step: [`Ddp::finish`] broadcasts them, so the next forward on
//!   every rank starts from rank 0's, as DDP's `broadcast_buffers=True` does before each
//!   forward (`broadcast_buffers: false` leaves each rank's own);
//! - parameters are grouped into buckets of about 25 MB (`bucket_cap_mb`; the first bucket is
//!   capped at 1 MB so communication starts early, as in DDP), in reverse order of
//!   [`Module::parameters`] — roughly the order backward produces their gradients;
//! - a gradient hook on every parameter ([`kiln_autograd::Var::register_grad_hook`]) marks it
//!   ready; when a bucket is complete, its gradients are flattened into one buffer and an
//!   all-reduce (mean) is launched on the group's communication stream right away, while
//!   backward goes on computing the next gradients. Buckets are launched in bucket order only
//!   (a complete bucket waits for the ones before it), so every rank issues the same
//!   collectives in the same order;
//! - [`Ddp::backward`] runs the backward pass, then [`Ddp::finish`]: the averaged gradients are
//!   written back into the parameters' `.grad()`, ordered before the optimizer's work.
//!
//! A parameter that got no gradient in a synchronized backward is an error
//! ([`DistErrorKind::Mismatch`]) naming it; its bucket is still reduced (with zeros for the
//! missing gradients) so that the other ranks are not left waiting on it.
//!
//! [`Ddp::no_sync`] runs a closure without communication (gradient accumulation): gradients
//! just accumulate locally, and the next synchronized backward reduces the accumulated sum.
//!
//! The same code runs with one thread per GPU (one `Ddp` per thread, each with its rank's
//! group) and with one process per GPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kiln_autograd::{HookHandle, Var};
use kiln_core::{Backend, DType, DistErrorKind, Error, Result, Tensor};
use kiln_nn::Module;

use crate::group::{ProcessGroup, ReduceOp, Work};

/// DDP's default bucket size, MB (10^6 bytes, as PyTorch's `bucket_cap_mb`).
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;
/// The first bucket's cap (PyTorch's `_DEFAULT_FIRST_BUCKET_BYTES`).
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Groups parameters into buckets: indices into `params` (given as `(bytes, dtype)` in
/// [`Module::parameters`] order), each bucket one dtype, filled in reverse parameter order up
/// to `cap_bytes` (the first bucket up to `first_cap_bytes`); a parameter larger than the cap
/// gets a bucket of its own.
pub fn assign_buckets(
    params: &[(usize, DType)],
    cap_bytes: usize,
    first_cap_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_bytes = 0;
    let mut cur_dtype = None;
    for i in (0..params.len()).rev() {
        let (bytes, dtype) = params[i];
        let cap = if buckets.is_empty() {
            first_cap_bytes.min(cap_bytes)
        } else {
            cap_bytes
        };
        if !cur.is_empty() && (cur_dtype != Some(dtype) || cur_bytes + bytes > cap) {
            buckets.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.push(i);
        cur_bytes += bytes;
        cur_dtype = Some(dtype);
    }
    if !cur.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// How [`Ddp`] is set up.
#[derive(Clone, Copy, Debug)]
pub struct DdpConfig {
    /// Bucket size in MB (10^6 bytes).
    pub bucket_cap_mb: f64,
    /// Broadcast rank 0's parameters (and buffers) at construction.
    pub broadcast_parameters: bool,
    /// Broadcast rank 0's buffers after every synchronized backward (PyTorch's
    /// `broadcast_buffers`).
    pub broadcast_buffers: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_mb: DEFAULT_BUCKET_CAP_MB,
            broadcast_parameters: true,
            broadcast_buffers: true,
        }
    }
}

struct Step<B: Backend> {
    /// Per parameter: its gradient arrived in this backward.
    ready: Vec<bool>,
    /// Per bucket: parameters still missing.
    missing: Vec<usize>,
    /// The next bucket to launch (buckets launch in order).
    next: usize,
    /// Launched buckets' collectives, by bucket.
    works: Vec<Option<Work<B>>>,
    /// The first error a hook met (reported by `finish`).
    error: Option<Error>,
}

struct Inner<B: Backend> {
    group: Arc<dyn ProcessGroup<B>>,
    params: Vec<(String, Var<B>)>,
    /// The model's buffers (once each), broadcast from rank 0 after each synchronized step
    /// when `broadcast_buffers` is on; empty otherwise.
    buffers: Vec<(String, Var<B>)>,
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
    sync: AtomicBool,
    step: Mutex<Step<B>>,
}

/// A data-parallel wrapper of one rank's model replica (see the module docs).
pub struct Ddp<B: Backend> {
    inner: Arc<Inner<B>>,
    hooks: Vec<(Var<B>, HookHandle)>,
}

impl<B: Backend> std::fmt::Debug for Ddp<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Ddp(rank {} of {}, {} parameters in {} buckets)",
            self.inner.group.rank(),
            self.inner.group.world_size(),
            self.inner.params.len(),
            self.inner.buckets.len()
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: Backend> Ddp<B> {
    /// Wraps `model` (this rank's replica) with the default config.
    pub fn new(model: &dyn Module<B>, group: Arc<dyn ProcessGroup<B>>) -> Result<Ddp<B>> {
        Self::with_config(model, group, DdpConfig::default())
    }

    pub fn with_config(
        model: &dyn Module<B>,
        group: Arc<dyn ProcessGroup<B>>,
        cfg: DdpConfig,
    ) -> Result<Ddp<B>> {
        const OP: &str = "Ddp::new";
        // A weight tied between two modules appears under both names: reduce it once.
        let mut seen = std::collections::HashSet::new();
        let params: Vec<(String, Var<B>)> = model
            .named_parameters()
            .into_iter()
            .filter(|(_, p)| p.requires_grad() && seen.insert(p.id()))
            .collect();
        let mut seen_buf = std::collections::HashSet::new();
        let buffers: Vec<(String, Var<B>)> = model
            .named_buffers()
            .into_iter()
            .filter(|(_, b)| seen_buf.insert(b.id()))
            .collect();
        let dev = group.device();
        for (name, p) in params.iter().chain(&buffers) {
            if p.device() != dev {
                return Err(Error::DeviceMismatch {
                    op: OP,
                    lhs: format!("parameter `{name}` on {}", p.device()),
                    rhs: format!("rank {}'s device {dev}", group.rank()),
                });
            }
        }
        // Every rank must agree on the model: compare the parameter count and sizes through
        // the group first (an all-gather of a small signature), so a mismatch is an error here
        // rather than a hang or garbage in the middle of training.
        let sig: Vec<f64> = [params.len() as f64, buffers.len() as f64]
            .into_iter()
            .chain(params.iter().map(|(_, p)| p.elem_count() as f64))
            .chain(buffers.iter().map(|(_, b)| b.elem_count() as f64))
            .collect();
        let sig_t = Tensor::<B>::from_slice(&sig, [sig.len()], &dev)?;
        let all = group.all_gather(&sig_t)?.wait()?.to_f64_vec()?;
        for r in 0..group.world_size() {
            if all[r * sig.len()..(r + 1) * sig.len()] != sig[..] {
                return Err(Error::dist(
                    OP,
                    DistErrorKind::Mismatch,
                    format!(
                        "rank {r}'s model differs from rank {}'s (parameter or buffer count \
                         or sizes)",
                        group.rank()
                    ),
                ));
            }
        }
        if cfg.broadcast_parameters {
            broadcast_each(&*group, &params)?;
            broadcast_coalesced(&*group, &buffers)?;
        }
        let buffers = if cfg.broadcast_buffers {
            buffers
        } else {
            Vec::new()
        };
        let sizes: Vec<(usize, DType)> = params
            .iter()
            .map(|(_, p)| (p.elem_count() * p.dtype().size_in_bytes(), p.dtype()))
            .collect();
        let cap = (cfg.bucket_cap_mb * 1e6).max(1.0) as usize;
        let buckets = assign_buckets(&sizes, cap, FIRST_BUCKET_BYTES);
        let mut bucket_of = vec![0; params.len()];
        for (b, idx) in buckets.iter().enumerate() {
            for &i in idx {
                bucket_of[i] = b;
            }
        }
        let step = Step {
            ready: vec![false; params.len()],
            missing: buckets.iter().map(|b| b.len()).collect(),
            next: 0,
            works: buckets.iter().map(|_| None).collect(),
            error: None,
        };
        let inner = Arc::new(Inner {
            group,
            params,
            buffers,
            buckets,
            bucket_of,
            sync: AtomicBool::new(true),
            step: Mutex::new(step),
        });
        let mut hooks = Vec::new();
        for (i, (_, p)) in inner.params.iter().enumerate() {
            let weak = Arc::downgrade(&inner);
            let h = p.register_grad_hook(Arc::new(move |_v: &Var<B>| match weak.upgrade() {
                Some(inner) => inner.on_grad(i),
                None => Ok(()),
            }));
            hooks.push((p.clone(), h));
        }
        Ok(Ddp { inner, hooks })
    }

    /// The group this replica communicates through.
    pub fn group(&self) -> &Arc<dyn ProcessGroup<B>> {
        &self.inner.group
    }

    /// The buckets, as indices into the model's trainable parameters.
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.inner.buckets
    }

    /// Runs `loss.backward()` and then [`Ddp::finish`].
    pub fn backward(&self, loss: &Var<B>) -> Result<()> {
        let r = loss.backward();
        let f = self.finish();
        r.and(f)
    }

    /// Completes the gradient synchronization of the backward pass that just ran: launches
    /// what is left (buckets with parameters that got no gradient, filled with zeros for
    /// them), waits for every bucket (stream-ordered), and writes the averaged gradients back
    /// into `.grad()`. An error naming the parameters that got no gradient, or the failure of
    /// the group. Does nothing inside [`Ddp::no_sync`].
    pub fn finish(&self) -> Result<()> {
        if !self.inner.sync.load(Ordering::Acquire) {
            return Ok(());
        }
        self.inner.finish()
    }

    /// Runs `f` without gradient synchronization (gradients accumulate locally); the next
    /// synchronized backward reduces the accumulated gradients.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a AtomicBool, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Release);
            }
        }
        let _r = Restore(
            &self.inner.sync,
            self.inner.sync.swap(false, Ordering::AcqRel),
        );
        f()
    }
}

impl<B: Backend> Drop for Ddp<B> {
    fn drop(&mut self) {
        for (p, h) in self.hooks.drain(..) {
            p.remove_grad_hook(h);
        }
    }
}

impl<B: Backend> Inner<B> {
    fn on_grad(&self, i: usize) -> Result<()> {
        if !self.sync.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut st = lock(&self.step);
        if st.ready[i] {
            // A second backward through the model before `finish`: reported there.
            if st.error.is_none() {
                st.error = Some(Error::dist(
                    "Ddp",
                    DistErrorKind::Mismatch,
                    format!(
                        "parameter `{}` got a gradient twice before Ddp::finish (run extra \
                         backward passes inside Ddp::no_sync)",
                        self.params[i].0
                    ),
                ));
            }
            return Ok(());
        }
        st.ready[i] = true;
        let b = self.bucket_of[i];
        st.missing[b] -= 1;
        // Launch every complete bucket from the next one on, in order.
        while st.next < self.buckets.len() && st.missing[st.next] == 0 {
            let b = st.next;
            match self.launch(b, false) {
                Ok(w) => st.works[b] = Some(w),
                Err(e) => {
                    st.error.get_or_insert(e);
                    // Leave the rest to `finish`, which reports the error.
                    return Ok(());
                }
            }
            st.next += 1;
        }
        Ok(())
    }

    /// Flattens bucket `b`'s gradients (zeros where missing when `fill`) and starts their
    /// all-reduce (mean).
    fn launch(&self, b: usize, fill: bool) -> Result<Work<B>> {
        let mut flat = Vec::with_capacity(self.buckets[b].len());
        for &i in &self.buckets[b] {
            let p = &self.params[i].1;
            let g = match p.grad() {
                Some(g) => g,
                None if fill => p.tensor().zeros_like()?,
                None => {
                    return Err(Error::dist(
                        "Ddp",
                        DistErrorKind::Mismatch,
                        format!("parameter `{}` has no gradient", self.params[i].0),
                    ));
                }
            };
            flat.push(g.reshape([g.elem_count()])?);
        }
        let flat = if flat.len() == 1 {
            flat.pop().unwrap().contiguous()?
        } else {
            Tensor::cat(&flat, 0)?
        };
        self.group.all_reduce(&flat, ReduceOp::Avg)
    }

    fn finish(&self) -> Result<()> {
        let mut st = lock(&self.step);
        let mut first_err = st.error.take();
        let missing: Vec<&str> = (0..self.params.len())
            .filter(|&i| !st.ready[i])
            .map(|i| self.params[i].0.as_str())
            .collect();
        if !missing.is_empty() && first_err.is_none() {
            first_err = Some(Error::dist(
                "Ddp::finish",
                DistErrorKind::Mismatch,
                format!(
                    "rank {}: parameter(s) {missing:?} got no gradient in this backward pass; \
                     every trainable parameter must take part in the loss on every rank \
                     (freeze unused ones with set_requires_grad(false) before wrapping)",
                    self.group.rank()
                ),
            ));
        }
        // Launch the rest in order (zeros for missing gradients) so peers are not left waiting.
        while st.next < self.buckets.len() {
            let b = st.next;
            match self.launch(b, true) {
                Ok(w) => st.works[b] = Some(w),
                Err(e) => {
                    first_err.get_or_insert(e);
                    break;
                }
            }
            st.next += 1;
        }
        let works: Vec<Option<Work<B>>> = st.works.iter_mut().map(Option::take).collect();
        // Reset for the next step.
        st.ready.iter_mut().for_each(|r| *r = false);
        for (b, m) in st.missing.iter_mut().enumerate() {
            *m = self.buckets[b].len();
        }
        st.next = 0;
        drop(st);
        for (b, w) in works.into_iter().enumerate() {
            let Some(w) = w else { continue };
            let flat = match w.wait() {
                Ok(f) => f,
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            if first_err.is_some() {
                continue;
            }
            let mut off = 0;
            for &i in &self.buckets[b] {
                let p = &self.params[i].1;
                let n = p.elem_count();
                let g = flat.narrow(0, off, n)?.reshape(p.dims())?;
                p.set_grad(Some(g))?;
                off += n;
            }
        }
        // Every rank issues the buffers' broadcasts, even after an error, so peers are not
        // left waiting on them.
        if let Err(e) = broadcast_coalesced(&*self.group, &self.buffers) {
            first_err.get_or_insert(e);
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.group.check()
    }
}

/// Sets every variable of `vars` to rank 0's value, one broadcast each (all launched, then
/// waited for), so each keeps storage of its own: for parameters, which an optimizer may
/// update in place (under CUDA graph capture), once at construction.
fn broadcast_each<B: Backend>(
    group: &dyn ProcessGroup<B>,
    vars: &[(String, Var<B>)],
) -> Result<()> {
    if group.world_size() < 2 || vars.is_empty() {
        return Ok(());
    }
    let works: Vec<Work<B>> = vars
        .iter()
        .map(|(_, v)| group.broadcast(&v.tensor(), 0))
        .collect::<Result<_>>()?;
    for ((_, v), w) in vars.iter().zip(works) {
        v.set_tensor(w.wait()?.reshape(v.dims())?)?;
    }
    Ok(())
}

/// Sets every variable of `vars` to rank 0's value with one broadcast per dtype of the
/// variables flattened and joined (as PyTorch coalesces its buffers: a ResNet-18 has 60 small
/// buffers, every step, and a collective costs about the same for 8 bytes as for 8 KB); each
/// variable becomes its slice of the received tensor. For buffers, which their modules replace
/// rather than write in place.
fn broadcast_coalesced<B: Backend>(
    group: &dyn ProcessGroup<B>,
    vars: &[(String, Var<B>)],
) -> Result<()> {
    if group.world_size() < 2 || vars.is_empty() {
        return Ok(());
    }
    let mut dtypes: Vec<DType> = Vec::new();
    for (_, v) in vars {
        if !dtypes.contains(&v.dtype()) {
            dtypes.push(v.dtype());
        }
    }
    let mut launched = Vec::with_capacity(dtypes.len());
    for dtype in dtypes {
        let members: Vec<&Var<B>> = vars
            .iter()
            .map(|(_, v)| v)
            .filter(|v| v.dtype() == dtype)
            .collect();
        let flat = members
            .iter()
            .map(|v| v.tensor().reshape([v.elem_count()]))
            .collect::<Result<Vec<_>>>()?;
        let work = group.broadcast(&Tensor::cat(&flat, 0)?, 0)?;
        launched.push((members, work));
    }
    for (members, work) in launched {
        let all = work.wait()?;
        let mut off = 0;
        for v in members {
            let n = v.elem_count();
            v.set_tensor(all.narrow(0, off, n)?.reshape(v.dims())?)?;
            off += n;
        }
    }
    Ok(())
}

/// Averages every parameter's gradient over the group in one call (no hooks, no overlap): the
/// simple form, for code that does not use [`Ddp`] (and a reference for testing it).
pub fn all_reduce_grads<B: Backend>(
    model: &dyn Module<B>,
    group: &dyn ProcessGroup<B>,
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (name, p) in model.named_parameters() {
        if !seen.insert(p.id()) {
            continue; // a tied weight, already averaged under its first name
        }
        let g = p.grad().ok_or_else(|| {
            Error::dist(
                "all_reduce_grads",
                DistErrorKind::Mismatch,
                format!("parameter `{name}` has no gradient"),
            )
        })?;
        let avg = group.all_reduce(&g, ReduceOp::Avg)?.wait()?;
        p.set_grad(Some(avg.reshape(p.dims())?))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_in_reverse_order_with_a_small_first_bucket() {
        use DType::F32;
        // A 784-4096-4096-10 MLP: w1 b1 w2 b2 w3 b3 (bytes).
        let p = [
            (784 * 4096 * 4, F32),
            (4096 * 4, F32),
            (4096 * 4096 * 4, F32),
            (4096 * 4, F32),
            (4096 * 10 * 4, F32),
            (10 * 4, F32),
        ];
        let b = assign_buckets(&p, 25_000_000, FIRST_BUCKET_BYTES);
        assert_eq!(b, vec![vec![5, 4, 3], vec![2], vec![1, 0]]);
        // Everything fits in one bucket when the cap is large.
        assert_eq!(
            assign_buckets(&p, usize::MAX, usize::MAX),
            vec![vec![5, 4, 3, 2, 1, 0]]
        );
        // Dtype changes split buckets; each parameter is in exactly one bucket.
        let mixed = [(8, F32), (8, DType::F64), (8, DType::F64), (8, F32)];
        assert_eq!(
            assign_buckets(&mixed, 1000, 1000),
            vec![vec![3], vec![2, 1], vec![0]]
        );
        assert!(assign_buckets(&[], 10, 10).is_empty());
    }
}
