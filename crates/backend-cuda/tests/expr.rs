//! The fused CUDA evaluator of expression programs (`Backend::eval_expr` on CUDA,
//! `src/expr_eval.rs` + `src/codegen/`) against the op-by-op evaluation of the same program
//! on the same GPU (`kiln_core::expr::eval_composed::<Cuda>`: the single-op kernels, which
//! call the same scalar device functions) for random expression trees over broadcast,
//! transposed and sliced inputs, with and without axis reductions; and fixed programs against
//! the CPU backend.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice, clear_kernel_cache, gpu_or_skip};
use kiln_core::expr::{Combine, Expr, Program, eval_composed};
use kiln_core::testing::check_close as close;
use kiln_core::testing::expr::{Input, Tree, input, shape, tree};
use kiln_core::{
    Backend, BinaryOp, CmpOp, DType, Error, ExprErrorKind, Generator, Layout, RandDist, Shape,
    Tensor, UnaryOp, Vjp,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

type G = Tensor<Cuda>;

/// Tolerances for a program of `dtype` built from `t`: f64's unless some part runs in f32.
fn tolerance(t: &Tree, f64_: bool, f32_tol: (f64, f64)) -> (f64, f64) {
    match (f64_, t.has_cast()) {
        (true, false) => (1e-9, 1e-9),
        (true, true) => (1e-6, 1e-6),
        (false, _) => f32_tol,
    }
}

/// The unary ops the random trees draw from, read from the op table: every op on both float
/// dtypes whose derivative is not zero everywhere (not floor, ceil or sign): a
/// piecewise-constant op would turn a last-bit difference between the fused and the op-by-op
/// evaluation into a different value. (Generated kernels compile with `--fmad=false`, so none
/// is expected; `tests/tier.rs` compares bits with every op.)
/// Every op, those included, is in the fixed programs of `every_op_and_dtype_matches_the_cpu`.
fn tree_ops() -> Vec<UnaryOp> {
    UnaryOp::ALL
        .into_iter()
        .filter(|op| !matches!(op.vjp(), Vjp::Zero))
        .filter(|op| op.supports(DType::F32) && op.supports(DType::F64))
        .collect()
}

/// Input `spec` on the GPU: random values made on the CPU, uploaded, then viewed.
fn make(dev: &CudaDevice, spec: &Input, shape: &[usize], dtype: DType) -> G {
    spec.make(shape, |d| {
        let c = Generator::new(spec.seed)
            .sample::<Cpu>(
                d.clone(),
                RandDist::Uniform {
                    low: -2.0,
                    high: 2.0,
                },
                dtype,
                &Cpu::device(0),
            )
            .unwrap();
        G::from_host(&c.to_host().unwrap(), d, dev).unwrap()
    })
}

fn values<B: Backend>(t: &Tensor<B>) -> Vec<f64> {
    t.to_host().unwrap().to_f64_vec()
}

/// Runs `p` fused and op by op (both on the GPU) and compares every output.
fn compare(
    dev: &CudaDevice,
    p: &Program,
    xs: &[G],
    params: &[f64],
    atol: f64,
    rtol: f64,
) -> Result<(), TestCaseError> {
    let refs: Vec<&G> = xs.iter().collect();
    let fused = p
        .run(&refs, params)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut shape = xs[0].shape().clone();
    for x in xs {
        shape = shape.broadcast_with("t", x.shape()).unwrap();
    }
    let layouts: Vec<Layout> = xs
        .iter()
        .map(|x| x.layout().broadcast_to(&shape).unwrap())
        .collect();
    let args: Vec<(&<Cuda as Backend>::Storage, &Layout)> = xs
        .iter()
        .zip(&layouts)
        .map(|(x, l)| (x.storage(), l))
        .collect();
    let composed = eval_composed::<Cuda>(dev, p, &shape, &args, params)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (j, (f, c)) in fused.iter().zip(composed).enumerate() {
        let c = G::from_storage(c, f.shape().clone(), f.dtype());
        close(&values(f), &values(&c), atol, rtol)
            .map_err(|m| TestCaseError::fail(format!("output {j}: {m}\nprogram:\n{p}")))?;
    }
    Ok(())
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Runs `cases` cases of `strategy()` spread over four threads, each with its own runner (and
/// random seed): every case compiles a new program, and NVRTC then compiles on four cores.
/// Panics with a failing case of any thread.
fn spread<S: Strategy>(
    cases: u32,
    strategy: impl Fn() -> S + Sync,
    test: impl Fn(S::Value) -> Result<(), TestCaseError> + Sync,
) {
    const THREADS: u32 = 4;
    let failures: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    (runner(cases / THREADS).run(&strategy(), &test)).map_err(|e| e.to_string())
                })
            })
            .collect();
        (runs.into_iter())
            .filter_map(|r| r.join().expect("a case thread panicked").err())
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Elementwise programs: two outputs (the tree and a second use of its inputs).
#[test]
fn elementwise_trees_match_op_by_op() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let strategy = || {
        (
            tree(3, &tree_ops()),
            shape(),
            prop::collection::vec(input(3), 3),
            any::<bool>(),
            -2.0f64..2.0,
        )
    };
    spread(160, strategy, |(t, shp, ins, f64_, param)| {
        let dtype = if f64_ { DType::F64 } else { DType::F32 };
        let other = if f64_ { DType::F32 } else { DType::F64 };
        let rank = shp.len();
        let xs: Vec<G> = ins
            .iter()
            .map(|i| {
                let mut i = i.clone();
                i.ones.resize(rank, false);
                i.drop = i.drop.min(rank);
                make(&dev, &i, &shp, dtype)
            })
            .collect();
        let e = t.build(dtype, other);
        let second = Expr::input(0) * 2.0 - Expr::input(1);
        let p = Program::from_exprs(&[dtype; 3], &[e, second]).unwrap();
        let params: Vec<f64> = (0..p.params().len()).map(|_| param).collect();
        let (atol, rtol) = tolerance(&t, f64_, (1e-4, 1e-4));
        compare(&dev, &p, &xs, &params, atol, rtol)
    });
}

/// Reductions over random axes with a post-map; also an elementwise output of the same pass.
#[test]
fn reductions_match_op_by_op() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let strategy = || {
        (
            tree(2, &tree_ops()),
            shape().prop_filter("rank >= 1", |s| !s.is_empty()),
            prop::collection::vec(input(3), 2),
            prop::collection::vec(any::<bool>(), 3),
            prop::sample::select(Combine::ALL.to_vec()),
            any::<bool>(),
            any::<bool>(),
        )
    };
    spread(
        160,
        strategy,
        |(t, shp, ins, axes_mask, combine, f64_, with_elem)| {
            let dtype = if f64_ { DType::F64 } else { DType::F32 };
            let other = if f64_ { DType::F32 } else { DType::F64 };
            let rank = shp.len();
            let mut axes: Vec<isize> = (0..rank)
                .filter(|&a| axes_mask[a])
                .map(|a| a as isize)
                .collect();
            if axes.is_empty() {
                axes.push(-1);
            }
            // Long products overflow in one order and not in another: keep them short.
            let big = shp.iter().product::<usize>() > 4096;
            prop_assume!(!(combine == Combine::Prod && big));
            let empty_fold = axes
                .iter()
                .any(|&a| shp[(a + rank as isize) as usize % rank] == 0);
            prop_assume!(!(empty_fold && matches!(combine, Combine::Max | Combine::Min)));
            let xs: Vec<G> = ins
                .iter()
                .enumerate()
                .map(|(k, i)| {
                    let mut i = i.clone();
                    i.ones.resize(rank, false);
                    i.drop = i.drop.min(rank);
                    if k == 1 {
                        // input 1 has the iteration shape itself
                        i.drop = 0;
                        i.ones = vec![false; rank];
                    }
                    make(&dev, &i, &shp, dtype)
                })
                .collect();
            // Bounded map values, so that sums in another order stay close.
            let body = t.build(dtype, other).tanh() * 1.5 + Expr::input(1);
            let red = body.reduce(combine, &axes);
            let post = (&red * 0.5).abs() + Expr::param(0);
            let mut outs = vec![post, red];
            if with_elem {
                outs.push(body.sigmoid());
            }
            let p = Program::from_exprs(&[dtype; 2], &outs).unwrap();
            let params = vec![0.25; p.params().len()];
            let (atol, rtol) = tolerance(&t, f64_, (1e-3, 1e-4));
            compare(&dev, &p, &xs, &params, atol, rtol)
        },
    );
}

/// Uploads a CPU tensor.
fn up(dev: &CudaDevice, c: &Tensor<Cpu>) -> G {
    G::from_host(&c.to_host().unwrap(), c.shape().clone(), dev).unwrap()
}

/// Runs `p` on the GPU (inputs uploaded, then viewed by `view`) and on the CPU, and compares.
fn against_cpu(
    dev: &CudaDevice,
    p: &Program,
    xs: &[Tensor<Cpu>],
    view: impl Fn(usize, G) -> G,
    cpu_view: impl Fn(usize, Tensor<Cpu>) -> Tensor<Cpu>,
    params: &[f64],
    rtol: f64,
) {
    let g: Vec<G> = xs
        .iter()
        .enumerate()
        .map(|(k, x)| view(k, up(dev, x)))
        .collect();
    let c: Vec<Tensor<Cpu>> = xs
        .iter()
        .enumerate()
        .map(|(k, x)| cpu_view(k, x.clone()))
        .collect();
    let gr: Vec<&G> = g.iter().collect();
    let cr: Vec<&Tensor<Cpu>> = c.iter().collect();
    let got = p.run(&gr, params).unwrap();
    let want = p.run(&cr, params).unwrap();
    assert_eq!(got.len(), want.len());
    for (j, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.shape(), b.shape(), "output {j}");
        assert_eq!(a.dtype(), b.dtype(), "output {j}");
        close(&values(a), &values(b), rtol, rtol)
            .unwrap_or_else(|m| panic!("output {j}: {m}\nprogram:\n{p}"));
    }
}

fn rand_cpu(dims: &[usize], seed: u64, dtype: DType) -> Tensor<Cpu> {
    Generator::new(seed)
        .sample::<Cpu>(
            dims.to_vec(),
            RandDist::Uniform {
                low: -3.0,
                high: 3.0,
            },
            dtype,
            &Cpu::device(0),
        )
        .unwrap()
}

/// A row-wise log-sum-exp (one block per row) with the softmax as an elementwise output of the
/// same pass, on f32 and f64, against the CPU.
#[test]
fn log_sum_exp_rows_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dtype, rtol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
        let x = rand_cpu(&[37, 3001], 1, dtype);
        let m = x.max(&[-1], true).unwrap();
        let (xe, me) = (Expr::input(0), Expr::input(1));
        let e = (&xe - &me).exp();
        let lse = e.sum(&[-1]).log() + &me;
        let p = Program::from_exprs(&[dtype, dtype], &[lse, e.sigmoid()]).unwrap();
        against_cpu(&dev, &p, &[x, m], |_, t| t, |_, t| t, &[], rtol);
    }
}

/// Column sums and maxima of a transposed input (strided fold), short rows (one thread per
/// kept element) and a reduction over two axes of three, each with a post-map and a parameter.
#[test]
fn axis_reductions_of_views_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Expr::input(0);
    for dtype in [DType::F32, DType::F64] {
        let rtol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        for axes in [vec![0isize], vec![1], vec![0, 1]] {
            for c in Combine::ALL {
                let red = x.tanh().reduce(c, &axes);
                let p =
                    Program::from_exprs(&[dtype], &[(&red * Expr::param(0)).exp(), red]).unwrap();
                // a [300, 7] view of a [7, 300] tensor
                let t = rand_cpu(&[7, 300], 3, dtype);
                let tr = |_: usize, v: G| v.permute(&[1, 0]).unwrap();
                let trc = |_: usize, v: Tensor<Cpu>| v.permute(&[1, 0]).unwrap();
                let rt = if c == Combine::Prod { 1e-3 } else { rtol };
                against_cpu(&dev, &p, std::slice::from_ref(&t), tr, trc, &[0.5], rt);
            }
        }
        // three axes, reducing the first and last of a sliced input
        let big = rand_cpu(&[6, 5, 70], 4, dtype);
        let sl = |_: usize, v: G| v.narrow(2, 3, 64).unwrap();
        let slc = |_: usize, v: Tensor<Cpu>| v.narrow(2, 3, 64).unwrap();
        let p = Program::from_exprs(&[dtype], &[x.square().sum(&[0, 2]).sqrt()]).unwrap();
        against_cpu(&dev, &p, std::slice::from_ref(&big), sl, slc, &[], rtol);
    }
}

/// Long reductions of few kept elements are split over many blocks (`Strategy::Split`: two
/// launches, the partials folded in order): a norm and a max of a whole 4M-element tensor with
/// an elementwise output, and three long rows of a transposed input with a post-map and a
/// parameter, on f32 and f64, against the CPU; the split result is the same on every run.
#[test]
fn long_reductions_split_over_blocks_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Expr::input(0);
    for (dtype, rtol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
        let t = rand_cpu(&[2048, 2048], 5, dtype);
        let norm = x.square().sum(&[0, 1]).sqrt();
        let p = Program::from_exprs(&[dtype], &[norm, x.max(&[0, 1]), x.exp()]).unwrap();
        against_cpu(
            &dev,
            &p,
            std::slice::from_ref(&t),
            |_, v| v,
            |_, v| v,
            &[],
            rtol,
        );
        let g = up(&dev, &t);
        g.realize().unwrap();
        let l0 = kiln_backend_cuda::thread_launches();
        let a = p.run(&[&g], &[]).unwrap().remove(0);
        assert_eq!(
            kiln_backend_cuda::thread_launches() - l0,
            2,
            "fold, then finish"
        );
        let b = p.run(&[&g], &[]).unwrap().remove(0);
        assert_eq!(values(&a), values(&b), "the same sum order every run");
        // The same values one element into a buffer (no 16-byte loads): the same bits.
        let pad = Tensor::<Cpu>::zeros([1], dtype, &Cpu::device(0)).unwrap();
        let flat = t.reshape([2048 * 2048]).unwrap();
        let shifted = up(&dev, &Tensor::cat(&[pad, flat], 0).unwrap())
            .narrow(0, 1, 2048 * 2048)
            .unwrap()
            .reshape([2048, 2048])
            .unwrap();
        let c = p.run(&[&shifted], &[]).unwrap().remove(0);
        assert_eq!(
            values(&a),
            values(&c),
            "the same sum order at any alignment"
        );
        // three rows of 2^19 elements, read transposed (a strided fold)
        let r = rand_cpu(&[1 << 19, 3], 6, dtype);
        let rows = (x.tanh().sum(&[-1]) * Expr::param(0)).exp();
        let p = Program::from_exprs(&[dtype], &[rows]).unwrap();
        let tr = |_: usize, v: G| v.permute(&[1, 0]).unwrap();
        let trc = |_: usize, v: Tensor<Cpu>| v.permute(&[1, 0]).unwrap();
        against_cpu(&dev, &p, std::slice::from_ref(&r), tr, trc, &[1e-3], rtol);
        // Just past one block's share (64K): a GPT embedding's 98K-element norm, split too.
        let e = rand_cpu(&[256, 384], 7, dtype);
        let p = Program::from_exprs(&[dtype], &[x.square().sum(&[0, 1])]).unwrap();
        against_cpu(
            &dev,
            &p,
            std::slice::from_ref(&e),
            |_, v| v,
            |_, v| v,
            &[],
            rtol,
        );
        let g = up(&dev, &e);
        g.realize().unwrap();
        let l0 = kiln_backend_cuda::thread_launches();
        p.run(&[&g], &[]).unwrap().remove(0).realize().unwrap();
        assert_eq!(
            kiln_backend_cuda::thread_launches() - l0,
            2,
            "split: two launches"
        );
    }
}

/// `n` values of `dtype` where the op table samples `op` ([`UnaryOp::domain`]): uniform on
/// `[lo, hi]`, pushed out to `avoid` near 0.
fn in_domain(op: UnaryOp, dims: &[usize], seed: u64, dtype: DType) -> Tensor<Cpu> {
    let d = op.domain();
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n as u64)
        .map(|i| kiln_core::philox::uniform_f64(seed, i, d.lo, d.hi))
        .map(|x| {
            if x.abs() < d.avoid {
                d.avoid.copysign(x)
            } else {
                x
            }
        })
        .collect();
    Tensor::<Cpu>::from_vec(v, dims.to_vec(), &Cpu::device(0))
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Every unary op of the table (floor, ceil and sign included) on every dtype it supports and
/// over its test domain, integer and u8 arithmetic, casts, comparisons and `where`, with a
/// broadcast row and a scalar input, against the CPU.
#[test]
fn every_op_and_dtype_matches_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (x, y) = (Expr::input(0), Expr::input(1));
    for dtype in [DType::F32, DType::F64, DType::I64] {
        let rtol = match dtype {
            DType::F32 => 2e-6,
            DType::F64 => 1e-13,
            _ => 0.0,
        };
        // x * y with y in [0.9, 1] (1 for integers) stays in the op's domain.
        let y_row = match dtype {
            DType::I64 => Tensor::<Cpu>::ones([65], dtype, &Cpu::device(0)).unwrap(),
            _ => Generator::new(6)
                .sample::<Cpu>(
                    [65],
                    RandDist::Uniform {
                        low: 0.9,
                        high: 1.0,
                    },
                    dtype,
                    &Cpu::device(0),
                )
                .unwrap(),
        };
        for u in UnaryOp::ALL.into_iter().filter(|u| u.supports(dtype)) {
            let xs = [in_domain(u, &[33, 65], 5, dtype), y_row.clone()];
            let p = Program::from_exprs(&[dtype, dtype], &[(&x * &y).unary(u)]).unwrap();
            against_cpu(&dev, &p, &xs, |_, t| t, |_, t| t, &[], rtol);
        }
        if dtype == DType::I64 {
            continue;
        }
        let xs = [rand_cpu(&[33, 65], 5, dtype), rand_cpu(&[65], 6, dtype)];
        for b in BinaryOp::ALL {
            let p = Program::from_exprs(&[dtype, dtype], &[x.binary(b, y.abs() + 0.5)]).unwrap();
            against_cpu(&dev, &p, &xs, |_, t| t, |_, t| t, &[], rtol);
        }
        for c in CmpOp::ALL {
            let mask = x.compare(c, &y);
            let p = Program::from_exprs(
                &[dtype, dtype],
                &[mask.where_cond(&x, Expr::param(0)), mask],
            )
            .unwrap();
            against_cpu(&dev, &p, &xs, |_, t| t, |_, t| t, &[-0.75], rtol);
        }
        // casts to every dtype and back
        for to in [DType::F32, DType::F64, DType::I64, DType::U8] {
            let p =
                Program::from_exprs(&[dtype, dtype], &[(&x * 40.0).to_dtype(to), y.to_dtype(to)])
                    .unwrap();
            against_cpu(&dev, &p, &xs, |_, t| t, |_, t| t, &[], rtol);
        }
    }
    // i64 arithmetic (wrapping, division by zero gives 0) and u8 maximum, with a sum
    let xi = rand_cpu(&[40, 50], 7, DType::F64)
        .mul_scalar(1e6)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap();
    let yi = rand_cpu(&[50], 8, DType::F64).to_dtype(DType::I64).unwrap();
    let p = Program::from_exprs(
        &[DType::I64, DType::I64],
        &[
            (&x * &y - x.abs()).sum(&[0]),
            (&x / &y).max(&[0]),
            (&x * 3.0).square().sign().min(&[0]),
        ],
    )
    .unwrap();
    against_cpu(
        &dev,
        &p,
        &[xi.clone(), yi.clone()],
        |_, t| t,
        |_, t| t,
        &[],
        0.0,
    );
    let xu = xi.to_dtype(DType::U8).unwrap();
    let yu = yi.to_dtype(DType::U8).unwrap();
    let p = Program::from_exprs(
        &[DType::U8, DType::U8],
        &[x.maximum(&y), x.minimum(&y).max(&[1])],
    )
    .unwrap();
    against_cpu(&dev, &p, &[xu, yu], |_, t| t, |_, t| t, &[], 0.0);
}

/// Inputs that are pending lazy work are computed first; an empty iteration and an empty
/// sum give empty and identity outputs.
#[test]
fn pending_inputs_and_empty_shapes() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Expr::input(0);
    let c = rand_cpu(&[64, 9], 9, DType::F32);
    let g = up(&dev, &c).exp().unwrap(); // pending on the GPU
    let p = Program::from_exprs(&[DType::F32], &[x.log().sum(&[1])]).unwrap();
    let got = p.run(&[&g], &[]).unwrap();
    let want = p.run(&[&c.exp().unwrap()], &[]).unwrap();
    close(&values(&got[0]), &values(&want[0]), 1e-5, 1e-5).unwrap();
    let e = up(&dev, &rand_cpu(&[3, 0], 1, DType::F32));
    let p = Program::from_exprs(&[DType::F32], &[x.exp(), (&x + 1.0).sum(&[1]) + 2.0]).unwrap();
    let out = p.run(&[&e], &[]).unwrap();
    assert_eq!(out[0].shape().dims(), &[3, 0]);
    assert_eq!(values(&out[1]), vec![2.0; 3]);
}

/// Bad calls are typed errors, and the device stays usable: the next program runs, also after
/// the kernel cache is cleared.
#[test]
fn bad_calls_are_typed_errors_and_the_device_stays_usable() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Expr::input(0);
    let kind = |e: Error| match e {
        Error::Expr { kind, .. } => kind,
        other => panic!("{other}"),
    };
    let p = Program::from_exprs(&[DType::F32], &[x.exp().sum(&[1])]).unwrap();
    let a = up(&dev, &rand_cpu(&[2, 3], 1, DType::F32));
    let b = up(&dev, &rand_cpu(&[2, 3], 1, DType::F64));
    assert_eq!(kind(p.run(&[&b], &[]).unwrap_err()), ExprErrorKind::DType);
    assert_eq!(
        kind(p.run(&[&a, &a], &[]).unwrap_err()),
        ExprErrorKind::Arity
    );
    let v = up(&dev, &rand_cpu(&[3], 1, DType::F32));
    assert_eq!(kind(p.run(&[&v], &[]).unwrap_err()), ExprErrorKind::Axis);
    let shape = Shape::new([2, 3]);
    let l = Layout::contiguous([3, 2]);
    let e = Cuda::eval_expr(&dev, &p, &shape, &[(a.storage(), &l)], &[]).unwrap_err();
    assert_eq!(kind(e), ExprErrorKind::Shape);
    // a layout reaching past its buffer
    let far = Layout::from_parts(shape.clone(), vec![3, 1], 1 << 20);
    let e = Cuda::eval_expr(&dev, &p, &shape, &[(a.storage(), &far)], &[]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let check = |p: &Program| {
        let s = p.run(&[&a], &[]).unwrap();
        let want = a.exp().unwrap().sum(&[1], true).unwrap();
        close(&values(&s[0]), &values(&want), 1e-6, 1e-6).unwrap();
    };
    check(&p);
    clear_kernel_cache(&dev).unwrap();
    check(&p);
}

#[test]
fn norm_is_one_fused_kernel_and_agrees_with_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let v: Vec<f32> = (0..10_000)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let x = Tensor::<Cuda>::from_slice(&v, [100, 100], &dev).unwrap();
    let want = Tensor::<Cpu>::from_slice(&v, [100, 100], &Cpu::device(0))
        .unwrap()
        .norm()
        .unwrap()
        .to_scalar()
        .unwrap();
    x.norm().unwrap().realize().unwrap();
    let l0 = kiln_backend_cuda::thread_launches();
    let n = x.norm().unwrap();
    n.realize().unwrap();
    assert_eq!(kiln_backend_cuda::thread_launches() - l0, 1, "one kernel");
    let got = n.to_scalar().unwrap();
    assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
    let t = x
        .transpose(0, 1)
        .unwrap()
        .norm()
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!((t - want).abs() <= 1e-5 * want, "{t} vs {want}");
}
