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
}

impl Default for SuiteConfig {
    fn default() -> Self {
        SuiteConfig {
            cases: 24,
            check: CheckOptions::default(),
            filter: None,
        }
    }
}

/// Runs every gradient check on `device` and panics listing every op that failed.
pub fn run_gradient_suite<B: Backend>(device: &B::Device) {
    run_gradient_suite_with::<B>(device, &SuiteConfig::default())
}

/// [`run_gradient_suite`] with explicit settings.
pub fn run_gradient_suite_with<B: Backend>(device: &B::Device, cfg: &SuiteConfig) {
    let mut failures = Vec::new();
    let mut ran = 0;
    for (name, case) in cases::<B>() {
        if cfg
            .filter
            .as_ref()
            .is_some_and(|f| !name.contains(f.as_str()))
        {
            continue;
        }
        ran += 1;
        if let Err(msg) = case(device, cfg) {
            failures.push(format!("{name}: {msg}"));
        }
    }
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

fn copy_suite<B: Backend>(a: &B::Device, b: &B::Device) -> Result<()> {
    use kiln_core::Error;
    let opts = CheckOptions::default();
    let x = Tensor::<B>::from_vec(vec![0.5f64, -1.0, 2.0, 0.25, 1.5, -0.75], [2, 3], a)?;
    let w = Tensor::<B>::from_vec(vec![1.0f64, 2.0, -1.0], [3], b)?;
    // x lives on a, w on b: compute on b, bring the result back to a.
    check_backward(
        |v| {
            v[0].to_device(b)?
                .mul(&v[1])?
                .tanh()?
                .copy_to(a)?
                .sum(&[1], false)
        },
        &[x.clone(), w.clone()],
        &opts,
    )?;
    check_backward(
        |v| v[0].t()?.copy_to(b)?.exp(),
        std::slice::from_ref(&x),
        &opts,
    )?;
    // The gradient arrives on the source device.
    let xv = Var::param(x.clone());
    xv.to_device(b)?.square()?.sum_all()?.backward()?;
    let g = xv
        .grad()
        .ok_or_else(|| Error::invalid("copy_suite", "no gradient"))?;
    if g.device() != a {
        return Err(Error::invalid(
            "copy_suite",
            format!("gradient on {} instead of {a}", g.device()),
        ));
    }
    let same = xv.to_device(a)?;
    if !same.ptr_eq(&xv) {
        return Err(Error::invalid(
            "copy_suite",
            "to_device to its own device made a copy",
        ));
    }
    if a != b {
        let err = match xv.mul(&Var::param(w.broadcast_to([2, 3])?)) {
            Ok(_) => return Err(Error::invalid("copy_suite", "mixing devices did not fail")),
            Err(e) => e.to_string(),
        };
        let (na, nb) = (a.to_string(), b.to_string());
        if !(err.contains("mul") && err.contains(&na) && err.contains(&nb)) {
            return Err(Error::invalid(
                "copy_suite",
                format!("mixing devices error does not name the op and both devices: {err}"),
            ));
        }
    }
    Ok(())
}

type Case<B> =
    Box<dyn Fn(&<B as Backend>::Device, &SuiteConfig) -> std::result::Result<(), String>>;

// ---- inputs ------------------------------------------------------------------------------------

/// How an input tensor is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lay {
    Contiguous,
    /// A transposed view of a tensor whose last two axes are swapped (column-major matrices).
    Transposed,
    /// A view narrowed on the last axis out of a wider tensor (strided, with an offset).
    Narrowed,
}

/// The values an input holds.
#[derive(Clone, Copy, Debug)]
enum Vals {
    Normal,
    /// Uniform in [0.5, 2): for log, sqrt, recip, pow bases.
    Positive,
    /// |x| in [0.5, 1.5) with a random sign: away from the kinks of abs, relu, sign, and from
    /// the pole of 1/x (whose third derivative would swamp a central difference near 0).
    AwayFromZero,
    /// k + [0.1, 0.9): away from the jumps of floor and ceil.
    AwayFromInt,
    /// Standard normal values moved at least 0.05 away from each of these points (kinks).
    AwayFrom(&'static [f64]),
    /// Odd (or even) multiples of 0.05: two grids never tie (maximum/minimum, clamp).
    Grid {
        odd: bool,
    },
    /// Distinct values 0.05 apart (max/min reductions).
    Distinct,
}

/// One input: its logical dims, layout and value seed.
#[derive(Clone, Debug)]
pub struct In {
    pub dims: Vec<usize>,
    pub lay: Lay,
    pub seed: u64,
}

fn lay() -> impl Strategy<Value = Lay> {
    prop_oneof![
        Just(Lay::Contiguous),
        Just(Lay::Transposed),
        Just(Lay::Narrowed)
    ]
}

fn input_of(dims: impl Strategy<Value = Vec<usize>>) -> impl Strategy<Value = In> {
    (dims, lay(), any::<u64>()).prop_map(|(dims, lay, seed)| In { dims, lay, seed })
}

fn dims(min_rank: usize, max_rank: usize) -> impl Strategy<Value = Vec<usize>> {
    vec(1usize..=4, min_rank..=max_rank)
}

fn host_values(v: Vals, n: usize, seed: u64) -> Vec<f64> {
    let u = |i: usize, lo: f64, hi: f64| philox::uniform_f64(seed, i as u64, lo, hi);
    match v {
        Vals::Normal => (0..n)
            .map(|i| philox::normal_f64(seed, i as u64, 0.0, 1.0))
            .collect(),
        Vals::Positive => (0..n).map(|i| u(i, 0.5, 2.0)).collect(),
        Vals::AwayFromZero => (0..n)
            .map(|i| {
                let x = u(i, -1.0, 1.0);
                x.signum() * (0.5 + x.abs())
            })
            .collect(),
        Vals::AwayFrom(kinks) => (0..n)
            .map(|i| {
                let x = philox::normal_f64(seed, i as u64, 0.0, 1.0);
                match kinks.iter().find(|&&k| (x - k).abs() < 0.05) {
                    Some(&k) => k + if x < k { -0.05 } else { 0.05 } + (x - k),
                    None => x,
                }
            })
            .collect(),
        Vals::AwayFromInt => (0..n)
            .map(|i| u(i, -3.0, 3.0).floor() + 0.1 + 0.8 * u(i + n, 0.0, 1.0))
            .collect(),
        Vals::Grid { odd } => (0..n)
            .map(|i| {
                let k = u(i, -20.0, 20.0).floor();
                (2.0 * k + if odd { 1.0 } else { 0.0 }) * 0.05
            })
            .collect(),
        Vals::Distinct => {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| u(a, 0.0, 1.0).total_cmp(&u(b, 0.0, 1.0)));
            let mut out = vec![0.0; n];
            for (rank, &i) in order.iter().enumerate() {
                out[i] = (rank as f64 - n as f64 / 2.0) * 0.05 + 0.01;
            }
            out
        }
    }
}

impl In {
    /// The f64 tensor on `dev`, laid out as asked.
    fn build<B: Backend>(&self, v: Vals, dev: &B::Device) -> Result<Tensor<B>> {
        let r = self.dims.len();
        let lay = match self.lay {
            _ if r == 0 => Lay::Contiguous,
            Lay::Transposed if r < 2 => Lay::Narrowed,
            l => l,
        };
        let mut sdims = self.dims.clone();
        match lay {
            Lay::Transposed => sdims.swap(r - 2, r - 1),
            Lay::Narrowed => sdims[r - 1] += 3,
            Lay::Contiguous => {}
        }
        let n: usize = sdims.iter().product();
        let t = Tensor::<B>::from_vec(host_values(v, n, self.seed), sdims, dev)?;
        match lay {
            Lay::Transposed => t.transpose(-2, -1),
            Lay::Narrowed => t.narrow(-1, 1, self.dims[r - 1]),
            Lay::Contiguous => Ok(t),
        }
    }
}

/// `len` random indices in `0..n` as an `i64` tensor of `dims`.
fn ids<B: Backend>(dims: &[usize], n: usize, seed: u64, dev: &B::Device) -> Result<Tensor<B>> {
    let len: usize = dims.iter().product();
    let v: Vec<i64> = (0..len)
        .map(|i| {
            let x = philox::uniform_f64(seed ^ 0x9e37_79b9, i as u64, 0.0, n as f64);
            (x as i64).min(n as i64 - 1)
        })
        .collect();
    Tensor::from_vec(v, dims.to_vec(), dev)
}

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

/// Broadcast-compatible pair of shapes: one full shape, the other with some axes set to 1 and
/// some leading axes dropped (either side).
fn bcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (dims(0, 3), vec(any::<bool>(), 3), 0usize..=3, any::<bool>()).prop_map(
        |(full, ones, drop, swap)| {
            let mut small: Vec<usize> = full
                .iter()
                .zip(&ones)
                .map(|(&d, &o)| if o { 1 } else { d })
                .collect();
            let drop = drop.min(small.len());
            small.drain(..drop);
            if swap { (small, full) } else { (full, small) }
        },
    )
}

/// A non-empty subset of the axes of a rank-`r` tensor.
fn axes_of(r: usize, mask: &[bool]) -> Vec<isize> {
    let a: Vec<isize> = (0..r).filter(|&i| mask[i]).map(|i| i as isize).collect();
    if a.is_empty() {
        (0..r as isize).collect()
    } else {
        a
    }
}

/// Where the gradient check samples `op`, from the op table: away from the jumps of a
/// piecewise-constant op, from kinks, inside a domain that starts near or above 0 (log, sqrt,
/// log1p), away from a pole at 0 (recip); else standard normal values.
fn unary_vals(op: UnaryOp) -> Vals {
    let d = op.domain();
    if matches!(op.vjp(), Vjp::Zero) {
        Vals::AwayFromInt
    } else if d.lo > -1.0 {
        Vals::Positive
    } else if d.avoid > 0.0 {
        Vals::AwayFromZero
    } else if !d.kinks.is_empty() {
        Vals::AwayFrom(d.kinks)
    } else {
        Vals::Normal
    }
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
    c.extend(device_cases::<B>());
    c
}

/// The unary ops of [`UnaryOp::ALL`], each on its own input domain.
fn unary_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- unary ----
    for op in UnaryOp::ALL {
        let vals = unary_vals(op);
        c.push((
            format!("unary/{}", op.name()),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                prop(cfg, input_of(dims(0, 3)), |x| {
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| v[0].unary(op))
                })
            }),
        ));
    }
    c
}

/// The composite ops of [`CompositeOp::ALL`], with the table's test parameters.
fn composite_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- composite ops (scalar parameters) ----
    for &op in CompositeOp::ALL {
        let d = op.domain();
        let vals = if d.kinks.is_empty() {
            Vals::Normal
        } else {
            Vals::AwayFrom(d.kinks)
        };
        c.push((
            format!("composite/{}", op.name()),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                prop(cfg, input_of(dims(0, 3)), |x| {
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| {
                        v[0].composite(op, op.test_params())
                    })
                })
            }),
        ));
    }
    c
}

/// Elementwise binary ops: two variables broadcasting, a variable against a scalar on either side, and `clamp`.
fn binary_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- binary with broadcasting ----
    for op in BinaryOp::ALL {
        let (va, vb) = match op {
            BinaryOp::Div => (Vals::Normal, Vals::AwayFromZero),
            BinaryOp::Pow => (Vals::Positive, Vals::Normal),
            BinaryOp::Maximum | BinaryOp::Minimum => {
                (Vals::Grid { odd: true }, Vals::Grid { odd: false })
            }
            _ => (Vals::Normal, Vals::Normal),
        };
        c.push((
            format!("binary/{}", op.name()),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s =
                    (bcast_pair(), lay(), lay(), any::<u64>()).prop_map(|((a, b), la, lb, s)| {
                        (
                            In {
                                dims: a,
                                lay: la,
                                seed: s,
                            },
                            In {
                                dims: b,
                                lay: lb,
                                seed: s.wrapping_add(1),
                            },
                        )
                    });
                prop(cfg, s, |(a, b)| {
                    let ins = [a.build::<B>(va, dev)?, b.build::<B>(vb, dev)?];
                    check(cfg, &ins, |v| v[0].binary(op, &v[1]))
                })
            }),
        ));
    }

    // ---- scalar ops, both sides ----
    for op in BinaryOp::ALL {
        for scalar_lhs in [false, true] {
            let (vals, k) = match (op, scalar_lhs) {
                (BinaryOp::Div, true) => (Vals::AwayFromZero, 1.7),
                (BinaryOp::Div, false) => (Vals::Normal, -1.7),
                (BinaryOp::Pow, false) => (Vals::Positive, 2.5),
                (BinaryOp::Pow, true) => (Vals::Normal, 1.7),
                (BinaryOp::Maximum | BinaryOp::Minimum, _) => (Vals::Grid { odd: true }, 0.1),
                (BinaryOp::Mul, _) => (Vals::Normal, -1.3),
                _ => (Vals::Normal, 0.7),
            };
            let side = if scalar_lhs { "c_op_x" } else { "x_op_c" };
            c.push((
                format!("scalar/{}/{side}", op.name()),
                Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                    prop(cfg, input_of(dims(0, 3)), |x| {
                        check(cfg, &[x.build::<B>(vals, dev)?], |v| {
                            if scalar_lhs {
                                v[0].scalar_binary(op, k)
                            } else {
                                v[0].binary_scalar(op, k)
                            }
                        })
                    })
                }),
            ));
        }
    }

    c.push((
        "clamp".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 3)), |x| {
                check(cfg, &[x.build::<B>(Vals::Grid { odd: true }, dev)?], |v| {
                    v[0].clamp(-0.3, 0.4)
                })
            })
        }),
    ));
    c
}

/// Reductions over chosen axes and over all axes.
fn reduction_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- reductions ----
    for name in ["sum", "mean", "max", "min"] {
        let vals = if matches!(name, "max" | "min") {
            Vals::Distinct
        } else {
            Vals::Normal
        };
        c.push((
            format!("reduce/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (input_of(dims(1, 4)), vec(any::<bool>(), 4), any::<bool>());
                prop(cfg, s, |(x, mask, keepdim)| {
                    let axes = axes_of(x.dims.len(), &mask);
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| match name {
                        "sum" => v[0].sum(&axes, keepdim),
                        "mean" => v[0].mean(&axes, keepdim),
                        "max" => v[0].max(&axes, keepdim),
                        _ => v[0].min(&axes, keepdim),
                    })
                })
            }),
        ));
        c.push((
            format!("reduce/{name}_all"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                prop(cfg, input_of(dims(0, 3)), |x| {
                    check(cfg, &[x.build::<B>(vals, dev)?], |v| match name {
                        "sum" => v[0].sum_all(),
                        "mean" => v[0].mean_all(),
                        "max" => v[0].max_all(),
                        _ => v[0].min_all(),
                    })
                })
            }),
        ));
    }
    for name in ["max_dim", "min_dim"] {
        c.push((
            format!("reduce/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = (input_of(dims(1, 3)), 0usize..3, any::<bool>());
                prop(cfg, s, |(x, axis, keepdim)| {
                    let dim = (axis % x.dims.len()) as isize;
                    check(cfg, &[x.build::<B>(Vals::Distinct, dev)?], |v| {
                        let (y, _) = if name == "max_dim" {
                            v[0].max_dim(dim, keepdim)?
                        } else {
                            v[0].min_dim(dim, keepdim)?
                        };
                        Ok(y)
                    })
                })
            }),
        ));
    }
    c
}

/// Matrix products and `linear`.
fn matmul_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- matmul ----
    c.push((
        "matmul".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                0usize..8,
                1usize..=4,
                1usize..=4,
                1usize..=4,
                1usize..=3,
                1usize..=3,
            );
            let s = (s, lay(), lay(), any::<u64>()).prop_map(
                |((kind, m, k, n, b, c), la, lb, seed)| {
                    let (a, bb): (Vec<usize>, Vec<usize>) = match kind {
                        0 => (vec![m, k], vec![k, n]),
                        1 => (vec![b, m, k], vec![b, k, n]),
                        2 => (vec![b, 1, m, k], vec![c, k, n]), // broadcast batch
                        3 => (vec![k], vec![k, n]),             // vector @ matrix
                        4 => (vec![m, k], vec![k]),             // matrix @ vector
                        5 => (vec![k], vec![k]),                // dot
                        6 => (vec![m, k], vec![b, k, n]),       // matrix @ batch
                        _ => (vec![b, m, k], vec![k]),          // batch @ vector
                    };
                    (
                        In {
                            dims: a,
                            lay: la,
                            seed,
                        },
                        In {
                            dims: bb,
                            lay: lb,
                            seed: seed.wrapping_add(1),
                        },
                    )
                },
            );
            prop(cfg, s, |(a, b)| {
                let ins = [
                    a.build::<B>(Vals::Normal, dev)?,
                    b.build::<B>(Vals::Normal, dev)?,
                ];
                check(cfg, &ins, |v| v[0].matmul(&v[1]))
            })
        }),
    ));

    // ---- linear: x · wᵀ + b with x of rank 1 to 3, with and without a bias ----
    c.push((
        "linear".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (0usize..3, 1usize..=3, 1usize..=4, 1usize..=4, any::<bool>());
            let s = (s, lay(), lay(), any::<u64>()).prop_map(
                |((lead, b, i, o, bias), lx, lw, seed)| {
                    let mut xd = vec![b; lead];
                    xd.push(i);
                    let x = In {
                        dims: xd,
                        lay: lx,
                        seed,
                    };
                    let w = In {
                        dims: vec![o, i],
                        lay: lw,
                        seed: seed.wrapping_add(1),
                    };
                    let bias = bias.then_some(In {
                        dims: vec![o],
                        lay: Lay::Contiguous,
                        seed: seed.wrapping_add(2),
                    });
                    (x, w, bias)
                },
            );
            prop(cfg, s, |(x, w, bias)| {
                let mut ins = vec![
                    x.build::<B>(Vals::Normal, dev)?,
                    w.build::<B>(Vals::Normal, dev)?,
                ];
                if let Some(b) = &bias {
                    ins.push(b.build::<B>(Vals::Normal, dev)?);
                }
                check(cfg, &ins, |v| v[0].linear(&v[1], v.get(2)))
            })
        }),
    ));
    c
}

/// Views (reshape, transpose, narrow, broadcast, ...).
fn view_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- views ----
    c.push((
        "view/reshape".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 4)), |x| {
                let mut to = x.dims.clone();
                to.reverse();
                to.insert(0, 1);
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].reshape(to.clone())
                })
            })
        }),
    ));
    c.push((
        "view/flatten".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, (input_of(dims(1, 4)), 0usize..4), |(x, start)| {
                let start = (start % x.dims.len()) as isize;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].flatten_from(start)?.flatten_all()
                })
            })
        }),
    ));
    c.push((
        "view/transpose".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(
                cfg,
                (input_of(dims(1, 4)), 0usize..4, 0usize..4),
                |(x, a, b)| {
                    let r = x.dims.len();
                    let (a, b) = ((a % r) as isize, -1 - (b % r) as isize);
                    check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                        v[0].transpose(a, b)
                    })
                },
            )
        }),
    ));
    c.push((
        "view/t".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(2, 4)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| v[0].t())
            })
        }),
    ));
    c.push((
        "view/permute".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = input_of(dims(1, 4)).prop_flat_map(|x| {
                let r = x.dims.len();
                (Just(x), Just((0..r).collect::<Vec<usize>>()).prop_shuffle())
            });
            prop(cfg, s, |(x, perm)| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].permute(&perm)
                })
            })
        }),
    ));
    c.push((
        "view/narrow".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 4)), 0usize..4, 0usize..4, 0usize..4);
            prop(cfg, s, |(x, axis, start, len)| {
                let axis = axis % x.dims.len();
                let d = x.dims[axis];
                let start = start % d;
                let len = 1 + len % (d - start);
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].narrow(axis as isize, start, len)
                })
            })
        }),
    ));
    c.push((
        "view/broadcast_to".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (bcast_pair(), lay(), any::<u64>());
            prop(cfg, s, |((a, b), l, seed)| {
                let (small, full) = if a.len() <= b.len()
                    && a.iter().product::<usize>() <= b.iter().product::<usize>()
                {
                    (a, b)
                } else {
                    (b, a)
                };
                let x = In {
                    dims: small,
                    lay: l,
                    seed,
                };
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].broadcast_to(full.clone())
                })
            })
        }),
    ));
    c.push((
        "view/squeeze_unsqueeze".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(0, 3)), 0usize..4);
            prop(cfg, s, |(x, axis)| {
                let axis = (axis % (x.dims.len() + 1)) as isize;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].unsqueeze(axis)?.exp()?.squeeze(axis)
                })
            })
        }),
    ));
    c.push((
        "view/contiguous".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 4)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].contiguous()
                })
            })
        }),
    ));
    c
}

/// Joins (cat, stack) and `slice_assign`.
fn join_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- joins ----
    c.push((
        "cat".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                dims(1, 3),
                0usize..3,
                vec(1usize..=3, 2..=3),
                vec(lay(), 3),
                any::<u64>(),
            );
            prop(cfg, s, |(base, axis, sizes, lays, seed)| {
                let axis = axis % base.len();
                let ins = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &sz)| {
                        let mut d = base.clone();
                        d[axis] = sz;
                        In {
                            dims: d,
                            lay: lays[i],
                            seed: seed.wrapping_add(i as u64),
                        }
                        .build::<B>(Vals::Normal, dev)
                    })
                    .collect::<Result<Vec<_>>>()?;
                check(cfg, &ins, |v| Var::cat(v, axis as isize))
            })
        }),
    ));
    c.push((
        "stack".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                dims(0, 3),
                0usize..4,
                2usize..=3,
                vec(lay(), 3),
                any::<u64>(),
            );
            prop(cfg, s, |(base, axis, count, lays, seed)| {
                let axis = (axis % (base.len() + 1)) as isize;
                let ins = (0..count)
                    .map(|i| {
                        In {
                            dims: base.clone(),
                            lay: lays[i],
                            seed: seed.wrapping_add(i as u64),
                        }
                        .build::<B>(Vals::Normal, dev)
                    })
                    .collect::<Result<Vec<_>>>()?;
                check(cfg, &ins, |v| Var::stack(v, axis))
            })
        }),
    ));

    c.push((
        "slice_assign".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, 0usize..4, 0usize..4, lay());
            prop(cfg, s, |(x, axis, start, len, sl)| {
                let axis = axis % x.dims.len();
                let d = x.dims[axis];
                let start = start % d;
                let len = 1 + len % (d - start);
                let mut sdims = x.dims.clone();
                sdims[axis] = len;
                let src = In {
                    dims: sdims,
                    lay: sl,
                    seed: x.seed.wrapping_add(3),
                };
                let ins = [
                    x.build::<B>(Vals::Normal, dev)?,
                    src.build::<B>(Vals::Normal, dev)?,
                ];
                check(cfg, &ins, |v| {
                    v[0].slice_assign(axis as isize, start, &v[1])
                })
            })
        }),
    ));
    c
}

/// Index ops (`index_select`, `gather`, `scatter_add`) and `where`.
fn index_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- indexing ----
    c.push((
        "index_select".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, 1usize..=6);
            prop(cfg, s, |(x, axis, n)| {
                let axis = axis % x.dims.len();
                let idx = ids::<B>(&[n], x.dims[axis], x.seed, dev)?;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].index_select(axis as isize, &idx)
                })
            })
        }),
    ));
    c.push((
        "gather".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, vec(1usize..=4, 3));
            prop(cfg, s, |(x, axis, want)| {
                let axis = axis % x.dims.len();
                let idims: Vec<usize> = (0..x.dims.len())
                    .map(|i| {
                        if i == axis {
                            want[i]
                        } else {
                            want[i].min(x.dims[i])
                        }
                    })
                    .collect();
                let idx = ids::<B>(&idims, x.dims[axis], x.seed, dev)?;
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].gather(axis as isize, &idx)
                })
            })
        }),
    ));
    c.push((
        "scatter_add".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(dims(1, 3)), 0usize..3, vec(1usize..=4, 3), lay());
            prop(cfg, s, |(x, axis, want, sl)| {
                let axis = axis % x.dims.len();
                let sdims: Vec<usize> = (0..x.dims.len())
                    .map(|i| {
                        if i == axis {
                            want[i]
                        } else {
                            want[i].min(x.dims[i])
                        }
                    })
                    .collect();
                let idx = ids::<B>(&sdims, x.dims[axis], x.seed, dev)?;
                let src = In {
                    dims: sdims,
                    lay: sl,
                    seed: x.seed.wrapping_add(7),
                };
                let ins = [
                    x.build::<B>(Vals::Normal, dev)?,
                    src.build::<B>(Vals::Normal, dev)?,
                ];
                check(cfg, &ins, |v| v[0].scatter_add(axis as isize, &idx, &v[1]))
            })
        }),
    ));
    c.push((
        "where".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (bcast_pair(), lay(), lay(), any::<u64>());
            prop(cfg, s, |((a, b), la, lb, seed)| {
                let ta = In {
                    dims: a.clone(),
                    lay: la,
                    seed,
                }
                .build::<B>(Vals::Normal, dev)?;
                let tb = In {
                    dims: b,
                    lay: lb,
                    seed: seed.wrapping_add(1),
                }
                .build::<B>(Vals::Normal, dev)?;
                // A condition of a's shape (which broadcasts with b's).
                let cond = ids::<B>(&a, 2, seed, dev)?.to_dtype(DType::U8)?;
                check(cfg, &[ta, tb], |v| Var::where_cond(&cond, &v[0], &v[1]))
            })
        }),
    ));
    c
}

/// Softmax, log-softmax and the cross-entropy losses.
fn loss_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- softmax and losses ----
    for log in [false, true] {
        c.push((
            if log { "log_softmax" } else { "softmax" }.into(),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                // Any axis, counted from either end (`dim` in `-rank..rank`).
                let s = (input_of(dims(1, 3)), 0usize..3, any::<bool>());
                prop(cfg, s, |(x, axis, negative)| {
                    let r = x.dims.len() as isize;
                    let dim = (axis as isize % r) - if negative { r } else { 0 };
                    check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                        if log {
                            v[0].log_softmax(dim)
                        } else {
                            v[0].softmax(dim)
                        }
                    })
                })
            }),
        ));
    }
    for (name, reduction) in [
        ("none", Reduction::None),
        ("mean", Reduction::Mean),
        ("sum", Reduction::Sum),
    ] {
        c.push((
            format!("cross_entropy/{name}"),
            Box::new(move |dev: &B::Device, cfg: &SuiteConfig| {
                let s = input_of(vec(1usize..=5, 2..=2));
                prop(cfg, s, |x| {
                    let labels = ids::<B>(&x.dims[..1], x.dims[1], x.seed, dev)?;
                    check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                        v[0].cross_entropy(&labels, reduction)
                    })
                })
            }),
        ));
    }
    c
}

/// Copies between devices, and compositions of several ops.
fn device_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- devices ----
    c.push((
        "copy_to".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let other = B::devices()
                .into_iter()
                .find(|d| d != dev)
                .unwrap_or_else(|| dev.clone());
            prop(cfg, input_of(dims(0, 3)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].copy_to(&other)?.tanh()?.to_device(dev)
                })
            })
        }),
    ));

    // ---- compositions ----
    c.push((
        "composite/reuse".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 3)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    let x = &v[0];
                    x.mul(x)?.add(&x.exp()?.mul(x)?)?.sub(&x.sin()?)
                })
            })
        }),
    ));
    c.push((
        "composite/logreg".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (1usize..=6, 1usize..=5, lay(), any::<u64>());
            prop(cfg, s, |(n, f, lx, seed)| {
                let x = In {
                    dims: vec![n, f],
                    lay: lx,
                    seed,
                }
                .build::<B>(Vals::Normal, dev)?;
                let y = ids::<B>(&[n], 2, seed, dev)?.to_dtype(DType::F64)?;
                let w = In {
                    dims: vec![f],
                    lay: Lay::Contiguous,
                    seed: seed.wrapping_add(1),
                }
                .build::<B>(Vals::Normal, dev)?;
                let b = Tensor::<B>::zeros([], DType::F64, dev)?;
                check(cfg, &[x, w, b], |v| {
                    let y = Var::constant(y.to_dtype(v[0].dtype())?);
                    let p = v[0].matmul(&v[1])?.add(&v[2])?.sigmoid()?;
                    let xent = y.neg()?.mul(&p.log()?)?.sub(
                        &y.scalar_binary(BinaryOp::Sub, 1.0)?
                            .mul(&p.scalar_binary(BinaryOp::Sub, 1.0)?.log()?)?,
                    )?;
                    xent.mean_all()?
                        .add(&v[1].square()?.sum_all()?.mul_scalar(0.01)?)
                })
            })
        }),
    ));
    c
}
