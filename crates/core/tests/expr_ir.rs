//! Tests of the expression IR (`kiln_core::expr`) through its public API on the f64 reference
//! backend (the CPU's fused evaluator has its own property tests in kiln-backend-cpu). They
//! live here rather than in `src/expr` because they need the reference backend, which sits
//! above the IR in kiln-core's module layers.

use kiln_core::expr::*;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{DType, Error, ExprErrorKind, Generator, RandDist, Tensor};

type T = Tensor<Reference>;

fn dev() -> RefDevice {
    RefDevice(0)
}

fn t(v: Vec<f64>, shape: &[usize]) -> T {
    T::from_vec(v, shape.to_vec(), &dev()).unwrap()
}

fn kind(e: Error) -> (&'static str, ExprErrorKind) {
    match e {
        Error::Expr { op, kind, .. } => (op, kind),
        other => panic!("not an expression error: {other}"),
    }
}

#[test]
fn swish_lowers_shares_and_runs() {
    let x = Expr::input(0);
    let y = &x * x.sigmoid() + 1.0;
    let p = Program::from_exprs(&[DType::F64], &[y]).unwrap();
    // input, sigmoid, mul, const, add: the two uses of x are one value.
    assert_eq!(p.code().len(), 5, "{p}");
    let xs = t(vec![-1.0, 0.0, 2.0], &[3]);
    let out = p.run(&[&xs], &[]).unwrap();
    let want: Vec<f64> = [-1.0f64, 0.0, 2.0]
        .iter()
        .map(|&v| v / (1.0 + (-v).exp()) + 1.0)
        .collect();
    let got = out[0].to_vec::<f64>().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-12, "{got:?} {want:?}");
    }
}

#[test]
fn broadcast_reduce_post_map_and_params() {
    // log(sum(exp(x - m), axis 1)) + m with m a [2, 1] input; a parameter scales the result.
    let (x, m) = (Expr::input(0), Expr::input(1));
    let lse = (&x - &m).exp().sum(&[1]).log() + &m;
    let scaled = &lse * Expr::param(0);
    let p =
        Program::from_exprs(&[DType::F64, DType::F64], &[lse, scaled.clone(), x.clone()]).unwrap();
    let xs = t(vec![1.0, 2.0, 3.0, -1.0, 0.0, 4.0], &[2, 3]);
    let ms = t(vec![3.0, 4.0], &[2, 1]);
    let out = p.run(&[&xs, &ms], &[2.0]).unwrap();
    assert_eq!(out[0].dims(), &[2, 1]);
    assert_eq!(out[2].dims(), &[2, 3]);
    let want0 = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
    let got = out[1].to_vec::<f64>().unwrap();
    assert!((got[0] - 2.0 * want0).abs() < 1e-12, "{got:?}");
    assert_eq!(out[2].to_vec::<f64>().unwrap(), xs.to_vec::<f64>().unwrap());
    // prod through the host fold; max over a transposed view
    let pr = Program::from_exprs(&[DType::F64], &[x.prod(&[0]), x.max(&[0])]).unwrap();
    let out = pr.run(&[&xs.t().unwrap()], &[]).unwrap();
    assert_eq!(out[0].to_vec::<f64>().unwrap(), vec![6.0, 0.0]);
    assert_eq!(out[1].to_vec::<f64>().unwrap(), vec![3.0, 4.0]);
}

#[test]
fn typed_errors() {
    let x = Expr::input(0);
    // dtype: exp of i64
    let e = Program::from_exprs(&[DType::I64], &[x.exp()]).unwrap_err();
    assert_eq!(kind(e), ("exp", ExprErrorKind::DType));
    // dtype: f32 + f64
    let e = Program::from_exprs(&[DType::F32, DType::F64], &[&x + Expr::input(1)]).unwrap_err();
    assert_eq!(kind(e), ("add", ExprErrorKind::DType));
    // arity: input 1 of 1
    let e = Program::from_exprs(&[DType::F32], &[Expr::input(1)]).unwrap_err();
    assert_eq!(kind(e).1, ExprErrorKind::Arity);
    // phase: a reduced value plus an elementwise one; two axis sets
    // a post-map may read an input only where it is constant along the reduced axes
    let p = Program::from_exprs(&[DType::F64], &[x.sum(&[0]) + &x]).unwrap();
    let e = p.run(&[&t(vec![1.0; 6], &[2, 3])], &[]).unwrap_err();
    assert_eq!(kind(e), ("expr", ExprErrorKind::Shape));
    let b = t(vec![1.0, 2.0, 3.0], &[1, 3])
        .broadcast_to([2, 3])
        .unwrap();
    assert_eq!(
        p.run(&[&b], &[]).unwrap()[0].to_vec::<f64>().unwrap(),
        vec![3.0, 6.0, 9.0]
    );
    let e = Program::from_exprs(&[DType::F32], &[x.sum(&[0]) + x.max(&[1])]).unwrap_err();
    assert_eq!(kind(e), ("max", ExprErrorKind::Phase));
    let e = Program::from_exprs(&[DType::F32], &[x.sum(&[0]).sum(&[0])]).unwrap_err();
    assert_eq!(kind(e), ("sum", ExprErrorKind::Phase));
    // where needs a u8 condition
    let e = Program::from_exprs(&[DType::F32], &[x.where_cond(1.0, 0.0)]).unwrap_err();
    assert_eq!(kind(e), ("where", ExprErrorKind::DType));
    // structure: a forward reference
    let e = Program::new(
        vec![DType::F32],
        vec![],
        vec![Instr::Unary(kiln_core::UnaryOp::Exp, 1), Instr::Input(0)],
        vec![0],
        vec![],
    )
    .unwrap_err();
    assert_eq!(kind(e), ("exp", ExprErrorKind::Structure));
    // call-time errors: inputs, params, axes, shapes, empty max
    let p = Program::from_exprs(&[DType::F64], &[(&x * Expr::param(0)).max(&[2])]).unwrap();
    let xs = t(vec![1.0; 6], &[2, 3]);
    assert_eq!(
        kind(p.run(&[&xs], &[1.0]).unwrap_err()).1,
        ExprErrorKind::Axis
    );
    assert_eq!(
        kind(p.run(&[&xs], &[]).unwrap_err()).1,
        ExprErrorKind::Arity
    );
    assert_eq!(
        kind(p.run::<Reference>(&[], &[1.0]).unwrap_err()).1,
        ExprErrorKind::Arity
    );
    let p = Program::from_exprs(&[DType::F64, DType::F64], &[&x + Expr::input(1)]).unwrap();
    let ys = t(vec![1.0; 4], &[4]);
    assert_eq!(
        kind(p.run(&[&xs, &ys], &[]).unwrap_err()).1,
        ExprErrorKind::Shape
    );
    let p = Program::from_exprs(&[DType::F64], &[x.max(&[0])]).unwrap();
    let empty = t(vec![], &[0, 3]);
    assert_eq!(
        kind(p.run(&[&empty], &[]).unwrap_err()),
        ("max", ExprErrorKind::Structure)
    );
    let p = Program::from_exprs(&[DType::F64], &[x.sum(&[0])]).unwrap();
    assert_eq!(
        p.run(&[&empty], &[]).unwrap()[0].to_vec::<f64>().unwrap(),
        vec![0.0; 3]
    );
    // a program's own evaluator rejects a wrong dtype
    let f = Program::from_exprs(&[DType::F32], &[x.exp()]).unwrap();
    assert_eq!(
        kind(f.run(&[&xs], &[]).unwrap_err()).1,
        ExprErrorKind::DType
    );
}

#[test]
fn programs_are_keys() {
    let f = |x: Expr| &x * x.sigmoid();
    let a = Program::from_exprs(&[DType::F32], &[f(Expr::input(0))]).unwrap();
    let b = Program::from_exprs(&[DType::F32], &[f(Expr::input(0))]).unwrap();
    let c = Program::from_exprs(&[DType::F64], &[f(Expr::input(0))]).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let mut set = std::collections::HashSet::new();
    set.insert(a);
    assert!(set.contains(&b));
}

/// The fingerprint (what a program hashes to) is a function of the parts, the same when
/// computed from them before building the program, and tells apart programs that differ in
/// one constant, operand, op, dtype, output or axis.
#[test]
fn fingerprints_follow_the_parts() {
    use kiln_core::BinaryOp;
    let sub = |a, b| {
        let code = vec![
            Instr::Input(0),
            Instr::Input(1),
            Instr::Binary(BinaryOp::Sub, a, b),
        ];
        Program::new(vec![DType::F32; 2], vec![], code, vec![2], vec![]).unwrap()
    };
    let x = Expr::input(0);
    let y = Expr::input(1);
    let f32s = [DType::F32, DType::F32];
    let progs = [
        Program::from_exprs(&f32s, &[(&x * &y + 1.0).exp()]).unwrap(),
        Program::from_exprs(&f32s, &[(&x * &y + 2.0).exp()]).unwrap(),
        Program::from_exprs(&f32s, &[(&y * &x + 1.0).exp()]).unwrap(),
        Program::from_exprs(&f32s, &[(&x - &y + 1.0).exp()]).unwrap(),
        Program::from_exprs(&f32s, &[(&x * &y + 1.0).sigmoid()]).unwrap(),
        Program::from_exprs(&[DType::F64; 2], &[(&x * &y + 1.0).exp()]).unwrap(),
        Program::from_exprs(&f32s, &[(&x * &y + 1.0).exp(), x.clone()]).unwrap(),
        Program::from_exprs(&f32s, &[(&x * &y).sum(&[0])]).unwrap(),
        Program::from_exprs(&f32s, &[(&x * &y).sum(&[1])]).unwrap(),
        Program::from_exprs(&f32s, &[(&x * &y).max(&[1])]).unwrap(),
        // the same instructions with one operand order swapped: x - y, then y - x
        sub(0, 1),
        sub(1, 0),
    ];
    for (i, a) in progs.iter().enumerate() {
        let parts = fingerprint(a.inputs(), a.params(), a.code(), a.outputs(), a.axes());
        assert_eq!(parts, a.fingerprint(), "program {i}");
        for (j, b) in progs.iter().enumerate().skip(i + 1) {
            assert_ne!(a.fingerprint(), b.fingerprint(), "programs {i} and {j}");
        }
    }
}

/// The backward program against central differences, on the reference backend.
fn check_grad(exprs: &dyn Fn(&[Expr]) -> Expr, xs: &[T]) {
    let ins: Vec<Expr> = (0..xs.len()).map(Expr::input).collect();
    let p = Program::from_exprs(&vec![DType::F64; xs.len()], &[exprs(&ins)]).unwrap();
    let wrt: Vec<usize> = (0..xs.len()).collect();
    let g = grad::derive(&p, 0, &wrt).unwrap();
    let refs: Vec<&T> = xs.iter().collect();
    let fwd = grad::with_reduced_outputs(&p)
        .unwrap()
        .run(&refs, &[])
        .unwrap();
    let y = &fwd[0];
    let gy = Generator::new(7).randn_like(y).unwrap();
    let mut args: Vec<T> = xs.to_vec();
    args.extend(fwd[1..].iter().cloned());
    if let Some(ties) = &g.ties {
        let a: Vec<&T> = args.iter().collect();
        args.extend(ties.run(&a, &[]).unwrap());
    }
    args.push(gy.clone());
    let a: Vec<&T> = args.iter().collect();
    let mut bparams = vec![];
    if p.reduces() {
        let shape = fwd
            .iter()
            .map(|t| t.shape().clone())
            .fold(xs[0].shape().clone(), |s, t| {
                s.broadcast_with("t", &t).unwrap()
            });
        let shape = xs
            .iter()
            .fold(shape, |s, x| s.broadcast_with("t", x.shape()).unwrap());
        let n: usize = p
            .resolve_axes(&shape)
            .unwrap()
            .iter()
            .map(|&a| shape.dims()[a])
            .product();
        bparams.push(n as f64);
    }
    let grads = g.backward.run(&a, &bparams).unwrap();
    let f = |xs: &[T]| -> f64 {
        let r: Vec<&T> = xs.iter().collect();
        let y = &p.run(&r, &[]).unwrap()[0];
        y.mul(&gy).unwrap().sum_all().unwrap().to_scalar().unwrap()
    };
    for k in 0..xs.len() {
        let d = Generator::new(11 + k as u64).randn_like(&xs[k]).unwrap();
        let shape = xs[k].shape().clone();
        let gk = sum_to_shape(&grads[k], &shape);
        let analytic = gk.mul(&d).unwrap().sum_all().unwrap().to_scalar().unwrap();
        let eps = 1e-6;
        let mut plus = xs.to_vec();
        plus[k] = xs[k].add(&d.mul_scalar(eps).unwrap()).unwrap();
        let mut minus = xs.to_vec();
        minus[k] = xs[k].sub(&d.mul_scalar(eps).unwrap()).unwrap();
        let numeric = (f(&plus) - f(&minus)) / (2.0 * eps);
        assert!(
            (numeric - analytic).abs() < 1e-6 * (1.0 + numeric.abs()),
            "input {k}: numeric {numeric} analytic {analytic}\n{}",
            g.backward
        );
    }
}

/// Sums a gradient of the iteration shape back to `shape` (what autograd's `reduce_to_shape`
/// does).
fn sum_to_shape(g: &T, shape: &kiln_core::Shape) -> T {
    let extra = g.rank() - shape.rank();
    let axes: Vec<isize> = (0..g.rank())
        .filter(|&i| i < extra || (shape.dims()[i - extra] == 1 && g.dims()[i] != 1))
        .map(|i| i as isize)
        .collect();
    let s = if axes.is_empty() {
        g.clone()
    } else {
        g.sum(&axes, true).unwrap()
    };
    s.reshape(shape.clone()).unwrap()
}

#[test]
fn gradients_match_central_differences() {
    let x = Generator::new(1)
        .sample(
            [3, 4],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            DType::F64,
            &dev(),
        )
        .unwrap();
    let y = Generator::new(2)
        .sample(
            [4],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            DType::F64,
            &dev(),
        )
        .unwrap();
    let pos = x.abs().unwrap().add_scalar(0.5).unwrap();
    check_grad(&|e| &e[0] * e[0].sigmoid(), std::slice::from_ref(&x));
    check_grad(
        &|e| (&e[0] * &e[1]).tanh() / (e[1].square() + 1.0) - e[0].gelu(),
        &[x.clone(), y.clone()],
    );
    check_grad(
        &|e| e[0].pow(&e[1]) + (&e[0] + 1.0).log().sqrt() + e[0].recip() * e[1].sin().cos(),
        &[pos.clone(), y.clone()],
    );
    check_grad(
        &|e| e[0].maximum(&e[1]) + e[0].clamp(-0.5, 0.5) + e[1].minimum(0.2).exp(),
        &[x.clone(), y.clone()],
    );
    check_grad(
        &|e| e[0].gt(&e[1]).where_cond(e[0].square(), e[1].abs()),
        &[x.clone(), y.clone()],
    );
    // reductions: log-sum-exp over the last axis, a max over the first, with ties
    check_grad(
        &|e| (&e[0] - &e[1]).exp().sum(&[-1]).log() * 2.0,
        &[x.clone(), y.clone()],
    );
    check_grad(&|e| e[0].max(&[0]) * e[0].sum(&[0]), &[x.t().unwrap()]);
    check_grad(&|e| e[0].min(&[-1]).exp(), &[x.narrow(1, 1, 2).unwrap()]);
    // a post-map that reads an input constant along the reduced axis (log-sum-exp given m)
    let m = x.max(&[1], true).unwrap();
    check_grad(
        &|e| (&e[0] - &e[1]).exp().sum(&[1]).log() + &e[1],
        &[x.clone(), m],
    );
}

#[test]
fn prod_gradient_is_a_typed_error() {
    let x = Expr::input(0);
    let p = Program::from_exprs(&[DType::F64], &[x.prod(&[0])]).unwrap();
    assert_eq!(
        kind(grad::derive(&p, 0, &[0]).unwrap_err()).1,
        ExprErrorKind::Structure
    );
    let p = Program::from_exprs(&[DType::I64], &[x.abs()]).unwrap();
    assert_eq!(
        kind(grad::derive(&p, 0, &[0]).unwrap_err()).1,
        ExprErrorKind::DType
    );
}
