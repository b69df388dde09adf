//! The fused attention kernels' algorithm (`kernels/attention.cu`), emulated on the CPU in f64
//! with the kernels' own tiling, masks and loop bounds, against attention written out
//! directly and its gradients checked by central differences. No GPU needed: this checks the
//! math the CUDA C implements (the online softmax with its rescaling, the causal tile bounds of
//! each of the three kernels, the `+inf` log-sum-exp of an empty row, the backward from the
//! log-sum-exp and `D = rowsum(dO ∘ O)`, dropout's mask in the product and the backward but
//! not in the normalizer), so a wrong formula fails here and not only on a GPU.
//! The GPU tests (`kiln-autograd`'s `cuda_attention`) compare the kernels themselves with the
//! composed path.

const TILE: usize = 32;

/// One problem: `q [tq, d]`, `k [tk, d]`, `v [tk, dv]`, row-major.
struct Problem {
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
    scale: f64,
    causal: bool,
    /// Dropout probability (0: none); the mask is [`Problem::drop`].
    drop_p: f64,
}

impl Problem {
    /// `att_drop`: weight (i, j)'s multiplier, 0 or 1/(1-p), from a hash of its index (the
    /// kernels use Philox; any fixed function of the index checks the same formulas).
    fn drop(&self, i: usize, j: usize) -> f64 {
        if self.drop_p == 0.0 {
            return 1.0;
        }
        let u = values(1, (i * self.tk + j) as u64 + 12345)[0] / 3.0 + 0.5;
        if u >= self.drop_p {
            1.0 / (1.0 - self.drop_p)
        } else {
            0.0
        }
    }
    /// `att_keep` of the kernel file.
    fn keep(&self, i: usize, j: usize) -> bool {
        i < self.tq && j < self.tk && (!self.causal || j <= i)
    }
    /// `att_kend`: keys a tile of queries starting at `q0` needs.
    fn kend(&self, q0: usize) -> usize {
        if self.causal {
            self.tk.min(q0 + TILE)
        } else {
            self.tk
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `attn_fwd`: per tile of queries, the online softmax over tiles of keys (base 2, as the
/// kernel); returns `(o [tq, dv], lse [tq])`.
fn kernel_forward(p: &Problem, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (d, dv) = (p.d, p.dv);
    let scale2 = p.scale * std::f64::consts::LOG2_E;
    let mut o = vec![0.0; p.tq * dv];
    let mut lse = vec![0.0; p.tq];
    for q0 in (0..p.tq).step_by(TILE) {
        let mut m = [f64::NEG_INFINITY; TILE];
        let mut l = [0.0; TILE];
        let mut acc = vec![[0.0; TILE]; dv];
        for k0 in (0..p.kend(q0)).step_by(TILE) {
            for r in 0..TILE {
                let i = q0 + r;
                let s: Vec<f64> = (0..TILE)
                    .map(|c| {
                        let j = k0 + c;
                        if p.keep(i, j) {
                            dot(&q[i * d..(i + 1) * d], &k[j * d..(j + 1) * d]) * scale2
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let mnew = s.iter().cloned().fold(m[r], f64::max);
                let base = if mnew == f64::NEG_INFINITY { 0.0 } else { mnew };
                let alpha = (m[r] - base).exp2();
                let pr: Vec<f64> = s.iter().map(|x| (x - base).exp2()).collect();
                l[r] = l[r] * alpha + pr.iter().sum::<f64>();
                m[r] = mnew;
                for (n, a) in acc.iter_mut().enumerate() {
                    a[r] *= alpha;
                    for (c, pc) in pr.iter().enumerate() {
                        let j = k0 + c;
                        if j < p.tk {
                            a[r] += pc * p.drop(i, j) * v[j * dv + n];
                        }
                    }
                }
            }
        }
        for r in 0..TILE {
            let i = q0 + r;
            if i >= p.tq {
                continue;
            }
            let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
            for n in 0..dv {
                o[i * dv + n] = acc[n][r] * inv;
            }
            lse[i] = if l[r] > 0.0 {
                (m[r] + l[r].log2()) * std::f64::consts::LN_2
            } else {
                f64::INFINITY
            };
        }
    }
    (o, lse)
}

/// The weight `p_ij` recomputed from the log-sum-exp, as both backward kernels do.
fn weight(p: &Problem, q: &[f64], k: &[f64], lse: &[f64], i: usize, j: usize) -> f64 {
    if !p.keep(i, j) {
        return 0.0;
    }
    let s2 = dot(&q[i * p.d..(i + 1) * p.d], &k[j * p.d..(j + 1) * p.d])
        * p.scale
        * std::f64::consts::LOG2_E;
    (s2 - lse[i] * std::f64::consts::LOG2_E).exp2()
}

/// `attn_bwd_pre`, `attn_bwd_dkdv` and `attn_bwd_dq` with the kernels' loop bounds.
#[allow(clippy::too_many_arguments)]
fn kernel_backward(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    o: &[f64],
    lse: &[f64],
    g: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (d, dv) = (p.d, p.dv);
    let dr: Vec<f64> = (0..p.tq)
        .map(|i| dot(&g[i * dv..(i + 1) * dv], &o[i * dv..(i + 1) * dv]))
        .collect();
    let ds = |i: usize, j: usize| {
        let pij = weight(p, q, k, lse, i, j);
        let dp = dot(&g[i * dv..(i + 1) * dv], &v[j * dv..(j + 1) * dv]) * p.drop(i, j);
        (pij, pij * (dp - dr[i]))
    };
    let (mut dk, mut dvv) = (vec![0.0; p.tk * d], vec![0.0; p.tk * dv]);
    for k0 in (0..p.tk).step_by(TILE) {
        let start = if p.causal { k0 } else { 0 };
        for q0 in (start..p.tq).step_by(TILE) {
            for j in k0..(k0 + TILE).min(p.tk) {
                for i in q0..(q0 + TILE).min(p.tq) {
                    let (pij, dsij) = ds(i, j);
                    let pij = pij * p.drop(i, j);
                    for n in 0..dv {
                        dvv[j * dv + n] += pij * g[i * dv + n];
                    }
                    for c in 0..d {
                        dk[j * d + c] += dsij * q[i * d + c] * p.scale;
                    }
                }
            }
        }
    }
    let mut dq = vec![0.0; p.tq * d];
    for q0 in (0..p.tq).step_by(TILE) {
        for k0 in (0..p.kend(q0)).step_by(TILE) {
            for i in q0..(q0 + TILE).min(p.tq) {
                for j in k0..(k0 + TILE).min(p.tk) {
                    let (_, dsij) = ds(i, j);
                    for c in 0..d {
                        dq[i * d + c] += dsij * k[j * d + c] * p.scale;
                    }
                }
            }
        }
    }
    (dq, dk, dvv)
}

/// Attention written out directly: softmax of each row's kept scores, zeros for an empty row.
fn direct(p: &Problem, q: &[f64], k: &[f64], v: &[f64]) -> Vec<f64> {
    let mut o = vec![0.0; p.tq * p.dv];
    for i in 0..p.tq {
        let s: Vec<Option<f64>> = (0..p.tk)
            .map(|j| {
                p.keep(i, j)
                    .then(|| dot(&q[i * p.d..(i + 1) * p.d], &k[j * p.d..(j + 1) * p.d]) * p.scale)
            })
            .collect();
        let m = s
            .iter()
            .flatten()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue;
        }
        let e: Vec<f64> = s.iter().map(|x| x.map_or(0.0, |x| (x - m).exp())).collect();
        let z: f64 = e.iter().sum();
        for n in 0..p.dv {
            o[i * p.dv + n] = (0..p.tk)
                .map(|j| e[j] / z * p.drop(i, j) * v[j * p.dv + n])
                .sum();
        }
    }
    o
}

/// Deterministic values in about [-1.5, 1.5].
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 * 3.0 - 1.5
        })
        .collect()
}

#[track_caller]
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// The gradient of `sum(g ∘ direct(q, k, v))` along each input, by central differences.
fn numeric_grads(p: &Problem, q: &[f64], k: &[f64], v: &[f64], g: &[f64]) -> [Vec<f64>; 3] {
    let eps = 1e-5;
    let f = |q: &[f64], k: &[f64], v: &[f64]| dot(&direct(p, q, k, v), g);
    let mut out: [Vec<f64>; 3] = Default::default();
    for (w, x) in [q, k, v].into_iter().enumerate() {
        out[w] = (0..x.len())
            .map(|e| {
                let mut plus = x.to_vec();
                let mut minus = x.to_vec();
                plus[e] += eps;
                minus[e] -= eps;
                let mut args = [q.to_vec(), k.to_vec(), v.to_vec()];
                args[w] = plus;
                let fp = f(&args[0], &args[1], &args[2]);
                args[w] = minus;
                let fm = f(&args[0], &args[1], &args[2]);
                (fp - fm) / (2.0 * eps)
            })
            .collect();
    }
    out
}

fn check(tq: usize, tk: usize, d: usize, dv: usize, causal: bool, grads: bool) {
    for drop_p in [0.0, 0.3] {
        check_with(tq, tk, (d, dv), causal, drop_p, grads);
    }
}

fn check_with(
    tq: usize,
    tk: usize,
    (d, dv): (usize, usize),
    causal: bool,
    drop_p: f64,
    grads: bool,
) {
    let p = Problem {
        tq,
        tk,
        d,
        dv,
        scale: 1.0 / (d as f64).sqrt(),
        causal,
        drop_p,
    };
    let what = format!("tq {tq} tk {tk} d {d} dv {dv} causal {causal} dropout {drop_p}");
    let seed = (tq * 1000 + tk * 10 + d) as u64;
    let (q, k, v) = (
        values(tq * d, seed),
        values(tk * d, seed + 1),
        values(tk * dv, seed + 2),
    );
    let g = values(tq * dv, seed + 3);
    let (o, lse) = kernel_forward(&p, &q, &k, &v);
    assert_close(
        &format!("{what}: output"),
        &o,
        &direct(&p, &q, &k, &v),
        1e-12,
    );
    let (dq, dk, dvv) = kernel_backward(&p, &q, &k, &v, &o, &lse, &g);
    if grads {
        let [nq, nk, nv] = numeric_grads(&p, &q, &k, &v, &g);
        assert_close(&format!("{what}: dq"), &dq, &nq, 1e-7);
        assert_close(&format!("{what}: dk"), &dk, &nk, 1e-7);
        assert_close(&format!("{what}: dv"), &dvv, &nv, 1e-7);
    }
}

#[test]
fn forward_matches_direct_attention() {
    for causal in [false, true] {
        // Tiles of 32: one partial tile, exact tiles, several tiles with a remainder, Tq != Tk.
        for (tq, tk) in [(5, 5), (32, 32), (70, 70), (40, 75), (75, 40), (1, 33)] {
            check(tq, tk, 8, 6, causal, false);
        }
    }
}

#[test]
fn backward_matches_central_differences() {
    for causal in [false, true] {
        for (tq, tk) in [(5, 7), (37, 37), (33, 70), (70, 33)] {
            check(tq, tk, 4, 3, causal, true);
        }
    }
}

/// Causal with `Tq > Tk`: the last queries see every key; no row is empty. And a row that is
/// empty (a query with no key, reachable only with `Tk = 0` in the kernels) gets zeros and a
/// log-sum-exp of `+inf`, whose weights recompute to 0.
#[test]
fn empty_rows_give_zeros_and_infinite_lse() {
    let p = Problem {
        tq: 3,
        tk: 0,
        d: 2,
        dv: 2,
        scale: 1.0,
        causal: false,
        drop_p: 0.0,
    };
    let (o, lse) = kernel_forward(&p, &values(6, 1), &[], &[]);
    assert!(o.iter().all(|&x| x == 0.0));
    assert!(lse.iter().all(|&x| x == f64::INFINITY));
}
