//! `batch_norm` (training and evaluation), `group_norm`, `update_running_stats`,
//! `avg_pool2d` and `adaptive_avg_pool2d` on variables, against values derived by hand: the
//! forward and the gradients written out as plain f64 loops here (independently of the programs
//! and GEMMs the ops run), on the f64 reference backend and the CPU backend, in f64 and f32,
//! with contiguous and strided inputs; and the typed errors. (PyTorch's values are compared in
//! `torch_f64_layers.rs`; the generic gradient suite checks the same ops on random shapes on
//! every backend.)

mod common;

use common::{assert_close, f64s, normal};
use kiln_autograd::{Var, update_running_stats};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Error, Tensor};

/// What a normalization gives by hand: output, dx, dw, db, and per statistic group the mean,
/// the biased and the unbiased variance.
struct Hand {
    y: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
    mean: Vec<f64>,
    var: Vec<f64>,
    var_unbiased: Vec<f64>,
}

/// Batch norm (`groups == None`: one statistic per channel over n and the spatial positions)
/// or group norm (one per sample and group) of `x` `[n, c, s]` (row-major, `s` the flattened
/// spatial size), by the textbook formulas.
#[allow(clippy::too_many_arguments)]
fn by_hand(
    x: &[f64],
    g: &[f64],
    [n, c, s]: [usize; 3],
    groups: Option<usize>,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
) -> Hand {
    let key = |i: usize, ch: usize| match groups {
        None => ch,
        Some(gr) => i * gr + ch / (c / gr),
    };
    let nkeys = groups.map_or(c, |gr| n * gr);
    let idx = |i: usize, ch: usize, p: usize| (i * c + ch) * s + p;
    let mut cnt = vec![0.0; nkeys];
    let mut sum = vec![0.0; nkeys];
    for i in 0..n {
        for ch in 0..c {
            for p in 0..s {
                cnt[key(i, ch)] += 1.0;
                sum[key(i, ch)] += x[idx(i, ch, p)];
            }
        }
    }
    let mean: Vec<f64> = sum.iter().zip(&cnt).map(|(s, c)| s / c).collect();
    let mut ss = vec![0.0; nkeys];
    for i in 0..n {
        for ch in 0..c {
            for p in 0..s {
                ss[key(i, ch)] += (x[idx(i, ch, p)] - mean[key(i, ch)]).powi(2);
            }
        }
    }
    let var: Vec<f64> = ss.iter().zip(&cnt).map(|(s, c)| s / c).collect();
    let var_unbiased: Vec<f64> = ss.iter().zip(&cnt).map(|(s, c)| s / (c - 1.0)).collect();
    let rstd: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let wc = |ch: usize| w.map_or(1.0, |w| w[ch]);
    let xhat = |i, ch, p| (x[idx(i, ch, p)] - mean[key(i, ch)]) * rstd[key(i, ch)];
    let (mut m1, mut m2) = (vec![0.0; nkeys], vec![0.0; nkeys]);
    let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
    let mut y = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            for p in 0..s {
                let (k, j) = (key(i, ch), idx(i, ch, p));
                y[j] = xhat(i, ch, p) * wc(ch) + b.map_or(0.0, |b| b[ch]);
                m1[k] += g[j] * wc(ch) / cnt[k];
                m2[k] += g[j] * wc(ch) * xhat(i, ch, p) / cnt[k];
                dw[ch] += g[j] * xhat(i, ch, p);
                db[ch] += g[j];
            }
        }
    }
    let mut dx = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            for p in 0..s {
                let (k, j) = (key(i, ch), idx(i, ch, p));
                dx[j] = rstd[k] * (g[j] * wc(ch) - m1[k] - xhat(i, ch, p) * m2[k]);
            }
        }
    }
    Hand {
        y,
        dx,
        dw,
        db,
        mean,
        var,
        var_unbiased,
    }
}

/// `y`, and the gradients of `sum(y · g)` of x, w and b.
fn grads<B: Backend>(
    y: &Var<B>,
    g: &Tensor<B>,
    vars: &[&Var<B>],
) -> (Vec<f64>, Vec<Option<Vec<f64>>>) {
    y.mul(&Var::constant(g.clone()))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let out = f64s(&y.tensor());
    (
        out,
        vars.iter().map(|v| v.grad().map(|t| f64s(&t))).collect(),
    )
}

fn norms_on<B: Backend>(dev: &B::Device, dtype: DType, tol: f64) {
    for dims in [vec![5, 3], vec![2, 3, 5], vec![2, 4, 3, 2]] {
        let (n, c) = (dims[0], dims[1]);
        let s: usize = dims[2..].iter().product();
        for (has_w, has_b, strided) in [
            (true, true, false),
            (false, true, true),
            (true, false, false),
            (false, false, true),
        ] {
            for groups in [None, Some(1), Some(c)] {
                let what = format!("{dims:?} w {has_w} b {has_b} groups {groups:?} {dtype}");
                // A strided x: a transposed view of a tensor with the last two axes swapped.
                let xt = if strided && dims.len() >= 3 {
                    let mut sd = dims.clone();
                    let r = sd.len();
                    sd.swap(r - 2, r - 1);
                    normal::<B>(&sd, 1, dtype, dev).transpose(-2, -1).unwrap()
                } else {
                    normal::<B>(&dims, 1, dtype, dev)
                };
                let g = normal::<B>(&dims, 2, dtype, dev);
                let w = has_w.then(|| Var::param(normal::<B>(&[c], 3, dtype, dev)));
                let b = has_b.then(|| Var::param(normal::<B>(&[c], 4, dtype, dev)));
                let x = Var::param(xt.clone());
                let eps = 1e-3;
                let (y, stats) = match groups {
                    None => {
                        let (y, st) = x.batch_norm_train(w.as_ref(), b.as_ref(), eps).unwrap();
                        (y, Some(st))
                    }
                    Some(gr) => (x.group_norm(gr, w.as_ref(), b.as_ref(), eps).unwrap(), None),
                };
                let mut vars = vec![&x];
                vars.extend(w.as_ref());
                vars.extend(b.as_ref());
                let (yv, gs) = grads(&y, &g, &vars);
                let wv = w.as_ref().map(|w| f64s(&w.tensor()));
                let bv = b.as_ref().map(|b| f64s(&b.tensor()));
                let h = by_hand(
                    &f64s(&xt),
                    &f64s(&g),
                    [n, c, s],
                    groups,
                    wv.as_deref(),
                    bv.as_deref(),
                    eps,
                );
                assert_close(&format!("{what} y"), &yv, &h.y, tol);
                assert_close(&format!("{what} dx"), gs[0].as_ref().unwrap(), &h.dx, tol);
                let mut k = 1;
                if has_w {
                    assert_close(&format!("{what} dw"), gs[k].as_ref().unwrap(), &h.dw, tol);
                    k += 1;
                }
                if has_b {
                    assert_close(&format!("{what} db"), gs[k].as_ref().unwrap(), &h.db, tol);
                }
                if let Some(st) = stats {
                    assert_eq!(st.count, n * s);
                    assert_close(&format!("{what} mean"), &f64s(&st.mean), &h.mean, tol);
                    assert_close(&format!("{what} var"), &f64s(&st.var), &h.var, tol);
                    assert_close(
                        &format!("{what} unbiased var"),
                        &f64s(&st.var_unbiased),
                        &h.var_unbiased,
                        tol,
                    );
                }
            }
        }
    }
}

#[test]
fn batch_and_group_norm_match_the_formulas() {
    norms_on::<Reference>(&RefDevice(0), DType::F64, 1e-12);
    norms_on::<Cpu>(&Cpu::device(0), DType::F64, 1e-12);
    norms_on::<Cpu>(&Cpu::device(0), DType::F32, 2e-4);
}

fn eval_on<B: Backend>(dev: &B::Device) {
    let dims = [2, 3, 2, 2];
    let c = 3;
    let xt = normal::<B>(&dims, 5, DType::F64, dev);
    let g = normal::<B>(&dims, 6, DType::F64, dev);
    let rm = normal::<B>(&[c], 7, DType::F64, dev);
    let rv = normal::<B>(&[c], 8, DType::F64, dev).abs().unwrap();
    let (w, b) = (
        Var::param(normal::<B>(&[c], 9, DType::F64, dev)),
        Var::param(normal::<B>(&[c], 10, DType::F64, dev)),
    );
    let x = Var::param(xt.clone());
    let eps = 1e-5;
    let y = x
        .batch_norm_eval(&rm, &rv, Some(&w), Some(&b), eps)
        .unwrap();
    let (yv, gs) = grads(&y, &g, &[&x, &w, &b]);
    let (xs, gv, rmv, rvv, wv, bv) = (
        f64s(&xt),
        f64s(&g),
        f64s(&rm),
        f64s(&rv),
        f64s(&w.tensor()),
        f64s(&b.tensor()),
    );
    let (mut want_y, mut want_dx) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
    let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
    for (j, &v) in xs.iter().enumerate() {
        let ch = (j / 4) % c;
        let rstd = 1.0 / (rvv[ch] + eps).sqrt();
        let xhat = (v - rmv[ch]) * rstd;
        want_y[j] = xhat * wv[ch] + bv[ch];
        want_dx[j] = gv[j] * wv[ch] * rstd;
        dw[ch] += gv[j] * xhat;
        db[ch] += gv[j];
    }
    assert_close("eval y", &yv, &want_y, 1e-12);
    assert_close("eval dx", gs[0].as_ref().unwrap(), &want_dx, 1e-12);
    assert_close("eval dw", gs[1].as_ref().unwrap(), &dw, 1e-12);
    assert_close("eval db", gs[2].as_ref().unwrap(), &db, 1e-12);
}

#[test]
fn batch_norm_eval_uses_the_given_statistics() {
    eval_on::<Reference>(&RefDevice(0));
    eval_on::<Cpu>(&Cpu::device(0));
}

#[test]
fn running_stats_follow_pytorch_formula() {
    let dev = Cpu::device(0);
    let x = Var::constant(normal::<Cpu>(&[4, 2, 3], 11, DType::F64, &dev));
    let (_, st) = x.batch_norm_train(None, None, 1e-5).unwrap();
    let rm = Tensor::<Cpu>::from_vec(vec![0.5, -1.0], [2], &dev).unwrap();
    let rv = Tensor::<Cpu>::from_vec(vec![2.0, 0.25], [2], &dev).unwrap();
    let (nm, nv) = update_running_stats(&rm, &rv, &st, 0.1).unwrap();
    let (m, vu) = (f64s(&st.mean), f64s(&st.var_unbiased));
    let want_m: Vec<f64> = (0..2).map(|i| 0.1 * m[i] + 0.9 * [0.5, -1.0][i]).collect();
    let want_v: Vec<f64> = (0..2).map(|i| 0.1 * vu[i] + 0.9 * [2.0, 0.25][i]).collect();
    assert_close("running mean", &f64s(&nm), &want_m, 1e-14);
    assert_close("running var", &f64s(&nv), &want_v, 1e-14);
    assert!(update_running_stats(&rm, &rv, &st, 1.5).is_err());
    let short = Tensor::<Cpu>::zeros([3], DType::F64, &dev).unwrap();
    assert!(update_running_stats(&short, &rv, &st, 0.1).is_err());
}

/// Average pooling by hand: for each output, the window's rows and columns (clipped) and the
/// divisor; `y` and, for the cotangent `g`, `dx`.
#[allow(clippy::type_complexity)]
fn pool_by_hand(
    x: &[f64],
    g: &[f64],
    [nc, h, w]: [usize; 3],
    rows: &[(usize, usize, f64)],
    cols: &[(usize, usize, f64)],
) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow) = (rows.len(), cols.len());
    let mut y = vec![0.0; nc * oh * ow];
    let mut dx = vec![0.0; x.len()];
    for p in 0..nc {
        for (i, &(r0, r1, dr)) in rows.iter().enumerate() {
            for (j, &(c0, c1, dc)) in cols.iter().enumerate() {
                let o = (p * oh + i) * ow + j;
                let d = dr * dc;
                for r in r0..r1 {
                    for c in c0..c1 {
                        y[o] += x[(p * h + r) * w + c] / d;
                        dx[(p * h + r) * w + c] += g[o] / d;
                    }
                }
            }
        }
    }
    (y, dx)
}

fn pools_on<B: Backend>(dev: &B::Device, dtype: DType, tol: f64) {
    let (n, c, h, w) = (2, 3, 7, 6);
    let xt = normal::<B>(&[n, c, w, h], 12, dtype, dev)
        .transpose(-2, -1)
        .unwrap(); // strided
    let xs = f64s(&xt);
    // (kernel, stride, padding, count_include_pad)
    let avg = [
        ([2, 2], [2, 2], [0, 0], true),
        ([3, 2], [2, 1], [1, 1], true),
        ([3, 2], [2, 1], [1, 1], false),
        ([3, 3], [1, 3], [1, 0], false),
        ([1, 1], [3, 2], [0, 0], true),
    ];
    for (k, st, pad, incl) in avg {
        let x = Var::param(xt.clone());
        let y = x.avg_pool2d(k, st, pad, incl).unwrap();
        let axis = |len: usize, a: usize| -> Vec<(usize, usize, f64)> {
            let out = (len + 2 * pad[a] - k[a]) / st[a] + 1;
            (0..out)
                .map(|o| {
                    let s = (o * st[a]) as isize - pad[a] as isize;
                    let e = (s + k[a] as isize).min(len as isize) as usize;
                    let s = s.max(0) as usize;
                    // With count_include_pad the divisor is the kernel (split per axis).
                    (s, e, if incl { k[a] as f64 } else { (e - s) as f64 })
                })
                .collect()
        };
        let (rows, cols) = (axis(h, 0), axis(w, 1));
        assert_eq!(y.dims(), [n, c, rows.len(), cols.len()]);
        let g = normal::<B>(&y.dims(), 13, dtype, dev);
        let (yv, gs) = grads(&y, &g, &[&x]);
        let (wy, wdx) = pool_by_hand(&xs, &f64s(&g), [n * c, h, w], &rows, &cols);
        let what = format!("avg_pool2d k {k:?} s {st:?} p {pad:?} incl {incl} {dtype}");
        assert_close(&format!("{what} y"), &yv, &wy, tol);
        assert_close(&format!("{what} dx"), gs[0].as_ref().unwrap(), &wdx, tol);
    }
    for out in [[1, 1], [7, 3], [3, 4], [2, 6], [5, 5]] {
        let x = Var::param(xt.clone());
        let y = x.adaptive_avg_pool2d(out).unwrap();
        let axis = |len: usize, o: usize| -> Vec<(usize, usize, f64)> {
            (0..o)
                .map(|i| {
                    let s = (i * len) / o;
                    let e = ((i + 1) * len).div_ceil(o);
                    (s, e, (e - s) as f64)
                })
                .collect()
        };
        let (rows, cols) = (axis(h, out[0]), axis(w, out[1]));
        assert_eq!(y.dims(), [n, c, out[0], out[1]]);
        let g = normal::<B>(&y.dims(), 14, dtype, dev);
        let (yv, gs) = grads(&y, &g, &[&x]);
        let (wy, wdx) = pool_by_hand(&xs, &f64s(&g), [n * c, h, w], &rows, &cols);
        let what = format!("adaptive_avg_pool2d {out:?} {dtype}");
        assert_close(&format!("{what} y"), &yv, &wy, tol);
        assert_close(&format!("{what} dx"), gs[0].as_ref().unwrap(), &wdx, tol);
    }
}

#[test]
fn average_pools_match_the_windows() {
    pools_on::<Reference>(&RefDevice(0), DType::F64, 1e-12);
    pools_on::<Cpu>(&Cpu::device(0), DType::F64, 1e-12);
    pools_on::<Cpu>(&Cpu::device(0), DType::F32, 1e-5);
}

/// How many host-to-device uploads (`from_host` ops) one pooling forward and backward of `f`
/// makes, and its output and gradient.
fn pool_uploads<B: Backend>(
    x: &Tensor<B>,
    range: &str,
    f: impl Fn(&Var<B>) -> Var<B>,
) -> (u64, Vec<f64>, Vec<f64>) {
    use kiln_core::profile::{self, Kind};
    let x = Var::param(x.clone());
    let g = normal::<B>(&[2, 3, 4, 5], 21, x.dtype(), &x.device());
    let ((y, dx), p) = profile::profile(|| {
        let _r = profile::range(range);
        let (y, dx) = grads(&f(&x), &g, &[&x]);
        (y, dx[0].clone().unwrap())
    });
    let p = p.in_range(range);
    (p.row(Kind::Op, "from_host").map_or(0, |r| r.calls), y, dx)
}

/// The pooling matrices are uploaded once per geometry, dtype and device and cached: a second
/// call with the same geometry uploads nothing and gives the same values. (The geometries are
/// used by no other test of this binary, whose tests share the process-wide cache.)
#[test]
fn pooling_matrices_are_uploaded_once_per_geometry_dtype_and_device() {
    type Pool<B> = fn(&Var<B>) -> Var<B>;
    // Overlapping, padded windows and adaptive windows that do not divide 11 x 13: both take
    // the GEMM road, with different row and column matrices. Output [2, 3, 4, 5] each.
    type Windows = Vec<(usize, usize, f64)>;
    fn pools<B: Backend>() -> [(&'static str, Pool<B>, [Windows; 2]); 2] {
        // By hand: avg_pool2d's windows (divisor: the part inside the input) and PyTorch's
        // adaptive ones.
        let avg = |len: usize, k: usize, s: usize, p: usize| -> Windows {
            (0..(len + 2 * p - k) / s + 1)
                .map(|o| {
                    let a = (o * s).saturating_sub(p);
                    let e = (o * s + k - p).min(len);
                    (a, e, (e - a) as f64)
                })
                .collect()
        };
        let adaptive = |len: usize, out: usize| -> Windows {
            (0..out)
                .map(|o| (o * len / out, ((o + 1) * len).div_ceil(out)))
                .map(|(a, e)| (a, e, (e - a) as f64))
                .collect()
        };
        [
            (
                "avg",
                |x| x.avg_pool2d([3, 5], [3, 3], [1, 2], false).unwrap(),
                [avg(11, 3, 3, 1), avg(13, 5, 3, 2)],
            ),
            (
                "adaptive",
                |x| x.adaptive_avg_pool2d([4, 5]).unwrap(),
                [adaptive(11, 4), adaptive(13, 5)],
            ),
        ]
    }
    fn check<B: Backend>(devs: &[B::Device], dtypes: &[DType]) {
        for (name, f, [rows, cols]) in pools::<B>() {
            for dev in devs {
                for &dtype in dtypes {
                    let what = format!("{name} {dtype} on {dev}");
                    let x = normal::<B>(&[2, 3, 11, 13], 20, dtype, dev);
                    let (first, y1, dx1) = pool_uploads(&x, &format!("{what} first"), f);
                    assert_eq!(first, 2, "{what}: one upload per axis at the first call");
                    let (again, y2, dx2) = pool_uploads(&x, &format!("{what} again"), f);
                    assert_eq!(again, 0, "{what}: the second call uploaded matrices");
                    assert_eq!(y1, y2, "{what}: y");
                    assert_eq!(dx1, dx2, "{what}: dx");
                    let g = normal::<B>(&[2, 3, 4, 5], 21, dtype, dev);
                    let (wy, wdx) = pool_by_hand(&f64s(&x), &f64s(&g), [6, 11, 13], &rows, &cols);
                    let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                    assert_close(&format!("{what} y"), &y2, &wy, tol);
                    assert_close(&format!("{what} dx"), &dx2, &wdx, tol);
                }
            }
        }
    }
    check::<Cpu>(&[Cpu::device(0)], &[DType::F32, DType::F64]);
    check::<Reference>(&[RefDevice(0), RefDevice(1)], &[DType::F64]);
}

/// The error's op name, for an `InvalidArgument` or `DTypeMismatch`.
fn op_of<T>(r: kiln_core::Result<T>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { op, .. }) | Err(Error::DTypeMismatch { op, .. }) => op,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn bad_arguments_are_typed_errors_naming_the_op() {
    let dev = Cpu::device(0);
    let t = |d: &[usize]| Var::param(normal::<Cpu>(d, 1, DType::F32, &dev));
    let c3 = t(&[3]);
    // batch_norm: rank 1, a weight of the wrong size, one value per channel, eval stats.
    assert_eq!(
        op_of(t(&[4]).batch_norm_train(None, None, 1e-5)),
        "batch_norm"
    );
    assert_eq!(
        op_of(t(&[2, 4, 3]).batch_norm_train(Some(&c3), None, 1e-5)),
        "batch_norm"
    );
    assert_eq!(
        op_of(t(&[1, 3]).batch_norm_train(None, None, 1e-5)),
        "batch_norm"
    );
    assert_eq!(
        op_of(t(&[2, 3]).batch_norm_train(None, None, f64::NAN)),
        "batch_norm"
    );
    let rv = normal::<Cpu>(&[4], 2, DType::F32, &dev);
    assert_eq!(
        op_of(t(&[2, 3]).batch_norm_eval(&c3.tensor(), &rv, None, None, 1e-5)),
        "batch_norm"
    );
    let rm64 = normal::<Cpu>(&[3], 2, DType::F64, &dev);
    assert_eq!(
        op_of(t(&[2, 3]).batch_norm_eval(&rm64, &c3.tensor(), None, None, 1e-5)),
        "batch_norm"
    );
    // group_norm: groups not dividing the channels, zero groups, a bias of the wrong size.
    assert_eq!(
        op_of(t(&[2, 6, 2]).group_norm(4, None, None, 1e-5)),
        "group_norm"
    );
    assert_eq!(
        op_of(t(&[2, 6, 2]).group_norm(0, None, None, 1e-5)),
        "group_norm"
    );
    assert_eq!(
        op_of(t(&[2, 6, 2]).group_norm(3, None, Some(&c3), 1e-5)),
        "group_norm"
    );
    // Pools: not 4-d, a kernel larger than the input, padding over half the kernel, zeros.
    assert_eq!(
        op_of(t(&[2, 3, 4]).avg_pool2d([2, 2], [2, 2], [0, 0], true)),
        "avg_pool2d"
    );
    assert_eq!(
        op_of(t(&[1, 1, 2, 2]).avg_pool2d([3, 3], [1, 1], [0, 0], true)),
        "avg_pool2d"
    );
    assert_eq!(
        op_of(t(&[1, 1, 4, 4]).avg_pool2d([2, 2], [1, 1], [2, 0], true)),
        "avg_pool2d"
    );
    assert_eq!(
        op_of(t(&[1, 1, 4, 4]).avg_pool2d([2, 2], [0, 1], [0, 0], true)),
        "avg_pool2d"
    );
    assert_eq!(
        op_of(t(&[2, 3, 4]).adaptive_avg_pool2d([1, 1])),
        "adaptive_avg_pool2d"
    );
    assert_eq!(
        op_of(t(&[1, 1, 4, 4]).adaptive_avg_pool2d([0, 1])),
        "adaptive_avg_pool2d"
    );
    let ints = Var::constant(Tensor::<Cpu>::zeros([2, 3, 2, 2], DType::I64, &dev).unwrap());
    assert_eq!(
        op_of(ints.avg_pool2d([1, 1], [1, 1], [0, 0], true)),
        "avg_pool2d"
    );
    assert_eq!(op_of(ints.batch_norm_train(None, None, 1e-5)), "batch_norm");
}

#[test]
fn avg_pool_ceil_mode_and_divisor_override_follow_pytorch() {
    use kiln_autograd::AvgPoolOptions;
    let dev = Cpu::device(0);
    let plane = |n: usize| {
        Var::param(
            Tensor::<Cpu>::from_vec((0..n * n).map(|v| v as f64).collect(), [1, 1, n, n], &dev)
                .unwrap(),
        )
    };
    let vals = |v: &Var<Cpu>| v.tensor().to_vec::<f64>().unwrap();
    let opts = |ceil_mode, count_include_pad, divisor_override| AvgPoolOptions {
        ceil_mode,
        count_include_pad,
        divisor_override,
    };
    // 5x5 (0..25), 2x2 windows, stride 2, ceil: 3x3; the partial windows divide by what they
    // cover (PyTorch: min(start + k, len + pad) - start, with no padding to count).
    let x = plane(5);
    let y = x
        .avg_pool2d_with([2, 2], [2, 2], [0, 0], opts(true, true, None))
        .unwrap();
    assert_eq!(y.dims(), [1, 1, 3, 3]);
    let want = [
        (0.0 + 1.0 + 5.0 + 6.0) / 4.0,
        (2.0 + 3.0 + 7.0 + 8.0) / 4.0,
        (4.0 + 9.0) / 2.0,
        (10.0 + 11.0 + 15.0 + 16.0) / 4.0,
        (12.0 + 13.0 + 17.0 + 18.0) / 4.0,
        (14.0 + 19.0) / 2.0,
        (20.0 + 21.0) / 2.0,
        (22.0 + 23.0) / 2.0,
        24.0,
    ];
    assert_eq!(vals(&y), want);
    y.sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap().to_vec::<f64>().unwrap();
    assert_eq!((g[0], g[4], g[24]), (0.25, 0.5, 1.0));
    // Kernel 3, stride 2, padding 1 on 6, ceil: 4 windows per axis; the last starts at 5 and is
    // cut at len + pad = 7, so with the padding counted its divisor is 2 (one cell, one pad).
    let x6 = plane(6);
    let y6 = x6
        .avg_pool2d_with([3, 3], [2, 2], [1, 1], opts(true, true, None))
        .unwrap();
    assert_eq!(y6.dims(), [1, 1, 4, 4]);
    assert_eq!(vals(&y6)[15], 35.0 / 4.0); // the corner: one cell of 0..36, divisor 2 x 2
    let y6n = x6
        .avg_pool2d_with([3, 3], [2, 2], [1, 1], opts(true, false, None))
        .unwrap();
    assert_eq!(vals(&y6n)[15], 35.0); // padding not counted: one cell, divisor 1
    // divisor_override: every window's sum over the given number.
    let x4 = plane(4);
    let y4 = x4
        .avg_pool2d_with([2, 2], [2, 2], [0, 0], opts(false, true, Some(3)))
        .unwrap();
    let want4 = [10.0 / 3.0, 18.0 / 3.0, 42.0 / 3.0, 50.0 / 3.0];
    assert_close("divisor_override", &vals(&y4), &want4, 1e-14);
    // Floor mode without options is unchanged (the plain method agrees).
    let plain = x4.avg_pool2d([2, 2], [2, 2], [0, 0], true).unwrap();
    assert_eq!(vals(&plain), [2.5, 4.5, 10.5, 12.5]);
    assert!(matches!(
        x4.avg_pool2d_with([2, 2], [2, 2], [0, 0], opts(false, true, Some(0))),
        Err(Error::InvalidArgument { .. })
    ));
}
