//! Batch norm of a 16-bit input under autocast: the output, `dx` and the saved input stay in
//! the input's dtype, the statistics, `dweight`, `dbias` and the running statistics in f32, all
//! computed in f32 from the 16-bit values. Checked against the f32 op on the same (rounded)
//! input: the statistics and the parameter gradients to f32 accuracy (they are f32 sums of the
//! same products), `y` and `dx` to one 16-bit rounding. On the CPU and, when there is one, on
//! CUDA device 0 (`cargo xtask test-gpu` carries this binary to the GPU machine).

mod common;

use common::{assert_close, f64s, normal};
use kiln_autograd::{Var, autocast, update_running_stats};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType, Tensor};

const EPS: f64 = 1e-5;

/// The gradients `(dx, dw, db)` of `x`, `w`, `b` (each present).
fn grads<B: Backend>(x: &Var<B>, w: &Var<B>, b: &Var<B>) -> [Tensor<B>; 3] {
    [x, w, b].map(|v| v.grad().expect("a gradient"))
}

/// One 16-bit rounding of values about `|ref|`, with room for the f32 sums' order.
fn tol(half: DType) -> f64 {
    2.0 * half.epsilon()
}

fn check<B: Backend>(dev: &B::Device, half: DType) {
    let dims = [4, 6, 5, 3];
    let xh = normal::<B>(&dims, 1, DType::F32, dev)
        .to_dtype(half)
        .unwrap();
    let xr = xh.to_dtype(DType::F32).unwrap();
    let gh = normal::<B>(&dims, 2, DType::F32, dev)
        .to_dtype(half)
        .unwrap();
    let gr = gh.to_dtype(DType::F32).unwrap();
    let wt = normal::<B>(&[6], 3, DType::F32, dev);
    let bt = normal::<B>(&[6], 4, DType::F32, dev);
    let rm = normal::<B>(&[6], 5, DType::F32, dev);
    let rv = normal::<B>(&[6], 6, DType::F32, dev)
        .abs()
        .unwrap()
        .add_scalar(0.5)
        .unwrap();
    let what = |s: &str| format!("{half} {}: {s}", B::NAME);
    for train in [true, false] {
        let mode = if train { "train" } else { "eval" };
        // The f32 reference on the rounded input, outside autocast.
        let (x, w, b) = (
            Var::leaf(xr.clone()),
            Var::param(wt.clone()),
            Var::param(bt.clone()),
        );
        let (y_ref, stats_ref) = if train {
            let (y, s) = x.batch_norm_train(Some(&w), Some(&b), EPS).unwrap();
            (y, Some(s))
        } else {
            let y = x.batch_norm_eval(&rm, &rv, Some(&w), Some(&b), EPS);
            (y.unwrap(), None)
        };
        y_ref.backward_with(&gr).unwrap();
        let want = grads(&x, &w, &b);
        // The 16-bit input under autocast, f32 parameters and running statistics.
        let (x, w, b) = (
            Var::leaf(xh.clone()),
            Var::param(wt.clone()),
            Var::param(bt.clone()),
        );
        let (y, stats) = {
            let _amp = autocast(half).unwrap();
            if train {
                let (y, s) = x.batch_norm_train(Some(&w), Some(&b), EPS).unwrap();
                (y, Some(s))
            } else {
                let y = x.batch_norm_eval(&rm, &rv, Some(&w), Some(&b), EPS);
                (y.unwrap(), None)
            }
        };
        assert_eq!(y.dtype(), half, "{}", what(mode));
        assert_close(
            &what(&format!("{mode} y")),
            &f64s(&y.tensor()),
            &f64s(&y_ref.tensor()),
            tol(half),
        );
        y.backward_with(&gh).unwrap();
        let got = grads(&x, &w, &b);
        assert_eq!(
            got.each_ref().map(Tensor::dtype),
            [half, DType::F32, DType::F32],
            "{}",
            what(mode)
        );
        assert_close(
            &what(&format!("{mode} dx")),
            &f64s(&got[0]),
            &f64s(&want[0]),
            tol(half),
        );
        for (i, name) in [(1, "dweight"), (2, "dbias")] {
            assert_close(
                &what(&format!("{mode} {name}")),
                &f64s(&got[i]),
                &f64s(&want[i]),
                1e-4,
            );
        }
        let (Some(s), Some(s_ref)) = (stats, stats_ref) else {
            continue;
        };
        for (name, t, r) in [
            ("mean", &s.mean, &s_ref.mean),
            ("var", &s.var, &s_ref.var),
            ("var_unbiased", &s.var_unbiased, &s_ref.var_unbiased),
        ] {
            assert_eq!(t.dtype(), DType::F32, "{}", what(name));
            assert_close(&what(name), &f64s(t), &f64s(r), 1e-5);
        }
        // Running statistics: f32 ones (the layer's under autocast), and 16-bit ones (a model
        // converted to 16 bits), each updated from the f32 batch statistics.
        let (m, v) = update_running_stats(&rm, &rv, &s, 0.1).unwrap();
        let (m_ref, v_ref) = update_running_stats(&rm, &rv, &s_ref, 0.1).unwrap();
        assert_eq!(m.dtype(), DType::F32);
        assert_close(&what("running mean"), &f64s(&m), &f64s(&m_ref), 1e-5);
        assert_close(&what("running var"), &f64s(&v), &f64s(&v_ref), 1e-5);
        let (rmh, rvh) = (rm.to_dtype(half).unwrap(), rv.to_dtype(half).unwrap());
        let (m, v) = update_running_stats(&rmh, &rvh, &s, 0.1).unwrap();
        assert_eq!([m.dtype(), v.dtype()], [half, half]);
        let (m_ref, v_ref) = update_running_stats(
            &rmh.to_dtype(DType::F32).unwrap(),
            &rvh.to_dtype(DType::F32).unwrap(),
            &s_ref,
            0.1,
        )
        .unwrap();
        assert_close(
            &what("16-bit running mean"),
            &f64s(&m),
            &f64s(&m_ref),
            tol(half),
        );
        assert_close(
            &what("16-bit running var"),
            &f64s(&v),
            &f64s(&v_ref),
            tol(half),
        );
    }
}

#[test]
fn half_batch_norm_under_autocast_matches_f32_on_cpu() {
    for half in [DType::BF16, DType::F16] {
        check::<Cpu>(&Cpu::device(0), half);
    }
}

#[test]
fn half_batch_norm_under_autocast_matches_f32_on_cuda() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for half in [DType::BF16, DType::F16] {
        check::<Cuda>(&dev, half);
    }
}

/// The 16-bit op reads the input itself: no f32 copy of it is made or saved, and a 16-bit
/// parameter beside it (a model converted to bf16, outside autocast) gets a 16-bit gradient.
#[test]
fn half_batch_norm_keeps_the_input_and_the_parameters_dtypes() {
    let dev = Cpu::device(0);
    for half in [DType::BF16, DType::F16] {
        let x = Var::leaf(normal::<Cpu>(&[8, 3, 4, 4], 7, half, &dev));
        let w = Var::param(normal::<Cpu>(&[3], 8, half, &dev));
        let b = Var::param(normal::<Cpu>(&[3], 9, DType::F32, &dev));
        let (y, stats) = x.batch_norm_train(Some(&w), Some(&b), EPS).unwrap();
        assert_eq!(y.dtype(), half);
        assert_eq!(stats.mean.dtype(), DType::F32, "statistics in f32");
        y.sum(&[0, 1, 2, 3], false).unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().dtype(), half);
        assert_eq!(w.grad().unwrap().dtype(), half);
        assert_eq!(b.grad().unwrap().dtype(), DType::F32);
        // Group norm shares the engine (outside autocast, which casts its input to f32).
        let xg = Var::leaf(normal::<Cpu>(&[2, 4, 5], 10, half, &dev));
        let wg = Var::param(normal::<Cpu>(&[4], 11, DType::F32, &dev));
        let yg = xg.group_norm(2, Some(&wg), None, EPS).unwrap();
        assert_eq!(yg.dtype(), half);
        let want = Var::leaf(xg.tensor().to_dtype(DType::F32).unwrap())
            .group_norm(2, Some(&wg.detach()), None, EPS)
            .unwrap();
        assert_close(
            "group norm",
            &f64s(&yg.tensor()),
            &f64s(&want.tensor()),
            tol(half),
        );
        yg.sum(&[0, 1, 2], false).unwrap().backward().unwrap();
        assert_eq!(xg.grad().unwrap().dtype(), half);
        assert_eq!(wg.grad().unwrap().dtype(), DType::F32);
        // f64 input, f32 parameter: still an error (only a 16-bit input takes f32 ones).
        let x64 = Var::leaf(normal::<Cpu>(&[8, 3], 7, DType::F64, &dev));
        let w32 = Var::param(normal::<Cpu>(&[3], 8, DType::F32, &dev));
        assert!(x64.batch_norm_train(Some(&w32), None, EPS).is_err());
    }
}
