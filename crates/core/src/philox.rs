//! Philox4x32-10, the one counter-based random generator of kiln.
//!
//! A draw with `seed` uses key `[seed_lo, seed_hi]` and counters `[c_lo, c_hi, 0, 0]`. f32
//! uniforms (and the 16-bit ones, rounded from them) take all four words of a counter: element
//! `i` is word `i % 4` of counter `i / 4` ([`uniform_f32`]), so one Philox call serves four
//! elements. f64 uniforms and every normal take counter `i` for element `i` (they need two or
//! four words). Every backend implements exactly these functions, so the same seed and shape
//! give the same numbers on the CPU and the GPU: bit-identical uniforms, and normals equal up
//! to the last bits of `log`/`cos` (GPU kernels must not contract the uniform's affine map into
//! an FMA; compute it as written below).
//!
//! Until 2026-11-29 an f32 uniform took word 0 of counter `i` and threw the other three away:
//! the draws were Philox-bound on a GPU (6.3M uniforms in 27 µs on an H200, a quarter of that
//! with four per call). Seeded f32 streams drawn before then differ.
//!
//! Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11).

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Ten rounds of Philox4x32 on `ctr` with `key`.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = ctr;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The four random words of element `i` for `seed`.
pub fn words(seed: u64, i: u64) -> [u32; 4] {
    philox4x32_10(
        [i as u32, (i >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// The key of draw number `draw` of a generator seeded with `seed`
/// ([`Generator`](crate::Generator)): the first two words of Philox on counter
/// `[draw_lo, draw_hi, 0x6b65_7973, 0]` (`"keys"`) under key `seed`, so that keys of
/// successive draws are unrelated and never equal an element's counter stream.
pub fn draw_key(seed: u64, draw: u64) -> u64 {
    let w = philox4x32_10(
        [draw as u32, (draw >> 32) as u32, 0x6b65_7973, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    (w[0] as u64) | ((w[1] as u64) << 32)
}

const F32_UNIT: f32 = 1.0 / 16_777_216.0; // 2^-24
const F64_UNIT: f64 = 1.0 / 9_007_199_254_740_992.0; // 2^-53

/// Uniform in `[0, 1)` with the top 24 bits of one word: `(w >> 8) * 2^-24`.
pub fn unit_f32(w: u32) -> f32 {
    (w >> 8) as f32 * F32_UNIT
}

/// Uniform in `[0, 1)` with 53 random bits from `w0:w1`.
pub fn unit_f64(w: [u32; 4]) -> f64 {
    ((((w[0] as u64) << 32) | w[1] as u64) >> 11) as f64 * F64_UNIT
}

/// Element `i` of the f32 uniforms of `seed`: word `i % 4` of counter `i / 4` as
/// [`uniform_f32_of`] maps it.
pub fn uniform_f32(seed: u64, i: u64, low: f32, high: f32) -> f32 {
    uniform_f32_of(words(seed, i / 4)[(i % 4) as usize], low, high)
}

/// Elements `4 g .. 4 g + 4` of the f32 uniforms of `seed`: one Philox call.
pub fn uniform_f32x4(seed: u64, g: u64, low: f32, high: f32) -> [f32; 4] {
    words(seed, g).map(|w| uniform_f32_of(w, low, high))
}

/// One word as a uniform in `[low, high)`: `low + (high - low) * u` in f32, no FMA.
pub fn uniform_f32_of(w: u32, low: f32, high: f32) -> f32 {
    low + (high - low) * unit_f32(w)
}

pub fn uniform_f64(seed: u64, i: u64, low: f64, high: f64) -> f64 {
    low + (high - low) * unit_f64(words(seed, i))
}

/// Box–Muller in f32: `u1 = ((w0 >> 8) + 1) * 2^-24` in `(0, 1]`, `u2 = (w1 >> 8) * 2^-24`,
/// `z = sqrt(-2 ln u1) * cos(2π u2)`, then `mean + std * z`.
pub fn normal_f32(seed: u64, i: u64, mean: f32, std: f32) -> f32 {
    let w = words(seed, i);
    let u1 = ((w[0] >> 8) + 1) as f32 * F32_UNIT;
    let u2 = (w[1] >> 8) as f32 * F32_UNIT;
    let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
    mean + std * z
}

/// Box–Muller in f64: `u1` from `w0:w1` shifted into `(0, 1]`, `u2` from `w2:w3`.
pub fn normal_f64(seed: u64, i: u64, mean: f64, std: f64) -> f64 {
    let w = words(seed, i);
    let u1 = (((((w[0] as u64) << 32) | w[1] as u64) >> 11) + 1) as f64 * F64_UNIT;
    let u2 = ((((w[2] as u64) << 32) | w[3] as u64) >> 11) as f64 * F64_UNIT;
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    mean + std * z
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answer() {
        // Random123's published known-answer vector for philox4x32_10 with all-zero inputs.
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffff_ffff; 4], [0xffff_ffff; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
    }

    #[test]
    fn f32_uniforms_take_four_words_a_counter() {
        let w = words(7, 3);
        for k in 0..4 {
            let u = uniform_f32(7, 12 + k, -1.0, 2.0);
            assert_eq!(
                u.to_bits(),
                uniform_f32_of(w[k as usize], -1.0, 2.0).to_bits()
            );
            assert_eq!(
                u.to_bits(),
                uniform_f32x4(7, 3, -1.0, 2.0)[k as usize].to_bits()
            );
        }
        // The words of neighbouring counters are not the same.
        assert_ne!(uniform_f32(7, 11, 0.0, 1.0), uniform_f32(7, 12, 0.0, 1.0));
    }

    #[test]
    fn uniforms_are_in_range_and_spread() {
        let xs: Vec<f32> = (0..10_000).map(|i| uniform_f32(7, i, 0.0, 1.0)).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        let zs: Vec<f64> = (0..10_000).map(|i| normal_f64(7, i, 0.0, 1.0)).collect();
        let m = zs.iter().sum::<f64>() / 1e4;
        let v = zs.iter().map(|z| (z - m) * (z - m)).sum::<f64>() / 1e4;
        assert!(m.abs() < 0.05 && (v - 1.0).abs() < 0.05, "{m} {v}");
    }
}
