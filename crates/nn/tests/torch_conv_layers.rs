//! Grouped and depthwise `conv2d`, and `BatchNorm2d`'s running statistics over two training
//! steps, against PyTorch in float64: the `layer` lines of kiln-autograd's
//! `tests/data/torch_f64.txt` that `torch_golden.py` writes (its `CONVS`, and the
//! `batch_norm_train_4d` case). A case the file lacks is skipped with a message naming it
//! (the file is regenerated where PyTorch is installed), not failed.

use std::collections::HashMap;

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Tensor};
use kiln_nn::{BatchNormConfig, Module, Window, conv2d_grouped};

const DATA: &str = include_str!("../../autograd/tests/data/torch_f64.txt");

const CONVS: &[&str] = &[
    "conv2d_groups2",
    "conv2d_depthwise",
    "conv2d_depthwise_dilated",
];

type Fields = HashMap<String, Vec<String>>;

fn cases() -> HashMap<String, Fields> {
    let mut m: HashMap<String, Fields> = HashMap::new();
    for l in DATA.lines().filter_map(|l| l.strip_prefix("layer ")) {
        let mut w = l.split_whitespace().map(str::to_string);
        let (Some(case), Some(field)) = (w.next(), w.next()) else {
            panic!("malformed line: layer {l}");
        };
        m.entry(case).or_default().insert(field, w.collect());
    }
    m
}

fn nums(f: &Fields, case: &str, field: &str) -> Vec<f64> {
    f.get(field)
        .unwrap_or_else(|| panic!("{case}: no `{field}` line"))
        .iter()
        .map(|w| w.parse().unwrap())
        .collect()
}

fn dims(w: &str) -> Vec<usize> {
    w.split(',').map(|d| d.parse().unwrap()).collect()
}

fn compare(bad: &mut Vec<String>, what: String, got: &[f64], want: &[f64]) {
    if got.len() != want.len() {
        bad.push(format!(
            "{what}: {} values, PyTorch {}",
            got.len(),
            want.len()
        ));
        return;
    }
    let close = |g: f64, w: f64| (g - w).abs() <= 1e-12 + 1e-10 * w.abs();
    if let Some(i) = (0..got.len()).find(|&i| !close(got[i], want[i])) {
        bad.push(format!("{what}[{i}] = {} (PyTorch {})", got[i], want[i]));
    }
}

fn host<B: Backend>(t: &Tensor<B>) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

fn skipped(case: &str) {
    eprintln!(
        "skipped: {case}: no PyTorch values in kiln-autograd's data/torch_f64.txt (regenerate it \
         with torch_golden.py where PyTorch is installed)"
    );
}

fn convs<B: Backend>(dev: &B::Device, all: &HashMap<String, Fields>, bad: &mut Vec<String>) {
    for &case in CONVS {
        let Some(f) = all.get(case) else {
            skipped(case);
            continue;
        };
        let spec = &f["spec"];
        let (xd, wd) = (dims(&spec[1]), dims(&spec[2]));
        let has_b = spec[3] == "1";
        let p = |i: usize| spec[i].parse::<usize>().unwrap();
        let (stride, pad, dil, groups) = (p(4), p(5), p(6), p(7));
        let var = |field: &str, d: &[usize]| {
            Var::param(Tensor::<B>::from_vec(nums(f, case, field), d.to_vec(), dev).unwrap())
        };
        let x = var("x", &xd);
        let w = var("w", &wd);
        let b = has_b.then(|| var("b", &[wd[0]]));
        let win = Window {
            kernel: [wd[2], wd[3]],
            stride: [stride; 2],
            padding: [pad; 2],
            dilation: [dil; 2],
        };
        let y = conv2d_grouped(&x, &w, b.as_ref(), win, groups).unwrap();
        let g = Tensor::<B>::from_vec(nums(f, case, "g"), y.dims().to_vec(), dev).unwrap();
        y.mul(&Var::constant(g))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let at = |field: &str| format!("{case} {field} on {}", B::NAME);
        compare(bad, at("y"), &host(&y.tensor()), &nums(f, case, "y"));
        for (v, field) in [(Some(&x), "dx"), (Some(&w), "dw"), (b.as_ref(), "db")] {
            if let Some(v) = v {
                compare(
                    bad,
                    at(field),
                    &host(&v.grad().unwrap()),
                    &nums(f, case, field),
                );
            }
        }
    }
}

/// `BatchNorm2d` (momentum 0.1) with PyTorch's weight and bias: the first step's output and
/// the running statistics after the second.
fn batch_norm_module<B: Backend>(
    dev: &B::Device,
    all: &HashMap<String, Fields>,
    bad: &mut Vec<String>,
) {
    let case = "batch_norm_train_4d";
    let Some(f) = all.get(case) else {
        skipped(case);
        return;
    };
    let xd = dims(&f["spec"][1]);
    let c = xd[1];
    let bn = BatchNormConfig::new(c)
        .with_dtype(DType::F64)
        .init_2d::<B>(dev)
        .unwrap();
    let t = |field: &str, d: &[usize]| {
        Tensor::<B>::from_vec(nums(f, case, field), d.to_vec(), dev).unwrap()
    };
    bn.weight
        .as_ref()
        .unwrap()
        .set_tensor(t("w", &[c]))
        .unwrap();
    bn.bias.as_ref().unwrap().set_tensor(t("b", &[c])).unwrap();
    let y = bn.forward(&Var::constant(t("x", &xd))).unwrap();
    bn.forward(&Var::constant(t("x2", &xd))).unwrap();
    let at = |field: &str| format!("BatchNorm2d {case} {field} on {}", B::NAME);
    compare(bad, at("y"), &host(&y.tensor()), &nums(f, case, "y"));
    let buf = |v: &Option<Var<B>>| host(&v.as_ref().unwrap().tensor());
    compare(
        bad,
        at("running_mean"),
        &buf(&bn.running_mean),
        &nums(f, case, "running_mean"),
    );
    compare(
        bad,
        at("running_var"),
        &buf(&bn.running_var),
        &nums(f, case, "running_var"),
    );
}

fn check_all<B: Backend>(dev: &B::Device) {
    let all = cases();
    let mut bad = Vec::new();
    convs::<B>(dev, &all, &mut bad);
    batch_norm_module::<B>(dev, &all, &mut bad);
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn conv_layers_match_pytorch_f64_on_the_reference() {
    check_all::<Reference>(&RefDevice(0));
}

#[test]
fn conv_layers_match_pytorch_f64_on_the_cpu() {
    check_all::<Cpu>(&Cpu::device(0));
}
