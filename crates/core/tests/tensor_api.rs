//! The Tensor API through the reference backend: error messages (they must name the op and the
//! shapes, devices, axes or indices involved), Display, and the device rules (`to_device` shares,
//! `copy_to` copies).

use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Error, Generator, RandDist, Reduction, Tensor};

type T = Tensor<Reference>;
const R0: RefDevice = RefDevice(0);
const R1: RefDevice = RefDevice(1);

fn t(v: &[f32], shape: &[usize], dev: RefDevice) -> T {
    T::from_slice(v, shape, &dev).unwrap()
}

fn err<X: std::fmt::Debug>(r: kiln_core::Result<X>) -> (Error, String) {
    let e = r.expect_err("expected an error");
    let m = e.to_string();
    (e, m)
}

// ---- errors --------------------------------------------------------------------------------

#[test]
fn mixing_devices_names_the_op_and_both_devices() {
    let a = t(&[1.0, 2.0, 3.0], &[3], R0);
    let b = t(&[1.0, 2.0, 3.0], &[3], R1);
    let (e, m) = err(a.add(&b));
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e:?}");
    assert_eq!(
        m,
        "add: inputs are on different devices (ref and ref:1); copy one with to_device first"
    );
    let cases: Vec<(&str, kiln_core::Result<T>)> = vec![
        ("mul", &b * &a),
        ("matmul", a.matmul(&b)),
        ("lt", a.lt(&b)),
        ("maximum", a.maximum(&b)),
        ("cat", T::cat(&[a.clone(), b.clone()], 0)),
        (
            "index_select",
            a.index_select(0, &T::from_vec(vec![0i64], [1], &R1).unwrap()),
        ),
        ("where", a.gt(&a).unwrap().where_cond(&b, &b)),
    ];
    for (op, r) in cases {
        let (e, m) = err(r);
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{op}: {e:?}");
        assert!(m.starts_with(&format!("{op}:")), "{op}: {m}");
        assert!(m.contains("ref") && m.contains("ref:1"), "{op}: {m}");
    }
    // Nothing is copied behind the user's back: after an explicit move it works.
    let s = a.add(&b.to_device(&R0).unwrap()).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
}

#[test]
fn mismatched_shapes_name_both_shapes() {
    let a = T::zeros([2, 3], DType::F32, &R0).unwrap();
    let b = T::zeros([4], DType::F32, &R0).unwrap();
    let (e, m) = err(a.add(&b));
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    assert_eq!(m, "add: shape mismatch between [2, 3] and [4]");
    let c = T::zeros([4, 5], DType::F32, &R0).unwrap();
    let (_, m) = err(a.matmul(&c));
    assert_eq!(m, "matmul: shape mismatch between [2, 3] and [4, 5]");
    let (_, m) = err(T::stack(&[a.clone(), c.clone()], 0));
    assert_eq!(m, "stack: shape mismatch between [2, 3] and [4, 5]");
    let (_, m) = err(T::cat(&[a.clone(), c], 0));
    assert!(
        m.starts_with("cat: shape mismatch") && m.contains("[2, 3]"),
        "{m}"
    );
    let (_, m) = err(a.broadcast_to([3, 3]));
    assert_eq!(m, "broadcast_to: shape mismatch between [2, 3] and [3, 3]");
    let labels = T::from_vec(vec![0i64; 3], [3], &R0).unwrap();
    let (_, m) = err(a.cross_entropy(&labels, Reduction::None));
    assert_eq!(m, "cross_entropy: shape mismatch between [2, 3] and [3]");
}

#[test]
fn bad_reshape_names_both_shapes_and_counts() {
    let a = T::zeros([2, 3], DType::F32, &R0).unwrap();
    let (e, m) = err(a.reshape([4]));
    assert!(matches!(e, Error::BadReshape { .. }), "{e:?}");
    assert_eq!(
        m,
        "reshape: cannot reshape [2, 3] (6 elements) into [4] (4 elements)"
    );
    // Also through a transposed view (the copying path).
    let (_, m) = err(a.t().unwrap().reshape([7]));
    assert_eq!(
        m,
        "reshape: cannot reshape [3, 2] (6 elements) into [7] (7 elements)"
    );
    let (_, m) = err(T::from_vec(vec![1.0f32; 5], [2, 3], &R0));
    assert_eq!(
        m,
        "from_vec: 5 values cannot fill shape [2, 3] (6 elements)"
    );
}

#[test]
fn out_of_range_axes_name_the_op_axis_and_rank() {
    let a = T::zeros([2, 3], DType::F32, &R0).unwrap();
    let (e, m) = err(a.sum(&[2], false));
    assert!(matches!(e, Error::AxisOutOfRange { .. }), "{e:?}");
    assert_eq!(m, "sum: axis 2 is out of range for a tensor of rank 2");
    let (_, m) = err(a.argmax(-3, false));
    assert_eq!(m, "argmax: axis -3 is out of range for a tensor of rank 2");
    let (_, m) = err(a.transpose(0, 5));
    assert_eq!(
        m,
        "transpose: axis 5 is out of range for a tensor of rank 2"
    );
    let (_, m) = err(a.narrow(2, 0, 1));
    assert_eq!(m, "narrow: axis 2 is out of range for a tensor of rank 2");
    let (_, m) = err(a.index_select(-3, &T::from_vec(vec![0i64], [1], &R0).unwrap()));
    assert_eq!(
        m,
        "index_select: axis -3 is out of range for a tensor of rank 2"
    );
    let (_, m) = err(a.max(&[0, 0], false));
    assert_eq!(m, "max: axis 0 given twice");
    let (_, m) = err(a.narrow(1, 2, 2));
    assert_eq!(
        m,
        "narrow: range 2..4 is outside axis 1 of size 3 (shape [2, 3])"
    );
    let (_, m) = err(a.squeeze(0));
    assert_eq!(m, "squeeze: axis 0 of shape [2, 3] has size 2, not 1");
    let e = T::zeros([2, 0], DType::F32, &R0).unwrap();
    let (_, m) = err(e.max(&[1], false));
    assert_eq!(m, "max: cannot reduce an empty axis of shape [2, 0]");
}

#[test]
fn wrong_dtypes_name_the_op_and_both_dtypes() {
    let f = T::zeros([3], DType::F32, &R0).unwrap();
    let d = T::zeros([3], DType::F64, &R0).unwrap();
    let i = T::zeros([3], DType::I64, &R0).unwrap();
    let u = T::zeros([3], DType::U8, &R0).unwrap();
    let (e, m) = err(f.add(&d));
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e:?}");
    assert_eq!(m, "add: dtype mismatch: expected f32, got f64");
    let (_, m) = err(i.exp());
    assert!(
        m.starts_with("exp: dtype mismatch") && m.ends_with("got i64"),
        "{m}"
    );
    let (_, m) = err(i.matmul(&i));
    assert_eq!(
        m,
        "matmul: dtype mismatch: expected a float dtype (f32, f64, f16, bf16), got i64"
    );
    let (_, m) = err(u.sum_all());
    assert_eq!(
        m,
        "sum: dtype mismatch: expected a float dtype or i64, got u8"
    );
    let (_, m) = err(f.where_cond(&f, &f));
    assert_eq!(m, "where: dtype mismatch: expected u8 condition, got f32");
    let (_, m) = err(f.index_select(0, &f));
    assert_eq!(
        m,
        "index_select: dtype mismatch: expected i64 indices, got f32"
    );
    let (_, m) = err(f.to_vec::<i64>());
    assert_eq!(m, "to_vec: dtype mismatch: expected i64, got f32");
    let (_, m) = err(Generator::new(1).sample::<Reference>(
        [2],
        RandDist::Uniform {
            low: 0.0,
            high: 1.0,
        },
        DType::I64,
        &R0,
    ));
    assert!(m.starts_with("rand: dtype mismatch"), "{m}");
    let (_, m) = err(i.pow(&i));
    assert!(
        m.starts_with("pow: dtype mismatch") && m.ends_with("got i64"),
        "{m}"
    );
}

#[test]
fn out_of_range_indices_name_the_op_and_index() {
    let a = T::arange(0.0, 6.0, 1.0, DType::F32, &R0)
        .unwrap()
        .reshape([3, 2])
        .unwrap();
    let ids = T::from_vec(vec![0i64, 3], [2], &R0).unwrap();
    let (e, m) = err(a.index_select(0, &ids));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "index_select",
                index: 3,
                size: 3
            }
        ),
        "{e:?}"
    );
    assert_eq!(m, "index_select: index 3 is out of range 0..3");
    let neg = T::from_vec(vec![-1i64], [1, 1], &R0).unwrap();
    let (e, m) = err(a.gather(1, &neg));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "gather",
                index: -1,
                size: 2
            }
        ),
        "{e:?}"
    );
    assert_eq!(m, "gather: index -1 is out of range 0..2");
    let src = T::ones([1, 1], DType::F32, &R0).unwrap();
    let (e, _) = err(a.scatter_add(0, &neg, &src));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "scatter_add",
                index: -1,
                size: 3
            }
        ),
        "{e:?}"
    );
    let labels = T::from_vec(vec![0i64, 0, 2], [3], &R0).unwrap();
    let (e, m) = err(a.cross_entropy(&labels, Reduction::None));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "cross_entropy",
                index: 2,
                size: 2
            }
        ),
        "{e:?}"
    );
    assert_eq!(m, "cross_entropy: index 2 is out of range 0..2");
    let g = T::ones([3], DType::F32, &R0).unwrap();
    let (e, _) = err(a.cross_entropy_backward(&labels, &g));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "cross_entropy_backward",
                index: 2,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn bad_device_names() {
    let (_, m) = err(Reference::parse_device("cuda:0"));
    assert!(
        m.starts_with("parse_device:") && m.contains("\"cuda:0\""),
        "{m}"
    );
    assert!(Reference::parse_device("ref:7").is_err());
    assert_eq!(Reference::parse_device("ref:1").unwrap(), R1);
    assert_eq!(Reference::devices(), vec![R0, R1]);
    let (_, m) = err(T::zeros([2], DType::F32, &RefDevice(9)));
    assert!(m.contains("ref:9"), "{m}");
}

// ---- display -------------------------------------------------------------------------------

#[test]
fn display_shows_values_dtype_and_device() {
    assert_eq!(
        t(&[1.0, 2.0, 3.0], &[1, 3], R0).to_string(),
        "[[1, 2, 3]] @ref"
    );
    let i = T::from_vec(vec![1i64, 2, 3], [1, 3], &R1).unwrap();
    assert_eq!(i.to_string(), "[[1, 2, 3]] i64 @ref:1");
    assert_eq!(
        T::scalar(3.5f64, &R1).unwrap().to_string(),
        "3.5 f64 @ref:1"
    );
    assert_eq!(
        t(&[0.1, -2.5, 1e-7, 12345678.0], &[2, 2], R0).to_string(),
        "[[0.1, -2.5],\n [1e-7, 12345678]] @ref"
    );
    assert_eq!(
        T::zeros([0, 3], DType::U8, &R0).unwrap().to_string(),
        "[] u8 @ref"
    );
    // A strided view prints its logical order.
    let v = T::arange(0.0, 6.0, 1.0, DType::I64, &R0)
        .unwrap()
        .reshape([2, 3])
        .unwrap()
        .t()
        .unwrap();
    assert_eq!(v.to_string(), "[[0, 3],\n [1, 4],\n [2, 5]] i64 @ref");
    // Inner blocks line up under their first row.
    let c = T::arange(0.0, 8.0, 1.0, DType::U8, &R0)
        .unwrap()
        .reshape([2, 2, 2])
        .unwrap();
    assert_eq!(
        c.to_string(),
        "[[[0, 1],\n  [2, 3]],\n [[4, 5],\n  [6, 7]]] u8 @ref"
    );
}

#[test]
fn display_abbreviates_large_tensors() {
    let big = T::arange(0.0, 2000.0, 1.0, DType::F32, &R0).unwrap();
    assert_eq!(big.to_string(), "[0, 1, 2, ..., 1997, 1998, 1999] @ref");
    let s = big.reshape([2, 10, 100]).unwrap().to_string();
    assert!(
        s.starts_with("[[[0, 1, 2, ..., 97, 98, 99],\n  [100, 101, 102, ..., 197, 198, 199],"),
        "{s}"
    );
    assert!(s.contains("\n  ...,\n  [700, 701"), "{s}");
    assert!(
        s.ends_with("[1900, 1901, 1902, ..., 1997, 1998, 1999]]] @ref"),
        "{s}"
    );
    assert!(!s.contains("1500"), "middle rows must be elided: {s}");
    // At the threshold nothing is elided.
    let small = T::arange(0.0, 1000.0, 1.0, DType::F32, &R0)
        .unwrap()
        .to_string();
    assert!(!small.contains("...") && small.contains("500"));
}

// ---- devices -------------------------------------------------------------------------------

#[test]
fn to_device_shares_when_already_there_and_copy_to_always_copies() {
    let a = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2], R0);
    let same = a.to_device(&R0).unwrap();
    assert!(same.same_storage(&a));
    let c = a.copy_to(&R0).unwrap();
    assert!(!c.same_storage(&a));
    assert_eq!(c.device(), &R0);
    assert_eq!(c.to_vec::<f32>().unwrap(), a.to_vec::<f32>().unwrap());

    let moved = a.to_device(&R1).unwrap();
    assert!(!moved.same_storage(&a));
    assert_eq!(moved.device(), &R1);
    assert_eq!(moved.to_string(), "[[1, 2],\n [3, 4]] @ref:1");
    let again = moved.to_device(&R1).unwrap();
    assert!(again.same_storage(&moved));

    // Views copy only their elements, contiguously.
    let v = a.t().unwrap();
    let vc = v.copy_to(&R1).unwrap();
    assert!(vc.is_contiguous());
    assert_eq!(vc.to_vec::<f32>().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    // Views share storage; contiguous() of a contiguous tensor is the same handle.
    assert!(v.same_storage(&a));
    assert!(a.contiguous().unwrap().same_storage(&a));
    assert!(!v.contiguous().unwrap().same_storage(&a));
}

// ---- norm ------------------------------------------------------------------------------------

#[test]
fn norm_is_the_euclidean_norm_of_every_element() {
    let x = t(&[3.0, 4.0, 0.0, 12.0], &[2, 2], R0);
    assert_eq!(x.norm().unwrap().to_scalar().unwrap(), 13.0);
    assert_eq!(x.norm().unwrap().rank(), 0);
    // A transposed view and a scalar.
    let xt = x.transpose(0, 1).unwrap();
    assert_eq!(xt.norm().unwrap().to_scalar().unwrap(), 13.0);
    let s = t(&[-2.0], &[], R0);
    assert_eq!(s.norm().unwrap().to_scalar().unwrap(), 2.0);
    let ids = T::from_vec(vec![1i64, 2], [2], &R0).unwrap();
    let (_, m) = err(ids.norm());
    assert!(m.contains("norm") && m.contains("i64"), "{m}");
}

// ---- softmax on any axis -------------------------------------------------------------------

#[test]
fn softmax_along_any_axis_is_the_definition_along_that_axis() {
    let v: Vec<f64> = (0..60)
        .map(|i| ((i * 7 + 3) % 11) as f64 * 0.9 - 4.0)
        .collect();
    let x = T::from_slice(&v, [3, 4, 5], &R0).unwrap();
    for dim in [0isize, 1, 2, -1, -2, -3] {
        // exp(x - max) / sum(exp(x - max)) along `dim`, from plain ops.
        let m = x.max(&[dim], true).unwrap();
        let e = x.sub(&m).unwrap().exp().unwrap();
        let want = e.div(&e.sum(&[dim], true).unwrap()).unwrap();
        let got = x.softmax(dim).unwrap();
        assert_eq!(got.dims(), x.dims());
        let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
        assert!(
            g.iter().zip(&w).all(|(a, b)| (a - b).abs() < 1e-12),
            "softmax({dim})"
        );
        let lg = x.log_softmax(dim).unwrap().to_f64_vec().unwrap();
        assert!(
            lg.iter().zip(&w).all(|(a, b)| (a - b.ln()).abs() < 1e-12),
            "log_softmax({dim})"
        );
    }
    let (e, _) = err(x.softmax(3));
    assert!(
        matches!(
            e,
            Error::AxisOutOfRange {
                axis: 3,
                rank: 3,
                ..
            }
        ),
        "{e:?}"
    );
    let (e, _) = err(x.log_softmax(-4));
    assert!(matches!(e, Error::AxisOutOfRange { axis: -4, .. }), "{e:?}");
}

// ---- max_dim / min_dim ---------------------------------------------------------------------

#[test]
fn max_dim_and_min_dim_return_values_and_indices() {
    let x = T::from_slice(&[3.0f32, 9.0, 1.0, 4.0, 2.0, 8.0], [2, 3], &R0).unwrap();
    let (v, i) = x.max_dim(1, false).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![9.0, 8.0]);
    assert_eq!(i.dtype(), DType::I64);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 2]);
    let (v, i) = x.min_dim(-2, true).unwrap();
    assert_eq!(v.dims(), [1, 3]);
    assert_eq!(i.dims(), [1, 3]);
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![3.0, 2.0, 1.0]);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 1, 0]);
    let (e, _) = err(x.max_dim(2, false));
    assert!(matches!(e, Error::AxisOutOfRange { .. }), "{e:?}");
}

#[test]
fn sixteen_bit_tensors_hold_print_and_convert() {
    use kiln_core::{bf16, f16};
    let d = kiln_core::reference::RefDevice(0);
    type R = kiln_core::reference::Reference;
    let h = Tensor::<R>::from_vec(
        vec![
            f16::from_f32(1.0),
            f16::from_f32(0.1),
            f16::from_f32(-65504.0),
        ],
        [3],
        &d,
    )
    .unwrap();
    assert_eq!(h.dtype(), DType::F16);
    assert_eq!(h.to_string(), "[1, 0.1, -65504] f16 @ref");
    assert_eq!(h.to_vec::<f16>().unwrap()[1], f16::from_f32(0.1));
    assert!(h.to_vec::<f32>().is_err());
    // Arithmetic rounds to the type: 1 + 2^-11 is not an f16, 1 + 2^-10 is.
    let one = Tensor::<R>::ones([1], DType::F16, &d).unwrap();
    let x = (&one + 2f64.powi(-11)).unwrap();
    assert_eq!(x.to_f64_vec().unwrap(), vec![1.0]);
    let x = (&one + 2f64.powi(-10)).unwrap();
    assert_eq!(x.to_f64_vec().unwrap(), vec![1.0 + 2f64.powi(-10)]);
    let b = h.to_dtype(DType::BF16).unwrap();
    assert_eq!(b.to_vec::<bf16>().unwrap()[0], bf16::ONE);
    assert_eq!(b.to_string(), "[1, 0.1, -65536] bf16 @ref");
    let back = b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(back, vec![1.0, f32::from_bits(0x3dcd_0000), -65536.0]); // bf16 0.1001
}

#[test]
fn conv2d_spec_output_dims_follow_pytorch() {
    use kiln_core::Conv2dSpec;
    let spec = |s, p, d, g| Conv2dSpec {
        stride: [s, s],
        padding: [p, p],
        dilation: [d, d],
        groups: g,
    };
    // torch.nn.functional.conv2d's output sizes.
    let cases = [
        (
            spec(1, 1, 1, 1),
            [2, 3, 9, 9],
            [4, 3, 3, 3],
            Some([2, 4, 9, 9]),
        ),
        (
            spec(2, 1, 1, 1),
            [2, 4, 10, 11],
            [6, 4, 3, 3],
            Some([2, 6, 5, 6]),
        ),
        (
            spec(1, 2, 2, 1),
            [2, 3, 9, 9],
            [5, 3, 3, 3],
            Some([2, 5, 9, 9]),
        ),
        (
            spec(2, 1, 1, 6),
            [2, 6, 8, 8],
            [6, 1, 3, 3],
            Some([2, 6, 4, 4]),
        ),
        (spec(1, 0, 1, 1), [1, 3, 2, 2], [1, 3, 3, 3], None), // window too large
        (spec(1, 0, 1, 2), [1, 3, 5, 5], [2, 1, 3, 3], None), // 3 channels, 2 groups
        (spec(0, 0, 1, 1), [1, 3, 5, 5], [2, 3, 3, 3], None), // stride 0
    ];
    for (s, x, w, want) in cases {
        assert_eq!(s.output_dims(x, w), want, "{s:?} {x:?} {w:?}");
    }
}

#[test]
fn native_conv2d_is_not_offered_by_the_reference_and_checks_shapes() {
    use kiln_core::Conv2dSpec;
    let dev = R0;
    let spec = Conv2dSpec {
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        groups: 1,
    };
    let x = Tensor::<Reference>::zeros([1, 3, 5, 5], DType::F64, &dev).unwrap();
    let w = Tensor::<Reference>::zeros([2, 3, 3, 3], DType::F64, &dev).unwrap();
    assert!(!Reference::offers_conv2d(&dev, DType::F64));
    assert!(x.conv2d_native(&w, spec).unwrap().is_none());
    let bad = Tensor::<Reference>::zeros([2, 4, 3, 3], DType::F64, &dev).unwrap();
    let e = x.conv2d_native(&bad, spec).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { op: "conv2d", .. }),
        "{e}"
    );
}
