//! [`Tensor::unscale_check`] on any backend against values computed on the host: planted
//! `inf`, `-inf` and NaN at the first, a middle and the last element of small and large
//! gradients in every float dtype, an overflow that only the rounding to f16 makes, and clean
//! sets. A backend's test calls [`check_unscale_check`] with a `large` size past whatever its
//! kernel splits work by (a GPU's grid-stride pass). [`check_sq_sum`] does the same for
//! [`Tensor::sq_sum`], the squared norm of gradient clipping.

use crate::{Backend, DType, Tensor, bf16, f16};

/// The value of gradient element `i` (exact in every float dtype: a multiple of 1/4 below 13).
fn grad_value(i: usize, salt: usize) -> f64 {
    ((i * 37 + salt * 11) % 101) as f64 * 0.25 - 12.5
}

/// `g · inv` as the op defines it for `dtype`, rounded once to `dtype`: computed in f32 for
/// f32 and the 16-bit floats (the inverse scale converted to f32), in f64 for f64. The second
/// value is the product computed in f64 and rounded once, which the f64 reference backend
/// gives; both are accepted (they differ only for an inverse scale that is not a power of 2).
fn unscaled(g: f64, inv: f64, dtype: DType) -> [f64; 2] {
    let round = |w: f64| match dtype {
        DType::F64 => w,
        DType::F32 => w as f32 as f64,
        DType::F16 => f16::from_f64(w).to_f64(),
        DType::BF16 => bf16::from_f64(w).to_f64(),
        d => panic!("unscale_check: no float dtype {d}"),
    };
    let w32 = ((g as f32) * (inv as f32)) as f64;
    let wide = if dtype == DType::F64 { g * inv } else { w32 };
    [round(wide), round(g * inv)]
}

fn same(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

/// `values` as 1-d tensors of `dtype` on `dev`.
fn tensors<B: Backend>(dev: &B::Device, dtype: DType, values: &[Vec<f64>]) -> Vec<Tensor<B>> {
    values
        .iter()
        .map(|g| {
            Tensor::<B>::from_slice(g, [g.len()], dev)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
        })
        .collect()
}

/// Runs one call: `grads` (host values) of `dtype` on `dev`; checks every unscaled value and
/// returns the flag.
fn run<B: Backend>(dev: &B::Device, dtype: DType, grads: &[Vec<f64>], inv: f64, what: &str) -> f64 {
    let ts = tensors::<B>(dev, dtype, grads);
    let (outs, flag) = Tensor::unscale_check(&ts, inv).unwrap();
    assert_eq!(flag.dims(), &[] as &[usize], "{what}: the flag is 0-d");
    assert_eq!(flag.dtype(), DType::F32, "{what}: the flag is f32");
    for (t, (g, o)) in grads.iter().zip(&outs).enumerate() {
        assert_eq!(o.dtype(), dtype, "{what}: gradient {t}'s dtype");
        assert_eq!(o.dims(), &[g.len()], "{what}: gradient {t}'s shape");
        let got = o.to_f64_vec().unwrap();
        for (i, (&x, &y)) in g.iter().zip(&got).enumerate() {
            let want = unscaled(x, inv, dtype);
            assert!(
                want.iter().any(|&w| same(y, w)),
                "{what}: gradient {t} element {i}: {x} * {inv} gave {y}, want {want:?}"
            );
        }
    }
    flag.to_scalar().unwrap()
}

/// The whole check (module docs); `large` is the element count of the large gradients.
pub fn check_unscale_check<B: Backend>(dev: &B::Device, large: usize) {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for n in [1usize, 7, 1000, large] {
            let clean = |salt| (0..n).map(|i| grad_value(i, salt)).collect::<Vec<_>>();
            for inv in [2f64.powi(-10), 1.0 / 3.0] {
                let what = format!("{dtype} n={n} inv={inv} clean");
                let set = [clean(1), vec![0.5; 3], clean(2)];
                assert_eq!(run::<B>(dev, dtype, &set, inv, &what), 0.0, "{what}: flag");
            }
            for pos in [0, n / 2, n - 1] {
                for bad in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
                    let mut planted = clean(3);
                    planted[pos] = bad;
                    let what = format!("{dtype} n={n}: {bad} at {pos}");
                    let set = [clean(1), planted, clean(2)];
                    let flag = run::<B>(dev, dtype, &set, 2f64.powi(-16), &what);
                    assert_eq!(flag, 1.0, "{what}: flag");
                }
            }
        }
    }
    // Finite inputs whose product overflows only when rounded to f16 (65504 is its largest).
    let set = [vec![1.0, 40000.0, 2.0]];
    let flag = run::<B>(dev, DType::F16, &set, 2.0, "f16 overflow on rounding");
    assert_eq!(flag, 1.0, "f16 overflow on rounding: flag");
    // The same in f32 stays finite.
    let flag = run::<B>(dev, DType::F32, &set, 2.0, "f32 no overflow");
    assert_eq!(flag, 0.0, "f32 no overflow: flag");
    // Many gradients, one bad in the last of them, and an empty one among them.
    let mut many: Vec<Vec<f64>> = (0..300).map(|t| vec![grad_value(t, 5); t % 5]).collect();
    many[299][3] = f64::NAN;
    let flag = run::<B>(
        dev,
        DType::F32,
        &many,
        0.5,
        "300 gradients, NaN in the last",
    );
    assert_eq!(flag, 1.0, "300 gradients: flag");
    many[299][3] = 1.0;
    let flag = run::<B>(dev, DType::F32, &many, 0.5, "300 gradients, clean");
    assert_eq!(flag, 0.0, "300 clean gradients: flag");
}

/// Typed errors: no gradients, mixed dtypes, a non-float dtype, a non-finite inverse scale.
pub fn check_unscale_check_errors<B: Backend>(dev: &B::Device) {
    let f32s = Tensor::<B>::from_slice(&[1.0f32, 2.0], [2], dev).unwrap();
    let f64s = Tensor::<B>::from_slice(&[1.0f64], [1], dev).unwrap();
    let ints = Tensor::<B>::from_slice(&[1i64], [1], dev).unwrap();
    let err = |r: crate::Result<(Vec<Tensor<B>>, Tensor<B>)>| r.map(drop).unwrap_err();
    let cases = [
        ("empty", err(Tensor::<B>::unscale_check(&[], 0.5))),
        (
            "mixed",
            err(Tensor::unscale_check(&[f32s.clone(), f64s], 0.5)),
        ),
        ("i64", err(Tensor::unscale_check(&[ints], 0.5))),
        (
            "inf inv",
            err(Tensor::unscale_check(&[f32s], f64::INFINITY)),
        ),
    ];
    for (what, e) in cases {
        assert!(
            e.to_string().contains("unscale_check"),
            "{what}: the error names the op: {e}"
        );
    }
}

/// [`Tensor::sq_sum`] against the f64 sum of the squares of the stored values: every float
/// dtype; sizes 0, 1, odd and `large`; one tensor and 300 (more than a GPU launch takes, with
/// empty ones among them). The values are multiples of 1/4 below 13, so every square and
/// every partial sum of at most 2^40 of them is exact in f64: any order of summation gives
/// the same bits, and the sum must equal the host's exactly.
pub fn check_sq_sum<B: Backend>(dev: &B::Device, large: usize) {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let sets: Vec<Vec<Vec<f64>>> = vec![
            vec![(0..large).map(|i| grad_value(i, 1)).collect()],
            [0usize, 1, 7, 1000, large]
                .iter()
                .enumerate()
                .map(|(s, &n)| (0..n).map(|i| grad_value(i, s)).collect())
                .collect(),
            (0..300).map(|t| vec![grad_value(t, 5); t % 5]).collect(),
        ];
        for set in sets {
            let what = format!("{dtype}, {} tensors", set.len());
            let ts = tensors::<B>(dev, dtype, &set);
            let want: f64 = set.iter().flatten().map(|v| v * v).sum();
            let got = Tensor::sq_sum(&ts).unwrap();
            assert_eq!(got.dims(), &[] as &[usize], "{what}: the sum is 0-d");
            assert_eq!(got.dtype(), DType::F64, "{what}: the sum is f64");
            assert_eq!(got.to_scalar().unwrap(), want, "{what}: the sum");
        }
    }
    // A non-finite element makes the sum inf or NaN (clipping then leaves gradients alone).
    let bad = Tensor::<B>::from_slice(&[1.0f32, f32::NAN], [2], dev).unwrap();
    assert!(
        Tensor::sq_sum(&[bad])
            .unwrap()
            .to_scalar()
            .unwrap()
            .is_nan()
    );
}

/// Typed errors of [`Tensor::sq_sum`]: no tensors, mixed dtypes, a non-float dtype.
pub fn check_sq_sum_errors<B: Backend>(dev: &B::Device) {
    let f32s = Tensor::<B>::from_slice(&[1.0f32, 2.0], [2], dev).unwrap();
    let f64s = Tensor::<B>::from_slice(&[1.0f64], [1], dev).unwrap();
    let ints = Tensor::<B>::from_slice(&[1i64], [1], dev).unwrap();
    let cases = [
        ("empty", Tensor::<B>::sq_sum(&[]).unwrap_err()),
        ("mixed", Tensor::sq_sum(&[f32s, f64s]).unwrap_err()),
        ("i64", Tensor::sq_sum(&[ints]).unwrap_err()),
    ];
    for (what, e) in cases {
        assert!(
            e.to_string().contains("sq_sum"),
            "{what}: the error names the op: {e}"
        );
    }
}
