//! Average pooling layers: [`AvgPool2d`] (`torch.nn.AvgPool2d`) and [`AdaptiveAvgPool2d`]
//! (`torch.nn.AdaptiveAvgPool2d`), over `[n, c, h, w]`. No parameters; the math is
//! [`Var::avg_pool2d`] / [`Var::adaptive_avg_pool2d`] (separable averages: two GEMMs with
//! constant matrices, or one mean when the windows tile the input). The layers keep no cache
//! of their own: the matrices are cached process-wide by geometry, dtype and device in
//! kiln-autograd, so a layer uploads them only at its first call.

use kiln_autograd::{AvgPoolOptions, Var};
use kiln_core::{Backend, Result};

use crate::module::Module;

/// Averages over `kernel` windows (PyTorch's defaults: stride = kernel, no padding,
/// `count_include_pad = true`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPool2d {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    /// Whether the zero padding counts in the divisor.
    pub count_include_pad: bool,
    /// Keep a last, partial window (PyTorch's `ceil_mode`).
    pub ceil_mode: bool,
    /// Divide every window's sum by this instead (PyTorch's `divisor_override`).
    pub divisor_override: Option<usize>,
}

impl AvgPool2d {
    /// `kernel x kernel` windows, stride `kernel`, no padding.
    pub fn new(kernel: usize) -> Self {
        AvgPool2d {
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
            count_include_pad: true,
            ceil_mode: false,
            divisor_override: None,
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
    pub fn with_count_include_pad(mut self, include: bool) -> Self {
        self.count_include_pad = include;
        self
    }
    pub fn with_ceil_mode(mut self, ceil_mode: bool) -> Self {
        self.ceil_mode = ceil_mode;
        self
    }
    pub fn with_divisor_override(mut self, divisor: Option<usize>) -> Self {
        self.divisor_override = divisor;
        self
    }
}

impl<B: Backend> Module<B> for AvgPool2d {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        let opts = AvgPoolOptions {
            ceil_mode: self.ceil_mode,
            count_include_pad: self.count_include_pad,
            divisor_override: self.divisor_override,
        };
        x.avg_pool2d_with(self.kernel, self.stride, self.padding, opts)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }
    fn describe(&self) -> String {
        format!(
            "AvgPool2d(kernel={:?}, stride={:?}, padding={:?}, ceil_mode={}, \
             count_include_pad={}, divisor_override={:?})",
            self.kernel,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override
        )
    }
}

/// Averages `[n, c, h, w]` down to `[n, c, out_h, out_w]` with PyTorch's adaptive windows;
/// `AdaptiveAvgPool2d::new([1, 1])` is the global average pool of a ResNet head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveAvgPool2d {
    pub output: [usize; 2],
}

impl AdaptiveAvgPool2d {
    pub fn new(output: [usize; 2]) -> Self {
        AdaptiveAvgPool2d { output }
    }
}

impl<B: Backend> Module<B> for AdaptiveAvgPool2d {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        x.adaptive_avg_pool2d(self.output)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }
    fn describe(&self) -> String {
        format!("AdaptiveAvgPool2d(output_size={:?})", self.output)
    }
}
