//! The `Dataset` trait and an in-memory implementation.
//!
//! A dataset hands out whole batches, not single samples: a `DataLoader` asks for the rows of
//! one batch at once and gets two contiguous host buffers back, ready for one upload each.
//! Gathering a batch row by row into per-sample tensors (and stacking them again) would cost an
//! allocation and a device copy per sample, which is what makes naive loaders the bottleneck.

use std::sync::Arc;

use kiln_core::{DType, Error, HostBuffer, HostRows, PinnedBlock, Result};

/// The rows of one batch, in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `len * prod(feature_dims)` elements, row-major.
    pub features: HostBuffer,
    /// `len * prod(label_dims)` elements, row-major.
    pub labels: HostBuffer,
    /// Number of samples.
    pub len: usize,
}

/// A finite, indexable collection of `(features, label)` samples.
///
/// Implementations must be `Send + Sync`: a `DataLoader` reads from its worker thread.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shape of one sample's features (`[784]` for flattened MNIST).
    fn feature_dims(&self) -> &[usize];

    /// Shape of one sample's label (`[]` for a class index).
    fn label_dims(&self) -> &[usize] {
        &[]
    }

    /// The samples at `indices` (in that order, repeats allowed) as one batch. An index
    /// `>= len()` is an error.
    fn get_batch(&self, indices: &[usize]) -> Result<Batch>;

    /// The dtypes of the features and labels, when every batch has the same: then a loader
    /// can gather batches straight into memory of its own (page-locked, for a GPU) with
    /// [`Dataset::get_batch_into`]. Default: unknown.
    fn dtypes(&self) -> Option<(DType, DType)> {
        None
    }

    /// Writes the batch of `indices` into `features` and `labels`: row-major bytes, exactly
    /// the batch's size in the dtypes of [`Dataset::dtypes`]. The default goes through
    /// [`Dataset::get_batch`]; in-memory datasets copy rows directly.
    fn get_batch_into(
        &self,
        indices: &[usize],
        features: &mut [u8],
        labels: &mut [u8],
    ) -> Result<()> {
        let b = self.get_batch(indices)?;
        copy_exact("Dataset::get_batch_into", features, b.features.as_bytes())?;
        copy_exact("Dataset::get_batch_into", labels, b.labels.as_bytes())
    }

    /// The features and labels as page-locked host arrays, when the dataset keeps them so
    /// ([`ArrayDataset::pin`]): a loader on a GPU then has the device gather each batch
    /// straight from host memory ([`kiln_core::Backend::gather_host_rows`]), and the host
    /// copies nothing. Default: `None`.
    fn pinned_rows(&self) -> Option<(HostRows, HostRows)> {
        None
    }

    /// One sample, as a batch of one.
    fn get(&self, index: usize) -> Result<Batch> {
        self.get_batch(&[index])
    }
}

/// A dataset held in memory as two row-major buffers (features and labels), like PyTorch's
/// `TensorDataset`. [`crate::Mnist`] gives two of these.
#[derive(Clone, Debug)]
pub struct ArrayDataset {
    features: HostBuffer,
    feature_dims: Vec<usize>,
    labels: HostBuffer,
    label_dims: Vec<usize>,
    len: usize,
    /// Page-locked copies of both arrays ([`ArrayDataset::pin`]).
    pinned: Option<(HostRows, HostRows)>,
}

/// Equal contents; whether either is pinned does not matter.
impl PartialEq for ArrayDataset {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.features,
            &self.feature_dims,
            &self.labels,
            &self.label_dims,
            self.len,
        ) == (
            &other.features,
            &other.feature_dims,
            &other.labels,
            &other.label_dims,
            other.len,
        )
    }
}

impl ArrayDataset {
    /// `len` samples: `features` holds `len * prod(feature_dims)` elements and `labels`
    /// `len * prod(label_dims)`, both row-major.
    pub fn new(
        features: HostBuffer,
        feature_dims: impl Into<Vec<usize>>,
        labels: HostBuffer,
        label_dims: impl Into<Vec<usize>>,
        len: usize,
    ) -> Result<Self> {
        let feature_dims = feature_dims.into();
        let label_dims = label_dims.into();
        for (what, buf, dims) in [
            ("features", &features, &feature_dims),
            ("labels", &labels, &label_dims),
        ] {
            let need = dims
                .iter()
                .try_fold(len, |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    Error::invalid("ArrayDataset::new", format!("{what}: size overflows"))
                })?;
            if buf.len() != need {
                return Err(Error::invalid(
                    "ArrayDataset::new",
                    format!(
                        "{what}: {len} samples of shape {dims:?} need {need} elements, got {}",
                        buf.len()
                    ),
                ));
            }
        }
        Ok(ArrayDataset {
            features,
            feature_dims,
            labels,
            label_dims,
            len,
            pinned: None,
        })
    }

    /// The dataset with its features converted to the float `dtype` on the host, once, so
    /// that every batch a `DataLoader` makes is already of that dtype: `F16`/`BF16` halve the
    /// memory and the bytes each batch moves (values rounded to nearest even, as `cast` does).
    /// A pinned copy is dropped (pin again after converting).
    pub fn features_as(mut self, dtype: DType) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::DTypeMismatch {
                op: "ArrayDataset::features_as",
                expected: "a float dtype (f32, f64, f16, bf16)".into(),
                got: dtype,
            });
        }
        if self.features.dtype() != dtype {
            self.features = HostBuffer::from_f64(dtype, &self.features.to_f64_vec());
            self.pinned = None;
        }
        Ok(self)
    }

    pub fn features(&self) -> &HostBuffer {
        &self.features
    }
    pub fn labels(&self) -> &HostBuffer {
        &self.labels
    }
    pub fn feature_dtype(&self) -> DType {
        self.features.dtype()
    }
    pub fn label_dtype(&self) -> DType {
        self.labels.dtype()
    }

    /// Keeps a page-locked copy of the features and labels, so that a `DataLoader` on a GPU
    /// has the device gather each batch's rows straight from host memory: one kernel reads
    /// every row once over the bus, where the host-side loader had a pool of threads gather
    /// the rows into a pinned block first (~30 GB/s of host memory traffic beside the
    /// training thread at MNIST batch 1000; see `DataLoader`).
    ///
    /// f32 features that are all bytes in disguise — `b / 255` or whole numbers 0 to 255, as
    /// MNIST's pixels are ([`crate::Pixels`]) — are kept as bytes: a quarter of the memory
    /// locked and of the bytes over the bus, and the device decodes them to the same f32 bits.
    /// The ordinary copy stays for host-side reads ([`Dataset::get_batch`]), so the dataset
    /// takes up to twice its size in host memory. Needs a GPU backend with a GPU (a typed
    /// error otherwise, or when the system cannot lock that much memory).
    pub fn pin(mut self) -> Result<Self> {
        const OP: &str = "ArrayDataset::pin";
        let elems = |dims: &[usize]| dims.iter().product::<usize>();
        let rows = |b: &HostBuffer, dims: &[usize], id_bound| -> Result<HostRows> {
            let dtype = b.dtype();
            Ok(HostRows {
                block: Arc::new(PinnedBlock::from_bytes(OP, b.as_bytes())?),
                dtype,
                row_bytes: elems(dims) * dtype.size_in_bytes(),
                id_bound,
                bytes_over: None,
            })
        };
        let f = match &self.features {
            HostBuffer::F32(v) => match bytes_over(v) {
                Some((bytes, d)) => HostRows {
                    block: Arc::new(PinnedBlock::from_bytes(OP, &bytes)?),
                    dtype: DType::F32,
                    row_bytes: elems(&self.feature_dims),
                    id_bound: None,
                    bytes_over: Some(d),
                },
                None => rows(&self.features, &self.feature_dims, None)?,
            },
            _ => rows(&self.features, &self.feature_dims, None)?,
        };
        let l = rows(
            &self.labels,
            &self.label_dims,
            kiln_core::host::id_bound(self.labels.dtype(), self.labels.as_bytes()),
        )?;
        self.pinned = Some((f, l));
        Ok(self)
    }

    /// Whether [`ArrayDataset::pin`] made a page-locked copy.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    fn check_indices(&self, indices: &[usize]) -> Result<()> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len) {
            return Err(Error::invalid(
                "Dataset::get_batch",
                format!(
                    "index {bad} is out of range for a dataset of {} samples",
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// The first `n` samples (or all when `n >= len`): a quick subset for smoke tests.
    pub fn take(&self, n: usize) -> ArrayDataset {
        let idx: Vec<usize> = (0..n.min(self.len)).collect();
        let b = self.get_batch(&idx).expect("indices are in range");
        ArrayDataset {
            features: b.features,
            feature_dims: self.feature_dims.clone(),
            labels: b.labels,
            label_dims: self.label_dims.clone(),
            len: b.len,
            pinned: None,
        }
    }
}

/// When every value is `b as f32 / d` for a byte `b`, with `d` 255 (pixels scaled to `[0, 1]`)
/// or 1 (raw pixels): the bytes and `d`, bit for bit (so `-0.0` and NaN never qualify).
fn bytes_over(v: &[f32]) -> Option<(Vec<u8>, f32)> {
    [255.0f32, 1.0].into_iter().find_map(|d| {
        v.iter()
            .map(|&x| {
                let b = (x * d).round();
                ((0.0..=255.0).contains(&b) && (b as u8 as f32 / d).to_bits() == x.to_bits())
                    .then_some(b as u8)
            })
            .collect::<Option<Vec<u8>>>()
            .map(|bytes| (bytes, d))
    })
}

fn copy_exact(op: &'static str, dst: &mut [u8], src: &[u8]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::invalid(
            op,
            format!(
                "the buffer holds {} bytes, the batch {}",
                dst.len(),
                src.len()
            ),
        ));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Copies rows `indices` (each `row_bytes` long) of `src` into `dst`, split over threads for
/// large batches (one pass, no intermediate buffer).
/// Threads that gather one batch of 1 MiB or more: a pool of their own, a quarter of the
/// cores and at most 4 (`KILN_GATHER_THREADS` overrides it). Enough to copy a batch of a few
/// MB well within a training step, yet few enough that the loader does not take the cores of
/// the training thread, which on a GPU spends its time launching kernels.
fn gather_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = std::env::var("KILN_GATHER_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or((cores / 4).clamp(1, 4));
        if threads == 1 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kiln-gather-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

pub(crate) fn gather_bytes(src: &[u8], row_bytes: usize, indices: &[usize], dst: &mut [u8]) {
    use rayon::prelude::*;
    if row_bytes == 0 {
        return;
    }
    let copy = |(rows, idx): (&mut [u8], &[usize])| {
        for (d, &i) in rows.chunks_exact_mut(row_bytes).zip(idx) {
            d.copy_from_slice(&src[i * row_bytes..(i + 1) * row_bytes]);
        }
    };
    let per_task = (256 << 10) / row_bytes + 1; // about 256 KiB per task
    match gather_pool() {
        Some(pool) if dst.len() >= 1 << 20 => pool.install(|| {
            dst.par_chunks_mut(per_task * row_bytes)
                .zip(indices.par_chunks(per_task))
                .for_each(copy)
        }),
        _ => copy((dst, indices)),
    }
}

/// Copies rows `indices` (each `row` elements long) of `src` into a new buffer.
fn gather(src: &HostBuffer, row: usize, indices: &[usize]) -> HostBuffer {
    fn rows<T: Copy>(v: &[T], row: usize, indices: &[usize]) -> Vec<T> {
        let mut out = Vec::with_capacity(row * indices.len());
        for &i in indices {
            out.extend_from_slice(&v[i * row..(i + 1) * row]);
        }
        out
    }
    match src {
        HostBuffer::F32(v) => HostBuffer::F32(rows(v, row, indices)),
        HostBuffer::F64(v) => HostBuffer::F64(rows(v, row, indices)),
        HostBuffer::I64(v) => HostBuffer::I64(rows(v, row, indices)),
        HostBuffer::U8(v) => HostBuffer::U8(rows(v, row, indices)),
        HostBuffer::F16(v) => HostBuffer::F16(rows(v, row, indices)),
        HostBuffer::BF16(v) => HostBuffer::BF16(rows(v, row, indices)),
    }
}

impl Dataset for ArrayDataset {
    fn len(&self) -> usize {
        self.len
    }
    fn feature_dims(&self) -> &[usize] {
        &self.feature_dims
    }
    fn label_dims(&self) -> &[usize] {
        &self.label_dims
    }
    fn dtypes(&self) -> Option<(DType, DType)> {
        Some((self.features.dtype(), self.labels.dtype()))
    }
    fn get_batch_into(
        &self,
        indices: &[usize],
        features: &mut [u8],
        labels: &mut [u8],
    ) -> Result<()> {
        self.check_indices(indices)?;
        let row = |b: &HostBuffer, dims: &[usize]| {
            dims.iter().product::<usize>() * b.dtype().size_in_bytes()
        };
        let (fr, lr) = (
            row(&self.features, &self.feature_dims),
            row(&self.labels, &self.label_dims),
        );
        for (buf, r) in [(&*features, fr), (&*labels, lr)] {
            if buf.len() != r * indices.len() {
                return Err(Error::invalid(
                    "Dataset::get_batch_into",
                    format!(
                        "the buffer holds {} bytes, the batch {}",
                        buf.len(),
                        r * indices.len()
                    ),
                ));
            }
        }
        gather_bytes(self.features.as_bytes(), fr, indices, features);
        gather_bytes(self.labels.as_bytes(), lr, indices, labels);
        Ok(())
    }
    fn pinned_rows(&self) -> Option<(HostRows, HostRows)> {
        self.pinned.clone()
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        self.check_indices(indices)?;
        Ok(Batch {
            features: gather(&self.features, self.feature_dims.iter().product(), indices),
            labels: gather(&self.labels, self.label_dims.iter().product(), indices),
            len: indices.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ds() -> ArrayDataset {
        ArrayDataset::new(
            HostBuffer::F32((0..12).map(|x| x as f32).collect()),
            [2, 2],
            HostBuffer::I64(vec![10, 11, 12]),
            [],
            3,
        )
        .unwrap()
    }

    #[test]
    fn gathers_rows_in_order() {
        let d = ds();
        let b = d.get_batch(&[2, 0, 2]).unwrap();
        assert_eq!(b.len, 3);
        assert_eq!(
            b.features,
            HostBuffer::F32(vec![
                8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0
            ])
        );
        assert_eq!(b.labels, HostBuffer::I64(vec![12, 10, 12]));
        assert_eq!(d.get(1).unwrap().labels, HostBuffer::I64(vec![11]));
        assert_eq!(d.get_batch(&[]).unwrap().features.len(), 0);
    }

    #[test]
    fn out_of_range_is_an_error() {
        let e = ds().get_batch(&[0, 3]).unwrap_err().to_string();
        assert!(e.contains("index 3") && e.contains("3 samples"), "{e}");
    }

    #[test]
    fn new_checks_lengths() {
        let e = ArrayDataset::new(
            HostBuffer::F32(vec![0.0; 11]),
            [2, 2],
            HostBuffer::I64(vec![0; 3]),
            [],
            3,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("features") && e.contains("need 12"), "{e}");
        assert!(
            ArrayDataset::new(
                HostBuffer::F32(vec![0.0; 12]),
                [2, 2],
                HostBuffer::I64(vec![0; 2]),
                [],
                3
            )
            .is_err()
        );
    }

    #[test]
    fn bytes_in_disguise_are_found_bit_for_bit() {
        let px: Vec<f32> = [0u8, 1, 128, 255]
            .iter()
            .map(|&b| b as f32 / 255.0)
            .collect();
        assert_eq!(bytes_over(&px), Some((vec![0, 1, 128, 255], 255.0)));
        assert_eq!(bytes_over(&[0.0, 3.0, 255.0]), Some((vec![0, 3, 255], 1.0)));
        for not_bytes in [&[0.5f32][..], &[-0.0], &[256.0], &[f32::NAN], &[0.1]] {
            assert_eq!(bytes_over(not_bytes), None, "{not_bytes:?}");
        }
    }

    #[test]
    fn take_is_a_prefix() {
        let t = ds().take(2);
        assert_eq!(t.len(), 2);
        assert_eq!(t.labels(), &HostBuffer::I64(vec![10, 11]));
        assert_eq!(ds().take(99), ds());
    }
}
