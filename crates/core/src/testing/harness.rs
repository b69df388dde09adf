//! The harness: runs one strategy's cases on the subject and the oracle backend and compares
//! what they return ([`Pair`]), collecting failures with descriptions of the inputs.

use super::*;

#[derive(Default)]
pub(super) struct Outcome {
    pub(super) checks: usize,
    pub(super) failures: Vec<String>,
}

/// The subject backend `X` and the oracle `Y`, with their devices.
pub(super) struct Pair<X: Backend, Y: Backend> {
    pub(super) dx: X::Device,
    pub(super) dy: Y::Device,
    pub(super) cfg: Config,
    /// Tolerance multiplier: 1 against the reference, 2 between two real backends.
    pub(super) slack: f64,
    /// Comparisons where both sides returned an error (reported in verbose mode: a check whose
    /// cases are mostly rejected tests little).
    pub(super) both_failed: std::cell::Cell<usize>,
}

pub(super) type Both<X, Y> = (Tensor<X>, Tensor<Y>);
pub(super) type Check = std::result::Result<(), String>;

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
    pub(super) fn new(dx: X::Device, dy: Y::Device, cfg: &Config, slack: f64) -> Self {
        Pair {
            dx,
            dy,
            cfg: cfg.clone(),
            slack,
            both_failed: std::cell::Cell::new(0),
        }
    }

    pub(super) fn build(&self, s: &Spec) -> std::result::Result<Both<X, Y>, String> {
        let x = s
            .build::<X>(&self.dx)
            .map_err(|e| format!("could not build input {s:?} on {}: {e}", X::NAME))?;
        let y = s
            .build::<Y>(&self.dy)
            .map_err(|e| format!("could not build input {s:?} on {}: {e}", Y::NAME))?;
        Ok((x, y))
    }

    /// Elementwise tolerance for `dtype`.
    pub(super) fn elem(&self, dtype: DType) -> Tol {
        self.accum(dtype, 0.0, None)
    }

    /// Tolerance for a `k`-term accumulation whose terms have absolute sums `mag`.
    pub(super) fn accum(&self, dtype: DType, k: f64, mag: Option<Vec<f64>>) -> Tol {
        // The 16-bit floats: within two units in the last place of the reference rounded to the
        // type (their kernels compute in f32 and round once, the reference in f64 and rounds
        // once, so they differ by at most one ulp), and f32's absolute floor, since the value
        // rounded is an f32 computation's (gelu(-7) is 0 in f32, -7.6e-13 exactly).
        let (rtol, atol) = match dtype {
            DType::F64 => (1e-12, 1e-13),
            DType::F16 | DType::BF16 => (2.0 * dtype.epsilon(), 1e-6),
            _ => (1e-5, 1e-6),
        };
        Tol::Close {
            rtol: rtol * self.slack,
            atol: atol * self.slack,
            k: k * self.slack,
            mag,
        }
    }

    pub(super) fn run<S>(
        &self,
        out: &mut Outcome,
        check: &str,
        strat: S,
        test: impl Fn(S::Value) -> Check,
    ) where
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
    pub(super) fn expect(
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
pub(super) fn describe<B: Backend>(name: &str, t: &Tensor<B>) -> String {
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

pub(super) fn host_values(h: &HostBuffer) -> String {
    match h {
        HostBuffer::F32(v) => format!("{v:?}"),
        HostBuffer::F64(v) => format!("{v:?}"),
        HostBuffer::I64(v) => format!("{v:?}"),
        HostBuffer::U8(v) => format!("{v:?}"),
        HostBuffer::F16(v) => format!("{v:?}"),
        HostBuffer::BF16(v) => format!("{v:?}"),
    }
}
