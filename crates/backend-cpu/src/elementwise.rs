//! Elementwise kernels: unary, binary, binary-with-scalar, compare, where, cast.
//!
//! Each op is a slice kernel (a plain loop over equal-length slices, which LLVM vectorizes)
//! run by the strided drivers in [`crate::strided`]. Semantics follow the `Backend` docs:
//! i64 arithmetic wraps, i64 `Div` truncates and gives 0 for a zero divisor, `Maximum`/`Minimum`
//! propagate NaN (as numpy and PyTorch do), casts are Rust `as` casts (`convert.rs`).
//!
//! The arithmetic of f16 and bf16 is not here: `lazy::record` runs every 16-bit op through the
//! fused evaluator (`expr`), whose widened program computes in f32 and rounds each result once
//! (`Program::widened`), so 16-bit arithmetic has one definition on the CPU. Comparisons,
//! `where`, casts and copies of 16-bit values are exact and run here like any other dtype's.

use kiln_core::expr::rules::unary_backward_program;
use kiln_core::{
    BinaryFn, BinaryOp, BinaryVisitor, CmpFn, CmpOp, CmpVisitor, DType, Error, Layout, Result,
    UnaryFn, UnaryOp, UnaryVisitor,
};

use crate::convert::Conv;
use crate::fastmath;
use crate::storage::{CpuElem, CpuStorage, alloc, storage, with_elem};
use crate::strided::{map1, map2, map3};

/// What ops over every dtype accept, for their errors.
pub(crate) const ALL_DTYPES: &str = "f32, f64, f16, bf16, i64 or u8";

pub(crate) fn dtype_err(op: &'static str, expected: &str, got: DType) -> Error {
    Error::DTypeMismatch {
        op,
        expected: expected.to_string(),
        got,
    }
}

/// The typed slice of `s`, or a dtype error naming `op`.
pub(crate) fn slice<'a, T: CpuElem>(op: &'static str, s: &'a CpuStorage) -> Result<&'a [T]> {
    T::slice(s.data()?).ok_or_else(|| dtype_err(op, T::DTYPE.as_str(), s.dtype()))
}

/// A slice kernel from an elementwise function.
#[inline(always)]
fn ew1<A: Copy, U>(f: impl Fn(A) -> U + Sync) -> impl Fn(&[A], &mut [U]) + Sync {
    move |a, o| {
        for (o, &x) in o.iter_mut().zip(a) {
            *o = f(x);
        }
    }
}

#[inline(always)]
fn ew2<A: Copy, B: Copy, U>(f: impl Fn(A, B) -> U + Sync) -> impl Fn(&[A], &[B], &mut [U]) + Sync {
    move |a, b, o| {
        for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
    }
}

/// Runs a unary slice kernel into a fresh storage.
fn run1<A: CpuElem, U: CpuElem>(
    s: &CpuStorage,
    layout: &Layout,
    op: &'static str,
    kern: impl Fn(&[A], &mut [U]) + Sync,
) -> Result<CpuStorage> {
    let a = slice::<A>(op, s)?;
    let mut out = alloc::<U>(op, s.device(), layout.elem_count())?;
    map1(a, layout, &mut out, kern);
    Ok(storage(s.device(), out))
}

fn run2<A: CpuElem, U: CpuElem>(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    op: &'static str,
    kern: impl Fn(&[A], &[A], &mut [U]) + Sync,
) -> Result<CpuStorage> {
    let (x, y) = (slice::<A>(op, a)?, slice::<A>(op, b)?);
    let mut out = alloc::<U>(op, a.device(), la.elem_count())?;
    map2(x, la, y, lb, &mut out, kern);
    Ok(storage(a.device(), out))
}

// ---- unary -----------------------------------------------------------------------------------

/// The loop of one unary op, monomorphized per op of the table (`UnaryOp::visit`).
struct UnaryKernel<'a> {
    s: &'a CpuStorage,
    layout: &'a Layout,
    dtype: DType,
}

impl UnaryVisitor for UnaryKernel<'_> {
    type Output = Result<CpuStorage>;

    fn visit<F: UnaryFn>(self) -> Result<CpuStorage> {
        let (s, l, name) = (self.s, self.layout, F::OP.name());
        match self.dtype {
            // f32 exp, ln and sigmoid: the vectorized polynomials of `fastmath` (hand kernels
            // kept because they beat the scalar loop, see `fastmath`'s docs and BENCHMARKS.md).
            DType::F32 if F::OP == UnaryOp::Exp => run1::<f32, f32>(s, l, name, fastmath::exp_f32),
            DType::F32 if F::OP == UnaryOp::Log => run1::<f32, f32>(s, l, name, fastmath::ln_f32),
            DType::F32 if F::OP == UnaryOp::Sigmoid => {
                run1::<f32, f32>(s, l, name, fastmath::sigmoid_f32)
            }
            DType::F32 => run1::<f32, f32>(s, l, name, ew1(F::f::<f32>)),
            DType::F64 => run1::<f64, f64>(s, l, name, ew1(F::f::<f64>)),
            DType::I64 if F::OP.supports(DType::I64) => run1::<i64, i64>(s, l, name, ew1(F::int)),
            DType::I64 => Err(dtype_err(name, "f32 or f64", self.dtype)),
            _ => Err(dtype_err(name, "f32, f64 or i64", self.dtype)),
        }
    }
}

/// `op(x)` elementwise, by the op table's definition of `op`.
pub(crate) fn unary(
    op: UnaryOp,
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    op.visit(UnaryKernel { s, layout, dtype })
}

// ---- unary backward --------------------------------------------------------------------------

/// `g · op'(x)` (see `Backend::unary_backward`): the op table's rule, run by the fused
/// evaluator in one pass; both layouts have the output's shape.
pub(crate) fn unary_backward(
    op: UnaryOp,
    s: &CpuStorage,
    ls: &Layout,
    g: &CpuStorage,
    lg: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    if !dtype.is_float() {
        return Err(dtype_err("unary_backward", "f32 or f64", dtype));
    }
    let program = unary_backward_program(op, dtype)?;
    let mut out =
        crate::expr::eval_expr(&s.device(), &program, lg.shape(), &[(s, ls), (g, lg)], &[])?;
    Ok(out.swap_remove(0))
}

// ---- binary ----------------------------------------------------------------------------------

/// The loop of one binary op, monomorphized per op of the table (`BinaryOp::visit`): `op(a, b)`
/// over two tensors, or over one and a scalar `c` (`op(x, c)`, or `op(c, x)` when `lhs`).
struct BinaryKernel<'a> {
    a: (&'a CpuStorage, &'a Layout),
    b: Option<(&'a CpuStorage, &'a Layout)>,
    c: f64,
    lhs: bool,
    dtype: DType,
}

impl BinaryKernel<'_> {
    fn run<T: CpuElem>(
        &self,
        name: &'static str,
        f: impl Fn(T, T) -> T + Sync + Copy,
    ) -> Result<CpuStorage> {
        let (a, la) = self.a;
        let c = T::from_f64(self.c);
        match self.b {
            Some((b, lb)) => run2::<T, T>(a, la, b, lb, name, ew2(f)),
            None if self.lhs => run1::<T, T>(a, la, name, ew1(move |x: T| f(c, x))),
            None => run1::<T, T>(a, la, name, ew1(move |x: T| f(x, c))),
        }
    }
}

impl BinaryVisitor for BinaryKernel<'_> {
    type Output = Result<CpuStorage>;

    fn visit<F: BinaryFn>(self) -> Result<CpuStorage> {
        let name = F::OP.name();
        if !F::OP.supports(self.dtype) {
            return Err(dtype_err(
                name,
                "a dtype the op supports (see BinaryOp)",
                self.dtype,
            ));
        }
        match self.dtype {
            DType::F32 => self.run::<f32>(name, F::f::<f32>),
            DType::F64 => self.run::<f64>(name, F::f::<f64>),
            DType::I64 => self.run::<i64>(name, F::int),
            DType::U8 => self.run::<u8>(name, F::byte),
            _ => Err(dtype_err(name, "f32, f64, i64 or u8", self.dtype)),
        }
    }
}

/// `op(a, b)` elementwise, by the op table's definition of `op`.
pub(crate) fn binary(
    op: BinaryOp,
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    op.visit(BinaryKernel {
        a: (a, la),
        b: Some((b, lb)),
        c: 0.0,
        lhs: false,
        dtype,
    })
}

/// `op(x, c)` (or `op(c, x)` when `scalar_lhs`) with `c` converted to the dtype by `as`.
pub(crate) fn binary_scalar(
    op: BinaryOp,
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
    scalar: f64,
    scalar_lhs: bool,
) -> Result<CpuStorage> {
    op.visit(BinaryKernel {
        a: (s, layout),
        b: None,
        c: scalar,
        lhs: scalar_lhs,
        dtype,
    })
}

// ---- compare, where, cast --------------------------------------------------------------------

/// One comparison's loop, monomorphized per comparison (`CmpOp::visit`).
struct CmpKernel<'a> {
    a: (&'a CpuStorage, &'a Layout),
    b: (&'a CpuStorage, &'a Layout),
}

impl CmpKernel<'_> {
    fn run<T: CpuElem>(
        &self,
        name: &'static str,
        f: impl Fn(T, T) -> bool + Sync,
    ) -> Result<CpuStorage> {
        let ((a, la), (b, lb)) = (self.a, self.b);
        run2::<T, u8>(a, la, b, lb, name, ew2(move |x: T, y: T| f(x, y) as u8))
    }
}

fn compare_t<T: CpuElem>(
    op: CmpOp,
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    struct V<'a, T>(CmpKernel<'a>, std::marker::PhantomData<T>);
    impl<T: CpuElem> CmpVisitor for V<'_, T> {
        type Output = Result<CpuStorage>;
        fn visit<F: CmpFn>(self) -> Result<CpuStorage> {
            self.0.run::<T>(F::OP.name(), F::f::<T>)
        }
    }
    op.visit(V::<T>(
        CmpKernel {
            a: (a, la),
            b: (b, lb),
        },
        std::marker::PhantomData,
    ))
}

pub(crate) fn compare(
    op: CmpOp,
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    // (16-bit floats compare exactly as stored: their order is their f32 values'.)
    with_elem!(dtype, T => compare_t::<T>(op, a, la, b, lb),
        _ => Err(dtype_err(op.name(), ALL_DTYPES, dtype)))
}

fn where_t<T: CpuElem>(
    c: &CpuStorage,
    lc: &Layout,
    t: &CpuStorage,
    lt: &Layout,
    f: &CpuStorage,
    lf: &Layout,
) -> Result<CpuStorage> {
    const OP: &str = "where";
    let (cv, tv, fv) = (slice::<u8>(OP, c)?, slice::<T>(OP, t)?, slice::<T>(OP, f)?);
    let mut out = alloc::<T>(OP, t.device(), lt.elem_count())?;
    map3(cv, lc, tv, lt, fv, lf, &mut out, |c, t, f, o| {
        for (((o, &c), &t), &f) in o.iter_mut().zip(c).zip(t).zip(f) {
            *o = if c != 0 { t } else { f };
        }
    });
    Ok(storage(t.device(), out))
}

pub(crate) fn where_cond(
    c: &CpuStorage,
    lc: &Layout,
    t: &CpuStorage,
    lt: &Layout,
    f: &CpuStorage,
    lf: &Layout,
    dtype: DType,
) -> Result<CpuStorage> {
    with_elem!(dtype, T => where_t::<T>(c, lc, t, lt, f, lf),
        _ => Err(dtype_err("where", ALL_DTYPES, dtype)))
}

/// `cast` between any two dtypes, by [`Conv`] (Rust's `as` among f32, f64, i64 and u8; see
/// `convert.rs` for the 16-bit floats).
pub(crate) fn cast(s: &CpuStorage, layout: &Layout, from: DType, to: DType) -> Result<CpuStorage> {
    with_elem!(from, A => with_elem!(to, U => run1::<A, U>(s, layout, "cast", ew1(Conv::<U>::conv)),
        _ => Err(dtype_err("cast", ALL_DTYPES, to))),
        _ => Err(dtype_err("cast", ALL_DTYPES, from)))
}

/// The elements of `layout` as a new contiguous storage on `dst` (any dtype).
pub(crate) fn copy_contiguous(
    op: &'static str,
    s: &CpuStorage,
    layout: &Layout,
    dtype: DType,
    dst: crate::CpuDevice,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(
        op: &'static str,
        s: &CpuStorage,
        layout: &Layout,
        dst: crate::CpuDevice,
    ) -> Result<CpuStorage> {
        let a = slice::<T>(op, s)?;
        let mut out = alloc::<T>(op, dst, layout.elem_count())?;
        map1(a, layout, &mut out, |x, o| o.copy_from_slice(x));
        Ok(storage(dst, out))
    }
    with_elem!(dtype, T => go::<T>(op, s, layout, dst), _ => Err(dtype_err(op, ALL_DTYPES, dtype)))
}
