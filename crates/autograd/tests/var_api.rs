//! The `Var` API itself: accumulation, zero_grad, no_grad, detach, graph freeing, seeds,
//! in-place updates, devices, threads, and that `check_backward` can fail. Runs on the f64
//! reference backend (two virtual devices, `ref` and `ref:1`).

use kiln_autograd::{CheckOptions, Var, check_backward, is_grad_enabled, no_grad};
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{DType, Reduction, Tensor};

type B = Reference;
const DEV: RefDevice = RefDevice(0);

fn t(v: &[f64], shape: &[usize]) -> Tensor<B> {
    Tensor::from_slice(v, shape, &DEV).unwrap()
}

fn vals(x: &Tensor<B>) -> Vec<f64> {
    x.to_f64_vec().unwrap()
}

#[test]
fn var_used_twice_accumulates_in_topological_order() {
    let x = Var::param(t(&[1.0, -2.0, 3.0], &[3]));
    // y = sum(x*x + x) + sum(x*x): x*x reused, x used four times.
    let xx = x.mul(&x).unwrap();
    let y = xx.add(&x).unwrap().sum_all().unwrap();
    let y = y.add(&xx.sum_all().unwrap()).unwrap();
    y.backward().unwrap();
    // dy/dx = 4x + 1
    assert_eq!(vals(&x.grad().unwrap()), vec![5.0, -7.0, 13.0]);
}

#[test]
fn grads_accumulate_across_backward_until_zero_grad() {
    let x = Var::param(t(&[2.0], &[]));
    for _ in 0..3 {
        x.square().unwrap().backward().unwrap();
    }
    assert_eq!(vals(&x.grad().unwrap()), vec![12.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    x.square().unwrap().backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![4.0]);
}

#[test]
fn graph_is_freed_unless_retained() {
    let x = Var::param(t(&[3.0], &[1]));
    let y = x.square().unwrap().sum_all().unwrap();
    y.backward_retain().unwrap();
    y.backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![12.0]);
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("already freed"), "{err}");
    // An intermediate of a freed graph cannot be backpropagated through either.
    let a = x.exp().unwrap();
    let b = a.sum_all().unwrap();
    b.backward().unwrap();
    let err = a
        .mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(err.to_string().contains("already freed"), "{err}");
}

#[test]
fn backward_needs_a_scalar_or_a_seed() {
    let x = Var::param(t(&[1.0, 2.0], &[2]));
    let y = x.mul_scalar(3.0).unwrap();
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("one-element"), "{err}");
    let bad = y.backward_with(&t(&[1.0], &[1])).unwrap_err();
    assert!(
        matches!(bad, kiln_core::Error::ShapeMismatch { .. }),
        "{bad}"
    );
    y.backward_with(&t(&[1.0, 10.0], &[2])).unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![3.0, 30.0]);
    // One element of rank 2 is a scalar too.
    let z = Var::param(t(&[2.0], &[1, 1]));
    z.square().unwrap().backward().unwrap();
    assert_eq!(vals(&z.grad().unwrap()), vec![4.0]);
}

#[test]
fn no_grad_records_nothing_and_restores() {
    let x = Var::param(t(&[1.0], &[]));
    assert!(is_grad_enabled());
    let y = no_grad(|| {
        assert!(!is_grad_enabled());
        x.exp().unwrap()
    });
    assert!(is_grad_enabled());
    assert!(!y.requires_grad());
    assert!(y.backward().is_err());
    // Restored after a panic too.
    let r = std::panic::catch_unwind(|| no_grad(|| panic!("boom")));
    assert!(r.is_err());
    assert!(is_grad_enabled());
}

#[test]
fn constants_and_detach_stop_gradients() {
    let x = Var::param(t(&[2.0], &[]));
    let c = Var::constant(t(&[5.0], &[]));
    let y = x
        .mul(&c)
        .unwrap()
        .add(&x.square().unwrap().detach())
        .unwrap();
    y.backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![5.0]);
    assert!(c.grad().is_none());
    let k = c.exp().unwrap();
    assert!(!k.requires_grad(), "ops on constants only record nothing");
}

#[test]
fn retain_grad_keeps_an_intermediate_gradient() {
    let x = Var::param(t(&[1.0, 2.0], &[2]));
    let h = x.mul_scalar(3.0).unwrap();
    h.retain_grad();
    h.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&h.grad().unwrap()), vec![6.0, 12.0]);
    assert_eq!(vals(&x.grad().unwrap()), vec![18.0, 36.0]);
}

#[test]
fn set_tensor_updates_in_place_for_every_clone() {
    let w = Var::param(t(&[1.0, 2.0], &[2]));
    let alias = w.clone();
    let loss = w.square().unwrap().sum_all().unwrap();
    // Update between forward and backward: the recorded graph keeps the old value.
    w.update_data(|x| x.mul_scalar(10.0)).unwrap();
    assert_eq!(vals(&alias.tensor()), vec![10.0, 20.0]);
    loss.backward().unwrap();
    assert_eq!(vals(&w.grad().unwrap()), vec![2.0, 4.0]);
    let err = w.set_tensor(t(&[1.0], &[1])).unwrap_err();
    assert!(
        matches!(
            err,
            kiln_core::Error::ShapeMismatch {
                op: "set_tensor",
                ..
            }
        ),
        "{err}"
    );
    let err = w
        .set_tensor(Tensor::zeros([2], DType::F32, &DEV).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, kiln_core::Error::DTypeMismatch { .. }),
        "{err}"
    );
    assert!(
        loss.set_tensor(t(&[0.0], &[])).is_err(),
        "op outputs are not updatable"
    );
    w.set_grad(None).unwrap();
    assert!(w.grad().is_none());
    assert!(w.set_grad(Some(t(&[1.0], &[1]))).is_err());
}

#[test]
fn to_device_is_differentiable_and_mixing_devices_errors() {
    let d1 = RefDevice(1);
    let x = Var::param(t(&[1.0, 2.0, 3.0], &[3]));
    let same = x.to_device(&DEV).unwrap();
    assert!(
        same.ptr_eq(&x),
        "to_device to the same device is the same variable"
    );
    let x1 = x.to_device(&d1).unwrap();
    assert_eq!(x1.device(), d1);
    let w1 = Var::param(Tensor::from_slice(&[4.0, 5.0, 6.0], [3], &d1).unwrap());
    // Mixing devices is an error naming both.
    let err = x.mul(&w1).unwrap_err().to_string();
    assert!(
        err.contains("ref") && err.contains("ref:1") && err.contains("mul"),
        "{err}"
    );
    let y = x1
        .mul(&w1)
        .unwrap()
        .sum_all()
        .unwrap()
        .copy_to(&DEV)
        .unwrap();
    assert_eq!(y.device(), DEV);
    y.backward().unwrap();
    let gx = x.grad().unwrap();
    assert_eq!(
        *gx.device(),
        DEV,
        "the gradient came back to the source device"
    );
    assert_eq!(vals(&gx), vec![4.0, 5.0, 6.0]);
    assert_eq!(*w1.grad().unwrap().device(), d1);
    assert_eq!(vals(&w1.grad().unwrap()), vec![1.0, 2.0, 3.0]);
    check_backward(
        |v| v[0].to_device(&d1)?.square()?.copy_to(&DEV),
        &[t(&[0.5, -1.5], &[2])],
        &CheckOptions::default(),
    )
    .unwrap();
}

#[test]
fn var_trains_on_several_threads() {
    let handles: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                let w = Var::param(t(&[i as f64], &[]));
                w.square().unwrap().backward().unwrap();
                (w.clone(), vals(&w.grad().unwrap())[0])
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (w, g) = h.join().unwrap();
        assert_eq!(g, 2.0 * i as f64);
        assert!(w.grad().is_some());
    }
    // A shared parameter: each thread accumulates into the same gradient.
    let w = Var::param(t(&[3.0], &[]));
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| w.mul_scalar(2.0).unwrap().backward().unwrap());
        }
    });
    assert_eq!(vals(&w.grad().unwrap()), vec![8.0]);
}

#[test]
fn check_backward_catches_a_wrong_gradient() {
    // y = x^3 with a deliberately wrong gradient (2x instead of 3x^2).
    let wrong_cube = |v: &[Var<B>]| {
        let x = v[0].tensor();
        let y = x.pow_scalar(3.0)?;
        Ok(Var::from_op("wrong_cube", &[&v[0]], y, move |g, _| {
            Ok(vec![Some(g.mul(&x.mul_scalar(2.0)?)?)])
        }))
    };
    let x = t(&[0.5, 1.5, -2.0], &[3]);
    let err = check_backward(
        wrong_cube,
        std::slice::from_ref(&x),
        &CheckOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("input 0") && err.contains("numerical"),
        "{err}"
    );
    // The right gradient passes.
    let right_cube = |v: &[Var<B>]| {
        let x = v[0].tensor();
        let y = x.pow_scalar(3.0)?;
        Ok(Var::from_op("cube", &[&v[0]], y, move |g, _| {
            Ok(vec![Some(g.mul(&x.square()?.mul_scalar(3.0)?)?)])
        }))
    };
    check_backward(right_cube, &[x], &CheckOptions::default()).unwrap();
}

#[test]
#[should_panic(expected = "input 1")]
fn assert_backward_panics_naming_the_input() {
    // Gradient of the second input is dropped.
    let f = |v: &[Var<B>]| {
        let (a, b) = (v[0].tensor(), v[1].tensor());
        let y = a.mul(&b)?;
        Ok(Var::from_op("bad_mul", &[&v[0], &v[1]], y, move |g, _| {
            Ok(vec![Some(g.mul(&b)?), None])
        }))
    };
    kiln_autograd::assert_backward(
        f,
        &[t(&[1.0, 2.0], &[2]), t(&[3.0, 4.0], &[2])],
        &CheckOptions::default(),
    );
}

#[test]
fn max_ties_share_the_gradient_and_maximum_ties_split() {
    let x = Var::param(t(&[1.0, 3.0, 3.0, 2.0, 5.0, 5.0], &[2, 3]));
    x.max(&[1], false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![0.0, 0.5, 0.5, 0.0, 0.5, 0.5]);
    let x = Var::param(t(&[4.0, 4.0, 1.0, 4.0], &[4]));
    x.min_all().unwrap().backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![0.0, 0.0, 1.0, 0.0]);
    x.zero_grad();
    x.max_all().unwrap().backward().unwrap();
    let third = 1.0 / 3.0;
    assert_eq!(vals(&x.grad().unwrap()), vec![third, third, 0.0, third]);

    let a = Var::param(t(&[1.0, 2.0, 3.0], &[3]));
    let b = Var::param(t(&[2.0, 2.0, 1.0], &[3]));
    a.maximum(&b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(vals(&a.grad().unwrap()), vec![0.0, 0.5, 1.0]);
    assert_eq!(vals(&b.grad().unwrap()), vec![1.0, 0.5, 0.0]);
    // Against a constant, as torch.clamp: ties pass the whole gradient.
    let c = Var::param(t(&[-1.0, 0.0, 1.0, 2.0], &[4]));
    c.clamp(0.0, 1.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(vals(&c.grad().unwrap()), vec![0.0, 1.0, 1.0, 0.0]);
    // relu and abs: 0 at 0.
    let z = Var::param(t(&[0.0, -1.0, 2.0], &[3]));
    z.relu()
        .unwrap()
        .add(&z.abs().unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(vals(&z.grad().unwrap()), vec![0.0, -1.0, 2.0]);
}

#[test]
fn pow_masks_zero_base_and_zero_exponent() {
    let a = Var::param(t(&[0.0, 0.0, 2.0], &[3]));
    let b = Var::param(t(&[0.0, 2.0, 0.0], &[3]));
    a.pow(&b).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&a.grad().unwrap()), vec![0.0, 0.0, 0.0]);
    let gb = vals(&b.grad().unwrap());
    assert_eq!(&gb[..2], &[0.0, 0.0]);
    assert!((gb[2] - 2f64.ln()).abs() < 1e-12);
}

#[test]
fn to_dtype_gradient_comes_back_in_the_source_dtype() {
    let x = Var::param(t(&[1.0, 2.0], &[2]));
    let y = x
        .to_dtype(DType::F32)
        .unwrap()
        .square()
        .unwrap()
        .sum_all()
        .unwrap();
    y.backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F64);
    assert_eq!(vals(&g), vec![2.0, 4.0]);
}

#[test]
fn mean_cross_entropy_matches_its_definition() {
    let logits = t(&[1.0, 2.0, 0.5, -1.0, 0.0, 3.0], &[2, 3]);
    let labels = Tensor::<B>::from_slice(&[1i64, 2], [2], &DEV).unwrap();
    let x = Var::param(logits.clone());
    let loss = x.cross_entropy(&labels, Reduction::Mean).unwrap();
    assert_eq!(loss.rank(), 0);
    loss.backward().unwrap();
    // (softmax - onehot) / n
    let sm = vals(&logits.softmax(-1).unwrap());
    let mut want = sm.clone();
    want[1] -= 1.0;
    want[5] -= 1.0;
    for (g, w) in vals(&x.grad().unwrap()).iter().zip(&want) {
        assert!((g - w / 2.0).abs() < 1e-12, "{g} vs {}", w / 2.0);
    }
}

#[test]
fn deep_graphs_neither_overflow_backward_nor_drop() {
    const DEPTH: usize = 100_000;
    let x = Var::param(t(&[1.0], &[]));
    let mut h = x.clone();
    for _ in 0..DEPTH {
        h = h.add_scalar(1e-6).unwrap();
    }
    h.backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![1.0]);
    // Dropped without backward.
    let mut h = x.clone();
    for _ in 0..DEPTH {
        h = h.mul_scalar(1.0).unwrap();
    }
    drop(h);
}

/// Ops save only what the gradients of the inputs that need one read: with one side constant
/// the other side's gradient must be the same as when both are parameters.
#[test]
fn one_sided_gradients_match_two_sided() {
    use kiln_core::BinaryOp;
    let a = t(&[0.5, 1.5, 2.0, 0.75], &[2, 2]);
    let b = t(&[1.25, -0.5], &[2]);
    for op in BinaryOp::ALL {
        let grads = |pa: bool, pb: bool| {
            let va = if pa {
                Var::param(a.clone())
            } else {
                Var::constant(a.clone())
            };
            let vb = if pb {
                Var::param(b.clone())
            } else {
                Var::constant(b.clone())
            };
            va.binary(op, &vb)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (va.grad().map(|g| vals(&g)), vb.grad().map(|g| vals(&g)))
        };
        let (ga, gb) = grads(true, true);
        assert_eq!(grads(true, false), (ga.clone(), None), "{op:?}");
        assert_eq!(grads(false, true), (None, gb.clone()), "{op:?}");
    }
}

#[test]
fn empty_tensors_get_empty_gradients() {
    let x = Var::param(Tensor::<B>::zeros([0, 3], DType::F64, &DEV).unwrap());
    x.exp().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().dims(), &[0, 3]);
    let a = Var::param(Tensor::<B>::zeros([2, 0], DType::F64, &DEV).unwrap());
    let b = Var::param(Tensor::<B>::zeros([0, 3], DType::F64, &DEV).unwrap());
    let y = a.matmul(&b).unwrap();
    assert_eq!(y.dims(), vec![2, 3]);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().dims(), &[2, 0]);
    assert_eq!(b.grad().unwrap().dims(), &[0, 3]);
    let p = Var::param(t(&[1.0, 2.0], &[1, 2]));
    let e = Var::param(Tensor::<B>::zeros([0, 2], DType::F64, &DEV).unwrap());
    let c = Var::cat(&[p.clone(), e.clone()], 0).unwrap();
    c.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&p.grad().unwrap()), vec![2.0, 4.0]);
    assert_eq!(e.grad().unwrap().dims(), &[0, 2]);
}

#[test]
fn set_tensor_to_another_device_moves_the_gradient_along() {
    let w = Var::param(t(&[1.0, 2.0], &[2]));
    w.square().unwrap().sum_all().unwrap().backward().unwrap();
    let d1 = RefDevice(1);
    w.set_tensor(w.tensor().to_device(&d1).unwrap()).unwrap();
    assert_eq!(w.device(), d1);
    let g = w.grad().unwrap();
    assert_eq!(*g.device(), d1);
    assert_eq!(vals(&g), vec![2.0, 4.0]);
    // Training continues on the new device, accumulating into the moved gradient.
    w.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&w.grad().unwrap()), vec![4.0, 8.0]);
}

#[test]
fn grad_hooks_fire_once_per_backward_as_soon_as_a_leaf_is_complete() {
    use std::sync::{Arc, Mutex};
    // y = sum(relu(x·w1)·w2): w2's gradient is complete before w1's is computed.
    let x = Var::constant(t(&[1.0, 2.0], &[1, 2]));
    let w1 = Var::param(t(&[1.0, 0.5, -1.0, 2.0], &[2, 2]));
    let w2 = Var::param(t(&[3.0, -1.0], &[2, 1]));
    type Log = Arc<Mutex<Vec<(&'static str, bool, bool)>>>;
    let log: Log = Arc::default();
    let mut handles = Vec::new();
    for (name, w, other) in [("w1", &w1, &w2), ("w2", &w2, &w1)] {
        let log = log.clone();
        let other = other.clone();
        handles.push(w.register_grad_hook(Arc::new(move |v: &Var<B>| {
            // The hooked leaf's gradient is in place; record whether the other one is yet.
            log.lock()
                .unwrap()
                .push((name, v.grad().is_some(), other.grad().is_some()));
            Ok(())
        })));
    }
    let y = x
        .matmul(&w1)
        .unwrap()
        .relu()
        .unwrap()
        .matmul(&w2)
        .unwrap()
        .sum_all()
        .unwrap();
    y.backward().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        vec![("w2", true, false), ("w1", true, true)],
        "w2's hook runs before w1's gradient exists"
    );
    // Values are the same as without hooks: dy/dw2 = relu(x·w1)ᵀ = [-1→0, 4.5]ᵀ.
    assert_eq!(vals(&w2.grad().unwrap()), vec![0.0, 4.5]);
    assert!(w1.remove_grad_hook(handles[0]));
    assert!(!w1.remove_grad_hook(handles[0]));
    log.lock().unwrap().clear();
    let y = x
        .matmul(&w1)
        .unwrap()
        .matmul(&w2)
        .unwrap()
        .sum_all()
        .unwrap();
    y.backward().unwrap();
    assert_eq!(log.lock().unwrap().len(), 1, "only w2's hook is left");
}

#[test]
fn a_failing_grad_hook_fails_backward() {
    use std::sync::Arc;
    let w = Var::param(t(&[1.0, 2.0], &[2]));
    w.register_grad_hook(Arc::new(|_v: &Var<B>| {
        Err(kiln_core::Error::invalid("hook", "planted failure"))
    }));
    let e = w
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(e.to_string().contains("planted failure"), "{e}");
}

#[test]
fn a_hooked_leaf_gets_its_gradient_and_hook_before_the_nodes_other_inputs() {
    use std::sync::{Arc, Mutex};
    // y = sum(x ⊙ w) with x = 3·x0 computed and w a leaf: the node's backward is asked for w's
    // gradient alone, w's hook runs, and only then is x's gradient computed (so that DDP's
    // all-reduce of w is queued before the work for x). Without a hook: one call for both.
    for hooked in [true, false] {
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let x0 = Var::param(t(&[1.0, 2.0], &[2]));
        let x = x0.mul_scalar(3.0).unwrap();
        let w = Var::param(t(&[0.5, -1.0], &[2]));
        if hooked {
            let l = log.clone();
            w.register_grad_hook(Arc::new(move |v: &Var<B>| {
                l.lock()
                    .unwrap()
                    .push(format!("hook {:?}", vals(&v.grad().unwrap())));
                Ok(())
            }));
        }
        let (xt, wt) = (x.tensor(), w.tensor());
        let l = log.clone();
        let y = Var::from_op("pair", &[&x, &w], xt.mul(&wt).unwrap(), move |g, needs| {
            l.lock().unwrap().push(format!("backward {needs:?}"));
            Ok(vec![
                needs[0].then(|| g.mul(&wt)).transpose()?,
                needs[1].then(|| g.mul(&xt)).transpose()?,
            ])
        });
        y.sum_all().unwrap().backward().unwrap();
        let want: Vec<String> = if hooked {
            vec![
                "backward [false, true]".into(),
                "hook [3.0, 6.0]".into(),
                "backward [true, false]".into(),
            ]
        } else {
            vec!["backward [true, true]".into()]
        };
        assert_eq!(*log.lock().unwrap(), want);
        assert_eq!(vals(&w.grad().unwrap()), vec![3.0, 6.0]);
        assert_eq!(vals(&x0.grad().unwrap()), vec![1.5, -3.0]);
    }
}

#[test]
fn linear_is_matmul_with_the_transposed_weight_plus_the_bias() {
    // The same values and gradients as the two-op form, with the parameters as direct inputs.
    let x = Var::param(t(&[1.0, -2.0, 0.5, 3.0, 0.0, -1.0], &[3, 2]));
    let w = Var::param(t(&[0.5, 1.0, -1.5, 2.0], &[2, 2]));
    let b = Var::param(t(&[0.25, -0.5], &[2]));
    let y = x.linear(&w, Some(&b)).unwrap();
    let r = x.matmul(&w.t().unwrap()).unwrap().add(&b).unwrap();
    assert_eq!(vals(&y.tensor()), vals(&r.tensor()));
    y.square().unwrap().sum_all().unwrap().backward().unwrap();
    let (gx, gw, gb) = (x.take_grad(), w.take_grad(), b.take_grad());
    r.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&gx.unwrap()), vals(&x.grad().unwrap()));
    assert_eq!(vals(&gw.unwrap()), vals(&w.grad().unwrap()));
    assert_eq!(vals(&gb.unwrap()), vals(&b.grad().unwrap()));
    // Shapes are checked, naming the op.
    let e = x.linear(&b, None).unwrap_err().to_string();
    assert!(e.contains("linear"), "{e}");
    let e = x.linear(&w, Some(&w)).unwrap_err().to_string();
    assert!(e.contains("linear") && e.contains("bias"), "{e}");
}

#[test]
fn max_dim_sends_the_gradient_to_the_indexed_element_only() {
    // Row 0 has a tie (the first maximum is picked); `max` would share, `max_dim` does not.
    let x = Var::param(t(&[5.0, 1.0, 5.0, 2.0, 7.0, 3.0], &[2, 3]));
    let (y, idx) = x.max_dim(1, false).unwrap();
    assert_eq!(vals(&y.tensor()), vec![5.0, 7.0]);
    assert_eq!(idx.to_vec::<i64>().unwrap(), vec![0, 1]);
    y.sum_all().unwrap().backward().unwrap();
    let g = vals(&x.grad().unwrap());
    assert_eq!(g, vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
    let x = Var::param(t(&[5.0, 1.0, 5.0, 2.0, 7.0, 3.0], &[2, 3]));
    let (y, idx) = x.min_dim(0, true).unwrap();
    assert_eq!(idx.to_vec::<i64>().unwrap(), vec![1, 0, 1]);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![0.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
}

/// `scale_grad` multiplies lazily: `grad()` reads the product, `grad_parts()` the sum and the
/// factor (factors given in turn multiply); setting or accumulating a gradient applies the
/// factor; a factor of another dtype or size is a typed error; without a gradient it is a
/// no-op.
#[test]
fn scale_grad_keeps_the_factor_apart_until_the_gradient_changes() {
    let x = Var::param(t(&[1.0, 2.0, 3.0], &[3]));
    x.scale_grad(&t(&[2.0], &[])).unwrap();
    assert!(x.grad().is_none());
    x.set_grad(Some(t(&[1.0, -2.0, 4.0], &[3]))).unwrap();
    assert!(x.grad_parts().unwrap().1.is_none());
    x.scale_grad(&t(&[0.5], &[])).unwrap();
    x.scale_grad(&t(&[3.0], &[1])).unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![1.5, -3.0, 6.0]);
    let (sum, factor) = x.grad_parts().unwrap();
    assert_eq!(vals(&sum), vec![1.0, -2.0, 4.0]);
    assert_eq!(vals(&factor.unwrap()), vec![1.5]);
    // A backward adds to the scaled gradient: the factor is applied first.
    x.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![3.5, 1.0, 12.0]);
    assert!(x.grad_parts().unwrap().1.is_none());
    let e = x
        .scale_grad(&t(&[1.0], &[]).to_dtype(DType::F32).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            e,
            kiln_core::Error::DTypeMismatch {
                op: "scale_grad",
                ..
            }
        ),
        "{e:?}"
    );
    let e = x.scale_grad(&t(&[1.0, 2.0], &[2])).unwrap_err();
    assert!(e.to_string().contains("one element"), "{e}");
    x.scale_grad(&t(&[2.0], &[])).unwrap();
    x.set_grad(Some(t(&[1.0, 1.0, 1.0], &[3]))).unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![1.0, 1.0, 1.0]);
    x.scale_grad(&t(&[2.0], &[])).unwrap();
    assert_eq!(vals(&x.take_grad().unwrap()), vec![2.0, 2.0, 2.0]);
    assert!(!x.has_grad());
}
