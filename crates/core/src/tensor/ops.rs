//! Ops on tensors: validation, broadcasting, then one backend call.

use super::Tensor;
use crate::backend::{Backend, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::dims::Dims;
use crate::shape::normalize_axis;
use crate::{DType, Error, Layout, Result, Shape};

/// How a loss reduces its per-row (or per-element) values: PyTorch's `reduction=` argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// No reduction: one loss per row (or element).
    None,
    /// The mean over rows (elements): PyTorch's default.
    #[default]
    Mean,
    /// The sum over rows (elements).
    Sum,
}

impl Reduction {
    /// `losses` reduced: itself, its mean or its sum (0-d).
    pub fn apply<B: Backend>(self, losses: &Tensor<B>) -> Result<Tensor<B>> {
        match self {
            Reduction::None => Ok(losses.clone()),
            Reduction::Mean => losses.mean_all(),
            Reduction::Sum => losses.sum_all(),
        }
    }

    /// The factor a reduced loss's gradient is scaled by to give each row's (element's):
    /// `1 / count` for the mean, 1 for the sum and for none.
    pub fn grad_scale(self, count: usize) -> f64 {
        match self {
            Reduction::Mean => 1.0 / count as f64,
            Reduction::None | Reduction::Sum => 1.0,
        }
    }
}

fn dtype_err(op: &'static str, expected: impl Into<String>, got: DType) -> Error {
    Error::DTypeMismatch {
        op,
        expected: expected.into(),
        got,
    }
}

impl<B: Backend> Tensor<B> {
    /// Checks device and dtype agreement and returns both layouts broadcast to a common shape.
    fn broadcast_pair(&self, op: &'static str, rhs: &Self) -> Result<(Shape, Layout, Layout)> {
        self.check_same_device(op, rhs)?;
        if self.dtype() != rhs.dtype() {
            return Err(dtype_err(op, self.dtype().to_string(), rhs.dtype()));
        }
        if self.shape() == rhs.shape() {
            // Nothing to broadcast (most calls): the layouts as they are.
            return Ok((
                self.shape().clone(),
                self.layout().clone(),
                rhs.layout().clone(),
            ));
        }
        let shape = self.shape().broadcast_with(op, rhs.shape())?;
        let l = self.layout().broadcast_to(&shape)?;
        let r = rhs.layout().broadcast_to(&shape)?;
        Ok((shape, l, r))
    }

    pub(crate) fn require_float(&self, op: &'static str) -> Result<()> {
        if !self.dtype().is_float() {
            return Err(dtype_err(
                op,
                "a float dtype (f32, f64, f16, bf16)",
                self.dtype(),
            ));
        }
        Ok(())
    }

    // ---- elementwise ---------------------------------------------------------------------

    pub fn unary(&self, op: UnaryOp) -> Result<Self> {
        if !op.supports(self.dtype()) {
            return Err(dtype_err(
                op.name(),
                "a dtype the op supports (see UnaryOp)",
                self.dtype(),
            ));
        }
        let _p = self.prof(op.name(), &[], true);
        let s = B::unary(op, self.storage(), self.layout(), self.dtype())?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }

    /// The gradient of `y = op(x)` given the upstream gradient `g` (same shape): `g · op'(x)`,
    /// in one kernel where the backend has one. `self` is the saved `x` or `y`, as
    /// [`UnaryOp::grad_reads`](crate::UnaryOp::grad_reads) says. Float dtypes.
    pub fn unary_backward(&self, op: UnaryOp, g: &Self) -> Result<Self> {
        const OP: &str = "unary_backward";
        if g.shape() != self.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: g.shape().clone(),
            });
        }
        if g.dtype() != self.dtype() || !self.dtype().is_float() {
            return Err(dtype_err(OP, "a float dtype, the same for both", g.dtype()));
        }
        if g.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: self.device().to_string(),
                rhs: g.device().to_string(),
            });
        }
        let _p = self.prof("unary_backward", &[g], true);
        let s = B::unary_backward(
            op,
            self.storage(),
            self.layout(),
            g.storage(),
            g.layout(),
            self.dtype(),
        )?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }

    /// `op(self, rhs)` with numpy broadcasting.
    pub fn binary(&self, op: BinaryOp, rhs: &Self) -> Result<Self> {
        let (shape, l, r) = self.broadcast_pair(op.name(), rhs)?;
        if !op.supports(self.dtype()) {
            return Err(dtype_err(
                op.name(),
                "a dtype the op supports (see BinaryOp)",
                self.dtype(),
            ));
        }
        let _p = self.prof(op.name(), &[rhs], true);
        let s = B::binary(op, self.storage(), &l, rhs.storage(), &r, self.dtype())?;
        Ok(self.fresh(s, shape, self.dtype()))
    }

    /// `op(self, scalar)`; the scalar travels as a kernel argument.
    pub fn binary_scalar(&self, op: BinaryOp, scalar: f64) -> Result<Self> {
        self.scalar_op(op, scalar, false)
    }

    /// `op(scalar, self)`.
    pub fn scalar_binary(&self, op: BinaryOp, scalar: f64) -> Result<Self> {
        self.scalar_op(op, scalar, true)
    }

    fn scalar_op(&self, op: BinaryOp, scalar: f64, scalar_lhs: bool) -> Result<Self> {
        if !op.supports(self.dtype()) {
            return Err(dtype_err(
                op.name(),
                "a dtype the op supports (see BinaryOp)",
                self.dtype(),
            ));
        }
        let _p = self.prof(op.name(), &[], true);
        let s = B::binary_scalar(
            op,
            self.storage(),
            self.layout(),
            self.dtype(),
            scalar,
            scalar_lhs,
        )?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }

    /// Clamps into `[lo, hi]`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Self> {
        self.maximum_scalar(lo)?.minimum_scalar(hi)
    }
    /// `a * self + b` (two scalar kernels; an affine map).
    pub fn affine(&self, a: f64, b: f64) -> Result<Self> {
        self.mul_scalar(a)?.add_scalar(b)
    }

    // ---- comparisons and selection -------------------------------------------------------

    /// A `u8` mask of `op(self, rhs)`, broadcasting.
    pub fn compare(&self, op: CmpOp, rhs: &Self) -> Result<Self> {
        let (shape, l, r) = self.broadcast_pair(op.name(), rhs)?;
        let _p = self.prof(op.name(), &[rhs], true);
        let s = B::compare(op, self.storage(), &l, rhs.storage(), &r, self.dtype())?;
        Ok(self.fresh(s, shape, DType::U8))
    }

    /// A `u8` mask of `op(self, c)`.
    pub fn compare_scalar(&self, op: CmpOp, c: f64) -> Result<Self> {
        let rhs = Self::full(Shape::scalar(), c, self.dtype(), self.device())?;
        self.compare(op, &rhs)
    }

    pub fn eq(&self, rhs: &Self) -> Result<Self> {
        self.compare(CmpOp::Eq, rhs)
    }
    pub fn ne(&self, rhs: &Self) -> Result<Self> {
        self.compare(CmpOp::Ne, rhs)
    }
    pub fn lt(&self, rhs: &Self) -> Result<Self> {
        self.compare(CmpOp::Lt, rhs)
    }
    pub fn le(&self, rhs: &Self) -> Result<Self> {
        self.compare(CmpOp::Le, rhs)
    }
    pub fn gt(&self, rhs: &Self) -> Result<Self> {
        self.compare(CmpOp::Gt, rhs)
    }
    pub fn ge(&self, rhs: &Self) -> Result<Self> {
        self.compare(CmpOp::Ge, rhs)
    }

    /// `self ? on_true : on_false` where `self` is a `u8` mask; all three broadcast.
    pub fn where_cond(&self, on_true: &Self, on_false: &Self) -> Result<Self> {
        const OP: &str = "where";
        if self.dtype() != DType::U8 {
            return Err(dtype_err(OP, "u8 condition", self.dtype()));
        }
        self.check_same_device(OP, on_true)?;
        let (shape, t, f) = on_true.broadcast_pair(OP, on_false)?;
        let shape = shape.broadcast_with(OP, self.shape())?;
        let c = self.layout().broadcast_to(&shape)?;
        let t = t.broadcast_to(&shape)?;
        let f = f.broadcast_to(&shape)?;
        let _p = self.prof("where", &[on_true, on_false], true);
        let s = B::where_cond(
            self.storage(),
            &c,
            on_true.storage(),
            &t,
            on_false.storage(),
            &f,
            on_true.dtype(),
        )?;
        Ok(self.fresh(s, shape, on_true.dtype()))
    }

    /// Converts to `dtype` (`as` semantics); returns `self` when it already has it.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let _p = self.prof("cast", &[], true);
        let s = B::cast(self.storage(), self.layout(), self.dtype(), dtype)?;
        Ok(self.fresh(s, self.shape().clone(), dtype))
    }

    // ---- reductions ----------------------------------------------------------------------

    /// Reduces `axes` (all axes when empty is not what you want: pass them). Keeps the reduced
    /// axes as size 1 when `keepdim`.
    pub fn reduce(&self, op: ReduceOp, axes: &[isize], keepdim: bool) -> Result<Self> {
        let name = op.name();
        let axes = self.shape().axis_set(name, axes)?;
        match op {
            ReduceOp::Sum if !(self.dtype().is_float() || self.dtype() == DType::I64) => {
                return Err(dtype_err(name, "a float dtype or i64", self.dtype()));
            }
            ReduceOp::ArgMax | ReduceOp::ArgMin if axes.len() != 1 => {
                return Err(Error::invalid(
                    name,
                    format!("reduces exactly one axis, got {}", axes.len()),
                ));
            }
            _ => {}
        }
        if op != ReduceOp::Sum && axes.iter().any(|&a| self.dims()[a] == 0) {
            return Err(Error::invalid(
                name,
                format!("cannot reduce an empty axis of shape {}", self.shape()),
            ));
        }
        let p = self.prof(name, &[], false);
        let s = B::reduce(op, self.storage(), self.layout(), self.dtype(), &axes)?;
        drop(p);
        let mut kept = Dims::from(self.dims());
        for &a in axes.iter() {
            kept[a] = 1;
        }
        let dtype = if op.is_arg() {
            DType::I64
        } else {
            self.dtype()
        };
        let out = self.fresh(s, Shape::from_dims(kept), dtype);
        if keepdim {
            return Ok(out);
        }
        let dims: Dims = (0..self.rank())
            .filter(|i| !axes.contains(i))
            .map(|i| self.dims()[i])
            .collect();
        out.reshape(Shape::from_dims(dims))
    }

    fn all_axes(&self) -> Vec<isize> {
        (0..self.rank() as isize).collect()
    }

    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        self.reduce(ReduceOp::Sum, axes, keepdim)
    }
    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Self> {
        self.sum(&self.all_axes(), false)
    }
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        self.require_float("mean")?;
        let axes_n = self.shape().axes("mean", axes)?;
        let n: usize = axes_n.iter().map(|&a| self.dims()[a]).product();
        self.sum(axes, keepdim)?.div_scalar(n as f64)
    }
    pub fn mean_all(&self) -> Result<Self> {
        self.mean(&self.all_axes(), false)
    }
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        self.reduce(ReduceOp::Max, axes, keepdim)
    }
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Self> {
        self.reduce(ReduceOp::Min, axes, keepdim)
    }
    pub fn max_all(&self) -> Result<Self> {
        self.max(&self.all_axes(), false)
    }
    pub fn min_all(&self) -> Result<Self> {
        self.min(&self.all_axes(), false)
    }
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Self> {
        self.reduce(ReduceOp::ArgMax, &[axis], keepdim)
    }
    pub fn argmin(&self, axis: isize, keepdim: bool) -> Result<Self> {
        self.reduce(ReduceOp::ArgMin, &[axis], keepdim)
    }
    /// The maxima along `dim` and where they are, as `torch.max(x, dim, keepdim)`:
    /// `(values, indices)`, the indices `i64` ([`Self::argmax`]'s, the first of tied maxima on
    /// the CPU and the reference). [`Self::max`] reduces several axes and returns values only.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Self, Self)> {
        Ok((self.max(&[dim], keepdim)?, self.argmax(dim, keepdim)?))
    }
    /// The minima along `dim` and where they are (`torch.min(x, dim, keepdim)`); as
    /// [`Self::max_dim`].
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Self, Self)> {
        Ok((self.min(&[dim], keepdim)?, self.argmin(dim, keepdim)?))
    }

    // ---- matmul --------------------------------------------------------------------------

    /// Matrix product with numpy semantics: 1-d operands are promoted (and the added axis
    /// removed), batch axes broadcast. Transposed views go to the backend without a copy.
    pub fn matmul(&self, rhs: &Self) -> Result<Self> {
        const OP: &str = "matmul";
        self.check_same_device(OP, rhs)?;
        if self.dtype() != rhs.dtype() {
            return Err(dtype_err(OP, self.dtype().to_string(), rhs.dtype()));
        }
        self.require_float(OP)?;
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::invalid(
                OP,
                format!("needs rank >= 1, got {} and {}", self.shape(), rhs.shape()),
            ));
        }
        let a = if self.rank() == 1 {
            self.unsqueeze(0)?
        } else {
            self.clone()
        };
        let b = if rhs.rank() == 1 {
            rhs.unsqueeze(-1)?
        } else {
            rhs.clone()
        };
        let (m, k) = (a.dims()[a.rank() - 2], a.dims()[a.rank() - 1]);
        let (k2, n) = (b.dims()[b.rank() - 2], b.dims()[b.rank() - 1]);
        if k != k2 {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
            });
        }
        let batch_a = Shape::new(&a.dims()[..a.rank() - 2]);
        let batch_b = Shape::new(&b.dims()[..b.rank() - 2]);
        let batch = batch_a
            .broadcast_with(OP, &batch_b)
            .map_err(|_| Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
            })?;
        let _p = self.prof(OP, &[rhs], false);
        let a3 = as_batched_matrix(&a, &batch, m, k)?;
        let b3 = as_batched_matrix(&b, &batch, k, n)?;
        let (a3, b3) = fold_shared_rhs(a3, b3);
        let s = B::matmul(
            a3.storage(),
            a3.layout(),
            b3.storage(),
            b3.layout(),
            self.dtype(),
        )?;
        let mut out_dims: Dims = batch.dims().iter().copied().collect();
        if self.rank() > 1 {
            out_dims.push(m);
        }
        if rhs.rank() > 1 {
            out_dims.push(n);
        }
        Ok(self.fresh(s, Shape::from_dims(out_dims), self.dtype()))
    }

    // ---- softmax and losses --------------------------------------------------------------

    /// Softmax along `dim` (negative counts from the end: `-1` is the last axis), as
    /// `torch.softmax(x, dim)`.
    ///
    /// The backend's kernel works on the last axis; another axis is swapped last by a
    /// transposed view (no copy: the kernel reads strided input), and the result is that
    /// kernel's output transposed back, a view, not contiguous.
    pub fn softmax(&self, dim: isize) -> Result<Self> {
        self.softmax_impl("softmax", dim, false)
    }
    /// Log-softmax along `dim` (computed in one pass, not as `log(softmax)`); any axis, as
    /// [`Self::softmax`].
    pub fn log_softmax(&self, dim: isize) -> Result<Self> {
        self.softmax_impl("log_softmax", dim, true)
    }
    fn softmax_impl(&self, op: &'static str, dim: isize, log: bool) -> Result<Self> {
        self.require_float(op)?;
        if self.rank() == 0 {
            return Err(Error::invalid(op, "needs rank >= 1, got a scalar"));
        }
        let axis = normalize_axis(op, dim, self.rank())?;
        let last = self.rank() - 1;
        if axis != last {
            let (a, l) = (axis as isize, last as isize);
            return self
                .transpose(a, l)?
                .softmax_impl(op, -1, log)?
                .transpose(a, l);
        }
        let _p = self.prof(op, &[], false);
        let s = B::softmax(self.storage(), self.layout(), self.dtype(), log)?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }

    /// Softmax cross-entropy of logits `[n, c]` against `i64` labels `[n]`
    /// (`torch.nn.functional.cross_entropy`): the row losses `logsumexp(row) - row[label]`
    /// reduced as `reduction` says, a 0-d tensor for [`Reduction::Mean`] (PyTorch's default)
    /// and [`Reduction::Sum`], the `[n]` row losses for [`Reduction::None`]. A label outside
    /// `0..c` is [`Error::IndexOutOfRange`].
    pub fn cross_entropy(&self, labels: &Self, reduction: Reduction) -> Result<Self> {
        reduction.apply(&self.cross_entropy_rows(labels)?)
    }

    fn cross_entropy_rows(&self, labels: &Self) -> Result<Self> {
        check_xent::<B>("cross_entropy", self, labels)?;
        let _p = self.prof("cross_entropy", &[labels], false);
        let s = B::cross_entropy(
            self.storage(),
            self.layout(),
            labels.storage(),
            labels.layout(),
            self.dtype(),
        )?;
        Ok(self.fresh(s, self.dims()[0], self.dtype()))
    }

    /// `(softmax(self) - onehot(labels)) * grad[:, None]`, the gradient of the row losses of
    /// [`Self::cross_entropy`] (its [`Reduction::None`] form) given their gradient `grad` `[n]`.
    pub fn cross_entropy_backward(&self, labels: &Self, grad: &Self) -> Result<Self> {
        const OP: &str = "cross_entropy_backward";
        check_xent::<B>(OP, self, labels)?;
        self.check_same_device(OP, grad)?;
        if grad.dims() != [self.dims()[0]] || grad.dtype() != self.dtype() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: grad.shape().clone(),
            });
        }
        let _p = self.prof(OP, &[labels, grad], false);
        let s = B::cross_entropy_backward(
            self.storage(),
            self.layout(),
            labels.storage(),
            labels.layout(),
            grad.storage(),
            grad.layout(),
            self.dtype(),
        )?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }

    // ---- indexing ------------------------------------------------------------------------

    /// Entries `index` (1-d `i64`) along `dim` (`torch.index_select(self, dim, index)`).
    pub fn index_select(&self, dim: isize, index: &Self) -> Result<Self> {
        const OP: &str = "index_select";
        let (axis, ids) = (normalize_axis(OP, dim, self.rank())?, index);
        check_ids::<B>(OP, self, ids)?;
        if ids.rank() != 1 {
            return Err(Error::invalid(
                OP,
                format!("indices must be 1-d, got shape {}", ids.shape()),
            ));
        }
        let _p = self.prof(OP, &[ids], false);
        let s = B::index_select(
            self.storage(),
            self.layout(),
            self.dtype(),
            ids.storage(),
            ids.layout(),
            axis,
        )?;
        let mut dims = self.dims().to_vec();
        dims[axis] = ids.elem_count();
        Ok(self.fresh(s, dims, self.dtype()))
    }

    /// `torch.gather(self, dim, index)`: `out[i][j] = self[index[i][j]][j]` for `dim == 0`,
    /// and so on; the output has the shape of `index`.
    pub fn gather(&self, dim: isize, index: &Self) -> Result<Self> {
        const OP: &str = "gather";
        let (axis, ids) = (normalize_axis(OP, dim, self.rank())?, index);
        check_ids::<B>(OP, self, ids)?;
        check_index_shape(OP, self.shape(), ids.shape(), axis)?;
        let _p = self.prof(OP, &[ids], false);
        let s = B::gather(
            self.storage(),
            self.layout(),
            self.dtype(),
            ids.storage(),
            ids.layout(),
            axis,
        )?;
        Ok(self.fresh(s, ids.shape().clone(), self.dtype()))
    }

    /// Out-of-place `torch.scatter_add(self, dim, index, src)`: `self` with `src` added at
    /// `index` along `dim`.
    pub fn scatter_add(&self, dim: isize, index: &Self, src: &Self) -> Result<Self> {
        const OP: &str = "scatter_add";
        let (axis, ids) = (normalize_axis(OP, dim, self.rank())?, index);
        check_ids::<B>(OP, self, ids)?;
        self.check_same_device(OP, src)?;
        if src.dtype() != self.dtype() {
            return Err(dtype_err(OP, self.dtype().to_string(), src.dtype()));
        }
        if ids.shape() != src.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: ids.shape().clone(),
                rhs: src.shape().clone(),
            });
        }
        check_index_shape(OP, self.shape(), ids.shape(), axis)?;
        let _p = self.prof(OP, &[ids, src], false);
        let s = B::scatter_add(
            self.storage(),
            self.layout(),
            self.dtype(),
            ids.storage(),
            ids.layout(),
            src.storage(),
            src.layout(),
            axis,
        )?;
        Ok(self.fresh(s, self.shape().clone(), self.dtype()))
    }
}

/// Views `t` (rank >= 2, last two dims `rows x cols`) as `[batch, rows, cols]` with the batch
/// broadcast and each matrix row- or column-major, copying only when neither holds.
fn as_batched_matrix<B: Backend>(
    t: &Tensor<B>,
    batch: &Shape,
    rows: usize,
    cols: usize,
) -> Result<Tensor<B>> {
    let mut full: Dims = batch.dims().iter().copied().collect();
    full.push(rows);
    full.push(cols);
    // Already of that shape (every plain 2-d product): no new layout to build.
    let t = if t.dims() == &full[..] {
        t.clone()
    } else {
        t.broadcast_to(Shape::from_dims(full))?
    };
    let nb = batch.elem_count();
    let try_view = |t: &Tensor<B>| -> Option<Layout> {
        let r = t.rank();
        let (rs, cs) = (t.layout().strides()[r - 2], t.layout().strides()[r - 1]);
        // Size-1 (and empty) dims carry arbitrary strides: pick ones BLAS accepts.
        let (rs, cs) = if rows == 0 || cols == 0 {
            (cols.max(1), 1)
        } else if (cols == 1 || cs == 1) && (rows == 1 || rs >= cols) {
            (if rows == 1 { cols } else { rs }, 1)
        } else if (rows == 1 || rs == 1) && (cols == 1 || cs >= rows) {
            (1, if cols == 1 { rows } else { cs })
        } else {
            return None;
        };
        // The batch axes must collapse into one stride.
        let bdims = &t.dims()[..r - 2];
        let bstr = &t.layout().strides()[..r - 2];
        let mut bstride = None;
        let mut expect = None::<usize>;
        for (&d, &s) in bdims.iter().zip(bstr).rev() {
            if d == 1 {
                continue;
            }
            match expect {
                None => {
                    bstride = Some(s);
                    expect = Some(s * d);
                }
                Some(e) if e == s => expect = Some(s * d),
                Some(_) => return None,
            }
        }
        Some(Layout::from_parts(
            Shape::new([nb, rows, cols]),
            [bstride.unwrap_or(0), rs, cs],
            t.layout().offset(),
        ))
    };
    if let Some(l) = try_view(&t) {
        return Ok(t.with_layout(l));
    }
    let c = t.contiguous()?;
    let l = try_view(&c).ok_or_else(|| {
        Error::invalid("matmul", "internal: contiguous operand has no BLAS layout")
    })?;
    Ok(c.with_layout(l))
}

/// `[batch, m, k] · [batch, k, n]` as one `[1, batch·m, k] · [1, k, n]` product when every
/// matrix shares the right operand (batch stride 0: `x · W` over `[b, t, k]`, a linear layer)
/// and the left matrices are the row blocks of one row-major matrix: the same numbers in the
/// same output layout, but one GEMM, as PyTorch folds its linear layers. A batched GEMM of 64
/// blocks of 256 rows ran a GPT's f32 products ~20% slower than one of 16,384 rows (cuBLAS
/// picks other kernels for it; H100, 2026-11-27). Anything else is returned as it was.
fn fold_shared_rhs<B: Backend>(a3: Tensor<B>, b3: Tensor<B>) -> (Tensor<B>, Tensor<B>) {
    let (la, lb) = (a3.layout(), b3.layout());
    let (nb, m, k) = (la.dims()[0], la.dims()[1], la.dims()[2]);
    let n = lb.dims()[2];
    let [sb, rs, cs] = [la.strides()[0], la.strides()[1], la.strides()[2]];
    if nb < 2 || lb.strides()[0] != 0 || cs != 1 || sb != m * rs {
        return (a3, b3);
    }
    let fa = Layout::from_parts(Shape::new([1, nb * m, k]), vec![0, rs, 1], la.offset());
    let fb = Layout::from_parts(
        Shape::new([1, k, n]),
        vec![0, lb.strides()[1], lb.strides()[2]],
        lb.offset(),
    );
    (a3.with_layout(fa), b3.with_layout(fb))
}

fn check_ids<B: Backend>(op: &'static str, t: &Tensor<B>, ids: &Tensor<B>) -> Result<()> {
    t.check_same_device(op, ids)?;
    if ids.dtype() != DType::I64 {
        return Err(dtype_err(op, "i64 indices", ids.dtype()));
    }
    Ok(())
}

fn check_index_shape(op: &'static str, shape: &Shape, ids: &Shape, axis: usize) -> Result<()> {
    let ok = ids.rank() == shape.rank()
        && (0..shape.rank()).all(|i| i == axis || ids.dims()[i] <= shape.dims()[i]);
    if !ok {
        return Err(Error::ShapeMismatch {
            op,
            lhs: shape.clone(),
            rhs: ids.clone(),
        });
    }
    Ok(())
}

fn check_xent<B: Backend>(op: &'static str, logits: &Tensor<B>, labels: &Tensor<B>) -> Result<()> {
    logits.require_float(op)?;
    check_ids::<B>(op, logits, labels)?;
    if logits.rank() != 2 || labels.dims() != [logits.dims()[0]] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: logits.shape().clone(),
            rhs: labels.shape().clone(),
        });
    }
    Ok(())
}

macro_rules! bin_trait {
    ($trait:ident, $method:ident, $op:ident) => {
        impl<B: Backend> std::ops::$trait<&Tensor<B>> for &Tensor<B> {
            type Output = Result<Tensor<B>>;
            fn $method(self, rhs: &Tensor<B>) -> Result<Tensor<B>> {
                self.binary(BinaryOp::$op, rhs)
            }
        }
        impl<B: Backend> std::ops::$trait<f64> for &Tensor<B> {
            type Output = Result<Tensor<B>>;
            fn $method(self, rhs: f64) -> Result<Tensor<B>> {
                self.binary_scalar(BinaryOp::$op, rhs)
            }
        }
    };
}
bin_trait!(Add, add, Add);
bin_trait!(Sub, sub, Sub);
bin_trait!(Mul, mul, Mul);
bin_trait!(Div, div, Div);

impl<B: Backend> std::ops::Neg for &Tensor<B> {
    type Output = Result<Tensor<B>>;
    fn neg(self) -> Result<Tensor<B>> {
        self.unary(UnaryOp::Neg)
    }
}
