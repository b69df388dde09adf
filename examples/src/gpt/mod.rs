//! The character-level GPT of `examples/gpt` (nanoGPT's `shakespeare_char`), as a library so
//! that the example and its integration test (`examples/tests/gpt.rs`) train the same code.
//!
//! [`data`] tokenizes the corpus and draws batches, [`model`] is the transformer, [`train`](mod@train) the
//! loop (AdamW in two weight-decay groups, clipping, warmup + cosine, evaluation) and
//! sampling. Everything is generic over the backend and uses only kiln's existing layers and
//! ops: the example is a check that they compose into a model people train.

pub mod data;
pub mod model;
pub mod train;

pub use data::{CharData, Split, bundled_corpus};
pub use model::{Gpt, GptConfig};
pub use train::{EvalPoint, TrainConfig, estimate_loss, generate, train};
