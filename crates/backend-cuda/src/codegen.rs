//! The code generator of expression programs ([`kiln_core::expr`]): a [`Program`] and a
//! [`Variant`] in, CUDA C source out.
//!
//! # Why a module of its own
//!
//! Generating source needs no device: keeping it apart from the runtime (context, memory,
//! module cache) lets it be read, unit-tested and compiled with NVRTC on a machine with no GPU
//! (`cargo xtask check-kernels` compiles [`sample_sources`]). It imports kiln-core, the kernel
//! header texts of `sources.rs` and the pure layout helpers of `launch.rs`, nothing else.
//!
//! # The kernels
//!
//! The conventions are those of the single-op kernels and of `lazy.rs`: every op calls the
//! scalar device function the single-op kernel calls (`op_<name><T>`, `cast_to<F, T>` in
//! `kernels/scalar_ops.cuh`), so fused and unfused values agree bit for bit; one C variable per
//! value (`v<i>`, SSA, in instruction order); shapes and strides travel by value (`Dims`,
//! `Strides` of `kernels/common.cuh`) after the host has merged dimensions ([`plan`]); index
//! arithmetic in `I`, 32-bit when every index fits, else 64-bit ([`Variant::wide`]).
//!
//! - **Elementwise** (no reduction): a grid-stride loop, one element per thread and iteration;
//!   values that do not vary per element (constants, parameters) are computed once before it.
//! - **Reductions**, [`Strategy::Block`]: one block per kept element (grid-stride over kept
//!   elements); each thread folds every `blockDim.x`-th reduced element into one accumulator
//!   per `Reduce` (f32 sums and products accumulate in f64), a shared-memory tree
//!   (`block_reduce` of common.cuh) combines the partials, and thread 0 evaluates the post-map
//!   and stores the reduced outputs. Elementwise outputs of the same program are stored during
//!   the fold.
//! - **Reductions**, [`Strategy::Thread`]: one thread per kept element, folding its reduced
//!   elements in order: for short reductions, where a block per kept element would idle.
//! - **Reductions**, [`Strategy::Split`]: few kept elements and long reductions (a norm of a
//!   whole tensor): a block per kept element would leave the device idle (one block for a
//!   full reduction), so each kept element's reduced range is cut into [`Geometry::parts`]
//!   consecutive parts, a block folds one part into a partial accumulator per `Reduce` (launch
//!   with `phase == 0`), and a second launch of the same kernel (`phase == 1`, a block per
//!   kept element) folds the partials in a fixed order and runs the post-map. The parts depend on the
//!   sizes alone ([`split_parts`]), so a result is the same on every run and every device.
//!
//! How each operand (input, or an elementwise output of a reducing program) is addressed in
//! the inner loop is part of the variant ([`Access`]): contiguous with the loop index (no
//! arithmetic), the same element throughout (a broadcast), or strided (one set of divisions
//! shared by all strided operands). The program is the memo key; the variant a part of it.

use std::fmt::Write as _;

use kiln_core::expr::{Combine, Instr, Phase, Program};
use kiln_core::{DType, Error, Layout, Result, Shape};

use crate::launch::{MAX_DIMS, collapse_raw};
use crate::sources::{COMMON, SCALAR_OPS, ctype};

/// The generated kernel's name.
pub(crate) const KERNEL: &str = "expr";

/// How the inner loop of a kernel addresses one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Access {
    /// At the loop index itself (the pointer is offset on the host).
    Contig,
    /// One element for the whole loop (stride 0, or extent 1, along every looped axis).
    Bcast,
    /// Through strides (a `Strides` argument).
    Strided,
}

/// How a reducing program is spread over threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Strategy {
    /// No reduction: one thread per element.
    Elementwise,
    /// One block per kept element, a tree reduction in shared memory.
    Block,
    /// One thread per kept element.
    Thread,
    /// Several blocks per kept element, then a pass over their partials (see the module
    /// docs).
    Split,
}

/// What the source of a program's kernel depends on besides the program.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    /// 64-bit index arithmetic (some element count or storage extent reaches 2^31).
    pub wide: bool,
    pub strategy: Strategy,
    /// Per operand: the inputs in order, then (reducing programs only) the elementwise
    /// outputs in output order. Elementwise programs store their outputs at the loop index.
    pub access: Vec<Access>,
    /// Elementwise programs whose operands are all contiguous or broadcast, whose contiguous
    /// inputs and outputs share one element size and start 16-byte aligned: elements per
    /// 16-byte vector (the loop moves `vec` elements per load and store, then finishes the
    /// tail one by one). [`Strategy::Split`] reductions: 4 when every operand is contiguous
    /// or broadcast along the reduced axes and the contiguous inputs have 4-byte elements
    /// and 16-byte aligned rows (each thread then loads its groups of 4 as one vector). 0:
    /// element by element. Chosen at launch (it depends on addresses).
    pub vec: u32,
}

/// The accumulator's C type of a `combine` over `dtype` values: f32 sums and products in f64.
fn acc_type(c: Combine, dtype: DType) -> &'static str {
    match (c, dtype) {
        (Combine::Sum | Combine::Prod, DType::F32) => "double",
        _ => ctype(dtype),
    }
}

/// The accumulator dtype of each live `Reduce` of `p`, in instruction order: the partial
/// buffers a [`Strategy::Split`] launch takes (`part<i>` in the source), `n_kept * parts`
/// accumulators each.
pub(crate) fn split_partials(p: &Program) -> Vec<DType> {
    let nd = need(p);
    p.code()
        .iter()
        .enumerate()
        .filter_map(|(i, ins)| match *ins {
            Instr::Reduce(c, a) if nd.live[i] => Some(match acc_type(c, p.dtype(a)) {
                "double" => DType::F64,
                _ => p.dtype(a),
            }),
            _ => None,
        })
        .collect()
}

/// The reduction functors (the `Op` interface of `block_reduce` in common.cuh).
const PRELUDE: &str = r#"
template <typename A> struct ExprSum {
    typedef A Acc;
    static __device__ __forceinline__ A init() { return (A)0; }
    static __device__ __forceinline__ A combine(A a, A b) { return op_add<A>(a, b); }
    static __device__ __forceinline__ A shfl(A a, int o) { return shfl_xor(a, o); }
};
template <typename A> struct ExprProd {
    typedef A Acc;
    static __device__ __forceinline__ A init() { return (A)1; }
    static __device__ __forceinline__ A combine(A a, A b) { return op_mul<A>(a, b); }
    static __device__ __forceinline__ A shfl(A a, int o) { return shfl_xor(a, o); }
};
template <typename A> struct ExprMax {
    typedef A Acc;
    static __device__ __forceinline__ A init() { return lowest<A>(); }
    static __device__ __forceinline__ A combine(A a, A b) { return op_maximum<A>(a, b); }
    static __device__ __forceinline__ A shfl(A a, int o) { return shfl_xor(a, o); }
};
template <typename A> struct ExprMin {
    typedef A Acc;
    static __device__ __forceinline__ A init() { return highest<A>(); }
    static __device__ __forceinline__ A combine(A a, A b) { return op_minimum<A>(a, b); }
    static __device__ __forceinline__ A shfl(A a, int o) { return shfl_xor(a, o); }
};
"#;

fn functor(c: Combine) -> &'static str {
    match c {
        Combine::Sum => "ExprSum",
        Combine::Prod => "ExprProd",
        Combine::Max => "ExprMax",
        Combine::Min => "ExprMin",
    }
}

/// An exact C expression for constant `c`.
fn literal(c: kiln_core::expr::Scalar) -> String {
    match c.dtype() {
        DType::F32 => {
            let v = c.to_f64() as f32;
            format!("__int_as_float((int)0x{:08x}u) /* {v:?} */", v.to_bits())
        }
        DType::F64 => format!(
            "__longlong_as_double((long long)0x{:016x}ull) /* {:?} */",
            c.bits(),
            c.to_f64()
        ),
        DType::I64 => format!("((i64)0x{:016x}ull)", c.bits()),
        DType::U8 => format!("((u8){})", c.bits() as u8),
        d => format!("unsupported /* {d} */"),
    }
}

/// The C expression of instruction `ins` (not an input nor a reduction).
fn expr(p: &Program, ins: &Instr) -> String {
    let t = |v: u32| ctype(p.dtype(v));
    match *ins {
        Instr::Param(k) => format!("p{k}"),
        Instr::Const(c) => literal(c),
        Instr::Unary(u, a) => format!("op_{}<{}>(v{a})", u.name(), t(a)),
        Instr::Binary(b, x, y) => format!("op_{}<{}>(v{x}, v{y})", b.name(), t(x)),
        Instr::Cmp(c, x, y) => format!("op_{}<{}>(v{x}, v{y})", c.name(), t(x)),
        Instr::Where(c, x, y) => format!("(v{c} ? v{x} : v{y})"),
        Instr::Cast(to, a) => format!("cast_to<{}, {}>(v{a})", t(a), ctype(to)),
        Instr::Input(_) | Instr::Reduce(..) => unreachable!("placed by the caller"),
    }
}

/// Which values each part of the kernel computes.
struct Need {
    /// Read by anything emitted (uniform values are computed once, at the top).
    live: Vec<bool>,
    /// Per element of the iteration (the elementwise loop, or the fold).
    elem: Vec<bool>,
    /// Per kept element, after the fold (reducing programs).
    post: Vec<bool>,
}

fn need(p: &Program) -> Need {
    let n = p.code().len();
    let mut elem = vec![false; n];
    let mut post = vec![false; n];
    for (j, &o) in p.outputs().iter().enumerate() {
        if p.output_is_reduced(j) {
            post[o as usize] = true;
        } else {
            elem[o as usize] = true;
        }
    }
    for i in (0..n).rev() {
        let ins = &p.code()[i];
        if post[i] {
            match *ins {
                Instr::Reduce(_, a) => elem[a as usize] = true,
                _ => {
                    for a in ins.operands() {
                        post[a as usize] = true;
                    }
                }
            }
        }
        if elem[i] {
            for a in ins.operands() {
                elem[a as usize] = true;
            }
        }
    }
    let live = (0..n).map(|i| elem[i] || post[i]).collect();
    for i in 0..n {
        if p.phase(i as u32) == Phase::Uniform {
            elem[i] = false;
            post[i] = false;
        }
    }
    Need { live, elem, post }
}

/// Emits the offsets `<var><m> = <base> + offset of index `idx` through `dims`/`strides<m>`
/// for the operands `ms` (one set of divisions for all of them).
#[allow(clippy::too_many_arguments)] // each names one piece of generated text
fn emit_offsets(
    s: &mut String,
    ind: &str,
    idx: &str,
    dims: &str,
    strides: &str,
    var: &str,
    base: &dyn Fn(usize) -> String,
    ms: &[usize],
) {
    for &m in ms {
        let _ = writeln!(s, "{ind}I {var}{m} = {};", base(m));
    }
    if ms.is_empty() {
        return;
    }
    let _ = writeln!(s, "{ind}{{");
    let _ = writeln!(s, "{ind}    I q = (I){idx};");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "{ind}    for (int k = KILN_MAX_DIMS - 1; k >= 0; --k) {{"
    );
    let _ = writeln!(s, "{ind}        if (k < {dims}.rank) {{");
    let _ = writeln!(s, "{ind}            I dk = (I){dims}.d[k];");
    let _ = writeln!(s, "{ind}            I nq = q / dk;");
    let _ = writeln!(s, "{ind}            I r_ = q - nq * dk;");
    for &m in ms {
        let _ = writeln!(s, "{ind}            {var}{m} += r_ * (I){strides}{m}.s[k];");
    }
    let _ = writeln!(s, "{ind}            q = nq;");
    let _ = writeln!(s, "{ind}        }}");
    let _ = writeln!(s, "{ind}    }}");
    let _ = writeln!(s, "{ind}}}");
}

/// Emits the instructions flagged in `which` (inputs loaded at `off<k>`); `acc`: a `Reduce`
/// reads its finished accumulator `acc<i>`.
fn emit_values(s: &mut String, ind: &str, p: &Program, which: &[bool], off: &str) {
    emit_values_with(s, ind, p, which, &|k| format!("x{k}[{off}{k}]"));
}

/// [`emit_values`] with input `k` read as `input(k)`.
fn emit_values_with(
    s: &mut String,
    ind: &str,
    p: &Program,
    which: &[bool],
    input: &dyn Fn(u32) -> String,
) {
    for (i, ins) in p.code().iter().enumerate() {
        if !which[i] {
            continue;
        }
        let t = ctype(p.dtype(i as u32));
        let e = match *ins {
            Instr::Input(k) => input(k),
            Instr::Reduce(c, a) => {
                let at = acc_type(c, p.dtype(a));
                if at == t {
                    format!("acc{i}")
                } else {
                    format!("cast_to<{at}, {t}>(acc{i})")
                }
            }
            _ => expr(p, ins),
        };
        let _ = writeln!(s, "{ind}const {t} v{i} = {e};");
    }
}

/// The operands' count: inputs, then (reducing programs) elementwise outputs.
fn elem_outputs(p: &Program) -> Vec<usize> {
    (0..p.outputs().len())
        .filter(|&j| !p.output_is_reduced(j))
        .collect()
}

/// The CUDA C source of `p` in `variant` (see the module docs). The kernel is [`KERNEL`]; its
/// parameters, in order:
/// - elementwise: `u64 n, Dims d`, the outputs `T* y<j>`, per input `const T* x<k>` and, when
///   strided, `Strides s<k>`, then the parameters `T p<k>`;
/// - reducing: `u64 n_kept, u64 n_red, Dims kd, Dims rd`, the outputs `T* y<j>` (reduced ones
///   contiguous in the kept shape), per input `const T* x<k>`, then per operand (inputs, then
///   elementwise outputs) `Strides ks<m>` and, when strided, `Strides rs<m>`, then the
///   parameters.
///
/// Pointers arrive offset to the operand's first element; the `offset` field of the strides is
/// not read.
pub(crate) fn source(p: &Program, v: &Variant) -> Result<String> {
    let n_in = p.inputs().len();
    let eouts = elem_outputs(p);
    let n_ops = if p.reduces() {
        n_in + eouts.len()
    } else {
        n_in
    };
    if v.access.len() != n_ops {
        return Err(Error::invalid(
            "expr codegen",
            format!(
                "{} operand access modes for a program of {n_ops} operands",
                v.access.len()
            ),
        ));
    }
    if p.reduces() == (v.strategy == Strategy::Elementwise) {
        return Err(Error::invalid(
            "expr codegen",
            format!(
                "strategy {:?} for a program that reduces: {}",
                v.strategy,
                p.reduces()
            ),
        ));
    }
    let known = |d: &DType| matches!(d, DType::F32 | DType::F64 | DType::I64 | DType::U8);
    if let Some(d) = p.dtypes().iter().chain(p.inputs()).find(|d| !known(d)) {
        return Err(Error::invalid(
            "expr codegen",
            format!("no CUDA type for {d}"),
        ));
    }
    let mut s = format!(
        "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"scalar_ops.cuh\"\n{SCALAR_OPS}\n\
         #line 1 \"expr.cu\"\n{PRELUDE}\ntypedef {} I;\n\n",
        if v.wide { "u64" } else { "u32" }
    );
    // Program listing, for whoever reads the source (and the NVRTC log).
    for line in p.to_string().lines() {
        let _ = writeln!(s, "// {line}");
    }
    let _ = write!(s, "extern \"C\" __global__ void {KERNEL}(");
    let mut params: Vec<String> = if p.reduces() {
        vec![
            "u64 n_kept".into(),
            "u64 n_red".into(),
            "Dims kd".into(),
            "Dims rd".into(),
        ]
    } else {
        vec!["u64 n".into(), "Dims d".into()]
    };
    for (j, &o) in p.outputs().iter().enumerate() {
        params.push(format!("{}* __restrict__ y{j}", ctype(p.dtype(o))));
    }
    for (k, &d) in p.inputs().iter().enumerate() {
        params.push(format!("const {}* __restrict__ x{k}", ctype(d)));
        if !p.reduces() && v.access[k] == Access::Strided {
            params.push(format!("Strides s{k}"));
        }
    }
    if p.reduces() {
        for m in 0..n_ops {
            params.push(format!("Strides ks{m}"));
            if v.access[m] == Access::Strided {
                params.push(format!("Strides rs{m}"));
            }
        }
    }
    for (k, &d) in p.params().iter().enumerate() {
        params.push(format!("{} p{k}", ctype(d)));
    }
    if v.strategy == Strategy::Split {
        params.push("u64 parts".into());
        params.push("u32 phase".into());
        for (i, d) in live_reduces(p).into_iter().zip(split_partials(p)) {
            params.push(format!("{}* __restrict__ part{i}", ctype(d)));
        }
    }
    s += &params.join(", ");
    s += ") {\n";
    let nd = need(p);
    // Uniform values, once per thread.
    let uni: Vec<bool> = (0..p.code().len())
        .map(|i| nd.live[i] && p.phase(i as u32) == Phase::Uniform)
        .collect();
    emit_values(&mut s, "    ", p, &uni, "off");
    if p.reduces() {
        reduction_body(&mut s, p, v, &nd, &eouts);
    } else {
        elementwise_body(&mut s, p, v, &nd);
    }
    s += "}\n";
    Ok(s)
}

fn elementwise_body(s: &mut String, p: &Program, v: &Variant, nd: &Need) {
    if v.vec > 1 {
        vector_loop(s, p, v, nd);
        // the tail, element by element
        s.push_str("    for (u64 i = nv * VN + KILN_TID; i < n; i += KILN_NTHREADS) {\n");
    } else {
        s.push_str("    for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {\n");
    }
    let ind = "        ";
    for (k, a) in v.access.iter().enumerate() {
        match a {
            Access::Contig => {
                let _ = writeln!(s, "{ind}const I off{k} = (I)i;");
            }
            Access::Bcast => {
                let _ = writeln!(s, "{ind}const I off{k} = 0;");
            }
            Access::Strided => {}
        }
    }
    let strided: Vec<usize> = (0..v.access.len())
        .filter(|&k| v.access[k] == Access::Strided)
        .collect();
    emit_offsets(s, ind, "i", "d", "s", "off", &|_| "0".into(), &strided);
    emit_values(s, ind, p, &nd.elem, "off");
    for (j, &o) in p.outputs().iter().enumerate() {
        let _ = writeln!(s, "{ind}y{j}[i] = v{o};");
    }
    s.push_str("    }\n");
}

/// The vector part of an elementwise kernel (see [`Variant::vec`]): `VN` consecutive elements
/// per iteration, each contiguous input loaded and each output stored as one 16-byte `Vec`.
fn vector_loop(s: &mut String, p: &Program, v: &Variant, nd: &Need) {
    let _ = writeln!(s, "    const int VN = {};", v.vec);
    s.push_str("    const u64 nv = n / VN;\n");
    s.push_str("    for (u64 w = KILN_TID; w < nv; w += KILN_NTHREADS) {\n");
    for (k, a) in v.access.iter().enumerate() {
        if *a == Access::Contig {
            let t = ctype(p.inputs()[k]);
            let _ = writeln!(
                s,
                "        const Vec<{t}, VN> w{k} = ((const Vec<{t}, VN>*)x{k})[w];"
            );
        }
    }
    for (j, &o) in p.outputs().iter().enumerate() {
        let _ = writeln!(s, "        Vec<{}, VN> o{j};", ctype(p.dtype(o)));
    }
    s.push_str("#pragma unroll\n        for (int l = 0; l < VN; ++l) {\n");
    let input = |k: u32| match v.access[k as usize] {
        Access::Contig => format!("w{k}.v[l]"),
        _ => format!("x{k}[0]"),
    };
    emit_values_with(s, "            ", p, &nd.elem, &input);
    for (j, &o) in p.outputs().iter().enumerate() {
        let _ = writeln!(s, "            o{j}.v[l] = v{o};");
    }
    s.push_str("        }\n");
    for j in 0..p.outputs().len() {
        let _ = writeln!(
            s,
            "        ((Vec<{}, VN>*)y{j})[w] = o{j};",
            ctype(p.dtype(p.outputs()[j]))
        );
    }
    s.push_str("    }\n");
}

/// The instruction index of each live `Reduce`, in order (as [`split_partials`]).
fn live_reduces(p: &Program) -> Vec<usize> {
    let nd = need(p);
    (0..p.code().len())
        .filter(|&i| nd.live[i] && matches!(p.code()[i], Instr::Reduce(..)))
        .collect()
}

/// Phase 1 of a [`Strategy::Split`] kernel: a block per kept element folds its parts' partial
/// accumulators (thread `t` the parts `t`, `t + blockDim.x`, ..., then the shared-memory tree:
/// a fixed order), and thread 0 runs the post-map.
fn split_finish(s: &mut String, p: &Program, v: &Variant, nd: &Need) {
    let all: Vec<usize> = (0..v.access.len()).collect();
    s.push_str("    if (phase == 1) {\n");
    s.push_str("    for (u64 ko = blockIdx.x; ko < n_kept; ko += gridDim.x) {\n");
    let ind = "        ";
    emit_offsets(s, ind, "ko", "kd", "ks", "kb", &|_| "0".into(), &all);
    for (i, ins) in p.code().iter().enumerate() {
        let Instr::Reduce(c, a) = *ins else { continue };
        if !nd.live[i] {
            continue;
        }
        let at = acc_type(c, p.dtype(a));
        let f = functor(c);
        let _ = writeln!(s, "{ind}{at} acc{i} = {f}<{at}>::init();");
        let _ = writeln!(
            s,
            "{ind}for (u64 q = threadIdx.x; q < parts; q += blockDim.x) acc{i} = \
             {f}<{at}>::combine(acc{i}, part{i}[ko * parts + q]);"
        );
        let _ = writeln!(
            s,
            "{ind}acc{i} = block_reduce<{f}<{at}>>(acc{i}, scratch{i});"
        );
    }
    s.push_str("        if (threadIdx.x == 0) {\n");
    let ind = "            ";
    emit_values(s, ind, p, &nd.post, "kb");
    for (j, &o) in p.outputs().iter().enumerate() {
        if p.output_is_reduced(j) {
            let _ = writeln!(s, "{ind}y{j}[ko] = v{o};");
        }
    }
    s.push_str("        }\n    }\n    return;\n    }\n");
}

fn reduction_body(s: &mut String, p: &Program, v: &Variant, nd: &Need, eouts: &[usize]) {
    let n_ops = v.access.len();
    let all: Vec<usize> = (0..n_ops).collect();
    let strided: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&m| v.access[m] == Access::Strided)
        .collect();
    let reduces: Vec<(usize, Combine, u32)> = p
        .code()
        .iter()
        .enumerate()
        .filter_map(|(i, ins)| match *ins {
            Instr::Reduce(c, a) if nd.live[i] => Some((i, c, a)),
            _ => None,
        })
        .collect();
    let split = v.strategy == Strategy::Split;
    let block = v.strategy == Strategy::Block || split;
    if block {
        for &(i, c, a) in &reduces {
            let _ = writeln!(
                s,
                "    __shared__ {} scratch{i}[32];",
                acc_type(c, p.dtype(a))
            );
        }
    }
    if split {
        split_finish(s, p, v, nd);
        // Block `b` folds part `b % parts` of kept element `b / parts`.
        s.push_str("    for (u64 b = blockIdx.x; b < n_kept * parts; b += gridDim.x) {\n");
        s.push_str("        const u64 ko = b / parts, pi = b - ko * parts;\n");
        // Parts start at multiples of 4: each thread folds groups of 4 consecutive elements.
        s.push_str("        const u64 chunk = ((n_red + parts - 1) / parts + 3) / 4 * 4;\n");
        s.push_str("        const u64 r0 = pi * chunk;\n");
        s.push_str("        const u64 r1 = r0 + chunk < n_red ? r0 + chunk : n_red;\n");
    } else if block {
        s.push_str("    for (u64 ko = blockIdx.x; ko < n_kept; ko += gridDim.x) {\n");
    } else {
        s.push_str("    for (u64 ko = KILN_TID; ko < n_kept; ko += KILN_NTHREADS) {\n");
    }
    let ind = "        ";
    emit_offsets(s, ind, "ko", "kd", "ks", "kb", &|_| "0".into(), &all);
    for &(i, c, a) in &reduces {
        let at = acc_type(c, p.dtype(a));
        let _ = writeln!(s, "{ind}{at} acc{i} = {}<{at}>::init();", functor(c));
    }
    let n_in = p.inputs().len();
    // The fold's body for reduced index `r`: offsets, values, accumulators, elementwise stores;
    // `input` reads input k.
    let body = |s: &mut String, ind: &str, input: &dyn Fn(u32) -> String| {
        for (m, a) in v.access.iter().enumerate() {
            match a {
                Access::Contig => {
                    let _ = writeln!(s, "{ind}const I off{m} = kb{m} + (I)r;");
                }
                Access::Bcast => {
                    let _ = writeln!(s, "{ind}const I off{m} = kb{m};");
                }
                Access::Strided => {}
            }
        }
        emit_offsets(
            s,
            ind,
            "r",
            "rd",
            "rs",
            "off",
            &|m| format!("kb{m}"),
            &strided,
        );
        emit_values_with(s, ind, p, &nd.elem, input);
        for &(i, c, a) in &reduces {
            let at = acc_type(c, p.dtype(a));
            let _ = writeln!(
                s,
                "{ind}acc{i} = {}<{at}>::combine(acc{i}, ({at})v{a});",
                functor(c)
            );
        }
        for (e, &j) in eouts.iter().enumerate() {
            let o = p.outputs()[j];
            let _ = writeln!(s, "{ind}y{j}[off{}] = v{o};", n_in + e);
        }
    };
    let scalar = |k: u32| format!("x{k}[off{k}]");
    if split {
        // Thread t folds the groups t, t + blockDim.x, ... of 4 consecutive elements, lane by
        // lane, whether or not the inputs are read as 16-byte vectors (`Variant::vec`), so
        // the result does not depend on the buffers' alignment.
        s.push_str("        for (u64 g = r0 / 4 + threadIdx.x; g * 4 < r1; g += blockDim.x) {\n");
        if v.vec == 4 {
            s.push_str("            if (g * 4 + 4 <= r1) {\n");
            for (k, a) in v.access[..n_in].iter().enumerate() {
                if *a == Access::Contig {
                    let t = ctype(p.inputs()[k]);
                    let _ = writeln!(
                        s,
                        "                const Vec<{t}, 4> w{k} = ((const Vec<{t}, 4>*)(x{k} + kb{k}))[g];"
                    );
                }
            }
            s.push_str("#pragma unroll\n");
            s.push_str("                for (int l = 0; l < 4; ++l) {\n");
            s.push_str("                    const u64 r = g * 4 + l;\n");
            let lanes = |k: u32| match v.access[k as usize] {
                Access::Contig => format!("w{k}.v[l]"),
                _ => format!("x{k}[off{k}]"),
            };
            body(s, "                    ", &lanes);
            s.push_str("                }\n                continue;\n            }\n");
        }
        s.push_str("            for (int l = 0; l < 4; ++l) {\n");
        s.push_str("                const u64 r = g * 4 + l;\n");
        s.push_str("                if (r >= r1) break;\n");
        body(s, "                ", &scalar);
        s.push_str("            }\n");
    } else {
        if block {
            s.push_str("        for (u64 r = threadIdx.x; r < n_red; r += blockDim.x) {\n");
        } else {
            s.push_str("        for (u64 r = 0; r < n_red; ++r) {\n");
        }
        body(s, "            ", &scalar);
    }
    s.push_str("        }\n");
    let ind3 = if block {
        for &(i, c, a) in &reduces {
            let at = acc_type(c, p.dtype(a));
            let _ = writeln!(
                s,
                "{ind}acc{i} = block_reduce<{}<{at}>>(acc{i}, scratch{i});",
                functor(c)
            );
        }
        s.push_str("        if (threadIdx.x == 0) {\n");
        "            "
    } else {
        s.push_str("        {\n");
        "            "
    };
    if split {
        for &(i, _, _) in &reduces {
            let _ = writeln!(s, "{ind3}part{i}[b] = acc{i};");
        }
        s.push_str("        }\n    }\n");
        return;
    }
    // The post-map, at the kept position: inputs read at their kept base (constant along the
    // reduced axes, as check_call made sure).
    emit_values(s, ind3, p, &nd.post, "kb");
    for (j, &o) in p.outputs().iter().enumerate() {
        if p.output_is_reduced(j) {
            let _ = writeln!(s, "{ind3}y{j}[ko] = v{o};");
        }
    }
    s.push_str("        }\n    }\n");
}

/// The host side of one launch: the variant, and the index arguments in plain numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub variant: Variant,
    /// Elements (elementwise), or kept elements (reducing).
    pub n: usize,
    /// Reduced elements per kept element (reducing; else 0).
    pub n_red: usize,
    /// Elementwise: the dims shared by the strided inputs. Reducing: the kept dims.
    pub dims: Vec<usize>,
    /// Per operand, its strides in `dims` (empty for contiguous or broadcast inputs of an
    /// elementwise program).
    pub strides: Vec<Vec<usize>>,
    /// Reducing: the reduced dims shared by the strided operands, and each operand's strides
    /// in them (empty unless strided).
    pub red_dims: Vec<usize>,
    pub red_strides: Vec<Vec<usize>>,
    /// [`Strategy::Split`]: the parts each kept element's reduction is cut into (else 1),
    /// and the accumulator dtype of each partial buffer ([`split_partials`]; else empty).
    pub parts: usize,
    pub partials: Vec<DType>,
}

fn too_many_dims(n: usize) -> Error {
    Error::invalid(
        "expr",
        format!("more than {MAX_DIMS} non-mergeable dimensions ({n})"),
    )
}

/// Reductions with at most this many elements per kept element run one thread per kept
/// element.
const THREAD_MAX_RED: usize = 64;

/// Blocks a [`Strategy::Split`] reduction aims for (about 8 resident blocks on each of an
/// H100's or H200's 132 multiprocessors), and the fewest reduced elements a part gets.
const SPLIT_BLOCKS: usize = 1024;
const SPLIT_MIN_PART: usize = 1 << 16;

/// The parts of a [`Strategy::Split`] reduction of `n_kept` kept elements of `n_red` reduced
/// elements each (1: do not split). Below two parts' worth of elements (128K) one block does
/// it alone: the second launch would cost a host-bound loop more (3–4 µs of driver time) than
/// the one block takes (a norm of 64K f32 is one launch in d2l-style loops).
pub(crate) fn split_parts(n_kept: usize, n_red: usize) -> usize {
    let want = SPLIT_BLOCKS.div_ceil(n_kept.max(1));
    want.min(n_red / SPLIT_MIN_PART).max(1)
}

/// Plans one call: `layouts` are the inputs' layouts in the iteration shape `shape`, `axes`
/// the resolved reduction axes. An error when the layouts need more dimensions than a kernel
/// takes (the caller then evaluates op by op).
pub(crate) fn plan(
    p: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    axes: &[usize],
) -> Result<Geometry> {
    let dims = shape.dims();
    let n = shape.elem_count();
    let extent_big = layouts
        .iter()
        .any(|l| l.elem_count() >= 1 << 31 || l.storage_extent() >= 1 << 31);
    let wide = n >= 1 << 31 || extent_big;
    if !p.reduces() {
        let access: Vec<Access> = layouts
            .iter()
            .map(|l| {
                if l.reads_one() {
                    Access::Bcast
                } else if l.is_contiguous() {
                    Access::Contig
                } else {
                    Access::Strided
                }
            })
            .collect();
        let strided: Vec<&[usize]> = layouts
            .iter()
            .zip(&access)
            .filter(|(_, a)| **a == Access::Strided)
            .map(|(l, _)| l.strides())
            .collect();
        let (cd, cs) = collapse_raw(dims, &strided);
        if cd.len() > MAX_DIMS {
            return Err(too_many_dims(cd.len()));
        }
        let mut it = cs.into_iter();
        let strides = access
            .iter()
            .map(|a| {
                if *a == Access::Strided {
                    it.next().expect("one per strided input")
                } else {
                    Vec::new()
                }
            })
            .collect();
        return Ok(Geometry {
            variant: Variant {
                wide,
                strategy: Strategy::Elementwise,
                vec: 0,
                access,
            },
            n,
            n_red: 0,
            dims: cd,
            strides,
            red_dims: Vec::new(),
            red_strides: Vec::new(),
            parts: 1,
            partials: Vec::new(),
        });
    }
    // Operands: the inputs, then the elementwise outputs (contiguous in the iteration shape).
    let contiguous = Layout::contiguous(shape.clone());
    let mut ops: Vec<&[usize]> = layouts.iter().map(|l| l.strides()).collect();
    for _ in elem_outputs(p) {
        ops.push(contiguous.strides());
    }
    let kept_axes: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
    let pick =
        |v: &[usize], which: &[usize]| -> Vec<usize> { which.iter().map(|&a| v[a]).collect() };
    let kdims = pick(dims, &kept_axes);
    let rdims = pick(dims, axes);
    let kstr: Vec<Vec<usize>> = ops.iter().map(|s| pick(s, &kept_axes)).collect();
    let rstr: Vec<Vec<usize>> = ops.iter().map(|s| pick(s, axes)).collect();
    let krefs: Vec<&[usize]> = kstr.iter().map(|v| v.as_slice()).collect();
    let (kd, ks) = collapse_raw(&kdims, &krefs);
    if kd.len() > MAX_DIMS {
        return Err(too_many_dims(kd.len()));
    }
    let access: Vec<Access> = rstr
        .iter()
        .map(|s| {
            if Layout::strides_read_one(&rdims, s) {
                Access::Bcast
            } else if Layout::strides_row_major(&rdims, s) {
                Access::Contig
            } else {
                Access::Strided
            }
        })
        .collect();
    let srefs: Vec<&[usize]> = rstr
        .iter()
        .zip(&access)
        .filter(|(_, a)| **a == Access::Strided)
        .map(|(s, _)| s.as_slice())
        .collect();
    let (rd, rs) = collapse_raw(&rdims, &srefs);
    if rd.len() > MAX_DIMS {
        return Err(too_many_dims(rd.len()));
    }
    let mut it = rs.into_iter();
    let red_strides = access
        .iter()
        .map(|a| {
            if *a == Access::Strided {
                it.next().expect("one per strided operand")
            } else {
                Vec::new()
            }
        })
        .collect();
    let n_kept: usize = kdims.iter().product();
    let n_red: usize = rdims.iter().product();
    let parts = split_parts(n_kept, n_red);
    let strategy = if n_red <= THREAD_MAX_RED {
        Strategy::Thread
    } else if parts > 1 {
        Strategy::Split
    } else {
        Strategy::Block
    };
    Ok(Geometry {
        variant: Variant {
            wide,
            strategy,
            vec: 0,
            access,
        },
        n: n_kept,
        n_red,
        dims: kd,
        strides: ks,
        red_dims: rd,
        red_strides,
        parts: if strategy == Strategy::Split {
            parts
        } else {
            1
        },
        partials: if strategy == Strategy::Split {
            split_partials(p)
        } else {
            Vec::new()
        },
    })
}

/// Sample programs in every strategy, both index widths and every access mode, with every
/// instruction kind: what `cargo xtask check-kernels` compiles (no GPU needed), so that a
/// generator change that breaks NVRTC fails CI.
pub(crate) fn sample_sources() -> Vec<(String, String)> {
    use kiln_core::expr::Expr;
    use kiln_core::{BinaryOp, CmpOp, UnaryOp};
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::I64] {
        let x = Expr::input(0);
        let y = Expr::input(1);
        let mut e = x.clone();
        for u in UnaryOp::ALL {
            if u.supports(dtype) {
                e = e.unary(u);
            }
        }
        for b in BinaryOp::ALL {
            if b.supports(dtype) {
                e = e.binary(b, &y);
            }
        }
        let mask = Expr::input(2);
        let sel = x
            .compare(CmpOp::Lt, &y)
            .where_cond(&e, Expr::param(0) + Expr::constant(-0.0));
        let sel = sel.binary(BinaryOp::Maximum, mask.to_dtype(dtype));
        let ins = [dtype, dtype, DType::U8];
        let Ok(map) = Program::from_exprs(&ins, &[sel.clone(), x.to_dtype(DType::U8)]) else {
            continue;
        };
        for (wide, access) in [
            (false, [Access::Contig, Access::Contig, Access::Contig]),
            (true, [Access::Strided, Access::Bcast, Access::Contig]),
        ] {
            let v = Variant {
                wide,
                strategy: Strategy::Elementwise,
                vec: 0,
                access: access.to_vec(),
            };
            if let Ok(src) = source(&map, &v) {
                out.push((format!("expr map ({dtype}, wide {wide})"), src));
            }
        }
        // the 16-byte vector loop: contiguous and broadcast inputs of one element size
        let vmap = Program::from_exprs(&[dtype, dtype], &[(&x * &y).exp() + &y, &x - &y]);
        if let Ok(vmap) = vmap {
            let v = Variant {
                wide: false,
                strategy: Strategy::Elementwise,
                vec: (16 / dtype.size_in_bytes()) as u32,
                access: vec![Access::Contig, Access::Bcast],
            };
            if let Ok(src) = source(&vmap, &v) {
                out.push((format!("expr map, 16-byte vectors ({dtype})"), src));
            }
        }
        for c in Combine::ALL {
            let red = sel.reduce(c, &[-1]);
            let post = red.binary(BinaryOp::Add, Expr::input(3)) * 2.0;
            let ins4 = [dtype, dtype, DType::U8, dtype];
            let Ok(rp) = Program::from_exprs(&ins4, &[post, sel.clone(), red]) else {
                continue;
            };
            if dtype == DType::F32 {
                let v = Variant {
                    wide: false,
                    strategy: Strategy::Split,
                    vec: 4,
                    access: vec![Access::Contig; 5],
                };
                if let Ok(src) = source(&rp, &v) {
                    out.push((
                        format!("expr {} (f32, Split, 16-byte loads)", c.name()),
                        src,
                    ));
                }
            }
            for (strategy, wide, access) in [
                (
                    Strategy::Block,
                    false,
                    [
                        Access::Contig,
                        Access::Strided,
                        Access::Contig,
                        Access::Bcast,
                        Access::Contig,
                    ],
                ),
                (
                    Strategy::Split,
                    false,
                    [
                        Access::Contig,
                        Access::Contig,
                        Access::Bcast,
                        Access::Bcast,
                        Access::Contig,
                    ],
                ),
                (
                    Strategy::Thread,
                    true,
                    [
                        Access::Strided,
                        Access::Contig,
                        Access::Bcast,
                        Access::Bcast,
                        Access::Strided,
                    ],
                ),
            ] {
                let v = Variant {
                    wide,
                    strategy,
                    vec: 0,
                    access: access.to_vec(),
                };
                if let Ok(src) = source(&rp, &v) {
                    let name = format!("expr {} ({dtype}, {strategy:?}, wide {wide})", c.name());
                    out.push((name, src));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::expr::Expr;

    fn prog(inputs: &[DType], outs: &[Expr]) -> Program {
        Program::from_exprs(inputs, outs).unwrap()
    }

    fn body(src: &str) -> &str {
        &src[src.find("extern \"C\"").expect("a kernel")..]
    }

    fn at(src: &str, needle: &str) -> usize {
        src.find(needle)
            .unwrap_or_else(|| panic!("`{needle}` missing in:\n{src}"))
    }

    #[test]
    fn elementwise_source_uses_the_scalar_functions_in_order() {
        let x = Expr::input(0);
        let p = prog(&[DType::F32], &[(&x * Expr::param(0)).sigmoid() + 0.5]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Elementwise,
            vec: 0,
            access: vec![Access::Contig],
        };
        let src = source(&p, &v).unwrap();
        assert!(src.contains("typedef u32 I;"));
        let b = body(&src);
        assert!(b.contains("float p0"), "{b}");
        let lp = at(b, "for (u64 i = KILN_TID");
        assert!(at(b, "const float v1 = p0;") < lp);
        assert!(at(b, "__int_as_float((int)0x3f000000u)") < lp);
        assert!(at(b, "const float v0 = x0[off0];") > lp);
        assert!(at(b, "op_mul<float>(v0, v1)") < at(b, "op_sigmoid<float>"));
        assert!(at(b, "y0[i] = v") > at(b, "op_add<float>"));
        assert!(!b.contains("Strides"), "{b}");
    }

    #[test]
    fn vector_loops_move_16_bytes_then_finish_the_tail() {
        let (x, y) = (Expr::input(0), Expr::input(1));
        let p = prog(&[DType::F32, DType::F32], &[(&x * &y).sigmoid()]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Elementwise,
            vec: 4,
            access: vec![Access::Contig, Access::Bcast],
        };
        let src = source(&p, &v).unwrap();
        let b = body(&src);
        assert!(b.contains("const int VN = 4;"), "{b}");
        let w = at(b, "for (u64 w = KILN_TID; w < nv;");
        assert!(
            w < at(
                b,
                "const Vec<float, VN> w0 = ((const Vec<float, VN>*)x0)[w];"
            )
        );
        assert!(!b.contains("Vec<float, VN> w1"), "{b}");
        assert!(at(b, "const float v0 = w0.v[l];") < at(b, "o0.v[l] = v"));
        assert!(b.contains("const float v1 = x1[0];"), "{b}");
        assert!(at(b, "((Vec<float, VN>*)y0)[w] = o0;") < at(b, "for (u64 i = nv * VN + KILN_TID"));
        assert!(at(b, "for (u64 i = nv * VN + KILN_TID") < at(b, "y0[i] = v"));
    }

    #[test]
    fn strided_inputs_share_one_set_of_divisions() {
        let (x, y, z) = (Expr::input(0), Expr::input(1), Expr::input(2));
        let p = prog(&[DType::F64; 3], &[&x * &y - &z]);
        let v = Variant {
            wide: true,
            strategy: Strategy::Elementwise,
            vec: 0,
            access: vec![Access::Strided, Access::Bcast, Access::Strided],
        };
        let src = source(&p, &v).unwrap();
        assert!(src.contains("typedef u64 I;"));
        let b = body(&src);
        assert!(b.contains("Strides s0") && b.contains("Strides s2") && !b.contains("Strides s1"));
        assert!(b.contains("const I off1 = 0;"));
        assert_eq!(b.matches("I nq = q / dk;").count(), 1, "{b}");
        assert!(b.contains("off0 += r_ * (I)s0.s[k];") && b.contains("off2 += r_ * (I)s2.s[k];"));
    }

    #[test]
    fn reductions_fold_then_thread_zero_runs_the_post_map() {
        let (x, m) = (Expr::input(0), Expr::input(1));
        let e = (&x - &m).exp();
        let lse = e.sum(&[-1]).log() + &m;
        let p = prog(&[DType::F32, DType::F32], &[lse, e.clone()]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Block,
            vec: 0,
            access: vec![Access::Contig, Access::Bcast, Access::Contig],
        };
        let src = source(&p, &v).unwrap();
        let b = body(&src);
        // f32 sums accumulate in double, through the shared-memory tree
        assert!(b.contains("__shared__ double scratch"), "{b}");
        assert!(b.contains("double acc"), "{b}");
        let fold = at(b, "for (u64 r = threadIdx.x; r < n_red; r += blockDim.x)");
        let tree = at(b, "block_reduce<ExprSum<double>>");
        let t0 = at(b, "if (threadIdx.x == 0)");
        assert!(fold < at(b, "op_exp<float>") && at(b, "op_exp<float>") < tree && tree < t0);
        // the elementwise output is stored in the fold, the reduced one by thread 0
        assert!(at(b, "y1[off2] = v") < tree);
        assert!(at(b, "cast_to<double, float>(acc") > t0);
        assert!(at(b, "op_log<float>") > t0 && at(b, "y0[ko] = v") > t0);
        // the post-map reads input 1 at the kept position
        assert!(b[t0..].contains("x1[kb1]"), "{b}");
        assert!(b.contains("Strides ks0") && b.contains("Strides ks2") && !b.contains("rs0"));
    }

    #[test]
    fn split_reductions_fold_parts_then_finish_in_a_second_phase() {
        let x = Expr::input(0);
        let norm = (&x * &x).sum(&[0]).sqrt();
        let p = prog(&[DType::F32], &[norm, x.max(&[0]), x.exp()]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Split,
            vec: 0,
            access: vec![Access::Contig, Access::Contig],
        };
        let src = source(&p, &v).unwrap();
        let b = body(&src);
        // the partial buffers, one per live reduction, of the accumulator's type
        assert!(
            b.contains("u64 parts, u32 phase, double* __restrict__ part"),
            "{b}"
        );
        assert!(b.contains("float* __restrict__ part"), "{b}");
        // phase 1 comes first and returns: a block folds the partials, its tree, then
        // thread 0 runs the post-map
        let fin = at(b, "if (phase == 1)");
        let fold_parts = at(b, "for (u64 q = threadIdx.x; q < parts; q += blockDim.x)");
        let tree1 = at(b, "block_reduce<ExprSum<double>>");
        let sqrt = at(b, "op_sqrt<float>");
        let ret = at(b, "return;");
        assert!(fin < fold_parts && fold_parts < tree1 && tree1 < sqrt && sqrt < ret);
        assert!(at(b, "y0[ko] = v") < ret && at(b, "y1[ko] = v") < ret);
        // phase 0: a block per part, its range folded, the tree, the partial stored
        let blocks = at(
            b,
            "for (u64 b = blockIdx.x; b < n_kept * parts; b += gridDim.x)",
        );
        let fold = at(
            b,
            "for (u64 g = r0 / 4 + threadIdx.x; g * 4 < r1; g += blockDim.x)",
        );
        assert!(
            !b.contains("Vec<float, 4>"),
            "no vector loads unless asked: {b}"
        );
        let tree = ret + at(&b[ret..], "block_reduce<ExprSum<double>>");
        assert!(ret < blocks && blocks < fold && fold < tree);
        assert!(at(b, "part2[b] = acc2;") > tree, "{b}");
        // the elementwise output is stored during the fold; no post-map in phase 0
        assert!(at(b, "y2[off1] = v") < tree);
        assert_eq!(b.matches("op_sqrt<float>").count(), 1, "{b}");
        assert_eq!(split_partials(&p), vec![DType::F64, DType::F32]);
        // 16-byte loads of each group of 4, then the same lanes in the same order
        let v4 = Variant { vec: 4, ..v };
        let src = source(&p, &v4).unwrap();
        let b = body(&src);
        let vec = at(b, "if (g * 4 + 4 <= r1)");
        let load = at(
            b,
            "const Vec<float, 4> w0 = ((const Vec<float, 4>*)(x0 + kb0))[g];",
        );
        let lane = at(b, "const float v0 = w0.v[l];");
        let tail = at(b, "if (r >= r1) break;");
        assert!(vec < load && load < lane && lane < tail, "{b}");
    }

    #[test]
    fn long_reductions_of_few_kept_elements_split() {
        assert_eq!(split_parts(1, 10_000), 1, "a small norm stays one launch");
        assert_eq!(split_parts(1, 256 * 256), 1);
        assert_eq!(split_parts(1, 1 << 26), SPLIT_BLOCKS);
        assert_eq!(split_parts(1, 5 * SPLIT_MIN_PART), 5);
        assert_eq!(split_parts(4, 1 << 26), SPLIT_BLOCKS / 4);
        assert_eq!(split_parts(4096, 1 << 20), 1, "enough blocks already");
        let x = Expr::input(0);
        let p = prog(&[DType::F32], &[(&x * &x).sum(&[0, 1])]);
        let shape = Shape::new([2048, 2048]);
        let l = Layout::contiguous(shape.clone());
        let g = plan(&p, &shape, &[&l], &[0, 1]).unwrap();
        assert_eq!(g.variant.strategy, Strategy::Split);
        assert_eq!((g.n, g.n_red, g.parts), (1, 1 << 22, 64));
        let small = Shape::new([100, 100]);
        let l = Layout::contiguous(small.clone());
        let g = plan(&p, &small, &[&l], &[0, 1]).unwrap();
        assert_eq!((g.variant.strategy, g.parts), (Strategy::Block, 1));
    }

    #[test]
    fn thread_per_kept_element_folds_in_order() {
        let x = Expr::input(0);
        let p = prog(&[DType::I64], &[x.max(&[0])]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Thread,
            vec: 0,
            access: vec![Access::Strided],
        };
        let b = source(&p, &v).unwrap();
        let b = body(&b).to_string();
        assert!(b.contains("for (u64 ko = KILN_TID"), "{b}");
        assert!(b.contains("for (u64 r = 0; r < n_red; ++r)"), "{b}");
        assert!(b.contains("i64 acc1 = ExprMax<i64>::init();"), "{b}");
        assert!(!b.contains("block_reduce") && !b.contains("__shared__"));
        assert!(b.contains("Strides rs0") && b.contains("off0 += r_ * (I)rs0.s[k];"));
    }

    #[test]
    fn constants_are_exact() {
        use kiln_core::expr::Scalar;
        assert!(
            literal(Scalar::new(0.1, DType::F64)).contains(&format!("{:016x}", 0.1f64.to_bits()))
        );
        assert!(
            literal(Scalar::new(0.1, DType::F32)).contains(&format!("{:08x}", 0.1f32.to_bits()))
        );
        assert!(literal(Scalar::new(f64::NAN, DType::F32)).contains("0x7fc00000"));
        assert_eq!(
            literal(Scalar::new(-1.0, DType::I64)),
            "((i64)0xffffffffffffffffull)"
        );
        assert_eq!(literal(Scalar::new(7.0, DType::U8)), "((u8)7)");
    }

    #[test]
    fn a_variant_of_the_wrong_size_is_an_error() {
        let p = prog(&[DType::F32], &[Expr::input(0).exp()]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Elementwise,
            vec: 0,
            access: vec![],
        };
        assert!(source(&p, &v).is_err());
        let v = Variant {
            wide: false,
            strategy: Strategy::Block,
            vec: 0,
            access: vec![Access::Contig],
        };
        assert!(source(&p, &v).is_err());
    }

    #[test]
    fn plan_classifies_operands() {
        let x = Expr::input(0);
        let p = prog(&[DType::F32; 3], &[&x + Expr::input(1) + Expr::input(2)]);
        let shape = Shape::new([4, 5]);
        let c = Layout::contiguous(shape.clone());
        let t = Layout::contiguous([5, 4]).permute(&[1, 0]).unwrap();
        let b = Layout::contiguous([5]).broadcast_to(&shape).unwrap();
        let g = plan(&p, &shape, &[&c, &t, &b], &[]).unwrap();
        assert_eq!(
            g.variant.access,
            vec![Access::Contig, Access::Strided, Access::Strided]
        );
        assert_eq!(g.dims, vec![4, 5]);
        assert_eq!(g.strides[1], vec![1, 4]);
        assert_eq!(g.strides[2], vec![0, 1]);
        assert!(g.strides[0].is_empty());
        let one = Layout::from_parts(shape.clone(), vec![0, 0], 3);
        let g = plan(&p, &shape, &[&c, &c, &one], &[]).unwrap();
        assert_eq!(g.variant.access[2], Access::Bcast);
        // a row reduction: rows contiguous, a [4, 1] input broadcast along them, and an
        // elementwise output
        let m = Layout::contiguous([4, 1]).broadcast_to(&shape).unwrap();
        let (x, m_) = (Expr::input(0), Expr::input(1));
        let r = prog(
            &[DType::F32; 2],
            &[(&x - &m_).exp().sum(&[-1]) + &m_, x.exp()],
        );
        let big = Shape::new([4, 500]);
        let cb = Layout::contiguous(big.clone());
        let mb = Layout::contiguous([4, 1]).broadcast_to(&big).unwrap();
        let g = plan(&r, &big, &[&cb, &mb], &[1]).unwrap();
        assert_eq!(g.variant.strategy, Strategy::Block);
        assert_eq!(
            g.variant.access,
            vec![Access::Contig, Access::Bcast, Access::Contig]
        );
        assert_eq!((g.n, g.n_red), (4, 500));
        assert_eq!(g.dims, vec![4]);
        assert_eq!(g.strides, vec![vec![500], vec![1], vec![500]]);
        // a column reduction of the small shape: strided, one thread per kept element
        let g = plan(&r, &shape, &[&c, &m], &[0]).unwrap();
        assert_eq!(g.variant.strategy, Strategy::Thread);
        assert_eq!(g.variant.access[0], Access::Strided);
        assert_eq!(g.red_dims, vec![4]);
        assert_eq!(g.red_strides[0], vec![5]);
    }

    /// The sample sources (what `cargo xtask check-kernels` compiles) compile with NVRTC for
    /// sm_90, when libnvrtc is present.
    #[test]
    fn sample_sources_compile_with_nvrtc() {
        let samples = sample_sources();
        assert!(samples.len() >= 20, "{} samples", samples.len());
        if !crate::nvrtc::nvrtc_available() {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        for (name, src) in samples {
            if let Err(log) = crate::nvrtc::compile_source("expr.cu", &src, 90) {
                panic!("{name} does not compile:\n{log}\n{}", body(&src));
            }
        }
    }
}
