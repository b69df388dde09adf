//! Fused expression programs against the same chain op by op (issue 13's CPU target; numpy's
//! side is `bench/fuse_numpy.py`, same workload, same sizes; `bash bench/fuse_compare.sh` runs
//! both alternately):
//!
//! - `chain5_32m`: `exp(a * b + 1) * 0.5 - b` over two 32M-element f32 vectors, five ops:
//!   - `op_by_op`: five `Tensor` ops with deferral off (`set_fusion(false)`), each a kernel
//!     that reads and writes 128 MiB;
//!   - `deferred`: the same five `Tensor` ops as users write them, deferral on (the default),
//!     then `realize`: recorded, then run as one program (`lazy.rs`);
//!   - `fused`: one program written with `Expr`, one pass (`Program::run` → `Backend::eval_expr`);
//! - `mul_32m`: `a * b` alone, fused and as the built-in kernel: the memory floor of the
//!   chain (both read 256 MiB and write 128 MiB);
//! - `lse_rows_4096x4096`: a row-wise log-sum-exp `log(sum(exp(x - m))) + m` given the row
//!   maxima `m`, fused (one pass, post-map included), op by op, and deferred (the same tensor
//!   ops: `x - m`, `exp` and the row sum run as one pass, the rest on 4096 elements at once).
//!
//! - `adam_512k` and `sgd_momentum_78400` (the first weight of the 784-100-100-10 MLP):
//!   `program`, the rule's expression program (`UpdateRule::program`) run through the fused
//!   evaluator; `fused_update`, `Tensor::fused_update` (on the CPU the same program, through
//!   `Backend::fused_update`'s default); and `hand_loop`, the one-pass loop the CPU backend
//!   carried before (`src/optim.rs` until the IR replaced it) written over bare vectors.
//!
//! kiln's results are allocated through the backend's buffer cache on both sides.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_backend_cpu::{Cpu, set_fusion};
use kiln_core::expr::{Expr, Program};
use kiln_core::{DType, Tensor, UpdateRule};
use std::hint::black_box;

fn benches(c: &mut Criterion) {
    let dev = Cpu::device(0);
    let n = 32 << 20;
    let a = Tensor::<Cpu>::rand([n], 0.0, 1.0, 1, DType::F32, &dev).unwrap();
    let b = Tensor::<Cpu>::rand([n], 0.0, 1.0, 2, DType::F32, &dev).unwrap();
    let (x, y) = (Expr::input(0), Expr::input(1));
    let chain = ((&x * &y + 1.0).exp() * 0.5) - &y;
    let p = Program::from_exprs(&[DType::F32, DType::F32], &[chain]).unwrap();
    let mut g = c.benchmark_group("chain5_32m");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    let tensor_chain = || {
        let t = a.mul(&b).unwrap().add_scalar(1.0).unwrap().exp().unwrap();
        let y = t.mul_scalar(0.5).unwrap().sub(&b).unwrap();
        y.realize().unwrap();
        y
    };
    set_fusion(false);
    g.bench_function("op_by_op", |bch| bch.iter(|| black_box(tensor_chain())));
    set_fusion(true);
    g.bench_function("deferred", |bch| bch.iter(|| black_box(tensor_chain())));
    g.bench_function("fused", |bch| {
        bch.iter(|| black_box(p.run(&[&a, &b], &[]).unwrap()))
    });
    g.finish();

    // The memory floor: one multiply, fused (one program) and as the built-in kernel.
    let prod = Program::from_exprs(&[DType::F32, DType::F32], &[&x * &y]).unwrap();
    let mut g = c.benchmark_group("mul_32m");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    g.bench_function("op", |bch| {
        bch.iter(|| {
            let y = a.mul(&b).unwrap();
            y.realize().unwrap();
            black_box(y)
        })
    });
    g.bench_function("fused", |bch| {
        bch.iter(|| black_box(prod.run(&[&a, &b], &[]).unwrap()))
    });
    g.finish();

    let r = 4096;
    let s = Tensor::<Cpu>::rand([r, r], -5.0, 5.0, 3, DType::F32, &dev).unwrap();
    let m = s.max(&[1], true).unwrap();
    let (x, mx) = (Expr::input(0), Expr::input(1));
    let lse = (&x - &mx).exp().sum(&[1]).log() + &mx;
    let p = Program::from_exprs(&[DType::F32, DType::F32], &[lse]).unwrap();
    let mut g = c.benchmark_group("lse_rows_4096x4096");
    g.throughput(Throughput::Elements((r * r) as u64));
    g.sample_size(10);
    let tensor_lse = || {
        let e = s.sub(&m).unwrap().exp().unwrap().sum(&[1], true).unwrap();
        let y = e.log().unwrap().add(&m).unwrap();
        y.realize().unwrap();
        y
    };
    set_fusion(false);
    g.bench_function("op_by_op", |bch| bch.iter(|| black_box(tensor_lse())));
    set_fusion(true);
    g.bench_function("deferred", |bch| bch.iter(|| black_box(tensor_lse())));
    g.bench_function("fused", |bch| {
        bch.iter(|| black_box(p.run(&[&s, &m], &[]).unwrap()))
    });
    g.finish();
}

/// The Adam update the CPU backend once wrote by hand (`optim.rs` before the IR), one pass.
fn adam_loop(p: &[f32], g: &[f32], m0: &[f32], v0: &[f32], c: [f32; 7]) -> [Vec<f32>; 3] {
    let [b1, b1c, b2, b2c, inv_bc2, eps, step] = c;
    let n = p.len();
    let (mut pn, mut mn, mut vn) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let outs = pn.iter_mut().zip(mn.iter_mut()).zip(vn.iter_mut());
    let ins = p.iter().zip(g).zip(m0.iter().zip(v0));
    for (((pn, mn), vn), ((&p, &g), (&m0, &v0))) in outs.zip(ins) {
        let m = m0 * b1 + g * b1c;
        let v = v0 * b2 + (g * g) * b2c;
        *mn = m;
        *vn = v;
        *pn = p - (m / (v.sqrt() * inv_bc2 + eps)) * step;
    }
    [pn, mn, vn]
}

/// SGD with momentum, as the CPU backend once wrote it by hand.
fn sgd_loop(p: &[f32], g: &[f32], m0: &[f32], lr: f32, mom: f32, damp1: f32) -> [Vec<f32>; 2] {
    let n = p.len();
    let (mut pn, mut mn) = (vec![0.0; n], vec![0.0; n]);
    for (((pn, mn), (&p, &g)), &m0) in pn
        .iter_mut()
        .zip(mn.iter_mut())
        .zip(p.iter().zip(g))
        .zip(m0)
    {
        let m = m0 * mom + g * damp1;
        *mn = m;
        *pn = p - m * lr;
    }
    [pn, mn]
}

fn updates(c: &mut Criterion) {
    let dev = Cpu::device(0);
    let t = |n: usize, seed: u64, lo: f64| {
        Tensor::<Cpu>::rand([n], lo, 1.0, seed, DType::F32, &dev).unwrap()
    };
    // Below the old hand-written path's parallel threshold (2^20): one core on that side.
    let n = 1 << 19;
    let (p, g, m, v) = (t(n, 1, -1.0), t(n, 2, -1.0), t(n, 3, -1.0), t(n, 4, 0.1));
    let (beta1, beta2, lr, eps) = (0.9f64, 0.999f64, 1e-3f64, 1e-8f64);
    let (bc1, bc2) = (1.0 - beta1.powi(3), 1.0 - beta2.powi(3));
    let rule = UpdateRule::Adam {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay: 0.0,
        decoupled: false,
        bias_correction1: bc1,
        bias_correction2: bc2,
    };
    let (ps, gs, ms, vs) = (
        p.to_vec::<f32>().unwrap(),
        g.to_vec::<f32>().unwrap(),
        m.to_vec::<f32>().unwrap(),
        v.to_vec::<f32>().unwrap(),
    );
    let consts = [
        beta1 as f32,
        (1.0 - beta1) as f32,
        beta2 as f32,
        (1.0 - beta2) as f32,
        (1.0 / bc2.sqrt()) as f32,
        eps as f32,
        (lr / bc1) as f32,
    ];
    let mut grp = c.benchmark_group("adam_512k");
    grp.throughput(Throughput::Elements(n as u64));
    grp.bench_function("fused_update", |bch| {
        bch.iter(|| {
            let st = vec![vec![m.clone(), v.clone()]];
            black_box(
                Tensor::fused_update(
                    &rule,
                    std::slice::from_ref(&p),
                    std::slice::from_ref(&g),
                    &st,
                )
                .unwrap(),
            )
        })
    });
    grp.bench_function("hand_loop", |bch| {
        bch.iter(|| black_box(adam_loop(&ps, &gs, &ms, &vs, consts)))
    });
    let (prog, params) = rule.program(DType::F32).unwrap();
    grp.bench_function("program", |bch| {
        bch.iter(|| black_box(prog.run(&[&p, &g, &m, &v], &params).unwrap()))
    });
    grp.finish();

    let n = 78_400;
    let (p, g, m) = (t(n, 5, -1.0), t(n, 6, -1.0), t(n, 7, -1.0));
    let rule = UpdateRule::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        first_step: false,
    };
    let (ps, gs, ms) = (
        p.to_vec::<f32>().unwrap(),
        g.to_vec::<f32>().unwrap(),
        m.to_vec::<f32>().unwrap(),
    );
    let mut grp = c.benchmark_group("sgd_momentum_78400");
    grp.throughput(Throughput::Elements(n as u64));
    grp.bench_function("fused_update", |bch| {
        bch.iter(|| {
            let st = vec![vec![m.clone()]];
            black_box(
                Tensor::fused_update(
                    &rule,
                    std::slice::from_ref(&p),
                    std::slice::from_ref(&g),
                    &st,
                )
                .unwrap(),
            )
        })
    });
    grp.bench_function("hand_loop", |bch| {
        bch.iter(|| black_box(sgd_loop(&ps, &gs, &ms, 0.1, 0.9, 1.0)))
    });
    let (prog, params) = rule.program(DType::F32).unwrap();
    grp.bench_function("program", |bch| {
        bch.iter(|| black_box(prog.run(&[&p, &g, &m], &params).unwrap()))
    });
    grp.finish();
}

criterion_group!(fuse, benches, updates);
criterion_main!(fuse);
