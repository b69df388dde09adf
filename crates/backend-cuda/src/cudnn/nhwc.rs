//! The NHWC side of cuDNN convolutions: the layout switch, the transposes between kiln's NCHW
//! tensors and NHWC scratch copies, and the event timer that compares the two layouts.
//!
//! Why: on Hopper, cuDNN's fastest tensor-core convolutions (TF32, bf16, f16 implicit GEMMs)
//! read and write NHWC activations and KRSC filters. Asked through NCHW descriptors, the legacy
//! API's search ends on older NCHW kernels (on an H100, ResNet-18's convolutions took ~12 ms a
//! TF32 step through them against ~7.6 ms for PyTorch's NHWC kernels plus their layout
//! transforms). kiln's tensors stay NCHW; for tensor-core math a geometry may run NHWC with
//! its operands transposed into pool scratch and the result transposed back, when that is
//! faster *including* the transposes (`mod.rs` measures both once per geometry and direction).
//!
//! The transposes are the backend's strided copy (`ops::copy_strided`, the `copy_*` kernels of
//! `contiguous`) over a permuted view: plain kernel launches, so they are captured in a CUDA
//! graph like any other op. Scratch buffers are pool blocks freed (stream-ordered) when the
//! call has been queued.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use cudarc::cudnn::sys as dnn;
use kiln_core::{DType, Layout, Result};

use crate::device::{DeviceState, time_on};
use crate::memory::{Buffer, alloc};

/// Which memory format cuDNN convolutions with tensor-core math (f32 with TF32 allowed, bf16,
/// f16) run in. f64 and f32 with TF32 off always run NCHW (cuDNN's NHWC kernels are
/// tensor-core ones; FMA math keeps the NCHW path that matches the CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudnnLayout {
    /// Measure both per geometry and direction and keep the faster, transposes included.
    Auto,
    /// Always NCHW (kiln's own layout, no transposes): the default. On an H100 (2026-11-27)
    /// `Auto` gained ~2% on a TF32 ResNet-18 step (15.9–16.2 against 16.2–16.8 ms), within
    /// the run-to-run noise, while searching both layouts doubles each geometry's first call
    /// and its one-shot timings can pick the slower layout (BENCHMARKS.md, seventh session).
    Nchw,
    /// NHWC wherever cuDNN offers it for the geometry (all three directions); NCHW otherwise.
    Nhwc,
}

static LAYOUT: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1 + index of the layout

const LAYOUTS: [CudnnLayout; 3] = [CudnnLayout::Auto, CudnnLayout::Nchw, CudnnLayout::Nhwc];

/// The layout switch: [`set_cudnn_layout`], else `KILN_CUDNN_LAYOUT=auto|nchw|nhwc` (default
/// `nchw`; another value is reported once on stderr and taken as `nchw`).
pub fn cudnn_layout() -> CudnnLayout {
    match LAYOUT.load(Ordering::Relaxed) {
        0 => {
            let l = match std::env::var("KILN_CUDNN_LAYOUT").as_deref() {
                Ok("auto") => CudnnLayout::Auto,
                Err(_) | Ok("") | Ok("nchw") => CudnnLayout::Nchw,
                Ok("nhwc") => CudnnLayout::Nhwc,
                Ok(other) => {
                    eprintln!("kiln: KILN_CUDNN_LAYOUT={other:?} is not auto, nchw or nhwc; nchw");
                    CudnnLayout::Nchw
                }
            };
            set_cudnn_layout(l);
            l
        }
        v => LAYOUTS[v as usize - 1],
    }
}

/// Sets the layout of cuDNN convolutions (see [`CudnnLayout`]) for the calls from now on,
/// overriding `KILN_CUDNN_LAYOUT`. Each layout's measured algorithms stay cached, so switching
/// back and forth measures nothing twice.
pub fn set_cudnn_layout(layout: CudnnLayout) {
    let i = LAYOUTS.iter().position(|l| *l == layout).unwrap_or(1);
    LAYOUT.store(i as u8 + 1, Ordering::Relaxed);
}

static NHWC_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many cuDNN convolution calls ran in NHWC since the process started (those of the
/// layout comparison included): lets tests and benchmarks see which layout ran.
pub fn cudnn_nhwc_calls() -> u64 {
    NHWC_CALLS.load(Ordering::Relaxed)
}

pub(super) fn count_nhwc_call() {
    NHWC_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// One of the two memory formats a geometry can run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    Nchw,
    Nhwc,
}

impl Format {
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn cudnn(self) -> dnn::cudnnTensorFormat_t {
        match self {
            Format::Nchw => dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            Format::Nhwc => dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Format::Nchw => "nchw",
            Format::Nhwc => "nhwc",
        }
    }
}

/// A packed NCHW tensor of `dims` (`[n, c, h, w]`) seen in NHWC order: copied packed, it is
/// the NHWC tensor (a filter's `[k, c, r, s]` becomes KRSC the same way).
fn nhwc_view(dims: [usize; 4]) -> Result<Layout> {
    Layout::contiguous(dims.to_vec()).permute(&[0, 2, 3, 1])
}

/// A packed NHWC tensor whose NCHW dimensions are `dims`, seen in NCHW order.
fn nchw_view(dims: [usize; 4]) -> Result<Layout> {
    let [n, c, h, w] = dims;
    Layout::contiguous(vec![n, h, w, c]).permute(&[0, 3, 1, 2])
}

/// A new packed NHWC copy of the packed NCHW `src` of `dims`.
pub(super) fn to_nhwc(src: &Buffer, dims: [usize; 4], dtype: DType) -> Result<Buffer> {
    crate::ops::contiguous(src, &nhwc_view(dims)?, dtype)
}

/// Copies the packed NHWC `src` (whose NCHW dimensions are `dims`) into the packed NCHW `dst`.
pub(super) fn to_nchw(src: &Buffer, dims: [usize; 4], dst: &Buffer, dtype: DType) -> Result<()> {
    let packed = Layout::contiguous(dims.to_vec());
    crate::ops::copy_strided(src, &nchw_view(dims)?, dst, &packed, dtype)
}

/// An NHWC output buffer for `dims` (uninitialized).
pub(super) fn scratch(dev: &'static DeviceState, dims: [usize; 4], dtype: DType) -> Result<Buffer> {
    alloc(dev, dims.iter().product::<usize>() * dtype.size_in_bytes())
}

/// The fastest of `reps` runs of `f` on the current stream, in ms, after one warm-up run
/// (synchronizes; never called while capturing).
pub(super) fn time_ms(
    dev: &'static DeviceState,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f32> {
    f()?;
    let mut best = f32::INFINITY;
    for _ in 0..reps {
        best = best.min(time_on(dev.stream(), "conv2d layout timing", &mut f)?);
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The element offset of index `i` in `l`.
    fn at(l: &Layout, i: [usize; 4]) -> usize {
        l.offset() + i.iter().zip(l.strides()).map(|(a, s)| a * s).sum::<usize>()
    }

    /// The two views address the elements cuDNN's NHWC descriptors expect (the GPU copies
    /// walk them in order): a swapped pair of dimensions fails here, on any machine.
    #[test]
    fn the_views_are_nhwc_and_back() {
        let dims = [2, 3, 4, 5];
        let [n, c, h, w] = dims;
        let (to, back) = (nhwc_view(dims).unwrap(), nchw_view(dims).unwrap());
        assert_eq!(to.dims(), &[n, h, w, c]);
        assert_eq!(back.dims(), &dims);
        for (a, b, y, x) in (0..n).flat_map(|a| {
            (0..c).flat_map(move |b| (0..h).flat_map(move |y| (0..w).map(move |x| (a, b, y, x))))
        }) {
            // Element (n, h, w, c) of the NHWC copy is element (n, c, h, w) of the NCHW source.
            assert_eq!(at(&to, [a, y, x, b]), ((a * c + b) * h + y) * w + x);
            // Element (n, c, h, w) of the NCHW result sits at (n, h, w, c) of the NHWC buffer.
            assert_eq!(at(&back, [a, b, y, x]), ((a * h + y) * w + x) * c + b);
        }
    }
}
