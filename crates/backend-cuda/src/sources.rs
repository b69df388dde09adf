//! The texts every kernel is built from: our hand-written kernel files under `kernels/`, the
//! shared headers, and the names that connect Rust to them (C type names, backward functions).
//!
//! # Why a module of its own
//!
//! This is the bottom of the crate: plain data, no device, no NVRTC. The code generators
//! (`codegen/`, `user_kernel/`) prepend these headers to what they write, the
//! runtime (`nvrtc.rs`, `device/`) compiles and loads them, and the ops name their kernels
//! with them — all of them import this module, and it imports none of them.

use kiln_core::{DType, UnaryOp};

/// The header prepended to every kernel source (types, `Dims`/`Strides`, block reductions).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// The hand-written part of [`scalar_ops`]: the math library's float/double overloads, binary
/// ops, comparisons, casts.
const SCALAR_OPS_CUH: &str = include_str!("../kernels/scalar_ops.cuh");

/// The elementwise ops' scalar functions, prepended to `elementwise.cu` and to every generated
/// kernel: `scalar_ops.cuh`, then one device function per entry of kiln-core's op table,
/// `op_<name><T>(T x)`, written from the entry's CUDA body ([`unary_device_functions`]).
pub fn scalar_ops() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        format!(
            "{SCALAR_OPS_CUH}\n#line 1 \"unary ops (kiln_core::op::unary)\"\n{}",
            unary_device_functions()
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

/// One compilation unit under `kernels/`. (Elementwise ops and optimizer updates have none:
/// their kernels are generated per program, `codegen/`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Copy,
    Rand,
    Reduce,
    Softmax,
    Index,
    Util,
}

impl Module {
    pub const ALL: [Module; 6] = [
        Module::Copy,
        Module::Rand,
        Module::Reduce,
        Module::Softmax,
        Module::Index,
        Module::Util,
    ];

    /// The file name under `kernels/`.
    pub fn file_name(self) -> &'static str {
        match self {
            Module::Copy => "copy.cu",
            Module::Rand => "rand.cu",
            Module::Reduce => "reduce.cu",
            Module::Softmax => "softmax.cu",
            Module::Index => "index.cu",
            Module::Util => "util.cu",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Module::Copy => include_str!("../kernels/copy.cu"),
            Module::Rand => include_str!("../kernels/rand.cu"),
            Module::Reduce => include_str!("../kernels/reduce.cu"),
            Module::Softmax => include_str!("../kernels/softmax.cu"),
            Module::Index => include_str!("../kernels/index.cu"),
            Module::Util => include_str!("../kernels/util.cu"),
        }
    }

    /// The text NVRTC compiles: the common header, then the file, with `#line` markers so that
    /// diagnostics name the real file and line.
    pub fn full_source(self) -> String {
        format!(
            "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}",
            self.file_name(),
            self.source()
        )
    }
}

/// The C type of `dtype` in our kernels (`common.cuh`'s typedefs), also the dtype part of the
/// single-op kernels' names.
pub(crate) fn ctype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::I64 => "i64",
        DType::U8 => "u8",
        _ => "unsupported",
    }
}
