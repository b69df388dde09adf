//! Focused tests of the CPU backend: hand-computed values, strided views, errors, and a
//! side-by-side check against the f64 reference backend. (The full property-based suite is
//! `tests/conformance.rs`.)

use kiln_backend_cpu::{Cpu, CpuDevice};
use kiln_core::philox;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::testing::check_close;
use kiln_core::{
    Backend, BinaryOp, CmpOp, DType, Error, Generator, RandDist, ReduceOp, Reduction, Result,
    Tensor, UnaryOp,
};

fn dev() -> CpuDevice {
    Cpu::device(0)
}

fn t32(v: &[f32], shape: &[usize]) -> Tensor<Cpu> {
    Tensor::from_slice(v, shape, &dev()).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
    check_close(a, b, tol, tol).is_ok()
}

fn check_against_ref(
    name: &str,
    data: &[f64],
    shape: &[usize],
    dtype: DType,
    tol: f64,
    f_cpu: impl Fn(&Tensor<Cpu>) -> Result<Tensor<Cpu>>,
    f_ref: impl Fn(&Tensor<Reference>) -> Result<Tensor<Reference>>,
) {
    let hb = kiln_core::HostBuffer::from_f64(dtype, data);
    let c = Tensor::<Cpu>::from_host(&hb, shape, &dev()).unwrap();
    let r = Tensor::<Reference>::from_host(&hb, shape, &RefDevice(0)).unwrap();
    let (oc, or) = (f_cpu(&c).unwrap(), f_ref(&r).unwrap());
    assert_eq!(oc.dims(), or.dims(), "{name}: shapes");
    assert_eq!(oc.dtype(), or.dtype(), "{name}: dtypes");
    let (vc, vr) = (oc.to_f64_vec().unwrap(), or.to_f64_vec().unwrap());
    assert!(close(&vc, &vr, tol), "{name}:\n cpu {vc:?}\n ref {vr:?}");
}

fn data(n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 37 + 11) % 23) as f64 * 0.37 - 4.1)
        .collect()
}

#[test]
fn unary_binary_on_views_match_reference() {
    let d = data(60);
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 2e-6 } else { 1e-12 };
        for op in UnaryOp::ALL {
            check_against_ref(
                op.name(),
                &d,
                &[3, 4, 5],
                dtype,
                tol,
                |x| x.permute(&[2, 0, 1])?.narrow(1, 1, 2)?.unary(op),
                |x| x.permute(&[2, 0, 1])?.narrow(1, 1, 2)?.unary(op),
            );
        }
        for op in BinaryOp::ALL {
            check_against_ref(
                op.name(),
                &d,
                &[3, 4, 5],
                dtype,
                tol,
                |x| {
                    x.transpose(0, 2)?.binary(
                        op,
                        &x.narrow(0, 1, 1)?.transpose(0, 2)?.narrow(0, 1, 1)?.abs()?,
                    )
                },
                |x| {
                    x.transpose(0, 2)?.binary(
                        op,
                        &x.narrow(0, 1, 1)?.transpose(0, 2)?.narrow(0, 1, 1)?.abs()?,
                    )
                },
            );
            check_against_ref(
                op.name(),
                &d,
                &[6, 10],
                dtype,
                tol,
                |x| x.binary_scalar(op, 1.5)?.scalar_binary(op, 0.5),
                |x| x.binary_scalar(op, 1.5)?.scalar_binary(op, 0.5),
            );
        }
    }
}

#[test]
fn softmax_on_every_axis_matches_reference() {
    let d = data(6 * 33 * 17);
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        for dim in [0isize, 1, 2, -1, -2, -3] {
            check_against_ref(
                &format!("softmax({dim})"),
                &d,
                &[6, 33, 17],
                dtype,
                tol,
                |x| x.softmax(dim),
                |x| x.softmax(dim),
            );
            check_against_ref(
                &format!("log_softmax({dim}) of a transposed view"),
                &d,
                &[6, 33, 17],
                dtype,
                tol,
                |x| x.transpose(0, 2)?.log_softmax(dim),
                |x| x.transpose(0, 2)?.log_softmax(dim),
            );
        }
    }
}

#[test]
fn large_parallel_paths_match_reference() {
    let d = data(300 * 257);
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        check_against_ref("exp", &d, &[300, 257], dtype, tol, |x| x.exp(), |x| x.exp());
        check_against_ref(
            "t+x",
            &d,
            &[300, 257],
            dtype,
            tol,
            |x| x.narrow(0, 0, 257)?.t()?.add(&x.narrow(0, 1, 257)?),
            |x| x.narrow(0, 0, 257)?.t()?.add(&x.narrow(0, 1, 257)?),
        );
        for axes in [&[0isize][..], &[1], &[0, 1]] {
            check_against_ref(
                "sum",
                &d,
                &[300, 257],
                dtype,
                tol,
                |x| x.sum(axes, true),
                |x| x.sum(axes, true),
            );
            check_against_ref(
                "max",
                &d,
                &[300, 257],
                dtype,
                tol,
                |x| x.t()?.max(axes, false),
                |x| x.t()?.max(axes, false),
            );
        }
        check_against_ref(
            "argmin",
            &d,
            &[300, 257],
            dtype,
            0.0,
            |x| x.argmin(0, false),
            |x| x.argmin(0, false),
        );
        check_against_ref(
            "softmax",
            &d,
            &[300, 257],
            dtype,
            tol,
            |x| x.t()?.softmax(-1),
            |x| x.t()?.softmax(-1),
        );
        check_against_ref(
            "log_softmax",
            &d,
            &[300, 257],
            dtype,
            tol,
            |x| x.log_softmax(-1),
            |x| x.log_softmax(-1),
        );
        check_against_ref(
            "matmul",
            &d,
            &[300, 257],
            dtype,
            tol * 10.0,
            |x| x.matmul(&x.narrow(0, 3, 100)?.t()?),
            |x| x.matmul(&x.narrow(0, 3, 100)?.t()?),
        );
        check_against_ref(
            "matmul_t",
            &d,
            &[300, 257],
            dtype,
            tol * 10.0,
            |x| x.t()?.matmul(&x.narrow(1, 7, 50)?),
            |x| x.t()?.matmul(&x.narrow(1, 7, 50)?),
        );
        check_against_ref(
            "bmm",
            &d,
            &[300, 257],
            dtype,
            tol * 10.0,
            |x| {
                x.narrow(0, 0, 240)?
                    .reshape([4, 60, 257])?
                    .matmul(&x.narrow(1, 0, 30)?.narrow(0, 0, 257)?)
            },
            |x| {
                x.narrow(0, 0, 240)?
                    .reshape([4, 60, 257])?
                    .matmul(&x.narrow(1, 0, 30)?.narrow(0, 0, 257)?)
            },
        );
    }
}

#[test]
fn hand_computed_values() -> Result<()> {
    let x = t32(&[1.0, -2.0, 3.0, -4.0, 5.0, -6.0], &[2, 3]);
    assert_eq!(x.abs()?.sum(&[1], false)?.to_vec::<f32>()?, vec![6.0, 15.0]);
    assert_eq!(
        x.relu()?.to_vec::<f32>()?,
        vec![1.0, 0.0, 3.0, 0.0, 5.0, 0.0]
    );
    assert_eq!(x.argmax(1, false)?.to_vec::<i64>()?, vec![2, 1]);
    assert_eq!(x.max(&[0], false)?.to_vec::<f32>()?, vec![1.0, 5.0, 3.0]);
    let y = x.t()?.matmul(&x)?; // [3,3]
    assert_eq!(y.to_vec::<f32>()?[..3], [17.0, -22.0, 27.0]);
    let i = Tensor::<Cpu>::from_slice(&[7i64, -7, 7, -7, 0], [5], &dev())?;
    let j = Tensor::<Cpu>::from_slice(&[2i64, 2, -2, -2, 0], [5], &dev())?;
    assert_eq!(i.div(&j)?.to_vec::<i64>()?, vec![3, -3, -3, 3, 0]);
    assert_eq!(i.div_scalar(0.0)?.to_vec::<i64>()?, vec![0; 5]);
    let s = t32(&[0.0, 0.0, 0.0, 0.0], &[1, 4]).softmax(-1)?;
    assert_eq!(s.to_vec::<f32>()?, vec![0.25; 4]);
    let big = t32(&[1000.0, 1000.0], &[1, 2]);
    assert_eq!(
        big.log_softmax(-1)?.to_vec::<f32>()?,
        vec![-std::f32::consts::LN_2; 2]
    );
    let g = t32(&[0.0, 1.0, -1.0], &[3]).gelu()?.to_vec::<f32>()?;
    assert!((g[1] - 0.841_344_7).abs() < 1e-6 && (g[2] + 0.158_655_25).abs() < 1e-6);
    // casts are `as` casts
    let c = t32(&[-1.5, 300.7, f32::NAN, 2.9], &[4]).to_dtype(DType::U8)?;
    assert_eq!(c.to_vec::<u8>()?, vec![0, 255, 0, 2]);
    // NaN rules
    let n = t32(&[1.0, f32::NAN, 3.0, f32::NAN], &[4]);
    assert_eq!(n.argmax(0, false)?.to_vec::<i64>()?, vec![1]);
    assert!(n.max_all()?.to_scalar()?.is_nan());
    let e = t32(&[2.0, 5.0, 5.0, 1.0, 1.0], &[5]);
    assert_eq!(e.argmax(0, false)?.to_vec::<i64>()?, vec![1]);
    assert_eq!(e.argmin(0, false)?.to_vec::<i64>()?, vec![3]);
    // NaN in reductions over the leading axis (row-wise fast path) and over the last axis
    let nn = t32(&[1.0, f32::NAN, 3.0, 4.0, 5.0, f32::NAN], &[2, 3]);
    let mx = nn.max(&[0], false)?.to_vec::<f32>()?;
    assert!(mx[0] == 4.0 && mx[1].is_nan() && mx[2].is_nan(), "{mx:?}");
    let mn = nn.min(&[0], false)?.to_vec::<f32>()?;
    assert!(mn[0] == 1.0 && mn[1].is_nan() && mn[2].is_nan(), "{mn:?}");
    let mr = nn.max(&[1], false)?.to_vec::<f32>()?;
    assert!(mr[0].is_nan() && mr[1].is_nan(), "{mr:?}");
    let big: Vec<f32> = (0..40)
        .map(|i| if i == 37 { f32::NAN } else { i as f32 })
        .collect();
    assert!(t32(&big, &[40]).max_all()?.to_scalar()?.is_nan());
    assert_eq!(
        t32(&big, &[40]).narrow(0, 0, 37)?.max_all()?.to_scalar()?,
        36.0
    );
    // compare and where
    let m = e.compare_scalar(CmpOp::Gt, 1.5)?;
    assert_eq!(m.to_vec::<u8>()?, vec![1, 1, 1, 0, 0]);
    let w = m.where_cond(&e, &e.neg()?)?;
    assert_eq!(w.to_vec::<f32>()?, vec![2.0, 5.0, 5.0, -1.0, -1.0]);
    // empty sum is 0
    let z = Tensor::<Cpu>::zeros([3, 0], DType::F32, &dev())?;
    assert_eq!(z.sum(&[1], false)?.to_vec::<f32>()?, vec![0.0; 3]);
    Ok(())
}

#[test]
fn f32_sum_is_accurate() -> Result<()> {
    // 2^24 + many ones: a naive f32 accumulation gets stuck at 2^24.
    let n = (1 << 20) + 1;
    let mut v = vec![1.0f32; n];
    v[0] = 16_777_216.0;
    let s = t32(&v, &[n]).sum_all()?.to_scalar()?;
    assert_eq!(s, 16_777_216.0 + (1 << 20) as f64);
    let s = t32(&v, &[n])
        .narrow(0, 0, n - 1)?
        .sum(&[0], false)?
        .to_scalar()?;
    assert_eq!(s, 16_777_216.0 + (1 << 20) as f64); // 2^24 + 2^20 - 1 rounds up to even
    Ok(())
}

#[test]
fn cross_entropy_and_backward() -> Result<()> {
    let logits = t32(&[1.0, 2.0, 3.0, 1.0, 1.0, 1.0], &[2, 3]);
    let labels = Tensor::<Cpu>::from_slice(&[2i64, 0], [2], &dev())?;
    let l = logits
        .cross_entropy(&labels, Reduction::None)?
        .to_vec::<f32>()?;
    let want0 = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln() - 3.0;
    assert!((l[0] - want0).abs() < 1e-6 && (l[1] - 3f32.ln()).abs() < 1e-6);
    let g = t32(&[1.0, 2.0], &[2]);
    let d = logits
        .cross_entropy_backward(&labels, &g)?
        .to_vec::<f32>()?;
    assert!((d[3] - 2.0 * (1.0 / 3.0 - 1.0)).abs() < 1e-6 && (d[4] - 2.0 / 3.0).abs() < 1e-6);
    let bad = Tensor::<Cpu>::from_slice(&[2i64, 3], [2], &dev())?;
    let e = logits.cross_entropy(&bad, Reduction::None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "cross_entropy",
                index: 3,
                size: 3
            }
        ),
        "{e:?}"
    );
    Ok(())
}

#[test]
fn index_ops_and_errors() -> Result<()> {
    let x = t32(&(0..12).map(|i| i as f32).collect::<Vec<_>>(), &[3, 4]);
    let ids = Tensor::<Cpu>::from_slice(&[2i64, 0, 2], [3], &dev())?;
    let s = x.index_select(0, &ids)?;
    assert_eq!(s.dims(), [3, 4]);
    assert_eq!(s.to_vec::<f32>()?[..5], [8.0, 9.0, 10.0, 11.0, 0.0]);
    let s1 = x.t()?.index_select(1, &ids)?; // [4, 3] picking columns of x^T = rows of x
    assert_eq!(s1.to_vec::<f32>()?[..3], [8.0, 0.0, 8.0]);
    let gi = Tensor::<Cpu>::from_slice(&[3i64, 0, 1], [3, 1], &dev())?;
    assert_eq!(x.gather(1, &gi)?.to_vec::<f32>()?, vec![3.0, 4.0, 9.0]);
    let src = t32(&[1.0, 1.0, 1.0], &[3, 1]);
    let sa = x.zeros_like()?.scatter_add(1, &gi, &src)?;
    assert_eq!(
        sa.sum(&[0], false)?.to_vec::<f32>()?,
        vec![1.0, 1.0, 0.0, 1.0]
    );
    let sa2 = x.zeros_like()?.scatter_add(
        0,
        &ids.unsqueeze(1)?.broadcast_to([3, 4])?.contiguous()?,
        &x,
    )?;
    assert_eq!(sa2.to_vec::<f32>()?[..4], [4.0, 5.0, 6.0, 7.0]);
    assert_eq!(sa2.to_vec::<f32>()?[8..], [8.0, 10.0, 12.0, 14.0]);
    for bad in [-1i64, 3] {
        let b = Tensor::<Cpu>::from_slice(&[0i64, bad], [2], &dev())?;
        let e = x.index_select(0, &b).unwrap_err();
        assert!(
            matches!(
                e,
                Error::IndexOutOfRange {
                    op: "index_select",
                    index,
                    size: 3,
                } if index == bad
            ),
            "{e}"
        );
    }
    let bg = Tensor::<Cpu>::from_slice(&[0i64, 4, 0], [3, 1], &dev())?;
    let e = x.gather(1, &bg).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "gather",
                index: 4,
                size: 4
            }
        ),
        "{e}"
    );
    let e = x.zeros_like()?.scatter_add(1, &bg, &src).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "scatter_add",
                index: 4,
                size: 4
            }
        ),
        "{e}"
    );
    Ok(())
}

#[test]
fn devices_copies_and_mismatch() -> Result<()> {
    assert_eq!(Cpu::parse_device("cpu")?, Cpu::device(0));
    assert_eq!(Cpu::parse_device("cpu:2")?.to_string(), "cpu:2");
    assert!(Cpu::parse_device("cuda:0").is_err());
    let x = t32(&[1.0, 2.0], &[2]);
    assert!(x.to_device(&dev())?.same_storage(&x));
    let y = x.copy_to(&Cpu::device(1))?;
    assert_eq!(y.device().to_string(), "cpu:1");
    assert!(!y.same_storage(&x));
    let e = x.add(&y).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("cpu") && e.contains("cpu:1"),
        "{e}"
    );
    assert!(format!("{y}").contains("cpu:1"));
    Ok(())
}

#[test]
fn memory_stats_track_live_buffers() -> Result<()> {
    let d = Cpu::device(7);
    let before = Cpu::memory_stats(&d)?;
    let t = Tensor::<Cpu>::zeros([1 << 20], DType::F32, &d)?;
    let during = Cpu::memory_stats(&d)?;
    assert_eq!(during.in_use, before.in_use + (4 << 20));
    assert!(during.peak >= during.in_use);
    drop(t);
    let after = Cpu::memory_stats(&d)?;
    assert_eq!(after.in_use, before.in_use);
    assert_eq!(after.reserved, after.in_use + (4 << 20)); // cached for reuse
    Cpu::empty_cache(&d)?;
    assert_eq!(Cpu::memory_stats(&d)?.reserved, after.in_use);
    Ok(())
}

#[test]
fn random_is_philox_bit_for_bit() -> Result<()> {
    let n = 100_000;
    let u = Generator::new(42)
        .uniform::<Cpu>([n], -1.0, 2.0, &dev())?
        .to_vec::<f32>()?;
    let z = Generator::new(9)
        .sample::<Cpu>(
            [n],
            RandDist::Normal {
                mean: 0.5,
                std: 2.0,
            },
            DType::F64,
            &dev(),
        )?
        .to_vec::<f64>()?;
    for i in [0, 1, 4095, 77_777, n - 1] {
        assert_eq!(
            u[i].to_bits(),
            kiln_core::philox::uniform_f32(philox::draw_key(42, 0), i as u64, -1.0, 2.0).to_bits()
        );
        assert_eq!(
            z[i].to_bits(),
            kiln_core::philox::normal_f64(philox::draw_key(9, 0), i as u64, 0.5, 2.0).to_bits()
        );
    }
    Ok(())
}

#[test]
fn cat_and_slice_assign_use_copy_into() -> Result<()> {
    let a = t32(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let c = Tensor::cat(&[a.clone(), a.t()?], 1)?;
    assert_eq!(
        c.to_vec::<f32>()?,
        vec![1.0, 2.0, 1.0, 3.0, 3.0, 4.0, 2.0, 4.0]
    );
    let r = ReduceOp::Sum;
    assert_eq!(c.reduce(r, &[0, 1], false)?.to_scalar()?, 20.0);
    Ok(())
}

#[test]
fn slice_assign_into_a_fresh_tensor_writes_in_place() -> Result<()> {
    // The gradient of `narrow` is zeros with the slice written in: the only handle on the
    // zeros must be written in place, not copied whole first (and a shared one must be).
    use kiln_core::profile::{self, Kind};
    let g = t32(&[1.0, 2.0], &[1, 2]);
    let (out, p) = profile::profile(|| {
        let _r = profile::range("slice-assign-fresh");
        Tensor::<Cpu>::zeros([2, 2], DType::F32, &dev())?.slice_assign(0, 1, &g)
    });
    assert_eq!(out?.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 2.0]);
    let p = p.in_range("slice-assign-fresh");
    assert!(p.row(Kind::Op, "copy_to").is_none(), "{}", p.table());
    let shared = Tensor::<Cpu>::zeros([2, 2], DType::F32, &dev())?;
    let written = shared.clone().slice_assign(1, 1, &g.t()?)?;
    assert_eq!(written.to_vec::<f32>()?, vec![0.0, 1.0, 0.0, 2.0]);
    assert_eq!(shared.to_vec::<f32>()?, vec![0.0; 4]);
    Ok(())
}

#[test]
fn matvec_paths_match_reference() {
    let d = data(300 * 257);
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-4 } else { 1e-12 };
        type F<B> = fn(&Tensor<B>) -> Result<Tensor<B>>;
        let cases: [(&str, F<Cpu>, F<Reference>); 8] = [
            (
                "A@v",
                |x| x.matmul(&x.narrow(0, 0, 257)?.narrow(1, 3, 1)?),
                |x| x.matmul(&x.narrow(0, 0, 257)?.narrow(1, 3, 1)?),
            ),
            (
                "A.T@v",
                |x| x.t()?.matmul(&x.narrow(1, 5, 1)?),
                |x| x.t()?.matmul(&x.narrow(1, 5, 1)?),
            ),
            (
                "A@v 1-d strided",
                |x| {
                    x.narrow(0, 0, 9)?
                        .matmul(&x.narrow(1, 2, 1)?.squeeze(1)?.narrow(0, 0, 257)?)
                },
                |x| {
                    x.narrow(0, 0, 9)?
                        .matmul(&x.narrow(1, 2, 1)?.squeeze(1)?.narrow(0, 0, 257)?)
                },
            ),
            (
                "v@B",
                |x| x.narrow(1, 0, 1)?.t()?.matmul(x),
                |x| x.narrow(1, 0, 1)?.t()?.matmul(x),
            ),
            (
                "v@B.T",
                |x| x.narrow(0, 4, 1)?.matmul(&x.t()?),
                |x| x.narrow(0, 4, 1)?.matmul(&x.t()?),
            ),
            (
                "v@B.T small",
                |x| {
                    x.narrow(0, 4, 1)?
                        .narrow(1, 0, 7)?
                        .matmul(&x.narrow(1, 0, 7)?.narrow(0, 0, 5)?.t()?)
                },
                |x| {
                    x.narrow(0, 4, 1)?
                        .narrow(1, 0, 7)?
                        .matmul(&x.narrow(1, 0, 7)?.narrow(0, 0, 5)?.t()?)
                },
            ),
            (
                "batched A@v",
                |x| {
                    x.narrow(0, 0, 240)?
                        .reshape([4, 60, 257])?
                        .matmul(&x.narrow(0, 0, 257)?.narrow(1, 1, 1)?)
                },
                |x| {
                    x.narrow(0, 0, 240)?
                        .reshape([4, 60, 257])?
                        .matmul(&x.narrow(0, 0, 257)?.narrow(1, 1, 1)?)
                },
            ),
            (
                "dot",
                |x| {
                    x.narrow(0, 1, 1)?
                        .squeeze(0)?
                        .matmul(&x.narrow(0, 2, 1)?.squeeze(0)?)
                },
                |x| {
                    x.narrow(0, 1, 1)?
                        .squeeze(0)?
                        .matmul(&x.narrow(0, 2, 1)?.squeeze(0)?)
                },
            ),
        ];
        for (name, fc, fr) in cases {
            check_against_ref(name, &d, &[300, 257], dtype, tol, fc, fr);
        }
    }
}

/// `[b, m, k] · [k, n]` folds into one `[b·m, k] · [k, n]` product when the left operand's
/// matrices are the row blocks of one row-major matrix; views whose blocks are not (a slice
/// of the rows, a transposed batch, column-major matrices) keep the batched product. Each
/// against the per-matrix 2-d products.
#[test]
fn products_with_a_shared_right_operand_fold_only_when_rows_stack() -> Result<()> {
    let d = dev();
    let x = Tensor::<Cpu>::from_vec(
        (0..3 * 6 * 5).map(|i| (i % 7) as f32 - 3.0).collect(),
        [3, 6, 5],
        &d,
    )?;
    let w = Tensor::<Cpu>::from_vec(
        (0..5 * 2).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect(),
        [5, 2],
        &d,
    )?;
    let views = [
        ("contiguous", x.clone()),
        ("rows 1..5 of each matrix", x.narrow(1, 1, 4)?),
        ("batch and rows swapped", x.transpose(0, 1)?),
        (
            "column-major matrices",
            x.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
        ),
    ];
    for (what, a) in views {
        let got = a.matmul(&w)?;
        assert_eq!(got.dims(), [a.dims()[0], a.dims()[1], 2], "{what}");
        for i in 0..a.dims()[0] {
            let want = a.narrow(0, i, 1)?.squeeze(0)?.matmul(&w)?;
            let have = got.narrow(0, i, 1)?.squeeze(0)?;
            assert!(
                close(&have.to_f64_vec()?, &want.to_f64_vec()?, 1e-6),
                "{what}, matrix {i}"
            );
        }
    }
    Ok(())
}
