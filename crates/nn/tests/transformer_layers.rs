//! The transformer layers as modules (`Embedding`, `LayerNorm`, `RMSNorm`, `GeluTanh`) and
//! `train()`/`eval()`: PyTorch's parameter names and initial values, loading a PyTorch-named
//! state dict, config errors, and Dropout switched off through nested containers. On the f64
//! reference backend (the ops' values and gradients are checked in kiln-autograd's tests).

use std::collections::BTreeMap;

use kiln_autograd::Var;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::assert_close;
use kiln_core::{DType, Error, Generator, Tensor};
use kiln_nn::{
    Dropout, EmbeddingConfig, GeluTanh, LayerNormConfig, LinearConfig, Module, ModuleExt,
    RMSNormConfig, Sequential,
};

type B = Reference;
const DEV: RefDevice = RefDevice(0);

fn vals(v: &Var<B>) -> Vec<f64> {
    v.tensor().to_f64_vec().unwrap()
}

fn layers() -> Sequential<B> {
    let f64 = DType::F64;
    Sequential::new()
        .add(
            EmbeddingConfig::new(5, 4)
                .with_padding_idx(Some(1))
                .with_dtype(f64)
                .init::<B>(&DEV, &mut Generator::new(0))
                .unwrap(),
        )
        .add(
            LayerNormConfig::new([4])
                .with_dtype(f64)
                .init::<B>(&DEV)
                .unwrap(),
        )
        .add(
            LayerNormConfig::new([4])
                .with_bias(false)
                .with_dtype(f64)
                .init::<B>(&DEV)
                .unwrap(),
        )
        .add(
            LayerNormConfig::new([4])
                .with_affine(false)
                .with_dtype(f64)
                .init::<B>(&DEV)
                .unwrap(),
        )
        .add(
            RMSNormConfig::new([4])
                .with_dtype(f64)
                .init::<B>(&DEV)
                .unwrap(),
        )
        .add(
            RMSNormConfig::new([4])
                .with_affine(false)
                .with_dtype(f64)
                .init::<B>(&DEV)
                .unwrap(),
        )
}

#[test]
fn names_shapes_and_initial_values_are_pytorchs() {
    let m = layers();
    let named = m.named_parameters();
    let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["0.weight", "1.weight", "1.bias", "2.weight", "4.weight"]
    );
    for (n, p) in &named[1..] {
        assert_eq!(p.dims(), [4], "{n}");
        let want = if n.ends_with("bias") { 0.0 } else { 1.0 };
        assert_eq!(vals(p), vec![want; 4], "{n}");
    }
    // N(0, 1) with the padding row zeroed.
    let table = vals(&named[0].1);
    assert_eq!(&table[4..8], &[0.0; 4]);
    assert!(table[..4].iter().chain(&table[8..]).all(|&v| v != 0.0));
    let big = EmbeddingConfig::new(1000, 64)
        .init::<B>(&DEV, &mut Generator::new(1))
        .unwrap();
    let v = vals(&big.weight);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!(
        mean.abs() < 0.01 && (std - 1.0).abs() < 0.01,
        "{mean} {std}"
    );
    assert_eq!(big.weight.dtype(), DType::F32);
}

#[test]
fn a_pytorch_state_dict_loads_and_drives_the_forward() {
    let m = layers();
    let mut sd = BTreeMap::new();
    let table: Vec<f64> = (0..20).map(|i| i as f64 * 0.25 - 2.0).collect();
    sd.insert(
        "0.weight".to_string(),
        Tensor::<B>::from_vec(table, [5, 4], &DEV).unwrap(),
    );
    for (i, n) in ["1.weight", "1.bias", "2.weight", "4.weight"]
        .iter()
        .enumerate()
    {
        let v: Vec<f64> = (0..4).map(|j| 0.5 + (i * 4 + j) as f64 * 0.1).collect();
        sd.insert(n.to_string(), Tensor::<B>::from_vec(v, [4], &DEV).unwrap());
    }
    m.load_tensors("a PyTorch state dict", sd.clone()).unwrap();
    let ids = Tensor::<B>::from_slice(&[3i64, 1, 4], [3], &DEV).unwrap();
    let y = m.forward(&Var::constant(ids.clone())).unwrap();
    // The same layers by hand with the loaded tensors.
    let p = |n: &str| Var::constant(sd[n].clone());
    let h = p("0.weight").embedding(&ids, Some(1)).unwrap();
    let h = h
        .layer_norm(&[4], Some(&p("1.weight")), Some(&p("1.bias")), 1e-5)
        .unwrap();
    let h = h
        .layer_norm(&[4], Some(&p("2.weight")), None, 1e-5)
        .unwrap();
    let h = h.layer_norm(&[4], None, None, 1e-5).unwrap();
    let h = h
        .rms_norm(&[4], Some(&p("4.weight")), f64::EPSILON)
        .unwrap();
    let h = h.rms_norm(&[4], None, f64::EPSILON).unwrap();
    assert_eq!(vals(&y), vals(&h));
    assert_eq!(y.dims(), [3, 4]);
    // A missing bias is named.
    sd.remove("1.bias");
    let e = m.load_tensors("x", sd).unwrap_err().to_string();
    assert!(e.contains("1.bias"), "{e}");
}

#[test]
fn rms_norm_eps_defaults_to_the_dtypes_machine_epsilon() {
    let r = RMSNormConfig::new([3]).init::<B>(&DEV).unwrap();
    assert_eq!(r.eps_for(DType::F32), f32::EPSILON as f64);
    assert_eq!(r.eps_for(DType::F64), f64::EPSILON);
    assert_eq!(r.eps_for(DType::BF16), 2f64.powi(-7));
    assert_eq!(r.eps_for(DType::F16), 2f64.powi(-10));
    let r = RMSNormConfig::new([3])
        .with_eps(1e-6)
        .init::<B>(&DEV)
        .unwrap();
    assert_eq!(r.eps_for(DType::F32), 1e-6);
}

#[test]
fn gelu_tanh_is_the_tanh_formula() {
    let xs = [-3.0, -1.0, -0.25, 0.0, 0.5, 2.0, 6.0];
    let x = Var::constant(Tensor::<B>::from_slice(&xs, [7], &DEV).unwrap());
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let want: Vec<f64> = xs
        .iter()
        .map(|&x| 0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh()))
        .collect();
    assert_close(
        "gelu_tanh",
        &vals(&GeluTanh.forward(&x).unwrap()),
        &want,
        1e-14,
    );
    assert_eq!(<GeluTanh as Module<B>>::describe(&GeluTanh), "GeluTanh()");
}

#[test]
fn config_errors_are_typed() {
    let e = LayerNormConfig::new(Vec::new())
        .init::<B>(&DEV)
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("LayerNormConfig::init:"), "{e}");
    let e = LayerNormConfig::new([4])
        .with_eps(-1.0)
        .init::<B>(&DEV)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("eps"), "{e}");
    let e = RMSNormConfig::new([4])
        .with_dtype(DType::I64)
        .init::<B>(&DEV)
        .err()
        .unwrap();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = EmbeddingConfig::new(4, 2)
        .with_padding_idx(Some(4))
        .init::<B>(&DEV, &mut Generator::new(0))
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                index: 4,
                size: 4,
                ..
            }
        ),
        "{e}"
    );
    let e = EmbeddingConfig::new(0, 2)
        .init::<B>(&DEV, &mut Generator::new(0))
        .err()
        .unwrap();
    assert!(e.to_string().contains("num_embeddings=0"), "{e}");
    // A wrong input is the op's error, naming the shapes.
    let ln = LayerNormConfig::new([4])
        .with_dtype(DType::F64)
        .init::<B>(&DEV)
        .unwrap();
    let x = Var::constant(Tensor::<B>::zeros([2, 3], DType::F64, &DEV).unwrap());
    let e = ln.forward(&x).unwrap_err().to_string();
    assert!(e.starts_with("layer_norm:") && e.contains("[2, 3]"), "{e}");
}

/// A user's model: a Sequential body with a Dropout inside a nested Sequential, and a Dropout
/// field of its own, switched by `train()`/`eval()`.
struct Model {
    body: Sequential<B>,
    dropout: Dropout,
}

impl Module<B> for Model {
    fn forward(&self, x: &Var<B>) -> kiln_core::Result<Var<B>> {
        self.dropout.forward(&self.body.forward(x)?)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        self.body.named_parameters()
    }
    fn set_training(&mut self, training: bool) {
        self.body.set_training(training);
        self.dropout.set_training(training);
    }
    fn describe(&self) -> String {
        "Model".into()
    }
}

#[test]
fn eval_makes_every_dropout_the_identity_and_train_restores_it() {
    let mut g = Generator::new(3);
    let lin = LinearConfig::new(6, 6)
        .with_dtype(DType::F64)
        .init::<B>(&DEV, &mut g)
        .unwrap();
    let inner = Sequential::new().add(Dropout::new(0.5, &mut g).unwrap());
    let mut m = Model {
        body: Sequential::new().add(lin).add(inner),
        dropout: Dropout::new(0.5, &mut g).unwrap(),
    };
    let x = Var::constant(Tensor::<B>::ones([50, 6], DType::F64, &DEV).unwrap());
    let plain = vals(&m.body.layers()[0].forward(&x).unwrap());
    let zeros = |v: &[f64]| v.iter().filter(|&&v| v == 0.0).count();
    // Training (the initial mode): both dropouts drop.
    assert!(zeros(&vals(&m.forward(&x).unwrap())) > 100);
    m.eval();
    assert_eq!(vals(&m.forward(&x).unwrap()), plain);
    assert!(!m.dropout.is_training());
    m.train();
    assert!(m.dropout.is_training());
    assert!(zeros(&vals(&m.forward(&x).unwrap())) > 100);
}
