//! `Backend::reduce` by its two paths: the hand-written kernels (`kernels/reduce.cu`), the
//! generated one-reduction programs, and the default choice between them per shape agree with
//! the CPU on rows, columns, batch-norm axes, strided views and every
//! float dtype. Its own test binary: the switch is process-wide.
//!
//! Without a GPU the test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, ReducePath, gpu_or_skip, set_reduce_path};
use kiln_core::{DType, Generator, Tensor};

/// `(shape, axes)`: rows, columns, a middle axis, batch norm's axes, everything, one past the
/// split threshold (64K reduced elements), a single element per output.
const CASES: &[(&[usize], &[isize])] = &[
    (&[37, 513], &[1]),
    (&[37, 513], &[0]),
    (&[6, 7, 9], &[1]),
    (&[8, 5, 6, 6], &[0, 2, 3]),
    (&[3, 4, 5], &[0, 1, 2]),
    (&[2, 98_304], &[1]),
    (&[300, 1], &[1]),
];

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}: element {i}: {x} against {y}"
        );
    }
}

#[test]
fn generated_reductions_match_the_kernels_and_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        // Sums of n values rounded to the dtype: the tolerance of the dtype's epsilon.
        let tol = match dtype {
            DType::F32 => 1e-5,
            DType::F64 => 1e-12,
            _ => 2e-2,
        };
        for (k, &(shape, axes)) in CASES.iter().enumerate() {
            let host = Generator::new(k as u64)
                .uniform::<Cpu>(shape, -1.0, 1.0, &Default::default())
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            let gpu = host.to_backend::<Cuda>(&dev).unwrap();
            // A transposed view too: the reduction reads strides, not a copy.
            let views = [
                (gpu.clone(), host.clone()),
                (
                    gpu.transpose(-1, -2).unwrap(),
                    host.transpose(-1, -2).unwrap(),
                ),
            ];
            for (g, h) in views {
                for op in ["sum", "max", "min"] {
                    let run = |t: &Tensor<Cuda>| {
                        match op {
                            "sum" => t.sum(axes, false),
                            "max" => t.max(axes, false),
                            _ => t.min(axes, false),
                        }
                        .and_then(|y| y.to_dtype(DType::F64))
                        .and_then(|y| y.to_vec::<f64>())
                        .unwrap()
                    };
                    let want = match op {
                        "sum" => h.sum(axes, false),
                        "max" => h.max(axes, false),
                        _ => h.min(axes, false),
                    }
                    .and_then(|y| y.to_dtype(DType::F64))
                    .and_then(|y| y.to_vec::<f64>())
                    .unwrap();
                    let what = format!("{op} {dtype} {shape:?} over {axes:?}");
                    let t = if op == "sum" { tol } else { 0.0 };
                    for path in [ReducePath::Kernels, ReducePath::Generated, ReducePath::Auto] {
                        set_reduce_path(path);
                        close(&run(&g), &want, t, &format!("{what}, {path:?}"));
                    }
                }
            }
        }
    }
}
