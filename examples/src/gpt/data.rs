//! The character-level corpus: nanoGPT's `shakespeare_char` preparation, done at load time.
//!
//! The vocabulary is the corpus's distinct characters, sorted (so a token id means the same
//! symbol in kiln and in the PyTorch twin, `bench/gpt_torch.py`); the first 90% of the tokens
//! train and the last 10% validate. Batches are nanoGPT's `get_batch`: `batch` windows of
//! `block + 1` tokens at random offsets, the input the first `block` and the target the last
//! `block`. Offsets are drawn on the host from a seeded [`Generator`] (f64 uniforms on kiln's
//! CPU backend, the same Philox numbers whatever device trains), so a seed fixes the batches.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use kiln_backend_cpu::Cpu;
use kiln_core::{Backend, DType, Error, Generator, RandDist, Result, Tensor};

/// Which part of the corpus a batch comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// A tokenized corpus and its vocabulary.
#[derive(Clone, Debug)]
pub struct CharData {
    /// The distinct characters, sorted; a token is an index into this.
    pub vocab: Vec<char>,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

/// The bundled corpus, `data/shakespeare.txt.gz` in the repository (a path fixed at build time:
/// pass `--data` to a binary run elsewhere).
pub fn bundled_corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/shakespeare.txt.gz")
}

/// Reads a text file, gunzipping it when its name ends in `.gz`.
pub fn read_text(path: &Path) -> Result<String> {
    let io = |source: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut text = String::new();
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .map_err(io)?;
    } else {
        std::io::BufReader::new(file)
            .read_to_string(&mut text)
            .map_err(io)?;
    }
    Ok(text)
}

impl CharData {
    /// Tokenizes `text`: vocabulary of its sorted distinct characters, first 90% train.
    pub fn from_text(text: &str) -> Result<Self> {
        let vocab: Vec<char> = text.chars().collect::<BTreeSet<_>>().into_iter().collect();
        let tokens: Vec<u32> = text
            .chars()
            .map(|c| vocab.binary_search(&c).map(|i| i as u32))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| Error::invalid("CharData", "a character outside the vocabulary"))?;
        if tokens.len() < 20 {
            return Err(Error::invalid(
                "CharData",
                format!("the corpus has {} characters, too few", tokens.len()),
            ));
        }
        let n = tokens.len() * 9 / 10;
        Ok(CharData {
            vocab,
            val: tokens[n..].to_vec(),
            train: tokens[..n].to_vec(),
        })
    }

    /// Reads and tokenizes a corpus file (`.gz` or plain UTF-8 text).
    pub fn load(path: &Path) -> Result<Self> {
        Self::from_text(&read_text(path)?)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The token of `c`, if it is in the vocabulary.
    pub fn encode_char(&self, c: char) -> Option<u32> {
        self.vocab.binary_search(&c).ok().map(|i| i as u32)
    }

    /// The text of `tokens` (ids outside the vocabulary read as `?`).
    pub fn decode(&self, tokens: &[i64]) -> String {
        tokens
            .iter()
            .map(|&t| {
                usize::try_from(t)
                    .ok()
                    .and_then(|i| self.vocab.get(i))
                    .copied()
                    .unwrap_or('?')
            })
            .collect()
    }

    fn split(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// The longest context both splits can serve (a window is `block + 1` tokens).
    pub fn max_block(&self) -> usize {
        self.train.len().min(self.val.len()).saturating_sub(1)
    }

    /// `batch` windows at random offsets of `split`: inputs and targets, both `i64 [batch,
    /// block]` on `dev`. Errors when `block` exceeds [`CharData::max_block`].
    pub fn batch<B: Backend>(
        &self,
        split: Split,
        batch: usize,
        block: usize,
        generator: &mut Generator,
        dev: &B::Device,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let data = self.split(split);
        if block == 0 || batch == 0 || block > self.max_block() {
            return Err(Error::invalid(
                "CharData::batch",
                format!(
                    "batch {batch} x block {block}: both must be positive and block at most {}",
                    self.max_block()
                ),
            ));
        }
        let span = data.len() - block; // offsets 0..span, as torch.randint(len(data) - block)
        let u = generator
            .sample::<Cpu>(
                [batch],
                RandDist::Uniform {
                    low: 0.0,
                    high: 1.0,
                },
                DType::F64,
                &Cpu::device(0),
            )?
            .to_vec::<f64>()?;
        let (mut x, mut y) = (
            Vec::with_capacity(batch * block),
            Vec::with_capacity(batch * block),
        );
        for u in u {
            let i = ((u * span as f64) as usize).min(span - 1);
            x.extend(data[i..i + block].iter().map(|&t| t as i64));
            y.extend(data[i + 1..i + 1 + block].iter().map(|&t| t as i64));
        }
        Ok((
            Tensor::from_vec(x, [batch, block], dev)?,
            Tensor::from_vec(y, [batch, block], dev)?,
        ))
    }
}
