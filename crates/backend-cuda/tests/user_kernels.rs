//! CuPy-style user kernels (`src/user_kernel/`) on a GPU: `ElementwiseKernel`,
//! `ReductionKernel` and `RawKernel` against the same computation on the CPU backend (f32,
//! f64, i64; broadcast, transposed and sliced inputs; scalars; given outputs; axis
//! reductions with and without keepdims), memoization per dtype signature and
//! `clear_kernel_cache`, pending (fused) inputs, and every error case — each followed by a
//! successful op on the same device, which must still work.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{
    Cuda, CudaDevice, ElementwiseKernel, KernelArg, RawKernel, ReductionKernel, clear_kernel_cache,
    empty, gpu_or_skip, thread_launches,
};
use kiln_core::testing::assert_close;
use kiln_core::{DType, Error, Generator, RandDist, Tensor};

type G = Tensor<Cuda>;
type C = Tensor<Cpu>;

fn host(t: &G) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

fn cpu(t: &G) -> C {
    t.to_backend::<Cpu>(&Default::default()).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) {
    assert_close("values", a, b, tol);
}

fn rand(shape: &[usize], seed: u64, dtype: DType, dev: &CudaDevice) -> G {
    let dist = RandDist::Uniform {
        low: -1.0,
        high: 1.0,
    };
    Generator::new(seed)
        .sample(shape, dist, dtype, dev)
        .unwrap()
}

/// A plain op after an error: the device must still work.
fn still_works(dev: &CudaDevice) {
    let x = rand(&[1000], 99, DType::F32, dev);
    let want: Vec<f64> = host(&x).iter().map(|v| v * 2.0).collect();
    close(&host(&x.mul_scalar(2.0).unwrap()), &want, 1e-6);
}

fn sqdiff() -> ElementwiseKernel {
    ElementwiseKernel::new("T x, T y", "T z", "z = (x - y) * (x - y)", "squared_diff").unwrap()
}

#[test]
fn elementwise_matches_cpu_with_broadcast_and_views() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let k = sqdiff();
    for dtype in [DType::F32, DType::F64] {
        let x = rand(&[6, 7], 1, dtype, &dev);
        let y = rand(&[7], 2, dtype, &dev); // broadcast along rows
        let z = k.call1(&[(&x).into(), (&y).into()]).unwrap();
        assert_eq!(z.dims(), &[6, 7]);
        assert_eq!(z.dtype(), dtype);
        let d = cpu(&x).sub(&cpu(&y)).unwrap();
        let want = d.mul(&d).unwrap().to_f64_vec().unwrap();
        close(&host(&z), &want, 1e-6);
        // transposed and sliced inputs
        let xt = rand(&[7, 6], 3, dtype, &dev).t().unwrap();
        let ys = rand(&[6, 9], 4, dtype, &dev).narrow(1, 2, 7).unwrap();
        let z = k.call1(&[(&xt).into(), (&ys).into()]).unwrap();
        let d = cpu(&xt).sub(&cpu(&ys)).unwrap();
        close(&host(&z), &d.mul(&d).unwrap().to_f64_vec().unwrap(), 1e-6);
    }
    // i64: integer arithmetic
    let a = G::from_vec(vec![1i64, -5, 7, 100], [4], &dev).unwrap();
    let b = G::from_vec(vec![3i64], [1], &dev).unwrap();
    let z = k.call1(&[(&a).into(), (&b).into()]).unwrap();
    assert_eq!(z.to_vec::<i64>().unwrap(), vec![4, 64, 16, 9409]);
}

#[test]
fn elementwise_scalars_index_raw_and_several_outputs() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let k = ElementwiseKernel::new(
        "T x, raw T table, float32 alpha, int k",
        "T y, int64 idx",
        "y = x * (T)alpha + table[i % 3]; idx = (i64)i * k",
        "axpy_table",
    )
    .unwrap();
    let x = rand(&[10], 5, DType::F64, &dev);
    let table = G::from_vec(vec![1.0f64, 2.0, 3.0], [3], &dev).unwrap();
    let outs = k
        .call(&[(&x).into(), (&table).into(), 0.5f32.into(), 3i32.into()])
        .unwrap();
    let xv = host(&x);
    let want: Vec<f64> = xv
        .iter()
        .enumerate()
        .map(|(i, v)| v * 0.5 + [1.0, 2.0, 3.0][i % 3])
        .collect();
    close(&host(&outs[0]), &want, 1e-12);
    assert_eq!(outs[1].dtype(), DType::I64);
    assert_eq!(
        outs[1].to_vec::<i64>().unwrap(),
        (0..10).map(|i| i * 3).collect::<Vec<i64>>()
    );
}

#[test]
fn elementwise_writes_into_given_outputs() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // Theano's PyCUDADoubleOp, in place into a given output
    let double = ElementwiseKernel::new("T x", "T y", "y = x * 2", "double_it").unwrap();
    let x = rand(&[3, 5], 6, DType::F32, &dev);
    let mut out = G::zeros([3, 5], DType::F32, &dev).unwrap();
    double.call_into(&[(&x).into()], &mut [&mut out]).unwrap();
    let want: Vec<f64> = host(&x).iter().map(|v| v * 2.0).collect();
    close(&host(&out), &want, 1e-6);
    // a strided (transposed) output
    let mut outt = G::zeros([5, 3], DType::F32, &dev).unwrap().t().unwrap();
    double.call_into(&[(&x).into()], &mut [&mut outt]).unwrap();
    close(&host(&outt), &want, 1e-6);
    // an output shared with another tensor is refused, and left as it was
    let mut shared = G::zeros([3, 5], DType::F32, &dev).unwrap();
    let other = shared.clone();
    let e = double.call_into(&[(&x).into()], &mut [&mut shared]);
    assert!(matches!(e, Err(Error::InvalidArgument { .. })), "{e:?}");
    assert_eq!(shared.dims(), &[3, 5]);
    assert!(host(&shared).iter().all(|v| *v == 0.0));
    drop(other);
    still_works(&dev);
}

#[test]
fn pending_inputs_run_first() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = rand(&[1000], 7, DType::F32, &dev);
    let pending = x.exp().unwrap().add_scalar(1.0).unwrap(); // deferred, fused
    let z = sqdiff().call1(&[(&pending).into(), (&x).into()]).unwrap();
    let p = cpu(&x).exp().unwrap().add_scalar(1.0).unwrap();
    let d = p.sub(&cpu(&x)).unwrap();
    close(&host(&z), &d.mul(&d).unwrap().to_f64_vec().unwrap(), 1e-5);
}

/// A call like the one before reuses its plan (types, shape, addressing, kernel); any change
/// that matters must not: other strides, another offset, another dtype, another kernel
/// definition made from a clone, or a cleared kernel cache between two identical calls.
#[test]
fn repeated_calls_reuse_a_plan_only_while_it_applies() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let k = ElementwiseKernel::new("T x", "T y", "y = x * 2", "plan_probe").unwrap();
    let base = rand(&[8, 12], 21, DType::F32, &dev);
    let twice = |t: &G| -> Vec<f64> { host(t).iter().map(|v| v * 2.0).collect() };
    let views = [
        base.clone(),
        base.t().unwrap(),                  // other strides
        base.narrow(1, 3, 6).unwrap(),      // other shape, an offset
        base.narrow(1, 4, 6).unwrap(),      // same shape and strides, another offset
        base.to_dtype(DType::F64).unwrap(), // another dtype
    ];
    for _ in 0..2 {
        for v in &views {
            let y = k.call1(&[v.into()]).unwrap();
            assert_eq!(y.dims(), v.dims());
            assert_eq!(y.dtype(), v.dtype());
            close(&host(&y), &twice(v), 1e-6);
            // The same call again: the same values.
            close(&host(&k.call1(&[v.into()]).unwrap()), &twice(v), 1e-6);
        }
    }
    // A clone given another definition shares nothing stale with the original.
    let scaled = |c: &str| {
        ElementwiseKernel::new("float32 x", "float32 y", "y = scale(x)", "plan_probe_pre")
            .unwrap()
            .with_preamble(&format!(
                "__device__ float scale(float v) {{ return v * {c}; }}"
            ))
    };
    let k2 = scaled("2.f");
    let k3 = k2
        .clone()
        .with_preamble("__device__ float scale(float v) { return v * 3.f; }");
    let v = &views[0];
    close(&host(&k2.call1(&[v.into()]).unwrap()), &twice(v), 1e-6);
    let thrice: Vec<f64> = host(v).iter().map(|x| x * 3.0).collect();
    close(&host(&k3.call1(&[v.into()]).unwrap()), &thrice, 1e-6);
    close(&host(&k2.call1(&[v.into()]).unwrap()), &twice(v), 1e-6);
    // A cleared kernel cache unloads the plan's kernel: the next identical call plans again.
    clear_kernel_cache(&dev).unwrap();
    close(&host(&k.call1(&[v.into()]).unwrap()), &twice(v), 1e-6);
    still_works(&dev);
}

#[test]
fn kernels_are_memoized_per_dtype_signature_and_cleared() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let k = ElementwiseKernel::new("T x", "T y", "y = x + 1", "memo_probe").unwrap();
    let f = rand(&[100], 8, DType::F32, &dev);
    let d = rand(&[100], 9, DType::F64, &dev);
    for _ in 0..3 {
        let before = thread_launches();
        k.call1(&[(&f).into()]).unwrap();
        k.call1(&[(&d).into()]).unwrap();
        assert_eq!(thread_launches() - before, 2);
    }
    clear_kernel_cache(&dev).unwrap();
    let y = k.call1(&[(&d).into()]).unwrap();
    let want: Vec<f64> = host(&d).iter().map(|v| v + 1.0).collect();
    close(&host(&y), &want, 1e-12);
}

#[test]
fn reductions_match_cpu_over_axes() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let l2 =
        ReductionKernel::new("T x", "T y", "x * x", "a + b", "y = sqrt(a)", "0", "l2norm").unwrap();
    for dtype in [DType::F32, DType::F64] {
        // f32 sums accumulate in f32 here (the accumulator is the output's type), in another
        // order than the CPU's
        let tol = if dtype == DType::F32 { 2e-4 } else { 1e-10 };
        let x = rand(&[5, 300, 4], 10, dtype, &dev);
        let c = cpu(&x);
        let sq = c.mul(&c).unwrap();
        for (axes, keep) in [
            (None, false),
            (Some(vec![1isize]), false),
            (Some(vec![0, 2]), true),
            (Some(vec![-1]), true),
        ] {
            let got = l2
                .call(&[(&x).into()], axes.as_deref(), keep)
                .unwrap()
                .remove(0);
            let all = [0isize, 1, 2];
            let want = sq
                .sum(axes.as_deref().unwrap_or(&all), keep)
                .unwrap()
                .sqrt()
                .unwrap();
            assert_eq!(got.dims(), want.dims(), "{axes:?} {keep}");
            close(&host(&got), &want.to_f64_vec().unwrap(), tol);
        }
        // a transposed input, reduced along its rows
        let xt = rand(&[400, 6], 11, dtype, &dev).t().unwrap();
        let got = l2
            .call(&[(&xt).into()], Some(&[1]), false)
            .unwrap()
            .remove(0);
        let c = cpu(&xt);
        let want = c.mul(&c).unwrap().sum(&[1], false).unwrap().sqrt().unwrap();
        close(&host(&got), &want.to_f64_vec().unwrap(), tol);
    }
}

/// A full reduction of a large tensor, and long rows of few kept elements, are split over many
/// blocks (two launches); the results match the CPU, with the accumulator in double, a
/// post-map, and the same bits on a second call.
#[test]
fn long_reductions_are_split_over_blocks() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let l2 = ReductionKernel::new("T x", "T y", "x * x", "a + b", "y = sqrt(a)", "0", "l2norm")
        .unwrap()
        .with_reduce_type("float64")
        .unwrap();
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
        let x = rand(&[2048, 2048], 14, dtype, &dev);
        let c = cpu(&x);
        let sq = c.mul(&c).unwrap();
        let got = l2.call(&[(&x).into()], None, false).unwrap().remove(0);
        let want = sq.sum(&[0, 1], false).unwrap().sqrt().unwrap();
        close(&host(&got), &want.to_f64_vec().unwrap(), tol);
        let l0 = kiln_backend_cuda::thread_launches();
        let again = l2.call(&[(&x).into()], None, false).unwrap().remove(0);
        assert_eq!(
            kiln_backend_cuda::thread_launches() - l0,
            2,
            "fold, then finish"
        );
        assert_eq!(host(&again), host(&got), "the same order every call");
        // the same values one element into a buffer (no 16-byte loads): the same bits
        let flat = c.reshape([2048 * 2048]).unwrap();
        let pad = C::zeros([1], dtype, &Default::default()).unwrap();
        let shifted = C::cat(&[pad, flat], 0).unwrap();
        let shifted = G::from_host(&shifted.to_host().unwrap(), [2048 * 2048 + 1], &dev)
            .unwrap()
            .narrow(0, 1, 2048 * 2048)
            .unwrap();
        let moved = l2
            .call(&[(&shifted).into()], None, false)
            .unwrap()
            .remove(0);
        assert_eq!(host(&moved), host(&got), "the same order at any alignment");
        // three rows of 2^19 read transposed: a strided fold per part
        let r = rand(&[1 << 19, 3], 15, dtype, &dev);
        let rt = r.permute(&[1, 0]).unwrap();
        let got = l2
            .call(&[(&rt).into()], Some(&[1]), false)
            .unwrap()
            .remove(0);
        let rc = cpu(&r);
        let want = rc
            .mul(&rc)
            .unwrap()
            .sum(&[0], false)
            .unwrap()
            .sqrt()
            .unwrap();
        close(&host(&got), &want.to_f64_vec().unwrap(), tol);
    }
}

#[test]
fn reductions_with_two_inputs_scalars_a_reduce_type_and_given_outputs() {
    let Some(dev) = gpu_or_skip(0) else { return };
    // weighted max of |x - m| with a broadcast row, accumulated in double
    let k = ReductionKernel::new(
        "T x, T m, float64 w",
        "T y, float64 s",
        "fabs((double)x - (double)m) * w",
        "a > b ? a : b",
        "y = (T)a; s = a",
        "-1.0",
        "wmax",
    )
    .unwrap()
    .with_reduce_type("float64")
    .unwrap();
    let x = rand(&[7, 50], 12, DType::F32, &dev);
    let m = rand(&[7, 1], 13, DType::F32, &dev);
    let mut y = G::zeros([7], DType::F32, &dev).unwrap();
    let mut s = G::zeros([7], DType::F64, &dev).unwrap();
    k.call_into(
        &[(&x).into(), (&m).into(), 2.0f64.into()],
        Some(&[1]),
        false,
        &mut [&mut y, &mut s],
    )
    .unwrap();
    let want = cpu(&x)
        .sub(&cpu(&m))
        .unwrap()
        .abs()
        .unwrap()
        .mul_scalar(2.0)
        .unwrap()
        .max(&[1], false)
        .unwrap()
        .to_f64_vec()
        .unwrap();
    close(&host(&y), &want, 1e-6);
    close(&host(&s), &want, 1e-6);
    // an empty reduction gives the identity
    let e = G::zeros([3, 0], DType::F32, &dev).unwrap();
    let z = G::zeros([3, 1], DType::F32, &dev).unwrap();
    let r = k
        .call(
            &[(&e).into(), (&z).into(), 1.0f64.into()],
            Some(&[1]),
            false,
        )
        .unwrap();
    assert_eq!(host(&r[1]), vec![-1.0; 3]);
}

const MULTIPLY_THEM: &str = r#"
extern "C" __global__ void multiply_them(float* dest, const float* a, const float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dest[i] = a[i] * b[i];
}
"#;

#[test]
fn raw_kernel_runs_with_user_grid_and_block() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let k = RawKernel::new(MULTIPLY_THEM, "multiply_them");
    let n = 1000usize;
    let a = rand(&[n], 14, DType::F32, &dev);
    let b = rand(&[n], 15, DType::F32, &dev);
    let dest = empty([n], DType::F32, &dev).unwrap();
    k.launch(
        (n as u32).div_ceil(128),
        128u32,
        0,
        &[(&dest).into(), (&a).into(), (&b).into(), (n as i32).into()],
    )
    .unwrap();
    let want = cpu(&a).mul(&cpu(&b)).unwrap().to_f64_vec().unwrap();
    close(&host(&dest), &want, 1e-6);
    // a pending input and a sliced one (pointer to its first element)
    let pa = a.mul_scalar(3.0).unwrap();
    let sb = rand(&[n + 10], 16, DType::F32, &dev)
        .narrow(0, 10, n)
        .unwrap();
    let dest = empty([n], DType::F32, &dev).unwrap();
    k.launch_on(
        &dev,
        (8u32, 1u32, 1u32),
        (128u32, 1u32),
        0,
        &[
            (&dest).into(),
            (&pa).into(),
            (&sb).into(),
            (n as i32).into(),
        ],
    )
    .unwrap();
    let want = cpu(&a)
        .mul_scalar(3.0)
        .unwrap()
        .mul(&cpu(&sb))
        .unwrap()
        .to_f64_vec()
        .unwrap();
    close(&host(&dest), &want, 1e-6);
}

#[test]
fn syntax_errors_carry_nvrtcs_log_and_the_device_stays_usable() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = rand(&[10], 17, DType::F32, &dev);
    let bad = ElementwiseKernel::new("T x", "T y", "y = x +* undefined_thing", "broken").unwrap();
    match bad.call1(&[(&x).into()]) {
        Err(Error::Backend { op, msg }) => {
            assert_eq!(op, "ElementwiseKernel");
            assert!(
                msg.contains("broken") && msg.contains("undefined_thing"),
                "{msg}"
            );
        }
        other => panic!("expected an NVRTC error, got {other:?}"),
    }
    still_works(&dev);
    let bad = ReductionKernel::new("T x", "T y", "x", "a +", "y = a", "0", "broken_red").unwrap();
    assert!(matches!(
        bad.call(&[(&x).into()], None, false),
        Err(Error::Backend { .. })
    ));
    still_works(&dev);
    let bad = RawKernel::new("extern \"C\" __global__ void k(float* p) { p[0] = ; }", "k");
    match bad.launch(1u32, 1u32, 0, &[(&x).into()]) {
        Err(Error::Backend { msg, .. }) => assert!(msg.contains("error"), "{msg}"),
        other => panic!("expected an NVRTC error, got {other:?}"),
    }
    still_works(&dev);
    // a name that is not in the module (C++ mangling without extern "C")
    let mangled = RawKernel::new("__global__ void k2(float* p) { p[0] = 1; }", "k2");
    assert!(mangled.launch(1u32, 1u32, 0, &[(&x).into()]).is_err());
    still_works(&dev);
}

#[test]
fn argument_errors_are_typed_and_the_device_stays_usable() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let k = sqdiff();
    let f = rand(&[4, 5], 18, DType::F32, &dev);
    let d = rand(&[4, 5], 19, DType::F64, &dev);
    let bad_shape = rand(&[3], 20, DType::F32, &dev);
    // wrong count
    let e = k.call(&[(&f).into()]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    still_works(&dev);
    // placeholder bound to tensors of different dtypes
    let e = k.call(&[(&f).into(), (&d).into()]).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    still_works(&dev);
    // shapes that do not broadcast
    let e = k.call(&[(&f).into(), (&bad_shape).into()]).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    still_works(&dev);
    // an unresolvable placeholder: T only bound to scalars
    let e = k.call(&[1.0f32.into(), 2.0f32.into()]).unwrap_err();
    assert!(e.to_string().contains("placeholder `T`"), "{e}");
    still_works(&dev);
    // a concrete type against a tensor of another dtype
    let typed = ElementwiseKernel::new("float32 x", "float32 y", "y = x", "copy_f32").unwrap();
    let e = typed.call(&[(&d).into()]).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    still_works(&dev);
    // a given output of the wrong shape
    let mut out = G::zeros([2, 5], DType::F32, &dev).unwrap();
    let e = k
        .call_into(&[(&f).into(), (&f).into()], &mut [&mut out])
        .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    still_works(&dev);
    // reduction: axis out of range
    let l2 =
        ReductionKernel::new("T x", "T y", "x * x", "a + b", "y = sqrt(a)", "0", "l2norm").unwrap();
    let e = l2.call(&[(&f).into()], Some(&[2]), false).unwrap_err();
    assert!(matches!(e, Error::AxisOutOfRange { .. }), "{e}");
    still_works(&dev);
    // raw kernel: wrong argument count and a scalar where a pointer is expected
    let raw = RawKernel::new(MULTIPLY_THEM, "multiply_them");
    let e = raw
        .launch(1u32, 20u32, 0, &[(&f).into(), (&f).into(), (&f).into()])
        .unwrap_err();
    assert!(e.to_string().contains("takes 4 parameter"), "{e}");
    still_works(&dev);
    let e = raw
        .launch(
            1u32,
            20u32,
            0,
            &[(&f).into(), 1.0f32.into(), (&f).into(), 20i32.into()],
        )
        .unwrap_err();
    assert!(e.to_string().contains("parameter 1"), "{e}");
    still_works(&dev);
    // malformed parameter lists
    assert!(ElementwiseKernel::new("T x y", "T z", "z = x", "k").is_err());
    assert!(ElementwiseKernel::new("T x", "", "x", "k").is_err());
    assert!(ReductionKernel::new("T a", "T y", "a", "a + b", "y = a", "0", "k").is_err());
    let args: [KernelArg; 0] = [];
    assert!(
        RawKernel::new(MULTIPLY_THEM, "multiply_them")
            .launch(1u32, 1u32, 0, &args)
            .is_err()
    );
    still_works(&dev);
}

#[test]
fn tensors_on_different_devices_are_an_error() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let Some(dev1) = kiln_backend_cuda::try_gpu(1) else {
        eprintln!("skipped: one GPU only (the device check needs two)");
        return;
    };
    let a = rand(&[10], 21, DType::F32, &dev);
    let b = rand(&[10], 22, DType::F32, &dev1);
    let e = sqdiff().call(&[(&a).into(), (&b).into()]).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    still_works(&dev);
}
