//! MNIST from the four standard IDX files in one directory.
//!
//! The files keep their original names, each either plain or gzipped (`.gz` added), exactly as
//! LeCun's site and its mirrors distribute them, so `--data-dir` can point at a download
//! unchanged. The repository bundles a 5,000-digit subset in `data/mnist/` (see its README).

use std::path::{Path, PathBuf};

use kiln_core::{Error, HostBuffer, Result};

use crate::dataset::ArrayDataset;
use crate::idx::{IdxData, read_idx};

/// The standard file names (without `.gz`).
pub const TRAIN_IMAGES: &str = "train-images-idx3-ubyte";
pub const TRAIN_LABELS: &str = "train-labels-idx1-ubyte";
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte";
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte";

/// Image side in pixels.
pub const SIDE: usize = 28;
/// Number of classes.
pub const CLASSES: usize = 10;

/// How pixels are turned into f32 features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Pixels {
    /// `byte / 255`, in `[0, 1]` (the usual choice, and Chainer's `get_mnist()` default).
    #[default]
    Scaled,
    /// The raw byte value as f32, in `[0, 255]`.
    Raw,
}

/// The MNIST training and test sets.
///
/// Features are f32 of shape `[784]` per sample (reshape to `[1, 28, 28]` in the
/// `DataLoader` for convolutions); labels are i64 class indices in `0..10`.
#[derive(Clone, Debug)]
pub struct Mnist {
    pub train: ArrayDataset,
    pub test: ArrayDataset,
}

impl Mnist {
    /// Loads the four files from `dir`, with pixels scaled to `[0, 1]`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Mnist> {
        Self::load_with(dir, Pixels::Scaled)
    }

    pub fn load_with(dir: impl AsRef<Path>, pixels: Pixels) -> Result<Mnist> {
        let dir = dir.as_ref();
        Ok(Mnist {
            train: load_split(dir, TRAIN_IMAGES, TRAIN_LABELS, pixels)?,
            test: load_split(dir, TEST_IMAGES, TEST_LABELS, pixels)?,
        })
    }

    /// The directory of the digits bundled with the repository (`<repo>/data/mnist`), found
    /// from this crate's source location: valid wherever the repository is checked out and
    /// built, not for a binary copied elsewhere (use an explicit directory there).
    pub fn bundled_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mnist")
    }
}

/// `dir/name`, or `dir/name.gz` when only that exists.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let plain = dir.join(name);
    if plain.exists() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.exists() {
        return Ok(gz);
    }
    Err(Error::Io {
        path: plain.display().to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no such MNIST file (nor {name}.gz) in {}", dir.display()),
        ),
    })
}

fn load_split(dir: &Path, images: &str, labels: &str, pixels: Pixels) -> Result<ArrayDataset> {
    let img_path = find(dir, images)?;
    let lbl_path = find(dir, labels)?;
    let img = read_idx(&img_path)?;
    let lbl = read_idx(&lbl_path)?;
    let corrupt = |p: &Path, msg: String| Error::Corrupt {
        path: p.display().to_string(),
        msg,
    };

    let img_dims = img.dims().to_vec();
    let img_type = img.data().type_name();
    let px = match (img_dims.as_slice(), img.into_data()) {
        (&[_, SIDE, SIDE], IdxData::U8(px)) => px,
        _ => {
            return Err(corrupt(
                &img_path,
                format!(
                    "MNIST images must be u8 of shape [n, 28, 28], found {img_type} {img_dims:?}"
                ),
            ));
        }
    };
    let n = img_dims[0];
    let labels_u8 = match (lbl.dims(), lbl.data()) {
        (&[_], IdxData::U8(v)) => v,
        _ => {
            return Err(corrupt(
                &lbl_path,
                format!(
                    "MNIST labels must be u8 of shape [n], found {} {:?}",
                    lbl.data().type_name(),
                    lbl.dims()
                ),
            ));
        }
    };
    if labels_u8.len() != n {
        return Err(corrupt(
            &lbl_path,
            format!(
                "{} labels for {n} images in {}",
                labels_u8.len(),
                img_path.display()
            ),
        ));
    }
    if let Some((i, &l)) = labels_u8
        .iter()
        .enumerate()
        .find(|&(_, &l)| l as usize >= CLASSES)
    {
        return Err(corrupt(
            &lbl_path,
            format!("label {l} at index {i} is not a digit 0-9"),
        ));
    }
    let labels: Vec<i64> = labels_u8.iter().map(|&l| l as i64).collect();
    let features: Vec<f32> = match pixels {
        Pixels::Scaled => px.iter().map(|&p| p as f32 / 255.0).collect(),
        Pixels::Raw => px.iter().map(|&p| p as f32).collect(),
    };
    ArrayDataset::new(
        HostBuffer::F32(features),
        [SIDE * SIDE],
        HostBuffer::I64(labels),
        [],
        n,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dataset;
    use crate::idx::{Idx, write_idx};

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kiln-mnist-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn images(n: usize) -> Idx {
        let px = (0..n * 784).map(|i| (i % 256) as u8).collect();
        Idx::new([n, 28, 28], IdxData::U8(px)).unwrap()
    }
    fn labels(v: &[u8]) -> Idx {
        Idx::new([v.len()], IdxData::U8(v.to_vec())).unwrap()
    }

    fn write_all(dir: &Path, train: (Idx, Idx), test: (Idx, Idx), gzip: bool) {
        let ext = if gzip { ".gz" } else { "" };
        write_idx(dir.join(format!("{TRAIN_IMAGES}{ext}")), &train.0, gzip).unwrap();
        write_idx(dir.join(format!("{TRAIN_LABELS}{ext}")), &train.1, gzip).unwrap();
        write_idx(dir.join(format!("{TEST_IMAGES}{ext}")), &test.0, gzip).unwrap();
        write_idx(dir.join(format!("{TEST_LABELS}{ext}")), &test.1, gzip).unwrap();
    }

    #[test]
    fn loads_plain_and_gzip() {
        for gzip in [false, true] {
            let d = tmpdir(&format!("ok{gzip}"));
            write_all(
                &d,
                (images(3), labels(&[1, 2, 9])),
                (images(1), labels(&[0])),
                gzip,
            );
            let m = Mnist::load(&d).unwrap();
            assert_eq!((m.train.len(), m.test.len()), (3, 1));
            assert_eq!(m.train.feature_dims(), &[784]);
            assert_eq!(m.train.labels(), &HostBuffer::I64(vec![1, 2, 9]));
            let HostBuffer::F32(f) = m.train.features() else {
                panic!("f32 features")
            };
            assert_eq!(f[255], 1.0);
            assert_eq!(f[1], 1.0 / 255.0);
            assert!(f.iter().all(|&x| (0.0..=1.0).contains(&x)));
            let raw = Mnist::load_with(&d, Pixels::Raw).unwrap();
            let HostBuffer::F32(f) = raw.test.features() else {
                panic!("f32 features")
            };
            assert_eq!(f[255], 255.0);
            std::fs::remove_dir_all(&d).unwrap();
        }
    }

    #[test]
    fn missing_file_names_the_path() {
        let d = tmpdir("missing");
        write_all(
            &d,
            (images(1), labels(&[1])),
            (images(1), labels(&[1])),
            true,
        );
        std::fs::remove_file(d.join(format!("{TEST_LABELS}.gz"))).unwrap();
        match Mnist::load(&d) {
            Err(Error::Io { path, .. }) => assert!(path.ends_with(TEST_LABELS), "{path}"),
            other => panic!("expected Error::Io, got {other:?}"),
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn rejects_inconsistent_files() {
        let cases: Vec<(&str, Idx, Idx, &str)> = vec![
            ("count", images(2), labels(&[1]), "1 labels for 2 images"),
            ("label", images(1), labels(&[10]), "label 10"),
            (
                "side",
                Idx::new([1, 28, 27], IdxData::U8(vec![0; 28 * 27])).unwrap(),
                labels(&[1]),
                "[n, 28, 28]",
            ),
            (
                "type",
                images(1),
                Idx::new([1], IdxData::I32(vec![1])).unwrap(),
                "labels must be u8",
            ),
        ];
        for (tag, img, lbl, want) in cases {
            let d = tmpdir(tag);
            write_all(&d, (img, lbl), (images(1), labels(&[1])), false);
            match Mnist::load(&d) {
                Err(e @ Error::Corrupt { .. }) => {
                    assert!(e.to_string().contains(want), "{tag}: {e}")
                }
                other => panic!("{tag}: expected Error::Corrupt, got {other:?}"),
            }
            std::fs::remove_dir_all(&d).unwrap();
        }
    }
}
