//! Fused expression programs against the same chain op by op (issue 13's CPU target; numpy's
//! side is `bench/fuse_numpy.py`, same workload, same sizes; `bash bench/fuse_compare.sh` runs
//! both alternately):
//!
//! - `chain5_32m`: `exp(a * b + 1) * 0.5 - b` over two 32M-element f32 vectors, five ops:
//!   - `op_by_op`: five `Tensor` ops, each a kernel that reads and writes 128 MiB;
//!   - `fused`: one program, one pass (`Program::run` → `Backend::eval_expr`);
//! - `mul_32m`: `a * b` alone, fused and as the built-in kernel: the memory floor of the
//!   chain (both read 256 MiB and write 128 MiB);
//! - `lse_rows_4096x4096`: a row-wise log-sum-exp `log(sum(exp(x - m))) + m` given the row
//!   maxima `m`, fused (one pass, post-map included) and op by op.
//!
//! kiln's results are allocated through the backend's buffer cache on both sides.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_backend_cpu::Cpu;
use kiln_core::expr::{Expr, Program};
use kiln_core::{DType, Tensor};
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
    g.bench_function("op_by_op", |bch| {
        bch.iter(|| {
            let t = a.mul(&b).unwrap().add_scalar(1.0).unwrap().exp().unwrap();
            black_box(t.mul_scalar(0.5).unwrap().sub(&b).unwrap())
        })
    });
    g.bench_function("fused", |bch| {
        bch.iter(|| black_box(p.run(&[&a, &b], &[]).unwrap()))
    });
    g.finish();

    // The memory floor: one multiply, fused (one program) and as the built-in kernel.
    let prod = Program::from_exprs(&[DType::F32, DType::F32], &[&x * &y]).unwrap();
    let mut g = c.benchmark_group("mul_32m");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    g.bench_function("op", |bch| bch.iter(|| black_box(a.mul(&b).unwrap())));
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
    g.bench_function("op_by_op", |bch| {
        bch.iter(|| {
            let e = s.sub(&m).unwrap().exp().unwrap().sum(&[1], true).unwrap();
            black_box(e.log().unwrap().add(&m).unwrap())
        })
    });
    g.bench_function("fused", |bch| {
        bch.iter(|| black_box(p.run(&[&s, &m], &[]).unwrap()))
    });
    g.finish();
}

criterion_group!(fuse, benches);
criterion_main!(fuse);
