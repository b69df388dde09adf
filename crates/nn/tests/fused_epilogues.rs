//! `Sequential` runs a `Linear` followed by `Relu`, `Gelu` or `GeluTanh` as one
//! `Var::linear_act`: the same values and gradients as the two modules in turn (bit for bit on
//! the CPU, which composes; within rounding on the reference backend, which offers the fused
//! op), and `with_fused_epilogues(false)` turns it off. The GPU's cuBLASLt path is compared in
//! kiln-backend-cuda's tests.

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Activation, Backend, DType, Error, Generator, RandDist, Result, Tensor};
use kiln_nn::{Gelu, GeluTanh, LinearConfig, Module, Relu, Sequential, Tanh};

fn mlp<B: Backend>(dev: &B::Device, fused: bool) -> Sequential<B> {
    let mut g = Generator::new(11);
    let lin = |i, o, g: &mut Generator| {
        LinearConfig::new(i, o)
            .with_dtype(DType::F64)
            .init::<B>(dev, g)
            .unwrap()
    };
    Sequential::new()
        .add(lin(6, 9, &mut g))
        .add(Relu)
        .add(lin(9, 8, &mut g))
        .add(GeluTanh)
        .add(lin(8, 7, &mut g))
        .add(Gelu)
        .add(lin(7, 5, &mut g))
        .add(Tanh)
        .add(lin(5, 3, &mut g))
        .with_fused_epilogues(fused)
}

/// The output and every parameter's gradient.
fn run<B: Backend>(dev: &B::Device, fused: bool) -> Vec<Vec<f64>> {
    let model = mlp::<B>(dev, fused);
    let x = Generator::new(3)
        .sample::<B>(
            [4, 2, 6],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            DType::F64,
            dev,
        )
        .unwrap();
    let y = model.forward(&Var::constant(x)).unwrap();
    y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![y.tensor().to_f64_vec().unwrap()];
    for p in model.parameters() {
        out.push(p.grad().unwrap().to_f64_vec().unwrap());
    }
    out
}

#[test]
fn fused_and_unfused_models_agree() {
    let cpu = Cpu::device(0);
    assert_eq!(
        run::<Cpu>(&cpu, true),
        run::<Cpu>(&cpu, false),
        "cpu: bit for bit"
    );
    let r = RefDevice::default();
    let (a, b) = (run::<Reference>(&r, true), run::<Reference>(&r, false));
    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - q).abs() <= 1e-12 * q.abs().max(1.0),
                "reference: tensor {k} element {i}: fused {p} vs unfused {q}"
            );
        }
    }
}

/// A layer whose fused form fails loudly: shows when `Sequential` takes the fused path.
struct Probe;

impl Module<Cpu> for Probe {
    fn forward(&self, x: &Var<Cpu>) -> Result<Var<Cpu>> {
        Ok(x.clone())
    }
    fn named_parameters(&self) -> Vec<(String, Var<Cpu>)> {
        Vec::new()
    }
    fn describe(&self) -> String {
        "Probe()".into()
    }
    fn forward_then(&self, _: &Var<Cpu>, act: Activation) -> Option<Result<Var<Cpu>>> {
        Some(Err(Error::invalid("Probe", format!("fused with {act:?}"))))
    }
}

#[test]
fn sequential_fuses_only_known_activations_and_only_when_on() {
    let dev = Cpu::device(0);
    let x = Var::constant(Tensor::<Cpu>::ones([2, 3], DType::F32, &dev).unwrap());
    let on = Sequential::new().add(Probe).add(Relu);
    let e = on.forward(&x).unwrap_err();
    assert!(e.to_string().contains("fused with Relu"), "{e}");
    let off = Sequential::new()
        .add(Probe)
        .add(Relu)
        .with_fused_epilogues(false);
    assert!(off.forward(&x).is_ok());
    // Tanh has no epilogue: no fusion is asked for.
    assert!(Sequential::new().add(Probe).add(Tanh).forward(&x).is_ok());
    // A boxed activation is recognized too.
    let boxed: Box<dyn Module<Cpu>> = Box::new(GeluTanh);
    let mut s = Sequential::new().add(Probe);
    s.push(boxed);
    let e = s.forward(&x).unwrap_err();
    assert!(e.to_string().contains("GeluTanh"), "{e}");
}
