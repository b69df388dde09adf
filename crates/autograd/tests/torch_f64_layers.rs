//! The layers' ops (`layer_norm`, `rms_norm`, `embedding`, `batch_norm` in both modes with the
//! running statistics after two steps, `group_norm`, `avg_pool2d`, `adaptive_avg_pool2d`)
//! against PyTorch in float64: the
//! `layer` lines of `data/torch_f64.txt`, which `torch_golden.py` writes (fixed inputs, the
//! cotangent, PyTorch's output and gradients). Checked on the f64 reference backend and the CPU
//! backend. A case of [`CASES`] that the file lacks is skipped with a message naming it (the
//! file is regenerated where PyTorch is installed), not failed; a malformed one fails.

use std::collections::HashMap;

use kiln_autograd::{Var, update_running_stats};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Tensor};

const DATA: &str = include_str!("data/torch_f64.txt");

/// The cases `torch_golden.py` writes (its `NORMS`, `EMBEDDINGS`, `CHANNEL_NORMS` and `POOLS`;
/// its `CONVS` are kiln-nn's).
const CASES: &[&str] = &[
    "batch_norm_train_4d",
    "batch_norm_train_2d",
    "batch_norm_train_3d_plain",
    "batch_norm_eval",
    "group_norm_2",
    "group_norm_1_plain",
    "group_norm_depth",
    "avg_pool2d_k3s2p1",
    "avg_pool2d_exclude_pad",
    "avg_pool2d_k2",
    "adaptive_avg_pool2d_3x4",
    "adaptive_avg_pool2d_1x1",
    "adaptive_avg_pool2d_5x5",
    "layer_norm_wb",
    "layer_norm_w",
    "layer_norm_b",
    "layer_norm_2d",
    "layer_norm_plain",
    "rms_norm_w",
    "rms_norm_plain",
    "embedding",
    "embedding_padding",
];

/// case -> field -> the words after it.
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
        .map(|w| {
            w.parse()
                .unwrap_or_else(|e| panic!("{case} {field}: {w}: {e}"))
        })
        .collect()
}

/// `3,5` -> [3, 5]; `-` -> [].
fn dims(w: &str) -> Vec<usize> {
    if w == "-" {
        return Vec::new();
    }
    w.split(',').map(|d| d.parse().unwrap()).collect()
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-12 + 1e-10 * want.abs()
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
    if let Some(i) = (0..got.len()).find(|&i| !close(got[i], want[i])) {
        bad.push(format!("{what}[{i}] = {} (PyTorch {})", got[i], want[i]));
    }
}

fn var<B: Backend>(v: Vec<f64>, d: &[usize], dev: &B::Device) -> Var<B> {
    Var::param(Tensor::<B>::from_vec(v, d.to_vec(), dev).unwrap())
}

fn host<B: Backend>(t: &Tensor<B>) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

/// Runs one case on `dev`; mismatches go to `bad`.
fn check_case<B: Backend>(dev: &B::Device, case: &str, f: &Fields, bad: &mut Vec<String>) {
    let spec = &f[&"spec".to_string()];
    let op = spec[0].as_str();
    let at = |field: &str| format!("{case} {field} on {}", B::NAME);
    if op == "embedding" {
        let (td, id_dims, pad) = (
            dims(&spec[1]),
            dims(&spec[2]),
            spec[3].parse::<i64>().unwrap(),
        );
        let ids: Vec<i64> = f["ids"].iter().map(|w| w.parse().unwrap()).collect();
        let ids = Tensor::<B>::from_vec(ids, id_dims, dev).unwrap();
        let w = var::<B>(nums(f, case, "w"), &td, dev);
        let y = w
            .embedding(&ids, (pad >= 0).then_some(pad as usize))
            .unwrap();
        let g = Tensor::<B>::from_vec(nums(f, case, "g"), y.dims().to_vec(), dev).unwrap();
        y.mul(&Var::constant(g))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        compare(bad, at("y"), &host(&y.tensor()), &nums(f, case, "y"));
        compare(
            bad,
            at("dw"),
            &host(&w.grad().unwrap()),
            &nums(f, case, "dw"),
        );
        return;
    }
    if op.starts_with("batch_norm") || op == "group_norm" {
        return check_channel_norm::<B>(dev, case, f, bad);
    }
    if op.ends_with("avg_pool2d") {
        return check_pool::<B>(dev, case, f, bad);
    }
    let (xd, nd) = (dims(&spec[1]), dims(&spec[2]));
    let (has_w, has_b) = (spec[3] == "1", spec[4] == "1");
    let eps: f64 = spec[5].parse().unwrap();
    let x = var::<B>(nums(f, case, "x"), &xd, dev);
    let w = has_w.then(|| var::<B>(nums(f, case, "w"), &nd, dev));
    let b = has_b.then(|| var::<B>(nums(f, case, "b"), &nd, dev));
    let y = match op {
        "layer_norm" => x.layer_norm(&nd, w.as_ref(), b.as_ref(), eps),
        "rms_norm" => x.rms_norm(&nd, w.as_ref(), eps),
        _ => panic!("{case}: unknown op {op}"),
    }
    .unwrap();
    let g = Tensor::<B>::from_vec(nums(f, case, "g"), xd, dev).unwrap();
    y.mul(&Var::constant(g))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    compare(bad, at("y"), &host(&y.tensor()), &nums(f, case, "y"));
    compare(
        bad,
        at("dx"),
        &host(&x.grad().unwrap()),
        &nums(f, case, "dx"),
    );
    for (p, field) in [(&w, "dw"), (&b, "db")] {
        if let Some(p) = p {
            compare(
                bad,
                at(field),
                &host(&p.grad().unwrap()),
                &nums(f, case, field),
            );
        }
    }
}

/// `y · g` summed and differentiated: the output's values and the gradients of `vars`.
fn backward_of<B: Backend>(y: &Var<B>, f: &Fields, case: &str, dev: &B::Device) {
    let g = Tensor::<B>::from_vec(nums(f, case, "g"), y.dims().to_vec(), dev).unwrap();
    y.mul(&Var::constant(g))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
}

/// batch_norm (training: output, gradients, and the running statistics after a second batch;
/// evaluation) and group_norm.
fn check_channel_norm<B: Backend>(dev: &B::Device, case: &str, f: &Fields, bad: &mut Vec<String>) {
    let spec = &f["spec"];
    let op = spec[0].as_str();
    let at = |field: &str| format!("{case} {field} on {}", B::NAME);
    let xd = dims(&spec[1]);
    let c = xd[1];
    let (has_w, has_b) = (spec[2] == "1", spec[3] == "1");
    let eps: f64 = spec[4].parse().unwrap();
    let groups: i64 = spec[5].parse().unwrap();
    let x = var::<B>(nums(f, case, "x"), &xd, dev);
    let w = has_w.then(|| var::<B>(nums(f, case, "w"), &[c], dev));
    let b = has_b.then(|| var::<B>(nums(f, case, "b"), &[c], dev));
    let t = |field: &str| Tensor::<B>::from_vec(nums(f, case, field), [c], dev).unwrap();
    let y = match op {
        "batch_norm_train" => {
            let (y, st) = x.batch_norm_train(w.as_ref(), b.as_ref(), eps).unwrap();
            // The running statistics from zeros and ones after this batch and `x2`.
            let zeros = Tensor::<B>::zeros([c], DType::F64, dev).unwrap();
            let ones = Tensor::<B>::ones([c], DType::F64, dev).unwrap();
            let (rm, rv) = update_running_stats(&zeros, &ones, &st, 0.1).unwrap();
            let x2 = var::<B>(nums(f, case, "x2"), &xd, dev);
            let (_, st2) = x2.batch_norm_train(w.as_ref(), b.as_ref(), eps).unwrap();
            let (rm, rv) = update_running_stats(&rm, &rv, &st2, 0.1).unwrap();
            compare(
                bad,
                at("running_mean"),
                &host(&rm),
                &nums(f, case, "running_mean"),
            );
            compare(
                bad,
                at("running_var"),
                &host(&rv),
                &nums(f, case, "running_var"),
            );
            y
        }
        "batch_norm_eval" => x
            .batch_norm_eval(&t("rm"), &t("rv"), w.as_ref(), b.as_ref(), eps)
            .unwrap(),
        "group_norm" => x
            .group_norm(groups as usize, w.as_ref(), b.as_ref(), eps)
            .unwrap(),
        _ => panic!("{case}: unknown op {op}"),
    };
    backward_of(&y, f, case, dev);
    compare(bad, at("y"), &host(&y.tensor()), &nums(f, case, "y"));
    compare(
        bad,
        at("dx"),
        &host(&x.grad().unwrap()),
        &nums(f, case, "dx"),
    );
    for (p, field) in [(&w, "dw"), (&b, "db")] {
        if let Some(p) = p {
            compare(
                bad,
                at(field),
                &host(&p.grad().unwrap()),
                &nums(f, case, field),
            );
        }
    }
}

/// avg_pool2d and adaptive_avg_pool2d: output and input gradient.
fn check_pool<B: Backend>(dev: &B::Device, case: &str, f: &Fields, bad: &mut Vec<String>) {
    let spec = &f["spec"];
    let at = |field: &str| format!("{case} {field} on {}", B::NAME);
    let pair = |w: &str| -> [usize; 2] {
        let d = dims(w);
        [d[0], d[1]]
    };
    let x = var::<B>(nums(f, case, "x"), &dims(&spec[1]), dev);
    let y = if spec[0] == "avg_pool2d" {
        x.avg_pool2d(
            pair(&spec[2]),
            pair(&spec[3]),
            pair(&spec[4]),
            spec[5] == "1",
        )
    } else {
        x.adaptive_avg_pool2d(pair(&spec[2]))
    }
    .unwrap();
    backward_of(&y, f, case, dev);
    compare(bad, at("y"), &host(&y.tensor()), &nums(f, case, "y"));
    compare(
        bad,
        at("dx"),
        &host(&x.grad().unwrap()),
        &nums(f, case, "dx"),
    );
}

fn check_all<B: Backend>(dev: &B::Device) {
    let all = cases();
    let mut bad = Vec::new();
    for &case in CASES {
        let Some(f) = all.get(case) else {
            eprintln!(
                "skipped: {case}: no PyTorch values in data/torch_f64.txt (regenerate it with \
                 torch_golden.py where PyTorch is installed)"
            );
            continue;
        };
        check_case::<B>(dev, case, f, &mut bad);
    }
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn layer_ops_match_pytorch_f64_on_the_reference() {
    check_all::<Reference>(&RefDevice(0));
}

#[test]
fn layer_ops_match_pytorch_f64_on_the_cpu() {
    check_all::<Cpu>(&Cpu::device(0));
}
