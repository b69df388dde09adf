//! Autograd over 16-bit tensors on the CPU backend: the forward runs in f16/bf16 (f32 inside
//! every kernel), the backward follows the forward's dtypes, and the gradients agree with the
//! same graph run in f32 within the 16-bit type's precision. (Gradient checks stay in f64.)

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_core::{DType, Generator, RandDist, Reduction, Tensor};

fn tensors(dtype: DType) -> (Tensor<Cpu>, Tensor<Cpu>, Tensor<Cpu>) {
    let dev = Cpu::device(0);
    let n = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    let x = Generator::new(1)
        .sample::<Cpu>([8, 5], n, DType::F32, &dev)
        .unwrap();
    let w = Generator::new(2)
        .sample::<Cpu>([5, 3], n, DType::F32, &dev)
        .unwrap();
    let y = Tensor::<Cpu>::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0, 1], [8], &dev).unwrap();
    // The 16-bit inputs, and f32 inputs holding the same (rounded) values.
    let (x, w) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
    (x, w, y)
}

/// loss = cross_entropy(relu(x @ w) * 0.5 + tanh(x @ w)) and d loss / d w, in `dtype`.
fn run(x: &Tensor<Cpu>, w: &Tensor<Cpu>, y: &Tensor<Cpu>) -> (Tensor<Cpu>, Tensor<Cpu>) {
    let (x, w) = (Var::constant(x.clone()), Var::param(w.clone()));
    let h = x.matmul(&w).unwrap();
    let z = h.relu().unwrap().mul_scalar(0.5).unwrap();
    let z = z.add(&h.tanh().unwrap()).unwrap();
    let loss = z.cross_entropy(y, Reduction::Mean).unwrap();
    loss.backward().unwrap();
    (loss.tensor(), w.grad().unwrap())
}

#[test]
fn backward_follows_the_forward_dtype() {
    for dtype in [DType::F16, DType::BF16] {
        let (x, w, y) = tensors(dtype);
        let (loss, gw) = run(&x, &w, &y);
        assert_eq!((loss.dtype(), gw.dtype()), (dtype, dtype));
        assert_eq!(gw.dims(), &[5, 3]);
        let f32 = |t: &Tensor<Cpu>| t.to_dtype(DType::F32).unwrap();
        let (loss32, gw32) = run(&f32(&x), &f32(&w), &y);
        let tol = 8.0 * dtype.epsilon();
        let (l, l32) = (
            loss.to_f64_vec().unwrap()[0],
            loss32.to_f64_vec().unwrap()[0],
        );
        assert!(
            (l - l32).abs() <= tol * l32.abs(),
            "{dtype}: loss {l} vs f32 {l32}"
        );
        let g = gw.to_f64_vec().unwrap();
        let g32 = gw32.to_f64_vec().unwrap();
        let scale = g32.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (a, b) in g.iter().zip(&g32) {
            assert!(
                (a - b).abs() <= tol * scale,
                "{dtype}: grad {a} vs f32 {b} ({g:?})"
            );
        }
    }
}
