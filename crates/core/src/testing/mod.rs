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
//! This file holds what every check shares: the entry points and [`GROUPS`], the harness that
//! runs one strategy on both backends and compares the results (tolerances, failure messages),
//! and the input generators (value domains, shapes, strided and broadcast views). The checks
//! themselves are one file per op family: `memory` (fills, copies, views, joins), `random`,
//! `unary`, `elementwise` (binary, scalar, comparison, `where_cond`, cast), `reduce` (with
//! softmax and cross-entropy), `matmul`, `index`, `errors` and `update` (fused optimizer
//! steps); a new op's check goes beside its family's. [`check_close`] and [`assert_close`]
//! are the tolerance comparisons that the other crates' tests share; [`expr`] holds the random
//! expression programs of the backends' evaluator tests.
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

type GroupFn<X, Y> = fn(&Pair<X, Y>, &mut Outcome);

fn group_fns<X: Backend, Y: Backend>() -> Vec<(&'static str, GroupFn<X, Y>)> {
    vec![
        ("devices", g_devices::<X, Y>),
        ("fill", g_fill::<X, Y>),
        ("host_roundtrip", g_host::<X, Y>),
        ("copy", g_copy::<X, Y>),
        ("contiguous", g_contiguous::<X, Y>),
        ("copy_into", g_copy_into::<X, Y>),
        ("rand", g_rand::<X, Y>),
        ("unary", g_unary::<X, Y>),
        ("unary_backward", g_unary_backward::<X, Y>),
        ("composite", g_composite::<X, Y>),
        ("binary", g_binary::<X, Y>),
        ("binary_scalar", g_binary_scalar::<X, Y>),
        ("compare", g_compare::<X, Y>),
        ("where_cond", g_where::<X, Y>),
        ("reduce", g_reduce::<X, Y>),
        ("matmul", g_matmul::<X, Y>),
        ("softmax", g_softmax::<X, Y>),
        ("cross_entropy", g_xent::<X, Y>),
        ("cast", g_cast::<X, Y>),
        ("index_select", g_index_select::<X, Y>),
        ("gather", g_gather::<X, Y>),
        ("scatter_add", g_scatter_add::<X, Y>),
        ("index_errors", g_index_errors::<X, Y>),
        ("cat_stack", g_cat_stack::<X, Y>),
        ("fused_update", g_fused_update::<X, Y>),
    ]
}

fn run_groups<X: Backend, Y: Backend>(p: &Pair<X, Y>, label: &str, only: Option<&[&str]>) {
    let mut out = Outcome::default();
    let mut groups = 0;
    for (name, f) in group_fns::<X, Y>() {
        if only.is_some_and(|o| !o.contains(&name)) {
            continue;
        }
        groups += 1;
        f(p, &mut out);
    }
    let head = format!(
        "{label}: {groups} op groups ({} checks), {} cases each",
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
    ($($(#[$doc:meta])* $pub_name:ident => $group:ident, $name:literal;)*) => {$(
        $(#[$doc])*
        ///
        /// Runs this one group of the suite against the reference backend; panics on failure.
        pub fn $pub_name<B: Backend>(device: &B::Device, cfg: &Config) {
            let p = Pair::<B, Reference>::new(device.clone(), RefDevice(0), cfg, 1.0);
            let mut out = Outcome::default();
            $group::<B, Reference>(&p, &mut out);
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
    check_devices => g_devices, "devices";
    /// `fill` (`Tensor::full`) for every dtype, including NaN/inf/-0 for floats.
    check_fill => g_fill, "fill";
    /// `from_host` then `to_host` of strided views: bit-exact for every dtype.
    check_host_roundtrip => g_host, "host_roundtrip";
    /// `copy_to` (always a new buffer), `to_device` (same storage when already there), copies
    /// to the backend's other devices.
    check_copy => g_copy, "copy";
    /// `contiguous` and copying reshapes of strided views.
    check_contiguous => g_contiguous, "contiguous";
    /// `copy_into` into strided destinations (direct) and through `slice_assign`.
    check_copy_into => g_copy_into, "copy_into";
    /// Philox `rand`: uniform and normal, f32 and f64.
    check_rand => g_rand, "rand";
    /// Every `UnaryOp` on every dtype it supports.
    check_unary => g_unary, "unary";
    /// `unary_backward` for every op it covers, with strided and broadcast gradients.
    check_unary_backward => g_unary_backward, "unary_backward";
    /// Every `CompositeOp` (ops with scalar parameters) on f32 and f64.
    check_composite => g_composite, "composite";
    /// Every `BinaryOp` on every dtype it supports, with broadcasting.
    check_binary => g_binary, "binary";
    /// Every `BinaryOp` with a scalar on either side.
    check_binary_scalar => g_binary_scalar, "binary_scalar";
    /// Every `CmpOp` on every dtype, with broadcasting and NaN.
    check_compare => g_compare, "compare";
    /// `where_cond` with three-way broadcasting.
    check_where => g_where, "where_cond";
    /// Every `ReduceOp` over random axis subsets, with and without keepdim.
    check_reduce => g_reduce, "reduce";
    /// Batched matmul: broadcast batches, transposed operands, 1-d operands, k = 0.
    check_matmul => g_matmul, "matmul";
    /// `softmax` and `log_softmax` on the last axis.
    check_softmax => g_softmax, "softmax";
    /// `cross_entropy` and `cross_entropy_backward`.
    check_cross_entropy => g_xent, "cross_entropy";
    /// `cast` between every pair of dtypes.
    check_cast => g_cast, "cast";
    /// `index_select`.
    check_index_select => g_index_select, "index_select";
    /// `gather`.
    check_gather => g_gather, "gather";
    /// `scatter_add`.
    check_scatter_add => g_scatter_add, "scatter_add";
    /// Out-of-range indices and labels give `Error::IndexOutOfRange` naming the op and index.
    check_index_errors => g_index_errors, "index_errors";
    /// `cat` and `stack` (built on `fill` + `copy_into`).
    check_cat_stack => g_cat_stack, "cat_stack";
    /// `fused_update` (SGD with momentum/Nesterov/weight decay, Adam, AdamW) over several
    /// parameters at once.
    check_fused_update => g_fused_update, "fused_update";
}

// ---- the harness ---------------------------------------------------------------------------

#[derive(Default)]
struct Outcome {
    checks: usize,
    failures: Vec<String>,
}

/// The subject backend `X` and the oracle `Y`, with their devices.
struct Pair<X: Backend, Y: Backend> {
    dx: X::Device,
    dy: Y::Device,
    cfg: Config,
    /// Tolerance multiplier: 1 against the reference, 2 between two real backends.
    slack: f64,
    /// Comparisons where both sides returned an error (reported in verbose mode: a check whose
    /// cases are mostly rejected tests little).
    both_failed: std::cell::Cell<usize>,
}

type Both<X, Y> = (Tensor<X>, Tensor<Y>);
type Check = std::result::Result<(), String>;

/// Runs `$body` once with each named input bound to the subject's tensor, once to the
/// oracle's, and returns both results.
macro_rules! both {
    ($($v:ident),* => $body:expr) => {{
        let x = { $(let $v = &$v.0;)* $body };
        let y = { $(let $v = &$v.1;)* $body };
        (x, y)
    }};
}

impl<X: Backend, Y: Backend> Pair<X, Y> {
    fn new(dx: X::Device, dy: Y::Device, cfg: &Config, slack: f64) -> Self {
        Pair {
            dx,
            dy,
            cfg: cfg.clone(),
            slack,
            both_failed: std::cell::Cell::new(0),
        }
    }

    fn build(&self, s: &Spec) -> std::result::Result<Both<X, Y>, String> {
        let x = s
            .build::<X>(&self.dx)
            .map_err(|e| format!("could not build input {s:?} on {}: {e}", X::NAME))?;
        let y = s
            .build::<Y>(&self.dy)
            .map_err(|e| format!("could not build input {s:?} on {}: {e}", Y::NAME))?;
        Ok((x, y))
    }

    /// Elementwise tolerance for `dtype`.
    fn elem(&self, dtype: DType) -> Tol {
        self.accum(dtype, 0.0, None)
    }

    /// Tolerance for a `k`-term accumulation whose terms have absolute sums `mag`.
    fn accum(&self, dtype: DType, k: f64, mag: Option<Vec<f64>>) -> Tol {
        let (rtol, atol) = match dtype {
            DType::F64 => (1e-12, 1e-13),
            _ => (1e-5, 1e-6),
        };
        Tol::Close {
            rtol: rtol * self.slack,
            atol: atol * self.slack,
            k: k * self.slack,
            mag,
        }
    }

    fn run<S>(&self, out: &mut Outcome, check: &str, strat: S, test: impl Fn(S::Value) -> Check)
    where
        S: Strategy,
        S::Value: Debug,
    {
        let seed = self.cfg.seed ^ fnv1a_64(check.as_bytes());
        let cfg = PtConfig {
            cases: self.cfg.cases,
            failure_persistence: None,
            rng_seed: RngSeed::Fixed(seed),
            max_shrink_iters: self.cfg.max_shrink_iters,
            max_shrink_time: 20_000, // ms: large failing cases shrink slowly
            max_global_rejects: 100_000,
            ..PtConfig::default()
        };
        let mut runner = TestRunner::new(cfg);
        out.checks += 1;
        let started = std::time::Instant::now();
        self.both_failed.set(0);
        let count = std::sync::atomic::AtomicUsize::new(0);
        let res = runner.run(&strat, |v| {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            test(v).map_err(TestCaseError::fail)
        });
        if self.cfg.verbose {
            eprintln!(
                "  {check}: {} cases in {:.2?} ({} comparisons rejected by both sides)",
                count.into_inner(),
                started.elapsed(),
                self.both_failed.get()
            );
        }
        match res {
            Ok(()) => {}
            Err(TestError::Fail(reason, value)) => out
                .failures
                .push(format!("[{check}] {reason}\n  minimal case: {value:?}")),
            Err(TestError::Abort(reason)) => {
                out.failures.push(format!("[{check}] aborted: {reason}"))
            }
        }
    }

    /// Compares the subject's result with the oracle's: both errors, or equal shape, dtype and
    /// values (within `tol`), and the subject's result on the subject's device.
    fn expect(
        &self,
        what: &str,
        inputs: &[(&str, &Tensor<X>)],
        got: Result<Tensor<X>>,
        want: Result<Tensor<Y>>,
        tol: &Tol,
    ) -> Check {
        let fail = |problem: String| {
            let ins: Vec<String> = inputs.iter().map(|(n, t)| describe(n, t)).collect();
            Err(format!(
                "{what} on {} ({}): {problem}\n  inputs:\n    {}",
                X::NAME,
                self.dx,
                ins.join("\n    ")
            ))
        };
        let (g, w) = match (got, want) {
            (Err(_), Err(_)) => {
                self.both_failed.set(self.both_failed.get() + 1);
                return Ok(());
            }
            (Err(e), Ok(w)) => {
                return fail(format!(
                    "failed with \"{e}\" where {} returned shape {} {}",
                    Y::NAME,
                    w.shape(),
                    w.dtype()
                ));
            }
            (Ok(g), Err(e)) => {
                return fail(format!(
                    "returned shape {} {} where {} failed with \"{e}\"",
                    g.shape(),
                    g.dtype(),
                    Y::NAME
                ));
            }
            (Ok(g), Ok(w)) => (g, w),
        };
        if g.shape() != w.shape() || g.dtype() != w.dtype() {
            return fail(format!(
                "output is {} {}, expected {} {}",
                g.shape(),
                g.dtype(),
                w.shape(),
                w.dtype()
            ));
        }
        if g.device() != &self.dx {
            return fail(format!("output is on {}, expected {}", g.device(), self.dx));
        }
        let gh = match g.to_host() {
            Ok(h) => h,
            Err(e) => return fail(format!("to_host of the output failed: {e}")),
        };
        let wh = w
            .to_host()
            .map_err(|e| format!("{what}: oracle to_host failed: {e}"))?;
        if let Err(m) = compare_values(&gh, &wh, g.dims(), tol) {
            return fail(format!("output {} {}: {m}", g.shape(), g.dtype()));
        }
        Ok(())
    }
}

/// A tensor's dtype, shape, strides and offset (and values when few), for failure messages.
fn describe<B: Backend>(name: &str, t: &Tensor<B>) -> String {
    let l = t.layout();
    let mut s = format!(
        "{name}: {} shape {} strides {:?} offset {}",
        t.dtype(),
        l.shape(),
        l.strides(),
        l.offset()
    );
    if t.elem_count() <= 32
        && let Ok(h) = t.to_host()
    {
        s += &format!(" values {}", host_values(&h));
    }
    s
}

fn host_values(h: &HostBuffer) -> String {
    match h {
        HostBuffer::F32(v) => format!("{v:?}"),
        HostBuffer::F64(v) => format!("{v:?}"),
        HostBuffer::I64(v) => format!("{v:?}"),
        HostBuffer::U8(v) => format!("{v:?}"),
    }
}

/// How outputs must agree.
#[derive(Clone, Debug)]
enum Tol {
    /// Bit for bit (data movement).
    Bits,
    /// `|got - want| <= atol + rtol·|want| + k·ε·mag[i]`; NaN matches NaN; ints exact.
    Close {
        rtol: f64,
        atol: f64,
        k: f64,
        mag: Option<Vec<f64>>,
    },
}

fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON,
        _ => f32::EPSILON as f64,
    }
}

fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        if dims[i] > 0 {
            idx[i] = flat % dims[i];
            flat /= dims[i];
        }
    }
    idx
}

fn compare_values(got: &HostBuffer, want: &HostBuffer, dims: &[usize], tol: &Tol) -> Check {
    if got.dtype() != want.dtype() || got.len() != want.len() {
        return Err(format!(
            "host buffer is {} x {}, expected {} x {}",
            got.len(),
            got.dtype(),
            want.len(),
            want.dtype()
        ));
    }
    let at = |i: usize| format!("element {i} (index {:?})", unravel(i, dims));
    let first_diff = |n: usize, same: &dyn Fn(usize) -> bool| (0..n).find(|&i| !same(i));
    let bad = match (got, want) {
        (HostBuffer::I64(g), HostBuffer::I64(w)) => first_diff(g.len(), &|i| g[i] == w[i])
            .map(|i| format!("{}: got {}, want {}", at(i), g[i], w[i])),
        (HostBuffer::U8(g), HostBuffer::U8(w)) => first_diff(g.len(), &|i| g[i] == w[i])
            .map(|i| format!("{}: got {}, want {}", at(i), g[i], w[i])),
        (HostBuffer::F32(g), HostBuffer::F32(w)) if matches!(tol, Tol::Bits) => {
            first_diff(g.len(), &|i| g[i].to_bits() == w[i].to_bits()).map(|i| {
                format!(
                    "{}: got {:?} ({:#010x}), want {:?} ({:#010x}) bit for bit",
                    at(i),
                    g[i],
                    g[i].to_bits(),
                    w[i],
                    w[i].to_bits()
                )
            })
        }
        (HostBuffer::F64(g), HostBuffer::F64(w)) if matches!(tol, Tol::Bits) => {
            first_diff(g.len(), &|i| g[i].to_bits() == w[i].to_bits()).map(|i| {
                format!(
                    "{}: got {:?} ({:#018x}), want {:?} ({:#018x}) bit for bit",
                    at(i),
                    g[i],
                    g[i].to_bits(),
                    w[i],
                    w[i].to_bits()
                )
            })
        }
        _ => {
            let Tol::Close { rtol, atol, k, mag } = tol else {
                unreachable!("Bits handled above")
            };
            let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
            let e = eps(got.dtype());
            let t =
                |i: usize| atol + rtol * w[i].abs() + k * e * mag.as_ref().map_or(0.0, |m| m[i]);
            first_diff(g.len(), &|i| {
                let (g, w) = (g[i], w[i]);
                if w.is_nan() || g.is_nan() {
                    return w.is_nan() && g.is_nan();
                }
                if w.is_infinite() || g.is_infinite() {
                    return g == w;
                }
                (g - w).abs() <= t(i)
            })
            .map(|i| {
                format!(
                    "{}: got {:?}, want {:?} (|diff| {:.3e} > tolerance {:.3e})",
                    at(i),
                    g[i],
                    w[i],
                    (g[i] - w[i]).abs(),
                    t(i)
                )
            })
        }
    };
    match bad {
        None => Ok(()),
        Some(m) => Err(m),
    }
}

// ---- inputs --------------------------------------------------------------------------------

/// A value domain for generated inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Dom {
    lo: f64,
    hi: f64,
    /// Magnitudes below this are pushed out to it (divisors, `recip`).
    avoid: f64,
    /// Fraction of integer values (ties for arg reductions and comparisons, exact zeros).
    ties: f64,
    /// Fraction of NaN (floats only).
    nan: f64,
    /// Mix in NaN, ±inf, -0, subnormals, extremes (data-movement checks).
    specials: bool,
}

impl Dom {
    const fn range(lo: f64, hi: f64) -> Dom {
        Dom {
            lo,
            hi,
            avoid: 0.0,
            ties: 0.125,
            nan: 0.0,
            specials: false,
        }
    }
    const fn avoid(mut self, a: f64) -> Dom {
        self.avoid = a;
        self
    }
    const fn ties(mut self, t: f64) -> Dom {
        self.ties = t;
        self
    }
    const fn nan(mut self, p: f64) -> Dom {
        self.nan = p;
        self
    }
    const fn specials(mut self) -> Dom {
        self.specials = true;
        self
    }
    /// Any value for `dtype` (data movement).
    fn any(dtype: DType) -> Dom {
        match dtype {
            DType::U8 => Dom::range(0.0, 255.0).specials(),
            DType::I64 => Dom::range(-1e6, 1e6).specials(),
            _ => Dom::range(-100.0, 100.0).specials(),
        }
    }
}

/// splitmix64: values come from a seed so that proptest only shrinks shapes and views.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }
}

fn gen_values(dom: &Dom, dtype: DType, n: usize, seed: u64) -> HostBuffer {
    let mut r = Mix(seed);
    let real = |r: &mut Mix| {
        let x = if r.unit() < dom.ties {
            (dom.lo + (dom.hi - dom.lo) * r.unit())
                .round()
                .clamp(dom.lo, dom.hi)
        } else {
            dom.lo + (dom.hi - dom.lo) * r.unit()
        };
        if x.abs() < dom.avoid {
            if x < 0.0 { -dom.avoid } else { dom.avoid }
        } else {
            x
        }
    };
    match dtype {
        DType::F32 | DType::F64 => {
            const SPECIAL: [f64; 8] = [
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                -0.0,
                1e-40,    // subnormal in f32
                1e-310,   // subnormal in f64 (0 in f32)
                3.0e38,   // near f32::MAX
                -1.7e308, // near -f64::MAX (-inf in f32)
            ];
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    if dom.specials && r.unit() < 0.15 {
                        SPECIAL[(r.next() % 8) as usize]
                    } else if dom.nan > 0.0 && r.unit() < dom.nan {
                        f64::NAN
                    } else {
                        real(&mut r)
                    }
                })
                .collect();
            HostBuffer::from_f64(dtype, &v)
        }
        DType::I64 => HostBuffer::I64(
            (0..n)
                .map(|_| {
                    if dom.specials && r.unit() < 0.15 {
                        [i64::MIN, i64::MAX, -1, 0][(r.next() % 4) as usize]
                    } else {
                        real(&mut r).round() as i64
                    }
                })
                .collect(),
        ),
        _ => HostBuffer::U8((0..n).map(|_| real(&mut r).round() as u8).collect()),
    }
}

/// How an input tensor is laid out over its storage: stored with its axes permuted by `perm`,
/// each axis narrowed from `start[i]` out of `start[i] + dim + extra[i]` entries, and the axes
/// with `bcast[i]` stored with size 1 and broadcast (stride 0).
#[derive(Clone, Debug)]
struct View {
    perm: Vec<usize>,
    start: Vec<usize>,
    extra: Vec<usize>,
    bcast: Vec<bool>,
}

/// One generated input: dtype, logical shape, view and the seed of its values.
#[derive(Clone)]
struct Spec {
    dtype: DType,
    dims: Vec<usize>,
    view: View,
    dom: Dom,
    seed: u64,
}

impl Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.dtype, self.dims)?;
        let v = &self.view;
        let ident = v.perm.iter().enumerate().all(|(i, &p)| i == p);
        if !ident {
            write!(f, " perm {:?}", v.perm)?;
        }
        if v.start.iter().chain(&v.extra).any(|&s| s > 0) {
            write!(f, " narrowed start {:?} extra {:?}", v.start, v.extra)?;
        }
        if v.bcast.iter().any(|&b| b) {
            write!(f, " broadcast {:?}", v.bcast)?;
        }
        write!(f, " seed {:#x}", self.seed)
    }
}

impl Spec {
    fn pre_dims(&self) -> Vec<usize> {
        let v = &self.view;
        (0..self.dims.len())
            .map(|i| {
                if v.bcast[i] {
                    1
                } else {
                    v.start[i] + self.dims[i] + v.extra[i]
                }
            })
            .collect()
    }

    fn storage_dims(&self) -> Vec<usize> {
        let pre = self.pre_dims();
        self.view.perm.iter().map(|&p| pre[p]).collect()
    }

    fn host(&self) -> HostBuffer {
        let n = self.storage_dims().iter().product();
        gen_values(&self.dom, self.dtype, n, self.seed)
    }

    fn inverse_perm(&self) -> Vec<usize> {
        let mut inv = vec![0; self.view.perm.len()];
        for (j, &p) in self.view.perm.iter().enumerate() {
            inv[p] = j;
        }
        inv
    }

    /// The layout alone (for direct backend calls).
    fn layout(&self) -> Result<Layout> {
        let mut l = Layout::contiguous(self.storage_dims()).permute(&self.inverse_perm())?;
        for i in 0..self.dims.len() {
            if !self.view.bcast[i] {
                l = l.narrow(i, self.view.start[i], self.dims[i])?;
            }
        }
        l.broadcast_to(&self.dims.clone().into())
    }

    fn build<B: Backend>(&self, dev: &B::Device) -> Result<Tensor<B>> {
        let mut t = Tensor::<B>::from_host(&self.host(), self.storage_dims(), dev)?
            .permute(&self.inverse_perm())?;
        for i in 0..self.dims.len() {
            if !self.view.bcast[i] {
                t = t.narrow(i as isize, self.view.start[i], self.dims[i])?;
            }
        }
        t.broadcast_to(self.dims.clone())
    }
}

fn view_strategy(rank: usize, bcast: bool) -> BoxedStrategy<View> {
    (
        Just((0..rank).collect::<Vec<_>>()).prop_shuffle(),
        prop::collection::vec(0..3usize, rank),
        prop::collection::vec(0..3usize, rank),
        prop::collection::vec(prop::bool::weighted(if bcast { 0.2 } else { 0.0 }), rank),
        prop::bool::weighted(0.3),
    )
        .prop_map(move |(perm, start, extra, bcast, plain)| {
            if plain {
                View {
                    perm: (0..rank).collect(),
                    start: vec![0; rank],
                    extra: vec![0; rank],
                    bcast: vec![false; rank],
                }
            } else {
                View {
                    perm,
                    start,
                    extra,
                    bcast,
                }
            }
        })
        .boxed()
}

fn spec(dims: Vec<usize>, dtype: DType, dom: Dom, bcast: bool) -> BoxedStrategy<Spec> {
    (view_strategy(dims.len(), bcast), any::<u64>())
        .prop_map(move |(view, seed)| Spec {
            dtype,
            dims: dims.clone(),
            view,
            dom,
            seed,
        })
        .boxed()
}

fn dim(max: usize) -> BoxedStrategy<usize> {
    prop_oneof![1 => Just(0usize), 3 => Just(1usize), 10 => 2..=max].boxed()
}

fn shape(min_rank: usize, max_rank: usize, max_dim: usize) -> BoxedStrategy<Vec<usize>> {
    prop::collection::vec(dim(max_dim), min_rank..=max_rank).boxed()
}

/// Occasionally large shapes (up to ~85k elements, runs longer than 1024, axes of several
/// hundred), so that backends' blocked, vectorized and multi-threaded paths are exercised too.
fn big_shape(min_rank: usize) -> BoxedStrategy<Vec<usize>> {
    let s = prop_oneof![
        (1000..=70_000usize).prop_map(|n| vec![n]),
        (2..=40usize, 1000..=2100usize).prop_map(|(a, b)| vec![a, b]),
        (1000..=2100usize, 2..=40usize).prop_map(|(a, b)| vec![a, b]),
        (2..=4usize, 90..=130usize, 90..=130usize).prop_map(|(a, b, c)| vec![a, b, c]),
    ];
    s.prop_filter("rank", move |d| d.len() >= min_rank).boxed()
}

/// [`shape`] with a large shape in about one case of twenty.
fn shapes(min_rank: usize, max_rank: usize, max_dim: usize) -> BoxedStrategy<Vec<usize>> {
    prop_oneof![19 => shape(min_rank, max_rank, max_dim), 1 => big_shape(min_rank)].boxed()
}

/// Derives an operand shape that broadcasts to `out`: leading axes dropped, some set to 1.
fn operand_dims(out: &[usize], drop: usize, ones: &[bool]) -> Vec<usize> {
    let drop = drop.min(out.len());
    out[drop..]
        .iter()
        .zip(&ones[drop..])
        .map(|(&d, &one)| if one { 1 } else { d })
        .collect()
}

fn broadcast_shapes(max_rank: usize) -> BoxedStrategy<(Vec<usize>, Vec<usize>)> {
    shapes(0, max_rank, 6)
        .prop_flat_map(|out| {
            let r = out.len();
            (
                Just(out),
                0..=r,
                0..=r,
                prop::collection::vec(prop::bool::weighted(0.2), r),
                prop::collection::vec(prop::bool::weighted(0.2), r),
                prop::bool::weighted(0.6),
            )
        })
        .prop_map(|(out, da, db, oa, ob, full_a)| {
            // Mostly one operand has the full shape; sometimes both broadcast.
            let a = if full_a {
                out.clone()
            } else {
                operand_dims(&out, da, &oa)
            };
            let b = operand_dims(&out, db, &ob);
            (a, b)
        })
        .boxed()
}

const FLOATS: [DType; 2] = [DType::F32, DType::F64];
const ALL: [DType; 4] = [DType::F32, DType::F64, DType::I64, DType::U8];

fn dtypes_where(f: impl Fn(DType) -> bool) -> Vec<DType> {
    ALL.into_iter().filter(|&d| f(d)).collect()
}

fn msg(e: Error) -> String {
    e.to_string()
}

// ---- the groups, one file per op family ----------------------------------------------------
// (declared after the harness: the files use its `both!` macro)

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
mod update;

pub use close::{assert_close, check_close};
use elementwise::{g_binary, g_binary_scalar, g_cast, g_compare, g_where};
use errors::g_index_errors;
use index::{g_gather, g_index_select, g_scatter_add};
use matmul::g_matmul;
use memory::{g_cat_stack, g_contiguous, g_copy, g_copy_into, g_devices, g_fill, g_host};
use random::g_rand;
use reduce::{g_reduce, g_softmax, g_xent};
use unary::{g_composite, g_unary, g_unary_backward};
use update::g_fused_update;
