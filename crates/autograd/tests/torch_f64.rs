//! Every op of kiln-core's op tables against PyTorch in float64: the forward and the gradient
//! (from `torch.autograd`) at fixed points, read from `data/torch_f64.txt`, which
//! `torch_golden.py` writes. Checked on the f64 reference backend and on the CPU backend. An op of
//! the table without lines in the file fails the test: add it to `torch_golden.py` and run it.

use std::collections::HashMap;

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, CompositeOp, Tensor, UnaryOp};

const DATA: &str = include_str!("data/torch_f64.txt");

/// `(x, y, dy/dx)` points.
type Points = Vec<(f64, f64, f64)>;
/// `(param, x, y, dy/dx)` lines per op name.
type Golden = HashMap<String, Vec<(Option<f64>, f64, f64, f64)>>;

fn golden() -> Golden {
    let mut g: Golden = HashMap::new();
    for line in DATA
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 5, "malformed line: {line}");
        let num = |s: &str| {
            s.parse::<f64>()
                .unwrap_or_else(|e| panic!("{s}: {e} in {line}"))
        };
        let param = (f[1] != "-").then(|| num(f[1]));
        g.entry(f[0].to_string())
            .or_default()
            .push((param, num(f[2]), num(f[3]), num(f[4])));
    }
    g
}

fn close(got: f64, want: f64) -> bool {
    (got.is_nan() && want.is_nan()) || (got - want).abs() <= 1e-12 + 1e-9 * want.abs()
}

/// Checks `f` (an op as a function of a variable) against PyTorch's points for `name`.
fn check_op<B: Backend>(
    dev: &B::Device,
    name: &str,
    points: &[(Option<f64>, f64, f64, f64)],
    f: impl Fn(&Var<B>, Option<f64>) -> kiln_core::Result<Var<B>>,
) -> Vec<String> {
    let mut by_param: Vec<(Option<f64>, Points)> = Vec::new();
    for &(p, x, y, d) in points {
        match by_param.iter_mut().find(|(q, _)| *q == p) {
            Some((_, v)) => v.push((x, y, d)),
            None => by_param.push((p, vec![(x, y, d)])),
        }
    }
    let mut bad = Vec::new();
    for (p, pts) in by_param {
        let xs: Vec<f64> = pts.iter().map(|t| t.0).collect();
        let n = xs.len();
        let x = Var::param(Tensor::<B>::from_vec(xs.clone(), [n], dev).unwrap());
        let y = f(&x, p).unwrap_or_else(|e| panic!("{name}: {e}"));
        y.sum_all().unwrap().backward().unwrap();
        let got_y = y.tensor().to_vec::<f64>().unwrap();
        let got_d = x.grad().expect("a gradient").to_vec::<f64>().unwrap();
        for (i, &(xi, yi, di)) in pts.iter().enumerate() {
            if !close(got_y[i], yi) {
                bad.push(format!("{name}({xi}, {p:?}) = {} (PyTorch {yi})", got_y[i]));
            }
            if !close(got_d[i], di) {
                bad.push(format!(
                    "{name}'({xi}, {p:?}) = {} (PyTorch {di})",
                    got_d[i]
                ));
            }
        }
    }
    bad
}

fn check_all<B: Backend>(dev: &B::Device) {
    let g = golden();
    let mut bad = Vec::new();
    for op in UnaryOp::ALL {
        let Some(points) = g.get(op.name()) else {
            bad.push(format!(
                "{}: no PyTorch values (run torch_golden.py)",
                op.name()
            ));
            continue;
        };
        bad.extend(check_op::<B>(dev, op.name(), points, |x, _| x.unary(op)));
    }
    for &op in CompositeOp::ALL {
        let Some(points) = g.get(op.name()) else {
            bad.push(format!(
                "{}: no PyTorch values (run torch_golden.py)",
                op.name()
            ));
            continue;
        };
        bad.extend(check_op::<B>(dev, op.name(), points, |x, p| {
            x.composite(op, &[p.expect("a parameter")])
        }));
    }
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn table_ops_match_pytorch_f64_on_the_reference() {
    check_all::<Reference>(&RefDevice(0));
}

#[test]
fn table_ops_match_pytorch_f64_on_the_cpu() {
    check_all::<Cpu>(&Cpu::device(0));
}
