//! The texts every kernel is built from: our hand-written kernel files under `kernels/`, the
//! shared headers, and the names that connect Rust to them (C type names, backward functions).
//!
//! # Why a module of its own
//!
//! This is the bottom of the crate: plain data, no device, no NVRTC. The code generators
//! (`codegen/`, `user_kernel/`) prepend these headers to what they write, the
//! runtime (`nvrtc.rs`, `device/`) compiles and loads them, and the ops name their kernels
//! with them — all of them import this module, and it imports only `kernel_files.rs` (the
//! fixed files' texts, which `build.rs` shares).

use kiln_core::{BinaryOp, CmpOp, DType, UnaryOp};

/// The header prepended to every kernel source (types, `Dims`/`Strides`, block reductions).
pub use crate::kernel_files::COMMON;
pub use crate::kernel_files::{Group, Module};

/// The hand-written part of [`scalar_ops`]: the math library's float/double overloads, binary
/// ops, comparisons, casts.
const SCALAR_OPS_CUH: &str = include_str!("../kernels/scalar_ops.cuh");

/// The elementwise ops' scalar functions, prepended to every generated kernel:
/// `scalar_ops.cuh`, then one device function per entry of kiln-core's op tables,
/// `op_<name><T>(T x)` and `op_<name><T>(T a, T b)`, written from the entries' CUDA bodies
/// ([`unary_device_functions`], [`binary_device_functions`]).
pub fn scalar_ops() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        format!(
            "{SCALAR_OPS_CUH}\n#line 1 \"unary ops (kiln_core::op::unary)\"\n{}\
             #line 1 \"binary ops (kiln_core::op::binary)\"\n{}",
            unary_device_functions(),
            binary_device_functions()
        )
    })
}

/// `template <typename T> T op_<name>(T x)` for every unary op of the table, and its `i64`
/// specialization where the entry has one.
pub fn unary_device_functions() -> String {
    let mut s = String::new();
    for op in UnaryOp::ALL {
        let (body, int) = op.cuda();
        let name = op.name();
        s += &format!(
            "template <typename T> __device__ __forceinline__ T op_{name}(T x) {{ return {body}; }}\n"
        );
        if let Some(int) = int {
            s += &format!(
                "template <> __device__ __forceinline__ i64 op_{name}(i64 x) {{ return {int}; }}\n"
            );
        }
    }
    s
}

/// `template <typename T> T op_<name>(T a, T b)` for every binary op of the table (with its
/// `i64` specialization where the entry has one), and `u8 op_<name>(T a, T b)` for every
/// comparison.
pub fn binary_device_functions() -> String {
    let mut s = String::new();
    for op in BinaryOp::ALL {
        let (body, int) = op.cuda();
        let name = op.name();
        s += &format!(
            "template <typename T> __device__ __forceinline__ T op_{name}(T a, T b) {{ return {body}; }}\n"
        );
        if let Some(int) = int {
            s += &format!(
                "template <> __device__ __forceinline__ i64 op_{name}(i64 a, i64 b) {{ return {int}; }}\n"
            );
        }
    }
    for op in CmpOp::ALL {
        let (name, o) = (op.name(), op.operator());
        s += &format!(
            "template <typename T> __device__ __forceinline__ u8 op_{name}(T a, T b) {{ return a {o} b; }}\n"
        );
    }
    s
}

/// The C type of `dtype` in our kernels (`common.cuh`'s typedefs), also the dtype part of the
/// single-op kernels' names.
pub(crate) fn ctype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::I64 => "i64",
        DType::U8 => "u8",
        // Storage structs of `common.cuh`: loaded, converted to f32, rounded on store.
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "unsupported",
    }
}
