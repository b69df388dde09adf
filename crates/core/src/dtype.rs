//! Element types.
//!
//! `DType` is a closed set today (f32, f64, i64, u8) but every match on it lives in a backend's
//! kernel dispatch, so adding f16/bf16 later is one variant plus one arm per backend.

use std::fmt;

/// The element type of a tensor. Storage is untyped; the tensor carries its dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    F32,
    F64,
    I64,
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// True for floating-point types (the only ones most math ops accept).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
