//! The CUDA C of user kernels: a parameter list, the user's snippets and one call's argument
//! kinds in, source out. Pure (no device), so it is unit-tested and compiled by `cargo xtask
//! check-kernels` on machines with no GPU.
//!
//! Conventions of the generated code (what a user's snippets may name):
//! - each placeholder is a `typedef` (`typedef float T;`), so the snippets use it as a type;
//! - in an elementwise body, an input parameter is a `const` value of its element, an output
//!   parameter a reference to its element, a `raw` parameter the tensor's pointer, a scalar
//!   parameter its value; `i` is the element's index and `n` the element count;
//! - in a reduction, the map expression sees the inputs like the elementwise body; the reduce
//!   expression combines `a` and `b` (both of the accumulator type); the post-map statement sees
//!   the accumulated value as `a`, and the outputs as references;
//! - names starting with `_k` belong to the generator.

use std::fmt::Write as _;

use super::params::{CType, Param, Resolved, concrete};
use crate::codegen::Access;
use crate::sources::COMMON;

/// How one parameter is passed in one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// A tensor read or written per element, addressed as given.
    Tensor(Access),
    /// A tensor's pointer (`raw`), indexed by the user's code.
    Raw,
    /// A scalar value.
    Scalar,
}

/// What the elementwise and reduction generators share: the kernel's name and parameters.
pub struct Spec<'a> {
    pub name: &'a str,
    pub inputs: &'a [Param],
    pub outputs: &'a [Param],
    pub preamble: &'a str,
}

impl Spec<'_> {
    fn params(&self) -> impl Iterator<Item = (&Param, bool)> {
        self.inputs
            .iter()
            .map(|p| (p, true))
            .chain(self.outputs.iter().map(|p| (p, false)))
    }
}

/// Common header, placeholder typedefs, index type and preamble.
fn head(s: &mut String, spec: &Spec, r: &Resolved, wide: bool) {
    let _ = writeln!(s, "#line 1 \"common.cuh\"\n{COMMON}");
    let _ = writeln!(
        s,
        "#line 1 \"{}.cu\"\n__device__ __forceinline__ int shfl_xor(int v, int o) {{ return \
         __shfl_xor_sync(0xffffffffu, v, o); }}",
        spec.name
    );
    for (t, c) in r {
        let _ = writeln!(s, "typedef {} {t};", c.c_name());
    }
    let _ = writeln!(s, "typedef {} _KI;", if wide { "u64" } else { "u32" });
    if !spec.preamble.trim().is_empty() {
        let _ = writeln!(s, "#line 1 \"{}: preamble\"\n{}", spec.name, spec.preamble);
    }
}

/// Emits `_K<var>_<name> = offset of index `idx` through `dims` and each operand's `strides`
/// argument `<sp>_<name>` for `names` (one set of divisions for all of them).
fn offsets(s: &mut String, ind: &str, idx: &str, dims: &str, sp: &str, var: &str, names: &[&str]) {
    for n in names {
        let _ = writeln!(s, "{ind}_KI {var}_{n} = 0;");
    }
    if names.is_empty() {
        return;
    }
    let _ = writeln!(s, "{ind}{{\n{ind}    _KI _kq = (_KI)({idx});");
    let _ = writeln!(
        s,
        "#pragma unroll\n{ind}    for (int _kk = KILN_MAX_DIMS - 1; _kk >= 0; --_kk) {{"
    );
    let _ = writeln!(s, "{ind}        if (_kk < {dims}.rank) {{");
    let _ = writeln!(s, "{ind}            _KI _kdk = (_KI){dims}.d[_kk];");
    let _ = writeln!(s, "{ind}            _KI _knq = _kq / _kdk;");
    let _ = writeln!(s, "{ind}            _KI _kr = _kq - _knq * _kdk;");
    for n in names {
        let _ = writeln!(
            s,
            "{ind}            {var}_{n} += _kr * (_KI){sp}_{n}.s[_kk];"
        );
    }
    let _ = writeln!(
        s,
        "{ind}            _kq = _knq;\n{ind}        }}\n{ind}    }}\n{ind}}}"
    );
}

/// The parameter declaration of `p` passed as `slot` (`input`: read-only).
fn declare(p: &Param, c: CType, slot: Slot, input: bool, out: &mut Vec<String>) {
    let cst = if input { "const " } else { "" };
    match slot {
        Slot::Tensor(_) => out.push(format!("{cst}{}* __restrict__ _kp_{}", c.c_name(), p.name)),
        Slot::Raw => out.push(format!("{cst}{}* {}", c.c_name(), p.name)),
        Slot::Scalar => out.push(format!("const {} {}", c.c_name(), p.name)),
    }
}

/// The source of an elementwise kernel (CuPy's `ElementwiseKernel`). `slots`: per parameter,
/// inputs then outputs. Kernel parameters, in order: `u64 n, Dims d`, then per parameter its
/// pointer (and `Strides` when strided) or its value.
pub fn elementwise(spec: &Spec, body: &str, r: &Resolved, slots: &[Slot], wide: bool) -> String {
    let mut s = String::new();
    head(&mut s, spec, r, wide);
    let mut decl = vec!["const u64 _kn".to_string(), "const Dims _kd".to_string()];
    for ((p, input), &slot) in spec.params().zip(slots) {
        declare(p, concrete(&p.ty, r), slot, input, &mut decl);
        if slot == Slot::Tensor(Access::Strided) {
            decl.push(format!("const Strides _ks_{}", p.name));
        }
    }
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void {}({}) {{",
        spec.name,
        decl.join(", ")
    );
    s += "    for (u64 _ki = KILN_TID; _ki < _kn; _ki += KILN_NTHREADS) {\n";
    s += "        const u64 i = _ki;\n        const u64 n = _kn;\n        (void)i; (void)n;\n";
    let strided: Vec<&str> = spec
        .params()
        .zip(slots)
        .filter(|(_, s)| **s == Slot::Tensor(Access::Strided))
        .map(|((p, _), _)| p.name.as_str())
        .collect();
    offsets(&mut s, "        ", "_ki", "_kd", "_ks", "_ko", &strided);
    for ((p, input), &slot) in spec.params().zip(slots) {
        let Slot::Tensor(a) = slot else { continue };
        let t = concrete(&p.ty, r).c_name();
        let at = match a {
            Access::Contig => "_ki".to_string(),
            Access::Bcast => "0".to_string(),
            Access::Strided => format!("_ko_{}", p.name),
        };
        if input {
            let _ = writeln!(s, "        const {t} {} = _kp_{}[{at}];", p.name, p.name);
        } else {
            let _ = writeln!(s, "        {t} &{} = _kp_{}[{at}];", p.name, p.name);
        }
    }
    let _ = writeln!(
        s,
        "        {{\n#line 1 \"{}: operation\"\n{body}\n;\n        }}\n    }}\n}}",
        spec.name
    );
    s
}

/// The snippets of a reduction (CuPy's `ReductionKernel`).
pub struct Reduction<'a> {
    pub map: &'a str,
    pub reduce: &'a str,
    pub post_map: &'a str,
    pub identity: &'a str,
    pub acc: CType,
}

/// The source of a reduction kernel: one block per kept element (grid-stride over kept
/// elements), each thread folds every `blockDim.x`-th reduced element, a shared-memory tree
/// (`block_reduce` of common.cuh) combines the block's partials, and thread 0 runs the
/// post-map. `slots`: per parameter, inputs then outputs (outputs are always tensors in the
/// kept shape; their slot's access is ignored). Kernel parameters, in order: `u64 n_kept,
/// u64 n_red, Dims kept_dims, Dims red_dims`, then per parameter: a tensor's pointer, its
/// kept-axes `Strides` and (inputs, when strided along the reduced axes) its reduced-axes
/// `Strides`; a raw pointer; a scalar's value.
///
/// `split` (few kept elements, long reductions; the expression generator's split strategy),
/// 0 when not split, else 1 or 4: three more parameters, `u64 parts, u32 phase, Acc* part`.
/// With `phase == 0` a block folds part `b % parts` of kept element `b / parts` into
/// `part[b]`, each thread taking groups of 4 consecutive elements (one 16-byte load per
/// contiguous input when `split == 4`; the same order either way); with `phase == 1` a block
/// per kept element folds its parts' accumulators with the reduce expression and runs the
/// post-map.
pub fn reduction(
    spec: &Spec,
    red: &Reduction,
    r: &Resolved,
    slots: &[Slot],
    wide: bool,
    split: u32,
) -> String {
    let mut s = String::new();
    head(&mut s, spec, r, wide);
    reduce_struct(&mut s, spec.name, red);
    reduction_signature(&mut s, spec, r, slots, split);
    s += "    __shared__ _KRed::Acc _kscratch[32];\n";
    open_kept_loop(&mut s, spec, red, r, slots, split);
    fold(&mut s, spec, red, r, slots, split);
    if split > 0 {
        s += "        _kacc = block_reduce<_KRed>(_kacc, _kscratch);\n";
        s += "        if (threadIdx.x == 0) _kpart[_kb0] = _kacc;\n    }\n";
    } else {
        post_map(&mut s, spec, red, r);
    }
    s += "}\n";
    s
}

/// The `_KRed` struct: the accumulator type, the identity and the reduce expression.
fn reduce_struct(s: &mut String, name: &str, red: &Reduction) {
    let acc = red.acc.c_name();
    let _ = writeln!(
        s,
        "struct _KRed {{\n    typedef {acc} Acc;\n    \
         static __device__ __forceinline__ Acc init() {{\n#line 1 \"{name}: identity\"\n\
         return (Acc)({});\n    }}\n    \
         static __device__ __forceinline__ Acc combine(const Acc a, const Acc b) {{\n\
         #line 1 \"{name}: reduce expression\"\nreturn (Acc)({});\n    }}\n    \
         static __device__ __forceinline__ Acc shfl(Acc a, int o) {{ return shfl_xor(a, o); }}\n}};",
        red.identity, red.reduce
    );
}

/// The reduction kernel's signature (parameters as [`reduction`] lists them) and opening brace.
fn reduction_signature(s: &mut String, spec: &Spec, r: &Resolved, slots: &[Slot], split: u32) {
    let mut decl: Vec<String> = [
        "const u64 _knk",
        "const u64 _knr",
        "const Dims _kkd",
        "const Dims _krd",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    for ((p, input), &slot) in spec.params().zip(slots) {
        declare(p, concrete(&p.ty, r), slot, input, &mut decl);
        if let Slot::Tensor(a) = slot {
            decl.push(format!("const Strides _kks_{}", p.name));
            if input && a == Access::Strided {
                decl.push(format!("const Strides _krs_{}", p.name));
            }
        }
    }
    if split > 0 {
        decl.push("const u64 _kparts".into());
        decl.push("const u32 _kphase".into());
        decl.push("_KRed::Acc* __restrict__ _kpart".into());
    }
    let name = spec.name;
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void {name}({}) {{",
        decl.join(", ")
    );
}

/// Opens the loop over kept elements (for a split: the whole of phase 1, then phase 0's loop
/// over (kept element, part) pairs and the part's range), then the kept bases and the
/// accumulator.
fn open_kept_loop(
    s: &mut String,
    spec: &Spec,
    red: &Reduction,
    r: &Resolved,
    slots: &[Slot],
    split: u32,
) {
    let tensors: Vec<&str> = spec
        .params()
        .zip(slots)
        .filter(|(_, s)| matches!(s, Slot::Tensor(_)))
        .map(|((p, _), _)| p.name.as_str())
        .collect();
    if split > 0 {
        // Phase 1: the parts' accumulators of each kept element, folded, then the post-map.
        *s += "    if (_kphase == 1) {\n";
        *s += "    for (u64 _kko = blockIdx.x; _kko < _knk; _kko += gridDim.x) {\n";
        offsets(s, "        ", "_kko", "_kkd", "_kks", "_kb", &tensors);
        *s += "        _KRed::Acc _kacc = _KRed::init();\n";
        *s += "        for (u64 _kq = threadIdx.x; _kq < _kparts; _kq += blockDim.x)\n";
        *s += "            _kacc = _KRed::combine(_kacc, _kpart[_kko * _kparts + _kq]);\n";
        post_map(s, spec, red, r);
        *s += "    return;\n    }\n";
        // Phase 0: block `_kb0` folds part `_kb0 % parts` of kept element `_kb0 / parts`.
        *s += "    for (u64 _kb0 = blockIdx.x; _kb0 < _knk * _kparts; _kb0 += gridDim.x) {\n";
        *s += "        const u64 _kko = _kb0 / _kparts, _kpi = _kb0 - _kko * _kparts;\n";
        *s += "        const u64 _kchunk = ((_knr + _kparts - 1) / _kparts + 3) / 4 * 4;\n";
        *s += "        const u64 _kr0 = _kpi * _kchunk;\n";
        *s += "        const u64 _kr1 = _kr0 + _kchunk < _knr ? _kr0 + _kchunk : _knr;\n";
    } else {
        *s += "    for (u64 _kko = blockIdx.x; _kko < _knk; _kko += gridDim.x) {\n";
    }
    offsets(s, "        ", "_kko", "_kkd", "_kks", "_kb", &tensors);
    *s += "        _KRed::Acc _kacc = _KRed::init();\n";
}

/// The fold of one kept element's reduced elements (of one part, for a split) into `_kacc`.
fn fold(s: &mut String, spec: &Spec, red: &Reduction, r: &Resolved, slots: &[Slot], split: u32) {
    let name = spec.name;
    let ins = || spec.inputs.iter().zip(slots);
    let strided: Vec<&str> = ins()
        .filter(|(_, s)| **s == Slot::Tensor(Access::Strided))
        .map(|(p, _)| p.name.as_str())
        .collect();
    // The fold's body for reduced index `_kri`; `read(name, access, type)` reads an input.
    let body = |s: &mut String, ind: &str, read: &dyn Fn(&str, Access) -> String| {
        offsets(s, ind, "_kri", "_krd", "_krs", "_ko", &strided);
        for (p, &slot) in ins() {
            let Slot::Tensor(a) = slot else { continue };
            let t = concrete(&p.ty, r).c_name();
            let _ = writeln!(s, "{ind}const {t} {} = {};", p.name, read(&p.name, a));
        }
        let _ = writeln!(
            s,
            "{ind}const _KRed::Acc _kv = (_KRed::Acc)(\n#line 1 \"{name}: map expression\"\n{}\n);",
            red.map
        );
        let _ = writeln!(s, "{ind}_kacc = _KRed::combine(_kacc, _kv);");
    };
    let scalar = |n: &str, a: Access| match a {
        Access::Contig => format!("_kp_{n}[_kb_{n} + (_KI)_kri]"),
        Access::Bcast => format!("_kp_{n}[_kb_{n}]"),
        Access::Strided => format!("_kp_{n}[_kb_{n} + _ko_{n}]"),
    };
    if split > 0 {
        // Groups of 4 consecutive elements per thread, lane by lane (as the expression
        // generator's split fold), read as one 16-byte vector each when `split == 4`.
        *s +=
            "        for (u64 _kg = _kr0 / 4 + threadIdx.x; _kg * 4 < _kr1; _kg += blockDim.x) {\n";
        if split == 4 {
            *s += "            if (_kg * 4 + 4 <= _kr1) {\n";
            for (p, &slot) in ins() {
                if slot == Slot::Tensor(Access::Contig) {
                    let t = concrete(&p.ty, r).c_name();
                    let n = &p.name;
                    let _ = writeln!(
                        s,
                        "                const Vec<{t}, 4> _kw_{n} = ((const Vec<{t}, 4>*)(_kp_{n} + _kb_{n}))[_kg];"
                    );
                }
            }
            *s += "#pragma unroll\n                for (int _kl = 0; _kl < 4; ++_kl) {\n";
            *s += "                    const u64 _kri = _kg * 4 + _kl;\n";
            let lanes = |n: &str, a: Access| match a {
                Access::Contig => format!("_kw_{n}.v[_kl]"),
                a => scalar(n, a),
            };
            body(s, "                    ", &lanes);
            *s += "                }\n                continue;\n            }\n";
        }
        *s += "            for (int _kl = 0; _kl < 4; ++_kl) {\n";
        *s += "                const u64 _kri = _kg * 4 + _kl;\n";
        *s += "                if (_kri >= _kr1) break;\n";
        body(s, "                ", &scalar);
        *s += "            }\n        }\n";
    } else {
        *s += "        for (u64 _kri = threadIdx.x; _kri < _knr; _kri += blockDim.x) {\n";
        body(s, "            ", &scalar);
        *s += "        }\n";
    }
}

/// The end of a kept element's block: the tree of the threads' accumulators, then thread 0
/// binds the outputs, runs the post-map (the result as `a`), and closes the kept loop.
fn post_map(s: &mut String, spec: &Spec, red: &Reduction, r: &Resolved) {
    let name = spec.name;
    *s += "        _kacc = block_reduce<_KRed>(_kacc, _kscratch);\n";
    *s += "        if (threadIdx.x == 0) {\n            const _KRed::Acc a = _kacc;\n";
    for p in spec.outputs {
        let t = concrete(&p.ty, r).c_name();
        let _ = writeln!(
            s,
            "            {t} &{} = _kp_{}[_kb_{}];",
            p.name, p.name, p.name
        );
    }
    let _ = writeln!(
        s,
        "            {{\n#line 1 \"{name}: post-map\"\n{}\n;\n            }}\n        }}\n    }}",
        red.post_map
    );
}

/// Sample kernels of both generators over every slot kind and both index widths: what `cargo
/// xtask check-kernels` compiles (no GPU needed).
pub fn sample_sources() -> Vec<(String, String)> {
    use super::params::parse_params;
    let mut out = Vec::new();
    let ins = parse_params("sample", "T x, T y, raw T z, float32 alpha, int k").unwrap();
    let outs = parse_params("sample", "T w, int64 idx").unwrap();
    for (t, wide) in [(CType::F32, false), (CType::F64, true), (CType::I64, false)] {
        let r: Resolved = vec![("T".into(), t)];
        let spec = Spec {
            name: "user_sample",
            inputs: &ins,
            outputs: &outs,
            preamble: "template <typename X> __device__ X twice(X v) { return v + v; }",
        };
        let slots = [
            Slot::Tensor(Access::Contig),
            Slot::Tensor(Access::Strided),
            Slot::Raw,
            Slot::Scalar,
            Slot::Scalar,
            Slot::Tensor(Access::Strided),
            Slot::Tensor(Access::Contig),
        ];
        let body = "w = twice(x) * (T)alpha + y - z[i % n]; idx = (i64)i + k";
        out.push((
            format!("user elementwise ({}, wide {wide})", t.c_name()),
            elementwise(&spec, body, &r, &slots, wide),
        ));
        let red = Reduction {
            map: "x * y + (T)alpha",
            reduce: "a + b",
            post_map: "w = (T)a; idx = (i64)k",
            identity: "0",
            acc: if t == CType::F32 { CType::F64 } else { t },
        };
        let rslots = [
            Slot::Tensor(Access::Contig),
            Slot::Tensor(Access::Strided),
            Slot::Raw,
            Slot::Scalar,
            Slot::Scalar,
            Slot::Tensor(Access::Contig),
            Slot::Tensor(Access::Contig),
        ];
        out.push((
            format!("user reduction ({}, wide {wide})", t.c_name()),
            reduction(&spec, &red, &r, &rslots, wide, 0),
        ));
        out.push((
            format!("user reduction, split ({}, wide {wide})", t.c_name()),
            reduction(&spec, &red, &r, &rslots, wide, 1),
        ));
        if t == CType::F32 {
            out.push((
                format!("user reduction, split, 16-byte loads (wide {wide})"),
                reduction(&spec, &red, &r, &rslots, wide, 4),
            ));
        }
        let rslots2 = [
            Slot::Tensor(Access::Bcast),
            Slot::Tensor(Access::Contig),
            Slot::Raw,
            Slot::Scalar,
            Slot::Scalar,
            Slot::Tensor(Access::Strided),
            Slot::Tensor(Access::Contig),
        ];
        out.push((
            format!(
                "user reduction, broadcast input ({}, wide {wide})",
                t.c_name()
            ),
            reduction(&spec, &red, &r, &rslots2, wide, 0),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::params::parse_params;
    use super::*;

    fn at(src: &str, needle: &str) -> usize {
        src.find(needle)
            .unwrap_or_else(|| panic!("`{needle}` missing in:\n{src}"))
    }

    #[test]
    fn elementwise_binds_inputs_by_value_and_outputs_by_reference() {
        let ins = parse_params("k", "T x, T y, float32 s").unwrap();
        let outs = parse_params("k", "T z").unwrap();
        let spec = Spec {
            name: "sqdiff",
            inputs: &ins,
            outputs: &outs,
            preamble: "",
        };
        let r: Resolved = vec![("T".into(), CType::F64)];
        let slots = [
            Slot::Tensor(Access::Contig),
            Slot::Tensor(Access::Strided),
            Slot::Scalar,
            Slot::Tensor(Access::Contig),
        ];
        let src = elementwise(&spec, "z = (x - y) * (x - y) * s", &r, &slots, false);
        assert!(src.contains("typedef double T;") && src.contains("typedef u32 _KI;"));
        let k = &src[at(&src, "extern \"C\" __global__ void sqdiff(")..];
        assert!(
            k.contains("const double* __restrict__ _kp_x") && k.contains("const Strides _ks_y")
        );
        assert!(k.contains("const float s") && k.contains("double* __restrict__ _kp_z"));
        assert!(!k.contains("_ks_x") && !k.contains("_ks_z"));
        assert!(at(k, "const double x = _kp_x[_ki];") < at(k, "z = (x - y)"));
        assert!(at(k, "const double y = _kp_y[_ko_y];") < at(k, "z = (x - y)"));
        assert!(k.contains("double &z = _kp_z[_ki];"));
        assert!(k.contains("#line 1 \"sqdiff: operation\""));
    }

    #[test]
    fn reduction_folds_then_thread_zero_post_maps() {
        let ins = parse_params("k", "T x").unwrap();
        let outs = parse_params("k", "T y").unwrap();
        let spec = Spec {
            name: "l2norm",
            inputs: &ins,
            outputs: &outs,
            preamble: "",
        };
        let r: Resolved = vec![("T".into(), CType::F32)];
        let red = Reduction {
            map: "x * x",
            reduce: "a + b",
            post_map: "y = sqrt(a)",
            identity: "0",
            acc: CType::F32,
        };
        let slots = [Slot::Tensor(Access::Contig), Slot::Tensor(Access::Contig)];
        let src = reduction(&spec, &red, &r, &slots, true, 0);
        assert!(src.contains("typedef u64 _KI;"));
        let k = &src[at(&src, "struct _KRed")..];
        assert!(at(k, "return (Acc)(0);") < at(k, "return (Acc)(a + b);"));
        assert!(at(k, "const float x = _kp_x[_kb_x + (_KI)_kri];") < at(k, "x * x"));
        assert!(at(k, "x * x") < at(k, "block_reduce<_KRed>"));
        assert!(at(k, "block_reduce<_KRed>") < at(k, "float &y = _kp_y[_kb_y];"));
        assert!(at(k, "float &y = _kp_y[_kb_y];") < at(k, "y = sqrt(a)"));
        assert!(!k.contains("_krs_x"));
        assert!(!k.contains("_kphase"));
        // Split: phase 1 folds the parts' accumulators and post-maps; phase 0 folds a part.
        let src = reduction(&spec, &red, &r, &slots, false, 1);
        let k = &src[at(&src, "extern \"C\"")..];
        assert!(
            k.contains("const u64 _kparts, const u32 _kphase, _KRed::Acc* __restrict__ _kpart")
        );
        let p1 = at(k, "if (_kphase == 1)");
        let parts = at(
            k,
            "_kacc = _KRed::combine(_kacc, _kpart[_kko * _kparts + _kq]);",
        );
        let post = at(k, "y = sqrt(a)");
        let ret = at(k, "return;");
        assert!(p1 < parts && parts < post && post < ret, "{k}");
        let fold = at(
            k,
            "for (u64 _kg = _kr0 / 4 + threadIdx.x; _kg * 4 < _kr1; _kg += blockDim.x)",
        );
        assert!(!k.contains("Vec<float, 4>"), "{k}");
        let store = at(k, "if (threadIdx.x == 0) _kpart[_kb0] = _kacc;");
        assert!(
            ret < fold && fold < at(k, "x * x") && at(k, "x * x") < store,
            "{k}"
        );
        assert_eq!(k.matches("y = sqrt(a)").count(), 1, "{k}");
        // with 16-byte loads: the vector read, then the same lanes, then the scalar tail
        let src = reduction(&spec, &red, &r, &slots, false, 4);
        let k = &src[at(&src, "extern \"C\"")..];
        let vec = at(k, "if (_kg * 4 + 4 <= _kr1)");
        let load = at(
            k,
            "const Vec<float, 4> _kw_x = ((const Vec<float, 4>*)(_kp_x + _kb_x))[_kg];",
        );
        let lane = at(k, "const float x = _kw_x.v[_kl];");
        let tail = at(k, "if (_kri >= _kr1) break;");
        assert!(vec < load && load < lane && lane < tail, "{k}");
    }

    /// The samples compile with NVRTC for sm_90 when libnvrtc is present.
    #[test]
    fn sample_sources_compile_with_nvrtc() {
        let samples = sample_sources();
        assert!(samples.len() >= 6);
        if !crate::nvrtc::nvrtc_available() {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        for (name, src) in samples {
            if let Err(log) =
                crate::nvrtc::compile_source(crate::nvrtc::Flavor::User, "user.cu", &src, 90)
            {
                panic!("{name} does not compile:\n{log}\n{src}");
            }
        }
    }
}
