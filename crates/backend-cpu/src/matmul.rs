//! Batched matrix products through matrixmultiply (sgemm/dgemm).
//!
//! Each operand matrix is an ndarray view over the storage with the layout's own row and column
//! strides, and ndarray hands those strides straight to matrixmultiply's packing kernels: a
//! transposed (column-major) operand is read in place, never copied. Batches loop over the
//! batch stride (0 broadcasts one matrix to every batch). A single product from a few million
//! multiply-adds up is cut into several parts per core, shared between the calling thread and
//! the [`pool`](crate::pool) helpers, each a single-threaded matrixmultiply GEMM: on two cores
//! that scales better than matrixmultiply's own threading (1.5-1.75x), which is therefore off. The split is along whichever of rows, columns or depth
//! duplicates the least work (see [`Split`]), so the 100x784x100 products of a small MLP step
//! gain from the second core too. Many small products are spread across cores with rayon, one
//! product per task.
//!
//! Where the CPU has AVX-512, f32 products of moderate size run on kiln's own kernels, which
//! copy nothing (see [`Own`]): [`gemm_nt`](crate::gemm_nt) when both operands are contiguous
//! along the depth (`x · Wᵀ`, a Linear layer's forward), [`gemm_nn`](crate::gemm_nn) when the
//! right one is row-major (`g · W`, `gᵀ · x`: the backward), and a tall `x · Wᵀ` of short depth
//! on `gemm_nn` over a row-major copy of `Wᵀ` ([`NT_VIA_NN`]). A split of such a product
//! ([`split_own`]) starts only from [`OWN_SPLIT`] (waking a helper costs tens of µs here), or
//! from [`OWN_SPLIT_AWAKE`] while a helper is awake anyway, and goes by rows or whole column
//! blocks, in parts that shrink towards the end, written in place.
//!
//! Matrix-vector products (`n == 1` or `m == 1`) skip GEMM: see [`gemv`](crate::gemv).

use kiln_core::{DType, Error, Layout, Result};
use ndarray::linalg::general_mat_mul;
use std::ops::Range;

use ndarray::{ArrayView2, ArrayViewMut2, LinalgScalar, s};
use rayon::prelude::*;

use crate::elementwise::{dtype_err, slice};
use crate::gemm_nn::{self, Strided};
use crate::gemm_nt::{self, Rows};
use crate::gemv::{SPLIT_GEMV, gemv, split_gemv};
use crate::mat::Mat;
use crate::pool;
use crate::storage::{AlignedVec, CpuData, CpuElem, CpuStorage, alloc, new_vec, storage};

/// Products smaller than this many multiply-adds run one per rayon task.
const SMALL_GEMM: usize = 1 << 18;
/// Single products with at least this many multiply-adds are split across cores (about 50 µs
/// of one core's work: below it the wake-up and the duplicated packing cost more than they save).
const SPLIT_GEMM: usize = 1 << 21;
/// The smallest part of a split product, in multiply-adds (about 10 µs of one core's work).
const GEMM_PART: usize = 1 << 19;
/// The smallest part of a split product on an [`Own`] kernel, in multiply-adds (about 1.5 µs
/// of one core's work): nothing is packed or copied per part.
const OWN_MIN_PART: usize = 1 << 18;
/// The column blocks of a split by columns on [`gemm_nn`] (its tiles' width).
const OWN_COLS: usize = 32;
/// Products on an [`Own`] kernel are split across cores from this many multiply-adds (about
/// 18 µs of one core's work). On the 2-core VM waking a sleeping helper costs the caller
/// 3.5-7 µs in the futex call and the helper starts 15-25 µs after it (2026-11-28), so below
/// this the caller would finish alone about as soon.
const OWN_SPLIT: usize = 1 << 22;
/// Where products on an [`Own`] kernel start being split: [`OWN_SPLIT`] while every helper
/// sleeps; [`OWN_SPLIT_AWAKE`] while one is awake (it worked on a product less than the
/// [`pool`]'s watch ago), when sharing costs no wake-up.
fn own_split() -> usize {
    if pool::awake() {
        OWN_SPLIT_AWAKE
    } else {
        OWN_SPLIT
    }
}
/// Products on an [`Own`] kernel are split from this many multiply-adds (about 2 µs of one
/// core's work) while a helper is awake ([`own_split`]). MLP 784-100-100-10 at batch 100 on
/// the 2-core VM (2026-11-28): its 100x100x100 products split, 0.177-0.179 ms a step against
/// 0.171-0.172 (2^18: 0.169-0.172).
const OWN_SPLIT_AWAKE: usize = 1 << 19;
/// The shortest depth that goes to [`gemm_nt`]: below one 16-lane vector most of its work is
/// the fold of the accumulators.
const NT_MIN_K: usize = 16;
/// [`Own`] kernels take depths up to this, and operands of up to [`OWN_MAX_LEN`] elements:
/// they have no cache blocking (a tile's rows of both operands stay in L1 and L2 only while
/// they are this small), larger products keep matrixmultiply's.
const OWN_MAX_K: usize = 1024;
const OWN_MAX_LEN: usize = 1 << 20;

/// How one product is shared among cores. Each part is a single-threaded GEMM that packs its
/// own panels of `a` and `b`, so every split duplicates some work: splitting the rows of the
/// output packs all of `b` (k·n) once per core, splitting its columns packs all of `a` (m·k)
/// once per core, and splitting the depth writes one m·n partial product per extra core and
/// sums them. [`Split::pick`] takes the cheapest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    Rows,
    Cols,
    Depth,
}

impl Split {
    fn pick(m: usize, k: usize, n: usize) -> Split {
        let (rows, cols, depth) = (k * n, m * k, 2 * m * n);
        if depth < rows.min(cols) && k >= 256 {
            Split::Depth
        } else if cols < rows && n >= 64 {
            Split::Cols
        } else {
            Split::Rows
        }
    }
}

fn gemm<T: CpuElem + LinalgScalar>(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    let (x, y) = (slice::<T>("matmul", a)?, slice::<T>("matmul", b)?);
    let (ma, mb) = (Mat::new(la)?, Mat::new(lb)?);
    let batch = la.dims()[0];
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    if lb.dims()[0] != batch || mb.rows != k {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: la.shape().clone(),
            rhs: lb.shape().clone(),
        });
    }
    // Saturating: a product past usize is reported by `alloc` as an impossible size.
    let len = batch.saturating_mul(m).saturating_mul(n);
    let mut out = alloc::<T>("matmul", a.device(), len)?;
    if m * n == 0 || batch == 0 {
        return Ok(storage(a.device(), out));
    }
    if k == 0 {
        out.fill(T::zero());
        return Ok(storage(a.device(), out));
    }
    if batch == 1
        && n == 1
        && (ma.cs == 1 || ma.rs == 1)
        && m * k >= SPLIT_GEMV
        && pool::cores() > 1
    {
        split_gemv((a, &ma), (b, &mb), &mut out)?;
        return Ok(storage(a.device(), out));
    }
    if n == 1 || m == 1 {
        for (bi, o) in out.chunks_mut(m * n).enumerate() {
            gemv(x, &ma, y, &mb, bi, o);
        }
        return Ok(storage(a.device(), out));
    }
    let one = |bi: usize, o: &mut [T]| -> Result<()> {
        if own_rows(x, &ma, y, &mb, bi, o) {
            return Ok(());
        }
        let av = ma.view(x, bi)?;
        let bv = mb.view(y, bi)?;
        let mut cv = ArrayViewMut2::from_shape((m, n), o)
            .map_err(|e| Error::invalid("matmul", e.to_string()))?;
        general_mat_mul(T::one(), &av, &bv, T::zero(), &mut cv);
        Ok(())
    };
    if batch > 1 && m * n * k < SMALL_GEMM {
        out.par_chunks_mut(m * n)
            .enumerate()
            .try_for_each(|(bi, o)| one(bi, o))?;
    } else if batch == 1 && pool::cores() > 1 {
        match own_kernel::<T>(ma, mb) {
            Some(kernel) if m * n * k >= own_split() => {
                split_own(kernel, (a, &ma), (b, &mb), &mut out)?
            }
            None if m * n * k >= SPLIT_GEMM && m.min(n) >= 16 => {
                split_gemm((a, &ma), (b, &mb), &mut out)?
            }
            _ => one(0, &mut out)?,
        }
    } else {
        for (bi, o) in out.chunks_mut(m * n).enumerate() {
            one(bi, o)?;
        }
    }
    Ok(storage(a.device(), out))
}

impl Split {
    /// The operands of the part of `a · b` that `r` (a range of rows, columns or depth) selects.
    fn operands<'a, T>(
        self,
        a: ArrayView2<'a, T>,
        b: ArrayView2<'a, T>,
        r: Range<usize>,
    ) -> (ArrayView2<'a, T>, ArrayView2<'a, T>) {
        match self {
            Split::Rows => (a.slice_move(s![r, ..]), b),
            Split::Cols => (a, b.slice_move(s![.., r])),
            Split::Depth => (a.slice_move(s![.., r.clone()]), b.slice_move(s![r, ..])),
        }
    }
}

impl Split {
    /// Where the part for `r` goes in the output `c`.
    fn target<'c, T>(
        self,
        c: &'c mut ArrayViewMut2<'_, T>,
        r: Range<usize>,
    ) -> ArrayViewMut2<'c, T> {
        match self {
            Split::Rows => c.slice_mut(s![r, ..]),
            Split::Cols => c.slice_mut(s![.., r]),
            Split::Depth => c.view_mut(),
        }
    }
}

fn shape_err(e: ndarray::ShapeError) -> Error {
    Error::invalid("matmul", e.to_string())
}

/// One part of a split product, computed into a buffer of its own (on a helper thread).
fn part<T: CpuElem + LinalgScalar>(
    dev: crate::CpuDevice,
    (a, ma): (&CpuData, Mat),
    (b, mb): (&CpuData, Mat),
    split: Split,
    r: Range<usize>,
) -> Result<AlignedVec<T>> {
    let x = T::slice(a).ok_or_else(|| dtype_err("matmul", T::DTYPE.as_str(), a.dtype()))?;
    let y = T::slice(b).ok_or_else(|| dtype_err("matmul", T::DTYPE.as_str(), b.dtype()))?;
    let (av, bv) = split.operands(ma.view(x, 0)?, mb.view(y, 0)?, r);
    if kiln_core::profile::enabled() {
        crate::storage::profile_alloc("matmul", dev, av.nrows() * bv.ncols() * size_of::<T>());
    }
    let mut out = new_vec::<T>("matmul", dev, av.nrows() * bv.ncols())?;
    let mut cv =
        ArrayViewMut2::from_shape((av.nrows(), bv.ncols()), &mut out[..]).map_err(shape_err)?;
    general_mat_mul(T::one(), &av, &bv, T::zero(), &mut cv);
    Ok(out)
}

/// `out = a · b` for one product (row-major `out`), cut as [`Split::pick`] decides into
/// parts (one or two per core, [`pool::parts`]): this thread writes the first straight into
/// `out` while the [`pool`](crate::pool) helpers start on the others, which it then joins in
/// claiming; those are computed into buffers of their own and then copied (or, for a depth
/// split, added in part order) into place.
fn split_gemm<T: CpuElem + LinalgScalar>(
    (a, ma): (&CpuStorage, &Mat),
    (b, mb): (&CpuStorage, &Mat),
    out: &mut [T],
) -> Result<()> {
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    let split = Split::pick(m, k, n);
    let len = match split {
        Split::Rows => m,
        Split::Cols => n,
        Split::Depth => k,
    };
    let ranges = pool::cut(len, pool::parts(m * k * n, GEMM_PART), 1);
    let (ma, mb, dev) = (*ma, *mb, a.device());
    let (ad, bd) = (a.shared()?, b.shared()?);
    let (x, y) = (slice::<T>("matmul", a)?, slice::<T>("matmul", b)?);
    let (av, bv) = (ma.view(x, 0)?, mb.view(y, 0)?);
    let mut c = ArrayViewMut2::from_shape((m, n), out).map_err(shape_err)?;
    // The first part is written straight into `out` on this thread while the helpers start on
    // the others (each into a buffer of its own, copied or, for a depth split, added after).
    let rest = ranges[1..].to_vec();
    let first = || {
        let (a0, b0) = split.operands(av, bv, ranges[0].clone());
        let mut t = split.target(&mut c, ranges[0].clone());
        general_mat_mul(T::one(), &a0, &b0, T::zero(), &mut t);
    };
    let jobs = rest.clone();
    let parts = pool::run_beside(
        rest.len(),
        move |i| part::<T>(dev, (&ad, ma), (&bd, mb), split, jobs[i].clone()),
        first,
    )
    .ok_or_else(|| Error::backend("matmul", "a part of the product panicked"))?;
    for (r, buf) in rest.into_iter().zip(parts) {
        let buf = buf?;
        let mut t = split.target(&mut c, r);
        let src = ArrayView2::from_shape(t.raw_dim(), &buf[..]).map_err(shape_err)?;
        match split {
            Split::Depth => t.zip_mut_with(&src, |o, &v| *o = *o + v),
            _ => t.assign(&src),
        }
    }
    Ok(())
}

/// kiln's own f32 kernels (AVX-512, nothing copied), each for one layout of the operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Own {
    /// [`gemm_nt`]: rows of `a` and columns of `b` contiguous (unit stride along the depth).
    Nt,
    /// [`gemm_nn`]: `b` row-major, `a` any strides.
    Nn,
}

/// Which [`Own`] kernel computes `a · b`, if one does: f32 on a processor with AVX-512, a
/// product (not a matrix-vector product) of at most [`OWN_MAX_K`] depth and operands of at
/// most [`OWN_MAX_LEN`] elements, in a layout one of them takes.
fn own_kernel<T: CpuElem>(ma: Mat, mb: Mat) -> Option<Own> {
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    if T::DTYPE != DType::F32
        || m < 2
        || n < 2
        || k > OWN_MAX_K
        || m * k > OWN_MAX_LEN
        || k * n > OWN_MAX_LEN
        || !gemm_nt::available()
    {
        return None;
    }
    if ma.cs == 1 && mb.rs == 1 && k >= NT_MIN_K {
        Some(Own::Nt)
    } else if mb.cs == 1 {
        Some(Own::Nn)
    } else {
        None
    }
}

/// Batch `bi`'s product `a · b` into `o` (row-major) on the [`own_kernel`] if there is one;
/// false (nothing written) if not.
fn own_rows<T: CpuElem>(x: &[T], ma: &Mat, y: &[T], mb: &Mat, bi: usize, o: &mut [T]) -> bool {
    let Some(kernel) = own_kernel::<T>(*ma, *mb) else {
        return false;
    };
    let (Some(x), Some(y)) = (as_f32(x), as_f32(y)) else {
        return false;
    };
    let Ok(o) = bytemuck::try_cast_slice_mut::<T, f32>(o) else {
        return false;
    };
    let out = Out {
        ptr: o.as_mut_ptr(),
        len: o.len(),
    };
    if ma.rows >= NT_VIA_NN
        && ma.cols <= NT_VIA_NN_MAX_K
        && let Some((bt, tb)) = row_major_copy(kernel, y, mb, bi)
    {
        // SAFETY: as below.
        unsafe {
            own_block(
                Own::Nn,
                (x, ma),
                (&bt, &tb),
                bi,
                0..ma.rows,
                0..mb.cols,
                out,
            )
        };
        put_scratch(bt);
        return true;
    }
    // SAFETY: `o` is borrowed exclusively for the call and `own_block` checks the block
    // against its length.
    unsafe { own_block(kernel, (x, ma), (y, mb), bi, 0..ma.rows, 0..mb.cols, out) };
    true
}

/// An [`Own::Nt`] product of at least [`NT_VIA_NN`] rows and at most [`NT_VIA_NN_MAX_K`]
/// depth that is not split across cores runs on [`gemm_nn`] over a row-major copy of its
/// right operand ([`gemm_nn::transpose`], one pass over `b`): at a short depth `gemm_nt`'s
/// fold and masked tail cost a third of its time. Single-threaded on the 2-core EPYC VM, µs
/// per call, gemm_nt -> copy + gemm_nn: 100x100x100 15.5 -> 9.9 (the copy 0.9), 100x100x10
/// 1.8 -> 1.6; but 16x784x100 10.7 -> 17.4 (the copy 6.3) and, split across both cores with
/// the copy made before the helper is woken, 100x784x100 64 -> 72 µs a call in an MLP step.
/// The copy changes the order of the sums, so such a product's bits differ from the same
/// rows computed on `gemm_nt` (fewer rows, or a split).
const NT_VIA_NN: usize = 16;
const NT_VIA_NN_MAX_K: usize = 256;

/// For an [`Own::Nt`] product of at least [`NT_VIA_NN`] rows: batch `bi` of `b` copied
/// row-major (into this thread's scratch buffer; give it back with [`put_scratch`]), with the
/// [`Mat`] that reads it.
fn row_major_copy(kernel: Own, y: &[f32], mb: &Mat, bi: usize) -> Option<(Vec<f32>, Mat)> {
    let (k, n) = (mb.rows, mb.cols);
    if kernel != Own::Nt || k * n == 0 {
        return None;
    }
    let mut bt = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    bt.resize(k * n, 0.0);
    let cols = Rows {
        data: y,
        off: mb.off + bi * mb.bstride,
        stride: mb.cs,
        rows: n,
    };
    gemm_nn::transpose(cols, k, &mut bt);
    let tb = Mat {
        off: 0,
        bstride: 0,
        rows: k,
        cols: n,
        rs: n,
        cs: 1,
    };
    Some((bt, tb))
}

thread_local! {
    /// The buffer of [`row_major_copy`], kept between products (it only grows).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Gives a buffer of [`row_major_copy`] back for the next product on this thread.
fn put_scratch(v: Vec<f32>) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if v.capacity() > s.capacity() {
            *s = v;
        }
    });
}

/// `x` as f32s, if `T` is f32 (a cast that changes nothing; CpuElem types are distinct, and
/// only f32 says DType::F32).
fn as_f32<T: CpuElem>(x: &[T]) -> Option<&[f32]> {
    (T::DTYPE == DType::F32)
        .then(|| bytemuck::try_cast_slice::<T, f32>(x).ok())
        .flatten()
}

/// The row-major output of one product, shared by the parts of a split that write disjoint
/// blocks of it.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: an `Out` is only written through by `own_block`, whose callers give each thread a
// block of its own and keep the buffer alive and unused until every part has returned
// (`split_own`).
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

/// Rows `rows` and columns `cols` of batch `bi`'s product `a · b` on `kernel`, written to
/// `out[i * n + j]` (`n` the width of `b`). Panics if the block lies outside `out`.
///
/// # Safety
/// `out.ptr` points to `out.len` writable f32s, and no other thread reads or writes this
/// block's elements until this returns.
unsafe fn own_block(
    kernel: Own,
    (x, ma): (&[f32], &Mat),
    (y, mb): (&[f32], &Mat),
    bi: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out: Out,
) {
    let (k, n) = (ma.cols, mb.cols);
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    assert!(
        rows.end <= ma.rows && cols.end <= n && (rows.end - 1) * n + cols.end <= out.len,
        "matmul: a block of the product lies outside its output"
    );
    let aoff = ma.off + bi * ma.bstride + rows.start * ma.rs;
    let boff = mb.off + bi * mb.bstride;
    // SAFETY: inside `out` (asserted above).
    let o = unsafe { out.ptr.add(rows.start * n + cols.start) };
    match kernel {
        Own::Nt => {
            let a = Rows {
                data: x,
                off: aoff,
                stride: ma.rs,
                rows: rows.len(),
            };
            // The columns of `b` are rows of `k` contiguous elements, `cs` apart.
            let b = Rows {
                data: y,
                off: boff + cols.start * mb.cs,
                stride: mb.cs,
                rows: cols.len(),
            };
            // SAFETY: the block's elements of `out` are writable and ours (our contract).
            unsafe { gemm_nt::product_to(a, b, k, o, n) };
        }
        Own::Nn => {
            let a = Strided {
                data: x,
                off: aoff,
                rs: ma.rs,
                cs: ma.cs,
                rows: rows.len(),
                cols: k,
            };
            let b = Strided {
                data: y,
                off: boff + cols.start,
                rs: mb.rs,
                cs: 1,
                rows: k,
                cols: cols.len(),
            };
            // SAFETY: as above.
            unsafe { gemm_nn::product_to(a, b, o, n) };
        }
    }
}

/// `out = a · b` on an [`Own`] kernel, shared with the [`pool`](crate::pool) helpers: by rows
/// (`gemm_nt`, or `gemm_nn` for narrow products) or by columns in whole 32-column blocks
/// (`gemm_nn`, so that every tile keeps its full height), every part written straight into
/// `out`. The parts shrink towards the end ([`guided`]): a helper starts 15-25 µs after it is
/// woken (2-core VM), and on data another core's cache holds, so equal parts left one core
/// waiting for the other's last; the first part, on this thread, is a quarter of the product.
/// In a small MLP's step (median wall µs per call, profiler trace, 2-core VM), against equal
/// parts of 1 M multiply-adds by rows copied from buffers of their own: 100x784x100 `x · Wᵀ`
/// 68 -> 62, 100x100x784 `gᵀ · x` 57 -> 48 (it takes 57-60 on one core).
fn split_own<T: CpuElem>(
    kernel: Own,
    (a, ma): (&CpuStorage, &Mat),
    (b, mb): (&CpuStorage, &Mat),
    out: &mut [T],
) -> Result<()> {
    let (m, k, n) = (ma.rows, ma.cols, mb.cols);
    let by_cols = kernel == Own::Nn && n >= 4 * OWN_COLS;
    let (len, align, per) = if by_cols {
        (n, OWN_COLS, m * k)
    } else {
        (m, gemm_nt::TILE, k * n)
    };
    let ranges = guided(len, align, (OWN_MIN_PART / per).max(1), 2 * pool::cores());
    let (rows_all, cols_all) = (0..m, 0..n);
    let block = move |r: Range<usize>| {
        if by_cols {
            (rows_all.clone(), r)
        } else {
            (r, cols_all.clone())
        }
    };
    let (ma, mb) = (*ma, *mb);
    let (x, y) = (slice::<f32>("matmul", a)?, slice::<f32>("matmul", b)?);
    let o = bytemuck::try_cast_slice_mut::<T, f32>(out)
        .map_err(|e| Error::backend("matmul", format!("an f32 output: {e}")))?;
    let dst = Out {
        ptr: o.as_mut_ptr(),
        len: o.len(),
    };
    let (ad, bd) = (a.shared()?, b.shared()?);
    let rest = ranges[1..].to_vec();
    let first = ranges[0].clone();
    let part_block = block.clone();
    // A panic in this thread's part is caught, so that `run_beside` still returns only after
    // the helpers' parts, which write into `out`, have finished.
    let mine_panicked = std::cell::Cell::new(false);
    let mine = || {
        let (rows, cols) = block(first);
        let run = || {
            // SAFETY: `out` is borrowed exclusively for this call, and each part writes its
            // own block of it (the ranges are disjoint).
            unsafe { own_block(kernel, (x, &ma), (y, &mb), 0, rows, cols, dst) }
        };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).is_err() {
            mine_panicked.set(true);
        }
    };
    let done = pool::run_beside(
        rest.len(),
        move |i| -> Result<()> {
            let x = f32::slice(&ad).ok_or_else(|| dtype_err("matmul", "f32", ad.dtype()))?;
            let y = f32::slice(&bd).ok_or_else(|| dtype_err("matmul", "f32", bd.dtype()))?;
            let (rows, cols) = part_block(rest[i].clone());
            // SAFETY: as for the first part: `split_own` holds `out` until `run_beside` has
            // returned, which is after every part has (a late helper finds none left).
            unsafe { own_block(kernel, (x, &ma), (y, &mb), 0, rows, cols, dst) };
            Ok(())
        },
        mine,
    )
    .ok_or_else(|| Error::backend("matmul", "a part of the product panicked"))?;
    if mine_panicked.get() {
        return Err(Error::backend("matmul", "a part of the product panicked"));
    }
    done.into_iter().collect()
}

/// `0..len` cut into parts that shrink as the work left does (guided self-scheduling): each
/// part is `1 / share` of what is left, in whole multiples of `align`, at least `min` long.
fn guided(len: usize, align: usize, min: usize, share: usize) -> Vec<Range<usize>> {
    let mut v = Vec::new();
    let mut start = 0;
    while start < len {
        let left = len - start;
        let size = left
            .div_ceil(share.max(1))
            .max(min)
            .next_multiple_of(align.max(1))
            .min(left);
        v.push(start..start + size);
        start += size;
    }
    v
}

pub(crate) fn matmul(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    match dtype {
        DType::F32 => gemm::<f32>(a, la, b, lb),
        DType::F64 => gemm::<f64>(a, la, b, lb),
        _ => Err(dtype_err("matmul", "f32 or f64", dtype)),
    }
}
