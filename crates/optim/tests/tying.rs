//! Weight tying (nanoGPT's `lm_head.weight = wte.weight`), on the f64 reference backend: the
//! tied gradient is the sum of both uses; `parameters()`, optimizers and the gradient norm see
//! the parameter once; the state dict lists both names, and a state dict with both names or
//! only one loads into the tied model.

use std::collections::BTreeMap;

use kiln_autograd::Var;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::assert_close;
use kiln_core::{DType, Error, Generator, Result, Tensor};
use kiln_nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, Module, ModuleExt};
use kiln_optim::{AdamWConfig, Optimizer, SgdConfig, grad_norm};

type B = Reference;
const DEV: RefDevice = RefDevice(0);

/// An embedding and an output layer over the same vocabulary.
struct Tiny {
    wte: Embedding<B>,
    lm_head: Linear<B>,
}

impl Tiny {
    fn new(tied: bool) -> Tiny {
        let mut g = Generator::new(0);
        let wte = EmbeddingConfig::new(5, 3)
            .with_dtype(DType::F64)
            .init::<B>(&DEV, &mut g)
            .unwrap();
        let mut lm_head = LinearConfig::new(3, 5)
            .with_bias(false)
            .with_dtype(DType::F64)
            .init::<B>(&DEV, &mut g)
            .unwrap();
        if tied {
            lm_head.tie_weight(&wte.weight).unwrap();
        } else {
            // Untied, but starting from the same values.
            lm_head
                .weight
                .set_tensor(wte.weight.tensor().contiguous().unwrap())
                .unwrap();
        }
        Tiny { wte, lm_head }
    }
}

impl Module<B> for Tiny {
    fn forward(&self, ids: &Var<B>) -> Result<Var<B>> {
        self.lm_head.forward(&self.wte.forward(ids)?)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        vec![
            ("wte.weight".into(), self.wte.weight.clone()),
            ("lm_head.weight".into(), self.lm_head.weight.clone()),
        ]
    }
    fn describe(&self) -> String {
        "Tiny".into()
    }
}

fn vals(t: &Tensor<B>) -> Vec<f64> {
    t.to_vec().unwrap()
}

/// Loss `<logits, c>` for fixed ids and cotangent.
fn backward(m: &Tiny) {
    let ids = Tensor::<B>::from_vec(vec![0i64, 3, 3, 1], [2, 2], &DEV).unwrap();
    let c = Generator::new(9)
        .randn::<B>([2, 2, 5], &DEV)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let logits = m.forward(&Var::constant(ids)).unwrap();
    logits
        .mul(&Var::constant(c))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
}

#[test]
fn tied_gradient_is_the_sum_of_both_uses() {
    let (tied, untied) = (Tiny::new(true), Tiny::new(false));
    assert!(tied.lm_head.weight.ptr_eq(&tied.wte.weight));
    assert_eq!(
        vals(&tied.wte.weight.tensor()),
        vals(&untied.lm_head.weight.tensor())
    );
    backward(&tied);
    backward(&untied);
    let sum = untied
        .wte
        .weight
        .grad()
        .unwrap()
        .add(&untied.lm_head.weight.grad().unwrap())
        .unwrap();
    let g = tied.wte.weight.grad().unwrap();
    assert_close("tied gradient", &vals(&g), &vals(&sum), 1e-12);
    // Both uses contribute (neither alone is the sum).
    let emb_only = vals(&untied.wte.weight.grad().unwrap());
    assert!(
        vals(&g)
            .iter()
            .zip(&emb_only)
            .any(|(a, b)| (a - b).abs() > 1e-6)
    );
    // The global norm counts the parameter once.
    let n = grad_norm(&tied.parameters()).unwrap();
    let want = vals(&g).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((n - want).abs() < 1e-12, "{n} vs {want}");
}

#[test]
fn tied_parameter_is_counted_and_stepped_once() {
    let m = Tiny::new(true);
    assert_eq!(m.parameters().len(), 1);
    assert_eq!(m.num_params(), 15);
    let names: Vec<String> = m.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["wte.weight", "lm_head.weight"],
        "PyTorch lists both names"
    );
    // Even given twice, an optimizer keeps one parameter and one state.
    let both: Vec<Var<B>> = m.named_parameters().into_iter().map(|(_, v)| v).collect();
    let mut opt = AdamWConfig::new(0.1)
        .with_weight_decay(0.0)
        .init(both)
        .unwrap();
    assert_eq!(opt.params().len(), 1);
    backward(&m);
    let before = vals(&m.wte.weight.tensor());
    opt.step().unwrap();
    let st = opt.state().unwrap();
    let keys: Vec<&String> = st.tensors.keys().collect();
    assert_eq!(keys, ["0.exp_avg", "0.exp_avg_sq", "0.step"]);
    // One AdamW step moves each element by about lr (the first step's |m̂ / √v̂| is 1), not 2 lr.
    let after = vals(&m.lm_head.weight.tensor());
    for (a, b) in after.iter().zip(&before) {
        let d = (a - b).abs();
        assert!((d - 0.1).abs() < 1e-3, "moved by {d}");
    }
    // SGD: one update of lr · (sum of both gradients).
    let m = Tiny::new(true);
    let mut sgd = SgdConfig::new(0.5)
        .init(vec![m.wte.weight.clone(), m.lm_head.weight.clone()])
        .unwrap();
    backward(&m);
    let (w0, g) = (
        vals(&m.wte.weight.tensor()),
        vals(&m.wte.weight.grad().unwrap()),
    );
    sgd.step().unwrap();
    let want: Vec<f64> = w0.iter().zip(&g).map(|(w, g)| w - 0.5 * g).collect();
    assert_close("sgd", &vals(&m.wte.weight.tensor()), &want, 1e-12);
}

#[test]
fn state_dicts_with_both_names_or_one_load_into_the_tied_model() {
    let m = Tiny::new(true);
    let new = Generator::new(4)
        .randn::<B>([5, 3], &DEV)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    // Both names, as PyTorch's state_dict() holds them.
    let both: BTreeMap<String, Tensor<B>> = [
        ("wte.weight".to_string(), new.clone()),
        ("lm_head.weight".to_string(), new.clone()),
    ]
    .into();
    m.load_tensors("both", both).unwrap();
    assert_eq!(vals(&m.lm_head.weight.tensor()), vals(&new));
    assert!(
        m.lm_head.weight.ptr_eq(&m.wte.weight),
        "still tied after loading"
    );
    // One name only (a file written without duplicates).
    let other = new.mul_scalar(2.0).unwrap();
    m.load_tensors(
        "one",
        [("lm_head.weight".to_string(), other.clone())].into(),
    )
    .unwrap();
    assert_eq!(vals(&m.wte.weight.tensor()), vals(&other));
    // Neither: both names are missing.
    match m.load_tensors("none", BTreeMap::new()) {
        Err(Error::InvalidArgument { msg, .. }) => {
            assert!(
                msg.contains("`wte.weight`") && msg.contains("`lm_head.weight`"),
                "{msg}"
            )
        }
        r => panic!("expected a missing-tensor error, got {:?}", r.err()),
    }
    // Through a file: saved with both names, loaded back.
    let path = std::env::temp_dir().join(format!("kiln-tied-{}.safetensors", std::process::id()));
    m.save(&path).unwrap();
    let fresh = Tiny::new(true);
    fresh.load(&path).unwrap();
    assert_eq!(vals(&fresh.wte.weight.tensor()), vals(&other));
    std::fs::remove_file(&path).ok();
}

#[test]
fn tie_weight_checks_shape_and_dtype() {
    let mut g = Generator::new(0);
    let mut lin = LinearConfig::new(3, 5).init::<B>(&DEV, &mut g).unwrap();
    let wrong = EmbeddingConfig::new(3, 5).init::<B>(&DEV, &mut g).unwrap();
    assert!(matches!(
        lin.tie_weight(&wrong.weight),
        Err(Error::InvalidArgument {
            op: "Linear::tie_weight",
            ..
        })
    ));
    let f64_emb = EmbeddingConfig::new(5, 3)
        .with_dtype(DType::F64)
        .init::<B>(&DEV, &mut g)
        .unwrap();
    assert!(lin.tie_weight(&f64_emb.weight).is_err());
    assert!(
        !lin.weight.ptr_eq(&f64_emb.weight),
        "unchanged after an error"
    );
}
