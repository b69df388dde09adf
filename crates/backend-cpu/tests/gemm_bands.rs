//! Large products take the row-band path (one single-threaded GEMM per core); the conformance
//! suite's shapes stay below its threshold, so check it here against f64 dot products, with a
//! plain and a transposed left operand and an odd row count (uneven bands).

use kiln_backend_cpu::Cpu;
use kiln_core::{DType, Tensor};

#[test]
fn banded_gemm_matches_f64_dot_products() {
    let dev = Cpu::device(0);
    let (m, k, n) = (301, 400, 300); // 36M multiply-adds: above the band threshold
    let a = Tensor::<Cpu>::randn([m, k], 0.0, 1.0, 1, DType::F32, &dev).unwrap();
    let at = Tensor::<Cpu>::randn([k, m], 0.0, 1.0, 1, DType::F32, &dev).unwrap();
    let b = Tensor::<Cpu>::randn([k, n], 0.0, 1.0, 2, DType::F32, &dev).unwrap();
    let bv = b.to_vec::<f32>().unwrap();
    for (lhs, name) in [(a, "a"), (at.t().unwrap(), "a.T")] {
        let c = lhs.matmul(&b).unwrap().to_vec::<f32>().unwrap();
        let l = lhs.contiguous().unwrap().to_vec::<f32>().unwrap();
        for &(i, j) in &[(0, 0), (150, 7), (151, 299), (300, 123), (299, 0)] {
            let want: f64 = (0..k)
                .map(|p| l[i * k + p] as f64 * bv[p * n + j] as f64)
                .sum();
            let got = c[i * n + j] as f64;
            assert!(
                (got - want).abs() < 1e-3,
                "{name}: c[{i}][{j}] = {got}, want {want}"
            );
        }
    }
}
