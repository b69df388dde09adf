//! `Var::linear_act` (a linear layer and its activation as one op): the backend's fused path
//! (the reference backend offers it, composed from its own kernels) and the composed path (the
//! CPU offers none) against `linear` followed by the activation, values and gradients, plus
//! finite-difference gradient checks of both paths. The GPU's cuBLASLt path is compared in
//! kiln-backend-cuda's tests.

mod common;

use common::{assert_close, f64s, normal};
use kiln_autograd::{CheckOptions, Var, assert_backward, autocast, set_linear_epilogues};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Activation, Backend, DType, Tensor};

const ACTS: [Activation; 4] = [
    Activation::Identity,
    Activation::Relu,
    Activation::Gelu,
    Activation::GeluTanh,
];

fn composed<B: Backend>(x: &Var<B>, w: &Var<B>, b: Option<&Var<B>>, act: Activation) -> Var<B> {
    let y = x.linear(w, b).unwrap();
    match act.unary() {
        Some(op) => y.unary(op).unwrap(),
        None => y,
    }
}

/// Output and gradients (x, w, b) of `f` on fresh leaves; `x` is 3-d, so the op flattens it.
fn run<B: Backend>(
    dev: &B::Device,
    dtype: DType,
    bias: bool,
    f: impl Fn(&Var<B>, &Var<B>, Option<&Var<B>>) -> Var<B>,
) -> Vec<Vec<f64>> {
    let x = Var::param(normal::<B>(&[2, 3, 5], 1, dtype, dev));
    let w = Var::param(normal::<B>(&[7, 5], 2, dtype, dev));
    let b = bias.then(|| Var::param(normal::<B>(&[7], 3, dtype, dev)));
    let y = f(&x, &w, b.as_ref());
    assert_eq!(y.dims(), [2, 3, 7]);
    let seed = Var::constant(normal::<B>(&[2, 3, 7], 4, dtype, dev));
    y.mul(&seed).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![
        f64s(&y.tensor()),
        f64s(&x.grad().unwrap()),
        f64s(&w.grad().unwrap()),
    ];
    if let Some(b) = b {
        out.push(f64s(&b.grad().unwrap()));
    }
    out
}

#[test]
fn the_fused_path_matches_linear_then_activation() {
    let dev = RefDevice::default();
    for act in ACTS {
        for bias in [false, true] {
            let fused = run::<Reference>(&dev, DType::F64, bias, |x, w, b| {
                x.linear_act(w, b, act).unwrap()
            });
            let want = run::<Reference>(&dev, DType::F64, bias, |x, w, b| composed(x, w, b, act));
            for (k, (g, w)) in fused.iter().zip(&want).enumerate() {
                assert_close(&format!("{act:?} bias {bias}: output {k}"), g, w, 1e-12);
            }
        }
    }
}

#[test]
fn the_composed_path_is_linear_then_activation_bit_for_bit() {
    let dev = Cpu::device(0);
    for dtype in [DType::F32, DType::F64] {
        for act in ACTS {
            for bias in [false, true] {
                let got = run::<Cpu>(&dev, dtype, bias, |x, w, b| {
                    x.linear_act(w, b, act).unwrap()
                });
                let want = run::<Cpu>(&dev, dtype, bias, |x, w, b| composed(x, w, b, act));
                assert_eq!(got, want, "{dtype} {act:?} bias {bias}");
            }
        }
    }
    // Under autocast too: the same casts, the same 16-bit output.
    let _amp = autocast(DType::BF16).unwrap();
    let got = run::<Cpu>(&dev, DType::F32, true, |x, w, b| {
        x.linear_act(w, b, Activation::Relu).unwrap()
    });
    let want = run::<Cpu>(&dev, DType::F32, true, |x, w, b| {
        composed(x, w, b, Activation::Relu)
    });
    assert_eq!(got, want, "bf16 autocast");
}

#[test]
fn gradients_check_by_finite_differences_on_both_paths() {
    let f = |act: Activation| {
        move |v: &[Var<Reference>]| {
            let y = v[0].linear_act(&v[1], v.get(2), act)?;
            y.mul(&y)?.sum_all()
        }
    };
    let dev = RefDevice::default();
    for act in ACTS {
        let inputs: Vec<Tensor<Reference>> = vec![
            normal::<Reference>(&[4, 3], 5, DType::F64, &dev),
            normal::<Reference>(&[2, 3], 6, DType::F64, &dev),
            normal::<Reference>(&[2], 7, DType::F64, &dev),
        ];
        assert_backward(f(act), &inputs, &CheckOptions::default());
        assert_backward(f(act), &inputs[..2], &CheckOptions::default());
    }
    let cpu = Cpu::device(0);
    for act in ACTS {
        let inputs: Vec<Tensor<Cpu>> = vec![
            normal::<Cpu>(&[4, 3], 5, DType::F64, &cpu),
            normal::<Cpu>(&[2, 3], 6, DType::F64, &cpu),
            normal::<Cpu>(&[2], 7, DType::F64, &cpu),
        ];
        let g = move |v: &[Var<Cpu>]| {
            let y = v[0].linear_act(&v[1], v.get(2), act)?;
            y.mul(&y)?.sum_all()
        };
        assert_backward(g, &inputs, &CheckOptions::default());
    }
}

#[test]
fn turned_off_the_reference_composes() {
    // Only this test toggles the switch; the others pass with either path.
    let dev = RefDevice::default();
    set_linear_epilogues(false);
    let off = run::<Reference>(&dev, DType::F64, true, |x, w, b| {
        x.linear_act(w, b, Activation::GeluTanh).unwrap()
    });
    set_linear_epilogues(true);
    let want = run::<Reference>(&dev, DType::F64, true, |x, w, b| {
        composed(x, w, b, Activation::GeluTanh)
    });
    assert_eq!(off, want);
}

#[test]
fn shape_errors_are_typed() {
    let dev = RefDevice::default();
    let x = Var::param(normal::<Reference>(&[4, 3], 1, DType::F64, &dev));
    let w = Var::param(normal::<Reference>(&[2, 4], 2, DType::F64, &dev));
    let e = x.linear_act(&w, None, Activation::Relu).unwrap_err();
    assert!(e.to_string().contains("linear"), "{e}");
    let w = Var::param(normal::<Reference>(&[2, 3], 2, DType::F64, &dev));
    let b = Var::param(normal::<Reference>(&[3], 3, DType::F64, &dev));
    let e = x.linear_act(&w, Some(&b), Activation::Relu).unwrap_err();
    assert!(e.to_string().contains("bias"), "{e}");
}
