//! One epoch's work, owned ([`Job`]): which batches are uploaded together ([`Group`]), how
//! their rows are gathered on the host or by the device, and how they are put on the device.

use std::sync::Arc;

use kiln_core::{Backend, DType, Error, HostRows, HostSource, PinnedBlock, Result, Tensor};

use crate::dataset::{Dataset, gather_bytes};

/// One batch on the device: features `[b, ..sample shape]` and labels `[b, ..label shape]`.
pub type TensorBatch<B> = (Tensor<B>, Tensor<B>);
/// What one epoch needs, owned, so the worker thread borrows nothing.
pub(super) struct Job<B: Backend> {
    pub(super) dataset: Arc<dyn Dataset>,
    pub(super) device: B::Device,
    pub(super) order: Vec<usize>,
    /// `order` is `0..n` (no shuffling): a group's rows are one range of the dataset.
    pub(super) in_order: bool,
    pub(super) batch_size: usize,
    pub(super) num_batches: usize,
    pub(super) pin_memory: bool,
    pub(super) upload_bytes: usize,
    pub(super) sample_dims: Vec<usize>,
    /// The dataset's pinned features and labels, when batches are taken from them.
    pub(super) host_rows: Option<[HostRows; 2]>,
    /// With `host_rows`: the device gathers each group itself (else the worker copies the rows
    /// as stored into a pinned block).
    pub(super) device_gather: bool,
}

/// Consecutive batches of an epoch gathered and uploaded together: batches `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Group {
    pub(super) start: usize,
    pub(super) end: usize,
}

/// Batches gathered on the host, not yet on the device.
pub(super) enum Gathered<B: Backend> {
    /// Rows gathered into page-locked blocks; [`Job::upload`] turns them into tensors.
    Pinned {
        features: PinnedBlock,
        labels: PinnedBlock,
        dtypes: (DType, DType),
        dims: (Vec<usize>, Vec<usize>),
    },
    /// Rows of a pinned dataset as it stores them (pixels as bytes): byte ranges of
    /// page-locked blocks, copies of the rows or, for consecutive rows, the dataset's own
    /// blocks; [`Job::upload`] moves them and decodes them on the device
    /// ([`Backend::copy_host_rows`] where the backend can, else tensor ops).
    Stored {
        blocks: [(Arc<PinnedBlock>, std::ops::Range<usize>); 2],
        dims: (Vec<usize>, Vec<usize>),
    },
    /// Already on the device (no pinned memory: uploaded where it was gathered).
    Ready(TensorBatch<B>),
}

/// A group of batches on the device, handed out one batch at a time.
pub(super) struct Uploaded<B: Backend> {
    /// All the group's rows (dropped with the last batch handed out; the views keep what
    /// they read alive).
    pub(super) batch: Option<TensorBatch<B>>,
    /// Rows of each batch, in order; `next` is the next one to hand out, from row `row`.
    pub(super) rows: Vec<usize>,
    pub(super) next: usize,
    pub(super) row: usize,
}

impl<B: Backend> Uploaded<B> {
    pub(super) fn exhausted(&self) -> bool {
        self.next == self.rows.len()
    }

    /// The next batch: the group itself when it is one batch, else a view of its rows.
    pub(super) fn take(&mut self) -> Result<TensorBatch<B>> {
        let n = self.rows[self.next];
        self.next += 1;
        if self.rows.len() == 1 {
            return Ok(self.batch.take().expect("a batch is taken once"));
        }
        let (x, y) = self
            .batch
            .as_ref()
            .expect("the group is held until its last batch");
        let batch = (x.narrow(0, self.row, n)?, y.narrow(0, self.row, n)?);
        self.row += n;
        if self.exhausted() {
            self.batch = None;
        }
        Ok(batch)
    }
}

impl<B: Backend> Job<B> {
    /// Whether batches go through pinned blocks (a GPU backend present, a dataset of fixed
    /// dtypes): only then are batches grouped into larger uploads.
    pub(super) fn pinned_path(&self) -> Option<(DType, DType)> {
        let pinned = self.pin_memory && kiln_core::host::pinned_allocator().is_some();
        pinned.then(|| self.dataset.dtypes()).flatten()
    }

    /// How the epoch's batches are split into uploads: one batch first (so the first step
    /// waits for one batch only), then groups larger than the one before (each arrives while
    /// its predecessor trains), up to as many batches as fit in `upload_bytes` of what crosses
    /// the bus (at least one).
    ///
    /// Rows copied as stored grow four times a group: a copy engine moves them (~16 µs a batch
    /// of MNIST pixel bytes) far faster than a step consumes them, and each upload costs the
    /// training thread ~35 µs of driver calls (two DMAs, a decode launch, an event) on the H100
    /// machines we measure on; the MNIST MLP at batch 1000 in order then takes 5 uploads an
    /// epoch instead of 7. Rows the device gathers over the bus (~66 µs a batch of f32 rows)
    /// grow twice a group, so the second group arrives before the first one's step is done.
    pub(super) fn groups(&self) -> Vec<Group> {
        let (per_group, growth) = match self.pinned_path() {
            Some((fd, _)) => {
                let (row_bytes, growth) = match &self.host_rows {
                    // Rows copied as stored (pixels stay bytes, decoded on the device).
                    Some(rows) if self.in_order || !self.device_gather => (rows[0].row_bytes, 4),
                    _ => (
                        self.sample_dims.iter().product::<usize>() * fd.size_in_bytes(),
                        2,
                    ),
                };
                let batch_bytes = (self.batch_size * row_bytes).max(1);
                ((self.upload_bytes / batch_bytes).max(1), growth)
            }
            _ => (1, 1),
        };
        let mut groups = Vec::new();
        let (mut start, mut len) = (0, 1);
        while start < self.num_batches {
            let end = (start + len).min(self.num_batches);
            groups.push(Group { start, end });
            start = end;
            len = (growth * len).min(per_group);
        }
        groups
    }

    /// The rows of each batch in `g`.
    pub(super) fn rows(&self, g: Group) -> Vec<usize> {
        (g.start..g.end)
            .map(|b| {
                let start = b * self.batch_size;
                (start + self.batch_size).min(self.order.len()) - start
            })
            .collect()
    }

    /// Gathers the batches of `g` on the host, as one batch of all their rows.
    ///
    /// With `pin_memory`, a GPU backend present and a dataset of fixed dtypes, the rows are
    /// gathered straight into page-locked blocks (pooled by the GPU backend; one pass over the
    /// bytes) and no driver call is made here. Otherwise the rows are gathered into ordinary
    /// memory and uploaded at once.
    pub(super) fn gather(&self, g: Group) -> Result<Gathered<B>> {
        let start = g.start * self.batch_size;
        let end = (g.end * self.batch_size).min(self.order.len());
        let indices = &self.order[start..end];
        let len = indices.len();
        let (fdims, ldims) = self.group_dims(len);
        if let (true, Some(rows)) = (len > 0, &self.host_rows) {
            let in_order = self.in_order;
            let copy = |r: &HostRows| -> Result<(Arc<PinnedBlock>, std::ops::Range<usize>)> {
                let n = r.rows();
                let bad = match in_order {
                    true => indices.last().filter(|&&i| i >= n),
                    false => indices.iter().find(|&&i| i >= n),
                };
                if let Some(bad) = bad {
                    return Err(Error::invalid(
                        "DataLoader",
                        format!("row {bad} of a pinned array of {n} rows"),
                    ));
                }
                if in_order {
                    let at = indices[0] * r.row_bytes;
                    return Ok((r.block.clone(), at..at + len * r.row_bytes));
                }
                let mut b = PinnedBlock::uninit("DataLoader", len * r.row_bytes)?;
                gather_bytes(r.block.as_bytes(), r.row_bytes, indices, b.as_bytes_mut());
                Ok((Arc::new(b), 0..len * r.row_bytes))
            };
            return Ok(Gathered::Stored {
                blocks: [copy(&rows[0])?, copy(&rows[1])?],
                dims: (fdims, ldims),
            });
        }
        if let (true, Some((fd, ld))) = (len > 0, self.pinned_path()) {
            let count = |d: &[usize]| d.iter().product::<usize>();
            let op = "DataLoader";
            let mut f = PinnedBlock::uninit(op, count(&fdims) * fd.size_in_bytes())?;
            let mut l = PinnedBlock::uninit(op, count(&ldims) * ld.size_in_bytes())?;
            self.dataset
                .get_batch_into(indices, f.as_bytes_mut(), l.as_bytes_mut())?;
            return Ok(Gathered::Pinned {
                features: f,
                labels: l,
                dtypes: (fd, ld),
                dims: (fdims, ldims),
            });
        }
        let batch = self.dataset.get_batch(indices)?;
        let x = Tensor::<B>::from_host(&batch.features, fdims, &self.device)?;
        let y = Tensor::<B>::from_host(&batch.labels, ldims, &self.device)?;
        Ok(Gathered::Ready((x, y)))
    }

    /// The shapes of a group of `len` rows: features and labels.
    pub(super) fn group_dims(&self, len: usize) -> (Vec<usize>, Vec<usize>) {
        let mut fdims = Vec::with_capacity(1 + self.sample_dims.len());
        fdims.push(len);
        fdims.extend_from_slice(&self.sample_dims);
        let mut ldims = vec![len];
        ldims.extend_from_slice(self.dataset.label_dims());
        (fdims, ldims)
    }

    /// The batches of `g` gathered by the device from the dataset's pinned arrays: one launch
    /// on the backend's copy stream, no host copy (see [`DataLoader::pin_memory`](crate::DataLoader::pin_memory)).
    pub(super) fn gather_on_device(&self, g: Group) -> Result<Uploaded<B>> {
        let Some(host_rows) = &self.host_rows else {
            return Err(Error::backend("DataLoader", "the dataset is not pinned"));
        };
        let start = g.start * self.batch_size;
        let end = (g.end * self.batch_size).min(self.order.len());
        if self.in_order {
            // Consecutive rows (no shuffling) are one range of each array: a plain DMA on a
            // copy engine, no gather kernel.
            return Ok(Uploaded {
                batch: Some(self.upload(self.gather(g)?)?),
                rows: self.rows(g),
                next: 0,
                row: 0,
            });
        }
        let (fdims, ldims) = self.group_dims(end - start);
        let mut s = B::gather_host_rows(&self.device, host_rows, &self.order[start..end])?
            .ok_or_else(|| {
                Error::backend(
                    "DataLoader",
                    "the backend cannot gather rows from host memory",
                )
            })?;
        let (ls, fs) = (s.pop(), s.pop());
        let (Some(fs), Some(ls)) = (fs, ls) else {
            return Err(Error::backend(
                "DataLoader",
                "the backend returned fewer storages than arrays",
            ));
        };
        let batch = (
            Tensor::from_storage(fs, fdims, host_rows[0].dtype),
            Tensor::from_storage(ls, ldims, host_rows[1].dtype),
        );
        Ok(Uploaded {
            batch: Some(batch),
            rows: self.rows(g),
            next: 0,
            row: 0,
        })
    }

    /// Puts gathered rows on the device: from pinned blocks, two asynchronous DMAs on the
    /// backend's copy stream and one event that orders the caller's later work after both (the
    /// blocks live until the copies are done).
    pub(super) fn upload(&self, g: Gathered<B>) -> Result<TensorBatch<B>> {
        /// Bytes `r` of `b`, kept alive by `b` until the copy is done.
        fn range(b: &Arc<PinnedBlock>, r: std::ops::Range<usize>) -> HostSource<'_> {
            HostSource {
                bytes: &b.as_bytes()[r],
                pinned: true,
                owner: Some(b.clone()),
            }
        }
        fn two<B: Backend>(mut s: Vec<B::Storage>) -> Result<(B::Storage, B::Storage)> {
            let (ls, fs) = (s.pop(), s.pop());
            fs.zip(ls).ok_or_else(|| {
                Error::backend(
                    "DataLoader",
                    "the backend returned fewer storages than sources",
                )
            })
        }
        match g {
            Gathered::Ready(batch) => Ok(batch),
            Gathered::Stored {
                blocks: [(f, fr), (l, lr)],
                dims: (fdims, ldims),
            } => {
                let rows = self
                    .host_rows
                    .as_ref()
                    .expect("stored rows come from host_rows");
                // The same rows of both arrays: the dataset's own blocks (in order) or copies.
                let picked = fr.start / rows[0].row_bytes..fr.end / rows[0].row_bytes;
                debug_assert_eq!(lr.start / rows[1].row_bytes, picked.start);
                let srcs = [(&f, &rows[0]), (&l, &rows[1])].map(|(b, r)| HostRows {
                    block: b.clone(),
                    ..r.clone()
                });
                // Where the backend can, one DMA each and the decode on its copy stream.
                if let Some(s) = B::copy_host_rows(&self.device, &srcs, picked)? {
                    let (fs, ls) = two::<B>(s)?;
                    return Ok((
                        Tensor::from_storage(fs, fdims, rows[0].dtype),
                        Tensor::from_storage(ls, ldims, rows[1].dtype),
                    ));
                }
                let (fd, ld) = (rows[0].stored_dtype(), rows[1].stored_dtype());
                let srcs = vec![(fd, range(&f, fr)), (ld, range(&l, lr))];
                let s = B::from_host_sources(&self.device, srcs)?;
                let (fs, ls) = two::<B>(s)?;
                let x = Tensor::from_storage(fs, fdims, fd);
                let x = match rows[0].bytes_over {
                    // Deferred where the backend fuses: one kernel decodes the group.
                    Some(d) => x.to_dtype(rows[0].dtype)?.div_scalar(d as f64)?,
                    None => x,
                };
                Ok((x, Tensor::from_storage(ls, ldims, ld)))
            }
            Gathered::Pinned {
                features,
                labels,
                dtypes: (fd, ld),
                dims: (fdims, ldims),
            } => {
                let (f, l) = (Arc::new(features), Arc::new(labels));
                let srcs = vec![(fd, range(&f, 0..f.len())), (ld, range(&l, 0..l.len()))];
                let s = B::from_host_sources(&self.device, srcs)?;
                let (fs, ls) = two::<B>(s)?;
                Ok((
                    Tensor::from_storage(fs, fdims, fd),
                    Tensor::from_storage(ls, ldims, ld),
                ))
            }
        }
    }
}
