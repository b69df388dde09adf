//! `MultiheadAttention`: PyTorch's parameter names, shapes and initial distributions; the output
//! against multi-head attention computed by hand in f64 on a tiny case (self- and
//! cross-attention, causal mask); the fused self-attention projection against the general
//! path; `check_backward` through every parameter; dropout in training only; config errors.

use kiln_autograd::{AttnMask, CheckOptions, Var, check_backward};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Error, Generator, RandDist, Tensor};
use kiln_nn::{
    MhaWeights, Module, ModuleExt, MultiheadAttention, MultiheadAttentionConfig,
    multi_head_attention,
};

fn normal<B: Backend>(dims: &[usize], seed: u64, dev: &B::Device) -> Tensor<B> {
    let d = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    Generator::new(seed)
        .sample::<B>(dims.to_vec(), d, DType::F64, dev)
        .unwrap()
}

fn f64s<B: Backend>(t: &Tensor<B>) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

fn mha<B: Backend>(dev: &B::Device, dropout: f64) -> MultiheadAttention<B> {
    MultiheadAttentionConfig::new(4, 2)
        .with_dropout(dropout)
        .with_dtype(DType::F64)
        .init::<B>(dev, &mut Generator::new(3))
        .unwrap()
}

/// Nonzero biases, so the test sees them.
fn with_random_biases<B: Backend>(m: &MultiheadAttention<B>, dev: &B::Device) {
    let b = m.in_proj_bias.as_ref().unwrap();
    b.set_tensor(normal::<B>(&[12], 40, dev)).unwrap();
    let ob = m.out_proj.bias.as_ref().unwrap();
    ob.set_tensor(normal::<B>(&[4], 41, dev)).unwrap();
}

/// `x [n, t, e] · wᵀ + b` for `w` rows `rows` of a row-major `[.., e]` matrix.
fn project(
    x: &[f64],
    n_rows: usize,
    w: &[f64],
    rows: std::ops::Range<usize>,
    b: &[f64],
) -> Vec<f64> {
    let e = 4;
    let mut out = Vec::new();
    for r in 0..n_rows {
        for o in rows.clone() {
            out.push((0..e).map(|c| x[r * e + c] * w[o * e + c]).sum::<f64>() + b[o]);
        }
    }
    out
}

/// Multi-head attention by hand: batch 2, `l` queries, `s` keys, E 4, 2 heads of 2.
#[allow(clippy::too_many_arguments)]
fn by_hand(
    xq: &[f64],
    xkv: &[f64],
    (l, s): (usize, usize),
    in_w: &[f64],
    in_b: &[f64],
    out_w: &[f64],
    out_b: &[f64],
    causal: bool,
) -> Vec<f64> {
    let (n, e, h, hd) = (2, 4, 2, 2);
    let q = project(xq, n * l, in_w, 0..4, in_b);
    let k = project(xkv, n * s, in_w, 4..8, in_b);
    let v = project(xkv, n * s, in_w, 8..12, in_b);
    let mut ctx = vec![0.0; n * l * e];
    for b in 0..n {
        for head in 0..h {
            for i in 0..l {
                let scores: Vec<f64> = (0..s)
                    .map(|j| {
                        if causal && j > i {
                            return f64::NEG_INFINITY;
                        }
                        (0..hd)
                            .map(|c| {
                                q[(b * l + i) * e + head * hd + c]
                                    * k[(b * s + j) * e + head * hd + c]
                            })
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ex: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = ex.iter().sum();
                for c in 0..hd {
                    ctx[(b * l + i) * e + head * hd + c] = (0..s)
                        .map(|j| ex[j] / z * v[(b * s + j) * e + head * hd + c])
                        .sum();
                }
            }
        }
    }
    project(&ctx, n * l, out_w, 0..4, out_b)
}

fn matches_by_hand<B: Backend>(dev: &B::Device) {
    let m = mha::<B>(dev, 0.0);
    with_random_biases(&m, dev);
    let params: Vec<Vec<f64>> = m.parameters().iter().map(|p| f64s(&p.tensor())).collect();
    let xq = normal::<B>(&[2, 3, 4], 1, dev);
    let xkv = normal::<B>(&[2, 5, 4], 2, dev);
    let (hq, hkv) = (f64s(&xq), f64s(&xkv));
    let want = |q: &[f64], kv: &[f64], ls, causal| {
        by_hand(
            q, kv, ls, &params[0], &params[1], &params[2], &params[3], causal,
        )
    };
    let close = |what: &str, got: &Var<B>, want: &[f64]| {
        let got = f64s(&got.tensor());
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() < 1e-12,
                "{} {what}[{i}]: got {g}, want {w}",
                B::NAME
            );
        }
    };
    let (q, kv) = (Var::constant(xq), Var::constant(xkv));
    close(
        "self",
        &m.forward(&q).unwrap(),
        &want(&hq, &hq, (3, 3), false),
    );
    let causal = m.forward_qkv(&q, &q, &q, &AttnMask::Causal).unwrap();
    close("self causal", &causal, &want(&hq, &hq, (3, 3), true));
    let cross = m.forward_qkv(&q, &kv, &kv, &AttnMask::None).unwrap();
    close("cross", &cross, &want(&hq, &hkv, (3, 5), false));
    // The general path (q, k, v different variables with equal values) gives the fused one's
    // values.
    let (q2, q3) = (Var::constant(q.tensor()), Var::constant(q.tensor()));
    let general = m.forward_qkv(&q, &q2, &q3, &AttnMask::Causal).unwrap();
    close("general path", &general, &f64s(&causal.tensor()));
}

#[test]
fn multihead_attention_matches_values_by_hand() {
    matches_by_hand::<Reference>(&RefDevice(0));
    matches_by_hand::<Cpu>(&Cpu::device(0));
}

#[test]
fn parameters_are_pytorchs() {
    let dev = Cpu::device(0);
    let m = MultiheadAttentionConfig::new(8, 2)
        .init::<Cpu>(&dev, &mut Generator::new(0))
        .unwrap();
    let named: Vec<(String, Vec<usize>)> = m
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.dims()))
        .collect();
    let want = [
        ("in_proj_weight", vec![24, 8]),
        ("in_proj_bias", vec![24]),
        ("out_proj.weight", vec![8, 8]),
        ("out_proj.bias", vec![8]),
    ];
    assert_eq!(named.len(), want.len());
    for ((n, d), (wn, wd)) in named.iter().zip(want) {
        assert_eq!((n.as_str(), d), (wn, &wd));
    }
    let vals = |v: &Var<Cpu>| v.tensor().to_vec::<f32>().unwrap();
    // Xavier uniform on [3E, E]: bound √(6 / (E + 3E)); the sample spreads to near it.
    let bound = (6.0f32 / 32.0).sqrt();
    let w = vals(&m.in_proj_weight);
    assert!(w.iter().all(|x| x.abs() <= bound));
    assert!(w.iter().any(|x| x.abs() > 0.8 * bound));
    // out_proj.weight: the Linear default, U(±1/√E).
    let ow = vals(&m.out_proj.weight);
    assert!(ow.iter().all(|x| x.abs() <= 1.0 / 8f32.sqrt()));
    assert!(
        vals(m.in_proj_bias.as_ref().unwrap())
            .iter()
            .all(|&x| x == 0.0)
    );
    assert!(
        vals(m.out_proj.bias.as_ref().unwrap())
            .iter()
            .all(|&x| x == 0.0)
    );
    let nb = MultiheadAttentionConfig::new(8, 2)
        .with_bias(false)
        .init::<Cpu>(&dev, &mut Generator::new(0))
        .unwrap();
    assert_eq!(nb.parameters().len(), 2);
    assert_eq!(m.num_params(), 24 * 8 + 24 + 64 + 8);
}

/// Inputs 2..6 of a gradient check are the parameters.
fn weights(v: &[Var<Reference>]) -> MhaWeights<'_, Reference> {
    MhaWeights {
        in_proj_weight: &v[2],
        in_proj_bias: Some(&v[3]),
        out_weight: &v[4],
        out_bias: Some(&v[5]),
    }
}

#[test]
fn gradients_check_through_every_parameter() {
    let dev = RefDevice(0);
    let m = mha::<Reference>(&dev, 0.0);
    let mut ins: Vec<Tensor<Reference>> =
        vec![normal(&[2, 3, 4], 50, &dev), normal(&[2, 5, 4], 51, &dev)];
    ins.extend(m.parameters().iter().map(|p| p.tensor()));
    ins[3] = normal(&[12], 52, &dev);
    let opts = CheckOptions::default();
    // Self-attention (the fused projection), causal.
    let self_ins = [&ins[..1], &[ins[0].clone()], &ins[2..]].concat();
    check_backward(
        |v| {
            multi_head_attention(
                (&v[0], &v[0], &v[0]),
                2,
                weights(v),
                &AttnMask::Causal,
                0.0,
                None,
            )
        },
        &self_ins,
        &opts,
    )
    .unwrap();
    // Cross-attention (three projections), no mask.
    check_backward(
        |v| {
            multi_head_attention(
                (&v[0], &v[1], &v[1]),
                2,
                weights(v),
                &AttnMask::None,
                0.0,
                None,
            )
        },
        &ins,
        &opts,
    )
    .unwrap();
}

#[test]
fn dropout_only_in_training() {
    let dev = RefDevice(0);
    let mut m = mha::<Reference>(&dev, 0.5);
    let x = Var::constant(normal::<Reference>(&[2, 3, 4], 60, &dev));
    let y = |m: &MultiheadAttention<Reference>| f64s(&m.forward(&x).unwrap().tensor());
    let (a, b) = (y(&m), y(&m));
    assert_eq!(m.step(), 2);
    assert_ne!(a, b, "two training forwards draw two masks");
    m.set_step(0);
    assert_eq!(y(&m), a, "the same step draws the same mask");
    m.eval();
    let e = y(&m);
    assert_eq!(e, y(&m));
    assert_ne!(e, a);
    assert_eq!(m.step(), 1, "evaluation draws nothing");
    let plain = mha::<Reference>(&dev, 0.0);
    assert_eq!(e, y(&plain), "eval is attention without dropout");
}

#[test]
fn config_and_input_errors() {
    let dev = Cpu::device(0);
    let mut g = Generator::new(0);
    for cfg in [
        MultiheadAttentionConfig::new(6, 4),
        MultiheadAttentionConfig::new(0, 1),
        MultiheadAttentionConfig::new(4, 2).with_batch_first(false),
        MultiheadAttentionConfig::new(4, 2).with_dropout(1.0),
    ] {
        assert!(matches!(
            cfg.init::<Cpu>(&dev, &mut g),
            Err(Error::InvalidArgument {
                op: "MultiheadAttentionConfig::init",
                ..
            })
        ));
    }
    let m = MultiheadAttentionConfig::new(4, 2)
        .init::<Cpu>(&dev, &mut g)
        .unwrap();
    let x = Var::constant(Tensor::<Cpu>::zeros([2, 3, 5], DType::F32, &dev).unwrap());
    assert!(matches!(
        m.forward(&x),
        Err(Error::InvalidArgument {
            op: "multi_head_attention",
            ..
        })
    ));
}
