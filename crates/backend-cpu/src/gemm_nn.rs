//! f32 products whose right operand is row-major (`g · W`, and `gᵀ · x` with the left operand
//! a transposed view: a Linear layer's backward), with AVX-512 and without packing.
//!
//! A tile of up to 12 output rows by 32 columns keeps 24 accumulators; each step of the depth
//! loads 32 contiguous elements of one row of the right operand and multiplies them by each
//! of the tile's 12 left elements, broadcast from wherever the left operand's strides put
//! them (rows or columns, no copy either way). The tile's rows of the right operand stay in
//! L1 across the tiles of one column block. matrixmultiply copies both operands into packed
//! panels on every call; for the small products of a small MLP that copy, and its 16x16 tile's
//! edges, cost more than they save. Single-threaded on the 2-core EPYC (Zen 5) VM, µs per call,
//! matrixmultiply's AVX-512 kernel -> this: 100x100x784 (`gᵀ · x`) 77-81 -> 58-60; 100x100x100
//! 11.7 -> 8.6 (`gᵀ · h`), 13.4-13.6 -> 8.5-8.7 (`g · W`); 10x100x100 2.6 -> 0.9; 100x10x100
//! 1.9 -> 1.0. (Tiles of 8, 10 and 14 rows measured the same as 12, within 3%.)
//!
//! Each output is one sequential sum over the depth in one accumulator lane, whichever tile
//! computes it, so a product split by rows or columns gives the same bits as on one core.
//!
//! [`transpose`] copies a right operand whose columns are contiguous (`Wᵀ`) row-major, in
//! 16x16 blocks transposed in registers, for products that pay for the copy (see
//! `matmul::NT_VIA_NN`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Output rows per tile at most.
const ROWS: usize = 12;

/// Whether this processor runs [`product_to`] (AVX-512F, detected once).
pub(crate) fn available() -> bool {
    crate::gemm_nt::available()
}

/// A `rows x cols` matrix, element `(i, j)` at `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strided<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Strided<'_> {
    /// Whether every element lies inside `data`.
    fn fits(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .zip((self.cols - 1).checked_mul(self.cs))
            .and_then(|(r, c)| r.checked_add(c)?.checked_add(self.off));
        last.is_some_and(|l| l < self.data.len())
    }
}

/// `out[i * ostride + j] = Σ_p a(i, p) · b(p, j)` for `a` (`m x k`, any strides) and a
/// row-major `b` (`k x n`, `b.cs == 1`). Panics if [`available`] is false, if `b` is not
/// row-major, or if an operand or the output lies outside its slice.
#[cfg(test)]
pub(crate) fn product(a: Strided<'_>, b: Strided<'_>, out: &mut [f32], ostride: usize) {
    let (m, n) = (a.rows, b.cols);
    assert!(
        m == 0
            || n == 0
            || (m - 1)
                .checked_mul(ostride)
                .and_then(|v| v.checked_add(n))
                .is_some_and(|end| end <= out.len()),
        "gemm_nn: the output lies outside its slice"
    );
    // SAFETY: `out` is borrowed exclusively and holds every element written (asserted above).
    unsafe { product_to(a, b, out.as_mut_ptr(), ostride) }
}

/// The same product written through a pointer: `out[i * ostride + j]`. Panics if [`available`] is false, if `b` is not
/// row-major, or if an operand lies outside its slice.
///
/// # Safety
/// `out[i * ostride + j]` is writable for `i < a.rows`, `j < b.cols`, and no other thread
/// reads or writes those elements until this returns.
pub(crate) unsafe fn product_to(a: Strided<'_>, b: Strided<'_>, out: *mut f32, ostride: usize) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm_nn: the depths differ");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                // SAFETY: i < m, j < n (the caller's contract).
                unsafe { *out.add(i * ostride + j) = 0.0 };
            }
        }
        return;
    }
    assert!(available(), "gemm_nn::product needs AVX-512F");
    assert!(b.cs == 1, "gemm_nn: the right operand must be row-major");
    assert!(
        a.fits() && b.fits(),
        "gemm_nn: an operand lies outside its slice"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has AVX-512F; `tiles` reads `a(i, p)` for i < m, p < k and
    // `b(p, j)` for p < k, j < n only (masked loads at the right edge), all inside their
    // slices (`fits`, asserted above), and writes `out[i * ostride + j]` for i < m, j < n
    // only, which the caller guarantees writable and ours.
    unsafe {
        tiles(a, b, out, ostride)
    }
}

/// `out[p * n + j] = b_j[p]` for the `n` rows `b_j` of `b` (`k` elements each): a right operand
/// whose columns are contiguous (`Wᵀ`) copied row-major for [`product_to`], in 16x16 blocks
/// transposed in registers. Panics if [`available`] is false, if a row lies outside its
/// slice or if `out` is shorter than `k * n`.
pub(crate) fn transpose(b: crate::gemm_nt::Rows<'_>, k: usize, out: &mut [f32]) {
    let n = b.rows;
    if n == 0 || k == 0 {
        return;
    }
    assert!(available(), "gemm_nn::transpose needs AVX-512F");
    assert!(
        (n - 1)
            .checked_mul(b.stride)
            .and_then(|v| v.checked_add(b.off + k))
            .is_some_and(|end| end <= b.data.len()),
        "gemm_nn: a row to transpose lies outside its slice"
    );
    assert!(
        out.len() >= k * n,
        "gemm_nn: the transposed copy lies outside its slice"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is there; `blocks` reads `k` elements of rows `0..n` (inside `b.data`,
    // asserted above) and writes `out[p * n + j]` for p < k, j < n (inside `out`, asserted).
    unsafe {
        blocks(b, k, out.as_mut_ptr())
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocks(b: crate::gemm_nt::Rows<'_>, k: usize, out: *mut f32) {
    let n = b.rows;
    let src = b.data.as_ptr();
    let lanes = |len: usize| -> __mmask16 { if len >= 16 { 0xffff } else { (1 << len) - 1 } };
    for j0 in (0..n).step_by(16) {
        let jn = (n - j0).min(16);
        for p0 in (0..k).step_by(16) {
            let pn = (k - p0).min(16);
            // r[q]: elements p0..p0 + pn of row j0 + q (zero past the last row).
            let r: [__m512; 16] = std::array::from_fn(|q| {
                if q < jn {
                    // SAFETY: row j0 + q < n, elements p0..p0 + pn < k (the mask).
                    unsafe {
                        _mm512_maskz_loadu_ps(lanes(pn), src.add(b.off + (j0 + q) * b.stride + p0))
                    }
                } else {
                    _mm512_setzero_ps()
                }
            });
            let t = transpose16(r);
            for (p, &v) in t.iter().enumerate().take(pn) {
                // SAFETY: row p0 + p < k of `out`, columns j0..j0 + jn < n (the mask).
                unsafe { _mm512_mask_storeu_ps(out.add((p0 + p) * n + j0), lanes(jn), v) };
            }
        }
    }
}

/// The 16x16 transpose of `r` (`r[q]` lane `p` becomes lane `q` of the result's `p`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4g + h]: 64-bit halves of t[4g + (h / 2)] and t[4g + 2 + (h / 2)].
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (g, h) = (i / 4, i % 4);
        let (a, b) = (
            _mm512_castps_pd(t[4 * g + h / 2]),
            _mm512_castps_pd(t[4 * g + 2 + h / 2]),
        );
        _mm512_castpd_ps(if h % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        })
    });
    let v: [__m512; 16] = std::array::from_fn(|i| {
        let (g, h) = (i / 8, i % 8);
        let (a, b) = (u[8 * g + h % 4], u[8 * g + 4 + h % 4]);
        if h < 4 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        }
    });
    std::array::from_fn(|i| {
        let (a, b) = (v[i % 8], v[8 + i % 8]);
        if i < 8 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        }
    })
}

/// Column blocks of 32 (16 at the right edge when that is enough), and in each the rows in
/// tiles of at most [`ROWS`], as even as they go (100 rows: one of 12, eight of 11).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tiles(a: Strided<'_>, b: Strided<'_>, out: *mut f32, ostride: usize) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let count = m.div_ceil(ROWS);
    let (pa, pb) = (a.data.as_ptr(), b.data.as_ptr());
    let mut j = 0;
    while j < n {
        let width = if n - j > 16 { 32 } else { 16 };
        let cols = width.min(n - j);
        let mask: __mmask16 = if cols % 16 == 0 {
            0xffff
        } else {
            (1 << (cols % 16)) - 1
        };
        let mut i = 0;
        for t in 0..count {
            let rows = m / count + usize::from(t < m % count);
            // SAFETY (the three pointers): row i < m of `a`, column j < n of `b` (inside their
            // slices, checked by `product_to`) and of `out` (its caller's contract).
            let (ap, bp, cp) = unsafe {
                (
                    pa.add(a.off + i * a.rs),
                    pb.add(b.off + j),
                    out.add(i * ostride + j),
                )
            };
            let t = Tile {
                k,
                a: ap,
                rs: a.rs,
                cs: a.cs,
                b: bp,
                brs: b.rs,
                c: cp,
                ostride,
                mask,
            };
            macro_rules! by_rows {
                ($($r:literal)*) => {
                    match (rows, width) {
                        // SAFETY: `rows` rows and `cols` columns (the mask) of the tile lie
                        // inside the operands and the output (see above).
                        $(($r, 32) => unsafe { t.run::<$r, 2>() },
                          ($r, _) => unsafe { t.run::<$r, 1>() },)*
                        _ => unreachable!("a tile has 1 to {ROWS} rows"),
                    }
                };
            }
            by_rows!(1 2 3 4 5 6 7 8 9 10 11 12);
            i += rows;
        }
        j += width;
    }
}

/// One tile: `R` rows from `a` (`a[r * rs + p * cs]`), `16 NV` columns from `b` (`b[p * brs
/// + col]`, the last 16 masked by `mask`), written to `c[r * ostride + col]`.
#[cfg(target_arch = "x86_64")]
struct Tile {
    k: usize,
    a: *const f32,
    rs: usize,
    cs: usize,
    b: *const f32,
    brs: usize,
    c: *mut f32,
    ostride: usize,
    mask: __mmask16,
}

#[cfg(target_arch = "x86_64")]
impl Tile {
    /// # Safety
    /// AVX-512F; `a[r * rs + p * cs]` readable for r < R, p < k; `b[p * brs + col]` readable
    /// and `c[r * ostride + col]` writable for the columns the mask leaves.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn run<const R: usize, const NV: usize>(&self) {
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        let lane_mask = |v: usize| if v + 1 == NV { self.mask } else { 0xffff };
        for p in 0..self.k {
            // SAFETY: row p of `b`, the columns the masks leave.
            let bv: [__m512; NV] = std::array::from_fn(|v| unsafe {
                _mm512_maskz_loadu_ps(lane_mask(v), self.b.add(p * self.brs + 16 * v))
            });
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: r < R, p < k.
                let x = _mm512_set1_ps(unsafe { *self.a.add(r * self.rs + p * self.cs) });
                for v in 0..NV {
                    acc[v] = _mm512_fmadd_ps(x, bv[v], acc[v]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &x) in acc.iter().enumerate() {
                // SAFETY: row r < R of the output, the columns the mask leaves.
                unsafe {
                    _mm512_mask_storeu_ps(self.c.add(r * self.ostride + 16 * v), lane_mask(v), x)
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(i: usize, salt: usize) -> f32 {
        ((i * 2654435761 + salt * 40503) % 1999) as f32 / 999.5 - 1.0
    }

    /// Every tile height (1 to 12 rows, and counts that split unevenly), column edges on both
    /// sides of 16 and 32, the left operand row- and column-major with gaps, an output wider
    /// than the product: against f64 sums, and nothing written outside the product.
    #[test]
    fn matches_f64_sums() {
        if !available() {
            eprintln!("no AVX-512F: gemm_nn not tested");
            return;
        }
        for &m in &[1, 2, 5, 12, 13, 25, 100] {
            for &n in &[1, 7, 16, 17, 31, 32, 33, 50] {
                for &k in &[1, 3, 16, 100] {
                    for col_major in [false, true] {
                        let (rs, cs) = if col_major { (1, m + 2) } else { (k + 3, 1) };
                        let alen = 4 + (m - 1) * rs + (k - 1) * cs + 1;
                        let ad: Vec<f32> = (0..alen).map(|i| value(i, 1)).collect();
                        let brs = n + 5;
                        let bd: Vec<f32> = (0..2 + k * brs).map(|i| value(i, 2)).collect();
                        let a = Strided {
                            data: &ad,
                            off: 4,
                            rs,
                            cs,
                            rows: m,
                            cols: k,
                        };
                        let b = Strided {
                            data: &bd,
                            off: 2,
                            rs: brs,
                            cs: 1,
                            rows: k,
                            cols: n,
                        };
                        let ostride = n + 3;
                        let mut out = vec![f32::NAN; m * ostride];
                        product(a, b, &mut out, ostride);
                        for i in 0..m {
                            for j in 0..ostride {
                                let got = out[i * ostride + j];
                                let what = format!("{m}x{k}x{n} col_major={col_major}");
                                if j >= n {
                                    assert!(got.is_nan(), "{what}: wrote past column {n}");
                                    continue;
                                }
                                let want: f64 = (0..k)
                                    .map(|p| {
                                        ad[4 + i * rs + p * cs] as f64 * bd[2 + p * brs + j] as f64
                                    })
                                    .sum();
                                assert!(
                                    (got as f64 - want).abs() <= 1e-5 * (k as f64).sqrt() * 4.0,
                                    "{what}: out[{i}][{j}] = {got}, want {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every block edge (sizes on both sides of 16 and 32), rows with gaps and an offset.
    #[test]
    fn transposes_exactly() {
        if !available() {
            return;
        }
        for &n in &[1, 5, 16, 17, 33, 100] {
            for &k in &[1, 15, 16, 17, 40, 784] {
                let (off, stride) = (3, k + 2);
                let d: Vec<f32> = (0..off + n * stride).map(|i| value(i, 3)).collect();
                let rows = crate::gemm_nt::Rows {
                    data: &d,
                    off,
                    stride,
                    rows: n,
                };
                let mut out = vec![f32::NAN; k * n + 1];
                transpose(rows, k, &mut out);
                for p in 0..k {
                    for j in 0..n {
                        assert_eq!(
                            out[p * n + j],
                            d[off + j * stride + p],
                            "{k}x{n} [{p}][{j}]"
                        );
                    }
                }
                assert!(out[k * n].is_nan(), "{k}x{n}: wrote past the end");
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside its slice")]
    fn an_operand_past_its_slice_panics() {
        if !available() {
            panic!("outside its slice (no AVX-512F, nothing to check)");
        }
        let d = vec![0f32; 10];
        let a = Strided {
            data: &d,
            off: 0,
            rs: 4,
            cs: 1,
            rows: 3,
            cols: 4,
        };
        let b = Strided {
            data: &d,
            off: 0,
            rs: 2,
            cs: 1,
            rows: 4,
            cols: 2,
        };
        product(a, b, &mut [0.0; 6], 2);
    }
}
