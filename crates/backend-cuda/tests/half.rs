//! f16 and bf16 tensors on a GPU: they move (upload, download, device copies, strided
//! `contiguous`, `fill`) bit for bit, and each op computes as the CPU backend does (16-bit
//! loads and stores, f32 arithmetic inside; issue 30), within a few units in the last place.
//! Ops without 16-bit kernels yet return a typed error naming the op and the dtype.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType, Reduction, Tensor, bf16, f16};

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

/// Deterministic values in about [-scale, scale).
fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 8) as f32;
            (h / (1u32 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The same values as a CPU tensor and a CUDA tensor of `dtype` (rounded on the CPU once).
fn pair(
    v: &[f32],
    dims: &[usize],
    dtype: DType,
    dev: &kiln_backend_cuda::CudaDevice,
) -> (Tensor<Cpu>, Tensor<Cuda>) {
    let c = Tensor::<Cpu>::from_slice(v, dims.to_vec(), &Cpu::device(0))
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let g = c.to_backend::<Cuda>(dev).unwrap();
    (c, g)
}

fn host_f32<B: Backend>(t: &Tensor<B>) -> Vec<f32> {
    t.to_backend::<Cpu>(&Cpu::device(0))
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// `got` (CUDA) within `ulps` units in the last place of `dtype` of `want` (CPU), relative to
/// the larger of |want| and `floor` (for values that cancel), NaN where NaN.
fn assert_close_ulps(what: &str, got: &Tensor<Cuda>, want: &Tensor<Cpu>, ulps: f64, floor: f64) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let eps = want.dtype().epsilon();
    let (g, w) = (host_f32(got), host_f32(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if b.is_nan() {
            assert!(a.is_nan(), "{what}[{i}]: got {a}, want NaN");
            continue;
        }
        let tol = ulps * eps * (*b as f64).abs().max(floor);
        assert!(
            ((*a as f64) - (*b as f64)).abs() <= tol,
            "{what}[{i}]: got {a}, want {b} (tolerance {tol:e}, {} of {})",
            want.dtype(),
            g.len()
        );
    }
}

#[test]
fn sixteen_bit_tensors_move_bit_for_bit() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let v: Vec<f16> = (0..24)
        .map(|i| f16::from_f32(i as f32 * 0.25 - 3.0))
        .collect();
    let x = Tensor::<Cuda>::from_vec(v.clone(), [4, 6], &dev).unwrap();
    assert_eq!(x.to_vec::<f16>().unwrap(), v);
    // A transposed view made contiguous: the strided 2-byte copy kernel.
    let t = x.t().unwrap().contiguous().unwrap();
    let want: Vec<f16> = (0..6)
        .flat_map(|j| (0..4).map(move |i| (i, j)))
        .map(|(i, j)| v[i * 6 + j])
        .collect();
    assert_eq!(t.to_vec::<f16>().unwrap(), want);
    let f = Tensor::<Cuda>::full([5], 0.1, DType::BF16, &dev).unwrap();
    assert_eq!(f.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(0.1); 5]);
}

/// Elementwise ops, one at a time and fused into one chain, a broadcast, a transposed view,
/// comparisons, `where`, scalars and casts to and from every dtype: as on the CPU (the same
/// widened program; exp/tanh may differ by an ulp of f32 before rounding, so 1 ulp of the
/// 16-bit type).
#[test]
fn elementwise_ops_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in HALVES {
        let (xc, xg) = pair(&values(37 * 29, 1, 3.0), &[37, 29], dtype, &dev);
        let (yc, yg) = pair(&values(29, 7, 2.0), &[29], dtype, &dev);
        let t = |x: &str| format!("{x} {dtype}");
        // one op at a time (realized)
        let check = |what: &str, g: Tensor<Cuda>, c: Tensor<Cpu>| {
            g.realize().unwrap();
            assert_close_ulps(&t(what), &g, &c, 1.0, 1e-3);
        };
        check("add", xg.add(&yg).unwrap(), xc.add(&yc).unwrap());
        check("mul", xg.mul(&yg).unwrap(), xc.mul(&yc).unwrap());
        check("exp", xg.exp().unwrap(), xc.exp().unwrap());
        check("tanh", xg.tanh().unwrap(), xc.tanh().unwrap());
        check("relu", xg.relu().unwrap(), xc.relu().unwrap());
        check(
            "scalar",
            xg.mul_scalar(0.1).unwrap(),
            xc.mul_scalar(0.1).unwrap(),
        );
        check(
            "transposed",
            xg.t()
                .unwrap()
                .sub(&xg.t().unwrap().exp().unwrap())
                .unwrap(),
            xc.t()
                .unwrap()
                .sub(&xc.t().unwrap().exp().unwrap())
                .unwrap(),
        );
        // a fused chain (deferred, one generated kernel): f32 inside, rounded once on store
        let chain = |x: &Tensor<Cuda>, y: &Tensor<Cuda>| {
            x.mul(y)?.exp()?.add_scalar(1.0)?.log()?.sub(x)?.tanh()
        };
        let chain_c = |x: &Tensor<Cpu>, y: &Tensor<Cpu>| {
            x.mul(y)?.exp()?.add_scalar(1.0)?.log()?.sub(x)?.tanh()
        };
        // The CPU's reference: the chain in f32, rounded once. f32 expf against Rust's exp can
        // differ in the last f32 bit, which can tip the one rounding: an ulp of the result's
        // scale (its values are about 1).
        let f32_of = |t: &Tensor<Cpu>| t.to_dtype(DType::F32).unwrap();
        let c = chain_c(&f32_of(&xc), &f32_of(&yc))
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let g = chain(&xg, &yg).unwrap();
        assert_close_ulps(&t("fused chain"), &g, &c, 1.0, 1.0);
        // comparisons and where
        let mg = xg.lt(&yg).unwrap();
        let mc = xc.lt(&yc).unwrap();
        assert_eq!(
            mg.to_vec::<u8>().unwrap(),
            mc.to_vec::<u8>().unwrap(),
            "{}",
            t("lt")
        );
        check(
            "where",
            mg.where_cond(&xg, &yg.broadcast_to(xg.dims()).unwrap())
                .unwrap(),
            mc.where_cond(&xc, &yc.broadcast_to(xc.dims()).unwrap())
                .unwrap(),
        );
        // casts to and from every dtype (exact or one rounding: bit for bit)
        for other in [
            DType::F32,
            DType::F64,
            DType::I64,
            DType::U8,
            DType::F16,
            DType::BF16,
        ] {
            let (g, c) = (xg.to_dtype(other).unwrap(), xc.to_dtype(other).unwrap());
            assert_eq!(
                g.to_host().unwrap().as_bytes(),
                c.to_host().unwrap().as_bytes(),
                "{}",
                t(&format!("cast to {other}"))
            );
            let (sg, sc) = (
                Tensor::<Cuda>::from_slice(&values(64, 3, 70_000.0), [64], &dev)
                    .unwrap()
                    .to_dtype(other)
                    .unwrap(),
                Tensor::<Cpu>::from_slice(&values(64, 3, 70_000.0), [64], &Cpu::device(0))
                    .unwrap()
                    .to_dtype(other)
                    .unwrap(),
            );
            assert_eq!(
                sg.to_dtype(dtype).unwrap().to_host().unwrap().as_bytes(),
                sc.to_dtype(dtype).unwrap().to_host().unwrap().as_bytes(),
                "{}",
                t(&format!("cast from {other}"))
            );
        }
    }
}

/// Largest |a|·|b| sum of a matrix product's dot products (the scale of its rounding).
fn dot_scale(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> f64 {
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|q| (a[i * k + q] as f64 * b[q * n + j] as f64).abs())
                .sum();
            worst = worst.max(s);
        }
    }
    worst
}

/// Matrix products through cuBLAS's GemmEx (16-bit operands, f32 accumulation): plain,
/// transposed operands (views, no copies), batched, and a matrix-vector product.
#[test]
fn matmul_matches_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in HALVES {
        let (m, k, n) = (33, 70, 21);
        let (ac, ag) = pair(&values(m * k, 11, 1.0), &[m, k], dtype, &dev);
        let (bc, bg) = pair(&values(k * n, 12, 1.0), &[k, n], dtype, &dev);
        let scale = dot_scale(&host_f32(&ac), &host_f32(&bc), m, k, n);
        // f32 accumulation in another order, then one rounding: one ulp of the result plus
        // f32 rounding of the sum's terms.
        let check = |what: &str, g: Tensor<Cuda>, c: Tensor<Cpu>| {
            assert_close_ulps(&format!("{what} {dtype}"), &g, &c, 1.0, scale);
        };
        check("matmul", ag.matmul(&bg).unwrap(), ac.matmul(&bc).unwrap());
        let (atc, atg) = (ac.t().unwrap(), ag.t().unwrap()); // [k, m] views
        check(
            "matmul of transposed views",
            bg.t().unwrap().matmul(&atg).unwrap(),
            bc.t().unwrap().matmul(&atc).unwrap(),
        );
        let (xc, xg) = pair(&values(3 * m * k, 13, 1.0), &[3, m, k], dtype, &dev);
        let (yc, yg) = pair(&values(3 * k * n, 14, 1.0), &[3, k, n], dtype, &dev);
        check(
            "batched matmul",
            xg.matmul(&yg).unwrap(),
            xc.matmul(&yc).unwrap(),
        );
        let (vc, vg) = pair(&values(k, 15, 1.0), &[k, 1], dtype, &dev);
        check(
            "matrix-vector",
            ag.matmul(&vg).unwrap(),
            ac.matmul(&vc).unwrap(),
        );
    }
}

/// Softmax and log-softmax on the last axis (the row cached as f32 in shared memory, and a row
/// too long for it), on a strided view, and on another axis.
#[test]
fn softmax_matches_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in HALVES {
        for (rows, cols) in [(17, 40), (3, 30_000)] {
            let (xc, xg) = pair(&values(rows * cols, 21, 6.0), &[rows, cols], dtype, &dev);
            for log in [false, true] {
                let (g, c) = if log {
                    (xg.log_softmax(-1).unwrap(), xc.log_softmax(-1).unwrap())
                } else {
                    (xg.softmax(-1).unwrap(), xc.softmax(-1).unwrap())
                };
                let what = format!("softmax (log {log}) {rows}x{cols} {dtype}");
                assert_close_ulps(&what, &g, &c, 1.0, 1e-3);
            }
        }
        let (xc, xg) = pair(&values(12 * 9, 22, 4.0), &[12, 9], dtype, &dev);
        assert_close_ulps(
            &format!("softmax of a transposed view {dtype}"),
            &xg.t().unwrap().softmax(-1).unwrap(),
            &xc.t().unwrap().softmax(-1).unwrap(),
            1.0,
            1e-3,
        );
        assert_close_ulps(
            &format!("softmax on axis 0 {dtype}"),
            &xg.softmax(0).unwrap(),
            &xc.softmax(0).unwrap(),
            1.0,
            1e-3,
        );
    }
}

/// Cross-entropy (per row and its mean) and its backward, in f32 inside.
#[test]
fn cross_entropy_and_backward_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (rows, cols) = (29, 13);
    let labels: Vec<i64> = (0..rows as i64).map(|i| (i * 7) % cols as i64).collect();
    let lc = Tensor::<Cpu>::from_vec(labels.clone(), [rows], &Cpu::device(0)).unwrap();
    let lg = Tensor::<Cuda>::from_vec(labels, [rows], &dev).unwrap();
    for dtype in HALVES {
        let (xc, xg) = pair(&values(rows * cols, 31, 5.0), &[rows, cols], dtype, &dev);
        let (gc, gg) = pair(&values(rows, 32, 1.0), &[rows], dtype, &dev);
        assert_close_ulps(
            &format!("cross_entropy rows {dtype}"),
            &xg.cross_entropy(&lg, Reduction::None).unwrap(),
            &xc.cross_entropy(&lc, Reduction::None).unwrap(),
            1.0,
            1e-2,
        );
        assert_close_ulps(
            &format!("cross_entropy mean {dtype}"),
            &xg.cross_entropy(&lg, Reduction::Mean).unwrap(),
            &xc.cross_entropy(&lc, Reduction::Mean).unwrap(),
            2.0,
            1e-2,
        );
        assert_close_ulps(
            &format!("cross_entropy_backward {dtype}"),
            &xg.cross_entropy_backward(&lg, &gg).unwrap(),
            &xc.cross_entropy_backward(&lc, &gc).unwrap(),
            1.0,
            1e-3,
        );
    }
}

/// Reductions (f32 accumulators, one rounding): over the last axis, over a non-last axis
/// (column mode), everything (split into partial f32 results), max/min/argmax.
#[test]
fn reductions_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in HALVES {
        for dims in [vec![37, 53], vec![5, 300, 7], vec![1 << 18]] {
            let n: usize = dims.iter().product();
            let (xc, xg) = pair(&values(n, 41, 1.0), &dims, dtype, &dev);
            let abs_sum: f64 = host_f32(&xc).iter().map(|v| v.abs() as f64).sum();
            for axes in [vec![-1isize], vec![0], vec![]] {
                let (g, c) = if axes.is_empty() {
                    (xg.sum_all().unwrap(), xc.sum_all().unwrap())
                } else {
                    (xg.sum(&axes, false).unwrap(), xc.sum(&axes, false).unwrap())
                };
                // f32 sums in another order: an ulp of the result, or of the magnitudes.
                let what = format!("sum {dims:?} over {axes:?} {dtype}");
                assert_close_ulps(&what, &g, &c, 1.0, abs_sum / 16.0);
                if let Some(&ax) = axes.first() {
                    let what = format!("max {dims:?} over {ax} {dtype}");
                    assert_close_ulps(
                        &what,
                        &xg.max(&[ax], false).unwrap(),
                        &xc.max(&[ax], false).unwrap(),
                        0.0,
                        1.0,
                    );
                    assert_eq!(
                        xg.argmax(ax, false).unwrap().to_vec::<i64>().unwrap(),
                        xc.argmax(ax, false).unwrap().to_vec::<i64>().unwrap(),
                        "argmax {dims:?} over {ax} {dtype}"
                    );
                }
            }
        }
    }
}

/// index_select and gather move 16-bit elements bit for bit; scatter_add adds in f32 and
/// rounds each output once.
#[test]
fn index_ops_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let ids: Vec<i64> = vec![3, 0, 3, 5, 1, 3];
    let ic = Tensor::<Cpu>::from_vec(ids.clone(), [6], &Cpu::device(0)).unwrap();
    let ig = Tensor::<Cuda>::from_vec(ids, [6], &dev).unwrap();
    for dtype in HALVES {
        let (xc, xg) = pair(&values(6 * 10, 51, 3.0), &[6, 10], dtype, &dev);
        for dim in [0isize, 1] {
            assert_eq!(
                host_f32(&xg.index_select(dim, &ig).unwrap()),
                host_f32(&xc.index_select(dim, &ic).unwrap()),
                "index_select dim {dim} {dtype}"
            );
        }
        let gi: Vec<i64> = (0..60).map(|i| (i * 7 % 6) as i64).collect();
        let gic = Tensor::<Cpu>::from_vec(gi.clone(), [6, 10], &Cpu::device(0)).unwrap();
        let gig = Tensor::<Cuda>::from_vec(gi, [6, 10], &dev).unwrap();
        assert_eq!(
            host_f32(&xg.gather(0, &gig).unwrap()),
            host_f32(&xc.gather(0, &gic).unwrap()),
            "gather {dtype}"
        );
        let (sc, sg) = pair(&values(6 * 10, 52, 2.0), &[6, 10], dtype, &dev);
        assert_close_ulps(
            &format!("scatter_add {dtype}"),
            &xg.scatter_add(0, &gig, &sg).unwrap(),
            &xc.scatter_add(0, &gic, &sc).unwrap(),
            1.0,
            1.0,
        );
    }
}

/// Random numbers: the f32 streams rounded, bit for bit the CPU's.
#[test]
fn rand_is_the_f32_stream_rounded() {
    let Some(dev) = gpu_or_skip(0) else { return };
    use kiln_core::RandDist;
    for dtype in HALVES {
        for dist in [
            RandDist::Uniform {
                low: -2.0,
                high: 3.0,
            },
            RandDist::Normal {
                mean: 0.5,
                std: 2.0,
            },
        ] {
            let g = kiln_core::Generator::new(42)
                .sample::<Cuda>([1000], dist, dtype, &dev)
                .unwrap();
            let c = kiln_core::Generator::new(42)
                .sample::<Cpu>([1000], dist, dtype, &Cpu::device(0))
                .unwrap();
            assert_eq!(
                g.to_host().unwrap().as_bytes(),
                c.to_host().unwrap().as_bytes(),
                "rand {dist:?} {dtype}"
            );
        }
    }
}

/// The optimizers' multi-tensor update with 16-bit parameters: f32 arithmetic inside, state in
/// the parameters' dtype, as the CPU's composed update.
#[test]
fn fused_update_matches_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    use kiln_core::UpdateRule;
    let rules = [
        UpdateRule::Sgd {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 1e-2,
            first_step: false,
        },
        UpdateRule::Adam {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
            bias_correction1: 0.1,
            bias_correction2: 0.001,
        },
    ];
    for dtype in HALVES {
        for rule in &rules {
            let mk = |seed| pair(&values(1000, seed, 1.0), &[1000], dtype, &dev);
            let (pc, pg) = mk(61);
            let (gc, gg) = mk(62);
            let (s0c, s0g) = mk(63);
            let (s1c, s1g) = pair(&values(1000, 64, 1.0), &[1000], dtype, &dev);
            let (s1c, s1g) = (s1c.abs().unwrap(), s1g.abs().unwrap());
            let nst = rule.state_count();
            let stc = vec![[s0c, s1c][..nst].to_vec()];
            let stg = vec![[s0g, s1g][..nst].to_vec()];
            let c = Tensor::<Cpu>::fused_update(rule, &[pc], &[gc], &stc).unwrap();
            let g = Tensor::<Cuda>::fused_update(rule, &[pg], &[gg], &stg).unwrap();
            assert_close_ulps(
                &format!("{rule:?} param {dtype}"),
                &g[0].0,
                &c[0].0,
                1.0,
                1e-2,
            );
            for (i, (a, b)) in g[0].1.iter().zip(&c[0].1).enumerate() {
                assert_close_ulps(&format!("{rule:?} state {i} {dtype}"), a, b, 1.0, 1e-3);
            }
        }
    }
}

/// A small MLP's training step in bf16 through autograd (linear, relu, cross-entropy, their
/// backwards: matmuls, reductions of broadcast gradients, fused elementwise chains), against
/// the CPU: the loss and every gradient within a few bf16 ulps.
#[test]
fn mlp_step_in_bf16_matches_the_cpu() {
    use kiln_autograd::Var;
    let Some(dev) = gpu_or_skip(0) else { return };
    let dtype = DType::BF16;
    let (n, d_in, hidden, classes) = (32, 20, 24, 5);
    let labels: Vec<i64> = (0..n as i64).map(|i| (i * 3) % classes as i64).collect();
    fn step<B: Backend>(ts: &[Tensor<B>], labels: &Tensor<B>) -> (Tensor<B>, Vec<Tensor<B>>) {
        let vars: Vec<Var<B>> = ts[1..].iter().map(|t| Var::param(t.clone())).collect();
        let x = Var::constant(ts[0].clone());
        let h = x
            .linear(&vars[0], Some(&vars[1]))
            .unwrap()
            .unary(kiln_core::UnaryOp::Relu)
            .unwrap();
        let logits = h.linear(&vars[2], Some(&vars[3])).unwrap();
        let loss = logits.cross_entropy(labels, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        let grads = vars.iter().map(|v| v.grad().expect("a gradient")).collect();
        (loss.tensor(), grads)
    }
    let shapes: [&[usize]; 5] = [
        &[n, d_in],
        &[hidden, d_in],
        &[hidden],
        &[classes, hidden],
        &[classes],
    ];
    let (mut tc, mut tg) = (Vec::new(), Vec::new());
    for (i, dims) in shapes.iter().enumerate() {
        let len: usize = dims.iter().product();
        let (c, g) = pair(&values(len, 70 + i as u32, 0.5), dims, dtype, &dev);
        tc.push(c);
        tg.push(g);
    }
    let lc = Tensor::<Cpu>::from_vec(labels.clone(), [n], &Cpu::device(0)).unwrap();
    let lg = Tensor::<Cuda>::from_vec(labels, [n], &dev).unwrap();
    let (loss_c, grads_c) = step(&tc, &lc);
    let (loss_g, grads_g) = step(&tg, &lg);
    assert_close_ulps("mlp loss", &loss_g, &loss_c, 2.0, 1e-2);
    // Gradients pass through several roundings (each op rounds to bf16): a few ulps of the
    // largest gradient of each tensor.
    for (i, (g, c)) in grads_g.iter().zip(&grads_c).enumerate() {
        let scale = host_f32(c).iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        assert_close_ulps(&format!("mlp grad {i}"), g, c, 4.0, scale);
    }
}
