//! The body of a reducing kernel, in each [`Strategy`]: the loop over kept elements, the fold
//! of the reduced elements into accumulators, the block-wide combination, and the post-map.

use std::fmt::Write as _;

use kiln_core::expr::{Combine, Instr, Program};

use super::{
    Access, Need, Strategy, Variant, acc_type, emit_offsets, emit_values, emit_values_with,
    functor, need,
};
use crate::sources::ctype;

/// The instruction index of each live `Reduce`, in order (as [`split_partials`]).
pub(super) fn live_reduces(p: &Program) -> Vec<usize> {
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

/// The live `Reduce`s of a program, in instruction order: (instruction index, combine,
/// operand).
type Reduces = [(usize, Combine, u32)];

/// The body of a reducing kernel: shared scratch, the split's second phase, the loop over kept
/// elements, the fold of their reduced elements, and the end of each kept element (block-wide
/// combination, then the post-map or the partial stores).
pub(super) fn reduction_body(s: &mut String, p: &Program, v: &Variant, nd: &Need, eouts: &[usize]) {
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
        emit_scratch(s, p, &reduces);
    }
    if split {
        split_finish(s, p, v, nd);
    }
    open_kept_loop(s, v.strategy);
    let all: Vec<usize> = (0..v.access.len()).collect();
    emit_offsets(s, "        ", "ko", "kd", "ks", "kb", &|_| "0".into(), &all);
    for &(i, c, a) in &reduces {
        let at = acc_type(c, p.dtype(a));
        let _ = writeln!(s, "        {at} acc{i} = {}<{at}>::init();", functor(c));
    }
    let fold = Fold {
        p,
        v,
        nd,
        eouts,
        reduces: &reduces,
        strided: (0..v.access.len())
            .filter(|&m| v.access[m] == Access::Strided)
            .collect(),
    };
    if split {
        fold.split_loop(s);
    } else if block && v.vec == 4 {
        // The whole row is the block's one part.
        s.push_str("        const u64 r0 = 0, r1 = n_red;\n");
        fold.split_loop(s);
    } else {
        fold.plain_loop(s, block);
    }
    s.push_str(
        "        }
",
    );
    end_kept_element(s, p, nd, &reduces, split, block);
}

/// The shared-memory scratch of `block_reduce`, one per `Reduce`.
fn emit_scratch(s: &mut String, p: &Program, reduces: &Reduces) {
    for &(i, c, a) in reduces {
        let _ = writeln!(
            s,
            "    __shared__ {} scratch{i}[32];",
            acc_type(c, p.dtype(a))
        );
    }
}

/// Opens the loop over kept elements (over (kept element, part) pairs for a split) and its
/// body's scope.
fn open_kept_loop(s: &mut String, strategy: Strategy) {
    match strategy {
        Strategy::Split => {
            // Block `b` folds part `b % parts` of kept element `b / parts`.
            s.push_str("    for (u64 b = blockIdx.x; b < n_kept * parts; b += gridDim.x) {\n");
            s.push_str("        const u64 ko = b / parts, pi = b - ko * parts;\n");
            // Parts start at multiples of 4: each thread folds groups of 4 consecutive elements.
            s.push_str("        const u64 chunk = ((n_red + parts - 1) / parts + 3) / 4 * 4;\n");
            s.push_str("        const u64 r0 = pi * chunk;\n");
            s.push_str("        const u64 r1 = r0 + chunk < n_red ? r0 + chunk : n_red;\n");
        }
        Strategy::Block => {
            s.push_str("    for (u64 ko = blockIdx.x; ko < n_kept; ko += gridDim.x) {\n");
        }
        _ => {
            s.push_str("    for (u64 ko = KILN_TID; ko < n_kept; ko += KILN_NTHREADS) {\n");
        }
    }
}

/// The fold over one kept element's reduced elements.
struct Fold<'a> {
    p: &'a Program,
    v: &'a Variant,
    nd: &'a Need,
    eouts: &'a [usize],
    reduces: &'a Reduces,
    /// The strided operands.
    strided: Vec<usize>,
}

impl Fold<'_> {
    /// The fold's body for reduced index `r`: offsets, values, accumulators, elementwise
    /// stores; `input` reads input k. `group`: inside a vector group (lane `l`), whose strided
    /// operands' offsets `offg<m>` were found once for the group.
    fn element(&self, s: &mut String, ind: &str, input: &dyn Fn(u32) -> String, group: bool) {
        let (p, v) = (self.p, self.v);
        for (m, a) in v.access.iter().enumerate() {
            match a {
                Access::Contig => {
                    let _ = writeln!(s, "{ind}const I off{m} = kb{m} + (I)r;");
                }
                Access::Bcast => {
                    let _ = writeln!(s, "{ind}const I off{m} = kb{m};");
                }
                Access::Strided if group => {
                    let _ = writeln!(s, "{ind}const I off{m} = offg{m} + (I)l;");
                }
                Access::Strided => {}
            }
        }
        if !group {
            emit_offsets(
                s,
                ind,
                "r",
                "rd",
                "rs",
                "off",
                &|m| format!("kb{m}"),
                &self.strided,
            );
        }
        emit_values_with(s, ind, p, &self.nd.elem, input);
        for &(i, c, a) in self.reduces {
            let at = acc_type(c, p.dtype(a));
            let _ = writeln!(
                s,
                "{ind}acc{i} = {}<{at}>::combine(acc{i}, ({at})v{a});",
                functor(c)
            );
        }
        let n_in = p.inputs().len();
        for (e, &j) in self.eouts.iter().enumerate() {
            let o = p.outputs()[j];
            let _ = writeln!(s, "{ind}y{j}[off{}] = v{o};", n_in + e);
        }
    }

    /// [`Strategy::Split`] (and [`Strategy::Block`] with vectors, over one part `r0..r1` =
    /// the whole row): thread t folds the groups t, t + blockDim.x, ... of 4 consecutive
    /// elements of its part, lane by lane, whether or not the inputs are read as vectors
    /// (`Variant::vec`), so the result does not depend on the buffers' alignment. With
    /// vectors, a strided operand (unit stride along the innermost reduced dim, which 4
    /// divides: see `vec_width` in expr_run) finds its offset once per group, and a strided
    /// input is loaded as one vector there too.
    fn split_loop(&self, s: &mut String) {
        let (p, v) = (self.p, self.v);
        s.push_str("        for (u64 g = r0 / 4 + threadIdx.x; g * 4 < r1; g += blockDim.x) {\n");
        if v.vec == 4 {
            s.push_str("            if (g * 4 + 4 <= r1) {\n");
            emit_offsets(
                s,
                "                ",
                "(g * 4)",
                "rd",
                "rs",
                "offg",
                &|m| format!("kb{m}"),
                &self.strided,
            );
            for (k, a) in v.access[..p.inputs().len()].iter().enumerate() {
                let t = ctype(p.inputs()[k]);
                let at = match a {
                    Access::Contig => format!("x{k} + kb{k} + (I)(g * 4)"),
                    Access::Strided => format!("x{k} + offg{k}"),
                    Access::Bcast => continue,
                };
                let _ = writeln!(
                    s,
                    "                const Vec<{t}, 4> w{k} = *(const Vec<{t}, 4>*)({at});"
                );
            }
            s.push_str("#pragma unroll\n");
            s.push_str("                for (int l = 0; l < 4; ++l) {\n");
            s.push_str("                    const u64 r = g * 4 + l;\n");
            let lanes = |k: u32| match v.access[k as usize] {
                Access::Bcast => format!("x{k}[off{k}]"),
                _ => format!("w{k}.v[l]"),
            };
            self.element(s, "                    ", &lanes, true);
            s.push_str("                }\n                continue;\n            }\n");
        }
        s.push_str("            for (int l = 0; l < 4; ++l) {\n");
        s.push_str("                const u64 r = g * 4 + l;\n");
        s.push_str("                if (r >= r1) break;\n");
        self.element(s, "                ", &scalar, false);
        s.push_str("            }\n");
    }

    /// [`Strategy::Block`] (thread t folds every `blockDim.x`-th reduced element) and
    /// [`Strategy::Thread`] (one thread folds them all, in order).
    fn plain_loop(&self, s: &mut String, block: bool) {
        if block {
            s.push_str("        for (u64 r = threadIdx.x; r < n_red; r += blockDim.x) {\n");
        } else {
            s.push_str("        for (u64 r = 0; r < n_red; ++r) {\n");
        }
        self.element(s, "            ", &scalar, false);
    }
}

/// Input k read at its own offset.
fn scalar(k: u32) -> String {
    format!("x{k}[off{k}]")
}

/// After the fold: the block-wide combination (block strategies), then, in thread 0, the
/// partial stores of a split's first phase or the post-map and the reduced outputs.
fn end_kept_element(
    s: &mut String,
    p: &Program,
    nd: &Need,
    reduces: &Reduces,
    split: bool,
    block: bool,
) {
    let ind = "            ";
    if block {
        for &(i, c, a) in reduces {
            let at = acc_type(c, p.dtype(a));
            let _ = writeln!(
                s,
                "        acc{i} = block_reduce<{}<{at}>>(acc{i}, scratch{i});",
                functor(c)
            );
        }
        s.push_str("        if (threadIdx.x == 0) {\n");
    } else {
        s.push_str("        {\n");
    }
    if split {
        for &(i, _, _) in reduces {
            let _ = writeln!(s, "{ind}part{i}[b] = acc{i};");
        }
        s.push_str("        }\n    }\n");
        return;
    }
    // The post-map, at the kept position: inputs read at their kept base (constant along the
    // reduced axes, as check_call made sure).
    emit_values(s, ind, p, &nd.post, "kb");
    for (j, &o) in p.outputs().iter().enumerate() {
        if p.output_is_reduced(j) {
            let _ = writeln!(s, "{ind}y{j}[ko] = v{o};");
        }
    }
    s.push_str("        }\n    }\n");
}
