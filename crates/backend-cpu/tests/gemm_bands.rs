//! Products from a few million multiply-adds up are split across cores (by rows, columns or
//! depth, whichever duplicates least; see `matmul.rs`), each part on its own thread. The
//! conformance suite's shapes stay below that threshold, so check the split paths here against
//! f64 dot products: one shape per kind of split, with a plain and a transposed left operand,
//! odd sizes (uneven parts), and several threads multiplying at once (the helper threads are
//! then busy and callers compute those parts themselves).

use kiln_backend_cpu::Cpu;
use kiln_core::{Generator, Tensor};

/// Checks `lhs · b` at a few positions against f64 sums.
fn check(lhs: &Tensor<Cpu>, b: &Tensor<Cpu>, what: &str) {
    let (m, k) = (lhs.dims()[0], lhs.dims()[1]);
    let n = b.dims()[1];
    let c = lhs.matmul(b).unwrap().to_vec::<f32>().unwrap();
    let l = lhs.contiguous().unwrap().to_vec::<f32>().unwrap();
    let bv = b.to_vec::<f32>().unwrap();
    for &(i, j) in &[
        (0, 0),
        (m / 2, 7),
        (m / 2 + 1, n - 1),
        (m - 1, n / 2),
        (m - 2, 0),
    ] {
        let want: f64 = (0..k)
            .map(|p| l[i * k + p] as f64 * bv[p * n + j] as f64)
            .sum();
        let got = c[i * n + j] as f64;
        assert!(
            (got - want).abs() < 1e-3,
            "{what}: c[{i}][{j}] = {got}, want {want}"
        );
    }
}

fn operands(m: usize, k: usize) -> [(Tensor<Cpu>, &'static str); 2] {
    let dev = Cpu::device(0);
    let a = Generator::new(1).randn::<Cpu>([m, k], &dev).unwrap();
    let at = Generator::new(1).randn::<Cpu>([k, m], &dev).unwrap();
    [(a, "a"), (at.t().unwrap(), "a.T")]
}

fn rhs(k: usize, n: usize) -> Tensor<Cpu> {
    Generator::new(2)
        .randn::<Cpu>([k, n], &Cpu::device(0))
        .unwrap()
}

#[test]
fn split_gemm_matches_f64_dot_products() {
    // rows (b is no larger than a), depth (long k, small output), columns (wide b)
    for (m, k, n) in [(301, 400, 300), (101, 785, 99), (99, 101, 785)] {
        let b = rhs(k, n);
        for (lhs, name) in operands(m, k) {
            check(&lhs, &b, &format!("{m}x{k}x{n} {name}"));
        }
    }
}

#[test]
fn split_gemm_from_several_threads_at_once() {
    let (m, k, n) = (101, 785, 99);
    let b = rhs(k, n);
    let [(a, _), (at, _)] = operands(m, k);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (a, at, b) = (&a, &at, &b);
            s.spawn(move || {
                for _ in 0..5 {
                    check(if t % 2 == 0 { a } else { at }, b, &format!("thread {t}"));
                }
            });
        }
    });
}

#[test]
fn a_large_matrix_vector_product_split_by_rows_is_exact_in_every_row() {
    // 1001 x 2100 (2.1 M multiply-adds, above the split threshold; an odd row count, so the
    // parts are uneven), the matrix row-major and transposed (column-major, as a gradient
    // `xᵀ · g`): every row against f64, so a part copied to the wrong rows shows.
    let dev = Cpu::device(0);
    let (m, k) = (1001, 2100);
    let v = Generator::new(4).randn::<Cpu>([k, 1], &dev).unwrap();
    for (a, what) in operands(m, k) {
        let c = a.matmul(&v).unwrap().to_vec::<f32>().unwrap();
        let av = a.contiguous().unwrap().to_vec::<f32>().unwrap();
        let vv = v.to_vec::<f32>().unwrap();
        for (i, &got) in c.iter().enumerate() {
            let want: f64 = (0..k).map(|p| av[i * k + p] as f64 * vv[p] as f64).sum();
            assert!(
                (got as f64 - want).abs() < 1e-3,
                "{what}: row {i}: {got}, want {want}"
            );
        }
        // The same product on one thread at a time from several callers (helpers busy).
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let (a, v) = (a.clone(), v.clone());
                std::thread::spawn(move || a.matmul(&v).unwrap().to_vec::<f32>().unwrap())
            })
            .collect();
        for h in hs {
            assert_eq!(
                h.join().unwrap(),
                c,
                "{what}: the same bits whoever computes each part"
            );
        }
    }
}

#[test]
fn small_matrix_vector_products_are_exact_in_every_row() {
    // Below the split threshold: row-major matrices go four rows at a time from the last
    // block down, then the leftover rows; every row count mod 4 and a depth with a remainder
    // past the 16-lane chunks, each row against f64 (a block written to the wrong rows shows).
    let dev = Cpu::device(0);
    for (m, k) in [(1, 5), (3, 17), (4, 16), (6, 33), (401, 785), (400, 784)] {
        let v = Generator::new(5).randn::<Cpu>([k, 1], &dev).unwrap();
        let vv = v.to_vec::<f32>().unwrap();
        for (a, what) in operands(m, k) {
            let c = a.matmul(&v).unwrap().to_vec::<f32>().unwrap();
            let av = a.contiguous().unwrap().to_vec::<f32>().unwrap();
            for (i, &got) in c.iter().enumerate() {
                let want: f64 = (0..k).map(|p| av[i * k + p] as f64 * vv[p] as f64).sum();
                assert!(
                    (got as f64 - want).abs() < 1e-3,
                    "{what} {m}x{k}: row {i}: {got}, want {want}"
                );
            }
        }
    }
}

#[test]
fn products_of_depth_contiguous_operands_match_f64_in_every_element() {
    // `x · Wᵀ` (both operands contiguous along the depth: the AVX-512 `gemm_nt` path where the
    // CPU has it, or `gemm_nn` over a row-major copy of Wᵀ for tall products of short depth):
    // below and above the split threshold, sizes off the 4x4 tile and the 16-lane vector, a
    // batch with a broadcast weight; every element against f64, and the first rows of a split
    // product bit for bit against the same rows computed alone (no split).
    let dev = Cpu::device(0);
    for (batch, m, k, n, split) in [
        (1, 2, 16, 2, false),
        (1, 5, 17, 7, false),
        (1, 100, 100, 100, false),
        (1, 37, 33, 10, false),
        (1, 100, 784, 100, true),
        (1, 101, 785, 99, true),
        (1, 301, 400, 30, false),
        (3, 9, 33, 6, false),
        (2, 20, 40, 3, false),
    ] {
        let x = Generator::new(6).randn::<Cpu>([batch, m, k], &dev).unwrap();
        let w = Generator::new(7).randn::<Cpu>([n, k], &dev).unwrap();
        let wt = w.t().unwrap().unsqueeze(0).unwrap();
        let wt = wt.broadcast_to([batch, k, n]).unwrap();
        let c = x.matmul(&wt).unwrap().to_vec::<f32>().unwrap();
        let (xv, wv) = (x.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
        for bi in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| xv[(bi * m + i) * k + p] as f64 * wv[j * k + p] as f64)
                        .sum();
                    let got = c[(bi * m + i) * n + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-3,
                        "{batch}x{m}x{k}x{n}: c[{bi}][{i}][{j}] = {got}, want {want}"
                    );
                }
            }
        }
        if split {
            let top = x.narrow(1, 0, 2).unwrap().matmul(&wt).unwrap();
            assert_eq!(
                top.to_vec::<f32>().unwrap(),
                x.matmul(&wt)
                    .unwrap()
                    .narrow(1, 0, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap(),
                "{batch}x{m}x{k}x{n}: rows alone and in a split product differ"
            );
        }
    }
}

#[test]
fn products_with_a_row_major_right_operand_keep_their_bits_when_split() {
    // `a · b` with `b` row-major (the AVX-512 `gemm_nn` path where the CPU has it), `a` plain
    // and transposed (`gᵀ · x`): above the split threshold (100x100x784, a small MLP's first
    // weight gradient) and below, against f64 (`check`), and the first rows computed alone
    // give the same bits as in the whole (split) product.
    for (m, k, n) in [
        (100, 100, 784),
        (100, 100, 100),
        (13, 7, 33),
        (301, 400, 300),
    ] {
        let b = rhs(k, n);
        for (lhs, name) in operands(m, k) {
            let what = format!("{m}x{k}x{n} {name}");
            check(&lhs, &b, &what);
            let top = lhs.narrow(0, 0, 3).unwrap().matmul(&b).unwrap();
            let whole = lhs.matmul(&b).unwrap().narrow(0, 0, 3).unwrap();
            assert_eq!(
                top.to_vec::<f32>().unwrap(),
                whole.contiguous().unwrap().to_vec::<f32>().unwrap(),
                "{what}: rows alone and in a split product differ"
            );
        }
    }
}
