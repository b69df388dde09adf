//! `layer_norm`, `rms_norm` and `embedding` on variables, against values derived by hand: the
//! forward and the closed-form gradients written out as plain f64 loops here (independently of
//! the expression programs the ops run), on the f64 reference backend and the CPU backend, in
//! f64 and f32, with contiguous and strided inputs; `check_backward` on each; and the typed
//! errors. The reference backend offers the fused op (`Backend::layer_norm_forward`), so on it
//! these tests check autograd's fused path, and under `composed_norm` the composed programs; the
//! CPU backend runs the composed programs. (The comparison with PyTorch's values is in `torch_f64.rs`; the generic gradient
//! suite checks the same ops on random shapes on every backend.)

mod common;

use common::{assert_close, f64s, normal};
use kiln_autograd::{CheckOptions, Var, check_backward, composed_norm};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Error, Tensor};

/// Rows of `n` normalized elements: `(y, dx, dw, db)` for the cotangent `g`, by the textbook
/// formulas (mean, biased variance; `dx = rstd (ĝ - mean ĝ - x̂ mean(ĝ x̂))`), layer norm when
/// `centered`, RMS norm otherwise.
#[allow(clippy::type_complexity)]
fn by_hand(
    x: &[f64],
    g: &[f64],
    n: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
    centered: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dw, mut db) = (vec![0.0; n], vec![0.0; n]);
    for r in 0..x.len() / n {
        let row = &x[r * n..(r + 1) * n];
        let gr = &g[r * n..(r + 1) * n];
        let mean = if centered {
            row.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let gy: Vec<f64> = (0..n).map(|i| gr[i] * w.map_or(1.0, |w| w[i])).collect();
        let m1 = if centered {
            gy.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let m2 = (0..n).map(|i| gy[i] * xhat[i]).sum::<f64>() / n as f64;
        for i in 0..n {
            y[r * n + i] = xhat[i] * w.map_or(1.0, |w| w[i]) + b.map_or(0.0, |b| b[i]);
            dx[r * n + i] = rstd * (gy[i] - m1 - xhat[i] * m2);
            dw[i] += gr[i] * xhat[i];
            db[i] += gr[i];
        }
    }
    (y, dx, dw, db)
}

/// Every variant (layer norm with weight and bias, weight only, bias only, neither; RMS norm
/// with and without weight) over one or two normalized dims, against [`by_hand`].
fn norms_match_by_hand<B: Backend>(dev: &B::Device, dtype: DType, tol: f64) {
    for (dims, k) in [(vec![3usize, 7], 1usize), (vec![2, 3, 4], 2), (vec![5], 1)] {
        let n: usize = dims[dims.len() - k..].iter().product();
        let nshape = dims[dims.len() - k..].to_vec();
        for (centered, has_w, has_b) in [
            (true, true, true),
            (true, true, false),
            (true, false, true),
            (true, false, false),
            (false, true, false),
            (false, false, false),
        ] {
            let what = format!("{dtype} {dims:?} k={k} centered={centered} w={has_w} b={has_b}");
            let eps = 1e-5;
            let x = Var::param(normal::<B>(&dims, 1, dtype, dev));
            let w = has_w.then(|| Var::param(normal::<B>(&nshape, 2, dtype, dev)));
            let b = has_b.then(|| Var::param(normal::<B>(&nshape, 3, dtype, dev)));
            let g = normal::<B>(&dims, 4, dtype, dev);
            let y = if centered {
                x.layer_norm(&nshape, w.as_ref(), b.as_ref(), eps)
            } else {
                x.rms_norm(&nshape, w.as_ref(), eps)
            }
            .unwrap();
            y.mul(&Var::constant(g.clone()))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (wv, bv) = (
                w.as_ref().map(|w| f64s(&w.tensor())),
                b.as_ref().map(|b| f64s(&b.tensor())),
            );
            let (ey, edx, edw, edb) = by_hand(
                &f64s(&x.tensor()),
                &f64s(&g),
                n,
                wv.as_deref(),
                bv.as_deref(),
                eps,
                centered,
            );
            assert_eq!(y.dims(), dims.as_slice());
            assert_close(&format!("{what} y"), &f64s(&y.tensor()), &ey, tol);
            assert_close(&format!("{what} dx"), &f64s(&x.grad().unwrap()), &edx, tol);
            if let Some(w) = &w {
                assert_eq!(w.grad().unwrap().dims(), nshape.as_slice());
                assert_close(&format!("{what} dw"), &f64s(&w.grad().unwrap()), &edw, tol);
            }
            if let Some(b) = &b {
                assert_close(&format!("{what} db"), &f64s(&b.grad().unwrap()), &edb, tol);
            }
        }
    }
}

#[test]
fn norms_match_values_derived_by_hand() {
    norms_match_by_hand::<Reference>(&RefDevice(0), DType::F64, 1e-12);
    norms_match_by_hand::<Cpu>(&Cpu::device(0), DType::F64, 1e-12);
    norms_match_by_hand::<Cpu>(&Cpu::device(0), DType::F32, 2e-5);
}

/// The reference backend's fused path (above) in f32 and with a strided input, and its composed
/// programs when `composed_norm` is in force.
#[test]
fn reference_fused_and_composed_paths() {
    let dev = RefDevice(0);
    norms_match_by_hand::<Reference>(&dev, DType::F32, 2e-6);
    let t = normal::<Reference>(&[6, 4], 9, DType::F64, &dev)
        .t()
        .unwrap();
    let (a, c) = (Var::param(t.clone()), Var::param(t.contiguous().unwrap()));
    let ya = a.rms_norm(&[6], None, 1e-5).unwrap();
    let yc = c.rms_norm(&[6], None, 1e-5).unwrap();
    assert_close("y", &f64s(&ya.tensor()), &f64s(&yc.tensor()), 1e-14);
    ya.sum_all().unwrap().backward().unwrap();
    yc.sum_all().unwrap().backward().unwrap();
    let (ga, gc) = (a.grad().unwrap(), c.grad().unwrap());
    assert_eq!(ga.dims(), [4, 6]);
    assert_close("dx", &f64s(&ga), &f64s(&gc), 1e-14);
    let _composed = composed_norm();
    norms_match_by_hand::<Reference>(&dev, DType::F64, 1e-12);
    gradcheck::<Reference>(&dev);
}

#[test]
fn norms_read_strided_inputs() {
    // A transposed view: the programs read it in place; values as the contiguous copy's.
    let dev = Cpu::device(0);
    let t = normal::<Cpu>(&[6, 4], 9, DType::F64, &dev).t().unwrap();
    let w = Var::param(normal::<Cpu>(&[6], 10, DType::F64, &dev));
    let a = Var::param(t.clone());
    let c = Var::param(t.contiguous().unwrap());
    let ya = a.layer_norm(&[6], Some(&w), None, 1e-5).unwrap();
    let yc = c.layer_norm(&[6], Some(&w), None, 1e-5).unwrap();
    assert_close("y", &f64s(&ya.tensor()), &f64s(&yc.tensor()), 1e-14);
    ya.square().unwrap().sum_all().unwrap().backward().unwrap();
    let wa = f64s(&w.grad().unwrap());
    w.zero_grad();
    yc.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().dims(), [4, 6]);
    assert_close(
        "dx",
        &f64s(&a.grad().unwrap()),
        &f64s(&c.grad().unwrap()),
        1e-14,
    );
    assert_close("dw", &wa, &f64s(&w.grad().unwrap()), 1e-14);
}

fn gradcheck<B: Backend>(dev: &B::Device) {
    let o = CheckOptions::default();
    let x = normal::<B>(&[3, 2, 5], 5, DType::F64, dev);
    let w = normal::<B>(&[5], 6, DType::F64, dev);
    let b = normal::<B>(&[5], 7, DType::F64, dev);
    let w2 = normal::<B>(&[2, 5], 8, DType::F64, dev);
    let ins = [x.clone(), w.clone(), b.clone()];
    check_backward(
        |v| v[0].layer_norm(&[5], Some(&v[1]), Some(&v[2]), 1e-5),
        &ins,
        &o,
    )
    .unwrap();
    check_backward(
        |v| v[0].layer_norm(&[5], None, Some(&v[1]), 1e-5),
        &[x.clone(), b],
        &o,
    )
    .unwrap();
    check_backward(
        |v| v[0].layer_norm(&[2, 5], Some(&v[1]), None, 1e-5),
        &[x.clone(), w2.clone()],
        &o,
    )
    .unwrap();
    check_backward(
        |v| v[0].layer_norm(&[2, 5], None, None, 1e-5),
        std::slice::from_ref(&x),
        &o,
    )
    .unwrap();
    check_backward(
        |v| v[0].rms_norm(&[5], Some(&v[1]), 1e-6),
        &[x.clone(), w],
        &o,
    )
    .unwrap();
    check_backward(|v| v[0].rms_norm(&[2, 5], None, 1e-6), &[x], &o).unwrap();
    // A residual connection: the norm's input is an op output that another reader (the add)
    // already gave a gradient, which the fused backward adds into its dx (the engine's fold);
    // then a third reader after the norm.
    let residual = |v: &[Var<B>]| {
        let h = v[0].mul_scalar(2.0)?;
        let y = h.add(&h.layer_norm(&[5], Some(&v[1]), Some(&v[2]), 1e-5)?)?;
        y.mul(&h.rms_norm(&[5], None, 1e-6)?.sin()?)
    };
    check_backward(residual, &ins, &o).unwrap();
}

#[test]
fn norms_pass_the_gradient_check() {
    gradcheck::<Reference>(&RefDevice(0));
    gradcheck::<Cpu>(&Cpu::device(0));
}

#[test]
fn norm_errors_name_the_op_and_the_problem() {
    let dev = RefDevice(0);
    let x = Var::param(normal::<Reference>(&[2, 3], 1, DType::F64, &dev));
    let w4 = Var::param(normal::<Reference>(&[4], 2, DType::F64, &dev));
    let w32 = Var::param(normal::<Reference>(&[3], 2, DType::F32, &dev));
    let e = x
        .layer_norm(&[4], None, None, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("layer_norm:") && e.contains("[4]") && e.contains("[2, 3]"),
        "{e}"
    );
    let e = x
        .layer_norm(&[3], Some(&w4), None, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("layer_norm:") && e.contains("weight"), "{e}");
    let e = x.rms_norm(&[3], Some(&w32), 1e-5).unwrap_err();
    assert!(
        matches!(e, Error::DTypeMismatch { op: "rms_norm", .. }),
        "{e}"
    );
    let e = x.rms_norm(&[], None, 1e-5).unwrap_err().to_string();
    assert!(e.starts_with("rms_norm:"), "{e}");
    let e = x
        .layer_norm(&[3], None, None, -1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("eps"), "{e}");
    let ids = Tensor::<Reference>::from_slice(&[0i64, 1], [2], &dev).unwrap();
    let e = Var::constant(ids.clone())
        .layer_norm(&[2], None, None, 1e-5)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                op: "layer_norm",
                ..
            }
        ),
        "{e}"
    );
}

fn embedding_by_hand<B: Backend>(dev: &B::Device) {
    let table = Var::param(
        Tensor::<B>::from_vec((0..12).map(f64::from).collect::<Vec<_>>(), [4, 3], dev).unwrap(),
    );
    let ids = Tensor::<B>::from_slice(&[2i64, 0, 2, 3, 1, 2], [2, 3], dev).unwrap();
    let y = table.embedding(&ids, None).unwrap();
    assert_eq!(y.dims(), [2, 3, 3]);
    let rows: Vec<f64> = [2, 0, 2, 3, 1, 2]
        .iter()
        .flat_map(|&r| (0..3).map(move |c| (r * 3 + c) as f64))
        .collect();
    assert_eq!(f64s(&y.tensor()), rows);
    // Cotangent: output row i is all (i + 1): row 2 collects 1 + 3 + 6.
    let g: Vec<f64> = (0..6).flat_map(|i| [(i + 1) as f64; 3]).collect();
    let g = Tensor::<B>::from_vec(g, [2, 3, 3], dev).unwrap();
    let loss = y.mul(&Var::constant(g.clone())).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let want = [[2.0; 3], [5.0; 3], [10.0; 3], [4.0; 3]].concat();
    assert_eq!(f64s(&table.grad().unwrap()), want);
    // padding_idx 2: the row is read but gets no gradient.
    table.zero_grad();
    let y = table.embedding(&ids, Some(2)).unwrap();
    assert_eq!(f64s(&y.tensor()), rows);
    y.mul(&Var::constant(g))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want = [[2.0; 3], [5.0; 3], [0.0; 3], [4.0; 3]].concat();
    assert_eq!(f64s(&table.grad().unwrap()), want);
    // And the gradient check, with repeated ids (not with a padding id: that row's gradient
    // is zero on purpose, which a numerical derivative does not know).
    let t = normal::<B>(&[4, 3], 3, DType::F64, dev);
    check_backward(
        |v| v[0].embedding(&ids, None),
        &[t],
        &CheckOptions::default(),
    )
    .unwrap();
}

#[test]
fn embedding_matches_values_derived_by_hand() {
    embedding_by_hand::<Reference>(&RefDevice(0));
    embedding_by_hand::<Cpu>(&Cpu::device(0));
}

fn embedding_errors<B: Backend>(dev: &B::Device) {
    let table = Var::param(normal::<B>(&[4, 3], 1, DType::F32, dev));
    let bad = Tensor::<B>::from_slice(&[1i64, 4], [2], dev).unwrap();
    let e = table.embedding(&bad, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "embedding",
                index: 4,
                size: 4
            }
        ),
        "{e}"
    );
    let neg = Tensor::<B>::from_slice(&[-1i64], [1], dev).unwrap();
    assert!(matches!(
        table.embedding(&neg, None).unwrap_err(),
        Error::IndexOutOfRange {
            op: "embedding",
            index: -1,
            ..
        }
    ));
    let f = Tensor::<B>::from_slice(&[1.0f32], [1], dev).unwrap();
    let e = table.embedding(&f, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                op: "embedding",
                ..
            }
        ),
        "{e}"
    );
    let ok = Tensor::<B>::from_slice(&[1i64], [1], dev).unwrap();
    let e = table.embedding(&ok, Some(4)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "embedding",
                index: 4,
                size: 4
            }
        ),
        "{e}"
    );
    let flat = Var::param(normal::<B>(&[4], 1, DType::F32, dev));
    assert!(
        flat.embedding(&ok, None)
            .unwrap_err()
            .to_string()
            .starts_with("embedding:")
    );
}

#[test]
fn embedding_errors_name_the_op_and_the_index() {
    embedding_errors::<Reference>(&RefDevice(0));
    embedding_errors::<Cpu>(&Cpu::device(0));
}
