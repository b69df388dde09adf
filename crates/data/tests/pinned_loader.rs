//! The DataLoader's pinned path without a GPU: with kiln-core's heap stand-in registered as
//! the pinned allocator, batches are gathered straight into pinned blocks
//! (`Dataset::get_batch_into`) and uploaded from there; the result must equal the plain path,
//! in small batches and in batches large enough for the threaded gather.

use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{HostBuffer, Result};
use kiln_data::{ArrayDataset, DataLoader, Dataset};

fn dataset(n: usize, width: usize) -> ArrayDataset {
    let f = (0..n * width).map(|k| (k % 9973) as f32 * 0.5).collect();
    ArrayDataset::new(
        HostBuffer::F32(f),
        [width],
        HostBuffer::I64((0..n as i64).map(|i| i * 7 % 10).collect()),
        [],
        n,
    )
    .unwrap()
}

/// The stand-in pool is one per process and these tests check that it ends empty: they hold
/// this lock so that one test's live blocks are not counted by another running beside it.
static POOL_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// An epoch's batches as (features, labels) values.
type Batches = Vec<(Vec<f64>, Vec<f64>)>;

fn all_batches(l: &mut DataLoader<Reference>) -> Batches {
    l.iter()
        .map(|b| -> Result<_> {
            let (x, y) = b?;
            Ok((x.to_f64_vec()?, y.to_f64_vec()?))
        })
        .collect::<Result<_>>()
        .unwrap()
}

/// The next epoch's batches and how many uploads the loader made for them.
fn epoch_and_uploads(l: &mut DataLoader<Reference>) -> (Batches, usize) {
    let mut it = l.iter();
    let got = (&mut it)
        .map(|b| {
            let (x, y) = b.unwrap();
            (x.to_f64_vec().unwrap(), y.to_f64_vec().unwrap())
        })
        .collect();
    (got, it.times().uploads)
}

/// Epoch `epoch` of a loader that does not pin, in batches of `batch` shuffled with `seed`: what
/// every pinned path must reproduce.
fn plain_batches(
    data: ArrayDataset,
    batch: usize,
    seed: u64,
    epoch: u64,
) -> Vec<(Vec<f64>, Vec<f64>)> {
    let mut l = DataLoader::<Reference>::new(data, batch, &RefDevice(0))
        .unwrap()
        .shuffle(seed)
        .pin_memory(false);
    l.set_epoch(epoch);
    all_batches(&mut l)
}

#[test]
fn pinned_batches_equal_plain_batches() {
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = RefDevice(0);
    // 3 KiB rows: batches of 700 rows pass the threaded gather's 1 MiB threshold.
    for (n, width, batch) in [(50, 4, 7), (2000, 784, 700)] {
        let data = dataset(n, width);
        let mut pinned = DataLoader::<Reference>::new(data.clone(), batch, &dev)
            .unwrap()
            .shuffle(3);
        assert_eq!(all_batches(&mut pinned), plain_batches(data, batch, 3, 0));
    }
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}

#[test]
fn grouped_uploads_hand_out_the_same_batches() {
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = RefDevice(0);
    // 50 rows of 4 f32 in batches of 7: 8 batches, the last of 1 row; a batch is 112 bytes.
    let data = dataset(50, 4);
    let plain = plain_batches(data.clone(), 7, 5, 0);
    for (bytes, uploads) in [
        (0, 8),
        (1, 8),
        (3 * 112, 4),
        (3 * 112 + 111, 4),
        (1 << 20, 4),
    ] {
        let mut l = DataLoader::<Reference>::new(data.clone(), 7, &dev)
            .unwrap()
            .shuffle(5)
            .upload_bytes(bytes);
        let mut it = l.iter();
        let mut got = Vec::new();
        for b in &mut it {
            let (x, y) = b.unwrap();
            got.push((x.to_f64_vec().unwrap(), y.to_f64_vec().unwrap()));
        }
        assert_eq!(got, plain, "upload_bytes {bytes}");
        // The first batch alone, then groups doubling up to as many as fit in `bytes`:
        // 1, 2, 3, 2 batches with room for 3; 1, 2, 4, 1 with room for all.
        assert_eq!(it.times().uploads, uploads, "upload_bytes {bytes}");
    }
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}

#[test]
fn get_batch_into_checks_its_buffers() {
    let d = dataset(10, 3);
    let (mut f, mut l) = (vec![0u8; 2 * 3 * 4], vec![0u8; 2 * 8]);
    d.get_batch_into(&[4, 1], &mut f, &mut l).unwrap();
    let b = d.get_batch(&[4, 1]).unwrap();
    assert_eq!(f, b.features.as_bytes());
    assert_eq!(l, b.labels.as_bytes());
    let mut short = vec![0u8; 5];
    assert!(d.get_batch_into(&[4, 1], &mut short, &mut l).is_err());
    assert!(d.get_batch_into(&[40], &mut f[..12], &mut l[..8]).is_err());
}

/// Counts the host gathers a loader asks of a dataset (none when the device gathers).
struct Counting {
    inner: ArrayDataset,
    host_gathers: std::sync::atomic::AtomicUsize,
}

impl Dataset for Counting {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn feature_dims(&self) -> &[usize] {
        self.inner.feature_dims()
    }
    fn get_batch(&self, indices: &[usize]) -> Result<kiln_data::Batch> {
        self.host_gathers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.get_batch(indices)
    }
    fn dtypes(&self) -> Option<(kiln_core::DType, kiln_core::DType)> {
        self.inner.dtypes()
    }
    fn get_batch_into(&self, indices: &[usize], f: &mut [u8], l: &mut [u8]) -> Result<()> {
        self.host_gathers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.get_batch_into(indices, f, l)
    }
    fn pinned_rows(&self) -> Option<(kiln_core::HostRows, kiln_core::HostRows)> {
        self.inner.pinned_rows()
    }
}

/// A pinned dataset on a backend that gathers host rows itself (the reference does, on the
/// host), asked to (`device_gather`): no host gather at all, the same batches as the plain path whatever the grouping and
/// the prefetch depth, the labels' id bound known, and every pinned block given back.
#[test]
fn a_pinned_dataset_is_gathered_by_the_device_into_the_same_batches() {
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = RefDevice(0);
    let data = dataset(50, 4);
    let plain = plain_batches(data.clone(), 7, 5, 0);
    let pinned = data.clone().pin().unwrap();
    assert!(pinned.is_pinned() && !data.is_pinned());
    assert_eq!(pinned, data, "pinning keeps the contents");
    let (_, labels) = pinned.pinned_rows().unwrap();
    assert_eq!(labels.id_bound, Some(10), "labels are i * 7 % 10");
    drop(labels);
    let counting = std::sync::Arc::new(Counting {
        inner: pinned,
        host_gathers: Default::default(),
    });
    for (bytes, prefetch, uploads) in [(0, 2, 8), (3 * 112, 1, 4), (1 << 20, 0, 4), (1, 5, 8)] {
        let mut l = DataLoader::<Reference>::new(counting.clone(), 7, &dev)
            .unwrap()
            .shuffle(5)
            .device_gather(true)
            .upload_bytes(bytes)
            .prefetch(prefetch);
        // Two epochs: the second must not reuse the first's groups.
        for _ in 0..2 {
            let (got, got_uploads) = epoch_and_uploads(&mut l);
            assert_eq!(got_uploads, uploads, "upload_bytes {bytes}");
            let want = plain_batches(data.clone(), 7, 5, l.epoch() - 1);
            assert_eq!(got, want, "upload_bytes {bytes}");
        }
        assert_eq!(
            got_host_gathers(&counting),
            0,
            "the device gathered every batch"
        );
    }
    assert_eq!(
        all_batches(
            &mut DataLoader::<Reference>::new(counting.clone(), 7, &dev)
                .unwrap()
                .shuffle(5)
                .device_gather(true)
        ),
        plain
    );
    // With pinning off the loader gathers on the host again.
    let mut off = DataLoader::<Reference>::new(counting.clone(), 7, &dev)
        .unwrap()
        .shuffle(5)
        .pin_memory(false);
    assert_eq!(all_batches(&mut off), plain);
    assert!(got_host_gathers(&counting) > 0);
    drop((off, counting));
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}

/// A pinned dataset by default: the worker copies its rows as stored into pinned blocks (not
/// through `get_batch_into`) and the backend decodes them: the plain path's batches, whatever
/// the grouping and the prefetch depth, and every pinned block given back.
#[test]
fn a_pinned_dataset_is_copied_as_stored_into_the_same_batches() {
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = RefDevice(0);
    let data = dataset(50, 4);
    let counting = std::sync::Arc::new(Counting {
        inner: data.clone().pin().unwrap(),
        host_gathers: Default::default(),
    });
    for (bytes, prefetch) in [(0, 2), (3 * 112, 1), (1 << 20, 0), (1, 5)] {
        let mut l = DataLoader::<Reference>::new(counting.clone(), 7, &dev)
            .unwrap()
            .shuffle(5)
            .upload_bytes(bytes)
            .prefetch(prefetch);
        for _ in 0..2 {
            let got = all_batches(&mut l);
            let want = plain_batches(data.clone(), 7, 5, l.epoch() - 1);
            assert_eq!(got, want, "upload_bytes {bytes}, prefetch {prefetch}");
        }
    }
    // In order (no shuffling) each group is one range of the pinned arrays, uploaded from the
    // dataset's own blocks, whoever would gather.
    let mut want = DataLoader::<Reference>::new(data.clone(), 7, &dev)
        .unwrap()
        .pin_memory(false);
    let want = all_batches(&mut want);
    // Groups of rows copied as stored grow four times: 1, 3, 3, 1 batches with room for 3,
    // 1, 4, 3 with room for all (a prefetch of 0 uploads each batch in `next()`, uncounted).
    for (device_gather, prefetch, bytes, uploads) in [
        (false, 2, 3 * 112, 4),
        (false, 0, 3 * 112, 0),
        (true, 2, 3 * 112, 4),
        (false, 2, 1 << 20, 3),
        (true, 1, 1 << 20, 3),
    ] {
        let mut l = DataLoader::<Reference>::new(counting.clone(), 7, &dev)
            .unwrap()
            .upload_bytes(bytes)
            .device_gather(device_gather)
            .prefetch(prefetch);
        let (got, got_uploads) = epoch_and_uploads(&mut l);
        assert_eq!(got, want, "in order, {device_gather}, {bytes}");
        assert_eq!(got_uploads, uploads, "{device_gather}, {bytes}");
    }
    assert_eq!(got_host_gathers(&counting), 0, "rows copied as stored");
    drop(counting);
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}

fn got_host_gathers(c: &Counting) -> usize {
    c.host_gathers.load(std::sync::atomic::Ordering::Relaxed)
}

/// `n` rows of `width` MNIST-like features (`byte / 255`) and labels `i % 10`.
fn pixel_dataset(n: usize, width: usize) -> ArrayDataset {
    let f = (0..n * width)
        .map(|k| (k * 37 % 256) as f32 / 255.0)
        .collect();
    let labels = HostBuffer::I64((0..n as i64).map(|i| i % 10).collect());
    ArrayDataset::new(HostBuffer::F32(f), [width], labels, [], n).unwrap()
}

/// MNIST-like features (`byte / 255`) are pinned as bytes and decoded on the device: the same
/// batches, bit for bit, as the plain path.
#[test]
fn pixel_features_are_pinned_as_bytes_and_decode_to_the_same_batches() {
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = RefDevice(0);
    let (n, width) = (40, 12);
    let data = pixel_dataset(n, width);
    let pinned = data.clone().pin().unwrap();
    let (features, _) = pinned.pinned_rows().unwrap();
    assert_eq!(features.bytes_over, Some(255.0));
    assert_eq!(features.block.len(), n * width, "one byte per pixel");
    drop(features);
    let plain = plain_batches(data.clone(), 6, 1, 0);
    // Copied as bytes by the worker and decoded after the upload, or gathered and decoded by
    // the device.
    let mut in_order = DataLoader::<Reference>::new(data, 6, &dev)
        .unwrap()
        .pin_memory(false);
    let in_order = all_batches(&mut in_order);
    for (device_gather, shuffle) in [(false, true), (true, true), (false, false), (true, false)] {
        let l = DataLoader::<Reference>::new(pinned.clone(), 6, &dev)
            .unwrap()
            .device_gather(device_gather);
        let (mut l, plain) = match shuffle {
            true => (l.shuffle(1), &plain),
            false => (l, &in_order),
        };
        let got = all_batches(&mut l);
        assert_eq!(
            &got, plain,
            "device_gather {device_gather}, shuffle {shuffle}"
        );
        let bits = |v: &[(Vec<f64>, Vec<f64>)]| -> Vec<u64> {
            v.iter()
                .flat_map(|(x, _)| x.iter().map(|f| f.to_bits()))
                .collect()
        };
        assert_eq!(bits(&got), bits(plain), "the same bits");
    }
    drop(pinned);
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}

/// A backend that neither gathers nor copies host rows itself (the CPU backend): the worker
/// copies the pinned pixel bytes as stored, uploads them and decodes them with tensor ops, and
/// the batches are the plain path's, bit for bit, shuffled and in order.
#[test]
fn a_backend_without_host_row_copies_decodes_stored_rows_itself() {
    use kiln_backend_cpu::Cpu;
    use kiln_core::Backend;
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = Cpu::device(0);
    assert!(!Cpu::gathers_host_rows(&dev));
    let (n, width) = (40, 12);
    let data = pixel_dataset(n, width);
    let pinned = data.clone().pin().unwrap();
    let batches = |l: &mut DataLoader<Cpu>| -> Vec<(Vec<u32>, Vec<i64>)> {
        l.iter()
            .map(|b| {
                let (x, y) = b.unwrap();
                let x = x.to_vec::<f32>().unwrap();
                (x.iter().map(|v| v.to_bits()).collect(), y.to_vec().unwrap())
            })
            .collect()
    };
    for shuffle in [false, true] {
        let loader = |d: &ArrayDataset| {
            let l = DataLoader::<Cpu>::new(d.clone(), 6, &dev).unwrap();
            if shuffle { l.shuffle(1) } else { l }
        };
        let want = batches(&mut loader(&data).pin_memory(false));
        let got = batches(&mut loader(&pinned).upload_bytes(1 << 20));
        assert_eq!(got, want, "shuffle {shuffle}");
    }
    drop(pinned);
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}

/// The reference backend's `copy_host_rows`: the rows of the range as `gather_host_rows` gives
/// them, and typed errors for a range past the rows and for an inverted one.
#[test]
fn the_reference_copies_a_range_of_host_rows() {
    use kiln_core::{Backend, Error};
    let _serial = POOL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let pool = kiln_core::test_pinned::register();
    let dev = RefDevice(0);
    let pinned = pixel_dataset(40, 12).pin().unwrap();
    let (f, l) = pinned.pinned_rows().unwrap();
    let srcs = [f, l];
    let values = |s: Vec<kiln_core::reference::RefStorage>| -> Vec<HostBuffer> {
        s.iter().map(|s| s.data().clone()).collect()
    };
    let got = Reference::copy_host_rows(&dev, &srcs, 5..17)
        .unwrap()
        .unwrap();
    let rows: Vec<usize> = (5..17).collect();
    let want = Reference::gather_host_rows(&dev, &srcs, &rows)
        .unwrap()
        .unwrap();
    assert_eq!(values(got), values(want));
    for bad in [38..41, 41..41] {
        let e = Reference::copy_host_rows(&dev, &srcs, bad.clone()).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::InvalidArgument {
                    op: "copy_host_rows",
                    ..
                }
            ),
            "{bad:?}: {e}"
        );
    }
    #[allow(clippy::reversed_empty_ranges)]
    let inverted = 9..3;
    assert!(Reference::copy_host_rows(&dev, &srcs, inverted).is_err());
    drop((srcs, pinned));
    assert_eq!(pool.live(), 0, "every pinned block was given back");
}
