//! Converts the 5,000-digit MNIST CSV into the four gzipped IDX files bundled in `data/mnist/`.
//!
//! ```text
//! cargo run -p kiln-data --example convert_mnist_csv -- [INPUT.csv[.gz]] [OUT_DIR] [TRAIN_PER_DIGIT]
//! ```
//!
//! Defaults: `../shared/data/mnist_5k.csv.gz`, `data/mnist`, 400. Each CSV row is 784 pixel
//! values (0-255) then the label (0-9); a non-numeric first row is taken as a header and
//! skipped. The split is per digit, in file order: the first `TRAIN_PER_DIGIT` rows of each
//! digit go to the training set, the rest to the test set, so both sets are balanced whatever
//! the row order. The output is byte-for-byte reproducible (gzip without timestamps).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use kiln_core::{Error, Result};
use kiln_data::mnist::{TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES, TRAIN_LABELS};
use kiln_data::{Idx, IdxData, Mnist, write_idx};

const PIXELS: usize = 784;

struct Split {
    images: Vec<u8>,
    labels: Vec<u8>,
}

impl Split {
    fn write(&self, dir: &Path, images: &str, labels: &str) -> Result<()> {
        let n = self.labels.len();
        let img = Idx::new([n, 28, 28], IdxData::U8(self.images.clone()))?;
        let lbl = Idx::new([n], IdxData::U8(self.labels.clone()))?;
        write_idx(dir.join(format!("{images}.gz")), &img, true)?;
        write_idx(dir.join(format!("{labels}.gz")), &lbl, true)
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let input = PathBuf::from(args.first().map_or("../shared/data/mnist_5k.csv.gz", |s| s));
    let out = PathBuf::from(args.get(1).map_or("data/mnist", |s| s));
    let per_digit: usize = match args.get(2) {
        None => 400,
        Some(s) => s
            .parse()
            .map_err(|_| Error::invalid("convert", format!("bad TRAIN_PER_DIGIT {s:?}")))?,
    };
    let name = input.display().to_string();
    let io_err = |p: &Path| {
        let p = p.display().to_string();
        move |source| Error::Io { path: p, source }
    };
    let corrupt = |msg: String| Error::Corrupt {
        path: name.clone(),
        msg,
    };

    let raw = std::fs::read(&input).map_err(io_err(&input))?;
    let reader: Box<dyn Read> = if raw.starts_with(&[0x1f, 0x8b]) {
        Box::new(MultiGzDecoder::new(&raw[..]))
    } else {
        Box::new(&raw[..])
    };

    let mut train = Split {
        images: vec![],
        labels: vec![],
    };
    let mut test = Split {
        images: vec![],
        labels: vec![],
    };
    let mut seen = [0usize; 10];
    let mut row = Vec::with_capacity(PIXELS + 1);
    for (lineno, line) in BufReader::new(reader).lines().enumerate() {
        let line = line.map_err(|e| corrupt(format!("reading line {}: {e}", lineno + 1)))?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        row.clear();
        let parsed: std::result::Result<Vec<u8>, _> =
            line.split(',').map(|f| f.trim().parse::<u8>()).collect();
        match parsed {
            Ok(v) => row.extend(v),
            Err(_) if lineno == 0 => {
                println!("skipping header row: {}...", &line[..line.len().min(40)]);
                continue;
            }
            Err(e) => {
                return Err(corrupt(format!(
                    "line {}: a field is not an integer in 0-255 ({e})",
                    lineno + 1
                )));
            }
        }
        if row.len() != PIXELS + 1 {
            return Err(corrupt(format!(
                "line {}: {} fields, expected 784 pixels + 1 label",
                lineno + 1,
                row.len()
            )));
        }
        let label = row[PIXELS];
        if label > 9 {
            return Err(corrupt(format!("line {}: label {label}", lineno + 1)));
        }
        let split = if seen[label as usize] < per_digit {
            &mut train
        } else {
            &mut test
        };
        seen[label as usize] += 1;
        split.images.extend_from_slice(&row[..PIXELS]);
        split.labels.push(label);
    }

    let mut train_counts = [0usize; 10];
    train
        .labels
        .iter()
        .for_each(|&l| train_counts[l as usize] += 1);
    let mut test_counts = [0usize; 10];
    test.labels
        .iter()
        .for_each(|&l| test_counts[l as usize] += 1);
    println!(
        "train per digit: {train_counts:?} ({} total)",
        train.labels.len()
    );
    println!(
        "test  per digit: {test_counts:?} ({} total)",
        test.labels.len()
    );
    if let Some(d) = (0..10).find(|&d| train_counts[d] != per_digit || test_counts[d] == 0) {
        return Err(corrupt(format!(
            "digit {d} has {} rows: not enough for {per_digit} training digits plus a test set",
            seen[d]
        )));
    }

    std::fs::create_dir_all(&out).map_err(io_err(&out))?;
    train.write(&out, TRAIN_IMAGES, TRAIN_LABELS)?;
    test.write(&out, TEST_IMAGES, TEST_LABELS)?;

    // Read back through the loader users will use.
    let m = Mnist::load(&out)?;
    use kiln_data::Dataset;
    println!(
        "wrote {} (train {}, test {}), verified by reading it back",
        out.display(),
        m.train.len(),
        m.test.len()
    );
    Ok(())
}
