//! The multi-tensor kernel of an elementwise program: one launch applies the program to up to
//! [`MT_MAX`] tensors (PyTorch's `multi_tensor_apply`), for the optimizers' updates
//! (`fused.rs`), whose per-element arithmetic is `kiln_core::UpdateRule::program`.
//!
//! The tensors form one virtual concatenation: `start` holds the prefix offsets, and each
//! thread finds its tensor by binary search over them. Every pointer travels in the by-value
//! `MtArgs` struct (no per-launch upload), all of its fields `u64` so that the host packs it as
//! plain words:
//!
//! ```text
//! struct MtArgs { u64 start[MT_MAX + 1]; u64 count; u64 x<k>[MT_MAX]...; u64 y<j>[MT_MAX]...; };
//! ```
//!
//! one `x<k>` per input and one `y<j>` per output, each the base address of that operand of
//! every tensor (contiguous, `start[t + 1] - start[t]` elements). The kernel is [`KERNEL`]; it
//! takes `MtArgs a`, then the program's parameters `T p<k>`. An output may be its own input
//! (an update in place): each thread reads an element's inputs before it stores its outputs,
//! and no other thread touches that element.

use std::fmt::Write as _;

use kiln_core::expr::Program;
use kiln_core::{Error, Result};

use super::{KERNEL, Phase, emit_values, emit_values_with, need, preamble};
use crate::sources::ctype;

/// Tensors per launch.
pub(crate) const MT_MAX: usize = 24;

/// The CUDA C source of the multi-tensor kernel of elementwise program `p` (see the module
/// docs), whose last `scalars` inputs are single elements read by every thread (an optimizer's
/// gradient scale; `x<k>` then holds that element's address for every tensor); an error for a
/// program that reduces.
pub(crate) fn multi_tensor_source(p: &Program, scalars: usize) -> Result<String> {
    if p.reduces() {
        return Err(Error::invalid(
            "expr codegen",
            "a multi-tensor kernel runs an elementwise program; this one reduces",
        ));
    }
    let mut s = preamble(p, true);
    let _ = writeln!(s, "struct MtArgs {{");
    let _ = writeln!(s, "    u64 start[{}];", MT_MAX + 1);
    let _ = writeln!(s, "    u64 count;");
    for k in 0..p.inputs().len() {
        let _ = writeln!(s, "    u64 x{k}[{MT_MAX}];");
    }
    for j in 0..p.outputs().len() {
        let _ = writeln!(s, "    u64 y{j}[{MT_MAX}];");
    }
    s += "};\n\n";
    let _ = write!(s, "extern \"C\" __global__ void {KERNEL}(MtArgs a");
    for (k, &d) in p.params().iter().enumerate() {
        let _ = write!(s, ", {} p{k}", ctype(d));
    }
    s += ") {\n";
    let nd = need(p);
    let uni: Vec<bool> = (0..p.code().len())
        .map(|i| nd.live[i] && p.phase(i as u32) == Phase::Uniform)
        .collect();
    emit_values(&mut s, "    ", p, &uni, "off");
    s += "    const u64 total = a.start[a.count];\n";
    s += "    for (u64 i = KILN_TID; i < total; i += KILN_NTHREADS) {\n";
    s += "        int lo = 0, hi = (int)a.count - 1;\n";
    s += "        while (lo < hi) {\n";
    s += "            int mid = (lo + hi + 1) >> 1;\n";
    s += "            if (a.start[mid] <= i) lo = mid; else hi = mid - 1;\n";
    s += "        }\n";
    s += "        const u64 e = i - a.start[lo];\n";
    let first_scalar = p.inputs().len().saturating_sub(scalars);
    let input = |k: u32| {
        let at = if k as usize >= first_scalar { "0" } else { "e" };
        format!(
            "((const {}*)a.x{k}[lo])[{at}]",
            ctype(p.inputs()[k as usize])
        )
    };
    emit_values_with(&mut s, "        ", p, &nd.elem, &input);
    for (j, &o) in p.outputs().iter().enumerate() {
        let _ = writeln!(s, "        (({}*)a.y{j}[lo])[e] = v{o};", ctype(p.dtype(o)));
    }
    s += "    }\n}\n";
    Ok(s)
}

/// The words of `MtArgs` for `p` over tensors of `lens[t]` elements (at most [`MT_MAX`]),
/// operand `m` (the inputs, then the outputs) of tensor `t` starting at `ptr(m, t)`.
pub(crate) fn multi_tensor_args(
    p: &Program,
    lens: &[usize],
    ptr: impl Fn(usize, usize) -> u64,
) -> Vec<u64> {
    debug_assert!(lens.len() <= MT_MAX);
    let ops = p.inputs().len() + p.outputs().len();
    let mut w = vec![0u64; MT_MAX + 2 + ops * MT_MAX];
    for (t, &n) in lens.iter().enumerate() {
        w[t + 1] = w[t] + n as u64;
    }
    w[MT_MAX + 1] = lens.len() as u64;
    for m in 0..ops {
        for t in 0..lens.len() {
            w[MT_MAX + 2 + m * MT_MAX + t] = ptr(m, t);
        }
    }
    w
}
