//! The generic gradient test suite (feature `testing`).
//!
//! Every differentiable op of `Var<B>` is checked with [`check_backward`] on proptest-chosen
//! shapes (0-d through rank 4, broadcasting pairs, batched matmuls), with each input built
//! contiguous, transposed (a column-major view) or narrowed (a strided view with an offset), so
//! both the contiguous fast paths and the strided paths of forward and backward are exercised.
//! The suite is generic over the backend, so a backend's tests run it with one line, a
//! `#[test]` calling `run_gradient_suite::<Cpu>(&Cpu::device(0))`; while debugging, a few ops
//! with few cases:
//!
//! ```
//! use kiln_autograd::testing::{self, SuiteConfig};
//! use kiln_backend_cpu::Cpu;
//!
//! let cfg = SuiteConfig { cases: 4, filter: Some("exp".into()), ..SuiteConfig::default() };
//! testing::run_gradient_suite_with::<Cpu>(&Cpu::device(0), &cfg);
//! ```
//!
//! Proptest runs with a fixed seed, so every backend (and every CI run) checks the same cases; a
//! failure reports the op, the shrunk case and both derivatives. Values are drawn away from the
//! kinks of non-smooth ops (relu, abs, floor, max, ...) by more than the finite-difference step,
//! so a central difference is meaningful there; ties are tested exactly in the crate's own
//! tests.
//!
//! This file holds the entry points, the case list and the runner (`prop`, `check`); `inputs`
//! builds the inputs (layouts, value domains, shapes) and the cases are one file per op family:
//! `elementwise`, `reduce` (with softmax and the losses), `matmul`, `views` (with joins),
//! `index`, `norm` (normalizations and the embedding), `pool` (average pooling), `attention` and `devices` (copies between devices, compositions of several ops).

use std::fmt::Debug;

use kiln_core::philox;
use kiln_core::{Backend, BinaryOp, CompositeOp, DType, Reduction, Result, Tensor, UnaryOp, Vjp};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use crate::{CheckOptions, Var, check_backward};

/// How the suite runs.
#[derive(Clone, Debug)]
pub struct SuiteConfig {
    /// Proptest cases per op.
    pub cases: u32,
    /// Tolerances and the dtype of the check (f64 by default).
    pub check: CheckOptions,
    /// Only ops whose name contains this string (all when `None`).
    pub filter: Option<String>,
    /// Threads the ops are spread over (1: one after another). A backend that compiles each
    /// new program on first use (CUDA, with empty caches) then compiles on several cores.
    pub threads: usize,
}

impl Default for SuiteConfig {
    fn default() -> Self {
        SuiteConfig {
            cases: 24,
            check: CheckOptions::default(),
            filter: None,
            threads: 1,
        }
    }
}

/// Runs every gradient check on `device` and panics listing every op that failed.
pub fn run_gradient_suite<B: Backend>(device: &B::Device) {
    run_gradient_suite_with::<B>(device, &SuiteConfig::default())
}

/// [`run_gradient_suite`] with explicit settings.
pub fn run_gradient_suite_with<B: Backend>(device: &B::Device, cfg: &SuiteConfig) {
    let threads = cfg.threads.max(1);
    // Thread `t` runs the cases whose index is `t` modulo `threads` (each thread builds its own
    // case list: the cases' closures are not `Send`).
    let part = |t: usize| {
        let (mut ran, mut failures) = (0, Vec::new());
        for (i, (name, case)) in cases::<B>().into_iter().enumerate() {
            let wanted = cfg
                .filter
                .as_ref()
                .is_none_or(|f| name.contains(f.as_str()));
            if i % threads != t || !wanted {
                continue;
            }
            ran += 1;
            if let Err(msg) = case(device, cfg) {
                failures.push(format!("{name}: {msg}"));
            }
        }
        (ran, failures)
    };
    let parts: Vec<(usize, Vec<String>)> = if threads == 1 {
        vec![part(0)]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads).map(|t| s.spawn(move || part(t))).collect();
            (handles.into_iter())
                .map(|h| h.join().expect("a gradient check thread panicked"))
                .collect()
        })
    };
    let ran: usize = parts.iter().map(|(r, _)| r).sum();
    let failures: Vec<String> = parts.into_iter().flat_map(|(_, f)| f).collect();
    assert!(
        failures.is_empty(),
        "gradient suite on {} ({device}): {} of {ran} ops failed:\n{}",
        B::NAME,
        failures.len(),
        failures.join("\n\n")
    );
    eprintln!(
        "gradient suite on {} ({device}): {ran} ops passed, {} cases each",
        B::NAME,
        cfg.cases
    );
}

/// Cross-device checks between two devices of one backend (`cpu` and `cpu:1`, or two GPUs):
/// gradients flow back through `copy_to`/`to_device` in both directions and arrive on the
/// source device, `to_device` to the same device records nothing, and an op mixing the two
/// devices is an error naming the op and both devices. Panics on failure.
pub fn run_copy_suite<B: Backend>(a: &B::Device, b: &B::Device) {
    if let Err(e) = copy_suite::<B>(a, b) {
        panic!("copy suite on {} ({a} <-> {b}): {e}", B::NAME);
    }
    eprintln!("copy suite on {} ({a} <-> {b}): passed", B::NAME);
}

type Case<B> =
    Box<dyn Fn(&<B as Backend>::Device, &SuiteConfig) -> std::result::Result<(), String>>;

/// Runs `test` on `cases` values of `strategy` with a fixed seed.
fn prop<S, F>(cfg: &SuiteConfig, strategy: S, test: F) -> std::result::Result<(), String>
where
    S: Strategy,
    S::Value: Debug,
    F: Fn(S::Value) -> Result<()>,
{
    let config = Config {
        cases: cfg.cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    runner
        .run(&strategy, |v| {
            test(v).map_err(|e| TestCaseError::fail(e.to_string()))
        })
        .map_err(|e| e.to_string())
}

fn check<B: Backend>(
    cfg: &SuiteConfig,
    inputs: &[Tensor<B>],
    f: impl Fn(&[Var<B>]) -> Result<Var<B>>,
) -> Result<()> {
    check_backward(f, inputs, &cfg.check)
}

/// The case list: (name, runner). Public so a backend can run one op while debugging.
pub fn case_names<B: Backend>() -> Vec<String> {
    cases::<B>().into_iter().map(|(n, _)| n).collect()
}

/// Every case: one function per op family, in this order.
fn cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c = unary_cases::<B>();
    c.extend(composite_cases::<B>());
    c.extend(binary_cases::<B>());
    c.extend(reduction_cases::<B>());
    c.extend(matmul_cases::<B>());
    c.extend(view_cases::<B>());
    c.extend(join_cases::<B>());
    c.extend(index_cases::<B>());
    c.extend(loss_cases::<B>());
    c.extend(norm_cases::<B>());
    c.extend(pool_cases::<B>());
    c.extend(attention_cases::<B>());
    c.extend(device_cases::<B>());
    c
}

mod attention;
mod devices;
mod elementwise;
mod index;
mod inputs;
mod matmul;
mod norm;
mod pool;
mod reduce;
mod views;

use attention::attention_cases;
use devices::{copy_suite, device_cases};
use elementwise::{binary_cases, composite_cases, unary_cases};
use index::index_cases;
pub use inputs::{In, Lay};
use inputs::{Vals, axes_of, bcast_pair, dims, host_values, ids, input_of, lay};
use matmul::matmul_cases;
use norm::norm_cases;
use pool::pool_cases;
use reduce::{loss_cases, reduction_cases};
use views::{join_cases, view_cases};
