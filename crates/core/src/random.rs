//! Random tensors from a generator object, as PyTorch's `torch.Generator` and
//! `torch.manual_seed`.
//!
//! A [`Generator`] holds a seed and a count of the draws made so far. A draw takes the Philox
//! key [`philox::draw_key`]`(seed, draws)` and advances the count by one; the backend then draws
//! the tensor's elements under that key, element `i` from a counter of its index
//! ([`Backend::rand`], [`philox`]). The numbers
//! therefore depend only on the seed, the order of the draws and their shapes, never on the
//! device: the same seed gives the same tensors on the CPU and on a GPU.
//!
//! `Tensor::rand`, `Tensor::randn`, `Tensor::random` and the `*_like` forms draw from one
//! process-wide default generator, seeded with [`Generator::DEFAULT_SEED`] until
//! [`manual_seed`] reseeds it. Code that must not depend on what else draws (tests, a model
//! built from a seed) makes its own `Generator::new(seed)` and passes it to what draws
//! (`kiln_nn`'s initializers and layers take `&mut Generator`, as PyTorch's take `generator=`).

use std::sync::{Mutex, MutexGuard};

use crate::backend::{Backend, RandDist};
use crate::{DType, Result, Shape, Tensor, philox};

/// A seedable source of random tensors (`torch.Generator`); see the module docs.
///
/// ```
/// use kiln_core::{DType, Generator, RandDist, Tensor, reference::{RefDevice, Reference}};
/// let dev = RefDevice(0);
/// let mut g = Generator::new(42);
/// let w: Tensor<Reference> = g.randn([3, 4], &dev)?; // f32, N(0, 1)
/// let b: Tensor<Reference> = g.uniform([4], -0.5, 0.5, &dev)?; // f32, U[-0.5, 0.5)
/// let x: Tensor<Reference> =
///     g.sample([2], RandDist::Normal { mean: 1.0, std: 0.1 }, DType::F64, &dev)?;
/// // Reseeding replays the same draws.
/// g.manual_seed(42);
/// assert_eq!(g.randn::<Reference>([3, 4], &dev)?.to_vec::<f32>()?, w.to_vec::<f32>()?);
/// # let _ = (b, x);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generator {
    seed: u64,
    draws: u64,
}

static DEFAULT: Mutex<Generator> = Mutex::new(Generator::new(Generator::DEFAULT_SEED));

/// Reseeds the default generator (`torch.manual_seed`): the draws of `Tensor::rand`,
/// `Tensor::randn`, ... start over from `seed`.
pub fn manual_seed(seed: u64) {
    default_generator().manual_seed(seed);
}

/// The process-wide default generator, locked: draw from it, read or change its seed.
/// Hold the guard only for the draws (every default draw waits for it).
pub fn default_generator() -> MutexGuard<'static, Generator> {
    DEFAULT.lock().unwrap_or_else(|e| e.into_inner())
}

impl Generator {
    /// The default generator's seed until [`manual_seed`] (PyTorch's default seed).
    pub const DEFAULT_SEED: u64 = 67_280_421_310_721;

    /// A generator seeded with `seed`, no draw made yet.
    pub const fn new(seed: u64) -> Self {
        Generator { seed, draws: 0 }
    }

    /// Reseeds and forgets the draws made (`Generator.manual_seed`).
    pub fn manual_seed(&mut self, seed: u64) -> &mut Self {
        *self = Generator::new(seed);
        self
    }

    /// The seed this generator was created or last reseeded with (`Generator.initial_seed`).
    pub fn initial_seed(&self) -> u64 {
        self.seed
    }

    /// How many tensors were drawn since the seed was set.
    pub fn draws(&self) -> u64 {
        self.draws
    }

    /// Moves to draw `draws` of the current seed (`Generator.set_offset`): the next tensor is
    /// the one a fresh generator of this seed would draw after `draws` draws. With [`draws`]
    /// (`Generator.get_offset`) it resumes a stream exactly.
    ///
    /// [`draws`]: Generator::draws
    pub fn set_draws(&mut self, draws: u64) -> &mut Self {
        self.draws = draws;
        self
    }

    /// The Philox key of the next draw, and the count advanced past it: what a backend kernel
    /// drawing a tensor by itself (dropout's mask, say) takes as its seed.
    pub fn next_key(&mut self) -> u64 {
        let k = philox::draw_key(self.seed, self.draws);
        self.draws += 1;
        k
    }

    /// A tensor of the float `dtype` drawn from `dist` (f16/bf16: drawn in f32, then rounded):
    /// the form every other method calls.
    pub fn sample<B: Backend>(
        &mut self,
        shape: impl Into<Shape>,
        dist: RandDist,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B>> {
        let key = self.next_key();
        Tensor::random_keyed(shape.into(), dist, key, dtype, device)
    }

    /// f32 uniform on `[0, 1)` (`torch.rand`).
    pub fn rand<B: Backend>(
        &mut self,
        shape: impl Into<Shape>,
        device: &B::Device,
    ) -> Result<Tensor<B>> {
        self.uniform(shape, 0.0, 1.0, device)
    }

    /// f32 uniform on `[low, high)` (`torch.empty(..).uniform_(low, high)`).
    pub fn uniform<B: Backend>(
        &mut self,
        shape: impl Into<Shape>,
        low: f64,
        high: f64,
        device: &B::Device,
    ) -> Result<Tensor<B>> {
        self.sample(shape, RandDist::Uniform { low, high }, DType::F32, device)
    }

    /// f32 standard normal, `N(0, 1)` (`torch.randn`).
    pub fn randn<B: Backend>(
        &mut self,
        shape: impl Into<Shape>,
        device: &B::Device,
    ) -> Result<Tensor<B>> {
        self.normal(shape, 0.0, 1.0, device)
    }

    /// f32 normal with `mean` and standard deviation `std` (`torch.normal`).
    pub fn normal<B: Backend>(
        &mut self,
        shape: impl Into<Shape>,
        mean: f64,
        std: f64,
        device: &B::Device,
    ) -> Result<Tensor<B>> {
        self.sample(shape, RandDist::Normal { mean, std }, DType::F32, device)
    }

    /// Standard normal of `like`'s shape, dtype and device (`torch.randn_like`).
    pub fn randn_like<B: Backend>(&mut self, like: &Tensor<B>) -> Result<Tensor<B>> {
        let dist = RandDist::Normal {
            mean: 0.0,
            std: 1.0,
        };
        self.sample(like.shape().clone(), dist, like.dtype(), like.device())
    }

    /// Uniform on `[0, 1)` of `like`'s shape, dtype and device (`torch.rand_like`).
    pub fn rand_like<B: Backend>(&mut self, like: &Tensor<B>) -> Result<Tensor<B>> {
        let dist = RandDist::Uniform {
            low: 0.0,
            high: 1.0,
        };
        self.sample(like.shape().clone(), dist, like.dtype(), like.device())
    }
}

/// Draws from the default generator, kept here (not in `tensor`) so that `tensor` does not
/// import this module back.
impl<B: Backend> Tensor<B> {
    /// f32 uniform on `[0, 1)` from the default generator (`torch.rand`); see [`Generator`]
    /// for explicit generators and [`crate::manual_seed`] to reseed.
    pub fn rand(shape: impl Into<Shape>, device: &B::Device) -> Result<Self> {
        default_generator().rand(shape, device)
    }

    /// f32 standard normal from the default generator (`torch.randn`).
    pub fn randn(shape: impl Into<Shape>, device: &B::Device) -> Result<Self> {
        default_generator().randn(shape, device)
    }

    /// A tensor of the float `dtype` drawn from `dist` by the default generator: the
    /// dtype-taking form of [`Self::rand`] and [`Self::randn`].
    pub fn random(
        shape: impl Into<Shape>,
        dist: RandDist,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self> {
        default_generator().sample(shape, dist, dtype, device)
    }

    /// Uniform on `[0, 1)` of this tensor's shape, dtype and device (`torch.rand_like`), from
    /// the default generator.
    pub fn rand_like(&self) -> Result<Self> {
        default_generator().rand_like(self)
    }

    /// Standard normal of this tensor's shape, dtype and device (`torch.randn_like`), from the
    /// default generator.
    pub fn randn_like(&self) -> Result<Self> {
        default_generator().randn_like(self)
    }
}

impl Default for Generator {
    /// A generator seeded with [`Generator::DEFAULT_SEED`].
    fn default() -> Self {
        Generator::new(Generator::DEFAULT_SEED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{RefDevice, Reference};

    #[test]
    fn draws_advance_and_reseeding_replays() {
        let dev = RefDevice(0);
        let mut g = Generator::new(7);
        let a = g
            .rand::<Reference>([5], &dev)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let b = g
            .rand::<Reference>([5], &dev)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_ne!(a, b, "a second draw gives new numbers");
        assert_eq!(g.draws(), 2);
        g.manual_seed(7);
        let a2 = g
            .rand::<Reference>([5], &dev)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(a, a2);
        // Element i of draw k is Philox's uniform under key draw_key(seed, k).
        let k1 = philox::draw_key(7, 1);
        let want: Vec<f32> = (0..5)
            .map(|i| philox::uniform_f32(k1, i, 0.0, 1.0))
            .collect();
        assert_eq!(b, want);
    }
}
