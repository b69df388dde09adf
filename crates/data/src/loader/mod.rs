//! `DataLoader<B>`: seeded shuffling, batching, and a background thread that prepares the next
//! batch on the device while the current one trains.
//!
//! Why a thread: gathering rows and uploading them is host work that the training step does
//! not depend on until the next iteration. A worker that stays one or two batches ahead (a
//! bounded channel, so it never runs away with memory) hides that work behind the compute, as
//! PyTorch's `DataLoader` workers and Chainer's `MultiprocessIterator` do. On a GPU the upload is
//! one DMA from page-locked memory on the backend's copy stream, asynchronous
//! ([`DataLoader::pin_memory`]), and small batches share one: the worker gathers consecutive
//! batches into one block, the consuming thread uploads it and hands out views
//! ([`DataLoader::upload_bytes`]), because each upload costs that thread the same whatever its
//! size.
//!
//! A dataset kept in page-locked memory ([`crate::ArrayDataset::pin`]) skips the host gather
//! altogether on a GPU: the device reads each batch's rows over the bus
//! ([`Backend::gather_host_rows`]), launched from `next()` a few groups ahead, with no worker;
//! consecutive rows (an epoch in order) are one DMA from the dataset's own memory instead,
//! decoded on the copy stream too ([`Backend::copy_host_rows`]).
//!
//! Why the consuming thread uploads, not the worker: the driver serializes calls from threads
//! of one context, so a worker's copies slowed the training thread's launches by as much as
//! making the copies itself (BENCHMARKS.md, the fifth session of 2026-11-23).
//!
//! Why Philox for the order: the permutation of epoch `e` is a pure function of
//! `(seed, e, len)` (see [`permutation`]), computed with integer arithmetic only, so a run
//! visits samples in the same order on every machine and every backend, and resuming at epoch
//! `e` needs no saved generator state.
//!
//! This file holds the [`DataLoader`] and its settings; `gather` one epoch's work (grouping
//! batches into uploads, gathering rows, uploading them), `epoch` the [`Epoch`] iterator and
//! its worker thread, and `permutation` the shuffled order.

mod epoch;
mod gather;
mod permutation;

use std::sync::Arc;

use kiln_core::{Backend, Error, HostRows, Result};

use crate::dataset::Dataset;
use epoch::Gate;
pub use epoch::{Epoch, LoaderTimes};
use gather::Job;
pub use gather::TensorBatch;
pub use permutation::permutation;

/// Iterates a [`Dataset`] in batches of tensors on one device.
///
/// ```
/// use kiln_backend_cpu::Cpu;
/// use kiln_data::{DataLoader, Mnist};
///
/// let dev = Cpu::device(0);
/// let mnist = Mnist::load(Mnist::bundled_dir())?;
/// let train = mnist.train.take(1000);
/// let mut train = DataLoader::<Cpu>::new(train, 100, &dev)?.shuffle(0).drop_last(true);
/// for _epoch in 0..2 {
///     for batch in train.iter() {
///         let (x, y) = batch?; // x: [100, 784] f32, y: [100] i64, both on `dev`
///         assert_eq!((x.dims(), y.dims()), (&[100, 784][..], &[100][..]));
///     }
/// }
/// # Ok::<(), kiln_core::Error>(())
/// ```
///
/// Each call to [`iter`](Self::iter) runs the next epoch (a new shuffle order when shuffling).
/// Dropping the iterator mid-epoch stops the worker and joins it.
pub struct DataLoader<B: Backend> {
    dataset: Arc<dyn Dataset>,
    device: B::Device,
    batch_size: usize,
    shuffle_seed: Option<u64>,
    drop_last: bool,
    prefetch: usize,
    pin_memory: bool,
    device_gather: bool,
    upload_bytes: usize,
    sample_dims: Vec<usize>,
    epoch: u64,
    /// The next epoch, started when the current one was (see [`DataLoader::iter`]).
    next: Option<(u64, Epoch<B>)>,
}

/// Default of [`DataLoader::prefetch`]: two uploads ready ahead (PyTorch's `prefetch_factor`
/// is 2 too). With one, the training thread waited for the worker more often: a 784-100-100-10
/// MLP at batch 1000 on an H200 ran its prefetching epoch at 1.24–1.29 times the compute-only
/// one with one, 1.17–1.24 with two (three runs each, 2026-11-26; four gained nothing more).
/// The cost is one more group of pinned memory.
pub const PREFETCH: usize = 2;

/// Default of [`DataLoader::upload_bytes`].
///
/// 16 MiB rather than 4: a 784-100-100-10 MLP at batch 1000 (3.1 MB of features a batch, so
/// one batch per 4 MiB upload) ran its prefetching epoch at 1.108, 1.110 and 1.115 times the
/// compute-only epoch with 16 MiB groups against 1.203, 1.165 and 1.232 with 4 MiB, alternating
/// in one call on an H200 (2026-11-26); batch 100 was 1.03 either way.
const UPLOAD_BYTES: usize = 16 << 20;

impl<B: Backend> std::fmt::Debug for DataLoader<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("backend", &B::NAME)
            .field("device", &self.device)
            .field("samples", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("shuffle_seed", &self.shuffle_seed)
            .field("drop_last", &self.drop_last)
            .field("prefetch", &self.prefetch)
            .field("pin_memory", &self.pin_memory)
            .field("device_gather", &self.device_gather)
            .field("upload_bytes", &self.upload_bytes)
            .field("sample_dims", &self.sample_dims)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl<B: Backend> DataLoader<B> {
    /// A loader over `dataset` yielding batches of `batch_size` on `device`: in order, the last
    /// batch possibly smaller, up to [`PREFETCH`] uploads prepared ahead by a worker thread.
    /// Share a dataset between loaders by passing an `Arc` of it.
    pub fn new(
        dataset: impl Dataset + 'static,
        batch_size: usize,
        device: &B::Device,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid(
                "DataLoader::new",
                "batch_size must be at least 1",
            ));
        }
        let sample_dims = dataset.feature_dims().to_vec();
        Ok(DataLoader {
            dataset: Arc::new(dataset),
            device: device.clone(),
            batch_size,
            shuffle_seed: None,
            drop_last: false,
            prefetch: PREFETCH,
            pin_memory: true,
            device_gather: true,
            upload_bytes: UPLOAD_BYTES,
            sample_dims,
            epoch: 0,
            next: None,
        })
    }

    /// Shuffles every epoch with the Philox permutation of `(seed, epoch)`.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.next = None;
        self.shuffle_seed = Some(seed);
        self
    }

    /// Drops the last batch of an epoch when it is smaller than `batch_size`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.next = None;
        self.drop_last = drop_last;
        self
    }

    /// How many uploads the worker may have gathered ahead of the consumer (default
    /// [`PREFETCH`]; the channel's capacity; an upload is one batch or, with pinned memory, a
    /// group of them: see [`upload_bytes`](Self::upload_bytes)); `0` prepares each batch in
    /// `next()` on the calling thread, with no worker.
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.next = None;
        self.prefetch = batches;
        self
    }

    /// Whether batches pass through page-locked memory on their way to the device (default
    /// on; it takes effect only when a GPU backend has found a GPU). Then each upload is one
    /// asynchronous DMA that overlaps the training step (PyTorch's `pin_memory=True`).
    ///
    /// When the dataset itself is page-locked ([`crate::ArrayDataset::pin`]), batches are
    /// taken from it as stored (MNIST's pixels as bytes: a quarter of the bytes) and decoded
    /// on the device: see [`device_gather`](Self::device_gather). Consecutive rows (no
    /// shuffling) are then one plain DMA from the dataset's own memory.
    pub fn pin_memory(mut self, on: bool) -> Self {
        self.next = None;
        self.pin_memory = on;
        self
    }

    /// With a page-locked dataset ([`crate::ArrayDataset::pin`]) and a backend that can read
    /// host memory ([`Backend::gather_host_rows`]: CUDA can), whether the device gathers each
    /// group of batches itself (DGL's UVA sampling; the default): `next()` launches one gather
    /// kernel per group on the copy stream, [`prefetch`](Self::prefetch) groups ahead, and no
    /// worker thread runs. Off, the worker copies the rows as stored into a pinned block that
    /// one DMA moves. On measured faster: a shuffled 784-100-100-10 MLP epoch at batch 1000 on
    /// an H200 ran 1.12–1.14× the compute-only epoch with it, 1.17–1.20× without (2026-11-26).
    pub fn device_gather(mut self, on: bool) -> Self {
        self.next = None;
        self.device_gather = on;
        self
    }

    /// The most bytes of features one upload moves (default 16 MiB; `0` or anything below one
    /// batch: one batch per upload; a pinned dataset's rows copied as stored, such as pixels
    /// kept as bytes, count as stored). With pinned memory, as many consecutive batches as fit
    /// are gathered together and copied to the device in one DMA, and each batch is handed out
    /// as a view of it: an upload costs the consuming thread 11–21 µs on the H100 machines we
    /// measure on, little of it growing with the size, which a small model's step (0.15 ms for
    /// a 784-100-100-10 MLP at batch 100) cannot hide. The first upload of an epoch is one
    /// batch and each later one twice the one before (up to this size), so no step waits for a
    /// whole group to arrive. A batch kept beyond its step keeps its group's device memory
    /// alive.
    pub fn upload_bytes(mut self, bytes: usize) -> Self {
        self.next = None;
        self.upload_bytes = bytes;
        self
    }

    /// Reshapes each sample's features, e.g. `[1, 28, 28]` for MNIST in a conv net; the
    /// element count must match the dataset's.
    pub fn sample_shape(mut self, dims: impl Into<Vec<usize>>) -> Result<Self> {
        let dims = dims.into();
        let have: usize = self.dataset.feature_dims().iter().product();
        let want: usize = dims.iter().product();
        if have != want {
            return Err(Error::invalid(
                "DataLoader::sample_shape",
                format!(
                    "samples of shape {:?} ({have} elements) cannot be viewed as {dims:?} \
                     ({want} elements)",
                    self.dataset.feature_dims()
                ),
            ));
        }
        self.sample_dims = dims;
        self.next = None;
        Ok(self)
    }

    /// Sets the epoch the next [`iter`](Self::iter) runs (to resume a run).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The epoch the next [`iter`](Self::iter) runs.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    pub fn device(&self) -> &B::Device {
        &self.device
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// Samples per epoch (after `drop_last`).
    pub fn samples_per_epoch(&self) -> usize {
        if self.drop_last {
            self.num_batches() * self.batch_size
        } else {
            self.dataset.len()
        }
    }

    /// Batches per epoch.
    pub fn num_batches(&self) -> usize {
        let n = self.dataset.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// Runs the next epoch: an iterator of `Result<(features, labels)>`.
    ///
    /// With a worker ([`prefetch`](Self::prefetch) > 0), the epoch after it is prepared
    /// too: once this epoch's worker has gathered its last batch, the next one's worker
    /// gathers that epoch's first uploads (never both at once: the dataset is read in order)
    /// and waits for the next `iter`, so an epoch's first step does not wait for the gather.
    /// A [`set_epoch`](Self::set_epoch) to another epoch, or a change of the loader's
    /// settings, discards it.
    pub fn iter(&mut self) -> Epoch<B> {
        let e = self.epoch;
        self.epoch += 1;
        let current = match self.next.take() {
            Some((n, epoch)) if n == e => epoch,
            _ => self.epoch_iter(e),
        };
        self.next = current
            .finished
            .clone()
            .map(|after| (e + 1, self.start_epoch(e + 1, Some(after))));
        current
    }

    /// The batches of epoch `epoch`, without advancing the loader's epoch counter.
    pub fn epoch_iter(&self, epoch: u64) -> Epoch<B> {
        self.start_epoch(epoch, None)
    }

    /// Epoch `epoch`, its worker (if any) starting to gather once `after` opens.
    fn start_epoch(&self, epoch: u64, after: Option<Arc<Gate>>) -> Epoch<B> {
        let n = self.dataset.len();
        let order = match self.shuffle_seed {
            Some(seed) => permutation(n, seed, epoch),
            None => (0..n).collect(),
        };
        let job = Job {
            dataset: self.dataset.clone(),
            device: self.device.clone(),
            order,
            in_order: self.shuffle_seed.is_none(),
            batch_size: self.batch_size,
            num_batches: self.num_batches(),
            pin_memory: self.pin_memory,
            upload_bytes: self.upload_bytes,
            sample_dims: self.sample_dims.clone(),
            host_rows: self.pinned_rows(),
            device_gather: self.device_gather && B::gathers_host_rows(&self.device),
        };
        Epoch::start(job, self.prefetch, after)
    }

    /// The dataset's page-locked arrays, when batches are taken from them (see
    /// [`DataLoader::pin_memory`]).
    fn pinned_rows(&self) -> Option<[HostRows; 2]> {
        if !self.pin_memory {
            return None;
        }
        self.dataset.pinned_rows().map(|(f, l)| [f, l])
    }
}

impl<B: Backend> IntoIterator for &mut DataLoader<B> {
    type Item = Result<TensorBatch<B>>;
    type IntoIter = Epoch<B>;
    fn into_iter(self) -> Epoch<B> {
        self.iter()
    }
}
