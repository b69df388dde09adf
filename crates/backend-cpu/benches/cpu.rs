//! CPU benchmarks of the issue-2 targets (compare with `bench/cpu_numpy.py` on the same
//! machine; BENCHMARKS.md records both):
//!
//! - `sgemm_1024`: `[1024, 1024] x [1024, 1024]` f32 (also with a transposed lhs view);
//! - `exp_230400`: elementwise exp over 230,400 f32 (the Theano tutorial's vector);
//! - `add_32m`: elementwise add of two 32M-element f32 vectors.
//!
//! kiln's ops allocate their result (through the backend's buffer cache); numpy's are timed with
//! `out=` (no allocation) and without. Large elementwise results are deferred (`lazy.rs`), so
//! each iteration realizes its result: the time is the whole computation.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_backend_cpu::Cpu;
use kiln_core::{Generator, Tensor};
use std::hint::black_box;

/// `t`, computed (deferred elementwise work runs here).
fn done(t: kiln_core::Result<Tensor<Cpu>>) -> Tensor<Cpu> {
    let t = t.unwrap();
    t.realize().unwrap();
    t
}

fn benches(c: &mut Criterion) {
    let dev = Cpu::device(0);

    let n = 1024;
    let a = Generator::new(1)
        .uniform::<Cpu>([n, n], -1.0, 1.0, &dev)
        .unwrap();
    let b = Generator::new(2)
        .uniform::<Cpu>([n, n], -1.0, 1.0, &dev)
        .unwrap();
    let at = a.t().unwrap();
    let mut g = c.benchmark_group("sgemm_1024");
    g.throughput(Throughput::Elements((2 * n * n * n) as u64)); // flops
    g.sample_size(30);
    g.bench_function("a@b", |bch| bch.iter(|| black_box(a.matmul(&b).unwrap())));
    g.bench_function("a.T@b", |bch| {
        bch.iter(|| black_box(at.matmul(&b).unwrap()))
    });
    g.finish();

    let x = Generator::new(3)
        .uniform::<Cpu>([230_400], -5.0, 5.0, &dev)
        .unwrap();
    let mut g = c.benchmark_group("exp_230400");
    g.throughput(Throughput::Elements(230_400));
    g.bench_function("exp", |bch| bch.iter(|| black_box(done(x.exp()))));
    g.finish();

    let m = 32 << 20;
    let p = Generator::new(4).rand::<Cpu>([m], &dev).unwrap();
    let q = Generator::new(5).rand::<Cpu>([m], &dev).unwrap();
    let mut g = c.benchmark_group("add_32m");
    g.throughput(Throughput::Elements(m as u64));
    g.sample_size(20);
    g.bench_function("add", |bch| bch.iter(|| black_box(done(p.add(&q)))));
    g.finish();

    let s = Generator::new(6)
        .uniform::<Cpu>([512, 1000], -5.0, 5.0, &dev)
        .unwrap();
    let mut g = c.benchmark_group("misc");
    g.bench_function("softmax_512x1000", |bch| {
        bch.iter(|| black_box(s.softmax(-1).unwrap()))
    });
    g.bench_function("sum_rows_512x1000", |bch| {
        bch.iter(|| black_box(s.sum(&[1], false).unwrap()))
    });
    g.bench_function("sum_cols_512x1000", |bch| {
        bch.iter(|| black_box(s.sum(&[0], false).unwrap()))
    });
    g.finish();
}

criterion_group!(cpu, benches);
criterion_main!(cpu);
