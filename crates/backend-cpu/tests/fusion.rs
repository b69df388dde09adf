//! Deferred, fused elementwise ops on the CPU (`src/lazy.rs`). Every test here lowers the size
//! threshold to 0, so that every fusable op is deferred (this binary is its own process: the
//! setting does not reach the other tests).

use kiln_backend_cpu::{Cpu, set_fusion_min_elements};
use kiln_core::testing::check_close as close;
use kiln_core::{Backend, BinaryOp, DType, Result, Tensor, UnaryOp};

fn all_deferred() {
    set_fusion_min_elements(0);
}

/// A deterministic pattern in [-1.5, 1.5].
fn pattern(dims: &[usize], salt: u64, dtype: DType) -> Tensor<Cpu> {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n as u64)
        .map(|i| (((i * 2654435761 + salt * 97) % 1000) as f64 / 1000.0 - 0.5) * 3.0)
        .collect();
    Tensor::<Cpu>::from_vec(v, dims.to_vec(), &Cpu::device(0))
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A chain that exercises every way an operand reaches a fused pass: a transposed leaf, a
/// broadcast row, a scalar fill, pending intermediates used twice, unary backward, scalar ops
/// on both sides, comparisons, `where`, casts, and pending tensors read through transposed
/// views (computed first). With `step`, every op's result is computed at once (op by op).
fn chain(dtype: DType, step: bool) -> Result<Tensor<Cpu>> {
    let dev = Cpu::device(0);
    let s = |t: Tensor<Cpu>| -> Result<Tensor<Cpu>> {
        if step {
            t.realize()?;
        }
        Ok(t)
    };
    let x = pattern(&[24, 16], 1, dtype).t()?; // [16, 24], strided
    let row = pattern(&[24], 2, dtype).broadcast_to([16, 24])?;
    let half = Tensor::<Cpu>::full([16, 24], 0.5, dtype, &dev)?;
    let z = s(s(x.mul(&row)?)?.add(&half)?)?;
    let p = s(z.sigmoid()?)?; // read twice below
    let one_minus = s(p.scalar_binary(BinaryOp::Sub, 1.0)?)?;
    let q = s(s(p.log()?)?.sub(&s(one_minus.log()?)?)?)?;
    let g = s(p.unary_backward(UnaryOp::Sigmoid, &q)?)?;
    let pos = s(z.gt(&half)?)?;
    let w = s(pos.where_cond(&g, &s(g.neg()?)?)?)?;
    let c = s(s(w.to_dtype(DType::F64)?)?.to_dtype(dtype)?)?;
    let t = c.t()?;
    let r = s(t.mul(&s(z.t()?.tanh()?)?)?)?;
    s(s(r.div_scalar(3.0)?)?.maximum_scalar(-0.25)?)
}

fn bits(t: &Tensor<Cpu>) -> Vec<u64> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        _ => t
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

#[test]
fn a_fused_chain_has_the_bits_of_the_op_by_op_one() {
    all_deferred();
    for dtype in [DType::F32, DType::F64] {
        let fused = chain(dtype, false).unwrap();
        assert!(Cpu::is_deferred(fused.storage()), "{dtype}: deferred");
        let stepped = chain(dtype, true).unwrap();
        assert!(!Cpu::is_deferred(stepped.storage()));
        assert_eq!(bits(&fused), bits(&stepped), "{dtype}");
        assert!(!Cpu::is_deferred(fused.storage()), "read, so computed");
    }
}

#[test]
fn the_conformance_suite_passes_with_every_op_deferred() {
    all_deferred();
    kiln_core::testing::run_conformance::<Cpu>(&Cpu::device(0));
}

#[test]
fn a_deferred_result_is_counted_only_once_computed() {
    all_deferred();
    let dev = Cpu::device(6);
    let a = Tensor::<Cpu>::ones([1 << 16], DType::F32, &dev).unwrap();
    let before = Cpu::memory_stats(&dev).unwrap().in_use;
    let y = (&(&a * 3.0).unwrap().exp().unwrap() - 1.0).unwrap();
    assert_eq!(
        Cpu::memory_stats(&dev).unwrap().in_use,
        before,
        "nothing ran"
    );
    y.realize().unwrap();
    let after = Cpu::memory_stats(&dev).unwrap().in_use;
    assert_eq!(
        after,
        before + (1 << 16) * 4,
        "one buffer: the chain's result"
    );
    assert_eq!(y.to_vec::<f32>().unwrap()[7], 3f32.exp() - 1.0);
    drop(y);
    assert_eq!(Cpu::memory_stats(&dev).unwrap().in_use, before);
}

#[test]
fn writing_into_a_tensor_that_a_pending_op_reads_keeps_the_old_values() {
    all_deferred();
    let dev = Cpu::device(0);
    let mut a = Tensor::<Cpu>::from_slice(&[1f32, 2.0, 3.0], [3], &dev).unwrap();
    let y = (&a * 2.0).unwrap();
    assert!(Cpu::is_deferred(y.storage()));
    let new = Tensor::<Cpu>::from_slice(&[10f32, 20.0, 30.0], [3], &dev).unwrap();
    a.copy_from(&new).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0]);
    assert_eq!(a.to_vec::<f32>().unwrap(), [10.0, 20.0, 30.0]);
    // And into a pending tensor itself: computed first, then written.
    let mut z = (&y + 1.0).unwrap();
    z.copy_from(&new).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), [10.0, 20.0, 30.0]);
    assert_eq!(y.to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0]);
}

#[test]
fn a_pending_value_that_two_chains_read_is_computed_once() {
    all_deferred();
    let dev = Cpu::device(8); // a device of its own: its bytes in use are this test's
    let n = 1usize << 12;
    let on_dev = |salt| pattern(&[n], salt, DType::F32).to_device(&dev).unwrap();
    let (a, b, c) = (on_dev(1), on_dev(2), on_dev(3));
    let in_use = || Cpu::memory_stats(&dev).unwrap().in_use;
    let bytes = n * 4;
    let base = in_use();

    // `y` (three leaf reads) is read by two pending chains and by no tensor.
    let y = (&(&a * &b).unwrap() + &c).unwrap();
    let (z1, z2) = (y.exp().unwrap(), y.sin().unwrap());
    drop(y);
    z1.realize().unwrap();
    assert_eq!(
        in_use(),
        base + 2 * bytes,
        "z1's pass also stored y, for z2"
    );
    z2.realize().unwrap();
    assert_eq!(in_use(), base + 2 * bytes, "z2 read y, then y was released");
    let y = (&(&a * &b).unwrap() + &c).unwrap();
    assert_eq!(bits(&z1), bits(&y.exp().unwrap()));
    assert_eq!(bits(&z2), bits(&y.sin().unwrap()));
    drop((y, z1, z2));

    // A reduced value that a pending chain also reads is stored by the reduction's pass.
    let y = (&(&a * &b).unwrap() + &c).unwrap();
    let z = y.exp().unwrap();
    let s = y.sum(&[0], false).unwrap();
    drop(y);
    assert!(in_use() >= base + bytes, "the reduction stored y for z");
    z.realize().unwrap();
    let y = (&(&a * &b).unwrap() + &c).unwrap();
    assert_eq!(bits(&z), bits(&y.exp().unwrap()));
    assert_eq!(bits(&s), bits(&y.sum(&[0], false).unwrap()));
    drop((y, z, s));

    // A value that only a tensor holds is not stored (the handle may be a temporary).
    let y = (&(&a * &b).unwrap() + &c).unwrap();
    let z = y.exp().unwrap();
    z.realize().unwrap();
    assert_eq!(in_use(), base + bytes, "z alone");
    assert!(Cpu::is_deferred(y.storage()), "y is still pending");
}

#[test]
fn errors_still_name_the_op_that_caused_them() {
    all_deferred();
    let dev = Cpu::device(0);
    let a = Tensor::<Cpu>::ones([4], DType::F32, &dev).unwrap();
    let b = Tensor::<Cpu>::ones([5], DType::F32, &dev).unwrap();
    let pending = (&a + 1.0).unwrap();
    let e = pending.add(&b).unwrap_err();
    assert!(e.to_string().contains("add"), "{e}");
    let ints = Tensor::<Cpu>::ones([4], DType::I64, &dev).unwrap();
    assert!(pending.add(&ints).is_err(), "f32 + i64");
    // The pending tensor is still usable after both errors.
    assert_eq!(pending.to_vec::<f32>().unwrap(), [2.0; 4]);
}

#[test]
fn a_long_chain_is_cut_into_bounded_programs() {
    all_deferred();
    let dev = Cpu::device(0);
    let mut x = Tensor::<Cpu>::ones([1000], DType::F64, &dev).unwrap();
    for _ in 0..200 {
        x = (&x * 1.01).unwrap();
    }
    let want = 1.01f64.powi(200);
    let got = x.to_vec::<f64>().unwrap()[999];
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
}

#[test]
fn a_reduction_of_a_pending_chain_runs_in_its_pass() {
    all_deferred();
    let chain = |x: &Tensor<Cpu>| x.mul_scalar(0.5).unwrap().exp().unwrap();
    for dtype in [DType::F32, DType::F64] {
        let x = pattern(&[64, 48], 3, dtype);
        for (axes, keep) in [
            (&[1isize][..], true),
            (&[0][..], false),
            (&[0, 1][..], false),
        ] {
            let stepped = chain(&x);
            stepped.realize().unwrap();
            let want_sum = stepped.sum(axes, keep).unwrap();
            let want_max = stepped.max(axes, keep).unwrap();
            let pending = chain(&x);
            let sum = pending.sum(axes, keep).unwrap();
            let max = pending.max(axes, keep).unwrap();
            assert!(
                Cpu::is_deferred(pending.storage()),
                "the chain itself never ran"
            );
            assert_eq!(sum.dims(), want_sum.dims());
            let f64s = |t: &Tensor<Cpu>| t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
            if let Err(e) = close(&f64s(&sum), &f64s(&want_sum), 0.0, tol) {
                panic!("{dtype} {axes:?}: {e}");
            }
            assert_eq!(bits(&max), bits(&want_max), "{dtype} {axes:?} max");
        }
    }
}

#[test]
fn a_fused_reduction_never_allocates_the_chain() {
    all_deferred();
    let dev = Cpu::device(7); // a device of its own: its peak is this test's
    let x = Tensor::<Cpu>::ones([512, 512], DType::F32, &dev).unwrap();
    let before = Cpu::memory_stats(&dev).unwrap();
    let s = (&x * 2.0).unwrap().exp().unwrap().sum(&[1], false).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap()[0], 512.0 * 2f32.exp());
    let peak = Cpu::memory_stats(&dev).unwrap().peak;
    assert!(
        peak - before.in_use < 512 * 512 * 4,
        "peak {peak} from {}: the chain's 1 MiB was allocated",
        before.in_use
    );
}

#[test]
fn the_profiler_shows_the_fused_pass() {
    use kiln_core::profile::{self, Kind};
    all_deferred();
    let x = pattern(&[256], 4, DType::F32);
    let (v, p) = profile::profile(|| {
        let _r = profile::range("fused-pass");
        let y = (&x.exp().unwrap() * 2.0).unwrap();
        y.to_vec::<f32>().unwrap()
    });
    assert_eq!(v.len(), 256);
    let p = p.in_range("fused-pass");
    let row = p.row(Kind::Op, "fused elementwise").expect("a fused pass");
    assert_eq!(row.calls, 1, "{}", p.table());
}

#[test]
fn writing_into_a_pinned_tensor_that_a_pending_op_reads_keeps_it_pinned() {
    all_deferred();
    kiln_core::test_pinned::register();
    let dev = Cpu::device(0);
    let mut p = Tensor::<Cpu>::from_slice(&[1f32, 2.0, 3.0], [3], &dev)
        .unwrap()
        .pin_memory()
        .unwrap();
    let y = (&p * 2.0).unwrap();
    assert!(Cpu::is_deferred(y.storage()));
    let new = Tensor::<Cpu>::from_slice(&[10f32, 20.0, 30.0], [3], &dev).unwrap();
    p.copy_from(&new).unwrap();
    assert!(
        p.is_pinned(),
        "the copy the write went to is page-locked too"
    );
    assert_eq!(p.to_vec::<f32>().unwrap(), [10.0, 20.0, 30.0]);
    assert_eq!(y.to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0]);
}

/// One step of a random chain: an op over earlier values (indices into the list so far).
#[derive(Clone, Debug)]
enum Step {
    Unary(UnaryOp, usize),
    Binary(BinaryOp, usize, usize),
    Scalar(BinaryOp, usize, f64, bool),
    Backward(UnaryOp, usize, usize),
    WhereGt(usize, usize, usize),
    RoundTrip(usize),
    Transposed(usize),
}

fn step_strategy() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let unary = prop_oneof![
        Just(UnaryOp::Exp),
        Just(UnaryOp::Tanh),
        Just(UnaryOp::Sigmoid),
        Just(UnaryOp::Abs),
        Just(UnaryOp::Neg),
        Just(UnaryOp::Relu),
        Just(UnaryOp::Sin),
        Just(UnaryOp::Square),
    ];
    let binary = prop_oneof![
        Just(BinaryOp::Add),
        Just(BinaryOp::Sub),
        Just(BinaryOp::Mul),
        Just(BinaryOp::Div),
        Just(BinaryOp::Maximum),
        Just(BinaryOp::Minimum),
    ];
    let backward = prop_oneof![
        Just(UnaryOp::Tanh),
        Just(UnaryOp::Sigmoid),
        Just(UnaryOp::Exp),
        Just(UnaryOp::Relu),
        Just(UnaryOp::Cos),
    ];
    let i = || 0usize..64; // taken modulo the values so far
    prop_oneof![
        (unary, i()).prop_map(|(u, a)| Step::Unary(u, a)),
        (binary.clone(), i(), i()).prop_map(|(b, x, y)| Step::Binary(b, x, y)),
        (binary, i(), -2.0f64..2.0, any::<bool>())
            .prop_map(|(b, x, c, l)| Step::Scalar(b, x, c, l)),
        (backward, i(), i()).prop_map(|(u, s, g)| Step::Backward(u, s, g)),
        (i(), i(), i()).prop_map(|(c, a, b)| Step::WhereGt(c, a, b)),
        i().prop_map(Step::RoundTrip),
        i().prop_map(Step::Transposed),
    ]
}

/// The chain of `steps` over three inputs of shape [6, 6] (one transposed, one a broadcast
/// row), every value realized at once when `stepped`; returns the last value and a row sum and
/// column max of it.
fn random_chain(steps: &[Step], dtype: DType, stepped: bool) -> Vec<Tensor<Cpu>> {
    let x = pattern(&[6, 6], 11, dtype);
    let y = pattern(&[6, 6], 12, dtype).t().unwrap();
    let r = pattern(&[6], 13, dtype).broadcast_to([6, 6]).unwrap();
    let mut v = vec![x, y, r];
    for s in steps {
        let at = |k: usize| v[k % v.len()].clone();
        let t = match *s {
            Step::Unary(u, a) => at(a).unary(u),
            Step::Binary(b, p, q) => at(p).binary(b, &at(q)),
            Step::Scalar(b, a, c, lhs) if lhs => at(a).scalar_binary(b, c),
            Step::Scalar(b, a, c, _) => at(a).binary_scalar(b, c),
            Step::Backward(u, a, g) => at(a).unary_backward(u, &at(g)),
            Step::WhereGt(c, a, b) => at(c).gt(&at(a)).and_then(|m| m.where_cond(&at(a), &at(b))),
            Step::RoundTrip(a) => {
                let other = if dtype == DType::F32 {
                    DType::F64
                } else {
                    DType::F32
                };
                at(a).to_dtype(other).and_then(|t| t.to_dtype(dtype))
            }
            Step::Transposed(a) => at(a).t(),
        }
        .unwrap();
        if stepped {
            t.realize().unwrap();
        }
        v.push(t);
    }
    let last = v.pop().unwrap();
    let sum = last.sum(&[1], false).unwrap();
    let max = last.max(&[0], true).unwrap();
    vec![last, sum, max]
}

/// Equal bits, or both NaN (a NaN's payload may differ between two equal computations).
fn same(a: &[u64], b: &[u64], dtype: DType) -> bool {
    let nan = |v: u64| match dtype {
        DType::F32 => f32::from_bits(v as u32).is_nan(),
        _ => f64::from_bits(v).is_nan(),
    };
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x == y || (nan(x) && nan(y)))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Random chains (transposed, broadcast and pending-transposed operands, scalar ops on
    /// either side, backward ops, `where`, casts) computed fused have the op-by-op bits, and so
    /// does the max of one; its row sum (fused into the chain's pass) agrees within rounding.
    #[test]
    fn random_chains_fused_match_op_by_op(steps in proptest::collection::vec(step_strategy(), 1..24)) {
        all_deferred();
        for dtype in [DType::F32, DType::F64] {
            let fused = random_chain(&steps, dtype, false);
            let stepped = random_chain(&steps, dtype, true);
            proptest::prop_assert!(same(&bits(&fused[0]), &bits(&stepped[0]), dtype), "{:?}", dtype);
            proptest::prop_assert!(same(&bits(&fused[2]), &bits(&stepped[2]), dtype), "{:?} max", dtype);
            let f64s = |t: &Tensor<Cpu>| t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            let sum = close(&f64s(&fused[1]), &f64s(&stepped[1]), tol, tol);
            proptest::prop_assert!(sum.is_ok(), "{:?} sum: {:?}", dtype, sum);
        }
    }
}
