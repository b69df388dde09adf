//! [`Real`]: the float arithmetic the op table's scalar definitions are written in.
//!
//! A table entry defines its forward once, generic over `T: Real`; the reference backend
//! instantiates it at `f64`, the CPU backend at `f32` and `f64`. The methods are the math
//! library's (`std` where it has the function, `libm` where it does not), so an op written
//! here computes the same thing on every CPU.

use std::ops::{Add, Div, Mul, Neg, Sub};

/// A float type the op table's scalar definitions run on (`f32`, `f64`).
pub trait Real:
    Copy
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + Send
    + Sync
    + 'static
{
    /// `v` rounded to this type (how the table writes constants: `T::of(0.5)`).
    fn of(v: f64) -> Self;
    fn is_nan(self) -> bool;
    fn abs(self) -> Self;
    fn exp(self) -> Self;
    /// `exp(x) - 1`, accurate near 0.
    fn exp_m1(self) -> Self;
    fn ln(self) -> Self;
    /// `ln(1 + x)`, accurate near 0.
    fn ln_1p(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    /// The error function.
    fn erf(self) -> Self;
    fn floor(self) -> Self;
    /// `self^e`.
    fn powf(self, e: Self) -> Self;
    fn ceil(self) -> Self;
}

macro_rules! real_impl {
    ($t:ty, $erf:path) => {
        impl Real for $t {
            #[inline(always)]
            fn of(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn exp_m1(self) -> Self {
                <$t>::exp_m1(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn floor(self) -> Self {
                <$t>::floor(self)
            }
            #[inline(always)]
            fn ceil(self) -> Self {
                <$t>::ceil(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
        }
    };
}

real_impl!(f32, libm::erff);
real_impl!(f64, libm::erf);
