//! f32 products of two operands that are both contiguous along the depth, `x · Wᵀ` (a Linear
//! layer's forward: `x` row-major, `Wᵀ` a transposed view of the row-major `[out, in]` weight),
//! with AVX-512 and without packing.
//!
//! A packing GEMM (matrixmultiply) copies `x`'s rows into row panels and `Wᵀ`'s columns into
//! column panels on every call, and for this layout both copies are transposes, the slow kind:
//! on the 784-100-100-10 MLP's first layer (100x784x100) they took a third of its time. Here
//! each output is the dot product of two contiguous rows, so nothing is copied: a tile of 4x4
//! outputs keeps 16 accumulators of 16 lanes over the whole depth (8 loads per 16 FMAs, both
//! rows of a tile in L1), and one shuffle tree folds the 16 accumulators into the tile's 16
//! sums. Single-threaded on the 2-core EPYC (Zen 5) VM, 100x784x100: 84-88 µs against
//! matrixmultiply's 119-124 µs (its AVX-512 kernel); 100x100x100: 15.2-15.5 against 15.8;
//! 100x100x10: 1.8 against 4.5. Cutting the depth into blocks (so that the rows of a tile
//! stay in L1 with less of the other operand) measured slower at every block size tried (128
//! to 400): the extra folds cost more than the cache misses they save.
//!
//! Every output is the same sum (the same lanes in the same order, then the same fold)
//! whichever tile computes it, so a product split by rows across cores gives the same bits as
//! on one core.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Output rows per tile, and output columns per tile.
pub(crate) const TILE: usize = 4;

/// Whether this processor runs [`product_to`] (AVX-512F, detected once).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `rows` rows of `len` contiguous elements, row `i` starting at `data[off + i * stride]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub stride: usize,
    pub rows: usize,
}

impl Rows<'_> {
    /// Whether rows of `len` elements all lie inside `data`.
    fn fits(&self, len: usize) -> bool {
        let last = (self.rows.saturating_sub(1))
            .checked_mul(self.stride)
            .and_then(|v| v.checked_add(self.off))
            .and_then(|v| v.checked_add(len));
        last.is_some_and(|end| end <= self.data.len())
    }
}

/// `out[i * ostride + j] = a_i · b_j` for every row `i` of `a` and row `j` of `b`, both of
/// `k` elements. Panics if [`available`] is false or a row or output lies outside its slice.
#[cfg(test)]
pub(crate) fn product(a: Rows<'_>, b: Rows<'_>, k: usize, out: &mut [f32], ostride: usize) {
    let (m, n) = (a.rows, b.rows);
    assert!(
        m == 0
            || n == 0
            || (m - 1)
                .checked_mul(ostride)
                .and_then(|v| v.checked_add(n))
                .is_some_and(|end| end <= out.len()),
        "gemm_nt: the output lies outside its slice"
    );
    // SAFETY: `out` is borrowed exclusively and holds every element written (asserted above).
    unsafe { product_to(a, b, k, out.as_mut_ptr(), ostride) }
}

/// The same product written through a pointer: `out[i * ostride + j]`. Panics if [`available`] is false or an operand
/// row lies outside its slice.
///
/// # Safety
/// `out[i * ostride + j]` is writable for `i < a.rows`, `j < b.rows`, and no other thread
/// reads or writes those elements until this returns.
pub(crate) unsafe fn product_to(a: Rows<'_>, b: Rows<'_>, k: usize, out: *mut f32, ostride: usize) {
    if a.rows == 0 || b.rows == 0 {
        return;
    }
    assert!(available(), "gemm_nt::product needs AVX-512F");
    assert!(
        a.fits(k) && b.fits(k),
        "gemm_nt: an operand row lies outside its slice"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has AVX-512F (asserted above), every row read lies inside its
    // slice (`fits`, asserted above: `tiles` reads rows `0..rows` of `k` elements from
    // `off + i * stride`) and `tiles` writes `out[i * ostride + j]` for i < m, j < n only,
    // which the caller guarantees writable and ours.
    unsafe {
        tiles(a, b, k, out, ostride)
    }
}

/// All tiles of the product; a tile at the bottom or right edge repeats the last row or column
/// of its operand and stores only its valid outputs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tiles(a: Rows<'_>, b: Rows<'_>, k: usize, out: *mut f32, ostride: usize) {
    let (m, n) = (a.rows, b.rows);
    let (pa, pb) = (a.data.as_ptr(), b.data.as_ptr());
    for i in (0..m).step_by(TILE) {
        // SAFETY (all pointer arithmetic below): rows `min(.., m - 1)` and `min(.., n - 1)`
        // exist, and `product_to` checked that they lie inside their slices.
        let ar: [*const f32; TILE] =
            std::array::from_fn(|r| unsafe { pa.add(a.off + (i + r).min(m - 1) * a.stride) });
        for j in (0..n).step_by(TILE) {
            let bc: [*const f32; TILE] =
                std::array::from_fn(|q| unsafe { pb.add(b.off + (j + q).min(n - 1) * b.stride) });
            // SAFETY: each pointer starts `k` readable elements (see above).
            let sums = unsafe { tile(k, ar, bc) };
            let mut o = [0f32; TILE * TILE];
            // SAFETY: `o` holds 16 elements.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), sums) };
            for r in 0..TILE.min(m - i) {
                for q in 0..TILE.min(n - j) {
                    // SAFETY: i + r < m and j + q < n, writable (`product_to`'s contract).
                    unsafe { *out.add((i + r) * ostride + j + q) = o[TILE * q + r] };
                }
            }
        }
    }
}

/// The 16 dot products of rows `a[r]` with rows `b[q]` (`k` elements each, read unaligned),
/// returned with `a[r] · b[q]` in lane `4 q + r`.
///
/// # Safety
/// AVX-512F; each pointer starts `k` readable `f32`s.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile(k: usize, a: [*const f32; TILE], b: [*const f32; TILE]) -> __m512 {
    let mut acc = [[_mm512_setzero_ps(); TILE]; TILE];
    let full = k / 16 * 16;
    let mut p = 0;
    while p < full {
        // SAFETY: p + 16 <= k.
        let av: [__m512; TILE] = std::array::from_fn(|r| unsafe { _mm512_loadu_ps(a[r].add(p)) });
        for q in 0..TILE {
            // SAFETY: as above.
            let bv = unsafe { _mm512_loadu_ps(b[q].add(p)) };
            for r in 0..TILE {
                acc[r][q] = _mm512_fmadd_ps(av[r], bv, acc[r][q]);
            }
        }
        p += 16;
    }
    if full < k {
        // The last k - full (< 16) elements; the masked lanes are neither read nor counted.
        let mask: __mmask16 = (1 << (k - full)) - 1;
        // SAFETY: the mask reads only elements p..k.
        let av: [__m512; TILE] =
            std::array::from_fn(|r| unsafe { _mm512_maskz_loadu_ps(mask, a[r].add(p)) });
        for q in 0..TILE {
            // SAFETY: as above.
            let bv = unsafe { _mm512_maskz_loadu_ps(mask, b[q].add(p)) };
            for r in 0..TILE {
                acc[r][q] = _mm512_fmadd_ps(av[r], bv, acc[r][q]);
            }
        }
    }
    fold(std::array::from_fn(|i| acc[i / TILE][i % TILE]))
}

/// The lane sums of 16 vectors, `x[s]`'s sum in lane `4 (s % 4) + s / 4`: four rounds, each
/// adding two halves of pairs of vectors (128-bit lanes, then 128-bit lanes again, then
/// 32-bit, then 64-bit elements within 128-bit lanes).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn fold(x: [__m512; 16]) -> __m512 {
    // y[t]: x[2t]'s 8 partial sums in 128-bit lanes 0-1, x[2t+1]'s in lanes 2-3.
    let y: [__m512; 8] = std::array::from_fn(|t| {
        let (u, v) = (x[2 * t], x[2 * t + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(u, v),
            _mm512_shuffle_f32x4::<0xEE>(u, v),
        )
    });
    // z[t]: x[4t + l]'s 4 partial sums in 128-bit lane l.
    let z: [__m512; 4] = std::array::from_fn(|t| {
        let (u, v) = (y[2 * t], y[2 * t + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(u, v),
            _mm512_shuffle_f32x4::<0xDD>(u, v),
        )
    });
    // w[t], 128-bit lane l: two partial sums each of z[2t] and z[2t+1]'s lane l, interleaved.
    let w: [__m512; 2] = std::array::from_fn(|t| {
        let (u, v) = (z[2 * t], z[2 * t + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(u, v), _mm512_unpackhi_ps(u, v))
    });
    // Lane 4l + s: the sum of z[s]'s 128-bit lane l, which is x[4s + l]'s.
    let (g, h) = (_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(g, h)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(g, h)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(i: usize, salt: usize) -> f32 {
        ((i * 2654435761 + salt * 40503) % 1999) as f32 / 999.5 - 1.0
    }

    /// Every size of the edge tiles and of the masked depth tail, rows with gaps between them
    /// and offsets, an output wider than the product: against f64 dot products.
    #[test]
    fn matches_f64_dot_products() {
        if !available() {
            eprintln!("no AVX-512F: gemm_nt not tested");
            return;
        }
        for &(m, n) in &[(1, 1), (1, 5), (3, 2), (4, 4), (5, 7), (9, 8), (13, 10)] {
            for &k in &[1, 2, 15, 16, 17, 31, 33, 100, 784] {
                let (sa, sb, ostride) = (k + 3, k + 1, n + 2);
                let (oa, ob) = (5, 1);
                let ad: Vec<f32> = (0..oa + m * sa).map(|i| value(i, 1)).collect();
                let bd: Vec<f32> = (0..ob + n * sb).map(|i| value(i, 2)).collect();
                let mut out = vec![f32::NAN; m * ostride];
                let a = Rows {
                    data: &ad,
                    off: oa,
                    stride: sa,
                    rows: m,
                };
                let b = Rows {
                    data: &bd,
                    off: ob,
                    stride: sb,
                    rows: n,
                };
                product(a, b, k, &mut out, ostride);
                for i in 0..m {
                    for j in 0..ostride {
                        let got = out[i * ostride + j];
                        if j >= n {
                            assert!(got.is_nan(), "{m}x{k}x{n}: wrote past column {n}");
                            continue;
                        }
                        let want: f64 = (0..k)
                            .map(|p| ad[oa + i * sa + p] as f64 * bd[ob + j * sb + p] as f64)
                            .sum();
                        assert!(
                            (got as f64 - want).abs() <= 1e-5 * (k as f64).sqrt() * 4.0,
                            "{m}x{k}x{n}: out[{i}][{j}] = {got}, want {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside its slice")]
    fn rows_past_the_slice_panic() {
        if !available() {
            panic!("outside its slice (no AVX-512F, nothing to check)");
        }
        let d = vec![0f32; 10];
        let r = Rows {
            data: &d,
            off: 0,
            stride: 4,
            rows: 3,
        };
        product(r, r, 4, &mut [0.0; 9], 3);
    }
}
