//! Convolutions by a backend's own library ([`Backend::conv2d`] and its two gradients), on
//! tensors: the checks every backend relies on, then the backend's answer, `None` when it does
//! not offer one (the caller, kiln-nn's `conv2d`, then builds the convolution from generic ops).
//!
//! These are not the public face of convolution: they exist so that the layer above can ask
//! "does this backend convolve natively?" without naming a backend.

use crate::backend::{Activation, Backend, Conv2dSpec};
use crate::{Error, Result, Tensor};

/// `t`'s dims as `[usize; 4]`, or an error naming `op` and `what`.
fn dims4<B: Backend>(op: &'static str, what: &str, t: &Tensor<B>) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(t.dims()).map_err(|_| {
        Error::invalid(
            op,
            format!("{what} must have rank 4 (NCHW), got shape {}", t.shape()),
        )
    })
}

/// The checks shared by the three entry points: same device, same float dtype.
fn check_pair<B: Backend>(op: &'static str, a: &Tensor<B>, b: &Tensor<B>) -> Result<()> {
    a.check_same_device(op, b)?;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: a.dtype().to_string(),
            got: b.dtype(),
        });
    }
    a.require_float(op)
}

/// An error for shapes that do not fit `spec`.
fn misfit(op: &'static str, x: [usize; 4], w: [usize; 4], spec: &Conv2dSpec) -> Error {
    Error::invalid(
        op,
        format!("input {x:?} and weight {w:?} do not fit the convolution {spec:?}"),
    )
}

impl<B: Backend> Tensor<B> {
    /// `self` `[n, c, h, w]` convolved with `weight` `[oc, c/groups, kh, kw]` by the backend's
    /// library ([`Backend::conv2d`]): `[n, oc, oh, ow]`, or `None` when the backend offers no
    /// convolution for these operands. Shapes that do not fit `spec` are an error naming
    /// `conv2d`.
    pub fn conv2d_native(&self, weight: &Self, spec: Conv2dSpec) -> Result<Option<Self>> {
        const OP: &str = "conv2d";
        check_pair(OP, self, weight)?;
        let (xd, wd) = (dims4(OP, "input", self)?, dims4(OP, "weight", weight)?);
        let out = spec
            .output_dims(xd, wd)
            .ok_or_else(|| misfit(OP, xd, wd, &spec))?;
        let _p = self.prof(OP, &[weight], false);
        let s = B::conv2d(
            self.storage(),
            self.layout(),
            weight.storage(),
            weight.layout(),
            self.dtype(),
            &spec,
        )?;
        Ok(s.map(|s| self.fresh(s, out, self.dtype())))
    }

    /// `act(conv2d(self, weight) + bias)` by one library call of the backend
    /// ([`Backend::conv2d_bias_act`]; forward only, for inference): `[n, oc, oh, ow]`, or
    /// `None` when the backend does not offer it for these operands and this activation.
    /// `bias` is `[oc]`, of the operands' dtype. Shapes that do not fit are an error naming
    /// `conv2d_bias_act`.
    pub fn conv2d_bias_act_native(
        &self,
        weight: &Self,
        bias: &Self,
        spec: Conv2dSpec,
        act: Activation,
    ) -> Result<Option<Self>> {
        const OP: &str = "conv2d_bias_act";
        check_pair(OP, self, weight)?;
        check_pair(OP, self, bias)?;
        let (xd, wd) = (dims4(OP, "input", self)?, dims4(OP, "weight", weight)?);
        let out = spec
            .output_dims(xd, wd)
            .ok_or_else(|| misfit(OP, xd, wd, &spec))?;
        if bias.dims() != [wd[0]] {
            return Err(Error::invalid(
                OP,
                format!("bias must be [{}], got {}", wd[0], bias.shape()),
            ));
        }
        let _p = self.prof(OP, &[weight, bias], false);
        let s = B::conv2d_bias_act(
            (self.storage(), self.layout()),
            (weight.storage(), weight.layout()),
            (bias.storage(), bias.layout()),
            self.dtype(),
            &spec,
            act,
        )?;
        Ok(s.map(|s| self.fresh(s, out, self.dtype())))
    }

    /// The gradient of [`Tensor::conv2d_native`] with respect to its input (of dims
    /// `x_dims`), from `weight` and the output's gradient `dy` ([`Backend::conv2d_backward_data`]);
    /// `None` when the backend offers none.
    pub fn conv2d_native_grad_input(
        weight: &Self,
        dy: &Self,
        x_dims: [usize; 4],
        spec: Conv2dSpec,
    ) -> Result<Option<Self>> {
        const OP: &str = "conv2d_backward_data";
        check_pair(OP, weight, dy)?;
        let wd = dims4(OP, "weight", weight)?;
        if spec.output_dims(x_dims, wd).as_ref().map(|d| &d[..]) != Some(dy.dims()) {
            return Err(misfit(OP, x_dims, wd, &spec));
        }
        let _p = dy.prof(OP, &[weight], false);
        let s = B::conv2d_backward_data(
            weight.storage(),
            weight.layout(),
            dy.storage(),
            dy.layout(),
            dy.dtype(),
            x_dims,
            &spec,
        )?;
        Ok(s.map(|s| dy.fresh(s, x_dims, dy.dtype())))
    }

    /// The gradient of [`Tensor::conv2d_native`] with respect to its weight (of dims
    /// `w_dims`), from the input `x` and the output's gradient `dy`
    /// ([`Backend::conv2d_backward_filter`]); `None` when the backend offers none.
    pub fn conv2d_native_grad_weight(
        x: &Self,
        dy: &Self,
        w_dims: [usize; 4],
        spec: Conv2dSpec,
    ) -> Result<Option<Self>> {
        const OP: &str = "conv2d_backward_filter";
        check_pair(OP, x, dy)?;
        let xd = dims4(OP, "input", x)?;
        if spec.output_dims(xd, w_dims).as_ref().map(|d| &d[..]) != Some(dy.dims()) {
            return Err(misfit(OP, xd, w_dims, &spec));
        }
        let _p = dy.prof(OP, &[x], false);
        let s = B::conv2d_backward_filter(
            x.storage(),
            x.layout(),
            dy.storage(),
            dy.layout(),
            dy.dtype(),
            w_dims,
            &spec,
        )?;
        Ok(s.map(|s| dy.fresh(s, w_dims, dy.dtype())))
    }
}
