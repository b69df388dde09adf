//! Our hand-written kernel files (`kernels/*.cu`) as NVRTC compiles them: which files there
//! are ([`Module`]), the part of a file compiled at once ([`Group`]: its instances of one
//! dtype), the exact text of each group, and NVRTC's options.
//!
//! # Why a module of its own, with no imports
//!
//! The run time compiles these texts on first use (`nvrtc.rs`), and `build.rs` compiles the
//! very same texts ahead of time into the CUBINs kiln ships in its binary (`prebuilt.rs`). So
//! that both compile byte-for-byte the same source with the same options, `build.rs` includes
//! this file as a module of its own (`#[path]`): it may use `std` only — nothing of the crate,
//! of kiln-core or of any dependency.

/// The header prepended to every kernel source (types, `Dims`/`Strides`, block reductions).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// NVRTC options for users' kernels on compute capability `arch` (e.g. 90). No fast-math:
/// results match the CPU backend to the usual float tolerances, and the random kernels use
/// explicit `_rn` intrinsics where bit-exactness matters.
pub fn user_options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".to_string(),
    ]
}

/// NVRTC options for kiln's own kernels (these files and the generated programs) on `arch`
/// with NVRTC `nvrtc`: [`user_options`], plus `--minimal` from NVRTC 12.4 on. It leaves out
/// declarations our kernels never use (textures, surfaces, device-side launch, the runtime
/// API's types): measured with NVRTC 13.0, ~15-20 % less CPU time for a small generated
/// program, and byte-identical CUBINs for every file here. (Users' kernels may use what it
/// leaves out, so they keep [`user_options`].)
pub fn options(arch: u32, nvrtc: (i32, i32)) -> Vec<String> {
    let mut o = user_options(arch);
    if nvrtc >= (12, 4) {
        o.push("--minimal".to_string());
    }
    o
}

/// The option that keeps NVRTC from contracting a multiply and an add into one fused
/// multiply-add: the generated elementwise programs and the interpreter take it (see
/// [`Module::options`]).
pub const NO_FMAD: &str = "--fmad=false";

/// A stable 64-bit FNV-1a of `source` and `module`'s options for `arch` and NVRTC `nvrtc`:
/// what a prebuilt CUBIN was built from, checked again at run time before it is used (a stale
/// table is never loaded).
pub fn source_hash(module: Module, source: &str, arch: u32, nvrtc: (i32, i32)) -> u64 {
    let opts = module.options(arch, nvrtc).join(" ");
    [source.as_bytes(), b"\0", opts.as_bytes()]
        .iter()
        .flat_map(|b| b.iter())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

impl Group {
    /// The group's name in diagnostics and in the prebuilt table: its dtype token, or `*`.
    pub fn label(self) -> &'static str {
        match self {
            Group::Dtype(t) => t,
            Group::All => "*",
        }
    }
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
    AttentionTc,
    Amp,
    Norm,
    Interp,
}

impl Module {
    pub const ALL: [Module; 11] = [
        Module::Copy,
        Module::Rand,
        Module::Reduce,
        Module::Softmax,
        Module::Index,
        Module::Util,
        Module::Attention,
        Module::AttentionTc,
        Module::Amp,
        Module::Norm,
        Module::Interp,
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
            Module::AttentionTc => "attention_tc.cu",
            Module::Amp => "amp.cu",
            Module::Norm => "norm.cu",
            Module::Interp => "interp.cu",
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
            Module::AttentionTc => include_str!("../kernels/attention_tc.cu"),
            Module::Amp => include_str!("../kernels/amp.cu"),
            Module::Norm => include_str!("../kernels/norm.cu"),
            // The scalar functions every generated program gets, as text `build.rs` can see
            // (`sources::interp_ops` writes the checked-in part), then the interpreter.
            Module::Interp => concat!(
                "#line 1 \"scalar_ops.cuh\"\n",
                include_str!("../kernels/scalar_ops.cuh"),
                "\n#line 1 \"interp_ops.cuh\"\n",
                include_str!("../kernels/interp_ops.cuh"),
                "\n#line 1 \"interp.cu\"\n",
                include_str!("../kernels/interp.cu"),
            ),
        }
    }

    /// NVRTC's options for this file on `arch` with NVRTC `nvrtc`: [`options`], and for the
    /// interpreter `--fmad=false`, as for the generated programs it stands in for (a multiply
    /// and an add contracted into one rounding in one of them but not in the other would make
    /// an interpreted run differ from a compiled one).
    pub fn options(self, arch: u32, nvrtc: (i32, i32)) -> Vec<String> {
        let mut o = options(arch, nvrtc);
        if self == Module::Interp {
            o.push(NO_FMAD.to_string());
        }
        o
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
    /// The instances naming this dtype (one of `DTYPE_TOKENS`), and those naming none.
    Dtype(&'static str),
    /// The whole file.
    All,
}

/// The dtype names our kernel files and kernel names use, and the tags of variants compiled
/// apart from their dtype's group: attention's instances that read a boolean mask
/// (`float_keep` ...; most programs never pass one, and where the groups are not prebuilt, they
/// would add their compile time to every program that runs attention).
pub const DTYPE_TOKENS: [&str; 14] = [
    "float",
    "double",
    "i64",
    "u8",
    "u16",
    "u32",
    "u64",
    "f32",
    "f64",
    "f16",
    "bf16",
    "float_keep",
    "f16_keep",
    "bf16_keep",
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
        assert_eq!(
            Module::AttentionTc.groups(),
            [
                Group::Dtype("float"),
                Group::Dtype("f16"),
                Group::Dtype("bf16"),
                Group::Dtype("float_keep"),
                Group::Dtype("f16_keep"),
                Group::Dtype("bf16_keep"),
            ]
        );
        // A mask's instances are not in the dtype's group, nor the other way round.
        let bf16 = Module::AttentionTc.group_source(Group::Dtype("bf16"));
        assert!(!bf16.contains("\nATTN_TC_KEEP("), "{bf16}");
        let keep = Module::AttentionTc.group_source(Group::Dtype("bf16_keep"));
        assert!(keep.contains("\nATTN_TC_KEEP(tc, TcHalf<KILN_TC_S_bf16_keep>, bf16_keep)"));
        assert!(!keep.contains("\nATTN_TC(tc, TcHalf<bf16>, bf16)"));
    }

    /// The two attention files describe the problem identically: the text between their
    /// `BEGIN same` / `END same` markers (the shape struct, the mask and the dropout mask, on
    /// which "the tensor-core kernels equal the FMA ones up to rounding" rests) is equal.
    #[test]
    fn attention_files_share_the_problem_verbatim() {
        let blocks = |m: Module| -> Vec<String> {
            m.source()
                .split("// ---- BEGIN same in attention.cu and attention_tc.cu ----")
                .skip(1)
                .map(|b| b.split("// ---- END same ----").next().unwrap().to_string())
                .collect()
        };
        let fma = blocks(Module::Attention);
        assert_eq!(fma.len(), 2);
        assert_eq!(fma, blocks(Module::AttentionTc));
    }
}
