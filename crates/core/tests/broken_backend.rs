//! The conformance suite must be able to fail: `Broken<M>` delegates every op to the reference
//! backend except one, which it perturbs slightly, and the check for that op must panic with a
//! message naming the op. Mode `0` breaks nothing, so the same checks must pass.

#![cfg(feature = "testing")]

use std::panic::{AssertUnwindSafe, catch_unwind};

use kiln_core::backend::{
    Backend, BinaryOp, CmpOp, HostBuffer, MemoryStats, RandDist, ReduceOp, UnaryOp, UpdateRule,
    UpdateSlot,
};
use kiln_core::reference::{RefDevice, RefStorage, Reference};
use kiln_core::testing::{self, Config};
use kiln_core::{DType, Layout, Result};

const NONE: u8 = 0;
const EXP_PLUS: u8 = 1;
const SUM_SCALED: u8 = 2;
const RAND_SHIFTED: u8 = 3;
const INDEX_CLAMPED: u8 = 4;
const MATMUL_ROW_MAJOR_ONLY: u8 = 5;
const ARGMAX_LAST_TIE: u8 = 6;
const BROADCAST_RHS_IGNORED: u8 = 7;
const ADAM_NO_BIAS_CORRECTION: u8 = 8;
const COPY_INTO_IGNORES_DST_STRIDES: u8 = 9;

/// The reference backend with one op broken (see the mode constants).
#[derive(Clone, Copy, Debug)]
struct Broken<const M: u8>;

type R = Reference;

fn host(s: RefStorage) -> HostBuffer {
    s.data().clone()
}

fn rewrap(like: &RefStorage, data: HostBuffer) -> Result<RefStorage> {
    R::from_host(&like.device(), &data)
}

impl<const M: u8> Backend for Broken<M> {
    type Device = RefDevice;
    type Storage = RefStorage;
    const NAME: &'static str = "broken";

    fn devices() -> Vec<RefDevice> {
        R::devices()
    }
    fn parse_device(name: &str) -> Result<RefDevice> {
        R::parse_device(name)
    }
    fn synchronize(d: &RefDevice) -> Result<()> {
        R::synchronize(d)
    }
    fn memory_stats(d: &RefDevice) -> Result<MemoryStats> {
        R::memory_stats(d)
    }
    fn empty_cache(d: &RefDevice) -> Result<()> {
        R::empty_cache(d)
    }
    fn storage_device(s: &RefStorage) -> RefDevice {
        R::storage_device(s)
    }
    fn fill(d: &RefDevice, dtype: DType, len: usize, v: f64) -> Result<RefStorage> {
        R::fill(d, dtype, len, v)
    }
    fn from_host(d: &RefDevice, data: &HostBuffer) -> Result<RefStorage> {
        R::from_host(d, data)
    }
    fn to_host(s: &RefStorage, l: &Layout, dtype: DType) -> Result<HostBuffer> {
        R::to_host(s, l, dtype)
    }
    fn copy_to_device(
        s: &RefStorage,
        l: &Layout,
        dtype: DType,
        dst: &RefDevice,
    ) -> Result<RefStorage> {
        R::copy_to_device(s, l, dtype, dst)
    }
    fn copy_into(
        src: &RefStorage,
        sl: &Layout,
        dst: &mut RefStorage,
        dl: &Layout,
        dtype: DType,
    ) -> Result<()> {
        if M == COPY_INTO_IGNORES_DST_STRIDES && !dl.is_contiguous() {
            // Writes the region as if it were contiguous from its offset.
            let flat = Layout::from_parts(
                dl.shape().clone(),
                dl.shape().contiguous_strides(),
                dl.offset(),
            );
            if flat.storage_extent() <= dst.data().len() {
                return R::copy_into(src, sl, dst, &flat, dtype);
            }
        }
        R::copy_into(src, sl, dst, dl, dtype)
    }
    fn contiguous(s: &RefStorage, l: &Layout, dtype: DType) -> Result<RefStorage> {
        R::contiguous(s, l, dtype)
    }
    fn rand(
        d: &RefDevice,
        dtype: DType,
        len: usize,
        seed: u64,
        dist: RandDist,
    ) -> Result<RefStorage> {
        if M != RAND_SHIFTED {
            return R::rand(d, dtype, len, seed, dist);
        }
        // Element i drawn from counter i + 1.
        let s = R::rand(d, dtype, len + 1, seed, dist)?;
        R::contiguous(&s, &Layout::from_parts([len].into(), vec![1], 1), dtype)
    }
    fn unary(op: UnaryOp, s: &RefStorage, l: &Layout, dtype: DType) -> Result<RefStorage> {
        let out = R::unary(op, s, l, dtype)?;
        if M != EXP_PLUS || op != UnaryOp::Exp {
            return Ok(out);
        }
        let v: Vec<f64> = host(out.clone())
            .to_f64_vec()
            .iter()
            .map(|x| x + 1e-3)
            .collect();
        rewrap(&out, HostBuffer::from_f64(dtype, &v))
    }
    fn binary(
        op: BinaryOp,
        a: &RefStorage,
        al: &Layout,
        b: &RefStorage,
        bl: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        if M == BROADCAST_RHS_IGNORED && bl.strides().contains(&0) && bl.elem_count() > 0 {
            // Reads the rhs as if it were contiguous from its offset (a classic broadcast bug).
            let bad = Layout::contiguous(bl.shape().clone());
            let flat = R::to_host(b, &Layout::contiguous([b.data().len()]), dtype)?;
            let padded: Vec<f64> = flat
                .to_f64_vec()
                .into_iter()
                .cycle()
                .take(bad.elem_count())
                .collect();
            let b2 = R::from_host(&b.device(), &HostBuffer::from_f64(dtype, &padded))?;
            return R::binary(op, a, al, &b2, &bad, dtype);
        }
        R::binary(op, a, al, b, bl, dtype)
    }
    fn binary_scalar(
        op: BinaryOp,
        s: &RefStorage,
        l: &Layout,
        dtype: DType,
        c: f64,
        lhs: bool,
    ) -> Result<RefStorage> {
        R::binary_scalar(op, s, l, dtype, c, lhs)
    }
    fn compare(
        op: CmpOp,
        a: &RefStorage,
        al: &Layout,
        b: &RefStorage,
        bl: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        R::compare(op, a, al, b, bl, dtype)
    }
    fn where_cond(
        c: &RefStorage,
        cl: &Layout,
        t: &RefStorage,
        tl: &Layout,
        f: &RefStorage,
        fl: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        R::where_cond(c, cl, t, tl, f, fl, dtype)
    }
    fn reduce(
        op: ReduceOp,
        s: &RefStorage,
        l: &Layout,
        dtype: DType,
        axes: &[usize],
    ) -> Result<RefStorage> {
        let out = R::reduce(op, s, l, dtype, axes)?;
        match (M, op) {
            (SUM_SCALED, ReduceOp::Sum) if dtype.is_float() => {
                let v: Vec<f64> = host(out.clone())
                    .to_f64_vec()
                    .iter()
                    .map(|x| x * (1.0 + 1e-4))
                    .collect();
                rewrap(&out, HostBuffer::from_f64(dtype, &v))
            }
            (ARGMAX_LAST_TIE, ReduceOp::ArgMax) => {
                // Last occurrence on ties: argmax of the axis reversed.
                let a = axes[0];
                let n = l.dims()[a];
                let rev: Vec<i64> = (0..n as i64).rev().collect();
                let ids = R::from_host(&s.device(), &HostBuffer::I64(rev))?;
                let r = R::index_select(s, l, dtype, &ids, &Layout::contiguous([n]), a)?;
                let mut dims = l.dims().to_vec();
                dims[a] = n;
                let am = R::reduce(op, &r, &Layout::contiguous(dims), dtype, axes)?;
                let HostBuffer::I64(v) = host(am) else {
                    unreachable!()
                };
                rewrap(
                    &out,
                    HostBuffer::I64(v.iter().map(|&p| n as i64 - 1 - p).collect()),
                )
            }
            _ => Ok(out),
        }
    }
    fn matmul(
        a: &RefStorage,
        al: &Layout,
        b: &RefStorage,
        bl: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        if M == MATMUL_ROW_MAJOR_ONLY
            && al.strides()[2] != 1
            && al.dims()[1] > 1
            && al.dims()[2] > 1
        {
            // Treats a column-major lhs as row-major with the same leading dimension.
            let d = al.dims();
            let bad = Layout::from_parts(
                al.shape().clone(),
                vec![al.strides()[0], d[2], 1],
                al.offset(),
            );
            if bad.storage_extent() <= a.data().len() {
                return R::matmul(a, &bad, b, bl, dtype);
            }
        }
        R::matmul(a, al, b, bl, dtype)
    }
    fn softmax(s: &RefStorage, l: &Layout, dtype: DType, log: bool) -> Result<RefStorage> {
        R::softmax(s, l, dtype, log)
    }
    fn cross_entropy(
        x: &RefStorage,
        xl: &Layout,
        y: &RefStorage,
        yl: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        R::cross_entropy(x, xl, y, yl, dtype)
    }
    fn cross_entropy_backward(
        x: &RefStorage,
        xl: &Layout,
        y: &RefStorage,
        yl: &Layout,
        g: &RefStorage,
        gl: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        R::cross_entropy_backward(x, xl, y, yl, g, gl, dtype)
    }
    fn cast(s: &RefStorage, l: &Layout, from: DType, to: DType) -> Result<RefStorage> {
        R::cast(s, l, from, to)
    }
    fn index_select(
        s: &RefStorage,
        l: &Layout,
        dtype: DType,
        ids: &RefStorage,
        il: &Layout,
        axis: usize,
    ) -> Result<RefStorage> {
        if M != INDEX_CLAMPED {
            return R::index_select(s, l, dtype, ids, il, axis);
        }
        // Clamps indices into range instead of reporting them.
        let n = l.dims()[axis] as i64;
        let HostBuffer::I64(v) = R::to_host(ids, il, DType::I64)? else {
            unreachable!()
        };
        let v: Vec<i64> = v.iter().map(|&i| i.clamp(0, (n - 1).max(0))).collect();
        let len = v.len();
        let ids = R::from_host(&ids.device(), &HostBuffer::I64(v))?;
        R::index_select(s, l, dtype, &ids, &Layout::contiguous([len]), axis)
    }
    fn gather(
        s: &RefStorage,
        l: &Layout,
        dtype: DType,
        ids: &RefStorage,
        il: &Layout,
        axis: usize,
    ) -> Result<RefStorage> {
        R::gather(s, l, dtype, ids, il, axis)
    }
    fn scatter_add(
        b: &RefStorage,
        bl: &Layout,
        dtype: DType,
        ids: &RefStorage,
        il: &Layout,
        src: &RefStorage,
        sl: &Layout,
        axis: usize,
    ) -> Result<RefStorage> {
        R::scatter_add(b, bl, dtype, ids, il, src, sl, axis)
    }
    #[allow(clippy::type_complexity)]
    fn fused_update(
        rule: &UpdateRule,
        dtype: DType,
        slots: &[UpdateSlot<'_, RefStorage>],
        grad_scale: Option<&RefStorage>,
    ) -> Result<Vec<(RefStorage, Vec<RefStorage>)>> {
        let mut rule = *rule;
        if let (
            ADAM_NO_BIAS_CORRECTION,
            UpdateRule::Adam {
                bias_correction1, ..
            },
        ) = (M, &mut rule)
        {
            *bias_correction1 = 1.0;
        }
        R::fused_update(&rule, dtype, slots, grad_scale)
    }
    fn eval_expr(
        d: &RefDevice,
        p: &kiln_core::expr::Program,
        shape: &kiln_core::Shape,
        inputs: &[(&RefStorage, &Layout)],
        params: &[f64],
    ) -> Result<Vec<RefStorage>> {
        kiln_core::expr::eval_composed::<Self>(d, p, shape, inputs, params)
    }
}

/// Runs `check` for `Broken<M>` and returns its panic message (None when it passed).
fn failure_of<const M: u8>(check: fn(&RefDevice, &Config)) -> Option<String> {
    // Detecting the failure is the point here; a short shrink keeps the test fast.
    let cfg = Config {
        max_shrink_iters: 64,
        ..Config::with_cases(64)
    };
    let r = catch_unwind(AssertUnwindSafe(|| check(&RefDevice(0), &cfg)));
    r.err().map(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

fn assert_fails<const M: u8>(check: fn(&RefDevice, &Config), needles: &[&str]) {
    let m = failure_of::<M>(check)
        .unwrap_or_else(|| panic!("the suite passed a backend broken in mode {M}"));
    for n in needles {
        assert!(m.contains(n), "failure message lacks {n:?}:\n{m}");
    }
}

#[test]
fn unbroken_wrapper_passes() {
    assert_eq!(
        failure_of::<NONE>(testing::check_unary::<Broken<NONE>>),
        None
    );
    assert_eq!(
        failure_of::<NONE>(testing::check_reduce::<Broken<NONE>>),
        None
    );
    assert_eq!(
        failure_of::<NONE>(testing::check_matmul::<Broken<NONE>>),
        None
    );
}

#[test]
fn exp_off_by_1e_3_fails_unary() {
    assert_fails::<EXP_PLUS>(
        testing::check_unary::<Broken<EXP_PLUS>>,
        &["unary exp", "element", "got", "want", "shape"],
    );
    // ... and only exp.
    let m = failure_of::<EXP_PLUS>(testing::check_unary::<Broken<EXP_PLUS>>).unwrap();
    let one_of_all = format!("1 of {} checks FAILED", kiln_core::UnaryOp::ALL.len());
    assert!(m.contains(&one_of_all), "{m}");
}

#[test]
fn sum_off_by_1e_4_relative_fails_reduce() {
    assert_fails::<SUM_SCALED>(
        testing::check_reduce::<Broken<SUM_SCALED>>,
        &["reduce sum", "element"],
    );
}

#[test]
fn shifted_philox_counter_fails_rand() {
    assert_fails::<RAND_SHIFTED>(
        testing::check_rand::<Broken<RAND_SHIFTED>>,
        &["rand uniform", "rand normal"],
    );
}

#[test]
fn clamped_indices_fail_index_errors() {
    assert_fails::<INDEX_CLAMPED>(
        testing::check_index_errors::<Broken<INDEX_CLAMPED>>,
        &["index_select", "instead of an error"],
    );
}

#[test]
fn ignoring_column_major_fails_matmul() {
    assert_fails::<MATMUL_ROW_MAJOR_ONLY>(
        testing::check_matmul::<Broken<MATMUL_ROW_MAJOR_ONLY>>,
        &["matmul", "strides"],
    );
}

#[test]
fn last_index_on_ties_fails_argmax() {
    assert_fails::<ARGMAX_LAST_TIE>(
        testing::check_reduce::<Broken<ARGMAX_LAST_TIE>>,
        &["reduce argmax"],
    );
}

#[test]
fn ignored_broadcast_fails_binary() {
    assert_fails::<BROADCAST_RHS_IGNORED>(
        testing::check_binary::<Broken<BROADCAST_RHS_IGNORED>>,
        &["binary", "strides [0"],
    );
}

#[test]
fn ignoring_destination_strides_fails_copy_into() {
    assert_fails::<COPY_INTO_IGNORES_DST_STRIDES>(
        testing::check_copy_into::<Broken<COPY_INTO_IGNORES_DST_STRIDES>>,
        &["copy_into", "into layout", "bit for bit"],
    );
}

#[test]
fn missing_bias_correction_fails_fused_update() {
    assert_fails::<ADAM_NO_BIAS_CORRECTION>(
        testing::check_fused_update::<Broken<ADAM_NO_BIAS_CORRECTION>>,
        &["fused_update Adam", "param", "element"],
    );
    assert_eq!(
        failure_of::<NONE>(testing::check_fused_update::<Broken<NONE>>),
        None
    );
}

#[test]
#[ignore = "prints sample failure messages; run with --ignored --nocapture"]
fn show_failure_messages() {
    for m in [
        failure_of::<EXP_PLUS>(testing::check_unary::<Broken<EXP_PLUS>>),
        failure_of::<MATMUL_ROW_MAJOR_ONLY>(testing::check_matmul::<Broken<MATMUL_ROW_MAJOR_ONLY>>),
        failure_of::<BROADCAST_RHS_IGNORED>(testing::check_binary::<Broken<BROADCAST_RHS_IGNORED>>),
        failure_of::<INDEX_CLAMPED>(testing::check_index_errors::<Broken<INDEX_CLAMPED>>),
    ] {
        println!("=====\n{}", m.unwrap_or_default());
    }
}
