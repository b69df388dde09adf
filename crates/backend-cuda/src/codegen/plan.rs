//! The host side of a launch: how each operand is addressed, the merged dimensions and
//! strides, and the reduction strategy, from the inputs' layouts.

use kiln_core::expr::Program;
use kiln_core::{DType, Error, Layout, Result, Shape};

use super::{Access, Strategy, Variant, elem_outputs, split_partials};
use crate::launch::{MAX_DIMS, collapse_raw};

/// The host side of one launch: the variant, and the index arguments in plain numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub variant: Variant,
    /// Elements (elementwise), or kept elements (reducing).
    pub n: usize,
    /// Reduced elements per kept element (reducing; else 0).
    pub n_red: usize,
    /// Elementwise: the dims shared by the strided inputs. Reducing: the kept dims.
    pub dims: Vec<usize>,
    /// Per operand, its strides in `dims` (empty for contiguous or broadcast inputs of an
    /// elementwise program).
    pub strides: Vec<Vec<usize>>,
    /// Reducing: the reduced dims shared by the strided operands, and each operand's strides
    /// in them (empty unless strided).
    pub red_dims: Vec<usize>,
    pub red_strides: Vec<Vec<usize>>,
    /// [`Strategy::Split`]: the parts each kept element's reduction is cut into (else 1),
    /// and the accumulator dtype of each partial buffer ([`split_partials`]; else empty).
    pub parts: usize,
    pub partials: Vec<DType>,
}

fn too_many_dims(n: usize) -> Error {
    Error::invalid(
        "expr",
        format!("more than {MAX_DIMS} non-mergeable dimensions ({n})"),
    )
}

/// Reductions with at most this many elements per kept element run one thread per kept
/// element.
const THREAD_MAX_RED: usize = 64;

/// Blocks a [`Strategy::Split`] reduction aims for (about 8 resident blocks on each of an
/// H100's or H200's 132 multiprocessors), and the fewest reduced elements a part gets (32 a
/// thread of a 256-thread block: enough loads in flight to stream).
pub(super) const SPLIT_BLOCKS: usize = 1024;
pub(super) const SPLIT_MIN_PART: usize = 1 << 13;
/// Reductions of at most this many elements per kept element are one block each, one launch.
pub(super) const ONE_BLOCK_MAX: usize = 1 << 16;
/// The fewest elements of a reduction that [`split_parts`] splits to fill the device although
/// each kept element is at most [`ONE_BLOCK_MAX`] (see there).
pub(super) const SPLIT_BUSY: usize = 1 << 22;

/// The parts of a [`Strategy::Split`] reduction of `n_kept` kept elements of `n_red` reduced
/// elements each (1: do not split). Up to 64K elements one block does it alone: the second
/// launch would cost a host-bound loop more (3–4 µs of driver time) than the one block takes
/// (a norm of 64K f32 is one launch in d2l-style loops). Above, parts of at least 8K elements:
/// with 64K-element parts (as until 2026-11-27) the per-parameter norms of a GPT's gradient
/// clipping ran 2–9 blocks each, 38–43 µs a weight matrix on an H100, and a 98K-element
/// embedding's one block 83 µs.
///
/// Below 64K elements a kept element is split too when the kept elements alone would leave
/// the multiprocessors idle on a big reduction: fewer than [`SPLIT_BLOCKS`]` / 2` of them over
/// at least [`SPLIT_BUSY`] elements in all (batch norm's statistics over `(n, h, w)` of a
/// `[256, 128, 16, 16]` activation were 128 blocks of 64K elements, one per multiprocessor).
pub(crate) fn split_parts(n_kept: usize, n_red: usize) -> usize {
    let few_blocks = n_kept < SPLIT_BLOCKS / 2 && n_kept * n_red >= SPLIT_BUSY;
    if n_red <= ONE_BLOCK_MAX && !few_blocks {
        return 1;
    }
    let want = SPLIT_BLOCKS.div_ceil(n_kept.max(1));
    want.min(n_red / SPLIT_MIN_PART).max(1)
}

/// Plans one call: `layouts` are the inputs' layouts in the iteration shape `shape`, `axes`
/// the resolved reduction axes. An error when the layouts need more dimensions than a kernel
/// takes (the caller then evaluates op by op).
pub(crate) fn plan(
    p: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    axes: &[usize],
) -> Result<Geometry> {
    let extent_big = layouts
        .iter()
        .any(|l| l.elem_count() >= 1 << 31 || l.storage_extent() >= 1 << 31);
    let wide = shape.elem_count() >= 1 << 31 || extent_big;
    if p.reduces() {
        plan_reduction(p, shape, layouts, axes, wide)
    } else {
        plan_elementwise(shape, layouts, wide)
    }
}

/// The elements per vector of an elementwise program whose operands are addressed as
/// `access`, its contiguous input `k` starting at device address `addr(k)` (see
/// [`Variant::vec`]): 16 bytes of the widest contiguous input or output, so that each of them
/// moves as one aligned vector of that many elements (a comparison of f32 loads 4 floats and
/// stores 4 bytes, as the hand-written comparison kernels did); 0 when nothing is contiguous,
/// a contiguous input is not aligned to its vector, or a strided operand varies within a
/// vector. Outputs are fresh buffers, aligned for any vector.
///
/// `rows` is the strided operands' iteration: the merged dims and, per operand, its strides
/// in them (empty for the others), as [`Geometry::dims`]/[`Geometry::strides`]. A strided
/// operand constant along the innermost of those dims (stride 0 there, as a per-channel
/// scale over `[n, c, h, w]` is along `h·w`), whose length the width divides, reads one value
/// per vector: the kernel finds its offset once per vector, not once per element (the
/// divisions of that search were what bound batch norm's elementwise passes).
pub(crate) fn vec_elems(
    p: &Program,
    access: &[Access],
    rows: (&[usize], &[Vec<usize>]),
    addr: impl Fn(usize) -> u64,
) -> u32 {
    if p.reduces() {
        return 0;
    }
    let contig = || (0..p.inputs().len()).filter(|&k| access[k] == Access::Contig);
    let widest = contig()
        .map(|k| p.inputs()[k].size_in_bytes())
        .chain(p.outputs().iter().map(|&o| p.dtype(o).size_in_bytes()))
        .max();
    let Some(widest) = widest.filter(|&w| w < 16) else {
        return 0;
    };
    let n = 16 / widest;
    let aligned =
        contig().all(|k| addr(k).is_multiple_of((n * p.inputs()[k].size_in_bytes()) as u64));
    let (dims, strides) = rows;
    let rows_ok = (0..access.len())
        .filter(|&k| access[k] == Access::Strided)
        .all(|k| {
            dims.last().is_some_and(|d| d % n == 0)
                && strides.get(k).and_then(|s| s.last()) == Some(&0)
        });
    if aligned && rows_ok { n as u32 } else { 0 }
}

/// Each strided operand's strides from `collapsed` (in order), empty for the others.
fn per_operand(access: &[Access], collapsed: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    let mut it = collapsed.into_iter();
    access
        .iter()
        .map(|a| {
            if *a == Access::Strided {
                it.next().expect("one per strided operand")
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// An elementwise program: each input broadcast, contiguous or strided; the strided ones'
/// dimensions merged together.
fn plan_elementwise(shape: &Shape, layouts: &[&Layout], wide: bool) -> Result<Geometry> {
    let access: Vec<Access> = layouts
        .iter()
        .map(|l| {
            if l.reads_one() {
                Access::Bcast
            } else if l.is_contiguous() {
                Access::Contig
            } else {
                Access::Strided
            }
        })
        .collect();
    let strided: Vec<&[usize]> = layouts
        .iter()
        .zip(&access)
        .filter(|(_, a)| **a == Access::Strided)
        .map(|(l, _)| l.strides())
        .collect();
    let (cd, cs) = collapse_raw(shape.dims(), &strided);
    if cd.len() > MAX_DIMS {
        return Err(too_many_dims(cd.len()));
    }
    let strides = per_operand(&access, cs);
    Ok(Geometry {
        variant: Variant {
            wide,
            strategy: Strategy::Elementwise,
            vec: 0,
            access,
        },
        n: shape.elem_count(),
        n_red: 0,
        dims: cd,
        strides,
        red_dims: Vec::new(),
        red_strides: Vec::new(),
        parts: 1,
        partials: Vec::new(),
    })
}

/// A reducing program: the operands (inputs, then elementwise outputs) split into kept and
/// reduced axes, each part merged on its own; the access along the reduced axes; the strategy
/// from the sizes.
fn plan_reduction(
    p: &Program,
    shape: &Shape,
    layouts: &[&Layout],
    axes: &[usize],
    wide: bool,
) -> Result<Geometry> {
    let dims = shape.dims();
    // Operands: the inputs, then the elementwise outputs (contiguous in the iteration shape).
    let contiguous = Layout::contiguous(shape.clone());
    let mut ops: Vec<&[usize]> = layouts.iter().map(|l| l.strides()).collect();
    for _ in elem_outputs(p) {
        ops.push(contiguous.strides());
    }
    let kept_axes: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
    let pick =
        |v: &[usize], which: &[usize]| -> Vec<usize> { which.iter().map(|&a| v[a]).collect() };
    let kdims = pick(dims, &kept_axes);
    let rdims = pick(dims, axes);
    let kstr: Vec<Vec<usize>> = ops.iter().map(|s| pick(s, &kept_axes)).collect();
    let rstr: Vec<Vec<usize>> = ops.iter().map(|s| pick(s, axes)).collect();
    let krefs: Vec<&[usize]> = kstr.iter().map(|v| v.as_slice()).collect();
    let (kd, ks) = collapse_raw(&kdims, &krefs);
    if kd.len() > MAX_DIMS {
        return Err(too_many_dims(kd.len()));
    }
    let access: Vec<Access> = rstr
        .iter()
        .map(|s| {
            if Layout::strides_read_one(&rdims, s) {
                Access::Bcast
            } else if Layout::strides_row_major(&rdims, s) {
                Access::Contig
            } else {
                Access::Strided
            }
        })
        .collect();
    let srefs: Vec<&[usize]> = rstr
        .iter()
        .zip(&access)
        .filter(|(_, a)| **a == Access::Strided)
        .map(|(s, _)| s.as_slice())
        .collect();
    let (rd, rs) = collapse_raw(&rdims, &srefs);
    if rd.len() > MAX_DIMS {
        return Err(too_many_dims(rd.len()));
    }
    let red_strides = per_operand(&access, rs);
    let n_kept: usize = kdims.iter().product();
    let n_red: usize = rdims.iter().product();
    let parts = split_parts(n_kept, n_red);
    let strategy = if n_red <= THREAD_MAX_RED {
        Strategy::Thread
    } else if parts > 1 {
        Strategy::Split
    } else {
        Strategy::Block
    };
    let split = strategy == Strategy::Split;
    Ok(Geometry {
        variant: Variant {
            wide,
            strategy,
            vec: 0,
            access,
        },
        n: n_kept,
        n_red,
        dims: kd,
        strides: ks,
        red_dims: rd,
        red_strides,
        parts: if split { parts } else { 1 },
        partials: if split { split_partials(p) } else { Vec::new() },
    })
}
