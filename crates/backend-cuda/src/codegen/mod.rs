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
//! A lone elementwise op (`ops/`), a chain `lazy.rs` recorded and a user's program are all
//! generated here: every op calls its scalar device function (`op_<name><T>`,
//! `cast_to<F, T>` in `kernels/scalar_ops.cuh`), and elementwise programs compile with
//! `--fmad=false` (no multiply-add contracted into one rounding), so fused and unfused values
//! agree bit for bit (but for 16-bit intermediates, which a widened program keeps in f32:
//! `kiln_core`'s `Program::widened`), and so does the interpreter (`tier.rs`); one C variable per
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
//!
//! # Files
//!
//! This file holds the variant types, the shared emitters (values, offsets) and [`source`],
//! which writes the signature and calls the body of its kind: `elementwise.rs`, `reduction.rs`.
//! `plan.rs` is the host side (the [`Geometry`] of a call), `samples.rs` the programs
//! `check-kernels` compiles, `tests.rs` the unit tests.

use std::fmt::Write as _;

use kiln_core::expr::{Combine, Instr, Phase, Program};
use kiln_core::{DType, Error, Result};

use crate::sources::{COMMON, ctype, scalar_ops};

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
    /// Elementwise programs whose operands are all contiguous or broadcast: elements per
    /// vector, 16 bytes of the widest contiguous input or output (each contiguous input and
    /// output moves as one `Vec` of `vec` elements per iteration, aligned to its size; then
    /// the tail one by one; see [`vec_elems`]). [`Strategy::Split`] reductions: 4 when every
    /// operand is contiguous or broadcast along the reduced axes and the contiguous inputs
    /// have 4-byte elements and 16-byte aligned rows (each thread then loads its groups of 4
    /// as one vector). 0: element by element. Chosen at launch (it depends on addresses).
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

/// An exact C expression for constant `c`; floats through `k_opaque` (scalar_ops.cuh), so that
/// NVRTC does not fold math functions of them with other bits than the interpreter's.
fn literal(c: kiln_core::expr::Scalar) -> String {
    match c.dtype() {
        DType::F32 => {
            let v = c.to_f64() as f32;
            format!(
                "k_opaque(__int_as_float((int)0x{:08x}u)) /* {v:?} */",
                v.to_bits()
            )
        }
        DType::F64 => format!(
            "k_opaque(__longlong_as_double((long long)0x{:016x}ull)) /* {:?} */",
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

/// The first instruction of `p` that is not in the widened form the generator takes for the
/// 16-bit floats (storage types of `common.cuh`, see `Program::widened`): a 16-bit value may
/// only be an input or a cast's result, a cast may read one only to make an f32, and no
/// parameter is 16-bit (`None`: `p` is in that form).
fn half_arithmetic(p: &Program) -> Option<usize> {
    if p.params().iter().any(|d| d.is_half()) {
        return Some(0);
    }
    p.code().iter().enumerate().find_map(|(i, ins)| {
        let ok = match *ins {
            Instr::Input(_) => true,
            Instr::Cast(to, a) if p.dtype(a).is_half() => to == DType::F32,
            Instr::Cast(..) => true,
            _ => {
                !p.dtype(i as u32).is_half()
                    && ins.operands().into_iter().all(|a| !p.dtype(a).is_half())
            }
        };
        (!ok).then_some(i)
    })
}

/// The text before a generated kernel: the headers, the reduction functors, the index type
/// `I` (64-bit when `wide`), and the program's listing (for whoever reads the source and the
/// NVRTC log).
fn preamble(p: &Program, wide: bool) -> String {
    let mut s = format!(
        "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"scalar_ops.cuh\"\n{}\n\
         #line 1 \"expr.cu\"\n{PRELUDE}\ntypedef {} I;\n\n",
        scalar_ops(),
        if wide { "u64" } else { "u32" }
    );
    for line in p.to_string().lines() {
        let _ = writeln!(s, "// {line}");
    }
    s
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
    let known = |d: &DType| {
        matches!(
            d,
            DType::F32 | DType::F64 | DType::I64 | DType::U8 | DType::F16 | DType::BF16
        )
    };
    if let Some(d) = p.dtypes().iter().chain(p.inputs()).find(|d| !known(d)) {
        return Err(Error::invalid(
            "expr codegen",
            format!("no CUDA type for {d}"),
        ));
    }
    if let Some(i) = half_arithmetic(p) {
        return Err(Error::invalid(
            "expr codegen",
            format!(
                "instruction %{i} computes in 16 bits: generate the program's widened form \
                 (`Program::widened`), which loads, converts and stores 16-bit values only"
            ),
        ));
    }
    let mut s = preamble(p, v.wide);
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

mod elementwise;
mod multi_tensor;
mod plan;
mod reduction;
mod samples;
#[cfg(test)]
mod tests;

use elementwise::elementwise_body;
pub(crate) use multi_tensor::{MT_MAX, multi_tensor_args, multi_tensor_source};
pub(crate) use plan::{Geometry, plan, split_parts, vec_elems};
use reduction::{live_reduces, reduction_body};
pub(crate) use samples::sample_sources;
