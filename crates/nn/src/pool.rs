//! Average pooling layers: [`AvgPool2d`] (`torch.nn.AvgPool2d`) and [`AdaptiveAvgPool2d`]
//! (`torch.nn.AdaptiveAvgPool2d`), over `[n, c, h, w]`. No parameters; the math is
//! [`Var::avg_pool2d`] / [`Var::adaptive_avg_pool2d`] (separable averages: two GEMMs with
//! constant matrices, or one mean when the windows tile the input). The layers keep no cache
//! of their own: the matrices are cached process-wide by geometry, dtype and device in
//! kiln-autograd, so a layer uploads them only at its first call.

use kiln_autograd::Var;
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
}

impl AvgPool2d {
    /// `kernel x kernel` windows, stride `kernel`, no padding.
    pub fn new(kernel: usize) -> Self {
        AvgPool2d {
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
            count_include_pad: true,
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
}

impl<B: Backend> Module<B> for AvgPool2d {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        x.avg_pool2d(
            self.kernel,
            self.stride,
            self.padding,
            self.count_include_pad,
        )
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        Vec::new()
    }
    fn describe(&self) -> String {
        format!(
            "AvgPool2d(kernel={:?}, stride={:?}, padding={:?}, count_include_pad={})",
            self.kernel, self.stride, self.padding, self.count_include_pad
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
