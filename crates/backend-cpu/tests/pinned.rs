//! Pinned CPU tensors and the host-transfer API on the CPU backend, without a GPU: kiln-core's
//! heap stand-in (`test_pinned`) replaces the GPU backend's pinned pool, so the CPU side of
//! `pin_memory`, `copy_to_slice`, `copy_from` and `to_backend` is checked in CI.

use kiln_backend_cpu::Cpu;
use kiln_core::reference::Reference;
use kiln_core::{DType, Error, Tensor};

fn setup() -> &'static kiln_core::test_pinned::HeapPinned {
    kiln_core::test_pinned::register()
}

#[test]
fn pinned_tensors_compute_like_any_other() {
    let pool = setup();
    let cpu = Cpu::device(0);
    let x = Tensor::<Cpu>::arange(0.0, 12.0, 1.0, DType::F32, &cpu)
        .unwrap()
        .reshape([3, 4])
        .unwrap();
    assert!(!x.is_pinned());
    let p = x.pin_memory().unwrap();
    assert!(p.is_pinned());
    assert!(
        p.pin_memory().unwrap().same_storage(&p),
        "already pinned: no copy"
    );
    assert_eq!(p.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    let y = (&p.t().unwrap().matmul(&p).unwrap() + 1.0).unwrap();
    let z = (&x.t().unwrap().matmul(&x).unwrap() + 1.0).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), z.to_vec::<f32>().unwrap());
    // A strided view pins into a contiguous copy.
    let pt = x.t().unwrap().pin_memory().unwrap();
    assert!(pt.is_pinned());
    assert_eq!(
        pt.to_vec::<f32>().unwrap(),
        x.t().unwrap().to_vec::<f32>().unwrap()
    );
    for dtype in [DType::F64, DType::I64, DType::U8] {
        let t = x.to_dtype(dtype).unwrap();
        let pt = t.pin_memory().unwrap();
        assert!(pt.is_pinned());
        assert_eq!(pt.to_f64_vec().unwrap(), t.to_f64_vec().unwrap());
    }
    let live = pool.live();
    assert!(live > 0);
    drop((p, pt));
    assert!(
        pool.live() < live,
        "dropping a pinned tensor frees its block"
    );
}

#[test]
fn transfers_into_caller_buffers_and_across_backends() {
    setup();
    let cpu = Cpu::device(0);
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25 - 3.0).collect();
    let x = Tensor::<Cpu>::from_slice(&data, [10, 100], &cpu).unwrap();
    let mut out = vec![0f32; 1000];
    x.copy_to_slice(&mut out).unwrap();
    assert_eq!(out, data);
    // A transposed view into a caller buffer.
    let mut outt = vec![0f32; 1000];
    x.t().unwrap().copy_to_slice(&mut outt).unwrap();
    assert_eq!(outt[1], data[100]);
    // Across backends, from ordinary and pinned memory, and back into a pinned tensor.
    let dev = kiln_core::reference::RefDevice(0);
    let r = x.to_backend::<Reference>(&dev).unwrap();
    assert_eq!(r.to_f64_vec().unwrap(), x.to_f64_vec().unwrap());
    let r2 = x
        .pin_memory()
        .unwrap()
        .narrow(1, 10, 5)
        .unwrap()
        .to_backend::<Reference>(&dev)
        .unwrap();
    assert_eq!(
        r2.to_f64_vec().unwrap(),
        x.narrow(1, 10, 5).unwrap().to_f64_vec().unwrap()
    );
    let mut back = Tensor::<Cpu>::zeros([10, 100], DType::F32, &cpu)
        .unwrap()
        .pin_memory()
        .unwrap();
    back.copy_from(&r).unwrap();
    assert!(back.is_pinned());
    assert_eq!(back.to_vec::<f32>().unwrap(), data);
    // Bad input: wrong length, wrong dtype, wrong shape, a shared or strided destination.
    let mut short = vec![0f32; 3];
    assert!(matches!(
        x.copy_to_slice(&mut short),
        Err(Error::InvalidArgument { .. })
    ));
    let mut ints = vec![0i64; 1000];
    assert!(matches!(
        x.copy_to_slice(&mut ints),
        Err(Error::DTypeMismatch { .. })
    ));
    let mut wrong = Tensor::<Cpu>::zeros([100, 10], DType::F32, &cpu).unwrap();
    assert!(wrong.copy_from(&r).is_err());
    let keep = back.clone();
    assert!(
        back.copy_from(&r).is_err(),
        "a destination shared with another handle is refused"
    );
    drop(keep);
    let mut strided = Tensor::<Cpu>::zeros([100, 10], DType::F32, &cpu)
        .unwrap()
        .t()
        .unwrap();
    let e = strided.copy_from(&r).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
}

#[test]
fn from_slice_of_every_dtype() {
    let cpu = Cpu::device(0);
    let a = Tensor::<Cpu>::from_slice(&[1u8, 2, 3], [3], &cpu).unwrap();
    assert_eq!(a.to_vec::<u8>().unwrap(), [1, 2, 3]);
    let b = Tensor::<Cpu>::from_slice(&[-1i64, 5], [2, 1], &cpu).unwrap();
    assert_eq!(b.to_vec::<i64>().unwrap(), [-1, 5]);
    let c = Tensor::<Cpu>::from_slice(&[0.5f64; 6], [2, 3], &cpu).unwrap();
    assert_eq!(c.to_vec::<f64>().unwrap(), [0.5; 6]);
    assert!(Tensor::<Cpu>::from_slice(&[1f32, 2.0], [3], &cpu).is_err());
}
