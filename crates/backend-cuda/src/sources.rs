//! The texts every kernel is built from: our hand-written kernel files under `kernels/`, the
//! shared headers, and the names that connect Rust to them (C type names, backward functions).
//!
//! # Why a module of its own
//!
//! This is the bottom of the crate: plain data, no device, no NVRTC. The code generators
//! (`codegen/`, `user_kernel/`) prepend these headers to what they write, the
//! runtime (`nvrtc.rs`, `device/`) compiles and loads them, and the ops name their kernels
//! with them — all of them import this module, and it imports none of them.

use kiln_core::{BinaryOp, CmpOp, DType, UnaryOp};

/// The header prepended to every kernel source (types, `Dims`/`Strides`, block reductions).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

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
    Attention,
}

impl Module {
    pub const ALL: [Module; 7] = [
        Module::Copy,
        Module::Rand,
        Module::Reduce,
        Module::Softmax,
        Module::Index,
        Module::Util,
        Module::Attention,
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
            Module::Attention => "attention.cu",
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
            Module::Attention => include_str!("../kernels/attention.cu"),
        }
    }

    /// The text NVRTC compiles for the kernels of dtype `group` only (see [`Group`]): the
    /// common header and the file, keeping of its instance lines (top-level macro calls such as
    /// `REDUCE_ALL(float)`) those that name the group's dtype or none.
    pub fn group_source(self, group: Group) -> String {
        let Group::Dtype(token) = group else {
            return self.full_source();
        };
        let mut out = String::with_capacity(self.source().len());
        let mut continued = false;
        for line in self.source().lines() {
            let instance = !continued && is_instance(line);
            continued = line.trim_end().ends_with('\\');
            if instance {
                let names = words(line)
                    .filter(|w| DTYPE_TOKENS.contains(w))
                    .collect::<Vec<_>>();
                if !names.is_empty() && !names.contains(&token) {
                    out.push('\n'); // keeps the line numbers of `#line`
                    continue;
                }
            }
            out.push_str(line);
            out.push('\n');
        }
        self.with_headers(&out)
    }

    /// The text NVRTC compiles: the common header, then the file, with `#line` markers so that
    /// diagnostics name the real file and line.
    pub fn full_source(self) -> String {
        self.with_headers(self.source())
    }

    fn with_headers(self, body: &str) -> String {
        format!(
            "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{body}",
            self.file_name(),
        )
    }
}

/// The part of a module compiled at once. A fresh machine compiles only what a program uses:
/// a kernel of dtype `float` needs only the `float` instances of its file (a quarter of
/// `reduce.cu`'s compile time), so each module compiles per dtype on first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// The instances naming this dtype (one of [`DTYPE_TOKENS`]), and those naming none.
    Dtype(&'static str),
    /// The whole file.
    All,
}

/// The dtype names our kernel files and kernel names use.
pub const DTYPE_TOKENS: [&str; 11] = [
    "float", "double", "i64", "u8", "u16", "u32", "u64", "f32", "f64", "f16", "bf16",
];

impl Group {
    /// The group of the kernel spelled by `parts` (`["reduce", "max", "float", "row"]`): that of
    /// its first dtype part, or the whole file.
    pub fn of(parts: &[&'static str]) -> Group {
        parts
            .iter()
            .find_map(|p| DTYPE_TOKENS.iter().find(|t| *t == p))
            .map_or(Group::All, |t| Group::Dtype(t))
    }
}

impl Module {
    /// The groups a program may compile of this file: each dtype its instance lines name, or
    /// the whole file when they name none. Together they instantiate every kernel of the file
    /// (check-kernels compiles each to prove it compiles alone).
    pub fn groups(self) -> Vec<Group> {
        let named: Vec<Group> = DTYPE_TOKENS
            .iter()
            .filter(|t| {
                self.source()
                    .lines()
                    .filter(|l| is_instance(l))
                    .any(|l| words(l).any(|w| w == **t))
            })
            .map(|t| Group::Dtype(t))
            .collect();
        if named.is_empty() {
            vec![Group::All]
        } else {
            named
        }
    }
}

/// Whether `line` instantiates kernels: a top-level macro call such as `REDUCE_ALL(float)`
/// (not a definition, not inside one).
fn is_instance(line: &str) -> bool {
    let t = line.trim_end();
    t.starts_with(|c: char| c.is_ascii_uppercase()) && t.ends_with(')') && t.contains('(')
}

fn words(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each instance line of a kernel file names one dtype at most, so that a dtype's group
    /// compiles its own instances only (`ROWS(f16, float)` would put the 16-bit kernels in the
    /// `float` group, and a fresh machine would compile them for every f32 program).
    #[test]
    fn instance_lines_name_one_dtype() {
        for m in Module::ALL {
            for line in m.source().lines().filter(|l| is_instance(l)) {
                let mut named: Vec<&str> =
                    words(line).filter(|w| DTYPE_TOKENS.contains(w)).collect();
                named.dedup();
                assert!(
                    named.len() <= 1,
                    "{}: `{line}` names {named:?}",
                    m.file_name()
                );
            }
        }
    }

    /// The 16-bit groups hold the 16-bit instances, and the f32 group none of them.
    #[test]
    fn sixteen_bit_kernels_compile_only_for_their_dtype() {
        let float = Module::Softmax.group_source(Group::Dtype("float"));
        assert!(!float.contains("\nROWS_HALF(f16)"), "{float}");
        let half = Module::Softmax.group_source(Group::Dtype("f16"));
        assert!(half.contains("\nROWS_HALF(f16)"));
        assert!(!half.contains("\nROWS_SAME(float)"));
        assert!(Module::Reduce.groups().contains(&Group::Dtype("bf16")));
        assert!(Module::Rand.groups().contains(&Group::Dtype("f16")));
        assert!(Module::Index.groups().contains(&Group::Dtype("u16")));
    }
}
