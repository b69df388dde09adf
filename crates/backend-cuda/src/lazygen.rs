//! The code generator of deferred elementwise chains (`lazy.rs`): a [`Program`] in, CUDA C
//! out.
//!
//! # Why a module of its own
//!
//! Generating source needs no device, so it lives apart from the deferral layer that records
//! chains and launches them: it can be read, unit-tested and compiled with NVRTC on a machine
//! with no GPU (`cargo xtask check-kernels` compiles [`sample_sources`]). It imports kiln-core
//! and the kernel texts of `sources.rs`, nothing else.
//!
//! A program is a list of instructions, each defining one register: strided leaves read per
//! element, uniform leaves (one element) and scalar arguments read once, and the elementwise
//! ops, which call the scalar device functions of `kernels/scalar_ops.cuh` like the single-op
//! kernels do. The kernel is one grid-stride loop (16-byte vector loads when every leaf is
//! contiguous and aligned), or a per-block partial reduction of the whole result.

use std::fmt::Write as _;

use kiln_core::{BinaryOp, CmpOp, DType, ReduceOp, UnaryOp};

use crate::sources::{COMMON, SCALAR_OPS, bwd_name, ctype as tname};

/// One instruction of a fused program; each defines the register with its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Ins {
    /// Strided leaf `k`, read per element.
    Leaf(u8),
    /// Uniform leaf `k` (one element, read once).
    Uni(u8),
    /// Scalar kernel argument `k`.
    Const(u8),
    Unary(UnaryOp, u16),
    Binary(BinaryOp, u16, u16),
    /// `op_bwd_<op>(saved, g)`.
    Bwd(UnaryOp, u16, u16),
    /// A comparison, as u8 0/1.
    Cmp(CmpOp, u16, u16),
    /// `cast_to<from, to>`.
    Cast(DType, u16),
    /// `cond ? a : b`.
    Where(u16, u16, u16),
}

/// A fused kernel's code: what its source (and so its compiled function) depends on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Program {
    /// The result's dtype (the last register's).
    pub dtype: DType,
    /// 64-bit index arithmetic (beyond 2^31 elements or storage extent).
    pub wide: bool,
    /// Every strided leaf is contiguous with the output (no index arithmetic).
    pub contig: bool,
    /// Contiguous, every leaf of the result's dtype and 16-byte aligned, no reduction: the
    /// loop moves 16 bytes per leaf and per store, then finishes the tail element by element.
    pub vec: bool,
    /// The dtypes of the strided leaves, uniform leaves and scalar arguments, in order.
    pub leaves: Vec<DType>,
    pub unis: Vec<DType>,
    pub consts: Vec<DType>,
    pub code: Vec<Ins>,
    /// `None`: write every element. `Some(op)`: reduce all of them with `op` (sum, max or
    /// min), one partial result per block.
    pub reduce: Option<ReduceOp>,
}

/// The CUDA C of `p`: one grid-stride loop; registers that do not vary per element (uniform
/// leaves, constants, ops of those) are computed once before it. `T` is the result's type;
/// every register is declared with its own.
pub(crate) fn source(p: &Program) -> String {
    let mut s = format!(
        "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"scalar_ops.cuh\"\n{SCALAR_OPS}\n\
         #line 1 \"fused.cu\"\ntypedef {} T;\ntypedef {} I;\n\
         extern \"C\" __global__ void fused(T* __restrict__ y, u64 n",
        tname(p.dtype),
        if p.wide { "u64" } else { "u32" }
    );
    if !p.contig {
        s += ", Dims d";
    }
    for (k, d) in p.leaves.iter().enumerate() {
        let _ = write!(s, ", const {}* __restrict__ a{k}", tname(*d));
        if !p.contig {
            let _ = write!(s, ", Strides s{k}");
        }
    }
    for (k, d) in p.unis.iter().enumerate() {
        let _ = write!(s, ", const {}* __restrict__ u{k}", tname(*d));
    }
    for (k, d) in p.consts.iter().enumerate() {
        let _ = write!(s, ", {} c{k}", tname(*d));
    }
    s += ") {\n";
    let red = p.reduce.map(|op| match op {
        ReduceOp::Max => "MaxOp<T>",
        ReduceOp::Min => "MinOp<T>",
        _ => "SumOp<T>",
    });
    if let Some(r) = red {
        let _ = writeln!(s, "    __shared__ {r}::Acc scratch[32];");
        let _ = writeln!(s, "    {r}::Acc acc = {r}::init();");
    }
    // Each register's type, and whether it varies per element (reads a leaf).
    let mut ty: Vec<DType> = Vec::with_capacity(p.code.len());
    let mut varies = vec![false; p.code.len()];
    for (j, ins) in p.code.iter().enumerate() {
        let (t, v) = match *ins {
            Ins::Leaf(k) => (p.leaves[k as usize], true),
            Ins::Uni(k) => (p.unis[k as usize], false),
            Ins::Const(k) => (p.consts[k as usize], false),
            Ins::Unary(_, a) | Ins::Cast(_, a) => (ty[a as usize], varies[a as usize]),
            Ins::Binary(_, a, b) | Ins::Bwd(_, a, b) | Ins::Cmp(_, a, b) => {
                (ty[a as usize], varies[a as usize] || varies[b as usize])
            }
            Ins::Where(c, a, b) => (
                ty[a as usize],
                varies[c as usize] || varies[a as usize] || varies[b as usize],
            ),
        };
        let t = match *ins {
            Ins::Cmp(..) => DType::U8,
            Ins::Cast(to, _) => to,
            _ => t,
        };
        ty.push(t);
        varies[j] = v;
    }
    // `lane`: inside the vector loop, where leaf k's element is `w{k}.v[j]`.
    let expr = |ins: Ins, lane: bool| -> String {
        let t = |r: u16| tname(ty[r as usize]);
        match ins {
            Ins::Leaf(k) if lane => format!("w{k}.v[j]"),
            Ins::Leaf(k) if p.contig => format!("a{k}[i]"),
            Ins::Leaf(k) => format!("a{k}[o{k}]"),
            Ins::Uni(k) => format!("u{k}[0]"),
            Ins::Const(k) => format!("c{k}"),
            Ins::Unary(u, a) => format!("op_{}<{}>(r{a})", u.name(), t(a)),
            Ins::Binary(b, x, y) => format!("op_{}<{}>(r{x}, r{y})", b.name(), t(x)),
            Ins::Bwd(u, x, y) => format!(
                "op_{}<{}>(r{x}, r{y})",
                bwd_name(u).expect("only ops with a backward kernel are recorded"),
                t(x)
            ),
            Ins::Cmp(c, x, y) => format!("op_{}<{}>(r{x}, r{y})", c.name(), t(x)),
            Ins::Cast(to, a) => format!("cast_to<{}, {}>(r{a})", t(a), tname(to)),
            Ins::Where(c, x, y) => format!("(r{c} ? r{x} : r{y})"),
        }
    };
    for (j, ins) in p.code.iter().enumerate() {
        if !varies[j] {
            let _ = writeln!(
                s,
                "    const {} r{j} = {};",
                tname(ty[j]),
                expr(*ins, false)
            );
        }
    }
    let last = p.code.len() - 1;
    if p.vec {
        // 16 bytes per leaf and per store; the scalar loop below takes the tail.
        s += "    const int N = 16 / sizeof(T);\n    const u64 nv = n / N;\n";
        s += "    for (u64 v = KILN_TID; v < nv; v += KILN_NTHREADS) {\n";
        for k in 0..p.leaves.len() {
            let _ = writeln!(
                s,
                "        const Vec<T, N> w{k} = ((const Vec<T, N>*)a{k})[v];"
            );
        }
        s += "        Vec<T, N> out;\n#pragma unroll\n        for (int j = 0; j < N; ++j) {\n";
        for (j, ins) in p.code.iter().enumerate() {
            if varies[j] {
                let ex = expr(*ins, true);
                let _ = writeln!(s, "            const {} r{j} = {ex};", tname(ty[j]));
            }
        }
        let _ = writeln!(s, "            out.v[j] = r{last};\n        }}");
        s += "        ((Vec<T, N>*)y)[v] = out;\n    }\n";
        s += "    for (u64 i = nv * N + KILN_TID; i < n; i += KILN_NTHREADS) {\n";
    } else {
        s += "    for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {\n";
    }
    if !p.contig && !p.leaves.is_empty() {
        s += "        I q = (I)i;\n";
        for k in 0..p.leaves.len() {
            let _ = writeln!(s, "        I o{k} = (I)s{k}.offset;");
        }
        s += "#pragma unroll\n        for (int k = KILN_MAX_DIMS - 1; k >= 0; --k) {\n\
              \x20           if (k < d.rank) {\n\
              \x20               I dk = (I)d.d[k];\n\
              \x20               I nq = q / dk;\n\
              \x20               I m = q - nq * dk;\n";
        for k in 0..p.leaves.len() {
            let _ = writeln!(s, "                o{k} += m * (I)s{k}.s[k];");
        }
        s += "                q = nq;\n            }\n        }\n";
    }
    for (j, ins) in p.code.iter().enumerate() {
        if varies[j] {
            let _ = writeln!(
                s,
                "        const {} r{j} = {};",
                tname(ty[j]),
                expr(*ins, false)
            );
        }
    }
    match red {
        None => {
            let _ = writeln!(s, "        y[i] = r{last};\n    }}\n}}");
        }
        Some(r) => {
            let _ = writeln!(
                s,
                "        acc = {r}::combine(acc, {r}::lift(r{last}, (i64)i));\n    }}\n    \
                 acc = block_reduce<{r}>(acc, scratch);\n    \
                 if (threadIdx.x == 0) y[blockIdx.x] = acc;\n}}"
            );
        }
    }
    s
}

/// A few programs covering every instruction, both index widths and both layouts: what `cargo
/// xtask check-kernels` compiles so that a code generator change that breaks NVRTC fails CI.
pub(crate) fn sample_sources() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (dtype, wide, contig, reduce) in [
        (DType::F32, false, true, None),
        (DType::F64, false, true, None),
        (DType::F64, true, false, None),
        (DType::F32, false, false, None),
        (DType::F32, false, true, Some(ReduceOp::Sum)),
        (DType::F64, true, false, Some(ReduceOp::Max)),
        (DType::F32, false, false, Some(ReduceOp::Min)),
    ] {
        // Registers 0-1: leaves of `dtype`; 2: a uniform; 3: a constant; 4: a u8 leaf.
        let mut code = vec![
            Ins::Leaf(0),
            Ins::Leaf(1),
            Ins::Uni(0),
            Ins::Const(0),
            Ins::Leaf(2),
        ];
        for u in UnaryOp::ALL {
            if u.supports(dtype) {
                code.push(Ins::Unary(u, 0));
            }
            if bwd_name(u).is_some() {
                code.push(Ins::Bwd(u, 0, 1));
            }
        }
        for b in BinaryOp::ALL {
            if b.supports(dtype) {
                code.push(Ins::Binary(b, 2, (code.len() - 1) as u16));
            }
        }
        let last = (code.len() - 1) as u16;
        let n = code.len() as u16;
        code.extend([
            Ins::Cmp(CmpOp::Lt, 0, last), // n: u8
            Ins::Cast(dtype, n),          // n + 1
            Ins::Where(4, n + 1, 3),      // n + 2 (u8 leaf as the condition)
            Ins::Cast(dtype, 4),          // n + 3
            Ins::Binary(BinaryOp::Add, n + 2, n + 3),
        ]);
        let p = Program {
            dtype,
            wide,
            contig,
            vec: contig && reduce.is_none() && !wide,
            leaves: vec![dtype, dtype, DType::U8],
            unis: vec![dtype],
            consts: vec![dtype],
            code,
            reduce,
        };
        let what = reduce.map_or("map", |r| r.name());
        let name = format!(
            "fused {what} ({dtype}, wide {wide}, contig {contig}, vec {})",
            p.vec
        );
        out.push((name, source(&p)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sigmoid(a0 + u0) * c0` over strided leaves: the uniform read and the constant are
    /// hoisted out of the loop, the per-element ops stay inside, in order.
    #[test]
    fn source_hoists_uniform_registers() {
        let p = Program {
            dtype: DType::F32,
            wide: false,
            contig: false,
            vec: false,
            leaves: vec![DType::F32],
            unis: vec![DType::F32],
            consts: vec![DType::F32],
            code: vec![
                Ins::Leaf(0),
                Ins::Uni(0),
                Ins::Binary(BinaryOp::Add, 0, 1),
                Ins::Unary(UnaryOp::Sigmoid, 2),
                Ins::Const(0),
                Ins::Binary(BinaryOp::Mul, 3, 4),
            ],
            reduce: None,
        };
        let src = source(&p);
        let body = &src[src.find("extern \"C\"").unwrap()..];
        let at = |needle: &str| {
            body.find(needle)
                .unwrap_or_else(|| panic!("`{needle}` missing in:\n{body}"))
        };
        let lp = at("for (u64 i");
        assert!(at("const float r1 = u0[0];") < lp);
        assert!(at("const float r4 = c0;") < lp);
        assert!(at("const float r0 = a0[o0];") > lp);
        assert!(
            at("const float r2 = op_add<float>(r0, r1);")
                < at("const float r3 = op_sigmoid<float>(r2);")
        );
        assert!(at("y[i] = r5;") > at("const float r5 = op_mul<float>(r3, r4);"));
        assert!(body.contains("typedef u32 I;") || src.contains("typedef u32 I;"));
        assert!(body.contains("Strides s0") && body.contains("Dims d"));
    }

    #[test]
    fn contiguous_programs_index_directly() {
        let p = Program {
            dtype: DType::F64,
            wide: true,
            contig: true,
            vec: false,
            leaves: vec![DType::F64, DType::F64],
            unis: vec![],
            consts: vec![],
            code: vec![Ins::Leaf(0), Ins::Leaf(1), Ins::Bwd(UnaryOp::Tanh, 0, 1)],
            reduce: None,
        };
        let src = source(&p);
        assert!(src.contains("typedef double T;") && src.contains("typedef u64 I;"));
        assert!(src.contains("const double r0 = a0[i];"));
        assert!(src.contains("op_bwd_tanh<double>(r0, r1)"));
        assert!(!src.contains("Strides s0") && !src.contains("Dims d"));
    }

    #[test]
    fn aligned_contiguous_programs_move_16_bytes_then_finish_the_tail() {
        let p = Program {
            dtype: DType::F32,
            wide: false,
            contig: true,
            vec: true,
            leaves: vec![DType::F32, DType::F32],
            unis: vec![],
            consts: vec![],
            code: vec![Ins::Leaf(0), Ins::Leaf(1), Ins::Binary(BinaryOp::Mul, 0, 1)],
            reduce: None,
        };
        let src = source(&p);
        let at = |needle: &str| {
            src.find(needle)
                .unwrap_or_else(|| panic!("`{needle}` missing in:\n{src}"))
        };
        assert!(at("const Vec<T, N> w1 = ((const Vec<T, N>*)a1)[v];") < at("out.v[j] = r2;"));
        assert!(at("const float r0 = w0.v[j];") < at("((Vec<T, N>*)y)[v] = out;"));
        assert!(at("for (u64 i = nv * N + KILN_TID") < at("const float r0 = a0[i];"));
        assert!(at("const float r0 = a0[i];") < at("y[i] = r2;"));
    }
}
