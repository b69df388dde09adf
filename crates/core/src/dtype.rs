//! Element types.
//!
//! `DType` is a closed set (f32, f64, f16, bf16, i64, u8); every match on it lives in a
//! backend's kernel dispatch or in the reference, so a new type is one variant plus one arm per
//! match.
//!
//! The 16-bit floats (`f16`, IEEE binary16, and `bf16`, bfloat16, both from the `half` crate and
//! re-exported as [`crate::f16`] and [`crate::bf16`]) are storage types: every kernel loads them,
//! computes in f32 and rounds the result to the 16-bit type on store (see
//! [`crate::expr::Program::widened`] for how an expression program does it).

use std::fmt;
use std::str::FromStr;

/// The element type of a tensor. Storage is untyped; the tensor carries its dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    F32,
    F64,
    I64,
    U8,
    /// IEEE 754 binary16 (`torch.float16`): 11 significant bits, up to 65504.
    F16,
    /// bfloat16 (`torch.bfloat16`): f32's range with 8 significant bits.
    BF16,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::I64,
        DType::U8,
        DType::F16,
        DType::BF16,
    ];

    /// The floating-point dtypes.
    pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::I64 => 8,
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// True for floating-point types (the only ones most math ops accept).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// True for the 16-bit floats, which kernels compute in f32 (see the module docs).
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// The dtype kernels compute a value of this dtype in: f32 for the 16-bit floats, the
    /// dtype itself otherwise.
    pub fn compute_dtype(self) -> DType {
        if self.is_half() { DType::F32 } else { self }
    }

    /// Machine epsilon (the distance from 1 to the next value) of a float dtype; 0 for
    /// integers.
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F32 => f32::EPSILON as f64,
            DType::F64 => f64::EPSILON,
            DType::F16 => 2f64.powi(-10),
            DType::BF16 => 2f64.powi(-7),
            DType::I64 | DType::U8 => 0.0,
        }
    }

    /// `v` rounded to the nearest value of this dtype, as an f64: the identity for f64, a
    /// round to nearest even for the other floats, an `as` cast (saturating, NaN to 0) for the
    /// integers.
    pub fn round(self, v: f64) -> f64 {
        match self {
            DType::F64 => v,
            DType::F32 => v as f32 as f64,
            DType::F16 => crate::halfround::f16_from_f64(v).to_f64(),
            DType::BF16 => crate::halfround::bf16_from_f64(v).to_f64(),
            DType::I64 => v as i64 as f64,
            DType::U8 => v as u8 as f64,
        }
    }

    /// The name PyTorch and numpy use for the type, without the `torch.` prefix (`f32`, `bf16`).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dtype name [`DType::from_str`] does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownDType(pub String);

impl fmt::Display for UnknownDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown dtype {:?} (expected f32, f64, f16, bf16, i64 or u8)",
            self.0
        )
    }
}

impl std::error::Error for UnknownDType {}

impl FromStr for DType {
    type Err = UnknownDType;

    /// Parses kiln's names (`f32`, `f16`, `bf16`, ...) and PyTorch's (`float32`, `float`,
    /// `float16`, `half`, `bfloat16`, `float64`, `double`, `int64`, `long`, `uint8`), with or
    /// without a `torch.` prefix.
    fn from_str(s: &str) -> Result<DType, UnknownDType> {
        let name = s.trim();
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Ok(match name {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i64" | "int64" | "long" => DType::I64,
            "u8" | "uint8" => DType::U8,
            _ => return Err(UnknownDType(s.to_string())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>().unwrap(), d);
        }
        assert_eq!("torch.bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("half".parse::<DType>().unwrap(), DType::F16);
        assert!("f8".parse::<DType>().is_err());
    }

    #[test]
    fn sixteen_bit_types() {
        for d in [DType::F16, DType::BF16] {
            assert_eq!(d.size_in_bytes(), 2);
            assert!(d.is_float() && d.is_half());
            assert_eq!(d.compute_dtype(), DType::F32);
        }
        assert_eq!(DType::F16.round(1.0 + 2f64.powi(-11)), 1.0); // a tie rounds to even
        assert_eq!(DType::F16.round(70000.0), f64::INFINITY);
        assert_eq!(DType::BF16.round(1.0 + 2f64.powi(-7)), 1.0 + 2f64.powi(-7));
        assert_eq!(DType::BF16.round(1.0 + 2f64.powi(-9)), 1.0);
    }
}
