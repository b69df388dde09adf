//! f64 to f16/bf16 with one correct rounding (to nearest, ties to even).
//!
//! Why not `half`'s `from_f64`: it drops the low 32 bits of the f64 before rounding (half 2.7),
//! so a value just above a tie rounds down, and `bf16::from_f64(x as f64)` differs from
//! `bf16::from_f32(x)` for some f32 `x` (seen in the conformance suite's casts). Here the f64
//! is first rounded to f32 *to odd* (truncated, its last bit set when inexact), which keeps
//! every bit a later rounding to 11 or 8 significant bits needs (f32's 24 bits are at least
//! two more than the target's, the condition for round-to-odd), then rounded to the 16-bit type
//! from f32, which `half` does correctly.

use half::{bf16, f16};

/// `x` rounded to f32 toward zero, with the last bit set when that was inexact.
fn f32_round_to_odd(x: f64) -> f32 {
    let r = x as f32; // to nearest
    if r.is_nan() || (r as f64) == x {
        return r;
    }
    // Toward zero: one step back where the nearest rounding went up in magnitude (an f32 of
    // the same sign is ordered by its bits' magnitude; inf steps back to the largest finite).
    let mut bits = r.to_bits();
    if (r as f64).abs() > x.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

/// `x` rounded once to the nearest f16 (ties to even).
pub fn f16_from_f64(x: f64) -> f16 {
    f16::from_f32(f32_round_to_odd(x))
}

/// `x` rounded once to the nearest bf16 (ties to even).
pub fn bf16_from_f64(x: f64) -> bf16 {
    bf16::from_f32(f32_round_to_odd(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_once() {
        // Just above the tie between bf16 1 and 1 + 2^-7: up (half's from_f64 gives 1).
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(bf16_from_f64(x).to_f64(), 1.0 + 2f64.powi(-7));
        assert_eq!(bf16_from_f64(1.0 + 2f64.powi(-8)).to_f64(), 1.0); // the tie: to even
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-45);
        assert_eq!(f16_from_f64(y).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(f16_from_f64(-y).to_f64(), -(1.0 + 2f64.powi(-10)));
        assert_eq!(f16_from_f64(1e300), f16::INFINITY);
        assert_eq!(bf16_from_f64(-1e300), bf16::NEG_INFINITY);
        assert!(f16_from_f64(f64::NAN).is_nan());
        assert_eq!(f16_from_f64(1e-300).to_bits(), 0);
        for i in 0..100_000u32 {
            let f = f32::from_bits(i.wrapping_mul(2_654_435_761));
            if f.is_nan() {
                continue;
            }
            assert_eq!(bf16_from_f64(f as f64), bf16::from_f32(f), "{f:e}");
            assert_eq!(f16_from_f64(f as f64), f16::from_f32(f), "{f:e}");
        }
    }
}
