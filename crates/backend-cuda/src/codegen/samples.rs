//! The sample programs `cargo xtask check-kernels` compiles with NVRTC (no GPU needed).

use kiln_core::expr::{Combine, Expr, Program};
use kiln_core::{BinaryOp, CmpOp, DType, Result, UnaryOp};

use super::{Access, Strategy, Variant, source};

/// Sample programs in every strategy, both index widths and every access mode, with every
/// instruction kind: what `cargo xtask check-kernels` compiles (no GPU needed), so that a
/// generator change that breaks NVRTC fails CI.
pub(crate) fn sample_sources() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::I64, DType::F16, DType::BF16] {
        let Some(sel) = map_samples(dtype, &mut out) else {
            continue;
        };
        reduction_samples(dtype, &sel, &mut out);
    }
    half_cast_samples(&mut out);
    update_samples(&mut out);
    out
}

/// The generated source of `p` (16-bit programs in their widened form, as `expr_run` runs
/// them).
fn source_of(p: &Program, v: &Variant) -> Result<String> {
    source(&p.widened()?, v)
}

/// Elementwise programs in `dtype`: every unary and binary op in one chain under a comparison
/// and a `where` (plain and wide indices), the 16-byte vector loop, and mixed element sizes in
/// vectors. Returns the selected chain the reductions build on (`None` when `dtype` has none).
fn map_samples(dtype: DType, out: &mut Vec<(String, String)>) -> Option<Expr> {
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
    let map = Program::from_exprs(&ins, &[sel.clone(), x.to_dtype(DType::U8)]).ok()?;
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
        if let Ok(src) = source_of(&map, &v) {
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
        if let Ok(src) = source_of(&vmap, &v) {
            out.push((format!("expr map, 16-byte vectors ({dtype})"), src));
        }
        // a strided operand constant across each vector (a per-channel scale)
        let v = Variant {
            access: vec![Access::Contig, Access::Strided],
            ..v
        };
        if let Ok(src) = source_of(&vmap, &v) {
            out.push((
                format!("expr map, vectors with a strided row ({dtype})"),
                src,
            ));
        }
    }
    // mixed element sizes vectorize by the widest: a comparison (u8 out), `where` over a
    // u8 mask, a cast to u8 (the lone ops of `ops::single`)
    let mixed = Program::from_exprs(
        &[dtype, dtype, DType::U8],
        &[
            x.compare(CmpOp::Le, &y),
            mask.where_cond(&x, &y),
            x.to_dtype(DType::U8),
        ],
    );
    if let Ok(mixed) = mixed {
        let v = Variant {
            wide: false,
            strategy: Strategy::Elementwise,
            vec: (16 / dtype.size_in_bytes()) as u32,
            access: vec![Access::Contig, Access::Bcast, Access::Contig],
        };
        if let Ok(src) = source_of(&mixed, &v) {
            out.push((format!("expr map, mixed sizes in vectors ({dtype})"), src));
        }
    }
    Some(sel)
}

/// Reductions of `sel` along the last axis with work after them, for every combine, in each
/// reduction strategy (and f32's split reduction with 16-byte loads).
fn reduction_samples(dtype: DType, sel: &Expr, out: &mut Vec<(String, String)>) {
    for c in Combine::ALL {
        let red = sel.reduce(c, &[-1]);
        let post = red.binary(BinaryOp::Add, Expr::input(3)) * 2.0;
        let ins4 = [dtype, dtype, DType::U8, dtype];
        let Ok(rp) = Program::from_exprs(&ins4, &[post, sel.clone(), red]) else {
            continue;
        };
        use Access::{Bcast, Contig, Strided};
        if matches!(dtype, DType::F32 | DType::BF16) {
            // groups of 4 per load: contiguous rows, strided rows (an input and an
            // elementwise output), broadcast operands
            for (strategy, access) in [
                (Strategy::Split, [Contig; 5]),
                (Strategy::Split, [Strided, Contig, Bcast, Bcast, Strided]),
                (Strategy::Block, [Contig, Strided, Bcast, Bcast, Contig]),
            ] {
                let v = Variant {
                    wide: false,
                    strategy,
                    vec: 4,
                    access: access.to_vec(),
                };
                if let Ok(src) = source_of(&rp, &v) {
                    let name = format!("expr {} ({dtype}, {strategy:?}, loads of 4)", c.name());
                    out.push((format!("{name} {access:?}"), src));
                }
            }
        }
        for (strategy, wide, access) in [
            (
                Strategy::Block,
                false,
                [Contig, Strided, Contig, Bcast, Contig],
            ),
            (
                Strategy::Split,
                false,
                [Contig, Contig, Bcast, Bcast, Contig],
            ),
            (
                Strategy::Thread,
                true,
                [Strided, Contig, Bcast, Bcast, Strided],
            ),
        ] {
            let v = Variant {
                wide,
                strategy,
                vec: 0,
                access: access.to_vec(),
            };
            if let Ok(src) = source_of(&rp, &v) {
                let name = format!("expr {} ({dtype}, {strategy:?}, wide {wide})", c.name());
                out.push((name, src));
            }
        }
    }
}

/// Casts between the 16-bit floats and every dtype, 16-bit vectors (8 per 16 bytes).
fn half_cast_samples(out: &mut Vec<(String, String)>) {
    for half in [DType::F16, DType::BF16] {
        let x = Expr::input(0);
        for other in [
            DType::F32,
            DType::F64,
            DType::I64,
            DType::U8,
            DType::F16,
            DType::BF16,
        ] {
            let Ok(p) = Program::from_exprs(
                &[half, other],
                &[
                    x.to_dtype(other),
                    Expr::input(1).to_dtype(half),
                    x.clone() + Expr::input(1).to_dtype(half),
                ],
            ) else {
                continue;
            };
            let v = Variant {
                wide: false,
                strategy: Strategy::Elementwise,
                vec: (16 / half.size_in_bytes().max(other.size_in_bytes())) as u32,
                access: vec![Access::Contig, Access::Contig],
            };
            if let Ok(src) = source_of(&p, &v) {
                out.push((format!("expr casts {half} <-> {other} (vectors)"), src));
            }
        }
    }
}

/// The optimizers' multi-tensor updates (fused.rs): every rule's program, in every float
/// dtype (16-bit ones widened, as fused.rs runs them), with and without a gradient scale.
fn update_samples(out: &mut Vec<(String, String)>) {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for rule in sample_update_rules() {
            for scaled in [false, true] {
                let Ok((p, _)) = rule.program_scaled(dtype, scaled) else {
                    continue;
                };
                let Ok(p) = p.widened() else { continue };
                if let Ok(src) = super::multi_tensor_source(&p, usize::from(scaled)) {
                    let how = if scaled { ", scaled" } else { "" };
                    out.push((format!("multi-tensor {rule:?} ({dtype}{how})"), src));
                }
            }
        }
    }
}

/// One update rule of each program shape: SGD plain, with momentum (first and later steps,
/// Nesterov, weight decay), Adam and AdamW.
pub(crate) fn sample_update_rules() -> Vec<kiln_core::UpdateRule> {
    use kiln_core::UpdateRule;
    let sgd = |momentum, nesterov, first_step, weight_decay| UpdateRule::Sgd {
        lr: 0.1,
        momentum,
        dampening: 0.1,
        nesterov,
        weight_decay,
        first_step,
    };
    let adam = |decoupled| UpdateRule::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
    };
    vec![
        sgd(0.0, false, false, 0.0),
        sgd(0.9, false, true, 1e-4),
        sgd(0.9, true, false, 1e-4),
        adam(false),
        adam(true),
    ]
}
