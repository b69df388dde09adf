//! `clip_grad_norm` on the device: the returned 0-d norm and the scaled gradients against a
//! hand computation (clipping and not, f32 and f64 gradients, a tied parameter, a non-finite
//! norm), and no value read back to the host while it runs (the profiler sees no `to_host`).

use kiln_autograd::Var;
use kiln_core::profile::{self, Kind};
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{DType, Tensor};
use kiln_optim::{clip_grad_norm, grad_norm, grad_norm_tensor};

type B = Reference;

fn param(v: &[f64], g: &[f64], dtype: DType) -> Var<B> {
    let dev = RefDevice(0);
    let p = Var::param(
        Tensor::<B>::from_vec(v.to_vec(), [v.len()], &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    );
    let g = Tensor::<B>::from_vec(g.to_vec(), [g.len()], &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    p.set_grad(Some(g)).unwrap();
    p
}

fn grad(p: &Var<B>) -> Vec<f64> {
    p.grad()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec()
        .unwrap()
}

#[test]
fn clips_on_the_device_as_computed_by_hand() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
        // Gradients (1, 2, 2) and (4): norm √(1 + 4 + 4 + 16) = 5. The tied parameter is given
        // twice and counts once.
        let a = param(&[0.0; 3], &[1.0, 2.0, 2.0], dtype);
        let b = param(&[0.0], &[4.0], dtype);
        let none = Var::param(Tensor::<B>::zeros([2], dtype, &RefDevice(0)).unwrap());
        let ps = [a.clone(), b.clone(), none.clone(), a.clone()];
        // No clipping (max_norm above the norm): the coefficient is 1.
        let n = clip_grad_norm(&ps, 10.0).unwrap();
        assert_eq!(n.dims(), &[] as &[usize]);
        assert_eq!(n.dtype(), DType::F64);
        assert!((n.to_scalar().unwrap() - 5.0).abs() < 1e-12);
        assert_eq!(grad(&a), [1.0, 2.0, 2.0]);
        assert_eq!(grad(&b), [4.0]);
        // Clipping to 2: scaled by 2 / (5 + 1e-6).
        let n = clip_grad_norm(&ps, 2.0).unwrap();
        assert!((n.to_scalar().unwrap() - 5.0).abs() < 1e-12);
        let k = 2.0 / (5.0 + 1e-6);
        for (got, want) in grad(&a).iter().chain(&grad(&b)).zip([1.0, 2.0, 2.0, 4.0]) {
            assert!(
                (got - want * k).abs() < tol,
                "{dtype}: {got} vs {}",
                want * k
            );
        }
        assert!(none.grad().is_none());
        assert!((grad_norm(&ps).unwrap() - 2.0).abs() < 1e-5);
    }
}

#[test]
fn a_non_finite_norm_leaves_the_gradients_alone() {
    let a = param(&[0.0; 2], &[f64::INFINITY, 1.0], DType::F64);
    let n = clip_grad_norm(std::slice::from_ref(&a), 1.0).unwrap();
    assert_eq!(n.to_scalar().unwrap(), f64::INFINITY);
    assert_eq!(grad(&a), [f64::INFINITY, 1.0]);
    let b = param(&[0.0; 2], &[f64::NAN, 1.0], DType::F64);
    assert!(
        clip_grad_norm(std::slice::from_ref(&b), 1.0)
            .unwrap()
            .to_scalar()
            .unwrap()
            .is_nan()
    );
    assert_eq!(grad(&b)[1], 1.0);
}

#[test]
fn nothing_is_read_back_to_the_host() {
    let a = param(&[0.0; 3], &[1.0, 2.0, 2.0], DType::F32);
    let b = param(&[0.0], &[4.0], DType::F32);
    let (n, p) = profile::profile(|| {
        let _r = profile::range("clip-no-sync");
        clip_grad_norm(&[a.clone(), b.clone()], 1.0).unwrap()
    });
    let mine = p.in_range("clip-no-sync");
    assert!(
        mine.records().iter().any(|r| r.kind == Kind::Op),
        "the profiler saw the ops:\n{mine}"
    );
    let reads: Vec<_> = mine
        .records()
        .iter()
        .filter(|r| r.kind == Kind::Sync || r.name.contains("to_host"))
        .collect();
    assert!(reads.is_empty(), "clip_grad_norm read back: {reads:?}");
    // The returned tensor is the norm (reading it now is the caller's choice).
    assert!((n.to_scalar().unwrap() - 5.0).abs() < 1e-12);
    assert!(grad_norm_tensor::<B>(&[]).unwrap().is_none());
}
