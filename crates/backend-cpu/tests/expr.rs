//! The fused evaluator (`Backend::eval_expr` on the CPU) against the op-by-op evaluation of the
//! same program (`kiln_core::expr::eval_composed::<Cpu>`, one CPU kernel per instruction) and
//! against the f64 reference backend: random expression trees over broadcast, transposed and
//! sliced inputs, with and without axis reductions, in f32 and f64.

use kiln_backend_cpu::Cpu;
use kiln_core::expr::{Combine, Expr, Program, eval_composed};
use kiln_core::testing::check_close as close;
use kiln_core::testing::expr::{Input, input, shape, tree};
use kiln_core::{
    Backend, DType, Error, ExprErrorKind, Generator, Layout, RandDist, Shape, Tensor, UnaryOp,
};
use proptest::prelude::*;

type T = Tensor<Cpu>;

/// Input `spec`'s tensor: random values made on the CPU, then viewed.
fn make(spec: &Input, shape: &[usize], dtype: DType) -> T {
    let dev = Cpu::device(0);
    spec.make(shape, |d| {
        Generator::new(spec.seed)
            .sample(
                d,
                RandDist::Uniform {
                    low: -2.0,
                    high: 2.0,
                },
                dtype,
                &dev,
            )
            .unwrap()
    })
}

fn values(t: &T) -> Vec<f64> {
    t.to_host().unwrap().to_f64_vec()
}

/// Runs `p` fused and op by op (both on the CPU) and compares every output.
fn compare(p: &Program, xs: &[T], params: &[f64], rtol: f64) -> Result<(), TestCaseError> {
    let refs: Vec<&T> = xs.iter().collect();
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
    let args: Vec<(&<Cpu as Backend>::Storage, &Layout)> = xs
        .iter()
        .zip(&layouts)
        .map(|(x, l)| (x.storage(), l))
        .collect();
    let dev = Cpu::device(0);
    let composed = eval_composed::<Cpu>(&dev, p, &shape, &args, params)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (j, (f, c)) in fused.iter().zip(composed).enumerate() {
        let c = T::from_storage(c, f.shape().clone(), f.dtype());
        close(&values(f), &values(&c), 1e-6, rtol)
            .map_err(|m| TestCaseError::fail(format!("output {j}: {m}\nprogram:\n{p}")))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    /// Elementwise programs: two outputs (the tree and a second use of its inputs).
    #[test]
    fn elementwise_trees_match_op_by_op(
        t in tree(3, &UnaryOp::ALL),
        shp in shape(),
        ins in prop::collection::vec(input(3), 3),
        f64_ in any::<bool>(),
        param in -2.0f64..2.0,
    ) {
        let dtype = if f64_ { DType::F64 } else { DType::F32 };
        let other = if f64_ { DType::F32 } else { DType::F64 };
        let rank = shp.len();
        let xs: Vec<T> = ins.iter().map(|i| {
            let mut i = i.clone();
            i.ones.resize(rank, false);
            i.drop = i.drop.min(rank);
            make(&i, &shp, dtype)
        }).collect();
        let e = t.build(dtype, other);
        let second = Expr::input(0) * 2.0 - Expr::input(1);
        let p = Program::from_exprs(&[dtype; 3], &[e, second]).unwrap();
        let params: Vec<f64> = (0..p.params().len()).map(|_| param).collect();
        // Same kernels, same order: only sums may differ, and there are none here.
        compare(&p, &xs, &params, 1e-12)?;
    }

    /// Reductions over random axes with a post-map; also an elementwise output of the same
    /// pass.
    #[test]
    fn reductions_match_op_by_op(
        t in tree(2, &UnaryOp::ALL),
        shp in shape().prop_filter("rank >= 1", |s| !s.is_empty()),
        ins in prop::collection::vec(input(3), 2),
        axes_mask in prop::collection::vec(any::<bool>(), 3),
        combine in prop::sample::select(Combine::ALL.to_vec()),
        f64_ in any::<bool>(),
        with_elem in any::<bool>(),
    ) {
        let dtype = if f64_ { DType::F64 } else { DType::F32 };
        let other = if f64_ { DType::F32 } else { DType::F64 };
        let rank = shp.len();
        let mut axes: Vec<isize> = (0..rank).filter(|&a| axes_mask[a]).map(|a| a as isize).collect();
        if axes.is_empty() {
            axes.push(-1);
        }
        // Long products overflow in one order and not in another: keep them short.
        let big = shp.iter().product::<usize>() > 4096;
        prop_assume!(!(combine == Combine::Prod && big));
        let empty_fold = axes.iter().any(|&a| shp[(a + rank as isize) as usize % rank] == 0);
        prop_assume!(!(empty_fold && matches!(combine, Combine::Max | Combine::Min)));
        let xs: Vec<T> = ins.iter().enumerate().map(|(k, i)| {
            let mut i = i.clone();
            i.ones.resize(rank, false);
            i.drop = i.drop.min(rank);
            if k == 1 {
                // input 1 has the iteration shape itself
                i.drop = 0;
                i.ones = vec![false; rank];
            }
            make(&i, &shp, dtype)
        }).collect();
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
        let rtol = if f64_ { 1e-9 } else { 1e-4 };
        compare(&p, &xs, &params, rtol)?;
    }
}

#[test]
fn agrees_with_the_reference_backend() {
    use kiln_core::reference::{RefDevice, Reference};
    let x = Expr::input(0);
    let m = Expr::input(1);
    let lse = (&x - &m).exp().sum(&[-1]).log() + &m;
    let p = Program::from_exprs(&[DType::F64, DType::F64], &[lse, x.gelu() * x.sigmoid()]).unwrap();
    let dev = Cpu::device(0);
    let xc = Generator::new(5)
        .sample(
            [37, 3001],
            RandDist::Uniform {
                low: -3.0,
                high: 3.0,
            },
            DType::F64,
            &dev,
        )
        .unwrap();
    let mc = xc.max(&[-1], true).unwrap();
    let xr =
        Tensor::<Reference>::from_host(&xc.to_host().unwrap(), [37, 3001], &RefDevice(0)).unwrap();
    let mr =
        Tensor::<Reference>::from_host(&mc.to_host().unwrap(), [37, 1], &RefDevice(0)).unwrap();
    let got = p.run(&[&xc, &mc], &[]).unwrap();
    let want = p.run(&[&xr, &mr], &[]).unwrap();
    for (g, w) in got.iter().zip(&want) {
        close(&values(g), &w.to_host().unwrap().to_f64_vec(), 1e-12, 1e-12).unwrap();
    }
}

#[test]
fn bad_calls_are_typed_errors_and_the_device_stays_usable() {
    let dev = Cpu::device(0);
    let x = Expr::input(0);
    let kind = |e: Error| match e {
        Error::Expr { kind, .. } => kind,
        other => panic!("{other}"),
    };
    let p = Program::from_exprs(&[DType::F32], &[x.exp().sum(&[1])]).unwrap();
    let a = Generator::new(1).rand([2, 3], &dev).unwrap();
    let b = Generator::new(1)
        .sample::<Cpu>(
            [2, 3],
            RandDist::Uniform {
                low: 0.0,
                high: 1.0,
            },
            DType::F64,
            &dev,
        )
        .unwrap();
    assert_eq!(kind(p.run(&[&b], &[]).unwrap_err()), ExprErrorKind::DType);
    assert_eq!(
        kind(p.run(&[&a, &a], &[]).unwrap_err()),
        ExprErrorKind::Arity
    );
    let v = Generator::new(1).rand::<Cpu>([3], &dev).unwrap();
    assert_eq!(kind(p.run(&[&v], &[]).unwrap_err()), ExprErrorKind::Axis);
    // below the tensor layer: a layout that is not the iteration shape, a wrong storage dtype
    let shape = Shape::new([2, 3]);
    let l = Layout::contiguous([3, 2]);
    let e = Cpu::eval_expr(&dev, &p, &shape, &[(a.storage(), &l)], &[]).unwrap_err();
    assert_eq!(kind(e), ExprErrorKind::Shape);
    let e = Cpu::eval_expr(&dev, &p, &shape, &[(b.storage(), b.layout())], &[]).unwrap_err();
    assert_eq!(kind(e), ExprErrorKind::DType);
    // ... and the next program runs
    let s = p.run(&[&a], &[]).unwrap();
    let want = a.exp().unwrap().sum(&[1], true).unwrap();
    close(&values(&s[0]), &values(&want), 1e-6, 1e-6).unwrap();
}

#[test]
fn norm_agrees_with_the_reference() {
    use kiln_core::reference::{RefDevice, Reference};
    let v: Vec<f32> = (0..10_000)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let want: f64 = v
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt();
    let x = Tensor::<Cpu>::from_slice(&v, [100, 100], &Cpu::device(0)).unwrap();
    let got = x.norm().unwrap().to_scalar().unwrap();
    assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
    let r = Tensor::<Reference>::from_slice(&v, [100, 100], &RefDevice(0)).unwrap();
    let want_ref = r.norm().unwrap().to_scalar().unwrap();
    assert!((got - want_ref).abs() <= 1e-5 * want, "{got} vs {want_ref}");
}

/// Scalar tails (ops with a uniform operand computed inside the previous op's loop), the
/// last instruction written a piece at a time and values read by several later ops give the
/// op-by-op bits, signed zeros, infinities
/// and NaN included, in f32 and f64, on one core and across cores.
#[test]
fn scalar_tails_and_pieces_give_the_op_by_op_bits() {
    let dev = Cpu::device(0);
    let specials = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1e-40,
    ];
    let (x, y) = (Expr::input(0), Expr::input(1));
    let exprs = [
        ((&x * &y + 1.0).exp() * 0.5) - &y,
        1.0 - (&x + &y) * 2.0,
        (&x * &y) * 0.0,
        (&x * &y) * -0.0 - 0.0,
        0.0 - (&x - &y),
        x.sqrt() + Expr::param(0) - 3.0,
        (((&x * &y) + 1.0) * 2.0 - 3.0) * 0.25,
        2.0 * x.abs() + 0.0,
        // A value read again after other values were computed: its register must not have
        // been reused in between (`flat.rs`'s register assignment).
        {
            let t = x.sin();
            (&t * &y).exp() + (&t * &x).cos() + &t
        },
        {
            let (s, c) = (x.sin(), y.cos());
            let m = &s * &c;
            ((&m + &s).sqrt() * &c - &m) / (&s + 3.0)
        },
    ];
    for dtype in [DType::F32, DType::F64] {
        for n in [3 * 4096 + 1007, 300_000] {
            let vals = |seed: u64| {
                let r = Generator::new(seed)
                    .sample::<Cpu>(
                        [n],
                        RandDist::Uniform {
                            low: -3.0,
                            high: 3.0,
                        },
                        DType::F64,
                        &dev,
                    )
                    .unwrap();
                let mut v = r.to_vec::<f64>().unwrap();
                for (i, s) in specials.iter().enumerate() {
                    for k in (i * (seed as usize + 1)..n).step_by(97) {
                        v[k] = *s;
                    }
                }
                T::from_slice(&v, [n], &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let xs = [vals(1), vals(2)];
            for e in &exprs {
                let p = Program::from_exprs(&[dtype, dtype], std::slice::from_ref(e)).unwrap();
                let l = Layout::contiguous([n]);
                let args: Vec<(&<Cpu as Backend>::Storage, &Layout)> =
                    xs.iter().map(|x| (x.storage(), &l)).collect();
                let params = vec![0.75; p.params().len()];
                let want =
                    eval_composed::<Cpu>(&dev, &p, &Shape::new([n]), &args, &params).unwrap();
                let want = T::from_storage(want.into_iter().next().unwrap(), [n], dtype);
                let got = p.run(&[&xs[0], &xs[1]], &params).unwrap().remove(0);
                let bits = |t: &T| -> Vec<u64> {
                    let v = t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
                    v.iter()
                        .map(|x| if x.is_nan() { 1 } else { x.to_bits() })
                        .collect()
                };
                let (g, w) = (bits(&got), bits(&want));
                if let Some(i) = (0..n).find(|&i| g[i] != w[i]) {
                    panic!("{dtype} n={n} element {i}: {} vs {}\n{p}", g[i], w[i]);
                }
            }
        }
    }
}

/// On one thread, outputs of 8 MiB and more are written by the steps that compute them, with
/// plain stores (`flat::direct_writes`): the same bits as op by op on two threads, for
/// an output that is only written, one that a later step also reads, and one value named by
/// two outputs.
#[test]
fn one_thread_direct_writes_give_the_op_by_op_bits() {
    let dev = Cpu::device(0);
    let n = (8 << 20) / 4 + 1000;
    let xs = [1, 2].map(|seed| Generator::new(seed).uniform([n], -3.0, 3.0, &dev).unwrap());
    let (x, y) = (Expr::input(0), Expr::input(1));
    let s = x.sin();
    let e = (&x * &y + 1.0).exp();
    let programs = [
        vec![((&x * &y + 1.0).exp() * 0.5) - &y],
        vec![s.clone(), &s * &y + 2.0],
        vec![e.clone(), e],
    ];
    let bits = |t: &T| -> Vec<u32> {
        t.to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| if x.is_nan() { 1 } else { x.to_bits() })
            .collect()
    };
    let pool = |k| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(k)
            .build()
            .unwrap()
    };
    let (one, two) = (pool(1), pool(2));
    let l = Layout::contiguous([n]);
    for outs in &programs {
        let p = Program::from_exprs(&[DType::F32, DType::F32], outs).unwrap();
        // The reference on two threads: streamed outputs, not direct writes.
        let args: Vec<(&<Cpu as Backend>::Storage, &Layout)> =
            xs.iter().map(|x| (x.storage(), &l)).collect();
        let shape = Shape::new([n]);
        let want = two.install(|| eval_composed::<Cpu>(&dev, &p, &shape, &args, &[]).unwrap());
        let got = one.install(|| p.run(&[&xs[0], &xs[1]], &[]).unwrap());
        for (j, (g, w)) in got.iter().zip(want).enumerate() {
            let w = T::from_storage(w, [n], DType::F32);
            assert!(bits(g) == bits(&w), "output {j} of\n{p}");
        }
    }
}

/// Small calls remember their plan per program (`flat.rs`'s `cached`): a plan must serve only
/// calls whose inputs are in the same places. The same program runs, in turn, over a
/// broadcast value that changes, inputs at other offsets, another length, and back; every
/// result is compared with the op-by-op evaluation.
#[test]
fn remembered_plans_serve_only_calls_like_theirs() {
    let dev = Cpu::device(0);
    let (x, y) = (Expr::input(0), Expr::input(1));
    let p = Program::from_exprs(&[DType::F32; 2], &[(x.exp() * &y) - &x]).unwrap();
    let base = T::from_vec(
        (0..600).map(|i| (i as f32 * 0.37).sin()).collect(),
        [600],
        &dev,
    )
    .unwrap();
    let view = |start: usize, len: usize| base.narrow(0, start, len).unwrap();
    let scalar = |v: f32| T::from_vec(vec![v], [1], &dev).unwrap();
    let calls: Vec<(T, T)> = vec![
        (view(0, 300), scalar(2.0)),
        (view(0, 300), scalar(3.0)),
        (view(0, 300), scalar(2.0)),
        (view(7, 300), scalar(2.0)),
        (view(0, 300), view(300, 300)),
        (view(0, 300), view(299, 300)),
        (view(0, 301), scalar(2.0)),
        (view(0, 300), scalar(-1.5)),
    ];
    for round in 0..2 {
        for (k, (a, b)) in calls.iter().enumerate() {
            compare(&p, &[a.clone(), b.clone()], &[], 0.0)
                .unwrap_or_else(|e| panic!("round {round}, call {k}: {e}"));
        }
    }
}
