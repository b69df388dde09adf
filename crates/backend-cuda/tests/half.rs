//! f16 and bf16 tensors on a GPU: they move (upload, download, device copies, strided
//! `contiguous`, `fill`) bit for bit, and each op computes as the CPU backend does (16-bit
//! loads and stores, f32 arithmetic inside; issue 30), within a few units in the last place.
//! Ops without 16-bit kernels yet return a typed error naming the op and the dtype.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType, Error, Reduction, Tensor, bf16, f16};

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
        // a fused chain (deferred, one generated kernel): rounds after every op, as the CPU
        let chain = |x: &Tensor<Cuda>, y: &Tensor<Cuda>| {
            x.mul(y)?.exp()?.add_scalar(1.0)?.log()?.sub(x)?.tanh()
        };
        let chain_c = |x: &Tensor<Cpu>, y: &Tensor<Cpu>| {
            x.mul(y)?.exp()?.add_scalar(1.0)?.log()?.sub(x)?.tanh()
        };
        check(
            "fused chain",
            chain(&xg, &yg).unwrap(),
            chain_c(&xc, &yc).unwrap(),
        );
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

/// Ops without 16-bit kernels yet: a typed error naming the op and the dtype.
#[test]
fn sixteen_bit_ops_without_kernels_are_typed_errors() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in HALVES {
        let x = Tensor::<Cuda>::ones([2, 3], dtype, &dev).unwrap();
        let y = Tensor::<Cuda>::from_vec(vec![0i64, 1], [2], &dev).unwrap();
        let results = [
            ("sum", x.sum_all().map(|_| ())),
            ("matmul", x.matmul(&x.t().unwrap()).map(|_| ())),
            ("softmax", x.softmax(-1).map(|_| ())),
            (
                "cross_entropy",
                x.cross_entropy(&y, Reduction::Mean).map(|_| ()),
            ),
        ];
        for (op, r) in results {
            match r {
                Err(Error::DTypeMismatch {
                    op: got_op, got, ..
                }) => {
                    assert_eq!((got_op, got), (op, dtype));
                }
                other => panic!("{op} of {dtype}: expected a DTypeMismatch, got {other:?}"),
            }
        }
    }
}
