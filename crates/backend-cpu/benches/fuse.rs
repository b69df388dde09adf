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
//!   - `hand_avx512`: the ceiling of any one-pass evaluator on this machine: the chain written
//!     by hand with AVX-512 intrinsics (16 lanes, the exp of `fastmath`), one loop, every
//!     value in registers, on all cores, into a reused buffer (x86-64 with AVX-512 only);
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
use kiln_core::{DType, Generator, Tensor, UpdateRule};
use std::hint::black_box;

fn benches(c: &mut Criterion) {
    let dev = Cpu::device(0);
    let n = 32 << 20;
    let a = Generator::new(1).rand::<Cpu>([n], &dev).unwrap();
    let b = Generator::new(2).rand::<Cpu>([n], &dev).unwrap();
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
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let mut out = vec![0f32; n];
        g.bench_function("hand_avx512", |bch| {
            bch.iter(|| {
                ceiling::chain5(&av, &bv, &mut out);
                black_box(out[n - 1])
            })
        });
    }
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
    let s = Generator::new(3)
        .uniform::<Cpu>([r, r], -5.0, 5.0, &dev)
        .unwrap();
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

/// `exp(a * b + 1) * 0.5 - b` by hand: the best a one-pass evaluator can do here.
#[cfg(target_arch = "x86_64")]
mod ceiling {
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    /// `fastmath`'s exp on 16 lanes (clamp, 2^n split, degree-5 polynomial, `vscalefps`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
        let x = _mm512_min_ps(_mm512_set1_ps(88.8), x);
        let round = _mm512_set1_ps(12_582_912.0);
        let t = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), round);
        let n = _mm512_sub_ps(t, round);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_2e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
        _mm512_scalef_ps(_mm512_add_ps(y, _mm512_set1_ps(1.0)), n)
    }

    /// One core's share. Plain stores: with this much arithmetic per element they measured
    /// faster than streaming ones (12.4-14.1 against 17.2-17.8 ms on the 2-core VM).
    #[target_feature(enable = "avx512f")]
    fn run(a: &[f32], b: &[f32], o: &mut [f32]) {
        let (a, b) = (a.chunks_exact(16), b.chunks_exact(16));
        for ((x, y), o) in a.zip(b).zip(o.chunks_exact_mut(16)) {
            // SAFETY: each chunk holds exactly 16 f32; unaligned loads and stores.
            unsafe {
                let (x, y) = (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(y.as_ptr()));
                let t = _mm512_add_ps(_mm512_mul_ps(x, y), _mm512_set1_ps(1.0));
                let e = _mm512_mul_ps(exp16(t), _mm512_set1_ps(0.5));
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_sub_ps(e, y));
            }
        }
    }

    /// The chain over whole 16-element groups, split over rayon's threads.
    pub fn chain5(a: &[f32], b: &[f32], out: &mut [f32]) {
        let piece = a
            .len()
            .div_ceil(rayon::current_num_threads())
            .next_multiple_of(16);
        out.par_chunks_mut(piece)
            .zip(a.par_chunks(piece).zip(b.par_chunks(piece)))
            // SAFETY: the caller checked for AVX-512F.
            .for_each(|(o, (a, b))| unsafe { run(a, b, o) });
    }
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
        Generator::new(seed)
            .uniform::<Cpu>([n], lo, 1.0, &dev)
            .unwrap()
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
