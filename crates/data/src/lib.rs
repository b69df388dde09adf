//! # kiln-data
//!
//! Datasets, the IDX/MNIST reader and a prefetching DataLoader. Not built yet; see the
//! nn/optim/data issue.
