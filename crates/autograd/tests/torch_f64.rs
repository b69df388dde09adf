//! Every op of kiln-core's op tables against PyTorch in float64: the forward and the gradients
//! (from `torch.autograd`) at fixed points, read from `data/torch_f64.txt`, which
//! `torch_golden.py` writes: unary and composite ops on a grid, binary ops on pairs of values
//! (ties and zeros included) between two tensors and against a constant on either side. Checked
//! on the f64 reference backend and on the CPU backend. An op of the tables without lines in
//! the file fails the test: add it to `torch_golden.py` and run it. (The layers' ops, the
//! `layer` lines, are checked in `torch_f64_layers.rs`.)

use std::collections::HashMap;

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, BinaryOp, CompositeOp, Tensor, UnaryOp};

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
        .filter(|l| {
            !["binary ", "scalar ", "layer "]
                .iter()
                .any(|t| l.starts_with(t))
        })
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
    got == want
        || (got.is_nan() && want.is_nan())
        || (got - want).abs() <= 1e-12 + 1e-9 * want.abs()
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
    bad.extend(check_binary::<B>(dev));
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// The numbers of the lines starting with `tag` and then `name`, after those two words.
fn rows(tag: &str, name: &str) -> Vec<Vec<f64>> {
    DATA.lines()
        .filter_map(|l| {
            l.strip_prefix(tag)?
                .strip_prefix(' ')?
                .strip_prefix(name)?
                .strip_prefix(' ')
        })
        .map(|rest| {
            rest.split_whitespace()
                .map(|w| match w {
                    "a" => 0.0,
                    "b" => 1.0,
                    w => w.parse().unwrap_or_else(|e| panic!("{w}: {e}")),
                })
                .collect()
        })
        .collect()
}

/// Checks `got` against `want` column by column; `what` names each value.
fn compare(bad: &mut Vec<String>, what: &dyn Fn(usize) -> String, got: &[f64], want: &[f64]) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !close(g, w) {
            bad.push(format!("{} = {g} (PyTorch {w})", what(i)));
        }
    }
}

/// Every float binary op of the table: `op(a, b)` of two variables (both gradients) and
/// `op(x, c)` / `op(c, x)` of a variable and a constant.
fn check_binary<B: Backend>(dev: &B::Device) -> Vec<String> {
    let mut bad = Vec::new();
    let col = |r: &[Vec<f64>], k: usize| r.iter().map(|v| v[k]).collect::<Vec<f64>>();
    let var = |v: Vec<f64>| Var::param(Tensor::<B>::from_vec(v.clone(), [v.len()], dev).unwrap());
    let vals = |v: &Var<B>| v.tensor().to_vec::<f64>().unwrap();
    let grad = |v: &Var<B>| v.grad().expect("a gradient").to_vec::<f64>().unwrap();
    for op in BinaryOp::ALL {
        let name = op.name();
        let r = rows("binary", name);
        if r.is_empty() {
            bad.push(format!("{name}: no PyTorch values (run torch_golden.py)"));
            continue;
        }
        let (a, b) = (var(col(&r, 0)), var(col(&r, 1)));
        let y = a.binary(op, &b).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        let at = |i: usize| format!("({}, {})", r[i][0], r[i][1]);
        compare(
            &mut bad,
            &|i| format!("{name}{}", at(i)),
            &vals(&y),
            &col(&r, 2),
        );
        compare(
            &mut bad,
            &|i| format!("d{name}/da{}", at(i)),
            &grad(&a),
            &col(&r, 3),
        );
        compare(
            &mut bad,
            &|i| format!("d{name}/db{}", at(i)),
            &grad(&b),
            &col(&r, 4),
        );
        // Against a constant: rows (side, c, x, y, dy/dx), side 0 for `op(x, c)`.
        let r = rows("scalar", name);
        if r.is_empty() {
            bad.push(format!("{name}: no PyTorch values with a constant"));
            continue;
        }
        let mut groups: Vec<(f64, f64, Vec<&Vec<f64>>)> = Vec::new();
        for row in &r {
            match groups.iter_mut().find(|g| g.0 == row[0] && g.1 == row[1]) {
                Some(g) => g.2.push(row),
                None => groups.push((row[0], row[1], vec![row])),
            }
        }
        for (side, c, rows) in groups {
            let x = var(rows.iter().map(|v| v[2]).collect());
            let y = if side == 0.0 {
                x.binary_scalar(op, c)
            } else {
                x.scalar_binary(op, c)
            }
            .unwrap();
            y.sum_all().unwrap().backward().unwrap();
            let form = |i: usize| {
                let xi = rows[i][2];
                if side == 0.0 {
                    format!("{name}({xi}, const {c})")
                } else {
                    format!("{name}(const {c}, {xi})")
                }
            };
            let want = |k: usize| rows.iter().map(|v| v[k]).collect::<Vec<f64>>();
            compare(&mut bad, &|i| form(i), &vals(&y), &want(3));
            compare(
                &mut bad,
                &|i| format!("d/dx {}", form(i)),
                &grad(&x),
                &want(4),
            );
        }
    }
    bad
}

#[test]
fn table_ops_match_pytorch_f64_on_the_reference() {
    check_all::<Reference>(&RefDevice(0));
}

#[test]
fn table_ops_match_pytorch_f64_on_the_cpu() {
    check_all::<Cpu>(&Cpu::device(0));
}
