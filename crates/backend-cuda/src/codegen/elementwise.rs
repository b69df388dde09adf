//! The body of an elementwise kernel: a grid-stride loop over the elements, after a loop of
//! 16-byte vectors when the variant allows it.

use std::fmt::Write as _;

use kiln_core::expr::Program;

use super::{Access, Need, Variant, emit_offsets, emit_values, emit_values_with};
use crate::sources::ctype;

pub(super) fn elementwise_body(s: &mut String, p: &Program, v: &Variant, nd: &Need) {
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
/// per iteration, each contiguous input loaded and each output stored as one `Vec` (16 bytes
/// for the widest of them), each strided one (constant across the vector) read once.
fn vector_loop(s: &mut String, p: &Program, v: &Variant, nd: &Need) {
    let _ = writeln!(s, "    const int VN = {};", v.vec);
    s.push_str("    const u64 nv = n / VN;\n");
    s.push_str("    for (u64 w = KILN_TID; w < nv; w += KILN_NTHREADS) {\n");
    // A strided operand is constant across the vector (see `vec_elems`): one offset for it.
    let strided: Vec<usize> = (0..v.access.len())
        .filter(|&k| v.access[k] == Access::Strided)
        .collect();
    emit_offsets(
        s,
        "        ",
        "(w * VN)",
        "d",
        "s",
        "off",
        &|_| "0".into(),
        &strided,
    );
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
        Access::Strided => format!("x{k}[off{k}]"),
        Access::Bcast => format!("x{k}[0]"),
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
