//! f16 and bf16 tensors on a GPU: they move (upload, download, device copies, strided
//! `contiguous`, `fill`), and every op that would compute on them returns a typed error naming
//! the op and the dtype (16-bit GPU kernels are not written yet, issue 30).
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{DType, Error, Reduction, Tensor, bf16, f16};

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

#[test]
fn sixteen_bit_arithmetic_is_a_typed_error() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in [DType::F16, DType::BF16] {
        let x = Tensor::<Cuda>::ones([2, 3], dtype, &dev).unwrap();
        let y = Tensor::<Cuda>::from_vec(vec![0i64, 1], [2], &dev).unwrap();
        let results = [
            ("add", x.add(&x).map(|_| ())),
            ("exp", x.exp().map(|_| ())),
            ("sum", x.sum_all().map(|_| ())),
            ("matmul", x.matmul(&x.t().unwrap()).map(|_| ())),
            ("softmax", x.softmax(-1).map(|_| ())),
            (
                "cross_entropy",
                x.cross_entropy(&y, Reduction::Mean).map(|_| ()),
            ),
            ("cast", x.to_dtype(DType::F32).map(|_| ())),
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
