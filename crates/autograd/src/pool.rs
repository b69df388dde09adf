//! Average pooling on variables: `F.avg_pool2d` and `F.adaptive_avg_pool2d` over `[n, c, h, w]`.
//!
//! # How
//!
//! An average over a rectangular window is *separable*: the window is a range of rows times a
//! range of columns (clipped to the input, padding being zeros), and its divisor is the
//! product of the two range lengths (`count_include_pad = false`, adaptive pooling) or
//! `kh · kw` (`count_include_pad = true`, where a window never leaves the padded input). So
//! `y = P_h · x · P_wᵀ` for two small constant matrices `P_h [oh, h]` and `P_w [ow, w]` holding
//! `1 / length` inside each window: two GEMMs forward, their two transposes backward (which
//! kiln's `matmul` already differentiates), on every backend with no kernel of its own. No
//! index tensor, no scatter, and the backward of overlapping windows comes for free.
//!
//! The common cases take a cheaper road: non-overlapping windows without padding (`stride ==
//! kernel`, every adaptive pooling whose output divides its input, the global average pool of a
//! ResNet head) are a view `[n, c, oh, kh, ow, kw]` and one mean over axes 3 and 5: one
//! reduction program forward, one broadcast backward.
//!
//! # The matrices are uploaded once
//!
//! A matrix depends only on its axis's geometry (`avg_pool2d`'s input length, kernel, stride,
//! padding and `count_include_pad`, or adaptive pooling's input and output lengths), the dtype
//! and the device, so it is built on the host and uploaded on first use and then kept in a
//! small process-wide cache keyed by exactly that (per backend; the rows and the columns of a
//! square pooling share one entry): a network that pools the same shapes every step uploads
//! nothing after its first step, and a second device gets its own copy rather than a
//! cross-device read. The cache holds at most [`MATRIX_CACHE_CAPACITY`] matrices and drops
//! the least recently used beyond that; each is `out × len` values (a few KiB for the pools of
//! a ResNet), so what it keeps alive on a device (also across `empty_cache`) is negligible.
//! The cache lives here rather than in the nn layers so that the functional
//! [`Var::avg_pool2d`] profits too, and because the geometry, not a module, is what
//! determines a matrix.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use kiln_core::{Backend, DType, Error, HostBuffer, Result, Tensor};

use crate::var::Var;

/// Checks a `[n, c, h, w]` float input of `op`; returns `(n, c, h, w)`.
fn check_nchw<B: Backend>(op: &'static str, x: &Var<B>) -> Result<[usize; 4]> {
    if !x.dtype().is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: "a float input".into(),
            got: x.dtype(),
        });
    }
    match *x.dims() {
        [n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(Error::invalid(
            op,
            format!("expects an input [n, c, h, w], got shape {}", x.shape()),
        )),
    }
}

/// What determines the windows of one axis, and so its matrix (the cache's key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum AxisKey {
    Avg {
        len: usize,
        kernel: usize,
        stride: usize,
        pad: usize,
        include_pad: bool,
        ceil_mode: bool,
        /// This axis's share of a `divisor_override` (the rows take it all, the columns 1).
        divisor: Option<usize>,
    },
    Adaptive {
        len: usize,
        out: usize,
    },
}

/// One axis of a pooling: for each output index, the input range `[start, end)` it averages
/// and the divisor.
struct Axis {
    key: AxisKey,
    len: usize,
    windows: Vec<(usize, usize, f64)>,
}

impl Axis {
    /// `[out, len]`: `1 / divisor` inside each window, else 0.
    fn matrix(&self) -> Vec<f64> {
        let mut m = vec![0.0; self.windows.len() * self.len];
        for (o, &(s, e, d)) in self.windows.iter().enumerate() {
            m[o * self.len + s..o * self.len + e].fill(1.0 / d);
        }
        m
    }

    /// Windows of `k` that tile the axis from 0 with no gap, overlap or padding.
    fn tiles(&self) -> Option<usize> {
        let &(s0, e0, d) = self.windows.first()?;
        let k = e0 - s0;
        let ok = s0 == 0
            && d == k as f64
            && self
                .windows
                .iter()
                .enumerate()
                .all(|(o, &(s, e, d))| s == o * k && e == s + k && d == k as f64);
        ok.then_some(k)
    }
}

/// Averages `x` `[n, c, h, w]` over the windows of `rows` and `cols`.
fn pool<B: Backend>(x: &Var<B>, rows: &Axis, cols: &Axis) -> Result<Var<B>> {
    let &[n, c, h, w] = x.dims().as_slice() else {
        unreachable!("checked by the callers")
    };
    let (oh, ow) = (rows.windows.len(), cols.windows.len());
    if let (Some(kh), Some(kw)) = (rows.tiles(), cols.tiles()) {
        // Non-overlapping windows: drop the rows and columns no window reads, view the windows
        // as axes and take one mean.
        let mut v = x.clone();
        if oh * kh != h {
            v = v.narrow(2, 0, oh * kh)?;
        }
        if ow * kw != w {
            v = v.narrow(3, 0, ow * kw)?;
        }
        return v.reshape([n, c, oh, kh, ow, kw])?.mean(&[3, 5], false);
    }
    let dev = x.device();
    // x · P_wᵀ: [n·c, h, ow]; then (·)ᵀ · P_hᵀ: [n·c, ow, oh]; back to [n, c, oh, ow].
    let pw_t = Var::constant(matrix_t::<B>(cols, x.dtype(), &dev)?);
    let ph_t = Var::constant(matrix_t::<B>(rows, x.dtype(), &dev)?);
    let t = x.reshape([n * c, h, w])?.matmul(&pw_t)?;
    let y = t.transpose(1, 2)?.matmul(&ph_t)?; // [n·c, ow, oh]
    y.transpose(1, 2)?.reshape([n, c, oh, ow])
}

/// How many matrices [`matrix_t`] keeps per backend (module docs).
const MATRIX_CACHE_CAPACITY: usize = 64;

/// The cached matrices of one backend, least recently used first.
type Entries<B> = Vec<((AxisKey, DType, <B as Backend>::Device), Tensor<B>)>;

/// Runs `f` on backend `B`'s cache, under the process-wide lock.
fn with_cache<B: Backend, R>(f: impl FnOnce(&mut Entries<B>) -> R) -> R {
    static CACHES: OnceLock<Mutex<HashMap<TypeId, Box<dyn Any + Send>>>> = OnceLock::new();
    let mut g = CACHES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let entries = g
        .entry(TypeId::of::<B>())
        .or_insert_with(|| Box::new(Entries::<B>::new()))
        .downcast_mut::<Entries<B>>()
        .expect("each backend's cache is keyed by its type");
    f(entries)
}

/// `P_axisᵀ` (`[len, out]`, a transposed view) in `dtype` on `device`: from the process-wide
/// cache, or built, uploaded and cached (module docs).
fn matrix_t<B: Backend>(axis: &Axis, dtype: DType, device: &B::Device) -> Result<Tensor<B>> {
    let key = (axis.key, dtype, device.clone());
    let hit = with_cache::<B, _>(|e| {
        let i = e.iter().position(|(k, _)| *k == key)?;
        let entry = e.remove(i);
        let t = entry.1.clone();
        e.push(entry);
        Some(t)
    });
    if let Some(t) = hit {
        return Ok(t);
    }
    // Built and uploaded outside the lock; two threads missing together both upload, and the
    // later insert wins.
    let t = Tensor::from_host(
        &HostBuffer::from_f64(dtype, &axis.matrix()),
        [axis.windows.len(), axis.len],
        device,
    )?
    .t()?;
    with_cache::<B, _>(|e| {
        e.retain(|(k, _)| *k != key);
        if e.len() >= MATRIX_CACHE_CAPACITY {
            e.remove(0);
        }
        e.push((key, t.clone()));
    });
    Ok(t)
}

/// The windows of `avg_pool2d` along one axis of length `len`, as PyTorch's: window `o` starts
/// at `o·stride - pad` and ends at `min(start + k, len + pad)` (only `ceil_mode`'s last window
/// is cut there); it averages the input inside it, divided by its length with padding
/// (`include_pad`), by the input it covers, or by `divisor` when given.
fn avg_axis(
    len: usize,
    k: usize,
    stride: usize,
    pad: usize,
    opts: AvgPoolOptions,
    divisor: Option<usize>,
) -> Axis {
    let floor = (len + 2 * pad - k) / stride + 1;
    let out = if opts.ceil_mode {
        ceil_out_len(len, k, stride, pad)
    } else {
        floor
    };
    let windows = (0..out)
        .map(|o| {
            let start = (o * stride) as isize - pad as isize;
            let end = (start + k as isize).min((len + pad) as isize);
            let (s, e) = (start.max(0) as usize, (end.max(0) as usize).min(len));
            let d = match divisor {
                Some(d) => d,
                None if opts.count_include_pad => (end - start) as usize,
                None => e - s,
            };
            (s, e, d as f64)
        })
        .collect();
    let key = AxisKey::Avg {
        len,
        kernel: k,
        stride,
        pad,
        include_pad: opts.count_include_pad,
        ceil_mode: opts.ceil_mode,
        divisor,
    };
    Axis { key, len, windows }
}

/// The pooled length of `len` under PyTorch's `ceil_mode`: one more window than the floor when
/// a partial one is left, unless it would start in the right padding.
fn ceil_out_len(len: usize, k: usize, stride: usize, pad: usize) -> usize {
    let mut out = (len + 2 * pad - k).div_ceil(stride) + 1;
    if (out - 1) * stride >= len + pad {
        out -= 1;
    }
    out
}

/// `avg_pool2d`'s options beyond the window (PyTorch's `F.avg_pool2d` arguments, with its
/// defaults from [`AvgPoolOptions::default`]: `ceil_mode = false`, `count_include_pad = true`,
/// no `divisor_override`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AvgPoolOptions {
    /// Keep a last, partial window where the input's end leaves one (PyTorch's `ceil_mode`).
    pub ceil_mode: bool,
    /// Whether the zero padding counts in the divisor.
    pub count_include_pad: bool,
    /// Divide every window's sum by this instead (PyTorch's `divisor_override`).
    pub divisor_override: Option<usize>,
}

impl Default for AvgPoolOptions {
    fn default() -> Self {
        AvgPoolOptions {
            ceil_mode: false,
            count_include_pad: true,
            divisor_override: None,
        }
    }
}

/// The windows of `adaptive_avg_pool2d` along one axis: PyTorch's `start = ⌊o·len/out⌋`,
/// `end = ⌈(o+1)·len/out⌉`.
fn adaptive_axis(len: usize, out: usize) -> Axis {
    let windows = (0..out)
        .map(|o| {
            let s = o * len / out;
            let e = ((o + 1) * len).div_ceil(out);
            (s, e, (e - s) as f64)
        })
        .collect();
    let key = AxisKey::Adaptive { len, out };
    Axis { key, len, windows }
}

impl<B: Backend> Var<B> {
    /// 2-D average pooling over `[n, c, h, w]` (PyTorch's `F.avg_pool2d(x, kernel, stride,
    /// padding, ceil_mode=False, count_include_pad)`; PyTorch's default is
    /// `count_include_pad = true`: the zero padding counts in the divisor). `padding` is at most
    /// half the kernel, as in PyTorch. Separable: two GEMMs with constant matrices, or one mean
    /// for non-overlapping windows (module docs).
    pub fn avg_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> Result<Self> {
        let opts = AvgPoolOptions {
            count_include_pad,
            ..Default::default()
        };
        self.avg_pool2d_with(kernel, stride, padding, opts)
    }

    /// [`Var::avg_pool2d`] with all of PyTorch's options (`F.avg_pool2d(x, kernel, stride,
    /// padding, ceil_mode, count_include_pad, divisor_override)`). A zero `divisor_override`
    /// is an error.
    pub fn avg_pool2d_with(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        opts: AvgPoolOptions,
    ) -> Result<Self> {
        const OP: &str = "avg_pool2d";
        let [_, _, h, w] = check_nchw(OP, self)?;
        let bad = kernel.contains(&0)
            || stride.contains(&0)
            || 2 * padding[0] > kernel[0]
            || 2 * padding[1] > kernel[1];
        if bad {
            return Err(Error::invalid(
                OP,
                format!(
                    "kernel {kernel:?} and stride {stride:?} must be positive and padding \
                     {padding:?} at most half the kernel"
                ),
            ));
        }
        if h + 2 * padding[0] < kernel[0] || w + 2 * padding[1] < kernel[1] {
            return Err(Error::invalid(
                OP,
                format!(
                    "a {h}x{w} input padded by {padding:?} is smaller than the kernel \
                     {kernel:?}"
                ),
            ));
        }
        if opts.divisor_override == Some(0) {
            return Err(Error::invalid(
                OP,
                "divisor_override must be positive, got 0",
            ));
        }
        // An overriding divisor is one number for the 2-D window: the rows divide by it, the
        // columns by 1.
        let (dr, dc) = match opts.divisor_override {
            Some(d) => (Some(d), Some(1)),
            None => (None, None),
        };
        let rows = avg_axis(h, kernel[0], stride[0], padding[0], opts, dr);
        let cols = avg_axis(w, kernel[1], stride[1], padding[1], opts, dc);
        pool(self, &rows, &cols)
    }

    /// 2-D adaptive average pooling of `[n, c, h, w]` to `[n, c, out_h, out_w]` (PyTorch's
    /// `F.adaptive_avg_pool2d(x, (out_h, out_w))`, with its window formula: output `o` of an
    /// axis of length `len` averages `⌊o·len/out⌋ .. ⌈(o+1)·len/out⌉`). `[1, 1]` is the global
    /// average pool.
    pub fn adaptive_avg_pool2d(&self, output: [usize; 2]) -> Result<Self> {
        const OP: &str = "adaptive_avg_pool2d";
        let [_, _, h, w] = check_nchw(OP, self)?;
        if output.contains(&0) || h == 0 || w == 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "the output size {output:?} and the input's h and w must be positive, got \
                     an input of shape {}",
                    self.shape()
                ),
            ));
        }
        pool(
            self,
            &adaptive_axis(h, output[0]),
            &adaptive_axis(w, output[1]),
        )
    }
}
