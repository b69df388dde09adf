//! The conformance suite: every op of the [`Backend`] trait, on random shapes, views and values,
//! compared with the f64 [`Reference`] backend (feature `testing`).
//!
//! A backend's tests run the whole suite with one line: kiln-backend-cpu's
//! `tests/conformance.rs` is a `#[test]` calling `run_conformance::<Cpu>(&Cpu::device(0))`.
//! Here with the reference backend as its own subject, one group at a time and few cases:
//!
//! ```
//! use kiln_core::reference::{RefDevice, Reference};
//! use kiln_core::testing::{self, Config};
//!
//! testing::check_fill::<Reference>(&RefDevice(0), &Config::with_cases(4));
//! testing::run_groups_named::<Reference>(&RefDevice(0), &Config::with_cases(4), &["cast"]);
//! ```
//!
//! and, on a machine that has both, [`compare_backends`] runs the same checks with one real
//! backend as the oracle of another (CUDA against the CPU). While debugging one op, call its
//! check alone, e.g. [`check_unary`]; [`Config`] sets the number of cases and the seed.
//!
//! ## How the code is laid out
//!
//! This file holds the entry points, [`GROUPS`] and [`Config`]. What every check shares is
//! one file each: `harness` runs one strategy on both backends and compares the results
//! (failure messages included), `tolerance` says how results must agree, and `inputs` makes
//! the inputs (value domains, shapes, strided and broadcast views). The checks themselves are
//! one file per op family: `memory` (fills, copies, views, joins), `random`, `unary`,
//! `elementwise` (binary, scalar, comparison, `where_cond`, cast), `reduce` (with softmax and
//! cross-entropy), `matmul`, `index`, `errors` and `update` (fused optimizer steps); a new
//! op's check goes beside its family's. [`check_close`] and [`assert_close`] are the tolerance
//! comparisons that the other crates' tests share; [`expr`] holds the random expression
//! programs of the backends' evaluator tests.
//!
//! ## What is generated
//!
//! Shapes of rank 0 to 4 with empty, size-1 and odd dimensions; every input is built with
//! [`Tensor::from_host`] and then, at random, permuted (transposed), narrowed (offsets, gaps)
//! and broadcast (stride 0), so kernels see strided inputs as well as contiguous ones. Values
//! are drawn from each op's domain (positive for `log`/`sqrt`, away from zero for divisors,
//! in range for casts), with ties and, where the semantics are defined, NaN. About one case in
//! twenty uses a large shape (up to ~85k elements, rows longer than 1024, matrices up to 130),
//! so that blocked, vectorized and multi-threaded paths are checked as well as the small ones.
//! All ops run through the [`Tensor`] API, so validation is exercised too.
//!
//! ## How results are compared
//!
//! Integers and data movement (copies, views, index ops, casts) must match exactly (bitwise
//! for floats). Float math must agree within `atol + rtol·|want| + k·ε·mag`, where `rtol`/`atol`
//! are 1e-5/1e-6 for f32 and 1e-12/1e-13 for f64, `ε` is the dtype's machine epsilon, and
//! `k·ε·mag` is the classic error bound of a `k`-term accumulation whose terms have absolute
//! sum `mag` (reductions, matmul, softmax, scatter_add): any summation order passes, a dropped
//! or doubled term does not. NaN must match NaN. Uniform random numbers must be bit-identical
//! to [`crate::philox`] for f32 (f64: within 4 ulps); normals within a few ulps of their scale.
//! Between two real backends, tolerances double.
//!
//! ## Reproducing a failure
//!
//! Cases are deterministic: each check draws from a seed derived from [`Config::seed`] and its
//! name. Failures are shrunk by proptest and reported with the op, dtype, the inputs' shapes,
//! strides and offsets (values too when small) and the first mismatching element. Set
//! `KILN_CONFORMANCE_SEED=<n>` to explore other cases, `KILN_CONFORMANCE_CASES=<n>` to run
//! more of them (default 128 per check) and `KILN_CONFORMANCE_VERBOSE=1` to print each check's
//! time.

use std::fmt::Debug;

use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config as PtConfig, RngSeed, TestCaseError, TestError, TestRunner};

use crate::backend::UpdateRule;
use crate::fasthash::fnv1a_64;
use crate::reference::{RefDevice, Reference};
use crate::{
    Backend, BinaryOp, CmpOp, CompositeOp, DType, Error, Generator, HostBuffer, Layout, RandDist,
    ReduceOp, Reduction, Result, Tensor, UnaryOp,
};

const DEFAULT_SEED: u64 = 0x6b69_6c6e_2d63_6f6e; // "kiln-con"

/// Settings of a conformance run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Random cases per check (one check per op, dtype pair or variant). Default 128, or
    /// `KILN_CONFORMANCE_CASES`.
    pub cases: u32,
    /// The seed every check derives its cases from. Default fixed, or `KILN_CONFORMANCE_SEED`.
    pub seed: u64,
    /// Upper bound on proptest's shrinking steps after a failure.
    pub max_shrink_iters: u32,
    /// Print each check's case count and time to stderr. Default: `KILN_CONFORMANCE_VERBOSE`
    /// is set.
    pub verbose: bool,
}

impl Default for Config {
    fn default() -> Self {
        fn env<T: std::str::FromStr>(k: &str) -> Option<T> {
            std::env::var(k).ok().and_then(|v| v.trim().parse().ok())
        }
        Config {
            cases: env("KILN_CONFORMANCE_CASES").unwrap_or(128),
            seed: env("KILN_CONFORMANCE_SEED").unwrap_or(DEFAULT_SEED),
            max_shrink_iters: 1024,
            verbose: std::env::var_os("KILN_CONFORMANCE_VERBOSE").is_some(),
        }
    }
}

impl Config {
    /// The default configuration with `cases` cases per check.
    pub fn with_cases(cases: u32) -> Self {
        Config {
            cases,
            ..Config::default()
        }
    }
}

// ---- entry points --------------------------------------------------------------------------

/// Runs every check on `device` against the reference backend, with [`Config::default`].
/// Panics with every failure found, and prints one summary line.
pub fn run_conformance<B: Backend>(device: &B::Device) {
    run_conformance_with::<B>(device, &Config::default())
}

/// [`run_conformance`] with explicit settings.
pub fn run_conformance_with<B: Backend>(device: &B::Device, cfg: &Config) {
    let p = Pair::<B, Reference>::new(device.clone(), RefDevice(0), cfg, 1.0);
    run_groups(&p, &format!("conformance[{}]", B::NAME), None);
}

/// [`run_conformance`] and [`compare_backends`] with the op groups spread over `threads` threads
/// (one [`Pair`] each): a backend that compiles each new program the first time it runs (the
/// CUDA backend, through NVRTC, with empty caches) then compiles in parallel, and the suite
/// takes a fraction of its one-thread time on a many-core host. `oracle`: `None` checks against
/// the reference backend, `Some(d)` against backend `O` on `d`. Panics with every group's
/// failures once all threads are done.
pub fn run_parallel<B: Backend, O: Backend>(
    device: &B::Device,
    oracle: Option<&O::Device>,
    threads: usize,
) {
    // The groups whose ops take longest, in shares first (heaviest first), then the others:
    // each thread takes every `threads`-th item.
    let mut items: Vec<(&str, Shard)> = Vec::new();
    for &(name, shares) in SHARED {
        items.extend((0..shares).map(|k| (name, Shard { k, n: shares })));
    }
    let whole = GROUPS
        .iter()
        .filter(|g| !SHARED.iter().any(|(n, _)| n == *g));
    items.extend(whole.map(|&g| (g, Shard::ALL)));
    let threads = threads.clamp(1, items.len());
    let chunks: Vec<Vec<(&str, Shard)>> = (0..threads)
        .map(|t| items.iter().copied().skip(t).step_by(threads).collect())
        .collect();
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|items| {
                s.spawn(move || match oracle {
                    None => {
                        let cfg = Config::default();
                        let p = Pair::<B, Reference>::new(device.clone(), RefDevice(0), &cfg, 1.0);
                        run_items(&p, &format!("conformance[{}]", B::NAME), items);
                    }
                    Some(od) => {
                        let p =
                            Pair::<B, O>::new(device.clone(), od.clone(), &Config::default(), 2.0);
                        let label =
                            format!("compare[{} ({device}) vs {} ({od})]", B::NAME, O::NAME);
                        run_items(&p, &label, items);
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().err())
            .map(|e| {
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|m| m.to_string()))
                    .unwrap_or_else(|| "a group panicked".into())
            })
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Runs every check with backend `A` on `da` as the subject and backend `B` on `db` as the
/// oracle, on the same random inputs (CUDA against the CPU). Tolerances are twice those against
/// the reference, since both sides round.
pub fn compare_backends<A: Backend, B: Backend>(da: &A::Device, db: &B::Device) {
    compare_backends_with::<A, B>(da, db, &Config::default())
}

/// [`compare_backends`] with explicit settings.
pub fn compare_backends_with<A: Backend, B: Backend>(da: &A::Device, db: &B::Device, cfg: &Config) {
    let p = Pair::<A, B>::new(da.clone(), db.clone(), cfg, 2.0);
    run_groups(
        &p,
        &format!("compare[{} ({da}) vs {} ({db})]", A::NAME, B::NAME),
        None,
    );
}

/// The names of the op groups, in the order the suite runs them.
pub const GROUPS: &[&str] = &[
    "devices",
    "fill",
    "host_roundtrip",
    "copy",
    "contiguous",
    "copy_into",
    "rand",
    "unary",
    "unary_backward",
    "composite",
    "binary",
    "binary_scalar",
    "compare",
    "where_cond",
    "reduce",
    "matmul",
    "softmax",
    "cross_entropy",
    "cast",
    "index_select",
    "gather",
    "scatter_add",
    "index_errors",
    "cat_stack",
    "fused_update",
];

/// Runs only the named groups (see [`GROUPS`]) against the reference; panics on an unknown name.
pub fn run_groups_named<B: Backend>(device: &B::Device, cfg: &Config, names: &[&str]) {
    for n in names {
        assert!(
            GROUPS.contains(n),
            "unknown conformance group {n:?}; see GROUPS"
        );
    }
    let p = Pair::<B, Reference>::new(device.clone(), RefDevice(0), cfg, 1.0);
    run_groups(&p, &format!("conformance[{}]", B::NAME), Some(names));
}

/// A share of a group's checks: the ops (or source dtypes) whose index is `k` modulo `n`.
/// [`run_parallel`] runs the slowest groups ([`SHARED`]) in shares on several threads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shard {
    k: usize,
    n: usize,
}

impl Shard {
    /// The whole group.
    pub(crate) const ALL: Shard = Shard { k: 0, n: 1 };

    /// This share's items of `all`.
    pub(crate) fn of<T: Copy, const N: usize>(self, all: [T; N]) -> impl Iterator<Item = T> {
        (all.into_iter().enumerate()).filter_map(move |(i, t)| (i % self.n == self.k).then_some(t))
    }
}

/// The groups [`run_parallel`] splits, and into how many shares: the slowest with a backend
/// that compiles each op's program on first use (CUDA with empty caches, 2026-11-28 on an
/// H100 host: `unary_backward` 77 s, `unary` 43 s, `binary` 27 s, `compare` 27 s,
/// `binary_scalar` 25 s, `cast` 17 s on one thread each).
const SHARED: &[(&str, usize)] = &[
    ("unary_backward", 8),
    ("unary", 4),
    ("binary", 3),
    ("compare", 3),
    ("binary_scalar", 3),
    ("cast", 2),
];

/// A group's checks: all of them, or those of a [`Shard`].
enum GroupFn<X: Backend, Y: Backend> {
    Whole(fn(&Pair<X, Y>, &mut Outcome)),
    Shared(fn(&Pair<X, Y>, &mut Outcome, Shard)),
}

/// Runs `shard` of group `name` (the whole group for [`Shard::ALL`]).
fn run_group<X: Backend, Y: Backend>(name: &str, p: &Pair<X, Y>, out: &mut Outcome, shard: Shard) {
    let fns = group_fns::<X, Y>();
    let (_, f) = (fns.iter())
        .find(|(n, _)| *n == name)
        .expect("a group of GROUPS");
    match f {
        GroupFn::Shared(f) => f(p, out, shard),
        GroupFn::Whole(f) => {
            assert_eq!(shard.n, 1, "group {name} has no shares");
            f(p, out)
        }
    }
}

fn group_fns<X: Backend, Y: Backend>() -> Vec<(&'static str, GroupFn<X, Y>)> {
    vec![
        ("devices", GroupFn::Whole(g_devices::<X, Y>)),
        ("fill", GroupFn::Whole(g_fill::<X, Y>)),
        ("host_roundtrip", GroupFn::Whole(g_host::<X, Y>)),
        ("copy", GroupFn::Whole(g_copy::<X, Y>)),
        ("contiguous", GroupFn::Whole(g_contiguous::<X, Y>)),
        ("copy_into", GroupFn::Whole(g_copy_into::<X, Y>)),
        ("rand", GroupFn::Whole(g_rand::<X, Y>)),
        ("unary", GroupFn::Shared(g_unary::<X, Y>)),
        ("unary_backward", GroupFn::Shared(g_unary_backward::<X, Y>)),
        ("composite", GroupFn::Whole(g_composite::<X, Y>)),
        ("binary", GroupFn::Shared(g_binary::<X, Y>)),
        ("binary_scalar", GroupFn::Shared(g_binary_scalar::<X, Y>)),
        ("compare", GroupFn::Shared(g_compare::<X, Y>)),
        ("where_cond", GroupFn::Whole(g_where::<X, Y>)),
        ("reduce", GroupFn::Whole(g_reduce::<X, Y>)),
        ("matmul", GroupFn::Whole(g_matmul::<X, Y>)),
        ("softmax", GroupFn::Whole(g_softmax::<X, Y>)),
        ("cross_entropy", GroupFn::Whole(g_xent::<X, Y>)),
        ("cast", GroupFn::Shared(g_cast::<X, Y>)),
        ("index_select", GroupFn::Whole(g_index_select::<X, Y>)),
        ("gather", GroupFn::Whole(g_gather::<X, Y>)),
        ("scatter_add", GroupFn::Whole(g_scatter_add::<X, Y>)),
        ("index_errors", GroupFn::Whole(g_index_errors::<X, Y>)),
        ("cat_stack", GroupFn::Whole(g_cat_stack::<X, Y>)),
        ("fused_update", GroupFn::Whole(g_fused_update::<X, Y>)),
    ]
}

/// Whether `KILN_TEST_TIMES=1`: the suites print each group's seconds (where a slow suite's
/// time goes; `--nocapture` shows them).
fn times_wanted() -> bool {
    std::env::var("KILN_TEST_TIMES").is_ok_and(|v| v == "1")
}

fn run_groups<X: Backend, Y: Backend>(p: &Pair<X, Y>, label: &str, only: Option<&[&str]>) {
    let items: Vec<(&str, Shard)> = (GROUPS.iter())
        .filter(|g| only.is_none_or(|o| o.contains(g)))
        .map(|&g| (g, Shard::ALL))
        .collect();
    run_items(p, label, &items);
}

/// Runs each (group, share) of `items`; prints one summary line, or panics with every failure.
fn run_items<X: Backend, Y: Backend>(p: &Pair<X, Y>, label: &str, items: &[(&str, Shard)]) {
    let mut out = Outcome::default();
    for &(name, shard) in items {
        let t0 = std::time::Instant::now();
        run_group(name, p, &mut out, shard);
        if times_wanted() {
            let part = match shard.n {
                1 => String::new(),
                n => format!(" ({} of {n})", shard.k + 1),
            };
            eprintln!(
                "{label}: group {name}{part} {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        }
    }
    let groups = items.len();
    let head = format!(
        "{label}: {groups} op groups or shares ({} checks), {} cases each",
        out.checks, p.cfg.cases
    );
    if out.failures.is_empty() {
        println!("{head}: all passed");
    } else {
        let msg = format!(
            "{head}: {} FAILED (seed {:#x})\n\n{}",
            out.failures.len(),
            p.cfg.seed,
            out.failures.join("\n\n")
        );
        panic!("{msg}");
    }
}

macro_rules! check_fns {
    ($($(#[$doc:meta])* $pub_name:ident => $name:literal;)*) => {$(
        $(#[$doc])*
        ///
        /// Runs this one group of the suite against the reference backend; panics on failure.
        pub fn $pub_name<B: Backend>(device: &B::Device, cfg: &Config) {
            let p = Pair::<B, Reference>::new(device.clone(), RefDevice(0), cfg, 1.0);
            let mut out = Outcome::default();
            run_group::<B, Reference>($name, &p, &mut out, Shard::ALL);
            if !out.failures.is_empty() {
                panic!(
                    "conformance[{}] {}: {} of {} checks FAILED (seed {:#x})\n\n{}",
                    B::NAME,
                    $name,
                    out.failures.len(),
                    out.checks,
                    cfg.seed,
                    out.failures.join("\n\n")
                );
            }
        }
    )*};
}

check_fns! {
    /// `devices`, `parse_device`, `synchronize`, `memory_stats`, `empty_cache`, `storage_device`.
    check_devices => "devices";
    /// `fill` (`Tensor::full`) for every dtype, including NaN/inf/-0 for floats.
    check_fill => "fill";
    /// `from_host` then `to_host` of strided views: bit-exact for every dtype.
    check_host_roundtrip => "host_roundtrip";
    /// `copy_to` (always a new buffer), `to_device` (same storage when already there), copies
    /// to the backend's other devices.
    check_copy => "copy";
    /// `contiguous` and copying reshapes of strided views.
    check_contiguous => "contiguous";
    /// `copy_into` into strided destinations (direct) and through `slice_assign`.
    check_copy_into => "copy_into";
    /// Philox `rand`: uniform and normal, f32 and f64.
    check_rand => "rand";
    /// Every `UnaryOp` on every dtype it supports.
    check_unary => "unary";
    /// `unary_backward` for every op it covers, with strided and broadcast gradients.
    check_unary_backward => "unary_backward";
    /// Every `CompositeOp` (ops with scalar parameters) on f32 and f64.
    check_composite => "composite";
    /// Every `BinaryOp` on every dtype it supports, with broadcasting.
    check_binary => "binary";
    /// Every `BinaryOp` with a scalar on either side.
    check_binary_scalar => "binary_scalar";
    /// Every `CmpOp` on every dtype, with broadcasting and NaN.
    check_compare => "compare";
    /// `where_cond` with three-way broadcasting.
    check_where => "where_cond";
    /// Every `ReduceOp` over random axis subsets, with and without keepdim.
    check_reduce => "reduce";
    /// Batched matmul: broadcast batches, transposed operands, 1-d operands, k = 0.
    check_matmul => "matmul";
    /// `softmax` and `log_softmax` on the last axis.
    check_softmax => "softmax";
    /// `cross_entropy` and `cross_entropy_backward`.
    check_cross_entropy => "cross_entropy";
    /// `cast` between every pair of dtypes.
    check_cast => "cast";
    /// `index_select`.
    check_index_select => "index_select";
    /// `gather`.
    check_gather => "gather";
    /// `scatter_add`.
    check_scatter_add => "scatter_add";
    /// Out-of-range indices and labels give `Error::IndexOutOfRange` naming the op and index.
    check_index_errors => "index_errors";
    /// `cat` and `stack` (built on `fill` + `copy_into`).
    check_cat_stack => "cat_stack";
    /// `fused_update` (SGD with momentum/Nesterov/weight decay, Adam, AdamW) over several
    /// parameters at once.
    check_fused_update => "fused_update";
}

// ---- the harness and the inputs, then the groups, one file per op family -------------------
// (the harness first: the group files use its `both!` macro)

#[macro_use]
mod harness;
mod inputs;
mod tolerance;

mod close;
mod elementwise;
mod errors;
pub mod expr;
mod index;
mod matmul;
mod memory;
mod random;
mod reduce;
mod unary;
mod unscale;
mod update;

use harness::{Check, Outcome, Pair, describe};
use inputs::*;
use tolerance::{Tol, compare_values, eps};

pub use close::{assert_close, check_close};
use elementwise::{g_binary, g_binary_scalar, g_cast, g_compare, g_where};
use errors::g_index_errors;
use index::{g_gather, g_index_select, g_scatter_add};
use matmul::g_matmul;
use memory::{g_cat_stack, g_contiguous, g_copy, g_copy_into, g_devices, g_fill, g_host};
use random::g_rand;
use reduce::{g_reduce, g_softmax, g_xent};
use unary::{g_composite, g_unary, g_unary_backward};
pub use unscale::{
    check_sq_sum, check_sq_sum_errors, check_unscale_check, check_unscale_check_errors,
};
use update::g_fused_update;
