//! 2-D convolution and max pooling, built from differentiable gathers and one GEMM.
//!
//! Both layers lower to ops that kiln-autograd already differentiates, so they need no
//! hand-written backward and run on every backend:
//!
//! - **Conv2d** is im2col + matmul. The input `[n, c, h, w]` is viewed batch-last, as rows
//!   `[c*h*w, n]`; a constant index tensor picks, for every tap `(c, kh, kw)` and output position
//!   `(oh, ow)`, the row it reads (`index_select` along axis 0), so every index copies a
//!   contiguous run of `n` values and the columns `[c*kh*kw, oh*ow*n]` come out as one matrix.
//!   Taps that fall into the zero padding point at one extra zero row, so padding costs no
//!   masking. One GEMM with the weight `[oc, c*kh*kw]` gives `[oc, oh, ow, n]`, returned as a
//!   `[n, oc, oh, ow]` view. The backward of `index_select` is a `scatter_add` (col2im), of the
//!   matmul two GEMMs. (Gathering batch-first, one element per index, was twice as slow on the
//!   CPU.) With `groups > 1` the column rows of each group are consecutive (`c` is the outer
//!   loop of the row order), so the columns are viewed `[groups, c/groups*kh*kw, oh*ow*n]` and
//!   one batched GEMM with the weight `[groups, oc/groups, c/groups*kh*kw]` does every group;
//!   depthwise convolution is the case `groups = c`.
//! - **MaxPool2d** gathers each window the same way, takes the arg-max per window (a constant),
//!   and then `gather`s the winners from the input directly, so the gradient goes to the first
//!   maximum of each window, as in PyTorch.
//!
//! Index tensors depend only on the input's spatial shape; each layer caches the last one (per
//! device), so steady-state training uploads nothing.
//!
//! **A backend's own convolution first.** Where the backend offers a convolution of its own
//! (the CUDA backend's cuDNN, [`Var::conv2d_native`]), [`conv2d`], [`conv2d_grouped`] and
//! [`Conv2d`] use it — one recorded op, the library's kernels forward and backward — and add
//! the bias after it; otherwise (the CPU, or CUDA without cuDNN or with `KILN_CUDNN=0`) the
//! im2col path above runs, unchanged. A few shapes (a stem layer's 3 input channels) run
//! faster through im2col even where the library is offered: those are measured once per shape
//! and routed to the faster path (`conv_route.rs`, [`set_conv_routing`](crate::set_conv_routing)).
//! [`conv2d_im2col_path`] always takes im2col, to compare the two.

use std::sync::Mutex;

use kiln_autograd::Var;
use kiln_core::{Backend, Conv2dSpec, DType, Error, Generator, Result, Tensor};

use crate::conv_route::{Candidate, prefer_im2col};
use crate::init::Init;
use crate::module::Module;

/// Output length of a sliding window over `len` (PyTorch's formula), or `None` when the window
/// does not fit.
fn out_len(len: usize, k: usize, stride: usize, pad: usize, dil: usize) -> Option<usize> {
    let span = dil * (k - 1) + 1;
    let padded = len + 2 * pad;
    if padded < span {
        return None;
    }
    Some((padded - span) / stride + 1)
}

/// A one-entry cache of an index tensor keyed by the input geometry and the device.
/// Holds the indices and whether any of them points into the padding.
type Cached<B> = (Vec<usize>, Tensor<B>, bool);
struct IdxCache<B: Backend>(Mutex<Option<Cached<B>>>);

impl<B: Backend> IdxCache<B> {
    fn new() -> Self {
        IdxCache(Mutex::new(None))
    }
    fn get_or(
        &self,
        key: Vec<usize>,
        device: &B::Device,
        make: impl FnOnce() -> Result<(Tensor<B>, bool)>,
    ) -> Result<(Tensor<B>, bool)> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, t, pads)) = &*g
            && *k == key
            && t.device() == device
        {
            return Ok((t.clone(), *pads));
        }
        let (t, pads) = make()?;
        *g = Some((key, t.clone(), pads));
        Ok((t, pads))
    }
}

/// Checks a `[n, c, h, w]` input.
fn check_nchw<B: Backend>(op: &'static str, x: &Var<B>, channels: Option<usize>) -> Result<()> {
    let ok = x.rank() == 4 && channels.is_none_or(|c| x.dims()[1] == c);
    if !ok {
        return Err(Error::invalid(
            op,
            format!(
                "expects input [n, {}, h, w], got shape {}",
                channels.map_or("c".to_string(), |c| c.to_string()),
                x.shape()
            ),
        ));
    }
    Ok(())
}

// ---- Conv2d -----------------------------------------------------------------------------------

/// Configuration of a [`Conv2d`] layer (`Conv2dConfig::new(1, 6, 5).with_padding(2)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conv2dConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    /// Channel groups (PyTorch's `groups`): each group of `in_channels / groups` inputs feeds
    /// `out_channels / groups` outputs; `groups = in_channels` is depthwise.
    pub groups: usize,
    pub bias: bool,
    /// Default PyTorch's Kaiming uniform with `a = √5`.
    pub weight_init: Init,
    pub dtype: DType,
}

impl Conv2dConfig {
    /// A square `kernel x kernel` convolution, stride 1, no padding, with bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel: usize) -> Self {
        Conv2dConfig {
            in_channels,
            out_channels,
            kernel: [kernel, kernel],
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
            weight_init: Init::torch_default(),
            dtype: DType::F32,
        }
    }
    pub fn with_kernel(mut self, kh: usize, kw: usize) -> Self {
        self.kernel = [kh, kw];
        self
    }
    pub fn with_stride(mut self, stride: usize) -> Self {
        self.stride = [stride, stride];
        self
    }
    pub fn with_padding(mut self, padding: usize) -> Self {
        self.padding = [padding, padding];
        self
    }
    pub fn with_dilation(mut self, dilation: usize) -> Self {
        self.dilation = [dilation, dilation];
        self
    }
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = init;
        self
    }
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Creates the parameters on `device`, the weight and then the bias drawn from
    /// `generator`.
    pub fn init<B: Backend>(
        self,
        device: &B::Device,
        generator: &mut Generator,
    ) -> Result<Conv2d<B>> {
        let bad = self.in_channels == 0
            || self.out_channels == 0
            || self.kernel.contains(&0)
            || self.stride.contains(&0)
            || self.dilation.contains(&0)
            || self.groups == 0
            || !self.in_channels.is_multiple_of(self.groups)
            || !self.out_channels.is_multiple_of(self.groups);
        if bad {
            return Err(Error::invalid(
                "Conv2dConfig::init",
                format!(
                    "channels, kernel, stride, dilation and groups must be positive, and both \
                     channel counts divisible by groups: {self:?}"
                ),
            ));
        }
        let [kh, kw] = self.kernel;
        let cg = self.in_channels / self.groups;
        let shape = [self.out_channels, cg, kh, kw];
        let w = self
            .weight_init
            .init::<B>(shape, generator, self.dtype, device)?;
        let bias = if self.bias {
            let fan_in = cg * kh * kw;
            Some(Var::param(Init::BiasUniform { fan_in }.init::<B>(
                [self.out_channels],
                generator,
                self.dtype,
                device,
            )?))
        } else {
            None
        };
        Ok(Conv2d {
            cfg: self,
            weight: Var::param(w),
            bias,
            idx: IdxCache::new(),
        })
    }
}

/// 2-D convolution (cross-correlation, as every framework computes it) over `[n, c, h, w]`.
pub struct Conv2d<B: Backend> {
    cfg: Conv2dConfig,
    /// `[out_channels, in_channels / groups, kh, kw]`, as PyTorch.
    pub weight: Var<B>,
    /// `[out_channels]`.
    pub bias: Option<Var<B>>,
    idx: IdxCache<B>,
}

impl<B: Backend> Conv2d<B> {
    pub fn config(&self) -> &Conv2dConfig {
        &self.cfg
    }

    /// The layer's sliding window (kernel, stride, padding, dilation).
    pub fn window(&self) -> Window {
        let c = &self.cfg;
        Window {
            kernel: c.kernel,
            stride: c.stride,
            padding: c.padding,
            dilation: c.dilation,
        }
    }

    /// The geometry handed to a backend's own convolution.
    pub(crate) fn spec(&self) -> Conv2dSpec {
        let c = &self.cfg;
        Conv2dSpec {
            stride: c.stride,
            padding: c.padding,
            dilation: c.dilation,
            groups: c.groups,
        }
    }

    /// This layer's convolution with another `weight` and `bias` of its shapes (a folded
    /// batch norm's, `conv_bn.rs`), through the same paths and index cache as
    /// [`Module::forward`].
    pub(crate) fn forward_with(
        &self,
        x: &Var<B>,
        weight: &Var<B>,
        bias: Option<&Var<B>>,
    ) -> Result<Var<B>> {
        conv2d_cached(
            x,
            weight,
            bias,
            self.window(),
            self.cfg.groups,
            Some(&self.idx),
        )
    }

    /// A new layer from this one's geometry and the given parameters (made parameters here):
    /// what `Conv2d::fold_batch_norm` returns.
    pub(crate) fn with_params(&self, weight: Tensor<B>, bias: Tensor<B>) -> Conv2d<B> {
        Conv2d {
            cfg: Conv2dConfig {
                bias: true,
                dtype: weight.dtype(),
                ..self.cfg
            },
            weight: Var::param(weight),
            bias: Some(Var::param(bias)),
            idx: IdxCache::new(),
        }
    }
}

/// The sliding-window geometry shared by convolution and pooling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl Window {
    /// A square `kernel x kernel` window, stride 1, no padding, no dilation.
    pub fn new(kernel: usize) -> Self {
        Window {
            kernel: [kernel, kernel],
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
        }
    }
    pub fn with_stride(mut self, stride: usize) -> Self {
        self.stride = [stride, stride];
        self
    }
    pub fn with_padding(mut self, padding: usize) -> Self {
        self.padding = [padding, padding];
        self
    }
    pub fn with_dilation(mut self, dilation: usize) -> Self {
        self.dilation = [dilation, dilation];
        self
    }

    /// Output height and width for an `h x w` input, or an error naming `op`.
    fn out_hw(&self, op: &'static str, h: usize, w: usize) -> Result<(usize, usize)> {
        if self.kernel.contains(&0) || self.stride.contains(&0) || self.dilation.contains(&0) {
            return Err(Error::invalid(
                op,
                format!("kernel, stride and dilation must be positive: {self:?}"),
            ));
        }
        let [kh, kw] = self.kernel;
        let [ph, pw] = self.padding;
        let [dh, dw] = self.dilation;
        let sizes = (
            out_len(h, kh, self.stride[0], ph, dh),
            out_len(w, kw, self.stride[1], pw, dw),
        );
        match sizes {
            (Some(oh), Some(ow)) => Ok((oh, ow)),
            _ => Err(Error::invalid(
                op,
                format!("a {h}x{w} input does not fit the window {self:?}"),
            )),
        }
    }

    /// For each input plane `c` and tap `(kh, kw)`, then each output position `(oh, ow)`, in
    /// that order (the row order of im2col columns `[c*kh*kw, oh*ow]`): the flat index
    /// `c*h*w + ih*w + iw` of the input element read, or `c*h*w` (one extra zero row) inside
    /// the padding. Also returns whether any tap falls in the padding.
    fn im2col_ids(
        &self,
        channels: usize,
        h: usize,
        w: usize,
        oh: usize,
        ow: usize,
    ) -> (Vec<i64>, bool) {
        let [kh, kw] = self.kernel;
        let [sh, sw] = self.stride;
        let [ph, pw] = self.padding;
        let [dh, dw] = self.dilation;
        let pad = (channels * h * w) as i64;
        let mut ids = Vec::with_capacity(oh * ow * channels * kh * kw);
        let mut pads = false;
        for ci in 0..channels {
            for ky in 0..kh {
                for kx in 0..kw {
                    for y in 0..oh {
                        let iy = (y * sh + ky * dh) as isize - ph as isize;
                        for x in 0..ow {
                            let ix = (x * sw + kx * dw) as isize - pw as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                ids.push(pad);
                                pads = true;
                            } else {
                                ids.push((ci * h * w + iy as usize * w + ix as usize) as i64);
                            }
                        }
                    }
                }
            }
        }
        (ids, pads)
    }
}

/// `torch.nn.functional.conv2d`: `x` `[n, c, h, w]`, `weight` `[oc, c, kh, kw]`, `bias` `[oc]`;
/// returns `[n, oc, oh, ow]`. The window's kernel must match the weight's.
pub fn conv2d<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    bias: Option<&Var<B>>,
    window: Window,
) -> Result<Var<B>> {
    conv2d_cached(x, weight, bias, window, 1, None)
}

/// `torch.nn.functional.conv2d(..., groups=groups)`: `x` `[n, c, h, w]`, `weight`
/// `[oc, c/groups, kh, kw]`, `bias` `[oc]`; `oc` and `c` divisible by `groups`. Each group of
/// `c/groups` input channels feeds `oc/groups` outputs; `groups = c` is a depthwise
/// convolution.
pub fn conv2d_grouped<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    bias: Option<&Var<B>>,
    window: Window,
    groups: usize,
) -> Result<Var<B>> {
    conv2d_cached(x, weight, bias, window, groups, None)
}

fn conv2d_cached<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    bias: Option<&Var<B>>,
    window: Window,
    groups: usize,
    cache: Option<&IdxCache<B>>,
) -> Result<Var<B>> {
    let (oc, _) = check_conv(x, weight, bias, window, groups)?;
    let g = groups;
    let d = x.dims();
    let (h, w) = (d[2], d[3]);
    let (oh, ow) = window.out_hw("conv2d", h, w)?;
    let spec = Conv2dSpec {
        stride: window.stride,
        padding: window.padding,
        dilation: window.dilation,
        groups: g,
    };
    if library_offered(x)
        && !routed_to_im2col(x, weight, window, groups, spec, (oh, ow))?
        && let Some(y) = x.conv2d_native(weight, spec)?
    {
        // The backend's library (cuDNN) convolved; the bias is one broadcast add, in the
        // convolution's dtype (under autocast the low one, as PyTorch's conv2d casts its bias).
        return match bias {
            Some(b) => y.add(&b.autocast_low()?.reshape([1, oc, 1, 1])?),
            None => Ok(y),
        };
    }
    conv2d_im2col(x, weight, bias, window, groups, cache, (oh, ow))
}

/// Whether the backend offers its own convolution for `x`'s dtype (and the autocast dtype).
fn library_offered<B: Backend>(x: &Var<B>) -> bool {
    let dev = x.device();
    B::offers_conv2d(&dev, x.dtype())
        && kiln_autograd::autocast_dtype().is_none_or(|low| B::offers_conv2d(&dev, low))
}

/// Whether this shape runs faster through im2col than through the backend's library, as
/// measured once per shape (`conv_route.rs`).
fn routed_to_im2col<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    window: Window,
    groups: usize,
    spec: Conv2dSpec,
    (oh, ow): (usize, usize),
) -> Result<bool> {
    let wd = weight.dims();
    let taps = wd[1] * wd[2] * wd[3];
    let candidate = Candidate {
        x,
        weight,
        taps,
        columns: taps * groups * oh * ow * x.dims()[0],
        spec,
    };
    prefer_im2col(
        &candidate,
        |x, w| {
            x.conv2d_native(w, spec)?.ok_or_else(|| {
                Error::backend("conv2d", "the backend withdrew its convolution offer")
            })
        },
        |x, w| conv2d_im2col(x, w, None, window, groups, None, (oh, ow)),
    )
}

/// Checks the operands of a convolution; returns `(oc, c)`.
fn check_conv<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    bias: Option<&Var<B>>,
    window: Window,
    groups: usize,
) -> Result<(usize, usize)> {
    const OP: &str = "conv2d";
    let wd = weight.dims();
    let g = groups;
    if g == 0 || wd.len() != 4 || wd[2..] != window.kernel || !wd[0].is_multiple_of(g) {
        return Err(Error::invalid(
            OP,
            format!(
                "weight must be [oc, c/groups, {}, {}] with oc divisible by groups {g} (> 0), \
                 got {}",
                window.kernel[0],
                window.kernel[1],
                weight.shape()
            ),
        ));
    }
    let (oc, c) = (wd[0], wd[1] * g);
    check_nchw(OP, x, Some(c))?;
    if let Some(b) = bias
        && b.dims() != [oc]
    {
        return Err(Error::invalid(
            OP,
            format!("bias must be [{oc}], got {}", b.shape()),
        ));
    }
    Ok((oc, c))
}

/// [`conv2d_grouped`] always through im2col and GEMM (what runs where the backend offers no
/// convolution of its own), also on a backend that does: for comparing the two paths.
pub fn conv2d_im2col_path<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    bias: Option<&Var<B>>,
    window: Window,
    groups: usize,
) -> Result<Var<B>> {
    check_conv(x, weight, bias, window, groups)?;
    let (h, w) = (x.dims()[2], x.dims()[3]);
    let ohw = window.out_hw("conv2d", h, w)?;
    conv2d_im2col(x, weight, bias, window, groups, None, ohw)
}

/// im2col + GEMM (module docs) for operands [`check_conv`] accepted; `(oh, ow)` the output's
/// spatial size.
fn conv2d_im2col<B: Backend>(
    x: &Var<B>,
    weight: &Var<B>,
    bias: Option<&Var<B>>,
    window: Window,
    groups: usize,
    cache: Option<&IdxCache<B>>,
    (oh, ow): (usize, usize),
) -> Result<Var<B>> {
    let g = groups;
    let (oc, c) = (weight.dims()[0], weight.dims()[1] * g);
    let d = x.dims();
    let (n, h, w) = (d[0], d[2], d[3]);
    let dev = x.device();
    let make = || {
        let (ids, pads) = window.im2col_ids(c, h, w, oh, ow);
        let len = ids.len();
        Ok((Tensor::from_vec(ids, [len], &dev)?, pads))
    };
    let (ids_t, pads) = match cache {
        Some(cache) => cache.get_or(vec![c, h, w], &dev, make)?,
        None => make()?,
    };
    // Batch-last rows `[c*h*w (+1 zero row), n]`: every gathered index then copies a
    // contiguous run of `n` values, and the columns come out as one matrix for one GEMM.
    let xt = x.reshape([n, c * h * w])?.t()?;
    let rows = if pads {
        let zero = Var::constant(Tensor::zeros([1, n], x.dtype(), &dev)?);
        Var::cat(&[xt, zero], 0)?
    } else {
        xt.contiguous()?
    };
    let l = oh * ow;
    let ckk = c * window.kernel[0] * window.kernel[1];
    let cols = rows.index_select(0, &ids_t)?;
    let mut y = if g == 1 {
        weight
            .reshape([oc, ckk])?
            .matmul(&cols.reshape([ckk, l * n])?)? // [oc, (oh, ow, n)]
    } else {
        // One batched GEMM over the groups: [g, oc/g, ckk/g] x [g, ckk/g, l*n].
        let cols = cols.reshape([g, ckk / g, l * n])?;
        weight
            .reshape([g, oc / g, ckk / g])?
            .matmul(&cols)?
            .reshape([oc, l * n])?
    };
    if let Some(b) = bias {
        // Under autocast the GEMM ran in the low dtype; the bias joins it there (PyTorch's
        // conv2d casts its bias too). Outside autocast this is `b` itself.
        y = y.add(&b.autocast_low()?.reshape([oc, 1])?)?;
    }
    y.reshape([oc, oh, ow, n])?.permute(&[3, 0, 1, 2])
}

impl<B: Backend> Module<B> for Conv2d<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        self.forward_with(x, &self.weight, self.bias.as_ref())
    }

    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "Conv2d({}, {}, kernel={:?}, stride={:?}, padding={:?}, dilation={:?}, groups={}, \
             bias={})",
            c.in_channels,
            c.out_channels,
            c.kernel,
            c.stride,
            c.padding,
            c.dilation,
            c.groups,
            c.bias
        )
    }
}

// ---- MaxPool2d --------------------------------------------------------------------------------

/// Max over `kernel x kernel` windows of `[n, c, h, w]` (`torch.nn.MaxPool2d`; stride defaults
/// to the kernel size; padding counts as `-inf`; `ceil_mode` as PyTorch's).
pub struct MaxPool2d<B: Backend> {
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    ceil_mode: bool,
    idx: IdxCache<B>,
}

impl<B: Backend> MaxPool2d<B> {
    /// Non-overlapping `kernel x kernel` pooling (stride = kernel, no padding).
    pub fn new(kernel: usize) -> Self {
        MaxPool2d {
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
            ceil_mode: false,
            idx: IdxCache::new(),
        }
    }
    pub fn with_stride(mut self, stride: usize) -> Self {
        self.stride = [stride, stride];
        self
    }
    pub fn with_padding(mut self, padding: usize) -> Self {
        self.padding = [padding, padding];
        self
    }
    /// PyTorch's `ceil_mode`: a last, partial window where the input's end (with the right
    /// padding) leaves one, as long as it starts inside the input or the left padding.
    pub fn with_ceil_mode(mut self, ceil_mode: bool) -> Self {
        self.ceil_mode = ceil_mode;
        self
    }

    fn window(&self) -> Window {
        Window {
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
            dilation: [1, 1],
        }
    }
}

/// `torch.nn.functional.max_pool2d` over `[n, c, h, w]` (dilation must be 1; padding counts as
/// `-inf` and is at most half the kernel). The gradient goes to the first maximum of each window.
pub fn max_pool2d<B: Backend>(x: &Var<B>, window: Window) -> Result<Var<B>> {
    max_pool2d_cached(x, window, false, None)
}

/// [`max_pool2d`] with PyTorch's `ceil_mode` (`F.max_pool2d(..., ceil_mode=True)` when true).
pub fn max_pool2d_ceil<B: Backend>(x: &Var<B>, window: Window, ceil_mode: bool) -> Result<Var<B>> {
    max_pool2d_cached(x, window, ceil_mode, None)
}

/// The pooled length of `len` with PyTorch's `ceil_mode` (stride `s`, padding `p`, dilation 1):
/// one more window than the floor when a partial one is left, unless it would start in the
/// right padding.
fn ceil_out_len(len: usize, k: usize, s: usize, p: usize) -> Option<usize> {
    let span = (len + 2 * p).checked_sub(k)?;
    let mut out = span.div_ceil(s) + 1;
    if (out - 1) * s >= len + p {
        out -= 1;
    }
    Some(out)
}

fn max_pool2d_cached<B: Backend>(
    x: &Var<B>,
    window: Window,
    ceil_mode: bool,
    cache: Option<&IdxCache<B>>,
) -> Result<Var<B>> {
    const OP: &str = "max_pool2d";
    check_nchw(OP, x, None)?;
    let [kh, kw] = window.kernel;
    if window.dilation != [1, 1] || 2 * window.padding[0] > kh || 2 * window.padding[1] > kw {
        return Err(Error::invalid(
            OP,
            format!(
                "unsupported window {window:?}: dilation must be 1 and padding at most half the kernel"
            ),
        ));
    }
    let d = x.dims();
    let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
    let (mut oh, mut ow) = window.out_hw(OP, h, w)?;
    if ceil_mode {
        let [sh, sw] = window.stride;
        let [ph, pw] = window.padding;
        oh = ceil_out_len(h, kh, sh, ph).unwrap_or(oh);
        ow = ceil_out_len(w, kw, sw, pw).unwrap_or(ow);
    }
    let dev = x.device();
    let l = oh * ow;
    let make = || {
        // im2col's `[kh*kw, l]` order for one plane, transposed to one row of taps per output.
        let (cols, pads) = window.im2col_ids(1, h, w, oh, ow);
        let taps = kh * kw;
        let ids = (0..l * taps)
            .map(|i| cols[(i % taps) * l + i / taps])
            .collect();
        Ok((Tensor::from_vec(ids, [l, taps], &dev)?, pads))
    };
    let (ids_t, pads) = match cache {
        Some(cache) => cache.get_or(vec![h, w, usize::from(ceil_mode)], &dev, make)?,
        None => make()?,
    };
    // Batch-last rows `[h*w (+1 row of -inf), n*c]`, as in conv2d: each index copies a run.
    let nc = n * c;
    let xt = x.reshape([nc, h * w])?.t()?;
    let rows = if pads {
        let ninf = Tensor::full([1, nc], f64::NEG_INFINITY, x.dtype(), &dev)?;
        Var::cat(&[xt, Var::constant(ninf)], 0)?
    } else {
        xt.contiguous()?
    };
    // The arg-max of each window is found with plain tensors (no gradient flows through an
    // index), mapped back to a flat input index, and the winners are gathered differentiably.
    let kk = kh * kw;
    let windows = rows
        .tensor()
        .index_select(0, &ids_t.reshape([l * kk])?)?
        .reshape([l, kk, nc])?;
    let arg = windows.argmax(1, true)?; // [l, 1, nc]
    let flat = ids_t
        .unsqueeze(-1)?
        .broadcast_to([l, kk, nc])?
        .gather(1, &arg)?
        .reshape([l, nc])?;
    rows.gather(0, &flat)?
        .reshape([oh, ow, n, c])?
        .permute(&[2, 3, 0, 1])
}

impl<B: Backend> Module<B> for MaxPool2d<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        max_pool2d_cached(x, self.window(), self.ceil_mode, Some(&self.idx))
    }

    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }

    fn describe(&self) -> String {
        format!(
            "MaxPool2d(kernel={:?}, stride={:?}, padding={:?}, ceil_mode={})",
            self.kernel, self.stride, self.padding, self.ceil_mode
        )
    }
}
