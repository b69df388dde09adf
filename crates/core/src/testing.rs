//! The conformance suite: every op of the [`Backend`] trait, on random shapes, views and values,
//! compared with the f64 [`Reference`] backend (feature `testing`).
//!
//! A backend's tests run the whole suite with one line:
//!
//! ```ignore
//! #[test]
//! fn conformance() {
//!     kiln_core::testing::run_conformance::<Cpu>(&Cpu::default_device_for_tests());
//! }
//! ```
//!
//! and, on a machine that has both, [`compare_backends`] runs the same checks with one real
//! backend as the oracle of another (CUDA against the CPU). While debugging one op, call its
//! check alone, e.g. [`check_unary`]; [`Config`] sets the number of cases and the seed.
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
use crate::reference::{RefDevice, Reference};
use crate::{
    Backend, BinaryOp, CmpOp, DType, Error, Generator, HostBuffer, Layout, RandDist, ReduceOp,
    Reduction, Result, Tensor, UnaryOp,
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
        let seed = self.cfg.seed ^ fnv1a(check);
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

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
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

// ---- groups: memory ------------------------------------------------------------------------

fn g_devices<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    out.checks += 1;
    let d = &p.dx;
    let r = (|| -> Check {
        let all = X::devices();
        if !all.contains(d) {
            return Err(format!(
                "devices() = {all:?} does not list the device under test {d}"
            ));
        }
        for dev in &all {
            let name = dev.to_string();
            match X::parse_device(&name) {
                Ok(back) if &back == dev => {}
                other => {
                    return Err(format!(
                        "parse_device({name:?}) gave {other:?}, expected {dev:?}"
                    ));
                }
            }
        }
        if X::parse_device("no-such-device:7").is_ok() {
            return Err("parse_device(\"no-such-device:7\") succeeded".into());
        }
        let t = Tensor::<X>::ones([3, 5], DType::F32, d).map_err(msg)?;
        if &X::storage_device(t.storage()) != d {
            return Err(format!(
                "storage_device of a tensor made on {d} is {}",
                X::storage_device(t.storage())
            ));
        }
        X::synchronize(d).map_err(|e| format!("synchronize({d}): {e}"))?;
        let m = X::memory_stats(d).map_err(|e| format!("memory_stats({d}): {e}"))?;
        if m.peak < m.in_use || m.reserved < m.in_use {
            return Err(format!(
                "memory_stats({d}) = {m:?}: peak and reserved must be at least in_use"
            ));
        }
        X::empty_cache(d).map_err(|e| format!("empty_cache({d}): {e}"))?;
        if t.to_vec::<f32>().map_err(msg)? != vec![1.0; 15] {
            return Err("a live tensor changed after empty_cache".into());
        }
        Ok(())
    })();
    if let Err(m) = r {
        out.failures
            .push(format!("[devices] {} on {d}: {m}", X::NAME));
    }
}

fn g_fill<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shape(0, 4, 6), select(ALL.to_vec()), -1e4..1e4f64, 0..8u8);
    p.run(out, "fill", strat, |(dims, dtype, raw, special)| {
        let value = match dtype {
            DType::F32 | DType::F64 => match special {
                0 => f64::NAN,
                1 => f64::NEG_INFINITY,
                2 => -0.0,
                _ => raw,
            },
            DType::I64 => raw.round(),
            _ => (raw.abs().round() % 256.0).floor(),
        };
        let (g, w) = (
            Tensor::<X>::full(dims.clone(), value, dtype, &p.dx),
            Tensor::<Y>::full(dims.clone(), value, dtype, &p.dy),
        );
        p.expect(
            &format!("fill {dtype} value {value:?}"),
            &[],
            g,
            w,
            &Tol::Bits,
        )
    });
}

fn g_host<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shapes(0, 4, 6), select(ALL.to_vec()))
        .prop_flat_map(|(dims, dtype)| spec(dims, dtype, Dom::any(dtype), true));
    p.run(out, "host_roundtrip", strat, |s| {
        // A contiguous upload must come back exactly as given.
        let host = s.host();
        let t = Tensor::<X>::from_host(&host, s.storage_dims(), &p.dx).map_err(msg)?;
        let back = t.to_host().map_err(msg)?;
        compare_values(&back, &host, &s.storage_dims(), &Tol::Bits)
            .map_err(|m| format!("from_host/to_host {} {:?}: {m}", s.dtype, s.storage_dims()))?;
        // Strided reads.
        let a = p.build(&s)?;
        let (g, w) = both!(a => a
            .to_host()
            .and_then(|h| Tensor::from_host(&h, a.shape().clone(), a.device())));
        p.expect(
            &format!("to_host of a view, {}", s.dtype),
            &[("x", &a.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

fn g_copy<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shapes(0, 4, 6), select(ALL.to_vec()))
        .prop_flat_map(|(dims, dtype)| spec(dims, dtype, Dom::any(dtype), true));
    p.run(out, "copy_to/to_device", strat, |s| {
        let a = p.build(&s)?;
        let what = format!("copy_to, {}", s.dtype);
        let x = &a.0;
        let same = x.to_device(&p.dx).map_err(msg)?;
        if !same.same_storage(x) {
            return Err(format!(
                "{what}: to_device to the tensor's own device copied"
            ));
        }
        let c = x.copy_to(&p.dx).map_err(msg)?;
        if c.same_storage(x) {
            return Err(format!("{what}: copy_to the same device did not copy"));
        }
        if !c.is_contiguous() {
            return Err(format!("{what}: copy is not contiguous ({:?})", c.layout()));
        }
        let (g, w) = both!(a => a.copy_to(a.device()));
        p.expect(&what, &[("x", x)], g, w, &Tol::Bits)?;
        // Every other device of the backend, there and back.
        for d in X::devices().into_iter().filter(|d| d != &p.dx) {
            let there = x.to_device(&d).map_err(msg)?;
            if there.device() != &d {
                return Err(format!(
                    "{what}: to_device({d}) gave a tensor on {}",
                    there.device()
                ));
            }
            let back = there.copy_to(&p.dx);
            p.expect(
                &format!("copy to {d} and back, {}", s.dtype),
                &[("x", x)],
                back,
                Ok(a.1.clone()),
                &Tol::Bits,
            )?;
        }
        Ok(())
    });
}

fn g_contiguous<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shapes(0, 4, 6), select(ALL.to_vec()))
        .prop_flat_map(|(dims, dtype)| spec(dims, dtype, Dom::any(dtype), true));
    p.run(out, "contiguous", strat, |s| {
        let a = p.build(&s)?;
        let (g, w) = both!(a => a.contiguous());
        if let Ok(g) = &g
            && (!g.is_contiguous() || g.layout().offset() != 0)
        {
            return Err(format!("contiguous gave layout {:?}", g.layout()));
        }
        p.expect(
            &format!("contiguous {}", s.dtype),
            &[("x", &a.0)],
            g,
            w,
            &Tol::Bits,
        )?;
        let (g, w) = both!(a => a.flatten_all());
        p.expect(
            &format!("reshape (flatten) {}", s.dtype),
            &[("x", &a.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

fn g_copy_into<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    // Direct: write a strided source into a strided (never broadcast) region of a buffer
    // filled with a sentinel; the whole buffer must match, untouched entries included.
    let strat = (shape(0, 4, 5), select(ALL.to_vec())).prop_flat_map(|(dims, dtype)| {
        (
            spec(dims.clone(), dtype, Dom::any(dtype), true),
            spec(dims, dtype, Dom::any(dtype), false),
        )
    });
    p.run(out, "copy_into", strat, |(src, dst)| {
        let a = p.build(&src)?;
        let dl = dst.layout().map_err(msg)?;
        let n: usize = dst.storage_dims().iter().product();
        let whole = Layout::contiguous(dst.storage_dims());
        let dtype = src.dtype;
        let run_x = || -> Result<HostBuffer> {
            let mut st = X::fill(&p.dx, dtype, n, 7.0)?;
            X::copy_into(a.0.storage(), a.0.layout(), &mut st, &dl, dtype)?;
            X::to_host(&st, &whole, dtype)
        };
        let run_y = || -> Result<HostBuffer> {
            let mut st = Y::fill(&p.dy, dtype, n, 7.0)?;
            Y::copy_into(a.1.storage(), a.1.layout(), &mut st, &dl, dtype)?;
            Y::to_host(&st, &whole, dtype)
        };
        let want = run_y().map_err(|e| format!("oracle copy_into failed: {e}"))?;
        let got = run_x().map_err(|e| format!("copy_into {dtype} into {dl:?}: {e}"))?;
        compare_values(&got, &want, &dst.storage_dims(), &Tol::Bits).map_err(|m| {
            format!(
                "copy_into {dtype}: {}\n  into layout {dl:?} of a {n}-element buffer: {m}",
                describe("src", &a.0)
            )
        })
    });
    // Through the Tensor API: slice_assign of a strided source into a strided tensor.
    let strat = (
        shape(1, 4, 5),
        select(ALL.to_vec()),
        any::<prop::sample::Index>(),
        0..3usize,
    )
        .prop_flat_map(|(dims, dtype, ax, start)| {
            let axis = ax.index(dims.len());
            let len = dims[axis].saturating_sub(start);
            let mut sd = dims.clone();
            sd[axis] = len;
            let start = start.min(dims[axis]);
            (
                Just((axis, start)),
                spec(dims, dtype, Dom::any(dtype), true),
                spec(sd, dtype, Dom::any(dtype), true),
            )
        });
    p.run(out, "slice_assign", strat, |((axis, start), base, src)| {
        let (a, b) = (p.build(&base)?, p.build(&src)?);
        let (g, w) = both!(a, b => a.clone().slice_assign(axis as isize, start, b));
        p.expect(
            &format!("slice_assign axis {axis} start {start}"),
            &[("base", &a.0), ("src", &b.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

fn g_rand<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let shapes = prop_oneof![8 => shape(0, 3, 6), 4 => shape(1, 2, 70), 1 => big_shape(1)];
    let strat = (
        shapes.clone(),
        select(FLOATS.to_vec()),
        any::<u64>(),
        -10.0..10.0f64,
        0.0..10.0f64,
    );
    p.run(
        out,
        "rand uniform",
        strat,
        |(dims, dtype, seed, low, width)| {
            let high = low + width;
            let (g, w) = (
                Generator::new(seed).sample::<X>(
                    dims.clone(),
                    RandDist::Uniform { low, high },
                    dtype,
                    &p.dx,
                ),
                Generator::new(seed).sample::<Y>(
                    dims.clone(),
                    RandDist::Uniform { low, high },
                    dtype,
                    &p.dy,
                ),
            );
            let tol = match dtype {
                DType::F32 => Tol::Bits,
                _ => Tol::Close {
                    rtol: 4.0 * f64::EPSILON,
                    atol: 4.0 * f64::EPSILON * (low.abs() + high.abs()),
                    k: 0.0,
                    mag: None,
                },
            };
            p.expect(
                &format!("rand uniform [{low}, {high}) seed {seed:#x} {dtype}"),
                &[],
                g,
                w,
                &tol,
            )
        },
    );
    let strat = (
        shapes,
        select(FLOATS.to_vec()),
        any::<u64>(),
        -5.0..5.0f64,
        0.0..3.0f64,
    );
    p.run(
        out,
        "rand normal",
        strat,
        |(dims, dtype, seed, mean, std)| {
            let (g, w) = (
                Generator::new(seed).sample::<X>(
                    dims.clone(),
                    RandDist::Normal { mean, std },
                    dtype,
                    &p.dx,
                ),
                Generator::new(seed).sample::<Y>(
                    dims.clone(),
                    RandDist::Normal { mean, std },
                    dtype,
                    &p.dy,
                ),
            );
            // A few ulps of the value's scale: |mean| + std·|z| with |z| <= ~8.
            let e = eps(dtype) * p.slack;
            let tol = Tol::Close {
                rtol: 8.0 * e,
                atol: 8.0 * e * (mean.abs() + 8.0 * std),
                k: 0.0,
                mag: None,
            };
            p.expect(
                &format!("rand normal mean {mean} std {std} seed {seed:#x} {dtype}"),
                &[],
                g,
                w,
                &tol,
            )
        },
    );
}

// ---- groups: elementwise -------------------------------------------------------------------

fn unary_dom(op: UnaryOp, dtype: DType) -> Dom {
    if dtype == DType::I64 {
        return Dom::range(-1000.0, 1000.0);
    }
    match op {
        UnaryOp::Log | UnaryOp::Sqrt => Dom::range(1e-3, 50.0),
        UnaryOp::Recip => Dom::range(-8.0, 8.0).avoid(0.05),
        UnaryOp::Exp => Dom::range(-20.0, 20.0),
        UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Gelu => Dom::range(-10.0, 10.0),
        _ => Dom::range(-6.0, 6.0),
    }
}

fn g_unary<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in UnaryOp::ALL {
        let strat = (shapes(0, 4, 6), select(dtypes_where(|d| op.supports(d))))
            .prop_flat_map(move |(dims, dtype)| spec(dims, dtype, unary_dom(op, dtype), true));
        p.run(out, &format!("unary {}", op.name()), strat, |s| {
            let a = p.build(&s)?;
            let (g, w) = both!(a => a.unary(op));
            p.expect(
                &format!("unary {} {}", op.name(), s.dtype),
                &[("x", &a.0)],
                g,
                w,
                &p.elem(s.dtype),
            )
        });
    }
}

fn g_unary_backward<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in UnaryOp::ALL
        .into_iter()
        .filter(|op| op.grad_reads().is_some())
    {
        let strat = (shapes(0, 4, 6), select(dtypes_where(|d| d.is_float()))).prop_flat_map(
            move |(dims, dtype)| {
                (
                    spec(dims.clone(), dtype, unary_dom(op, dtype), true),
                    spec(dims, dtype, Dom::range(-4.0, 4.0), true),
                )
            },
        );
        p.run(
            out,
            &format!("unary_backward {}", op.name()),
            strat,
            |(ss, sg)| {
                let (s, g) = (p.build(&ss)?, p.build(&sg)?);
                let (got, want) = both!(s, g => s.unary_backward(op, g));
                p.expect(
                    &format!("unary_backward {} {}", op.name(), ss.dtype),
                    &[("saved", &s.0), ("g", &g.0)],
                    got,
                    want,
                    &p.elem(ss.dtype),
                )
            },
        );
    }
}

fn binary_doms(op: BinaryOp, dtype: DType) -> (Dom, Dom) {
    match dtype {
        DType::U8 => (
            Dom::range(0.0, 255.0).ties(1.0),
            Dom::range(0.0, 255.0).ties(1.0),
        ),
        DType::I64 => match op {
            // Zeros included: integer division by zero gives 0.
            BinaryOp::Div => (Dom::range(-1000.0, 1000.0), Dom::range(-20.0, 20.0)),
            _ => (Dom::range(-1000.0, 1000.0), Dom::range(-1000.0, 1000.0)),
        },
        _ => match op {
            BinaryOp::Div => (Dom::range(-8.0, 8.0), Dom::range(-8.0, 8.0).avoid(0.1)),
            BinaryOp::Pow => (Dom::range(0.05, 5.0), Dom::range(-3.0, 3.0).ties(0.3)),
            BinaryOp::Maximum | BinaryOp::Minimum => (
                Dom::range(-8.0, 8.0).ties(0.3).nan(0.05),
                Dom::range(-8.0, 8.0).ties(0.3).nan(0.05),
            ),
            _ => (Dom::range(-8.0, 8.0), Dom::range(-8.0, 8.0)),
        },
    }
}

fn g_binary<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in BinaryOp::ALL {
        let strat = (
            broadcast_shapes(4),
            select(dtypes_where(|d| op.supports(d))),
            any::<bool>(),
        )
            .prop_flat_map(move |((da, db), dtype, swap)| {
                let (ma, mb) = binary_doms(op, dtype);
                let (da, db) = if swap { (db, da) } else { (da, db) };
                (spec(da, dtype, ma, true), spec(db, dtype, mb, true))
            });
        p.run(out, &format!("binary {}", op.name()), strat, |(sa, sb)| {
            let (a, b) = (p.build(&sa)?, p.build(&sb)?);
            let (g, w) = both!(a, b => a.binary(op, b));
            p.expect(
                &format!("binary {} {}", op.name(), sa.dtype),
                &[("lhs", &a.0), ("rhs", &b.0)],
                g,
                w,
                &p.elem(sa.dtype),
            )
        });
    }
}

fn g_binary_scalar<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in BinaryOp::ALL {
        let strat = (
            shapes(0, 4, 6),
            select(dtypes_where(|d| op.supports(d))),
            any::<bool>(),
            -8.0..8.0f64,
            any::<bool>(),
        )
            .prop_flat_map(move |(dims, dtype, scalar_lhs, raw, int)| {
                let raw = if int { raw.round() } else { raw };
                let (c, dom) = match (dtype, op) {
                    (DType::U8, _) => (
                        (raw.abs() * 32.0).round().min(255.0),
                        binary_doms(op, dtype).0,
                    ),
                    (DType::I64, BinaryOp::Div) => (raw.round(), Dom::range(-1000.0, 1000.0)),
                    (DType::I64, _) => ((raw * 125.0).round(), Dom::range(-1000.0, 1000.0)),
                    (_, BinaryOp::Div) if scalar_lhs => (raw, Dom::range(-8.0, 8.0).avoid(0.1)),
                    (_, BinaryOp::Div) => (
                        if raw.abs() < 0.1 { 0.5 } else { raw },
                        Dom::range(-8.0, 8.0),
                    ),
                    (_, BinaryOp::Pow) if scalar_lhs => {
                        (raw.abs() * 0.6 + 0.05, Dom::range(-3.0, 3.0))
                    }
                    (_, BinaryOp::Pow) => (raw * 0.375, Dom::range(0.05, 5.0)),
                    (_, BinaryOp::Maximum | BinaryOp::Minimum) => {
                        (raw, Dom::range(-8.0, 8.0).ties(0.3).nan(0.05))
                    }
                    _ => (raw, Dom::range(-8.0, 8.0)),
                };
                (Just((c, scalar_lhs)), spec(dims, dtype, dom, true))
            });
        p.run(
            out,
            &format!("binary_scalar {}", op.name()),
            strat,
            |((c, lhs), s)| {
                let a = p.build(&s)?;
                let (g, w) =
                    both!(a => if lhs { a.scalar_binary(op, c) } else { a.binary_scalar(op, c) });
                let what = if lhs {
                    format!("binary_scalar {}({c:?}, x) {}", op.name(), s.dtype)
                } else {
                    format!("binary_scalar {}(x, {c:?}) {}", op.name(), s.dtype)
                };
                p.expect(&what, &[("x", &a.0)], g, w, &p.elem(s.dtype))
            },
        );
    }
}

fn cmp_dom(dtype: DType) -> Dom {
    match dtype {
        DType::U8 => Dom::range(0.0, 6.0),
        DType::I64 => Dom::range(-5.0, 5.0),
        _ => Dom::range(-3.0, 3.0).ties(0.5).nan(0.05),
    }
}

fn g_compare<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in CmpOp::ALL {
        let strat = (broadcast_shapes(4), select(ALL.to_vec()), any::<bool>()).prop_flat_map(
            |((da, db), dtype, swap)| {
                let (da, db) = if swap { (db, da) } else { (da, db) };
                (
                    spec(da, dtype, cmp_dom(dtype), true),
                    spec(db, dtype, cmp_dom(dtype), true),
                )
            },
        );
        p.run(out, &format!("compare {}", op.name()), strat, |(sa, sb)| {
            let (a, b) = (p.build(&sa)?, p.build(&sb)?);
            let (g, w) = both!(a, b => a.compare(op, b));
            p.expect(
                &format!("compare {} {}", op.name(), sa.dtype),
                &[("lhs", &a.0), ("rhs", &b.0)],
                g,
                w,
                &Tol::Bits,
            )
        });
    }
}

fn g_where<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        broadcast_shapes(4),
        0..=4usize,
        prop::collection::vec(prop::bool::weighted(0.2), 4),
        select(ALL.to_vec()),
    )
        .prop_flat_map(|((dt, df), drop, ones, dtype)| {
            let full = if dt.len() >= df.len() {
                dt.clone()
            } else {
                df.clone()
            };
            let ones: Vec<bool> = ones
                .into_iter()
                .chain(std::iter::repeat(false))
                .take(full.len())
                .collect();
            let dc = operand_dims(&full, drop.min(full.len()), &ones);
            (
                // Any nonzero byte selects on_true.
                spec(dc, DType::U8, Dom::range(0.0, 2.0).ties(1.0), true),
                spec(dt, dtype, Dom::any(dtype), true),
                spec(df, dtype, Dom::any(dtype), true),
            )
        });
    p.run(out, "where_cond", strat, |(sc, st, sf)| {
        let (c, t, f) = (p.build(&sc)?, p.build(&st)?, p.build(&sf)?);
        let (g, w) = both!(c, t, f => c.where_cond(t, f));
        p.expect(
            &format!("where_cond {}", st.dtype),
            &[("cond", &c.0), ("on_true", &t.0), ("on_false", &f.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

// ---- groups: reductions, matmul, softmax ---------------------------------------------------

fn g_reduce<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for op in ReduceOp::ALL {
        let dtypes = match op {
            ReduceOp::Sum => vec![DType::F32, DType::F64, DType::I64],
            _ => ALL.to_vec(),
        };
        let min_rank = if op.is_arg() { 1 } else { 0 };
        let strat = (
            prop_oneof![
                8 => shape(min_rank, 4, 6),
                2 => shape(min_rank.max(1), 2, 40),
                1 => big_shape(min_rank)
            ],
            select(dtypes),
            prop::collection::vec(any::<bool>(), 4),
            prop::collection::vec(any::<bool>(), 4),
            any::<prop::sample::Index>(),
            any::<bool>(),
            select(vec![0.0, 0.0, 0.0, 0.05]),
        )
            .prop_flat_map(move |(mut dims, dtype, pick, neg, one, keepdim, nan)| {
                let r = dims.len();
                let mut axes: Vec<usize> = if op.is_arg() {
                    vec![one.index(r)]
                } else {
                    (0..r).filter(|&i| pick[i]).collect()
                };
                if op != ReduceOp::Sum {
                    // Max/Min/Arg* reject empty reductions: keep reduced axes non-empty.
                    for &a in &axes {
                        dims[a] = dims[a].max(1);
                    }
                }
                axes.sort_unstable();
                let axes: Vec<isize> = axes
                    .iter()
                    .map(|&a| {
                        if neg[a] {
                            a as isize - r as isize
                        } else {
                            a as isize
                        }
                    })
                    .collect();
                let dom = match dtype {
                    DType::U8 => Dom::range(0.0, 255.0).ties(1.0),
                    DType::I64 => Dom::range(-1000.0, 1000.0),
                    _ => Dom::range(-8.0, 8.0).ties(0.3).nan(nan),
                };
                (Just((axes, keepdim)), spec(dims, dtype, dom, true))
            });
        p.run(
            out,
            &format!("reduce {}", op.name()),
            strat,
            |((axes, keepdim), s)| {
                let a = p.build(&s)?;
                let (g, w) = both!(a => a.reduce(op, &axes, keepdim));
                let tol = if op == ReduceOp::Sum && s.dtype.is_float() {
                    let k: usize = axes
                        .iter()
                        .map(|&ax| s.dims[ax.rem_euclid(s.dims.len().max(1) as isize) as usize])
                        .product();
                    let mag =
                        a.1.abs()
                            .and_then(|t| t.reduce(op, &axes, keepdim))
                            .and_then(|t| t.to_f64_vec())
                            .ok();
                    p.accum(s.dtype, k as f64, mag)
                } else {
                    Tol::Bits
                };
                p.expect(
                    &format!(
                        "reduce {} axes {axes:?} keepdim {keepdim} {}",
                        op.name(),
                        s.dtype
                    ),
                    &[("x", &a.0)],
                    g,
                    w,
                    &tol,
                )
            },
        );
    }
}

fn mat_dim() -> BoxedStrategy<usize> {
    prop_oneof![
        1 => Just(0usize),
        2 => Just(1usize),
        8 => 2..=9usize,
        2 => 10..=33usize,
        1 => 34..=130usize
    ]
    .boxed()
}

fn g_matmul<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        select(FLOATS.to_vec()),
        (mat_dim(), mat_dim(), mat_dim()),
        prop::collection::vec(
            prop_oneof![1 => Just(1usize), 2 => 2..=3usize, 1 => Just(0usize)],
            0..=2,
        ),
        (0..=2usize, 0..=2usize),
        (
            prop::collection::vec(prop::bool::weighted(0.3), 2),
            prop::collection::vec(prop::bool::weighted(0.3), 2),
        ),
        (prop::bool::weighted(0.12), prop::bool::weighted(0.12)),
    )
        .prop_flat_map(
            |(dtype, (m, k, n), batch, (drop_a, drop_b), (ones_a, ones_b), (a1, b1))| {
                let mut ones_a = ones_a;
                let mut ones_b = ones_b;
                ones_a.truncate(batch.len());
                ones_b.truncate(batch.len());
                let mut da = if a1 {
                    vec![]
                } else {
                    operand_dims(&batch, drop_a, &ones_a)
                };
                let mut db = if b1 {
                    vec![]
                } else {
                    operand_dims(&batch, drop_b, &ones_b)
                };
                if a1 {
                    da.push(k)
                } else {
                    da.extend([m, k])
                }
                if b1 {
                    db.push(k)
                } else {
                    db.extend([k, n])
                }
                let dom = Dom::range(-2.0, 2.0);
                (
                    Just(k),
                    spec(da, dtype, dom, true),
                    spec(db, dtype, dom, true),
                )
            },
        );
    p.run(out, "matmul", strat, |(k, sa, sb)| {
        let (a, b) = (p.build(&sa)?, p.build(&sb)?);
        let (g, w) = both!(a, b => a.matmul(b));
        let mag =
            a.1.abs()
                .and_then(|x| x.matmul(&b.1.abs()?))
                .and_then(|t| t.to_f64_vec())
                .ok();
        p.expect(
            &format!("matmul {}", sa.dtype),
            &[("lhs", &a.0), ("rhs", &b.0)],
            g,
            w,
            &p.accum(sa.dtype, k as f64 + 1.0, mag),
        )
    });
}

/// Per-row `(max |x|, row length)` of the last axis, broadcast to every element of the row.
fn row_scale<B: Backend>(t: &Tensor<B>) -> Option<(Vec<f64>, usize)> {
    let c = *t.dims().last()?;
    let v = t.to_f64_vec().ok()?;
    let mut out = Vec::with_capacity(v.len());
    for row in v.chunks(c.max(1)) {
        let m = row.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        out.extend(std::iter::repeat_n(m, row.len()));
    }
    Some((out, c))
}

fn g_softmax<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for log in [false, true] {
        let name = if log { "log_softmax" } else { "softmax" };
        let dims = prop_oneof![
            19 => (shape(1, 4, 6), 0..=13usize).prop_map(|(mut dims, last)| {
                *dims.last_mut().expect("rank >= 1") = last;
                dims
            }),
            1 => big_shape(1),
        ];
        let strat = (dims, select(FLOATS.to_vec()), prop::bool::weighted(0.2)).prop_flat_map(
            |(dims, dtype, big)| {
                // Large logits check the max subtraction (exp overflows f32 beyond 88).
                let dom = if big {
                    Dom::range(-300.0, 300.0)
                } else {
                    Dom::range(-10.0, 10.0)
                };
                spec(dims, dtype, dom, true)
            },
        );
        p.run(out, name, strat, |s| {
            let a = p.build(&s)?;
            let (g, w) = both!(a => if log { a.log_softmax(-1) } else { a.softmax(-1) });
            let tol = match (&w, row_scale(&a.1)) {
                (Ok(w), Some((scale, c))) => {
                    let wv = w.to_f64_vec().map_err(msg)?;
                    // softmax: relative error ~ row length; log_softmax: absolute, of the logits'
                    // magnitude.
                    let mag: Vec<f64> = if log {
                        scale
                            .iter()
                            .zip(&wv)
                            .map(|(m, w)| 2.0 * m + w.abs() + 1.0)
                            .collect()
                    } else {
                        wv.iter().map(|w| w.abs()).collect()
                    };
                    p.accum(s.dtype, c as f64 + 2.0, Some(mag))
                }
                _ => p.elem(s.dtype),
            };
            p.expect(&format!("{name} {}", s.dtype), &[("x", &a.0)], g, w, &tol)
        });
    }
}

fn g_xent<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        0..=9usize,
        1..=13usize,
        select(FLOATS.to_vec()),
        prop::bool::weighted(0.2),
    )
        .prop_flat_map(|(n, c, dtype, big)| {
            let dom = if big {
                Dom::range(-300.0, 300.0)
            } else {
                Dom::range(-10.0, 10.0)
            };
            (
                spec(vec![n, c], dtype, dom, true),
                spec(
                    vec![n],
                    DType::I64,
                    Dom::range(0.0, c as f64 - 1.0).ties(1.0),
                    true,
                ),
                spec(vec![n], dtype, Dom::range(-2.0, 2.0), true),
            )
        });
    p.run(out, "cross_entropy", strat, |(sl, sy, sg)| {
        let (x, y, gr) = (p.build(&sl)?, p.build(&sy)?, p.build(&sg)?);
        let c = sl.dims[1];
        let (scale, _) = row_scale(&x.1).unwrap_or_default();
        let per_row: Vec<f64> = scale.iter().step_by(c).map(|m| 2.0 * m + 2.0).collect();
        let (g, w) = both!(x, y => x.cross_entropy(y, Reduction::None));
        let wv = w
            .as_ref()
            .ok()
            .and_then(|w| w.to_f64_vec().ok())
            .unwrap_or_default();
        let mag = per_row
            .iter()
            .zip(wv.iter().chain(std::iter::repeat(&0.0)))
            .map(|(m, w)| m + w.abs())
            .collect();
        p.expect(
            &format!("cross_entropy {}", sl.dtype),
            &[("logits", &x.0), ("labels", &y.0)],
            g,
            w,
            &p.accum(sl.dtype, c as f64 + 2.0, Some(mag)),
        )?;
        let (g, w) = both!(x, y, gr => x.cross_entropy_backward(y, gr));
        let gv = gr.1.to_f64_vec().map_err(msg)?;
        let mag: Vec<f64> = (0..sl.dims[0] * c).map(|i| 2.0 * gv[i / c].abs()).collect();
        p.expect(
            &format!("cross_entropy_backward {}", sl.dtype),
            &[("logits", &x.0), ("labels", &y.0), ("grad", &gr.0)],
            g,
            w,
            &p.accum(sl.dtype, c as f64 + 2.0, Some(mag)),
        )
    });
}

// ---- groups: cast, indexing, joins ---------------------------------------------------------

/// Values of `from` that every backend casts to `to` the same way (no NaN or out-of-range
/// values into integers, whose C conversions are undefined).
fn cast_dom(from: DType, to: DType) -> Dom {
    match (from, to) {
        (DType::U8, _) => Dom::range(0.0, 255.0).ties(1.0),
        (DType::I64, DType::U8) => Dom::range(0.0, 255.0),
        // Large integers: i64 -> f32/f64 rounds.
        (DType::I64, _) => Dom::range(-1.1e12, 1.1e12).ties(0.0).specials(),
        (_, DType::U8) => Dom::range(0.0, 255.5).ties(0.3),
        (_, DType::I64) => Dom::range(-1e6, 1e6).ties(0.2),
        _ => Dom::range(-1e6, 1e6).specials(),
    }
}

fn g_cast<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    for from in ALL {
        for to in ALL {
            let strat = shapes(0, 4, 6)
                .prop_flat_map(move |dims| spec(dims, from, cast_dom(from, to), true));
            p.run(out, &format!("cast {from} -> {to}"), strat, |s| {
                let a = p.build(&s)?;
                // to_dtype skips the kernel when nothing changes; call it directly then.
                let (g, w) = if from == to {
                    both!(a => B_cast(a, to))
                } else {
                    both!(a => a.to_dtype(to))
                };
                p.expect(
                    &format!("cast {from} -> {to}"),
                    &[("x", &a.0)],
                    g,
                    w,
                    &Tol::Bits,
                )
            });
        }
    }
}

/// The backend's `cast` kernel called directly (same-dtype casts).
#[allow(non_snake_case)]
fn B_cast<B: Backend>(t: &Tensor<B>, to: DType) -> Result<Tensor<B>> {
    let s = B::cast(t.storage(), t.layout(), t.dtype(), to)?;
    Ok(Tensor::from_storage(s, t.shape().clone(), to))
}

fn g_index_select<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        shapes(1, 4, 6),
        select(ALL.to_vec()),
        any::<prop::sample::Index>(),
        prop_oneof![10 => 0..=8usize, 1 => 100..=2000usize],
        any::<bool>(),
    )
        .prop_flat_map(|(mut dims, dtype, ax, n_ids, neg)| {
            let axis = ax.index(dims.len());
            dims[axis] = dims[axis].max(1);
            // Keep the output below ~100k elements.
            let others: usize = dims.iter().product::<usize>() / dims[axis];
            let n_ids = n_ids.min(100_000 / others.max(1)).max(n_ids.min(1));
            let d = dims[axis] as f64;
            let axis_arg = if neg {
                axis as isize - dims.len() as isize
            } else {
                axis as isize
            };
            (
                Just(axis_arg),
                spec(dims, dtype, Dom::any(dtype), true),
                spec(
                    vec![n_ids],
                    DType::I64,
                    Dom::range(0.0, d - 1.0).ties(1.0),
                    true,
                ),
            )
        });
    p.run(out, "index_select", strat, |(axis, s, si)| {
        let (a, i) = (p.build(&s)?, p.build(&si)?);
        let (g, w) = both!(a, i => a.index_select(axis, i));
        p.expect(
            &format!("index_select axis {axis} {}", s.dtype),
            &[("x", &a.0), ("ids", &i.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

/// `(source dims, index dims, axis)` for gather/scatter_add: index dims no larger than the
/// source's off the axis, any length along it.
fn index_shapes() -> BoxedStrategy<(Vec<usize>, Vec<usize>, usize)> {
    // Mostly small; sometimes a large source with a long index axis (other index dims capped
    // so the output stays below ~100k elements).
    let sizes = prop_oneof![
        12 => (shape(1, 4, 5), 0..=6usize, Just(usize::MAX)),
        1 => (big_shape(1), 100..=2000usize, Just(40usize)),
    ];
    (
        sizes,
        any::<prop::sample::Index>(),
        prop::collection::vec(0..=2usize, 4),
    )
        .prop_map(|((mut dims, along, cap), ax, shrink)| {
            let axis = ax.index(dims.len());
            dims[axis] = dims[axis].max(1);
            let ids: Vec<usize> = dims
                .iter()
                .enumerate()
                .map(|(i, &d)| {
                    if i == axis {
                        along
                    } else {
                        d.saturating_sub(shrink[i]).min(cap)
                    }
                })
                .collect();
            (dims, ids, axis)
        })
        .boxed()
}

fn g_gather<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat =
        (index_shapes(), select(ALL.to_vec())).prop_flat_map(|((dims, ids, axis), dtype)| {
            let d = dims[axis] as f64;
            (
                Just(axis),
                spec(dims, dtype, Dom::any(dtype), true),
                spec(ids, DType::I64, Dom::range(0.0, d - 1.0).ties(1.0), true),
            )
        });
    p.run(out, "gather", strat, |(axis, s, si)| {
        let (a, i) = (p.build(&s)?, p.build(&si)?);
        let (g, w) = both!(a, i => a.gather(axis as isize, i));
        p.expect(
            &format!("gather axis {axis} {}", s.dtype),
            &[("x", &a.0), ("ids", &i.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

fn g_scatter_add<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let dtypes = vec![DType::F32, DType::F64, DType::I64];
    let strat = (index_shapes(), select(dtypes)).prop_flat_map(|((dims, ids, axis), dtype)| {
        let d = dims[axis] as f64;
        let dom = if dtype == DType::I64 {
            Dom::range(-1000.0, 1000.0)
        } else {
            Dom::range(-8.0, 8.0)
        };
        (
            Just(axis),
            spec(dims, dtype, dom, true),
            spec(
                ids.clone(),
                DType::I64,
                Dom::range(0.0, d - 1.0).ties(1.0),
                true,
            ),
            // The source must not be broadcast in ways that differ from ids: any view is fine.
            spec(ids, dtype, dom, true),
        )
    });
    p.run(out, "scatter_add", strat, |(axis, sb, si, ss)| {
        let (b, i, s) = (p.build(&sb)?, p.build(&si)?, p.build(&ss)?);
        let (g, w) = both!(b, i, s => b.scatter_add(axis as isize, i, s));
        // Summation order is unspecified: bound by the count and sizes of the terms.
        let mag =
            b.1.abs()
                .and_then(|bb| bb.scatter_add(axis as isize, &i.1, &s.1.abs()?))
                .and_then(|t| t.to_f64_vec())
                .ok();
        let k = si.dims[axis] as f64 + 1.0;
        p.expect(
            &format!("scatter_add axis {axis} {}", sb.dtype),
            &[("base", &b.0), ("ids", &i.0), ("src", &s.0)],
            g,
            w,
            &p.accum(sb.dtype, k, mag),
        )
    });
}

/// The subject must reject an out-of-range index with `IndexOutOfRange` naming the op and the
/// index.
fn expect_index_error<X: Backend>(op: &str, bad: i64, r: Result<Tensor<X>>) -> Check {
    match r {
        Ok(t) => Err(format!(
            "{op} with index {bad} out of range returned a {} tensor instead of an error",
            t.shape()
        )),
        Err(Error::IndexOutOfRange { op: o, index, .. }) if o == op && index == bad => Ok(()),
        Err(e) => Err(format!(
            "{op} with index {bad} out of range: expected Error::IndexOutOfRange naming them, got {e:?} (\"{e}\")"
        )),
    }
}

fn g_index_errors<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        index_shapes(),
        select(FLOATS.to_vec()),
        any::<prop::sample::Index>(),
        0..4usize,
        prop::bool::weighted(0.3),
    )
        .prop_filter("needs an index", |((_, ids, _), ..)| {
            ids.iter().product::<usize>() > 0
        })
        .prop_map(|((dims, ids, axis), dtype, at, beyond, negative)| {
            let d = dims[axis] as i64;
            let bad = if negative {
                -1 - beyond as i64
            } else {
                d + beyond as i64
            };
            (dims, ids, axis, dtype, at, bad)
        });
    p.run(
        out,
        "index errors",
        strat,
        |(dims, id_dims, axis, dtype, at, bad)| {
            let x = Tensor::<X>::zeros(dims.clone(), dtype, &p.dx).map_err(msg)?;
            let n: usize = id_dims.iter().product();
            let mut ids = vec![0i64; n];
            ids[at.index(n)] = bad;
            let idt = Tensor::<X>::from_vec(ids.clone(), id_dims.clone(), &p.dx).map_err(msg)?;
            let src = Tensor::<X>::ones(id_dims.clone(), dtype, &p.dx).map_err(msg)?;
            let ax = axis as isize;
            let sel = Tensor::<X>::from_vec(ids.clone(), n, &p.dx).map_err(msg)?;
            expect_index_error("index_select", bad, x.index_select(ax, &sel))?;
            expect_index_error("gather", bad, x.gather(ax, &idt))?;
            expect_index_error("scatter_add", bad, x.scatter_add(ax, &idt, &src))?;
            // Labels of cross_entropy (and its backward) outside 0..c.
            let c = dims[axis].clamp(1, 64);
            let n = n.min(64);
            let logits = Tensor::<X>::zeros([n, c], dtype, &p.dx).map_err(msg)?;
            let bad_label = if bad < 0 {
                bad
            } else {
                c as i64 + (bad - dims[axis] as i64)
            };
            // (`n` rows, one bad label.)
            let mut labels = vec![0i64; n];
            labels[at.index(n)] = bad_label;
            let labels = Tensor::<X>::from_vec(labels, n, &p.dx).map_err(msg)?;
            let grad = Tensor::<X>::ones(n, dtype, &p.dx).map_err(msg)?;
            expect_index_error(
                "cross_entropy",
                bad_label,
                logits.cross_entropy(&labels, Reduction::None),
            )?;
            expect_index_error(
                "cross_entropy_backward",
                bad_label,
                logits.cross_entropy_backward(&labels, &grad),
            )
        },
    );
}

fn g_cat_stack<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        shape(1, 4, 5),
        select(ALL.to_vec()),
        any::<prop::sample::Index>(),
        prop::collection::vec(0..=4usize, 1..=4),
        any::<bool>(),
    )
        .prop_flat_map(|(dims, dtype, ax, lens, neg)| {
            let axis = ax.index(dims.len());
            let parts: Vec<_> = lens
                .iter()
                .map(|&l| {
                    let mut d = dims.clone();
                    d[axis] = l;
                    spec(d, dtype, Dom::any(dtype), true)
                })
                .collect();
            let axis = if neg {
                axis as isize - dims.len() as isize
            } else {
                axis as isize
            };
            (Just(axis), parts)
        });
    p.run(out, "cat", strat, |(axis, parts)| {
        let built = parts
            .iter()
            .map(|s| p.build(s))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let xs: Vec<Tensor<X>> = built.iter().map(|b| b.0.clone()).collect();
        let ys: Vec<Tensor<Y>> = built.iter().map(|b| b.1.clone()).collect();
        let ins: Vec<(&str, &Tensor<X>)> = xs.iter().map(|t| ("part", t)).collect();
        p.expect(
            &format!("cat axis {axis} {}", parts[0].dtype),
            &ins,
            Tensor::cat(&xs, axis),
            Tensor::cat(&ys, axis),
            &Tol::Bits,
        )
    });
    let strat = (
        shape(0, 3, 5),
        select(ALL.to_vec()),
        1..=4usize,
        any::<prop::sample::Index>(),
    )
        .prop_flat_map(|(dims, dtype, n, ax)| {
            let axis = ax.index(dims.len() + 1) as isize;
            (
                Just(axis),
                prop::collection::vec(spec(dims, dtype, Dom::any(dtype), true), n),
            )
        });
    p.run(out, "stack", strat, |(axis, parts)| {
        let built = parts
            .iter()
            .map(|s| p.build(s))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let xs: Vec<Tensor<X>> = built.iter().map(|b| b.0.clone()).collect();
        let ys: Vec<Tensor<Y>> = built.iter().map(|b| b.1.clone()).collect();
        let ins: Vec<(&str, &Tensor<X>)> = xs.iter().map(|t| ("part", t)).collect();
        p.expect(
            &format!("stack axis {axis} {}", parts[0].dtype),
            &ins,
            Tensor::stack(&xs, axis),
            Tensor::stack(&ys, axis),
            &Tol::Bits,
        )
    });
}

// ---- group: fused optimizer updates --------------------------------------------------------

/// A random SGD or Adam(W) rule whose update stays moderate (|update| of order 1 at most).
fn update_rule() -> BoxedStrategy<UpdateRule> {
    let sgd = (
        1e-4..0.1f64,
        select(vec![0.0, 0.9, 0.5]),
        select(vec![0.0, 0.1]),
        any::<bool>(),
        select(vec![0.0, 0.01, 0.1]),
        any::<bool>(),
    )
        .prop_map(
            |(lr, momentum, dampening, nesterov, weight_decay, first_step)| UpdateRule::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
                first_step,
            },
        );
    let adam = (
        1e-4..0.1f64,
        0.8..0.99f64,
        0.9..0.9999f64,
        select(vec![1e-8, 1e-6, 1e-3]),
        select(vec![0.0, 0.01, 0.1]),
        any::<bool>(),
        1..=10i32,
    )
        .prop_map(
            |(lr, beta1, beta2, eps, weight_decay, decoupled, t)| UpdateRule::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
                bias_correction1: 1.0 - beta1.powi(t),
                bias_correction2: 1.0 - beta2.powi(t),
            },
        );
    prop_oneof![sgd, adam].boxed()
}

/// Per element, a bound on the magnitude of every term of the update (for the tolerance):
/// `[param, state...]` outputs all get `|p| + |g| + Σ|state| + lr·|direction|`.
fn update_mags(rule: &UpdateRule, p: &[f64], g: &[f64], st: &[Vec<f64>]) -> Vec<f64> {
    (0..p.len())
        .map(|i| {
            let (p, g) = (p[i].abs(), g[i].abs());
            let s: f64 = st.iter().map(|v| v[i].abs()).sum();
            let dir = match *rule {
                UpdateRule::Sgd {
                    lr,
                    momentum,
                    weight_decay,
                    ..
                } => lr * (g + weight_decay * p + momentum * s) * (1.0 + momentum),
                UpdateRule::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    bias_correction1,
                    bias_correction2,
                    ..
                } => {
                    let gg = g + weight_decay * p;
                    let m = beta1 * st[0][i].abs() + (1.0 - beta1) * gg;
                    let v = beta2 * st[1][i].abs();
                    lr * weight_decay * p
                        + lr / bias_correction1 * m / ((v / bias_correction2).sqrt() + eps)
                        + gg * gg
                }
            };
            p + g + s + dir
        })
        .collect()
}

fn g_fused_update<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        update_rule(),
        select(FLOATS.to_vec()),
        prop::collection::vec(prop_oneof![39 => shape(0, 3, 6), 1 => big_shape(1)], 1..=4),
    )
        .prop_flat_map(|(rule, dtype, dims)| {
            let n_state = rule.state_count();
            let adam = matches!(rule, UpdateRule::Adam { .. });
            let slots: Vec<_> = dims
                .into_iter()
                .map(|d| {
                    let states: Vec<_> = (0..n_state)
                        .map(|j| {
                            // Adam's second moment is positive.
                            let dom = if adam && j == 1 {
                                Dom::range(0.05, 2.0)
                            } else {
                                Dom::range(-1.0, 1.0)
                            };
                            spec(d.clone(), dtype, dom, true)
                        })
                        .collect();
                    (
                        spec(d.clone(), dtype, Dom::range(-2.0, 2.0), true),
                        spec(d, dtype, Dom::range(-1.0, 1.0), true),
                        states,
                    )
                })
                .collect();
            (Just(rule), slots)
        });
    p.run(out, "fused_update", strat, |(rule, slots)| {
        let mut ps = Vec::new();
        let mut gs = Vec::new();
        let mut ss = Vec::new();
        for (sp, sg, sst) in &slots {
            ps.push(p.build(sp)?);
            gs.push(p.build(sg)?);
            ss.push(
                sst.iter()
                    .map(|s| p.build(s))
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            );
        }
        let px: Vec<Tensor<X>> = ps.iter().map(|t| t.0.clone()).collect();
        let py: Vec<Tensor<Y>> = ps.iter().map(|t| t.1.clone()).collect();
        let gx: Vec<Tensor<X>> = gs.iter().map(|t| t.0.clone()).collect();
        let gy: Vec<Tensor<Y>> = gs.iter().map(|t| t.1.clone()).collect();
        let sx: Vec<Vec<Tensor<X>>> = ss
            .iter()
            .map(|v| v.iter().map(|t| t.0.clone()).collect())
            .collect();
        let sy: Vec<Vec<Tensor<Y>>> = ss
            .iter()
            .map(|v| v.iter().map(|t| t.1.clone()).collect())
            .collect();
        let got = Tensor::<X>::fused_update(&rule, &px, &gx, &sx);
        let want = Tensor::<Y>::fused_update(&rule, &py, &gy, &sy);
        let (got, want) = match (got, want) {
            (Err(_), Err(_)) => return Ok(()),
            (Err(e), Ok(_)) => return Err(format!("fused_update {rule:?} failed: {e}")),
            (Ok(_), Err(e)) => {
                return Err(format!(
                    "fused_update {rule:?}: {} failed with {e} but {} did not",
                    Y::NAME,
                    X::NAME
                ));
            }
            (Ok(g), Ok(w)) => (g, w),
        };
        if got.len() != want.len() {
            return Err(format!(
                "fused_update returned {} slots, expected {}",
                got.len(),
                want.len()
            ));
        }
        for (i, ((gp, gst), (wp, wst))) in got.into_iter().zip(want).enumerate() {
            let host = |t: &Tensor<Y>| t.to_f64_vec().map_err(msg);
            let st_vals = ss[i]
                .iter()
                .map(|t| host(&t.1))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let mag = update_mags(&rule, &host(&ps[i].1)?, &host(&gs[i].1)?, &st_vals);
            let tol = p.accum(slots[i].0.dtype, 32.0, Some(mag));
            let dtype = slots[i].0.dtype;
            let mut ins = vec![("param", &ps[i].0), ("grad", &gs[i].0)];
            ins.extend(ss[i].iter().map(|t| ("state", &t.0)));
            p.expect(
                &format!("fused_update {rule:?} {dtype}: slot {i} param"),
                &ins,
                Ok(gp),
                Ok(wp),
                &tol,
            )?;
            if gst.len() != wst.len() {
                return Err(format!(
                    "fused_update slot {i}: {} state buffers, expected {}",
                    gst.len(),
                    wst.len()
                ));
            }
            for (j, (g, w)) in gst.into_iter().zip(wst).enumerate() {
                p.expect(
                    &format!("fused_update {rule:?} {dtype}: slot {i} state {j}"),
                    &ins,
                    Ok(g),
                    Ok(w),
                    &tol,
                )?;
            }
        }
        Ok(())
    });
}
