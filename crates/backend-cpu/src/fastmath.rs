//! A vectorizable `exp` and `ln` for f32 slices.
//!
//! `f32::exp` is a call into the C library per element, which no compiler can vectorize; numpy
//! uses SIMD kernels instead. This is the Cephes `expf` polynomial written branch-free (clamps
//! and selects only), so LLVM turns the loop into SIMD code: SSE2 on any x86-64, AVX2+FMA or
//! AVX-512 when the processor has them (detected at run time; the same Rust source is compiled
//! once per feature set). Accuracy: within 2 ulp of the correctly rounded result over the whole
//! range (checked against f64 in the tests), with `exp(-inf) = 0`, `exp(inf) = inf`,
//! `exp(NaN) = NaN`, overflow to `inf` above ~88.72 and gradual underflow to subnormals.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const C1: f32 = 0.693_359_4; // ln 2, high bits (exact times any n in range)
const C2: f32 = -2.121_944_4e-4; // ln 2 - C1
const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `exp(x)`; `FMA` must only be true where the processor has fused multiply-add.
#[inline(always)]
fn exp1<const FMA: bool>(x: f32) -> f32 {
    // Clamp (NaN passes through both comparisons and stays NaN).
    let xc = if x < -104.0 { -104.0 } else { x };
    let xc = if xc > 88.8 { 88.8 } else { xc };
    let t = madd::<FMA>(xc, LOG2E, ROUND);
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = madd::<FMA>(n, -C2, madd::<FMA>(n, -C1, xc));
    let mut p = P[0];
    for &c in &P[1..] {
        p = madd::<FMA>(p, r, c);
    }
    let y = madd::<FMA>(p, r * r, r) + 1.0;
    // 2^n as two factors so that n down to -150 and up to 128 stay representable.
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    let s1 = f32::from_bits((n1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((n2.wrapping_add(127) as u32) << 23);
    y * s1 * s2
}

#[inline(always)]
fn exp_loop<const FMA: bool>(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp1::<FMA>(v);
    }
}

/// `exp`, then `y * m[k] + a[k]` for k = 0, 1, each a separately rounded multiply and add
/// (the fused evaluator's scalar tail, see `expr::block::Aff`).
#[inline(always)]
fn exp_then_loop<const FMA: bool>(x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let y = exp1::<FMA>(v) * m[0] + a[0];
        *o = y * m[1] + a[1];
    }
}

#[inline(always)]
fn sigmoid_loop<const FMA: bool>(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = 1.0 / (1.0 + exp1::<FMA>(-v));
    }
}

#[inline(always)]
fn exp_sub_sum_loop<const FMA: bool>(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp1::<FMA>(*v - m);
            *a += *v;
        }
    }
    let mut s: f32 = 0.0;
    for v in chunks.into_remainder() {
        *v = exp1::<FMA>(*v - m);
        s += *v;
    }
    s + acc.iter().sum::<f32>()
}

const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// Cephes `logf`'s polynomial, highest power first.
const LP: [f32; 9] = [
    7.037_683_6e-2,
    -1.151_461e-1,
    1.167_699_9e-1,
    -1.242_014_1e-1,
    1.424_932_3e-1,
    -1.666_805_8e-1,
    2.000_071_5e-1,
    -2.499_999_4e-1,
    3.333_333e-1,
];

/// `ln(x)`: the Cephes `logf` polynomial, branch-free (selects only) so that a loop of it
/// vectorizes. `x = 2^e · m` with `m` in `[√½, √2)`; subnormal inputs are scaled by 2^23
/// first. Special values as `f32::ln`: `ln(0) = -inf`, `ln(inf) = inf`, NaN below zero and
/// for NaN. Replaces a libm call per element (the two logs of a logistic-regression step's
/// cross-entropy were 4% of its instructions under callgrind).
#[inline(always)]
fn ln1<const FMA: bool>(x: f32) -> f32 {
    let sub = x < f32::MIN_POSITIVE;
    let xs = if sub { x * 8_388_608.0 } else { x };
    let bits = xs.to_bits();
    // The exponent for a mantissa in [0.5, 1), then [√½, √2) after the adjustment below.
    let e = ((bits >> 23) & 0xff) as i32 - 126 - if sub { 23 } else { 0 };
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000);
    let small = m < SQRT_HALF;
    let e = (e - i32::from(small)) as f32;
    let m = if small { m + m - 1.0 } else { m - 1.0 };
    let z = m * m;
    let mut p = LP[0];
    for &c in &LP[1..] {
        p = madd::<FMA>(p, m, c);
    }
    let y = m * z * p;
    let y = madd::<FMA>(e, C2, y);
    let y = madd::<FMA>(z, -0.5, y);
    let r = madd::<FMA>(e, C1, m + y);
    let r = if x == f32::INFINITY { x } else { r };
    let r = if x == 0.0 { f32::NEG_INFINITY } else { r };
    if x < 0.0 || x.is_nan() { f32::NAN } else { r }
}

#[inline(always)]
fn ln_loop<const FMA: bool>(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = ln1::<FMA>(v);
    }
}

/// `ln`, then the scalar tail as [`exp_then_loop`].
#[inline(always)]
fn ln_then_loop<const FMA: bool>(x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let y = ln1::<FMA>(v) * m[0] + a[0];
        *o = y * m[1] + a[1];
    }
}

/// The loops above on 16 lanes with AVX-512 intrinsics. The arithmetic is the scalar code's,
/// operation for operation (the same clamps, the same rounding trick for `n`, the same
/// polynomial), except the final scaling: one `vscalefps` instead of the product by two powers
/// of two. Both round once (the first factor keeps the product normal, so only the second
/// rounds), so results are the AVX2 path's bit for bit; the scaling was a third of the
/// instructions, and LLVM does not emit `vscalefps` from scalar code.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{C1, C2, LOG2E, P, ROUND};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        // `max(c, x)` and `min(c, x)` return `x` when it is NaN (the second operand).
        let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
        let x = _mm512_min_ps(_mm512_set1_ps(88.8), x);
        let t = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(ROUND));
        let n = _mm512_sub_ps(t, _mm512_set1_ps(ROUND));
        // fnmadd(a, b, c) = c - a * b, rounded once: the scalar `madd(n, -C, c)`.
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C1), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C2), r);
        let mut p = _mm512_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
        let y = _mm512_add_ps(y, _mm512_set1_ps(1.0));
        _mm512_scalef_ps(y, n)
    }

    /// The lanes of a tail of `len < 16` elements.
    #[inline]
    fn tail_mask(len: usize) -> __mmask16 {
        ((1u32 << len) - 1) as __mmask16
    }

    /// `out[i] = f(x[i])` 16 lanes at a time, the tail through masked loads and stores.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn map16(x: &[f32], out: &mut [f32], f: impl Fn(__m512) -> __m512) {
        let n = x.len().min(out.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`, in bounds of both slices; unaligned loads and stores.
            unsafe {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), f(v));
            }
            i += 16;
        }
        if i < n {
            let k = tail_mask(n - i);
            // SAFETY: the mask covers the `n - i` elements left in both slices; masked-off
            // lanes are neither read nor written (no fault).
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, x.as_ptr().add(i));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), k, f(v));
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn exp(x: &[f32], out: &mut [f32]) {
        map16(x, out, |v| exp16(v));
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn exp_then(x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) {
        let (m0, a0) = (_mm512_set1_ps(m[0]), _mm512_set1_ps(a[0]));
        let (m1, a1) = (_mm512_set1_ps(m[1]), _mm512_set1_ps(a[1]));
        map16(x, out, |v| {
            let y = _mm512_add_ps(_mm512_mul_ps(exp16(v), m0), a0);
            _mm512_add_ps(_mm512_mul_ps(y, m1), a1)
        });
    }

    /// `ln` has no hand kernel: the FMA loop compiled for AVX-512 (the same bits).
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn ln(x: &[f32], out: &mut [f32]) {
        super::ln_loop::<true>(x, out)
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn ln_then(x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) {
        super::ln_then_loop::<true>(x, out, m, a)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn sigmoid(x: &[f32], out: &mut [f32]) {
        let one = _mm512_set1_ps(1.0);
        let sign = _mm512_set1_epi32(i32::MIN);
        map16(x, out, |v| {
            let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign));
            _mm512_div_ps(one, _mm512_add_ps(one, exp16(neg)))
        });
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        let mv = _mm512_set1_ps(m);
        let mut acc = _mm512_setzero_ps();
        let n = x.len();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`, in bounds.
            unsafe {
                let v = exp16(_mm512_sub_ps(_mm512_loadu_ps(x.as_ptr().add(i)), mv));
                _mm512_storeu_ps(x.as_mut_ptr().add(i), v);
                acc = _mm512_add_ps(acc, v);
            }
            i += 16;
        }
        let mut s: f32 = 0.0;
        if i < n {
            let k = tail_mask(n - i);
            // SAFETY: the mask covers exactly the `n - i` elements left.
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, x.as_ptr().add(i));
                _mm512_mask_storeu_ps(x.as_mut_ptr().add(i), k, exp16(_mm512_sub_ps(v, mv)));
            }
            // In order, as the scalar loop adds its remainder.
            for v in &x[i..] {
                s += *v;
            }
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        s + lanes.iter().sum::<f32>()
    }
}

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $loop:ident, $wide:ident,
     ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $loop::<true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the processor has AVX-512F, all that `avx512::$wide` is
                    // compiled for (checked just above).
                    return unsafe { avx512::$wide($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the processor has AVX2 and FMA, all that `avx2` is compiled
                    // for (checked just above); the function itself is safe Rust.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $loop::<false>($($arg),*)
        }
    };
}

dispatch!(
    /// `out[i] = exp(x[i])` (the slices have equal length).
    exp_f32, exp_loop, exp, (x: &[f32], out: &mut [f32]) -> ()
);
dispatch!(
    /// `out[i] = (exp(x[i]) * m[0] + a[0]) * m[1] + a[1]`, no operation fused with another.
    exp_then_f32, exp_then_loop, exp_then,
    (x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) -> ()
);
dispatch!(
    /// `out[i] = 1 / (1 + exp(-x[i]))`.
    sigmoid_f32, sigmoid_loop, sigmoid, (x: &[f32], out: &mut [f32]) -> ()
);
dispatch!(
    /// `out[i] = ln(x[i])`.
    ln_f32, ln_loop, ln, (x: &[f32], out: &mut [f32]) -> ()
);
dispatch!(
    /// `out[i] = (ln(x[i]) * m[0] + a[0]) * m[1] + a[1]`, no operation fused with another.
    ln_then_f32, ln_then_loop, ln_then,
    (x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) -> ()
);
dispatch!(
    /// `x[i] = exp(x[i] - m)` in place; returns the sum of the new values.
    exp_sub_sum_f32, exp_sub_sum_loop, exp_sub_sum, (x: &mut [f32], m: f32) -> f32
);

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_matches_f64_everywhere() {
        let mut xs: Vec<f32> = (-2_000_000..=2_000_000).map(|i| i as f32 * 5e-5).collect();
        xs.extend((-1100..=900).map(|i| i as f32 * 0.1));
        xs.extend([88.72, 88.73, -87.3, -87.4, -100.0, -103.9, 0.0, -0.0, 1e-30]);
        let mut out = vec![0.0; xs.len()];
        exp_f32(&xs, &mut out);
        let mut fallback = vec![0.0; xs.len()];
        exp_loop::<false>(&xs, &mut fallback);
        for ((&x, &y), &z) in xs.iter().zip(&out).zip(&fallback) {
            let want = (x as f64).exp() as f32;
            let tol = if want < f32::MIN_POSITIVE { 1 << 4 } else { 2 };
            assert!(ulps(y, want) <= tol, "exp({x}) = {y}, want {want}");
            assert!(ulps(z, want) <= tol, "fallback exp({x}) = {z}, want {want}");
        }
        let mut o = [0.0; 5];
        exp_f32(
            &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 89.0, -105.0],
            &mut o,
        );
        assert!(o[0].is_nan());
        assert_eq!(&o[1..], &[f32::INFINITY, 0.0, f32::INFINITY, 0.0]);
    }

    #[test]
    fn ln_matches_f64_everywhere() {
        // Every 97th f32 bit pattern from the smallest subnormal to infinity, and around 1.
        let mut xs: Vec<f32> = (1..0x7f80_0000u32)
            .step_by(97)
            .map(f32::from_bits)
            .collect();
        xs.extend((-100_000..=100_000).map(|i| 1.0 + i as f32 * 1e-6));
        xs.extend([
            f32::MIN_POSITIVE,
            f32::MAX,
            1.0,
            2.0,
            0.5,
            SQRT_HALF,
            1e-45,
            1e-40,
        ]);
        let mut out = vec![0.0; xs.len()];
        ln_f32(&xs, &mut out);
        let mut fallback = vec![0.0; xs.len()];
        ln_loop::<false>(&xs, &mut fallback);
        for ((&x, &y), &z) in xs.iter().zip(&out).zip(&fallback) {
            let want = (x as f64).ln() as f32;
            assert!(ulps(y, want) <= 2, "ln({x}) = {y}, want {want}");
            assert!(ulps(z, want) <= 2, "fallback ln({x}) = {z}, want {want}");
        }
        let mut o = [0.0; 6];
        ln_f32(
            &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -1.0],
            &mut o,
        );
        assert!(o[0].is_nan() && o[2].is_nan() && o[5].is_nan());
        assert_eq!(&o[1..2], &[f32::INFINITY]);
        assert_eq!(&o[3..5], &[f32::NEG_INFINITY, f32::NEG_INFINITY]);
    }

    /// The dispatched paths (AVX-512 with `vscalefps` on processors that have it) give the
    /// scalar code's bits with fused multiply-adds, for every function and every tail length.
    #[test]
    fn every_path_gives_the_fma_code_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if !std::arch::is_x86_feature_detected!("fma") {
            eprintln!("skipped: no FMA, so the dispatched path is the plain one");
            return;
        }
        let mut xs: Vec<f32> = (-120_000..=100_000).map(|i| i as f32 * 1e-3).collect();
        xs.extend([
            -87.33, -87.34, -100.0, -103.97, -104.0, -104.1, 88.72, 88.73, 88.8, 88.9,
        ]);
        xs.extend([0.0, -0.0, 1e-30, -1e-30, f32::MIN_POSITIVE, 3e38, -3e38]);
        xs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
        let same = |a: &[f32], b: &[f32], what: &str| {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                let nans = x.is_nan() && y.is_nan();
                assert!(
                    x.to_bits() == y.to_bits() || nans,
                    "{what} at {i}: {x} vs {y}"
                );
            }
        };
        for len in (0..40).chain([xs.len() - 5, xs.len()]) {
            let x = &xs[xs.len() - len..];
            let (mut got, mut want) = (vec![0.0; len], vec![0.0; len]);
            exp_f32(x, &mut got);
            exp_loop::<true>(x, &mut want);
            same(&got, &want, "exp");
            let (m, a) = ([0.5, -1.0], [-0.0, 3.0]);
            exp_then_f32(x, &mut got, m, a);
            exp_then_loop::<true>(x, &mut want, m, a);
            same(&got, &want, "exp_then");
            sigmoid_f32(x, &mut got);
            sigmoid_loop::<true>(x, &mut want);
            same(&got, &want, "sigmoid");
            ln_f32(x, &mut got);
            ln_loop::<true>(x, &mut want);
            same(&got, &want, "ln");
            ln_then_f32(x, &mut got, m, a);
            ln_then_loop::<true>(x, &mut want, m, a);
            same(&got, &want, "ln_then");
            let finite: Vec<f32> = x.iter().map(|v| v.clamp(-50.0, 50.0) * 0.1).collect();
            let (mut got, mut want) = (finite.clone(), finite);
            let (s, t) = (
                exp_sub_sum_f32(&mut got, 1.5),
                exp_sub_sum_loop::<true>(&mut want, 1.5),
            );
            same(&got, &want, "exp_sub_sum values");
            let nans = s.is_nan() && t.is_nan();
            assert!(
                s.to_bits() == t.to_bits() || nans,
                "exp_sub_sum's sum, len {len}"
            );
        }
    }

    #[test]
    fn exp_sub_sum() {
        let mut x: Vec<f32> = (0..37).map(|i| i as f32 * 0.1).collect();
        let s = exp_sub_sum_f32(&mut x, 3.6);
        let want: f32 = (0..37)
            .map(|i| ((i as f32 * 0.1 - 3.6) as f64).exp() as f32)
            .sum();
        assert!((s - want).abs() < 1e-5 * want, "{s} {want}");
        assert!((x[36] - 1.0).abs() < 1e-6);
    }
}
