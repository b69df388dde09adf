//! Element conversions: the `cast` op's per-element function between every pair of dtypes.
//!
//! Between f32, f64, i64 and u8 a conversion is Rust's `as` (saturating for integers, NaN to
//! 0). A 16-bit float source is first widened to f32 (exact), then converted as an f32; a
//! 16-bit float target rounds once, to nearest even, from the source's value (an i64 beyond
//! 2^53 goes through f64 first, as the reference does). So `cast` between any two dtypes,
//! single-op or fused, has one definition.

use half::{bf16, f16};

/// `self` converted to `U` (see the module docs).
pub(crate) trait Conv<U>: Copy {
    fn conv(self) -> U;
}

macro_rules! conv_as {
    ($($a:ty),*) => {
        $(
            impl Conv<f32> for $a {
                #[inline(always)]
                fn conv(self) -> f32 { self as f32 }
            }
            impl Conv<f64> for $a {
                #[inline(always)]
                fn conv(self) -> f64 { self as f64 }
            }
            impl Conv<i64> for $a {
                #[inline(always)]
                fn conv(self) -> i64 { self as i64 }
            }
            impl Conv<u8> for $a {
                #[inline(always)]
                fn conv(self) -> u8 { self as u8 }
            }
            impl Conv<f16> for $a {
                #[inline(always)]
                fn conv(self) -> f16 { kiln_core::halfround::f16_from_f64(self as f64) }
            }
            impl Conv<bf16> for $a {
                #[inline(always)]
                fn conv(self) -> bf16 { kiln_core::halfround::bf16_from_f64(self as f64) }
            }
        )*
    };
}
conv_as!(i64, u8, f64);

// f32 sources: a 16-bit target rounds from the f32 directly (one rounding, as from f64).
macro_rules! conv_from_f32 {
    ($a:ty, $wide:expr) => {
        impl Conv<f32> for $a {
            #[inline(always)]
            #[allow(clippy::redundant_closure_call)]
            fn conv(self) -> f32 {
                ($wide)(self)
            }
        }
        impl Conv<f64> for $a {
            #[inline(always)]
            fn conv(self) -> f64 {
                Conv::<f32>::conv(self) as f64
            }
        }
        impl Conv<i64> for $a {
            #[inline(always)]
            fn conv(self) -> i64 {
                Conv::<f32>::conv(self) as i64
            }
        }
        impl Conv<u8> for $a {
            #[inline(always)]
            fn conv(self) -> u8 {
                Conv::<f32>::conv(self) as u8
            }
        }
        impl Conv<f16> for $a {
            #[inline(always)]
            fn conv(self) -> f16 {
                f16::from_f32(Conv::<f32>::conv(self))
            }
        }
        impl Conv<bf16> for $a {
            #[inline(always)]
            fn conv(self) -> bf16 {
                bf16::from_f32(Conv::<f32>::conv(self))
            }
        }
    };
}
conv_from_f32!(f32, |x: f32| x);
conv_from_f32!(f16, f16::to_f32);
conv_from_f32!(bf16, bf16::to_f32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn casts_round_once_and_saturate() {
        let x: f16 = Conv::conv(1.0f32 + 2f32.powi(-11)); // a tie: to even
        assert_eq!(x, f16::ONE);
        let y: bf16 = Conv::conv(x);
        assert_eq!(y, bf16::ONE);
        assert_eq!(Conv::<u8>::conv(f16::from_f32(300.0)), 255);
        assert_eq!(Conv::<i64>::conv(f16::NAN), 0);
        assert_eq!(Conv::<f16>::conv(70000i64), f16::INFINITY);
        assert_eq!(
            Conv::<f64>::conv(bf16::from_f32(0.1)),
            bf16::from_f32(0.1).to_f64()
        );
    }
}
