//! # kiln-data
//!
//! Getting training data onto a device, fast and reproducibly:
//!
//! - [`Dataset`]: a finite collection that hands out whole batches as host buffers (one gather,
//!   one upload per batch, never one per sample); [`ArrayDataset`] holds one in memory;
//! - [`idx`]: the IDX format of MNIST, plain or gzip, read strictly (a truncated or corrupt file
//!   is an error naming the file, never a panic or a silent short read) and written
//!   reproducibly;
//! - [`Mnist`]: the four standard MNIST files from a directory (the repository bundles a
//!   5,000-digit subset under `data/mnist/`, found by [`Mnist::bundled_dir`]);
//! - [`DataLoader`]: batches as `Tensor<B>` on any backend, shuffled per epoch by a Philox
//!   permutation (the same order on every machine), prepared by a background thread while the
//!   current batch trains.
//!
//! Like every kiln crate but the backends, it knows only `kiln-core` and is generic over
//! `B: Backend`.

mod dataset;
pub mod idx;
mod loader;
pub mod mnist;

pub use dataset::{ArrayDataset, Batch, Dataset};
pub use idx::{Idx, IdxData, parse_idx, read_idx, write_idx};
pub use loader::{DataLoader, Epoch, LoaderTimes, PREFETCH, TensorBatch, permutation};
pub use mnist::{Mnist, Pixels};

use std::sync::Arc;

/// A shared dataset is a dataset, so several loaders can read one copy.
impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn feature_dims(&self) -> &[usize] {
        (**self).feature_dims()
    }
    fn label_dims(&self) -> &[usize] {
        (**self).label_dims()
    }
    fn get_batch(&self, indices: &[usize]) -> kiln_core::Result<Batch> {
        (**self).get_batch(indices)
    }
    fn dtypes(&self) -> Option<(kiln_core::DType, kiln_core::DType)> {
        (**self).dtypes()
    }
    fn get_batch_into(
        &self,
        indices: &[usize],
        features: &mut [u8],
        labels: &mut [u8],
    ) -> kiln_core::Result<()> {
        (**self).get_batch_into(indices, features, labels)
    }
    fn pinned_rows(&self) -> Option<(kiln_core::HostRows, kiln_core::HostRows)> {
        (**self).pinned_rows()
    }
}
