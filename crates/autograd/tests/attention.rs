//! `scaled_dot_product_attention` against attention written out as plain f64 loops, on the f64
//! reference backend and the CPU backend; `check_backward` with every kind of mask, with
//! dropout and with a fully masked row; the zero (not NaN) result of fully masked rows; and the
//! typed errors. (The generic gradient suite checks it on random shapes on every backend.)

mod common;

use common::{assert_close, f64s};
use kiln_autograd::{AttnMask, CheckOptions, Var, check_backward};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Error, Generator, Tensor};

/// Standard normal values drawn from `seed`.
fn normal<B: Backend>(dims: &[usize], seed: u64, dtype: DType, dev: &B::Device) -> Tensor<B> {
    common::normal_with(dims, seed, (0.0, 1.0), dtype, dev)
}

/// Attention by hand over `nb` independent `[t, d]` blocks: `allowed(i, j)` says whether query
/// `i` may see key `j`, `bias(i, j)` is added to the score; fully masked rows give zeros.
#[allow(clippy::too_many_arguments)]
fn by_hand(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    nb: usize,
    (tq, tk, d, dv): (usize, usize, usize, usize),
    scale: f64,
    allowed: impl Fn(usize, usize) -> bool,
    bias: impl Fn(usize, usize) -> f64,
) -> Vec<f64> {
    let mut out = vec![0.0; nb * tq * dv];
    for b in 0..nb {
        for i in 0..tq {
            let s: Vec<Option<f64>> = (0..tk)
                .map(|j| {
                    allowed(i, j).then(|| {
                        (0..d)
                            .map(|c| q[(b * tq + i) * d + c] * k[(b * tk + j) * d + c])
                            .sum::<f64>()
                            * scale
                            + bias(i, j)
                    })
                })
                .collect();
            let m = s
                .iter()
                .flatten()
                .cloned()
                .fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                continue;
            }
            let e: Vec<f64> = s.iter().map(|x| x.map_or(0.0, |x| (x - m).exp())).collect();
            let z: f64 = e.iter().sum();
            for c in 0..dv {
                out[(b * tq + i) * dv + c] =
                    (0..tk).map(|j| e[j] / z * v[(b * tk + j) * dv + c]).sum();
            }
        }
    }
    out
}

/// A named mask with its scale and the expected output.
type Case<B> = (&'static str, AttnMask<B>, Option<f64>, Vec<f64>);

/// No mask, causal (square and `Tq < Tk`), a boolean mask broadcast over the batch and an
/// additive one, with the default and an explicit scale.
fn matches_by_hand<B: Backend>(dev: &B::Device, dtype: DType, tol: f64) {
    let (batch, tq, tk, d, dv) = ([2usize, 3], 4usize, 5usize, 3usize, 2usize);
    let nb = 6;
    for (tq, tk) in [(tq, tk), (tk, tk)] {
        let q = normal::<B>(&[batch[0], batch[1], tq, d], 1, dtype, dev);
        let k = normal::<B>(&[batch[0], batch[1], tk, d], 2, dtype, dev);
        let v = normal::<B>(&[batch[0], batch[1], tk, dv], 3, dtype, dev);
        let (qh, kh, vh) = (f64s(&q), f64s(&k), f64s(&v));
        let keep: Vec<u8> = (0..tq * tk).map(|x| u8::from(x % 3 != 1)).collect();
        let add: Vec<f64> = (0..tq * tk).map(|x| (x as f64 * 0.37).sin()).collect();
        let keep_t = Tensor::<B>::from_slice(&keep, [tq, tk], dev).unwrap();
        let add_t = Tensor::<B>::from_slice(&add, [tq, tk], dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let all = |_: usize, _: usize| true;
        let nobias = |_: usize, _: usize| 0.0;
        let cases: Vec<Case<B>> = vec![
            (
                "none",
                AttnMask::None,
                None,
                by_hand(
                    &qh,
                    &kh,
                    &vh,
                    nb,
                    (tq, tk, d, dv),
                    1.0 / (d as f64).sqrt(),
                    all,
                    nobias,
                ),
            ),
            (
                "causal",
                AttnMask::Causal,
                Some(0.7),
                by_hand(
                    &qh,
                    &kh,
                    &vh,
                    nb,
                    (tq, tk, d, dv),
                    0.7,
                    |i, j| j <= i,
                    nobias,
                ),
            ),
            (
                "keep",
                AttnMask::Keep(keep_t),
                None,
                by_hand(
                    &qh,
                    &kh,
                    &vh,
                    nb,
                    (tq, tk, d, dv),
                    1.0 / (d as f64).sqrt(),
                    |i, j| keep[i * tk + j] != 0,
                    nobias,
                ),
            ),
            (
                "additive",
                AttnMask::Additive(add_t),
                None,
                by_hand(
                    &qh,
                    &kh,
                    &vh,
                    nb,
                    (tq, tk, d, dv),
                    1.0 / (d as f64).sqrt(),
                    all,
                    |i, j| add[i * tk + j],
                ),
            ),
        ];
        for (name, mask, scale, want) in cases {
            let y = Var::constant(q.clone())
                .scaled_dot_product_attention(
                    &Var::constant(k.clone()),
                    &Var::constant(v.clone()),
                    &mask,
                    0.0,
                    scale,
                    None,
                )
                .unwrap();
            assert_eq!(y.dims(), [2, 3, tq, dv]);
            assert_close(
                &format!("{} {dtype} {name} tq={tq}", B::NAME),
                &f64s(&y.tensor()),
                &want,
                tol,
            );
        }
    }
}

#[test]
fn attention_matches_values_derived_by_hand() {
    matches_by_hand::<Reference>(&RefDevice(0), DType::F64, 1e-12);
    matches_by_hand::<Cpu>(&Cpu::device(0), DType::F64, 1e-12);
    matches_by_hand::<Cpu>(&Cpu::device(0), DType::F32, 1e-5);
}

/// A keep-mask with query row 1 fully masked (broadcast over 2 heads).
fn mask_with_empty_row<B: Backend>(dev: &B::Device) -> Tensor<B> {
    let keep: [u8; 12] = [1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0];
    Tensor::<B>::from_slice(&keep, [3, 4], dev).unwrap()
}

/// Queries, keys and values.
type Qkv<B> = [Tensor<B>; 3];

fn gradcheck<B: Backend>(dev: &B::Device) {
    let opts = CheckOptions::default();
    let ins = [
        normal::<B>(&[2, 3, 3], 10, DType::F64, dev),
        normal::<B>(&[2, 4, 3], 11, DType::F64, dev),
        normal::<B>(&[2, 4, 2], 12, DType::F64, dev),
    ];
    let square = [
        normal::<B>(&[2, 2, 4, 3], 13, DType::F64, dev),
        normal::<B>(&[2, 2, 4, 3], 14, DType::F64, dev),
        normal::<B>(&[2, 2, 4, 5], 15, DType::F64, dev),
    ];
    let add = normal::<B>(&[3, 4], 16, DType::F64, dev);
    let masks: Vec<(&str, AttnMask<B>, &Qkv<B>)> = vec![
        ("none", AttnMask::None, &ins),
        ("causal", AttnMask::Causal, &square),
        ("causal-rect", AttnMask::Causal, &ins),
        (
            "keep-empty-row",
            AttnMask::Keep(mask_with_empty_row(dev)),
            &ins,
        ),
        ("additive", AttnMask::Additive(add), &ins),
    ];
    for (name, mask, inputs) in masks {
        check_backward(
            |v| v[0].scaled_dot_product_attention(&v[1], &v[2], &mask, 0.0, None, None),
            inputs,
            &opts,
        )
        .unwrap_or_else(|e| panic!("{} {name}: {e}", B::NAME));
    }
    // Dropout: the same seed in every evaluation, so the function is deterministic.
    check_backward(
        |v| {
            let mut g = Generator::new(5);
            v[0].scaled_dot_product_attention(
                &v[1],
                &v[2],
                &AttnMask::Causal,
                0.3,
                Some(0.5),
                Some(&mut g),
            )
        },
        &square,
        &opts,
    )
    .unwrap_or_else(|e| panic!("{} dropout: {e}", B::NAME));
}

#[test]
fn attention_gradients_check() {
    gradcheck::<Reference>(&RefDevice(0));
    gradcheck::<Cpu>(&Cpu::device(0));
}

/// A fully masked query row gives a zero output row, zero gradients to that query, and leaves
/// the gradients of `k` and `v` exactly those of attention without that row (no NaN anywhere).
fn empty_rows<B: Backend>(dev: &B::Device) {
    let (q, k, v) = (
        normal::<B>(&[2, 3, 3], 20, DType::F64, dev),
        normal::<B>(&[2, 4, 3], 21, DType::F64, dev),
        normal::<B>(&[2, 4, 2], 22, DType::F64, dev),
    );
    let run = |q: Tensor<B>, mask: Tensor<B>| {
        let (qv, kv, vv) = (Var::param(q), Var::param(k.clone()), Var::param(v.clone()));
        let y = qv
            .scaled_dot_product_attention(&kv, &vv, &AttnMask::Keep(mask), 0.0, None, None)
            .unwrap();
        y.sum_all().unwrap().backward().unwrap();
        let grads = [&qv, &kv, &vv].map(|x| f64s(&x.grad().unwrap()));
        (f64s(&y.tensor()), grads)
    };
    let mask = mask_with_empty_row::<B>(dev);
    let (y, [dq, dk, dv]) = run(q.clone(), mask.clone());
    for x in y.iter().chain(&dq).chain(&dk).chain(&dv) {
        assert!(x.is_finite(), "{}: non-finite value {x}", B::NAME);
    }
    for b in 0..2 {
        assert_eq!(
            &y[b * 6 + 2..b * 6 + 4],
            &[0.0, 0.0],
            "output of the empty row"
        );
        assert_eq!(&dq[b * 9 + 3..b * 9 + 6], &[0.0; 3], "dq of the empty row");
    }
    // The same without the empty row: rows 0 and 2 of q and of the mask.
    let ids = Tensor::<B>::from_slice(&[0i64, 2], [2], dev).unwrap();
    let (y2, [_, dk2, dv2]) = run(
        q.index_select(1, &ids).unwrap(),
        mask.index_select(0, &ids).unwrap(),
    );
    assert_close("y without the empty row", &y2[..2], &y[..2], 1e-12);
    assert_close("dk", &dk, &dk2, 1e-12);
    assert_close("dv", &dv, &dv2, 1e-12);
}

#[test]
fn fully_masked_rows_give_zeros_not_nan() {
    empty_rows::<Reference>(&RefDevice(0));
    empty_rows::<Cpu>(&Cpu::device(0));
}

#[test]
fn dropout_is_seeded_and_scales_the_kept_weights() {
    let dev = Cpu::device(0);
    let (q, k, v) = (
        Var::constant(normal::<Cpu>(&[2, 5, 4], 30, DType::F64, &dev)),
        Var::constant(normal::<Cpu>(&[2, 5, 4], 31, DType::F64, &dev)),
        Var::constant(normal::<Cpu>(&[2, 5, 3], 32, DType::F64, &dev)),
    );
    let run = |seed: u64| {
        let mut g = Generator::new(seed);
        let y = q
            .scaled_dot_product_attention(&k, &v, &AttnMask::Causal, 0.4, None, Some(&mut g))
            .unwrap();
        f64s(&y.tensor())
    };
    assert_eq!(run(7), run(7), "same seed, same mask");
    assert_ne!(run(7), run(8), "another seed, another mask");
    // By hand: the weights without dropout, times the generator's keep-mask / (1 - p).
    let eye = Var::constant(Tensor::<Cpu>::eye(5, DType::F64, &dev).unwrap());
    // Attention over the identity as values gives the weights themselves.
    let weights = |p_drop: f64, g: Option<&mut Generator>| {
        f64s(
            &q.scaled_dot_product_attention(&k, &eye, &AttnMask::Causal, p_drop, None, g)
                .unwrap()
                .tensor(),
        )
    };
    let plain = weights(0.0, None);
    let dropped = weights(0.4, Some(&mut Generator::new(7)));
    // The keep mask is the f32 uniforms' `u >= p` (in f32) whatever the dtype (RandDist::Keep).
    let u = f64s(
        &Generator::new(7)
            .rand_like(&Tensor::<Cpu>::zeros([2, 5, 5], DType::F32, &dev).unwrap())
            .unwrap(),
    );
    let want: Vec<f64> = plain
        .iter()
        .zip(&u)
        .map(|(p, u)| if *u >= 0.4f32 as f64 { p / 0.6 } else { 0.0 })
        .collect();
    assert_close("dropped weights", &dropped, &want, 1e-12);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let dev = Cpu::device(0);
    let t = |dims: &[usize]| Var::constant(normal::<Cpu>(dims, 1, DType::F32, &dev));
    let (q, k, v) = (t(&[2, 3, 4]), t(&[2, 5, 4]), t(&[2, 5, 6]));
    let sdpa = |q: &Var<Cpu>, k: &Var<Cpu>, v: &Var<Cpu>, m: &AttnMask<Cpu>, p: f64| {
        q.scaled_dot_product_attention(k, v, m, p, None, None)
    };
    let invalid = |r: kiln_core::Result<Var<Cpu>>, what: &str| match r {
        Err(Error::InvalidArgument { op, msg }) => {
            assert_eq!(op, "scaled_dot_product_attention");
            assert!(msg.contains(what), "{msg} should mention {what}");
        }
        Err(e) => panic!("{what}: wrong error {e}"),
        Ok(_) => panic!("{what}: accepted"),
    };
    invalid(
        sdpa(&q, &t(&[2, 5, 3]), &v, &AttnMask::None, 0.0),
        "k [.., Tk, d]",
    );
    invalid(
        sdpa(&q, &k, &t(&[2, 4, 6]), &AttnMask::None, 0.0),
        "v [.., Tk, dv]",
    );
    invalid(sdpa(&t(&[4]), &k, &v, &AttnMask::None, 0.0), "q must be");
    invalid(sdpa(&q, &k, &v, &AttnMask::None, 1.0), "dropout_p");
    invalid(sdpa(&q, &k, &v, &AttnMask::None, 0.1), "generator");
    invalid(
        q.scaled_dot_product_attention(&k, &v, &AttnMask::None, 0.0, Some(-1.0), None),
        "scale",
    );
    let wide = Tensor::<Cpu>::ones([3, 6], DType::U8, &dev).unwrap();
    assert!(matches!(
        sdpa(&q, &k, &v, &AttnMask::Keep(wide), 0.0),
        Err(Error::ShapeMismatch {
            op: "scaled_dot_product_attention",
            ..
        })
    ));
    let extra = Tensor::<Cpu>::ones([2, 2, 3, 5], DType::U8, &dev).unwrap();
    invalid(
        sdpa(&q, &k, &v, &AttnMask::Keep(extra), 0.0),
        "does not broadcast",
    );
    let float_keep = Tensor::<Cpu>::ones([3, 5], DType::F32, &dev).unwrap();
    assert!(matches!(
        sdpa(&q, &k, &v, &AttnMask::Keep(float_keep), 0.0),
        Err(Error::DTypeMismatch {
            op: "scaled_dot_product_attention",
            ..
        })
    ));
    let f64_add = Tensor::<Cpu>::zeros([3, 5], DType::F64, &dev).unwrap();
    assert!(matches!(
        sdpa(&q, &k, &v, &AttnMask::Additive(f64_add), 0.0),
        Err(Error::DTypeMismatch {
            op: "scaled_dot_product_attention",
            ..
        })
    ));
    assert!(matches!(
        sdpa(
            &q,
            &t(&[2, 5, 4]).to_dtype(DType::F64).unwrap(),
            &v,
            &AttnMask::None,
            0.0
        ),
        Err(Error::DTypeMismatch {
            op: "scaled_dot_product_attention",
            ..
        })
    ));
    assert!(matches!(
        sdpa(&q, &t(&[3, 5, 4]), &t(&[3, 5, 6]), &AttnMask::None, 0.0),
        Err(Error::ShapeMismatch {
            op: "scaled_dot_product_attention",
            ..
        })
    ));
}

#[test]
fn key_padding_ignores_the_padded_keys() {
    // Two sequences of 4 keys; the second's last two are padding. Attention with the
    // key-padding mask equals attention over the unpadded keys alone.
    let dev = Cpu::device(0);
    let (q, k, v) = (
        normal::<Cpu>(&[2, 3, 5, 8], 1, DType::F64, &dev),
        normal::<Cpu>(&[2, 3, 4, 8], 2, DType::F64, &dev),
        normal::<Cpu>(&[2, 3, 4, 6], 3, DType::F64, &dev),
    );
    let pad = Tensor::<Cpu>::from_vec(vec![0u8, 0, 0, 0, 0, 0, 1, 1], [2, 4], &dev).unwrap();
    let mask = AttnMask::key_padding(&pad).unwrap();
    let (qv, kv, vv) = (
        Var::constant(q.clone()),
        Var::constant(k.clone()),
        Var::constant(v.clone()),
    );
    let y = qv
        .scaled_dot_product_attention(&kv, &vv, &mask, 0.0, None, None)
        .unwrap()
        .tensor();
    let seq = |t: &Tensor<Cpu>, i: usize, keys: usize| {
        Var::constant(t.narrow(0, i, 1).unwrap().narrow(2, 0, keys).unwrap())
    };
    for (i, keys) in [(0, 4), (1, 2)] {
        let want = seq(&q, i, 5)
            .scaled_dot_product_attention(
                &seq(&k, i, keys),
                &seq(&v, i, keys),
                &AttnMask::None,
                0.0,
                None,
                None,
            )
            .unwrap()
            .tensor();
        let got = y.narrow(0, i, 1).unwrap();
        assert_close(&format!("sequence {i}"), &f64s(&got), &f64s(&want), 1e-12);
    }
    assert!(matches!(
        AttnMask::key_padding(&pad.reshape([8]).unwrap()),
        Err(Error::InvalidArgument { .. })
    ));
}

/// `packed_self_attention` over a `[b, t, 3E]` projection equals three narrowed head views
/// into `scaled_dot_product_attention` (output and the projection's gradient, with dropout
/// from the same generator state and a keep-mask, which composes), and rejects a width that is
/// not a multiple of `3·num_heads` with a typed error.
#[test]
fn packed_self_attention_equals_the_narrowed_views() {
    let dev = Cpu::device(0);
    let (b, t, h, d) = (2, 5, 3, 4);
    let e = h * d;
    let x = normal::<Cpu>(&[b, t, 3 * e], 3, DType::F32, &dev);
    let g = normal::<Cpu>(&[b, t, e], 4, DType::F32, &dev);
    let keep: Vec<u8> = (0..t * t).map(|i| u8::from(i % 3 != 1)).collect();
    let keep = Tensor::<Cpu>::from_vec(keep, [t, t], &dev).unwrap();
    for (mask, p) in [
        (AttnMask::None, 0.0),
        (AttnMask::Causal, 0.3),
        (AttnMask::Keep(keep), 0.0),
    ] {
        let run = |packed: bool| {
            let xv = Var::param(x.clone());
            let mut rng = Generator::new(9);
            let rng = (p > 0.0).then_some(&mut rng);
            let y = if packed {
                xv.packed_self_attention(h, &mask, p, None, rng).unwrap()
            } else {
                let view = |i: usize| {
                    xv.narrow(-1, i * e, e)
                        .unwrap()
                        .reshape([b, t, h, d])
                        .unwrap()
                        .transpose(-3, -2)
                        .unwrap()
                };
                view(0)
                    .scaled_dot_product_attention(&view(1), &view(2), &mask, p, None, rng)
                    .unwrap()
                    .transpose(-3, -2)
                    .unwrap()
                    .reshape([b, t, e])
                    .unwrap()
            };
            y.backward_with(&g).unwrap();
            [f64s(&y.tensor()), f64s(&xv.grad().unwrap())]
        };
        let (packed, narrow) = (run(true), run(false));
        for (name, (a, c)) in ["out", "dx"].iter().zip(packed.iter().zip(&narrow)) {
            assert_close(&format!("packed vs narrowed, p {p}: {name}"), a, c, 0.0);
        }
    }
    let bad = Var::param(normal::<Cpu>(&[b, t, 3 * e + 1], 5, DType::F32, &dev));
    let err = bad
        .packed_self_attention(h, &AttnMask::None, 0.0, None, None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                op: "packed_self_attention",
                ..
            }
        ),
        "{err:?}"
    );
}
