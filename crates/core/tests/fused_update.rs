//! `Tensor::fused_update` against the formulas written out by hand, on the reference backend.
//!
//! Needs the feature `testing` (for `kiln_core::testing::assert_close`), as the suite's own
//! tests here do.

#![cfg(feature = "testing")]

use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::assert_close;
use kiln_core::{Tensor, UpdateRule};

type T = Tensor<Reference>;

fn t(v: &[f64]) -> T {
    T::from_slice(v, [v.len()], &RefDevice::default()).unwrap()
}

fn close(a: &T, want: &[f64]) {
    assert_close("update", &a.to_f64_vec().unwrap(), want, 1e-12);
}

#[test]
fn sgd_momentum_nesterov_weight_decay() {
    let (p, g, m) = ([1.0, -2.0], [0.5, 0.25], [0.1, -0.1]);
    let (lr, mu, damp, wd) = (0.1, 0.9, 0.2, 0.01);
    let rule = UpdateRule::Sgd {
        lr,
        momentum: mu,
        dampening: damp,
        nesterov: false,
        weight_decay: wd,
        first_step: false,
    };
    let out = T::fused_update(&rule, &[t(&p)], &[t(&g)], &[vec![t(&m)]]).unwrap();
    let gg: Vec<f64> = (0..2).map(|i| g[i] + wd * p[i]).collect();
    let mm: Vec<f64> = (0..2).map(|i| mu * m[i] + (1.0 - damp) * gg[i]).collect();
    close(&out[0].1[0], &mm);
    close(&out[0].0, &[p[0] - lr * mm[0], p[1] - lr * mm[1]]);

    let first = UpdateRule::Sgd {
        lr,
        momentum: mu,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 0.0,
        first_step: true,
    };
    let out = T::fused_update(&first, &[t(&p)], &[t(&g)], &[vec![t(&m)]]).unwrap();
    close(&out[0].1[0], &g); // first step: m = g, the old buffer is ignored
    close(
        &out[0].0,
        &[
            p[0] - lr * (g[0] + mu * g[0]),
            p[1] - lr * (g[1] + mu * g[1]),
        ],
    );
}

#[test]
fn adam_and_adamw() {
    let (p, g, m, v) = ([1.0, -2.0], [0.5, 0.25], [0.1, -0.1], [0.01, 0.02]);
    let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.999, 1e-8, 0.1);
    let (bc1, bc2) = (1.0 - b1 * b1, 1.0 - b2 * b2);
    for decoupled in [false, true] {
        let rule = UpdateRule::Adam {
            lr,
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
            decoupled,
            bias_correction1: bc1,
            bias_correction2: bc2,
        };
        let out = T::fused_update(&rule, &[t(&p)], &[t(&g)], &[vec![t(&m), t(&v)]]).unwrap();
        let mut want_p = vec![];
        let mut want_m = vec![];
        let mut want_v = vec![];
        for i in 0..2 {
            let (mut pi, mut gi) = (p[i], g[i]);
            if decoupled {
                pi *= 1.0 - lr * wd;
            } else {
                gi += wd * pi;
            }
            let mi = b1 * m[i] + (1.0 - b1) * gi;
            let vi = b2 * v[i] + (1.0 - b2) * gi * gi;
            want_p.push(pi - lr / bc1 * mi / (vi.sqrt() / bc2.sqrt() + eps));
            want_m.push(mi);
            want_v.push(vi);
        }
        close(&out[0].0, &want_p);
        close(&out[0].1[0], &want_m);
        close(&out[0].1[1], &want_v);
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let rule = UpdateRule::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        first_step: true,
    };
    let e = T::fused_update(&rule, &[t(&[1.0])], &[t(&[1.0])], &[vec![]]).unwrap_err();
    assert!(
        e.to_string()
            .contains("needs 1 state tensors per parameter, got 0"),
        "{e}"
    );
    let e =
        T::fused_update(&rule, &[t(&[1.0])], &[t(&[1.0, 2.0])], &[vec![t(&[0.0])]]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "fused_update: shape mismatch between [1] and [2]"
    );
    let other = T::from_slice(&[1.0], [1], &RefDevice(1)).unwrap();
    let e = T::fused_update(&rule, &[t(&[1.0])], &[other], &[vec![t(&[0.0])]]).unwrap_err();
    assert!(
        e.to_string().contains("different devices (ref and ref:1)"),
        "{e}"
    );
    let ints = T::from_slice(&[1i64], [1], &RefDevice::default()).unwrap();
    let e = T::fused_update(
        &rule,
        std::slice::from_ref(&ints),
        std::slice::from_ref(&ints),
        &[vec![ints.clone()]],
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with("fused_update: dtype mismatch"),
        "{e}"
    );
}

/// A gradient scale multiplies every gradient inside the update: the same as scaling first,
/// for SGD (whose gradient appears twice under Nesterov) and AdamW; a scale of another dtype,
/// or of more than one element, is a typed error.
#[test]
fn a_gradient_scale_is_the_update_of_the_scaled_gradients() {
    let (p, g, m, v) = (
        [1.0, -2.0, 3.0],
        [0.5, 0.25, -4.0],
        [0.1, -0.1, 0.0],
        [0.01, 0.02, 0.5],
    );
    let s = 0.3;
    let scaled: Vec<f64> = g.iter().map(|g| g * s).collect();
    let sgd = UpdateRule::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        nesterov: true,
        weight_decay: 0.01,
        first_step: false,
    };
    let adamw = UpdateRule::Adam {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
        decoupled: true,
        bias_correction1: 0.19,
        bias_correction2: 0.0199,
    };
    let scale = T::from_slice(&[s], [], &RefDevice::default()).unwrap();
    for (rule, state) in [(sgd, vec![t(&m)]), (adamw, vec![t(&m), t(&v)])] {
        let got = T::fused_update_scaled(
            &rule,
            &[t(&p)],
            &[t(&g)],
            std::slice::from_ref(&state),
            Some(&scale),
        )
        .unwrap();
        let want = T::fused_update(&rule, &[t(&p)], &[t(&scaled)], &[state]).unwrap();
        close(&got[0].0, &want[0].0.to_f64_vec().unwrap());
        for (a, b) in got[0].1.iter().zip(&want[0].1) {
            close(a, &b.to_f64_vec().unwrap());
        }
    }
    let f32_scale = scale.to_dtype(kiln_core::DType::F32).unwrap();
    let e = T::fused_update_scaled(&sgd, &[t(&p)], &[t(&g)], &[vec![t(&m)]], Some(&f32_scale))
        .unwrap_err();
    assert!(
        matches!(
            e,
            kiln_core::Error::DTypeMismatch {
                op: "fused_update",
                ..
            }
        ),
        "{e:?}"
    );
    let e = T::fused_update_scaled(&sgd, &[t(&p)], &[t(&g)], &[vec![t(&m)]], Some(&t(&[s, s])))
        .unwrap_err();
    assert!(e.to_string().contains("one element"), "{e}");
}
