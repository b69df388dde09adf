//! Deferred, fused elementwise ops on the GPU (`src/lazy.rs`): the same values as the CPU
//! backend, one launch for a chain, tensors still immutable, unread work never run.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip, thread_launches};
use kiln_core::testing::assert_close;
use kiln_core::{Backend, BinaryOp, DType, HostBuffer, Layout, Result, Tensor, UnaryOp};

/// The same values on both backends: a deterministic pattern in [-1.5, 1.5].
fn pattern<B: Backend>(dims: &[usize], salt: u64, dev: &B::Device, dtype: DType) -> Tensor<B> {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n as u64)
        .map(|i| (((i * 2654435761 + salt * 97) % 1000) as f64 / 1000.0 - 0.5) * 3.0)
        .collect();
    Tensor::<B>::from_vec(v, dims.to_vec(), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A chain that exercises every way an operand reaches a fused kernel: a transposed leaf, a
/// broadcast row, a scalar fill, pending intermediates used twice, unary backward, scalar ops
/// on both sides, and a pending tensor read through a transposed view (forced first).
fn chain<B: Backend>(dev: &B::Device, dtype: DType) -> Result<Tensor<B>> {
    let x = pattern::<B>(&[24, 16], 1, dev, dtype).t()?; // [16, 24], strided
    let row = pattern::<B>(&[24], 2, dev, dtype).broadcast_to([16, 24])?;
    let half = Tensor::<B>::full([16, 24], 0.5, dtype, dev)?;
    let z = x.mul(&row)?.add(&half)?; // pending
    let p = z.sigmoid()?; // pending, read twice below
    let q = p.log()?.sub(&p.scalar_binary(BinaryOp::Sub, 1.0)?.log()?)?;
    let g = p.unary_backward(UnaryOp::Sigmoid, &q)?; // sigmoid's backward at p
    // Transposed views of pending tensors: forced, then read as strided leaves.
    let t = g.t()?;
    t.mul(&z.t()?.tanh()?)?
        .div_scalar(3.0)?
        .maximum_scalar(-0.25)
}

fn close(a: &[f64], b: &[f64], rtol: f64, what: &str) {
    assert_close(&format!("{what} (cuda vs cpu)"), a, b, rtol);
}

#[test]
fn fused_chains_match_the_cpu_backend() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dtype, rtol) in [(DType::F32, 2e-6), (DType::F64, 1e-14)] {
        let gpu = chain::<Cuda>(&dev, dtype).unwrap();
        assert!(
            gpu.storage().is_pending(),
            "the chain should still be pending"
        );
        let cpu = chain::<Cpu>(&Cpu::device(0), dtype).unwrap();
        close(
            &gpu.to_f64_vec().unwrap(),
            &cpu.to_f64_vec().unwrap(),
            rtol,
            &format!("{dtype} chain"),
        );
    }
}

#[test]
fn a_chain_is_one_launch_and_unread_work_never_runs() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = pattern::<Cuda>(&[1000], 3, &dev, DType::F32);
    let y = pattern::<Cuda>(&[1000], 4, &dev, DType::F32);
    // Warm up: compile the program once.
    let f = |x: &Tensor<Cuda>, y: &Tensor<Cuda>| -> Result<Tensor<Cuda>> {
        x.mul(y)?
            .exp()?
            .add_scalar(1.0)?
            .log()?
            .mul_scalar(0.5)?
            .sub(x)?
            .square()
    };
    f(&x, &y).unwrap().realize().unwrap();

    let before = thread_launches();
    let r = f(&x, &y).unwrap();
    assert_eq!(thread_launches(), before, "recording must not launch");
    r.realize().unwrap();
    assert_eq!(thread_launches(), before + 1, "seven ops, one fused launch");
    r.realize().unwrap();
    assert_eq!(thread_launches(), before + 1, "realized once");

    let before = thread_launches();
    drop(f(&x, &y).unwrap());
    assert_eq!(
        thread_launches(),
        before,
        "dropped before being read: never ran"
    );

    let expect: Vec<f64> = x
        .to_f64_vec()
        .unwrap()
        .iter()
        .zip(y.to_f64_vec().unwrap())
        .map(|(&a, b)| {
            let (a, b) = (a as f32, b as f32);
            let v = ((a * b).exp() + 1.0).ln() * 0.5 - a;
            (v * v) as f64
        })
        .collect();
    close(&r.to_f64_vec().unwrap(), &expect, 1e-5, "softplus chain");
}

/// A pending value that two pending chains read is stored by the first chain's kernel and read
/// back by the second, not recomputed; a value only a tensor holds is not stored.
#[test]
fn a_pending_value_that_two_chains_read_is_computed_once() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let cpu = Cpu::device(0);
    let n = 1 << 16;
    let [a, b, c] = [1, 2, 3].map(|salt| pattern::<Cuda>(&[n], salt, &dev, DType::F32));
    let [ca, cb, cc] = [1, 2, 3].map(|salt| pattern::<Cpu>(&[n], salt, &cpu, DType::F32));
    let cy = ca.mul(&cb).unwrap().add(&cc).unwrap();
    let pending = |t: &Tensor<Cuda>| t.storage().is_pending();

    let y = a.mul(&b).unwrap().add(&c).unwrap();
    let (z1, z2) = (y.exp().unwrap(), y.sin().unwrap());
    z1.realize().unwrap(); // compiles
    assert!(!pending(&y), "z1's kernel stored y, which z2 reads");
    let before = thread_launches();
    z2.realize().unwrap();
    assert_eq!(thread_launches(), before + 1, "z2: one launch over y");
    let host = |t: &Tensor<Cuda>| t.to_f64_vec().unwrap();
    let cpu_of = |t: Tensor<Cpu>| t.to_f64_vec().unwrap();
    close(&host(&z1), &cpu_of(cy.exp().unwrap()), 1e-5, "exp(y)");
    close(&host(&z2), &cpu_of(cy.sin().unwrap()), 1e-5, "sin(y)");

    // The reduction of a pending value that a pending chain also reads stores it too.
    let y = a.mul(&b).unwrap().add(&c).unwrap();
    let z = y.exp().unwrap();
    let s = y.sum(&[0], false).unwrap();
    s.realize().unwrap();
    assert!(
        !pending(&y),
        "the reduction's kernel stored y, which z reads"
    );
    close(
        &host(&z),
        &cpu_of(cy.exp().unwrap()),
        1e-5,
        "exp(y) after sum",
    );
    close(
        &host(&s),
        &cpu_of(cy.sum(&[0], false).unwrap()),
        1e-4,
        "sum(y)",
    );

    // Held by a tensor only: not stored (the handle may be a temporary nobody reads).
    let y = a.mul(&b).unwrap().add(&c).unwrap();
    y.exp().unwrap().realize().unwrap();
    assert!(
        pending(&y),
        "y was stored although no pending chain reads it"
    );
}

#[test]
fn writing_into_a_buffer_a_pending_op_reads_leaves_the_op_its_old_values() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let f32s = |v: Vec<f32>| HostBuffer::F32(v);
    let l = Layout::contiguous([8]);
    let mut base = Cuda::from_host(&dev, &f32s((0..8).map(|i| i as f32).collect())).unwrap();
    // Pending, and reading `base`'s buffer.
    let doubled = Cuda::binary_scalar(BinaryOp::Mul, &base, &l, DType::F32, 2.0, false).unwrap();
    assert!(doubled.is_pending());
    let ones = Cuda::from_host(&dev, &f32s(vec![1.0; 4])).unwrap();
    let region = l.narrow(0, 2, 4).unwrap();
    Cuda::copy_into(
        &ones,
        &Layout::contiguous([4]),
        &mut base,
        &region,
        DType::F32,
    )
    .unwrap();
    let read = |s: &<Cuda as Backend>::Storage| match Cuda::to_host(s, &l, DType::F32).unwrap() {
        HostBuffer::F32(v) => v,
        other => panic!("f32 expected, got {other:?}"),
    };
    assert_eq!(read(&base), [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0, 7.0]);
    assert_eq!(read(&doubled), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]);
}

/// A deferred result already computed (read, so its node holds the value) and then written in
/// place gives the node's buffer back to the write: no copy of the whole tensor, and the
/// values right.
#[test]
fn an_in_place_write_into_a_computed_deferred_result_does_not_copy_it() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let f32s = |v: Vec<f32>| HostBuffer::F32(v);
    let n = 1 << 22; // 16 MiB of f32
    let l = Layout::contiguous([n]);
    let base = Cuda::from_host(&dev, &f32s(vec![1.0; n])).unwrap();
    let mut x = Cuda::binary_scalar(BinaryOp::Add, &base, &l, DType::F32, 1.0, false).unwrap();
    assert!(x.is_pending());
    drop(Cuda::to_host(&x, &l, DType::F32).unwrap()); // computed; the node keeps the value
    Cuda::synchronize(&dev).unwrap();
    kiln_backend_cuda::reset_peak(&dev).unwrap();
    let before = Cuda::memory_stats(&dev).unwrap().in_use;
    let five = Cuda::from_host(&dev, &f32s(vec![5.0; 2])).unwrap();
    let region = l.narrow(0, 1, 2).unwrap();
    Cuda::copy_into(&five, &Layout::contiguous([2]), &mut x, &region, DType::F32).unwrap();
    Cuda::synchronize(&dev).unwrap();
    let peak = Cuda::memory_stats(&dev).unwrap().peak;
    assert!(
        peak < before + n * 4,
        "the write copied the tensor: peak {peak} bytes, {before} before"
    );
    let head = l.narrow(0, 0, 4).unwrap();
    match Cuda::to_host(&x, &head, DType::F32).unwrap() {
        HostBuffer::F32(v) => assert_eq!(v, [2.0, 5.0, 5.0, 2.0]),
        other => panic!("f32 expected, got {other:?}"),
    }
}

#[test]
fn a_value_updated_in_a_loop_stays_bounded_and_right() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // b = b * 0.5 + 1 converges to 2; 300 steps exceed the node caps many times over.
    let mut b = Tensor::<Cuda>::zeros([3], DType::F64, &dev).unwrap();
    let mut expect = 0.0f64;
    for _ in 0..300 {
        b = b.mul_scalar(0.5).unwrap().add_scalar(1.0).unwrap();
        expect = expect * 0.5 + 1.0;
    }
    for v in b.to_vec::<f64>().unwrap() {
        assert_eq!(v, expect);
    }
}

#[test]
fn uniform_values_broadcast_through_any_view() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // A pending scalar (fill, then scalar ops) broadcast into a matrix, as autograd's seed and
    // mean backward do.
    let s = Tensor::<Cuda>::full(kiln_core::Shape::scalar(), 1.0, DType::F32, &dev)
        .unwrap()
        .div_scalar(4.0)
        .unwrap();
    let m = pattern::<Cuda>(&[3, 5], 5, &dev, DType::F32);
    let r = s
        .broadcast_to([3, 5])
        .unwrap()
        .mul(&m)
        .unwrap()
        .neg()
        .unwrap();
    let expect: Vec<f64> = m
        .to_f64_vec()
        .unwrap()
        .iter()
        .map(|v| -(v * 0.25))
        .collect();
    close(&r.to_f64_vec().unwrap(), &expect, 1e-7, "broadcast scalar");
    // A reduction of a pending tensor forces it first.
    let total = r.sum_all().unwrap().to_scalar().unwrap();
    assert!((total - expect.iter().sum::<f64>()).abs() < 1e-5);
}

/// One random chain: leaves in every layout a fused kernel meets (contiguous, transposed,
/// narrowed, broadcast row, broadcast scalar) and earlier results read directly (inlined) or
/// transposed (forced first), through unary, binary and scalar ops on both sides, comparisons,
/// `where` and casts through u8.
fn random_chain<B: Backend>(seed: u64, dev: &B::Device) -> Result<Tensor<B>> {
    let mut state = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let n = [1usize, 2, 3, 5, 17][next(5) as usize];
    let dims: Vec<usize> = if next(3) == 0 {
        vec![2, n, n]
    } else {
        vec![n, n]
    };
    let dt = DType::F64;
    let mut salt = seed * 1000;
    let mut leaf = |kind: u64| -> Result<Tensor<B>> {
        salt += 1;
        match kind {
            0 => Ok(pattern::<B>(&dims, salt, dev, dt)),
            1 => pattern::<B>(&dims, salt, dev, dt).transpose(-1, -2),
            2 => {
                let mut big = dims.clone();
                big[0] += 2;
                pattern::<B>(&big, salt, dev, dt).narrow(0, 1, dims[0])
            }
            3 => pattern::<B>(&dims[dims.len() - 1..], salt, dev, dt).broadcast_to(dims.clone()),
            _ => pattern::<B>(&[], salt, dev, dt).broadcast_to(dims.clone()),
        }
    };
    let mut vals = vec![leaf(0)?];
    for _ in 0..2 + next(7) {
        let pick = |vals: &Vec<Tensor<B>>, r: u64| -> Result<Tensor<B>> {
            let v = &vals[r as usize % vals.len()];
            if r % 4 == 3 {
                v.transpose(-1, -2)
            } else {
                Ok(v.clone())
            }
        };
        let a = pick(&vals, next(64))?;
        let out = match next(7) {
            0 => {
                let ops = [
                    UnaryOp::Neg,
                    UnaryOp::Abs,
                    UnaryOp::Exp,
                    UnaryOp::Sigmoid,
                    UnaryOp::Tanh,
                    UnaryOp::Square,
                    UnaryOp::Relu,
                    UnaryOp::Sin,
                    UnaryOp::Cos,
                ];
                a.unary(ops[next(ops.len() as u64) as usize])?
            }
            1 => {
                let b = if next(2) == 0 {
                    leaf(next(5))?
                } else {
                    pick(&vals, next(64))?
                };
                let ops = [
                    BinaryOp::Add,
                    BinaryOp::Sub,
                    BinaryOp::Mul,
                    BinaryOp::Maximum,
                    BinaryOp::Minimum,
                ];
                a.binary(ops[next(ops.len() as u64) as usize], &b)?
            }
            2 => {
                let ops = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul];
                let op = ops[next(3) as usize];
                let c = next(7) as f64 * 0.25 - 0.5;
                if next(2) == 0 {
                    a.binary_scalar(op, c)?
                } else {
                    a.scalar_binary(op, c)?
                }
            }
            3 => a.unary_backward(UnaryOp::Tanh, &leaf(next(5))?)?,
            // A mask: a comparison cast back to floats (dropout's shape).
            4 => a.gt(&leaf(next(5))?)?.to_dtype(dt)?.mul(&a)?,
            5 => a
                .ge(&pick(&vals, next(64))?)?
                .where_cond(&a, &leaf(next(5))?)?,
            // Through u8 and back (Rust `as`: truncating, saturating, NaN to 0).
            _ => a.mul_scalar(40.0)?.to_dtype(DType::U8)?.to_dtype(dt)?,
        };
        vals.push(out);
    }
    Ok(vals.pop().expect("at least one op"))
}

#[test]
fn random_chains_match_the_cpu_backend() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let same = |x: f64, y: f64| {
        (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-9 * (1.0 + y.abs())
    };
    for seed in 1..=48 {
        let gpu = random_chain::<Cuda>(seed, &dev).unwrap();
        let cpu = random_chain::<Cpu>(seed, &Cpu::device(0)).unwrap();
        assert_eq!(gpu.shape(), cpu.shape(), "seed {seed}");
        let (g, c) = (gpu.to_f64_vec().unwrap(), cpu.to_f64_vec().unwrap());
        for (i, (x, y)) in g.iter().zip(&c).enumerate() {
            assert!(
                same(*x, *y),
                "seed {seed}, element {i}: cuda {x} vs cpu {y}"
            );
        }
    }
}

#[test]
fn reductions_of_chains_match_the_cpu_backend() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let same = |x: f64, y: f64| {
        (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-9 * (1.0 + y.abs())
    };
    for seed in 1..=24 {
        let gpu = random_chain::<Cuda>(seed, &dev).unwrap();
        let cpu = random_chain::<Cpu>(seed, &Cpu::device(0)).unwrap();
        for (name, g, c) in [
            ("sum", gpu.sum_all(), cpu.sum_all()),
            ("max", gpu.max_all(), cpu.max_all()),
            ("min", gpu.min_all(), cpu.min_all()),
        ] {
            let (g, c) = (
                g.unwrap().to_scalar().unwrap(),
                c.unwrap().to_scalar().unwrap(),
            );
            assert!(same(g, c), "seed {seed}, {name}: cuda {g} vs cpu {c}");
        }
    }
}

#[test]
fn a_loss_over_a_chain_is_one_launch_and_a_large_one_two() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // (`mean_all` would add a launch for its division, unless something else consumes it.)
    let loss = |x: &Tensor<Cuda>, y: &Tensor<Cuda>| -> Result<Tensor<Cuda>> {
        x.sub(y)?.square()?.sum_all()
    };
    for (n, launches) in [(1000usize, 1u64), (1 << 20, 2)] {
        let x = pattern::<Cuda>(&[n], 11, &dev, DType::F64);
        let y = pattern::<Cuda>(&[n], 12, &dev, DType::F64);
        loss(&x, &y).unwrap().realize().unwrap(); // compile
        let before = thread_launches();
        let l = loss(&x, &y).unwrap();
        l.realize().unwrap();
        assert_eq!(thread_launches() - before, launches, "n = {n}");
        let (xs, ys) = (x.to_f64_vec().unwrap(), y.to_f64_vec().unwrap());
        let expect = xs
            .iter()
            .zip(&ys)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>();
        let got = l.to_scalar().unwrap();
        assert!(
            // The host's sequential sum of 2^20 terms is the less accurate of the two.
            (got - expect).abs() <= 1e-9 * expect.abs(),
            "n = {n}: {got} vs {expect}"
        );
    }
    // The chain under a reduction stays pending and is computed when read.
    let x = pattern::<Cuda>(&[7], 13, &dev, DType::F32);
    let sq = x.square().unwrap();
    let total = sq.sum_all().unwrap().to_scalar().unwrap();
    assert!(sq.storage().is_pending());
    let v = sq.to_f64_vec().unwrap();
    assert!((v.iter().sum::<f64>() - total).abs() < 1e-5);
}
