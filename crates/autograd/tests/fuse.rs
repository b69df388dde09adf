//! Fused user functions on the CPU: forward equal to the same function written with ops,
//! gradients derived from the IR that pass `check_backward` (and equal the op-by-op graph's),
//! broadcast and non-contiguous inputs, reductions, several outputs, typed errors.

use kiln_autograd::{CheckOptions, Var, assert_backward, fuse, fuse_n, fuse2};
use kiln_backend_cpu::Cpu;
use kiln_core::expr::Expr;
use kiln_core::{DType, Error, ExprErrorKind, Generator, RandDist, Tensor};

type T = Tensor<Cpu>;

fn randn(shape: &[usize], seed: u64) -> T {
    Generator::new(seed)
        .sample(
            shape.to_vec(),
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            DType::F64,
            &Cpu::device(0),
        )
        .unwrap()
}

fn assert_close(a: &T, b: &T, tol: f64) {
    assert_eq!(a.shape(), b.shape());
    let (x, y) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    kiln_core::testing::assert_close("tensor", &x, &y, tol);
}

#[test]
fn swish_forward_and_gradient() {
    let swish = fuse(|x| &x * x.sigmoid());
    let x = randn(&[5, 7], 1);
    let want = x.mul(&x.sigmoid().unwrap()).unwrap();
    assert_close(&swish.tensor(&x).unwrap(), &want, 1e-12);
    assert_backward(
        |v| swish.var(&v[0]),
        std::slice::from_ref(&x),
        &CheckOptions::default(),
    );
    // a transposed input, in f32 too
    assert_backward(
        |v| swish.var(&v[0]),
        &[x.t().unwrap()],
        &CheckOptions::default(),
    );
    assert_backward(
        |v| swish.var(&v[0]),
        std::slice::from_ref(&x),
        &CheckOptions::f32(),
    );
    // the same gradient as the graph of separate ops
    let (a, b) = (Var::param(x.clone()), Var::param(x.clone()));
    swish
        .var(&a)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    b.mul(&b.sigmoid().unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_close(&a.grad().unwrap(), &b.grad().unwrap(), 1e-12);
}

#[test]
fn broadcast_inputs_get_gradients_of_their_shapes() {
    // a [4, 3] input, a [3] bias and a [4, 1] scale, broadcast together
    let f = fuse_n(3, |x| {
        vec![((&x[0] + &x[1]).tanh() * &x[2] - x[1].square()).gelu()]
    });
    let (x, b, s) = (randn(&[4, 3], 1), randn(&[3], 2), randn(&[4, 1], 3));
    assert_backward(
        |v| Ok(f.vars(&[&v[0], &v[1], &v[2]])?.swap_remove(0)),
        &[x, b, s.narrow(0, 0, 4).unwrap()],
        &CheckOptions::default(),
    );
    let sliced = randn(&[6, 5], 4).narrow(1, 1, 3).unwrap();
    let g = fuse2(|a, b| a.maximum(&b) * a.minimum(0.3) + (a / (b.abs() + 1.0)).exp());
    assert_backward(
        |v| Ok(g.vars(&[&v[0], &v[1]])?.swap_remove(0)),
        &[sliced, randn(&[1, 3], 5)],
        &CheckOptions::default(),
    );
}

#[test]
fn reductions_and_several_outputs() {
    // log-sum-exp over the last axis (the max given as an input), and the shifted exponentials
    // as a second, elementwise output of the same pass
    let lse = fuse_n(2, |x| {
        let (v, m) = (&x[0], &x[1]);
        let e = (v - m).exp();
        let s = e.sum(&[-1]);
        vec![s.log() + m, e]
    });
    let x = randn(&[3, 5], 7);
    let m = x.max(&[-1], true).unwrap();
    let outs = lse.tensors(&[&x, &m]).unwrap();
    let want = x.exp().unwrap().sum(&[-1], true).unwrap().log().unwrap();
    assert_close(&outs[0], &want, 1e-12);
    assert_close(&outs[1], &x.sub(&m).unwrap().exp().unwrap(), 1e-12);
    for j in 0..2 {
        assert_backward(
            |v| Ok(lse.vars(&[&v[0], &v[1]])?.swap_remove(j)),
            &[x.clone(), m.clone()],
            &CheckOptions::default(),
        );
    }
    // max and min reductions over the first axis of a transposed input, with a post-map
    let mm = fuse(|x| (x.max(&[0]) - x.min(&[0])).square() + x.sum(&[0]).sin());
    assert_backward(
        |v| mm.var(&v[0]),
        &[randn(&[4, 6], 8).t().unwrap()],
        &CheckOptions::default(),
    );
    // ties share the gradient evenly, as Var::max does
    let t = T::from_vec(vec![1.0f64, 3.0, 3.0, 0.5], [4], &Cpu::device(0)).unwrap();
    let (a, b) = (Var::param(t.clone()), Var::param(t));
    fuse(|x| x.max(&[0]))
        .var(&a)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    b.max(&[0], true)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_close(&a.grad().unwrap(), &b.grad().unwrap(), 0.0);
}

#[test]
fn parameters_are_constants_and_dtypes_retrace() {
    let f = fuse(|x| (&x * Expr::param(0)).exp());
    let x = randn(&[8], 9);
    let y = f.tensors_with(&[&x], &[0.5]).unwrap().swap_remove(0);
    assert_close(&y, &x.mul_scalar(0.5).unwrap().exp().unwrap(), 1e-12);
    assert_backward(
        |v| Ok(f.vars_with(&[&v[0]], &[-1.5])?.swap_remove(0)),
        std::slice::from_ref(&x),
        &CheckOptions::default(),
    );
    assert_eq!(f.program(&[DType::F32]).unwrap().dtype(0), DType::F32);
    assert_eq!(f.program(&[DType::F64]).unwrap().dtype(0), DType::F64);
}

#[test]
fn errors_are_typed() {
    let kind = |e: Error| match e {
        Error::Expr { kind, .. } => kind,
        other => panic!("{other}"),
    };
    let f = fuse2(|a, b| a + b);
    let x = randn(&[3], 1);
    assert_eq!(kind(f.tensors(&[&x]).unwrap_err()), ExprErrorKind::Arity);
    let y = randn(&[4], 2);
    assert_eq!(
        kind(f.tensors(&[&x, &y]).unwrap_err()),
        ExprErrorKind::Shape
    );
    let i = T::from_vec(vec![1i64, 2, 3], [3], &Cpu::device(0)).unwrap();
    assert_eq!(
        kind(f.tensors(&[&x, &i]).unwrap_err()),
        ExprErrorKind::DType
    );
    // prod runs, but has no gradient
    let p = fuse(|x| x.prod(&[0]));
    let v = Var::param(x.clone());
    let out = p.var(&v).unwrap();
    assert_close(
        &out.tensor(),
        &T::from_vec(
            vec![x.to_vec::<f64>().unwrap().iter().product::<f64>()],
            [1],
            &Cpu::device(0),
        )
        .unwrap(),
        1e-12,
    );
    assert_eq!(
        kind(out.sum_all().unwrap().backward().unwrap_err()),
        ExprErrorKind::Structure
    );
}
