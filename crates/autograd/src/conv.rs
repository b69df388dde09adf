//! A convolution by the backend's own library (cuDNN on the CUDA backend) as one recorded op.
//!
//! kiln-nn builds a convolution from differentiable gathers and one GEMM (im2col), which runs
//! on every backend. Where a backend offers a convolution of its own ([`Backend::conv2d`]),
//! [`Var::conv2d_native`] runs it and records one node whose backward asks the same backend
//! for the two gradients ([`Backend::conv2d_backward_data`], [`Backend::conv2d_backward_filter`]):
//! the library's kernels both ways, no index tensor and no column matrix in memory. A backend
//! that offers no convolution (the CPU, the reference) answers `None`, and the caller keeps its
//! im2col path.
//!
//! The node saves only what its gradients read: the weight when the input needs a gradient,
//! the input when the weight does. Under [`crate::autocast`] both operands are first cast to the
//! autocast dtype (convolution is on the "low" list, as the GEMM of the im2col path is), so the
//! convolution runs in 16 bits exactly where the im2col path would.

use kiln_core::{Backend, Conv2dSpec, Error, Result, Tensor};

use crate::var::Var;

impl<B: Backend> Var<B> {
    /// `self` `[n, c, h, w]` convolved with `weight` `[oc, c/groups, kh, kw]` by the backend's
    /// library, recorded as one op (module docs); `None` when the backend offers no
    /// convolution for these operands (or they are not of one float dtype, which the caller's
    /// own path reports). Shapes that do not fit `spec` are an error naming `conv2d`.
    pub fn conv2d_native(&self, weight: &Var<B>, spec: Conv2dSpec) -> Result<Option<Var<B>>> {
        // Nothing is cast for a backend that will not convolve (the CPU keeps its im2col path,
        // which casts where it needs to).
        let dev = self.device();
        let offered = B::offers_conv2d(&dev, self.dtype())
            && crate::autocast::autocast_dtype().is_none_or(|low| B::offers_conv2d(&dev, low));
        if !offered {
            return Ok(None);
        }
        let (x, w) = (self.autocast_low()?, weight.autocast_low()?);
        if x.dtype() != w.dtype() || !x.dtype().is_float() || x.device() != w.device() {
            return Ok(None);
        }
        let (xt, wt) = (x.tensor(), w.tensor());
        let (Ok(xd), Ok(wd)) = (
            <[usize; 4]>::try_from(xt.dims()),
            <[usize; 4]>::try_from(wt.dims()),
        ) else {
            // Not NCHW: the caller's own checks name the problem.
            return Ok(None);
        };
        let Some(y) = xt.conv2d_native(&wt, spec)? else {
            return Ok(None);
        };
        // Only what the gradients read: dx needs the weight, dw the input.
        let saved_w = x.requires_grad().then(|| wt.clone());
        let saved_x = w.requires_grad().then(|| xt.clone());
        let missing = |what: &str| {
            Error::backend(
                "conv2d backward",
                format!(
                    "the {} backend ran the convolution but offers no {what} gradient",
                    B::NAME
                ),
            )
        };
        Ok(Some(Var::from_op(
            "conv2d",
            &[&x, &w],
            y,
            move |g, needs| {
                let gx = match (&saved_w, needs[0]) {
                    (Some(wt), true) => Some(
                        Tensor::conv2d_native_grad_input(wt, g, xd, spec)?
                            .ok_or_else(|| missing("input"))?,
                    ),
                    _ => None,
                };
                let gw = match (&saved_x, needs[1]) {
                    (Some(xt), true) => Some(
                        Tensor::conv2d_native_grad_weight(xt, g, wd, spec)?
                            .ok_or_else(|| missing("weight"))?,
                    ),
                    _ => None,
                };
                Ok(vec![gx, gw])
            },
        )))
    }
}
