//! Unit tests of the generated source (compared as text) and of the launch plan.

use super::plan::{ONE_BLOCK_MAX, SPLIT_BLOCKS, SPLIT_MIN_PART};
use super::*;
use kiln_core::expr::Expr;
use kiln_core::{Layout, Shape};

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

/// A lone op with a scalar (`Backend::binary_scalar`) reads the scalar as a kernel argument,
/// never as a literal: one kernel serves every value.
#[test]
fn a_scalar_operand_is_a_kernel_parameter() {
    for (lhs, call) in [
        (false, "op_sub<double>(v0, v1)"),
        (true, "op_sub<double>(v1, v0)"),
    ] {
        let (x, s) = if lhs { (1, 0) } else { (0, 1) };
        let code = vec![
            Instr::Input(0),
            Instr::Param(0),
            Instr::Binary(kiln_core::BinaryOp::Sub, x, s),
        ];
        let p = Program::new(vec![DType::F64], vec![DType::F64], code, vec![2], vec![]).unwrap();
        let v = Variant {
            wide: false,
            strategy: Strategy::Elementwise,
            vec: 2,
            access: vec![Access::Contig],
        };
        let b = source(&p, &v).unwrap();
        let b = body(&b);
        assert!(b.contains("double p0"), "{b}");
        assert!(at(b, "const double v1 = p0;") < at(b, "for (u64 w"), "{b}");
        assert!(b.contains(call), "{b}");
        assert!(!b.contains("__longlong_as_double"), "no literal: {b}");
    }
}

/// Mixed element sizes vectorize by the widest (a comparison of f32 loads 4 floats and
/// stores 4 bytes, as the old hand-written kernel did); an input not aligned to its vector, or
/// a strided one, turns vectors off.
/// No strided operand's rows (see `vec_elems`).
const NO_ROWS: (&[usize], &[Vec<usize>]) = (&[], &[]);

#[test]
fn vector_width_follows_the_widest_contiguous_operand() {
    use kiln_core::CmpOp;
    let (x, y, m) = (Expr::input(0), Expr::input(1), Expr::input(2));
    let cmp = |d: DType| prog(&[d, d], &[x.compare(CmpOp::Lt, &y)]);
    let contig = [Access::Contig, Access::Contig];
    assert_eq!(vec_elems(&cmp(DType::F32), &contig, NO_ROWS, |_| 256), 4);
    assert_eq!(vec_elems(&cmp(DType::F64), &contig, NO_ROWS, |_| 256), 2);
    assert_eq!(vec_elems(&cmp(DType::U8), &contig, NO_ROWS, |_| 256), 16);
    assert_eq!(
        vec_elems(&cmp(DType::F32), &contig, NO_ROWS, |k| 256 + 8 * k as u64),
        0
    );
    let strided = [Access::Contig, Access::Strided];
    assert_eq!(vec_elems(&cmp(DType::F32), &strided, NO_ROWS, |_| 256), 0);
    // A strided operand constant along rows that the width divides (a per-channel scale over
    // [n, c, h·w]) reads once per vector; rows of 6, or a stride along the row, turn vectors
    // off.
    let per_channel = vec![vec![], vec![0, 1, 0]];
    let rows = |hw: usize| vec![2, 3, hw];
    let f32s = cmp(DType::F32);
    assert_eq!(
        vec_elems(&f32s, &strided, (&rows(8), &per_channel), |_| 256),
        4
    );
    assert_eq!(
        vec_elems(&f32s, &strided, (&rows(6), &per_channel), |_| 256),
        0
    );
    let along = vec![vec![], vec![0, 8, 1]];
    assert_eq!(vec_elems(&f32s, &strided, (&rows(8), &along), |_| 256), 0);
    // `where` over a u8 mask and f32 branches: the mask moves 4 bytes at a time, so it must
    // be 4-byte aligned, not 16.
    let w = prog(
        &[DType::F32, DType::F32, DType::U8],
        &[m.where_cond(&x, &y)],
    );
    let three = [Access::Contig, Access::Bcast, Access::Contig];
    assert_eq!(
        vec_elems(&w, &three, NO_ROWS, |k| if k == 2 { 260 } else { 256 }),
        4
    );
    assert_eq!(
        vec_elems(&w, &three, NO_ROWS, |k| if k == 2 { 258 } else { 256 }),
        0
    );
    // A cast f32 -> f64: 2 elements (8 bytes in, 16 out).
    let c = prog(&[DType::F32], &[x.to_dtype(DType::F64)]);
    assert_eq!(vec_elems(&c, &[Access::Contig], NO_ROWS, |_| 8), 2);
    assert_eq!(vec_elems(&c, &[Access::Contig], NO_ROWS, |_| 4), 0);
    // Only broadcast inputs: the output alone sets the width.
    let b = prog(&[DType::F32], &[&x + 1.0]);
    assert_eq!(vec_elems(&b, &[Access::Bcast], NO_ROWS, |_| 4), 4);
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
        "const Vec<float, 4> w0 = *(const Vec<float, 4>*)(x0 + kb0 + (I)(g * 4));",
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
    assert_eq!(split_parts(1, ONE_BLOCK_MAX), 1);
    assert_eq!(split_parts(1, 10 * SPLIT_MIN_PART), 10);
    assert_eq!(
        split_parts(1, 384 * 1536),
        72,
        "a GPT weight's norm: 72 blocks"
    );
    assert_eq!(split_parts(4, 1 << 26), SPLIT_BLOCKS / 4);
    assert_eq!(split_parts(4096, 1 << 20), 1, "enough blocks already");
    // Batch norm's statistics: 128 channels of 64K elements split to fill the device, 512
    // channels of 4K need not; a small reduction stays one launch.
    assert_eq!(split_parts(128, 256 * 16 * 16), 8);
    assert_eq!(split_parts(256, 256 * 8 * 8), 2);
    assert_eq!(split_parts(512, 256 * 4 * 4), 1);
    assert_eq!(split_parts(64, 4096), 1);
    let x = Expr::input(0);
    let p = prog(&[DType::F32], &[(&x * &x).sum(&[0, 1])]);
    let shape = Shape::new([2048, 2048]);
    let l = Layout::contiguous(shape.clone());
    let g = plan(&p, &shape, &[&l], &[0, 1]).unwrap();
    assert_eq!(g.variant.strategy, Strategy::Split);
    assert_eq!((g.n, g.n_red, g.parts), (1, 1 << 22, 512));
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
    assert!(literal(Scalar::new(0.1, DType::F64)).contains(&format!("{:016x}", 0.1f64.to_bits())));
    assert!(literal(Scalar::new(0.1, DType::F32)).contains(&format!("{:08x}", 0.1f32.to_bits())));
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

/// The multi-tensor kernel of an update rule finds its tensor, loads every input before it
/// stores (so an update in place is exact), takes the hyperparameters as kernel arguments,
/// and its argument words put each operand's pointers where the struct declares them.
#[test]
fn multi_tensor_kernels_run_the_rules_program() {
    let rule = kiln_core::UpdateRule::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
        bias_correction1: 0.1,
        bias_correction2: 0.01,
    };
    let (p, params) = rule.program(DType::F32).unwrap();
    let src = multi_tensor_source(&p, 0).unwrap();
    let b = body(&src);
    assert!(
        src.contains(&format!("u64 start[{}];", MT_MAX + 1)),
        "{src}"
    );
    for k in 0..4 {
        assert!(src.contains(&format!("u64 x{k}[{MT_MAX}];")), "{src}");
    }
    assert!(src.contains(&format!("u64 y2[{MT_MAX}];")), "{src}");
    assert!(!src.contains("u64 y3["), "three outputs: {src}");
    for k in 0..params.len() {
        assert!(b.contains(&format!("float p{k}")), "{b}");
    }
    assert!(
        !b.contains("__int_as_float"),
        "hyperparameters are arguments: {b}"
    );
    let first_store = at(b, "((float*)a.y");
    for k in 0..4 {
        assert!(
            at(b, &format!("((const float*)a.x{k}[lo])[e]")) < first_store,
            "{b}"
        );
    }
    assert!(at(b, "op_sqrt<float>") < first_store, "{b}");
    // Two tensors of 3 and 5 elements: start, count, then x0..x3, y0..y2 per tensor.
    let w = multi_tensor_args(&p, &[3, 5], |m, t| (100 * m + t) as u64);
    assert_eq!(w.len(), MT_MAX + 2 + 7 * MT_MAX);
    assert_eq!(&w[..3], &[0, 3, 8]);
    assert_eq!(w[MT_MAX + 1], 2);
    let at_op = |m: usize, t: usize| w[MT_MAX + 2 + m * MT_MAX + t];
    assert_eq!((at_op(0, 0), at_op(0, 1), at_op(6, 1)), (0, 1, 601));
    assert!(multi_tensor_source(&prog(&[DType::F32], &[Expr::input(0).sum(&[0])]), 0).is_err());
    // With a gradient scale: a fifth input, read at its one element by every thread, and the
    // gradient multiplied by it.
    let (p, _) = rule.program_scaled(DType::F32, true).unwrap();
    let src = multi_tensor_source(&p, 1).unwrap();
    let b = body(&src);
    assert!(src.contains(&format!("u64 x4[{MT_MAX}];")), "{src}");
    assert!(b.contains("((const float*)a.x4[lo])[0]"), "{b}");
    assert!(!b.contains("((const float*)a.x4[lo])[e]"), "{b}");
    assert!(b.contains("((const float*)a.x1[lo])[e]"), "{b}");
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
        if let Err(log) =
            crate::nvrtc::compile_source(crate::nvrtc::Flavor::Generated, "expr.cu", &src, 90)
        {
            panic!("{name} does not compile:\n{log}\n{}", body(&src));
        }
    }
}

/// A 16-bit program compiles in its widened form: 16-bit loads and stores (8 elements per
/// 16-byte vector), f32 arithmetic, one rounding per instruction; the unwidened program is a
/// typed error, not wrong code.
#[test]
fn half_programs_load_and_store_16_bits_and_compute_in_f32() {
    let (x, y) = (Expr::input(0), Expr::input(1));
    for (dtype, t) in [(DType::F16, "f16"), (DType::BF16, "bf16")] {
        let p = prog(&[dtype, dtype], &[(&x * &y).exp() + Expr::param(0)]);
        let v = Variant {
            wide: false,
            strategy: Strategy::Elementwise,
            vec: 8,
            access: vec![Access::Contig, Access::Contig],
        };
        assert!(
            source(&p, &v).is_err(),
            "16-bit arithmetic must be widened first"
        );
        let src = source(&p.widened().unwrap(), &v).unwrap();
        let b = body(&src);
        assert!(b.contains(&format!("const {t}* __restrict__ x0")), "{b}");
        assert!(b.contains(&format!("{t}* __restrict__ y0")), "{b}");
        assert!(b.contains("float p0"), "{b}");
        assert!(b.contains("const int VN = 8;"), "{b}");
        assert!(b.contains(&format!("const Vec<{t}, VN> w0")), "{b}");
        assert!(b.contains(&format!("cast_to<{t}, float>")), "{b}");
        assert!(b.contains(&format!("cast_to<float, {t}>")), "{b}");
        assert!(b.contains("op_mul<float>"), "{b}");
        assert!(b.contains("op_exp<float>"), "{b}");
        assert!(!b.contains(&format!("op_mul<{t}>")), "{b}");
    }
    let casts = sample_sources()
        .into_iter()
        .filter(|(n, _)| n.starts_with("expr casts"))
        .count();
    assert_eq!(casts, 12, "a cast sample per 16-bit type and dtype");
}

/// A reduction of 16-bit values accumulates in f32 (sums in f64, as for f32) and rounds the
/// result once.
#[test]
fn half_reductions_accumulate_wide() {
    let x = Expr::input(0);
    let p = prog(&[DType::BF16], &[x.sum(&[-1])]).widened().unwrap();
    let v = Variant {
        wide: false,
        strategy: Strategy::Block,
        vec: 0,
        access: vec![Access::Contig],
    };
    let src = source(&p, &v).unwrap();
    let b = body(&src);
    assert!(b.contains("double acc"), "{b}");
    assert!(b.contains("cast_to<float, bf16>"), "{b}");
    assert_eq!(split_partials(&p), vec![DType::F64]);
}
