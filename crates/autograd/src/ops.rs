//! The differentiable ops on `Var<B>`: each runs the `Tensor` op forward and records its
//! gradient. Method names and arguments mirror `Tensor<B>`, so code moves between the two by
//! wrapping tensors in `Var`s.
//!
//! Gradients at non-differentiable points follow PyTorch, so results can be compared with it:
//! - `relu`, `abs`: the derivative at 0 is 0 (`sign(0) = 0`); `sign`, `floor`, `ceil` have a
//!   zero gradient everywhere.
//! - `maximum` / `minimum` of two variables: on ties the gradient is split evenly (half to each).
//! - `maximum_scalar` / `minimum_scalar` / `clamp` (a variable against a constant): as
//!   `torch.clamp`, the gradient passes where the value is inside the closed range, ties
//!   included.
//! - `max_dim` / `min_dim` (values and indices, `torch.max(x, dim)`): the gradient goes to the
//!   element the index names.
//! - `max` / `min` reductions: as `torch.amax`/`amin`, the gradient is distributed evenly among
//!   all the elements equal to the extreme.
//! - `pow(a, b)`: where `b == 0` the gradient to `a` is 0; where `a == 0` and `b >= 0` the
//!   gradient to `b` is 0 (not `0 * log 0 = NaN`).

use kiln_core::expr::rules::binary_vjp_program;
use std::sync::Arc;

use kiln_core::expr::{Arg, Program};
use kiln_core::{
    Backend, BinaryOp, CmpOp, DType, Error, GradFrom, Reduction, Result, Shape, Side, Tensor,
    UnaryOp,
};

use crate::autocast::{autocast_dtype, binary_in_f32, unary_in_f32, widest_all};
use crate::var::Var;

/// Sums `g` over the axes that broadcasting stretched, so it gets back `shape` (the shape of the
/// operand before broadcasting): leading axes `g` has in excess, and axes where `shape` has 1.
pub fn reduce_to_shape<B: Backend>(g: &Tensor<B>, shape: &Shape) -> Result<Tensor<B>> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let (gr, r) = (g.rank(), shape.rank());
    if gr < r {
        return Err(Error::ShapeMismatch {
            op: "reduce_to_shape",
            lhs: g.shape().clone(),
            rhs: shape.clone(),
        });
    }
    let extra = gr - r;
    let axes: Vec<isize> = (0..gr)
        .filter(|&i| i < extra || (shape.dims()[i - extra] == 1 && g.dims()[i] != 1))
        .map(|i| i as isize)
        .collect();
    let summed = if axes.is_empty() {
        g.clone()
    } else {
        g.sum(&axes, true)?
    };
    summed.reshape(shape.clone())
}

/// A `u8` mask as a 0/1 float tensor of `dtype`.
/// The gradient through a softmax along `dim` whose output is `y`: `y · (g - Σ_dim g·y)`.
pub(crate) fn softmax_backward<B: Backend>(
    y: &Tensor<B>,
    g: &Tensor<B>,
    dim: isize,
) -> Result<Tensor<B>> {
    let s = g.mul(y)?.sum(&[dim], true)?;
    y.mul(&g.sub(&s)?)
}

/// Two independent gradient computations through [`Backend::concurrently`], after realizing
/// the deferred values among `reads` (what both read): one realized inside `first` would run
/// after `second` may have started reading it.
fn concurrently<B: Backend, R1, R2>(
    reads: &[&Tensor<B>],
    flops: u64,
    first: impl FnOnce() -> Result<R1>,
    second: impl FnOnce() -> Result<R2>,
) -> Result<(R1, R2)> {
    for t in reads {
        t.realize()?;
    }
    let work = (reads[0].dtype(), flops);
    B::concurrently(reads[0].device(), work, first, second)
}

fn mask<B: Backend>(m: Tensor<B>, dtype: DType) -> Result<Tensor<B>> {
    m.to_dtype(dtype)
}

fn zeros_scalar<B: Backend>(like: &Tensor<B>) -> Result<Tensor<B>> {
    Tensor::zeros(Shape::scalar(), like.dtype(), like.device())
}

/// The dims of `dims` with `axes` set to 1 (a `keepdim` reduction's shape).
fn kept_dims(dims: &[usize], axes: &[usize]) -> Vec<usize> {
    let mut k = dims.to_vec();
    for &a in axes {
        k[a] = 1;
    }
    k
}

/// A tensor a backward closure saved, or an internal error if the op's save list missed it.
fn saved<'a, B: Backend>(t: &'a Option<Tensor<B>>, op: &'static str) -> Result<&'a Tensor<B>> {
    t.as_ref()
        .ok_or_else(|| Error::invalid(op, "internal: backward needs a tensor that was not saved"))
}

/// Which of input and output the gradient of a unary op needs (the op table's rule says):
/// only those are kept alive by the graph (a relu keeps its output, not also its input), which
/// matters for activation memory in deep networks.
fn unary_saves(op: UnaryOp) -> (bool, bool) {
    match op.grad_reads() {
        Some(GradFrom::Input) => (true, false),
        Some(GradFrom::Output) => (false, true),
        None => (false, false),
    }
}

/// `g · op'(x)` for a unary op with (saved) input `x` or output `y`: the op table's rule, one
/// backend kernel (or one deferred node).
fn unary_grad<B: Backend>(
    op: UnaryOp,
    x: &Option<Tensor<B>>,
    y: &Option<Tensor<B>>,
    g: &Tensor<B>,
) -> Result<Tensor<B>> {
    let name = op.name();
    match op.grad_reads() {
        Some(GradFrom::Input) => saved(x, name)?.unary_backward(op, g),
        Some(GradFrom::Output) => saved(y, name)?.unary_backward(op, g),
        None if op.vjp_is_zero() => g.zeros_like(),
        // The rule reads only `g`; `g` stands in for the saved operand.
        None => g.unary_backward(op, g),
    }
}

impl<B: Backend> Var<B> {
    // ---- elementwise ---------------------------------------------------------------------

    /// `op(self)`. Under [`autocast`](crate::autocast), the ops of its f32 list (`exp`, `log`,
    /// ...) compute from a 16-bit input cast up to f32.
    pub fn unary(&self, op: UnaryOp) -> Result<Self> {
        if autocast_dtype().is_some() && unary_in_f32(op) && self.dtype().is_half() {
            return self.autocast_f32()?.unary(op);
        }
        let x = self.tensor();
        let y = x.unary(op)?;
        let (sx, sy) = unary_saves(op);
        let xs = sx.then_some(x);
        let ys = sy.then(|| y.clone());
        Ok(Var::from_op(op.name(), &[self], y, move |g, _| {
            Ok(vec![Some(unary_grad(op, &xs, &ys, g)?)])
        }))
    }

    /// `op(self, rhs)` with broadcasting; each gradient is summed back to its input's shape.
    /// The gradients are the binary op table's rules ([`BinaryOp::vjp`]).
    ///
    /// Under [`autocast`](crate::autocast), operands of different float dtypes meet at the
    /// wider one (`pow` computes in f32); outside it they are an error.
    pub fn binary(&self, op: BinaryOp, rhs: &Self) -> Result<Self> {
        if autocast_dtype().is_some() {
            let (a, b) = if binary_in_f32(op) {
                (self.autocast_f32()?, rhs.autocast_f32()?)
            } else {
                Var::autocast_widest(self, rhs)?
            };
            if !a.ptr_eq(self) || !b.ptr_eq(rhs) {
                return Self::binary_impl(&a, op, &b);
            }
        }
        Self::binary_impl(self, op, rhs)
    }

    fn binary_impl(&self, op: BinaryOp, rhs: &Self) -> Result<Self> {
        let a = self.tensor();
        let b = rhs.tensor();
        let y = a.binary(op, &b)?;
        let (sa, sb) = (a.shape().clone(), b.shape().clone());
        let rule = |v: &Self, side| -> Result<Option<Arc<Program>>> {
            v.requires_grad()
                .then(|| binary_vjp_program(op, side, false, y.dtype()))
                .transpose()
        };
        let (ra, rb) = (rule(self, Side::A)?, rule(rhs, Side::B)?);
        // Save only what the rules of the inputs that need a gradient read.
        let reads = |k: usize| {
            [&ra, &rb]
                .iter()
                .any(|r| r.as_ref().is_some_and(|p| p.reads(k)))
        };
        let saved = Saved {
            a: reads(0).then_some(a),
            b: reads(1).then_some(b),
            y: reads(2).then(|| y.clone()),
        };
        Ok(Var::from_op(op.name(), &[self, rhs], y, move |g, needs| {
            let apply = |rule: &Option<Arc<Program>>, need: bool, shape: &Shape| match rule {
                Some(rule) if need => {
                    let args = saved.args(None, g);
                    let d = rule.run_ops(&args, &[])?.swap_remove(0);
                    reduce_to_shape(&d, shape).map(Some)
                }
                _ => Ok(None),
            };
            Ok(vec![apply(&ra, needs[0], &sa)?, apply(&rb, needs[1], &sb)?])
        }))
    }

    /// `op(self, c)`; the constant gets no gradient.
    pub fn binary_scalar(&self, op: BinaryOp, c: f64) -> Result<Self> {
        self.scalar_op(op, c, false)
    }
    /// `op(c, self)`: `c - x`, `c / x`, `c ^ x`, ...
    pub fn scalar_binary(&self, op: BinaryOp, c: f64) -> Result<Self> {
        self.scalar_op(op, c, true)
    }

    fn scalar_op(&self, op: BinaryOp, c: f64, scalar_lhs: bool) -> Result<Self> {
        if autocast_dtype().is_some() && binary_in_f32(op) && self.dtype().is_half() {
            return self.autocast_f32()?.scalar_op(op, c, scalar_lhs);
        }
        let x = self.tensor();
        let y = if scalar_lhs {
            x.scalar_binary(op, c)?
        } else {
            x.binary_scalar(op, c)?
        };
        // The rule to the tensor's side, the other operand being the constant `c`.
        let (side, x_at) = if scalar_lhs {
            (Side::B, 1)
        } else {
            (Side::A, 0)
        };
        let rule = binary_vjp_program(op, side, true, y.dtype())?;
        let saved = Saved {
            a: (!scalar_lhs && rule.reads(x_at)).then(|| x.clone()),
            b: (scalar_lhs && rule.reads(x_at)).then(|| x.clone()),
            y: rule.reads(2).then(|| y.clone()),
        };
        Ok(Var::from_op(op.name(), &[self], y, move |g, _| {
            let args = saved.args(Some((c, scalar_lhs)), g);
            Ok(vec![Some(rule.run_ops(&args, &[])?.swap_remove(0))])
        }))
    }

    /// `a * self + b`.
    pub fn affine(&self, a: f64, b: f64) -> Result<Self> {
        self.mul_scalar(a)?.add_scalar(b)
    }

    /// Clamps into `[lo, hi]`; the gradient passes where `lo <= self <= hi` (as `torch.clamp`).
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Self> {
        let x = self.tensor();
        let y = x.clamp(lo, hi)?;
        Ok(Var::from_op("clamp", &[self], y, move |g, _| {
            let dt = x.dtype();
            let inside = mask(x.compare_scalar(CmpOp::Ge, lo)?, dt)?
                .mul(&mask(x.compare_scalar(CmpOp::Le, hi)?, dt)?)?;
            Ok(vec![Some(g.mul(&inside)?)])
        }))
    }

    // ---- reductions ----------------------------------------------------------------------

    /// Sum over `axes`. Under [`autocast`](crate::autocast) a 16-bit input is summed in f32
    /// and gives f32 (PyTorch's `sum(dtype=float32)`); [`Var::mean`] follows.
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        if autocast_dtype().is_some() && self.dtype().is_half() {
            return self.autocast_f32()?.sum(axes, keepdim);
        }
        let x = self.tensor();
        let axes_n = x.shape().axes("sum", axes)?;
        let y = x.sum(axes, keepdim)?;
        let shape = x.shape().clone();
        Ok(Var::from_op("sum", &[self], y, move |g, _| {
            let kept = kept_dims(shape.dims(), &axes_n);
            Ok(vec![Some(g.reshape(kept)?.broadcast_to(shape.clone())?)])
        }))
    }
    /// Sum of every element, as a 0-d variable.
    pub fn sum_all(&self) -> Result<Self> {
        self.sum(&self.all_axes(), false)
    }
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        let x = self.tensor();
        let axes_n = x.shape().axes("mean", axes)?;
        let n: usize = axes_n.iter().map(|&a| x.dims()[a]).product();
        if !x.dtype().is_float() {
            return Err(Error::DTypeMismatch {
                op: "mean",
                expected: "a float dtype (f32, f64, f16, bf16)".into(),
                got: x.dtype(),
            });
        }
        self.sum(axes, keepdim)?.div_scalar(n as f64)
    }
    pub fn mean_all(&self) -> Result<Self> {
        self.mean(&self.all_axes(), false)
    }
    /// Maximum over `axes`; the gradient is shared evenly among tied maxima (`torch.amax`).
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        self.extreme("max", axes, keepdim)
    }
    /// Minimum over `axes`; the gradient is shared evenly among tied minima (`torch.amin`).
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        self.extreme("min", axes, keepdim)
    }
    /// The maxima along `dim` and their `i64` indices, as `torch.max(x, dim, keepdim)`. The
    /// gradient flows to the element each index names only (not shared among ties, unlike
    /// [`Var::max`]), as in PyTorch.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Self, Tensor<B>)> {
        self.extreme_dim("max_dim", dim, keepdim)
    }
    /// The minima along `dim` and their `i64` indices (`torch.min(x, dim, keepdim)`); as
    /// [`Var::max_dim`].
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Self, Tensor<B>)> {
        self.extreme_dim("min_dim", dim, keepdim)
    }
    fn extreme_dim(
        &self,
        name: &'static str,
        dim: isize,
        keepdim: bool,
    ) -> Result<(Self, Tensor<B>)> {
        let x = self.tensor();
        let (y, idx) = if name == "max_dim" {
            x.max_dim(dim, keepdim)?
        } else {
            x.min_dim(dim, keepdim)?
        };
        let ax = kiln_core::normalize_axis(name, dim, x.rank())?;
        let kept = if keepdim {
            idx.clone()
        } else {
            idx.unsqueeze(ax as isize)?
        };
        let shape = x.shape().clone();
        let v = Var::from_op(name, &[self], y, move |g, _| {
            let g = if keepdim {
                g.clone()
            } else {
                g.unsqueeze(ax as isize)?
            };
            let z = Tensor::zeros(shape.clone(), g.dtype(), g.device())?;
            Ok(vec![Some(z.scatter_add(ax as isize, &kept, &g)?)])
        });
        Ok((v, idx))
    }
    pub fn max_all(&self) -> Result<Self> {
        self.max(&self.all_axes(), false)
    }
    pub fn min_all(&self) -> Result<Self> {
        self.min(&self.all_axes(), false)
    }

    fn all_axes(&self) -> Vec<isize> {
        (0..self.rank() as isize).collect()
    }

    fn extreme(&self, name: &'static str, axes: &[isize], keepdim: bool) -> Result<Self> {
        let x = self.tensor();
        let axes_n = x.shape().axes(name, axes)?;
        let y = if name == "max" {
            x.max(axes, keepdim)?
        } else {
            x.min(axes, keepdim)?
        };
        let yc = y.clone();
        Ok(Var::from_op(name, &[self], y, move |g, _| {
            let kept = kept_dims(x.dims(), &axes_n);
            let hit = mask(x.eq(&yc.reshape(kept.clone())?)?, x.dtype())?;
            let axes_i: Vec<isize> = axes_n.iter().map(|&a| a as isize).collect();
            let count = hit.sum(&axes_i, true)?;
            Ok(vec![Some(g.reshape(kept)?.div(&count)?.mul(&hit)?)])
        }))
    }

    // ---- matmul --------------------------------------------------------------------------

    /// Matrix product with numpy semantics (1-d operands promoted, batch axes broadcast);
    /// gradients are matmuls against transposed views (no copies) summed over broadcast batches.
    ///
    /// Under [`autocast`](crate::autocast) both operands are cast to the autocast dtype first.
    pub fn matmul(&self, rhs: &Self) -> Result<Self> {
        if autocast_dtype().is_some() {
            let (a, b) = (self.autocast_low()?, rhs.autocast_low()?);
            if !a.ptr_eq(self) || !b.ptr_eq(rhs) {
                return a.matmul_impl(&b);
            }
        }
        self.matmul_impl(rhs)
    }

    fn matmul_impl(&self, rhs: &Self) -> Result<Self> {
        let a = self.tensor();
        let b = rhs.tensor();
        let y = a.matmul(&b)?;
        Ok(Var::from_op("matmul", &[self, rhs], y, move |g, needs| {
            let a2 = if a.rank() == 1 {
                a.unsqueeze(0)?
            } else {
                a.clone()
            };
            let b2 = if b.rank() == 1 {
                b.unsqueeze(-1)?
            } else {
                b.clone()
            };
            // g with the promoted axes restored: [batch.., m, n].
            let mut gdims = g.dims().to_vec();
            if a.rank() == 1 {
                gdims.insert(gdims.len() - usize::from(b.rank() > 1), 1);
            }
            if b.rank() == 1 {
                gdims.push(1);
            }
            let g2 = g.reshape(gdims)?;
            // An operand that is a transposed view (a Linear layer's `W.t()`) gets its gradient
            // computed transposed, `(gᵀ·x)ᵀ` rather than `xᵀ·g`: the same numbers, but laid out
            // like the parameter behind the view, so no copy is needed to store it.
            let transposed = |t: &Tensor<B>| {
                t.rank() == 2 && !t.is_contiguous() && t.t().is_ok_and(|v| v.is_contiguous())
            };
            let grad_a = || -> Result<Option<Tensor<B>>> {
                if !needs[0] {
                    return Ok(None);
                }
                Ok(Some(if transposed(&a2) && g2.rank() == 2 {
                    b2.matmul(&g2.t()?)?.t()?.reshape(a.shape().clone())?
                } else {
                    let full = g2.matmul(&b2.t()?)?;
                    reduce_to_shape(&full, a2.shape())?.reshape(a.shape().clone())?
                }))
            };
            let grad_b = || -> Result<Option<Tensor<B>>> {
                if !needs[1] {
                    return Ok(None);
                }
                Ok(Some(if transposed(&b2) && g2.rank() == 2 {
                    g2.t()?.matmul(&a2)?.t()?.reshape(b.shape().clone())?
                } else {
                    let full = a2.t()?.matmul(&g2)?;
                    reduce_to_shape(&full, b2.shape())?.reshape(b.shape().clone())?
                }))
            };
            // The two products are independent: a backend may run them at once.
            let (ga, gb) = if needs[0] && needs[1] {
                let k = a2.dims()[a2.rank() - 1] as u64;
                let flops = 2 * g2.elem_count() as u64 * k;
                concurrently(&[&g2, &a2, &b2], flops, grad_a, grad_b)?
            } else {
                (grad_a()?, grad_b()?)
            };
            Ok(vec![ga, gb])
        }))
    }

    /// `self · wᵀ + b` (PyTorch's `F.linear`): `w` is `[out, in]`, `b` is `[out]`, `self` is
    /// `[.., in]`; gives `[.., out]`. The same products as `self.matmul(&w.t()?)?.add(b)` (the
    /// same bits), recorded as one node whose inputs are the parameters themselves: their
    /// gradients are a leaf's, so a backward pass computes them before the input's and runs their
    /// hooks at once (see [`Var::register_grad_hook`]), and data parallelism starts reducing
    /// them while the input's gradient is still being computed.
    ///
    /// Under [`autocast`](crate::autocast) the input, weight and bias are cast to the autocast
    /// dtype first (the weight's cast cached for the scope), and the output is in that dtype.
    pub fn linear(&self, w: &Self, b: Option<&Self>) -> Result<Self> {
        if autocast_dtype().is_some() {
            let (x, w) = (self.autocast_low()?, w.autocast_low()?);
            let b = b.map(Var::autocast_low).transpose()?;
            return x.linear_impl(&w, b.as_ref());
        }
        self.linear_impl(w, b)
    }

    fn linear_impl(&self, w: &Self, b: Option<&Self>) -> Result<Self> {
        const OP: &str = "linear";
        let x = self.tensor();
        let wt = w.tensor();
        if wt.rank() != 2 || x.rank() == 0 || x.dims()[x.rank() - 1] != wt.dims()[1] {
            return Err(Error::invalid(
                OP,
                format!(
                    "expects an input [.., in] and a weight [out, in], got {} and {}",
                    x.shape(),
                    wt.shape()
                ),
            ));
        }
        let (n_out, n_in) = (wt.dims()[0], wt.dims()[1]);
        let mut y = x.matmul(&wt.t()?)?;
        let mut inputs = vec![self, w];
        if let Some(b) = b {
            if b.shape().dims() != [n_out] {
                return Err(Error::invalid(
                    OP,
                    format!("expects a bias [{n_out}], got {}", b.shape()),
                ));
            }
            y = y.add(&b.tensor())?;
            inputs.push(b);
        }
        Ok(Var::from_op(OP, &inputs, y, move |g, needs| {
            let rows = g.elem_count() / n_out.max(1);
            let g2 = g.reshape([rows, n_out])?;
            let weight = || -> Result<_> {
                let gw = if needs[1] {
                    Some(g2.t()?.matmul(&x.reshape([rows, n_in])?)?)
                } else {
                    None
                };
                let gb = match needs.get(2) {
                    Some(true) => Some(g2.sum(&[0], false)?),
                    _ => None,
                };
                Ok((gw, gb))
            };
            let input = || -> Result<_> {
                needs[0]
                    .then(|| g.matmul(&wt)?.reshape(x.shape().clone()))
                    .transpose()
            };
            // The two products are independent: a backend may run them at once.
            let ((gw, gb), gx) = if needs[0] && needs[1] {
                let flops = 2 * (rows * n_in * n_out) as u64;
                concurrently(&[g, &g2, &x, &wt], flops, weight, input)?
            } else {
                (weight()?, input()?)
            };
            let mut grads = vec![gx, gw];
            if needs.len() > 2 {
                grads.push(gb);
            }
            Ok(grads)
        }))
    }

    // ---- views ---------------------------------------------------------------------------

    fn view_op(
        &self,
        name: &'static str,
        y: Tensor<B>,
        back: impl Fn(&Tensor<B>, &Shape) -> Result<Tensor<B>> + Send + Sync + 'static,
    ) -> Self {
        let shape = self.tensor().shape().clone();
        Var::from_op(name, &[self], y, move |g, _| {
            Ok(vec![Some(back(g, &shape)?)])
        })
    }

    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Self> {
        let y = self.tensor().reshape(shape)?;
        Ok(self.view_op("reshape", y, |g, s| g.reshape(s.clone())))
    }
    pub fn flatten_all(&self) -> Result<Self> {
        let y = self.tensor().flatten_all()?;
        Ok(self.view_op("flatten", y, |g, s| g.reshape(s.clone())))
    }
    pub fn flatten_from(&self, start: isize) -> Result<Self> {
        let y = self.tensor().flatten_from(start)?;
        Ok(self.view_op("flatten", y, |g, s| g.reshape(s.clone())))
    }
    pub fn squeeze(&self, axis: isize) -> Result<Self> {
        let y = self.tensor().squeeze(axis)?;
        Ok(self.view_op("squeeze", y, |g, s| g.reshape(s.clone())))
    }
    pub fn unsqueeze(&self, axis: isize) -> Result<Self> {
        let y = self.tensor().unsqueeze(axis)?;
        Ok(self.view_op("unsqueeze", y, |g, s| g.reshape(s.clone())))
    }
    pub fn transpose(&self, a: isize, b: isize) -> Result<Self> {
        let y = self.tensor().transpose(a, b)?;
        Ok(self.view_op("transpose", y, move |g, _| g.transpose(a, b)))
    }
    /// Swaps the last two axes.
    pub fn t(&self) -> Result<Self> {
        let y = self.tensor().t()?;
        Ok(self.view_op("t", y, |g, _| g.t()))
    }
    pub fn permute(&self, perm: &[usize]) -> Result<Self> {
        let y = self.tensor().permute(perm)?;
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(self.view_op("permute", y, move |g, _| g.permute(&inv)))
    }
    /// Keeps `len` entries of `axis` from `start`; the gradient is zero outside them.
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Self> {
        let y = self.tensor().narrow(axis, start, len)?;
        Ok(self.view_op("narrow", y, move |g, s| {
            Tensor::zeros(s.clone(), g.dtype(), g.device())?.slice_assign(axis, start, g)
        }))
    }
    /// Broadcasts to `shape`; the gradient is summed back.
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Self> {
        let y = self.tensor().broadcast_to(shape)?;
        Ok(self.view_op("broadcast_to", y, reduce_to_shape))
    }
    pub fn contiguous(&self) -> Result<Self> {
        let y = self.tensor().contiguous()?;
        Ok(self.view_op("contiguous", y, |g, _| Ok(g.clone())))
    }

    /// Joins variables along an existing axis; each gets its slice of the gradient.
    /// Under [`autocast`](crate::autocast), float inputs of different dtypes meet at the
    /// widest.
    pub fn cat(vars: &[Self], axis: isize) -> Result<Self> {
        let vars = &widest_all(vars)?[..];
        let ts: Vec<Tensor<B>> = vars.iter().map(|v| v.tensor()).collect();
        let y = Tensor::cat(&ts, axis)?;
        let lens: Vec<usize> = ts.iter().map(|t| t.dims()[y_axis(&y, axis)]).collect();
        let inputs: Vec<&Var<B>> = vars.iter().collect();
        Ok(Var::from_op("cat", &inputs, y, move |g, needs| {
            let mut start = 0;
            let mut out = Vec::with_capacity(lens.len());
            for (&len, &need) in lens.iter().zip(needs) {
                out.push(if need {
                    Some(g.narrow(axis, start, len)?)
                } else {
                    None
                });
                start += len;
            }
            Ok(out)
        }))
    }

    /// Joins variables of one shape along a new axis.
    pub fn stack(vars: &[Self], axis: isize) -> Result<Self> {
        let first = vars
            .first()
            .ok_or_else(|| Error::invalid("stack", "needs at least one variable"))?;
        let axis = kiln_core::normalize_axis("stack", axis, first.rank() + 1)? as isize;
        let parts = vars
            .iter()
            .map(|v| {
                if v.shape() != first.shape() {
                    return Err(Error::ShapeMismatch {
                        op: "stack",
                        lhs: first.shape(),
                        rhs: v.shape(),
                    });
                }
                v.unsqueeze(axis)
            })
            .collect::<Result<Vec<_>>>()?;
        Self::cat(&parts, axis)
    }

    /// `self` with the region `start..start + src.dims()[axis]` of `axis` replaced by `src`
    /// (out of place: the variable's tensor is never written). The region's gradient goes to
    /// `src`, the rest to `self`.
    pub fn slice_assign(&self, axis: isize, start: usize, src: &Self) -> Result<Self> {
        let s = src.tensor();
        let y = self.tensor().slice_assign(axis, start, &s)?;
        let len = s
            .dims()
            .get(kiln_core::normalize_axis("slice_assign", axis, s.rank())?)
            .copied()
            .unwrap_or(0);
        let src_shape = s.shape().clone();
        Ok(Var::from_op(
            "slice_assign",
            &[self, src],
            y,
            move |g, needs| {
                let gself = if needs[0] {
                    let z = Tensor::zeros(src_shape.clone(), g.dtype(), g.device())?;
                    Some(g.clone().slice_assign(axis, start, &z)?)
                } else {
                    None
                };
                let gsrc = if needs[1] {
                    Some(g.narrow(axis, start, len)?)
                } else {
                    None
                };
                Ok(vec![gself, gsrc])
            },
        ))
    }

    // ---- indexing ------------------------------------------------------------------------

    /// Entries `index` (1-d `i64`) along `dim`; repeated ids accumulate their gradients.
    pub fn index_select(&self, dim: isize, index: &Tensor<B>) -> Result<Self> {
        let (x, ids, axis) = (self.tensor(), index, dim);
        let y = x.index_select(axis, ids)?;
        let ax = kiln_core::normalize_axis("index_select", axis, x.rank())?;
        let ids = ids.clone();
        let shape = x.shape().clone();
        Ok(Var::from_op("index_select", &[self], y, move |g, _| {
            let mut d = vec![1; g.rank()];
            d[ax] = ids.elem_count();
            let ids_b = ids.reshape(d)?.broadcast_to(g.shape().clone())?;
            let z = Tensor::zeros(shape.clone(), g.dtype(), g.device())?;
            Ok(vec![Some(z.scatter_add(axis, &ids_b, g)?)])
        }))
    }

    /// `torch.gather(self, dim, index)`; the gradient is scattered (added) back.
    pub fn gather(&self, dim: isize, index: &Tensor<B>) -> Result<Self> {
        let (x, ids, axis) = (self.tensor(), index, dim);
        let y = x.gather(axis, ids)?;
        let ids = ids.clone();
        let shape = x.shape().clone();
        Ok(Var::from_op("gather", &[self], y, move |g, _| {
            let z = Tensor::zeros(shape.clone(), g.dtype(), g.device())?;
            Ok(vec![Some(z.scatter_add(axis, &ids, g)?)])
        }))
    }

    /// Out-of-place `torch.scatter_add(self, dim, index, src)`: `self` with `src` added at
    /// `index` along `dim`. Both `self` and `src` get gradients (`src`'s is the output gradient
    /// gathered at `index`).
    pub fn scatter_add(&self, dim: isize, index: &Tensor<B>, src: &Self) -> Result<Self> {
        let axis = dim;
        let y = self.tensor().scatter_add(axis, index, &src.tensor())?;
        let ids = index.clone();
        Ok(Var::from_op(
            "scatter_add",
            &[self, src],
            y,
            move |g, needs| {
                let gsrc = if needs[1] {
                    Some(g.gather(axis, &ids)?)
                } else {
                    None
                };
                Ok(vec![Some(g.clone()), gsrc])
            },
        ))
    }

    /// `cond ? on_true : on_false` with broadcasting; `cond` (a `u8` mask) gets no gradient.
    /// Under [`autocast`](crate::autocast), float branches of different dtypes meet at the
    /// widest.
    pub fn where_cond(cond: &Tensor<B>, on_true: &Self, on_false: &Self) -> Result<Self> {
        let (on_true, on_false) = &Var::autocast_widest(on_true, on_false)?;
        let t = on_true.tensor();
        let f = on_false.tensor();
        let y = cond.where_cond(&t, &f)?;
        let cond = cond.clone();
        let (ts, fs) = (t.shape().clone(), f.shape().clone());
        Ok(Var::from_op(
            "where",
            &[on_true, on_false],
            y,
            move |g, needs| {
                let z = zeros_scalar(g)?;
                let gt = if needs[0] {
                    Some(reduce_to_shape(&cond.where_cond(g, &z)?, &ts)?)
                } else {
                    None
                };
                let gf = if needs[1] {
                    Some(reduce_to_shape(&cond.where_cond(&z, g)?, &fs)?)
                } else {
                    None
                };
                Ok(vec![gt, gf])
            },
        ))
    }

    // ---- softmax and losses --------------------------------------------------------------

    /// Softmax along `dim` (any axis, negative from the end): `dx = y * (g - sum_dim(g * y))`.
    /// Under [`autocast`](crate::autocast), a 16-bit input is cast to f32 first.
    pub fn softmax(&self, dim: isize) -> Result<Self> {
        if autocast_dtype().is_some() && self.dtype().is_half() {
            return self.autocast_f32()?.softmax(dim);
        }
        let y = self.tensor().softmax(dim)?;
        let yc = y.clone();
        Ok(Var::from_op("softmax", &[self], y, move |g, _| {
            Ok(vec![Some(softmax_backward(&yc, g, dim)?)])
        }))
    }

    /// Log-softmax along `dim` (any axis, negative from the end):
    /// `dx = g - exp(y) * sum_dim(g)`.
    /// Under [`autocast`](crate::autocast), a 16-bit input is cast to f32 first.
    pub fn log_softmax(&self, dim: isize) -> Result<Self> {
        if autocast_dtype().is_some() && self.dtype().is_half() {
            return self.autocast_f32()?.log_softmax(dim);
        }
        let y = self.tensor().log_softmax(dim)?;
        let yc = y.clone();
        Ok(Var::from_op("log_softmax", &[self], y, move |g, _| {
            let s = g.sum(&[dim], true)?;
            Ok(vec![Some(g.sub(&yc.exp()?.mul(&s)?)?)])
        }))
    }

    /// Softmax cross-entropy of logits `[n, c]` against `i64` labels `[n]`, reduced as
    /// `reduction` says (`torch.nn.functional.cross_entropy`; [`Reduction::Mean`] is PyTorch's
    /// default): a 0-d variable for the mean and the sum, the `[n]` row losses for
    /// [`Reduction::None`]. Fused: the forward is the backend's `cross_entropy` kernel (plus the
    /// reduction), the backward one `cross_entropy_backward` kernel
    /// (`(softmax - onehot) * g`, `g` scaled by `1 / n` for the mean).
    ///
    /// Under [`autocast`](crate::autocast), 16-bit logits are cast to f32 first (the loss is
    /// f32).
    pub fn cross_entropy(&self, labels: &Tensor<B>, reduction: Reduction) -> Result<Self> {
        if autocast_dtype().is_some() && self.dtype().is_half() {
            return self.autocast_f32()?.cross_entropy(labels, reduction);
        }
        let x = self.tensor();
        let n = x.dims().first().copied().unwrap_or(0);
        let y = x.cross_entropy(labels, reduction)?;
        let labels = labels.clone();
        Ok(Var::from_op("cross_entropy", &[self], y, move |g, _| {
            let rows = match reduction {
                Reduction::None => g.clone(),
                r => g.mul_scalar(r.grad_scale(n))?.broadcast_to(n)?,
            };
            Ok(vec![Some(x.cross_entropy_backward(&labels, &rows)?)])
        }))
    }

    // ---- devices and dtypes --------------------------------------------------------------

    /// This variable on `device`: itself when already there, otherwise a copy recorded as an op
    /// whose backward copies the gradient back to this device (Chainer's `F.copy`), which is
    /// what model parallelism across GPUs needs.
    pub fn to_device(&self, device: &B::Device) -> Result<Self> {
        if &self.device() == device {
            return Ok(self.clone());
        }
        self.copy_to(device)
    }

    /// A copy on `device`, always (even the same device); differentiable like
    /// [`Var::to_device`].
    pub fn copy_to(&self, device: &B::Device) -> Result<Self> {
        let x = self.tensor();
        let src = x.device().clone();
        let y = x.copy_to(device)?;
        Ok(Var::from_op("copy_to", &[self], y, move |g, _| {
            Ok(vec![Some(g.to_device(&src)?)])
        }))
    }

    /// Converts to another float dtype; the gradient is converted back.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let x = self.tensor();
        if x.dtype() == dtype {
            return Ok(self.clone());
        }
        let src = x.dtype();
        let y = x.to_dtype(dtype)?;
        Ok(Var::from_op("to_dtype", &[self], y, move |g, _| {
            Ok(vec![Some(g.to_dtype(src)?)])
        }))
    }
}

fn y_axis<B: Backend>(y: &Tensor<B>, axis: isize) -> usize {
    // `Tensor::cat` already validated `axis` against this rank.
    if axis < 0 {
        (axis + y.rank() as isize) as usize
    } else {
        axis as usize
    }
}

/// What a binary op's backward kept: operands and output, each only when a rule reads it.
struct Saved<B: Backend> {
    a: Option<Tensor<B>>,
    b: Option<Tensor<B>>,
    y: Option<Tensor<B>>,
}

impl<B: Backend> Saved<B> {
    /// The arguments `(a, b, y, g)` of a rule program; `constant` is `(c, c_is_a)` for an op
    /// with a constant operand. What was not saved is not read: `g` stands in for it.
    fn args<'a>(&'a self, constant: Option<(f64, bool)>, g: &'a Tensor<B>) -> [Arg<'a, B>; 4] {
        let t = |s: &'a Option<Tensor<B>>| Arg::Tensor(s.as_ref().unwrap_or(g));
        let (mut a, mut b) = (t(&self.a), t(&self.b));
        match constant {
            Some((c, true)) => a = Arg::Scalar(c),
            Some((c, false)) => b = Arg::Scalar(c),
            None => {}
        }
        [a, b, t(&self.y), Arg::Tensor(g)]
    }
}

// ---- operators ------------------------------------------------------------------------------

macro_rules! bin_trait {
    ($trait:ident, $method:ident, $op:ident) => {
        impl<B: Backend> std::ops::$trait<&Var<B>> for &Var<B> {
            type Output = Result<Var<B>>;
            fn $method(self, rhs: &Var<B>) -> Result<Var<B>> {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl<B: Backend> std::ops::$trait<f64> for &Var<B> {
            type Output = Result<Var<B>>;
            fn $method(self, rhs: f64) -> Result<Var<B>> {
                self.binary_scalar(BinaryOp::$op, rhs)
            }
        }
        impl<B: Backend> std::ops::$trait<&Var<B>> for f64 {
            type Output = Result<Var<B>>;
            fn $method(self, rhs: &Var<B>) -> Result<Var<B>> {
                rhs.scalar_binary(BinaryOp::$op, self)
            }
        }
    };
}
bin_trait!(Add, add, Add);
bin_trait!(Sub, sub, Sub);
bin_trait!(Mul, mul, Mul);
bin_trait!(Div, div, Div);

impl<B: Backend> std::ops::Neg for &Var<B> {
    type Output = Result<Var<B>>;
    fn neg(self) -> Result<Var<B>> {
        self.unary(UnaryOp::Neg)
    }
}

/// One method per entry of kiln-core's op table: `v.exp()`, `v.relu()`, ... Generated, so an op
/// added to the table is a `Var` method with no code here.
macro_rules! var_unary_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident $dt:ident { $($body:tt)* })*) => {
        impl<B: Backend> Var<B> {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self) -> Result<Self> {
                    self.unary(UnaryOp::$V)
                }
            )*
        }
    };
}
kiln_core::unary_table!(var_unary_methods);

/// One method per entry of the binary op table, with a variable and with a constant.
macro_rules! var_binary_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident $scalar:ident $dt:ident { $($body:tt)* })*) => {
        impl<B: Backend> Var<B> {
            $(
                $(#[doc = $doc])*
                ///
                /// With broadcasting; each gradient is summed back to its input's shape.
                pub fn $method(&self, rhs: &Self) -> Result<Self> {
                    self.binary(BinaryOp::$V, rhs)
                }
                #[doc = concat!("`", stringify!($method), "(self, c)` with a constant `c`, which gets no gradient.")]
                pub fn $scalar(&self, c: f64) -> Result<Self> {
                    self.binary_scalar(BinaryOp::$V, c)
                }
            )*
        }
    };
}
kiln_core::binary_table!(var_binary_methods);
