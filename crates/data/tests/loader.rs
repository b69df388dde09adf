//! DataLoader behaviour on the reference backend: batching, shuffling, prefetch, errors, and
//! clean shutdown when an epoch is dropped early.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{DType, Error, HostBuffer, Result};
use kiln_data::{ArrayDataset, Batch, DataLoader, Dataset, permutation};

type Loader = DataLoader<Reference>;
const DEV: RefDevice = RefDevice(0);

/// `n` samples: features `[i, i+0.5, i+0.25, i+0.125]` as f32 `[4]`, label `i` (i64).
fn counting(n: usize) -> ArrayDataset {
    let f = (0..n)
        .flat_map(|i| [0.0, 0.5, 0.25, 0.125].map(|d| i as f32 + d))
        .collect();
    ArrayDataset::new(
        HostBuffer::F32(f),
        [4],
        HostBuffer::I64((0..n as i64).collect()),
        [],
        n,
    )
    .unwrap()
}

/// Labels of every batch of one epoch, checking each batch's features against its labels.
fn epoch_labels(
    it: impl Iterator<Item = Result<kiln_data::TensorBatch<Reference>>>,
) -> Vec<Vec<i64>> {
    it.map(|b| {
        let (x, y) = b.unwrap();
        assert_eq!(x.dtype(), DType::F32);
        assert_eq!(y.dtype(), DType::I64);
        assert_eq!(x.device(), &DEV);
        assert_eq!(x.dims()[0], y.dims()[0]);
        let labels = y.to_vec::<i64>().unwrap();
        let feats = x.to_vec::<f32>().unwrap();
        for (r, &l) in labels.iter().enumerate() {
            assert_eq!(
                feats[r * 4..r * 4 + 4],
                [0.0, 0.5, 0.25, 0.125].map(|d| l as f32 + d)
            );
        }
        labels
    })
    .collect()
}

#[test]
fn batches_in_order_with_a_partial_last_batch() {
    let mut l = Loader::new(counting(10), 4, &DEV).unwrap();
    assert_eq!(l.num_batches(), 3);
    assert_eq!(l.samples_per_epoch(), 10);
    let mut shapes = vec![];
    for b in l.iter() {
        let (x, y) = b.unwrap();
        shapes.push((x.dims().to_vec(), y.dims().to_vec()));
    }
    assert_eq!(
        shapes,
        [
            (vec![4, 4], vec![4]),
            (vec![4, 4], vec![4]),
            (vec![2, 4], vec![2])
        ]
    );
    assert_eq!(
        epoch_labels(l.iter()),
        [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
    assert_eq!(l.epoch(), 2);
}

#[test]
fn drop_last() {
    let mut l = Loader::new(counting(10), 4, &DEV).unwrap().drop_last(true);
    assert_eq!((l.num_batches(), l.samples_per_epoch()), (2, 8));
    assert_eq!(epoch_labels(l.iter()), [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    // Fewer samples than one batch: no batches at all.
    let mut l = Loader::new(counting(3), 4, &DEV).unwrap().drop_last(true);
    assert_eq!(l.iter().count(), 0);
}

#[test]
fn shuffle_is_seeded_per_epoch_and_covers_everything() {
    let n = 103;
    let mut a = Loader::new(counting(n), 10, &DEV).unwrap().shuffle(7);
    let mut b = Loader::new(counting(n), 10, &DEV)
        .unwrap()
        .shuffle(7)
        .prefetch(0);
    let e0: Vec<i64> = epoch_labels(a.iter()).concat();
    let e1: Vec<i64> = epoch_labels(a.iter()).concat();
    // The documented permutation, whatever the prefetch setting.
    let want0: Vec<i64> = permutation(n, 7, 0).iter().map(|&i| i as i64).collect();
    assert_eq!(e0, want0);
    assert_eq!(epoch_labels(b.iter()).concat(), want0);
    assert_ne!(e0, e1, "a new order every epoch");
    let mut sorted = e1.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..n as i64).collect::<Vec<_>>());
    // Resuming at epoch 1 replays epoch 1.
    b.set_epoch(1);
    assert_eq!(epoch_labels(b.iter()).concat(), e1);
    assert_eq!(epoch_labels(a.epoch_iter(1)).concat(), e1);
}

#[test]
fn the_next_epoch_started_ahead_is_the_one_iter_runs() {
    let n = 57;
    let mut l = Loader::new(counting(n), 8, &DEV).unwrap().shuffle(3);
    let want = |e: u64| -> Vec<i64> { permutation(n, 3, e).iter().map(|&i| i as i64).collect() };
    // Consecutive epochs (each one's successor started ahead), a jump back, a jump forward,
    // and a change of settings in between: each epoch is the documented one.
    for e in [0, 1, 2] {
        assert_eq!(epoch_labels(l.iter()).concat(), want(e), "epoch {e}");
    }
    l.set_epoch(1);
    assert_eq!(epoch_labels(l.iter()).concat(), want(1));
    l.set_epoch(7);
    assert_eq!(epoch_labels(l.iter()).concat(), want(7));
    let mut l = l.shuffle(4);
    assert_eq!(
        epoch_labels(l.iter()).concat(),
        permutation(n, 4, 8)
            .iter()
            .map(|&i| i as i64)
            .collect::<Vec<_>>()
    );
    // An epoch abandoned half-way does not disturb the next one.
    let mut it = l.iter();
    it.next().unwrap().unwrap();
    drop(it);
    assert_eq!(
        epoch_labels(l.iter()).concat(),
        permutation(n, 4, 10)
            .iter()
            .map(|&i| i as i64)
            .collect::<Vec<_>>()
    );
}

#[test]
fn prefetch_depths_agree() {
    let runs: Vec<Vec<Vec<i64>>> = [0, 1, 2, 5]
        .into_iter()
        .map(|p| {
            let mut l = Loader::new(counting(50), 8, &DEV)
                .unwrap()
                .shuffle(1)
                .prefetch(p);
            epoch_labels(l.iter())
        })
        .collect();
    assert!(runs.iter().all(|r| r == &runs[0]));
}

#[test]
fn sample_shape_reshapes_features() {
    let mut l = Loader::new(counting(5), 2, &DEV)
        .unwrap()
        .sample_shape([1, 2, 2])
        .unwrap();
    let (x, _) = l.iter().next().unwrap().unwrap();
    assert_eq!(x.dims(), &[2, 1, 2, 2]);
    let e = Loader::new(counting(5), 2, &DEV)
        .unwrap()
        .sample_shape([1, 28, 28])
        .unwrap_err()
        .to_string();
    assert!(e.contains("[1, 28, 28]"), "{e}");
}

#[test]
fn features_decode_into_sixteen_bit_batches() {
    for dtype in [DType::F16, DType::BF16] {
        let ds = counting(6).features_as(dtype).unwrap();
        assert_eq!(ds.feature_dtype(), dtype);
        let mut l = Loader::new(ds, 4, &DEV).unwrap();
        let (x, y) = l.iter().next().unwrap().unwrap();
        assert_eq!((x.dtype(), y.dtype()), (dtype, DType::I64));
        // Whole numbers and eighths are exact in both types.
        let want: Vec<f32> = (0..4)
            .flat_map(|i| [0.0, 0.5, 0.25, 0.125].map(|d| i as f32 + d))
            .collect();
        let got = x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got, want);
    }
    assert!(matches!(
        counting(2).features_as(DType::I64),
        Err(Error::DTypeMismatch { .. })
    ));
    // Values round once, to nearest even: 1 + 2^-9 is not a bf16.
    let ds = ArrayDataset::new(
        HostBuffer::F32(vec![1.0 + 2f32.powi(-9)]),
        [1],
        HostBuffer::I64(vec![0]),
        [],
        1,
    )
    .unwrap()
    .features_as(DType::BF16)
    .unwrap();
    assert_eq!(ds.features(), &HostBuffer::BF16(vec![kiln_core::bf16::ONE]));
}

#[test]
fn bad_arguments() {
    assert!(matches!(
        Loader::new(counting(5), 0, &DEV),
        Err(Error::InvalidArgument { .. })
    ));
    let mut empty = Loader::new(counting(0), 3, &DEV).unwrap();
    assert_eq!(empty.iter().count(), 0);
    // A device the backend does not have: the upload fails, the epoch reports it and ends.
    let mut l = Loader::new(counting(5), 2, &RefDevice(9)).unwrap();
    let items: Vec<_> = l.iter().collect();
    assert_eq!(items.len(), 1);
    assert!(items[0].is_err());
}

/// Pinning a dataset needs a GPU backend's page-locked pool: without one (this test binary
/// registers none) it is a typed error naming the op, not an abort.
#[test]
fn pinning_without_a_gpu_is_a_typed_error() {
    match counting(5).pin() {
        Err(Error::InvalidArgument { op, msg }) => {
            assert_eq!(op, "ArrayDataset::pin");
            assert!(msg.contains("page-locked"), "{msg}");
        }
        other => panic!("expected a typed error, got {other:?}"),
    }
}

/// Counts `get_batch` calls; fails at call `fail_at` (an error or a panic), sleeps `delay`.
struct Probe {
    inner: ArrayDataset,
    calls: Arc<AtomicUsize>,
    fail_at: Option<(usize, bool)>,
    delay: Duration,
}

impl Dataset for Probe {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn feature_dims(&self) -> &[usize] {
        self.inner.feature_dims()
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        let k = self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        match self.fail_at {
            Some((at, true)) if k == at => panic!("probe panics at batch {k}"),
            Some((at, false)) if k == at => Err(Error::invalid("probe", format!("fails at {k}"))),
            _ => self.inner.get_batch(indices),
        }
    }
}

fn probe(n: usize, fail_at: Option<(usize, bool)>, delay_ms: u64) -> (Probe, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let p = Probe {
        inner: counting(n),
        calls: calls.clone(),
        fail_at,
        delay: Duration::from_millis(delay_ms),
    };
    (p, calls)
}

/// Runs `f` on another thread and fails (instead of hanging the suite) if it never returns.
fn no_hang(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the loader hung (or the closure panicked)");
}

#[test]
fn a_dataset_error_ends_the_epoch() {
    for prefetch in [0, 2] {
        let (p, _) = probe(10, Some((2, false)), 0);
        let mut l = Loader::new(p, 2, &DEV).unwrap().prefetch(prefetch);
        let items: Vec<_> = l.iter().collect();
        assert_eq!(items.len(), 3, "prefetch {prefetch}");
        assert!(items[0].is_ok() && items[1].is_ok());
        let e = items[2].as_ref().unwrap_err().to_string();
        assert!(e.contains("fails at 2"), "{e}");
    }
}

#[test]
fn a_worker_panic_is_an_error_not_a_hang() {
    no_hang(|| {
        let (p, _) = probe(10, Some((1, true)), 0);
        let mut l = Loader::new(p, 2, &DEV).unwrap();
        let items: Vec<_> = l.iter().collect();
        assert_eq!(items.len(), 2);
        assert!(items[0].is_ok());
        let e = items[1].as_ref().unwrap_err().to_string();
        assert!(e.contains("probe panics at batch 1"), "{e}");
    });
}

#[test]
fn dropping_mid_epoch_stops_the_worker() {
    no_hang(|| {
        // 1000 batches; take two and drop the epoch. The worker may have made a few more,
        // never the rest of the epoch: the group uploaded ahead (1), the channel's (2) and
        // one in flight (1). Drop joins the worker, which opens the gate of the next epoch's
        // worker (started ahead by `iter`): it gathers at most its channel's worth plus one
        // in flight (3) and waits for `iter`.
        const THIS_EPOCH: usize = 2 + 1 + 2 + 1;
        const NEXT_EPOCH: usize = 2 + 1;
        let (p, calls) = probe(1000, None, 1);
        let mut l = Loader::new(p, 1, &DEV).unwrap().prefetch(2);
        let mut it = l.iter();
        it.next().unwrap().unwrap();
        it.next().unwrap().unwrap();
        drop(it);
        std::thread::sleep(Duration::from_millis(200));
        let later = calls.load(Ordering::SeqCst);
        assert!(
            later <= THIS_EPOCH + NEXT_EPOCH,
            "{later} batches made in all: the next epoch ran on"
        );
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            later,
            "a worker still running"
        );
        // Dropped before the first batch, and a loader dropped while its worker is blocked
        // on a full channel.
        drop(l.iter());
        let (p, _) = probe(1000, None, 0);
        let mut l = Loader::new(p, 1, &DEV).unwrap().prefetch(1);
        let it = l.iter();
        std::thread::sleep(Duration::from_millis(10));
        drop(it);
    });
}

#[test]
fn loaders_share_one_dataset_through_an_arc() {
    let ds = Arc::new(counting(6));
    let mut a = Loader::new(ds.clone(), 3, &DEV).unwrap();
    let mut b = Loader::new(ds, 6, &DEV).unwrap();
    assert_eq!(
        epoch_labels(a.iter()).concat(),
        epoch_labels(b.iter()).concat()
    );
}
