//! How results must agree: bit for bit, or within a tolerance that allows for rounding and for
//! any summation order ([`Tol`]), and the first mismatching element when they do not.

use super::*;

/// How outputs must agree.
#[derive(Clone, Debug)]
pub(super) enum Tol {
    /// Bit for bit (data movement).
    Bits,
    /// `|got - want| <= atol + rtol·|want| + k·ε·mag[i]`; NaN matches NaN; ints exact.
    Close {
        rtol: f64,
        atol: f64,
        k: f64,
        mag: Option<Vec<f64>>,
    },
}

/// The machine epsilon of `dtype` (f32's for the integers, which compare exactly anyway).
pub(super) fn eps(dtype: DType) -> f64 {
    match dtype.epsilon() {
        0.0 => f32::EPSILON as f64,
        e => e,
    }
}

pub(super) fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        if dims[i] > 0 {
            idx[i] = flat % dims[i];
            flat /= dims[i];
        }
    }
    idx
}

/// The first element of `g` whose bits differ from `w`'s (equal lengths), described with
/// both values and their bits as `hex_digits` hex digits.
fn bits_diff<T: Copy + std::fmt::Debug>(
    g: &[T],
    w: &[T],
    bits: fn(T) -> u64,
    hex_digits: usize,
    at: &dyn Fn(usize) -> String,
) -> Option<String> {
    (0..g.len()).find(|&i| bits(g[i]) != bits(w[i])).map(|i| {
        format!(
            "{}: got {:?} ({:#0width$x}), want {:?} ({:#0width$x}) bit for bit",
            at(i),
            g[i],
            bits(g[i]),
            w[i],
            bits(w[i]),
            width = hex_digits + 2
        )
    })
}

pub(super) fn compare_values(
    got: &HostBuffer,
    want: &HostBuffer,
    dims: &[usize],
    tol: &Tol,
) -> Check {
    if got.dtype() != want.dtype() || got.len() != want.len() {
        return Err(format!(
            "host buffer is {} x {}, expected {} x {}",
            got.len(),
            got.dtype(),
            want.len(),
            want.dtype()
        ));
    }
    let at = |i: usize| format!("element {i} (index {:?})", unravel(i, dims));
    let first_diff = |n: usize, same: &dyn Fn(usize) -> bool| (0..n).find(|&i| !same(i));
    let bad = match (got, want) {
        (HostBuffer::I64(g), HostBuffer::I64(w)) => first_diff(g.len(), &|i| g[i] == w[i])
            .map(|i| format!("{}: got {}, want {}", at(i), g[i], w[i])),
        (HostBuffer::U8(g), HostBuffer::U8(w)) => first_diff(g.len(), &|i| g[i] == w[i])
            .map(|i| format!("{}: got {}, want {}", at(i), g[i], w[i])),
        (HostBuffer::F32(g), HostBuffer::F32(w)) if matches!(tol, Tol::Bits) => {
            bits_diff(g, w, |x| x.to_bits().into(), 8, &at)
        }
        (HostBuffer::F64(g), HostBuffer::F64(w)) if matches!(tol, Tol::Bits) => {
            bits_diff(g, w, f64::to_bits, 16, &at)
        }
        (HostBuffer::F16(g), HostBuffer::F16(w)) if matches!(tol, Tol::Bits) => {
            bits_diff(g, w, |x| x.to_bits().into(), 4, &at)
        }
        (HostBuffer::BF16(g), HostBuffer::BF16(w)) if matches!(tol, Tol::Bits) => {
            bits_diff(g, w, |x| x.to_bits().into(), 4, &at)
        }
        _ => {
            let Tol::Close { rtol, atol, k, mag } = tol else {
                unreachable!("Bits handled above")
            };
            let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
            let e = eps(got.dtype());
            let t =
                |i: usize| atol + rtol * w[i].abs() + k * e * mag.as_ref().map_or(0.0, |m| m[i]);
            first_diff(g.len(), &|i| {
                let (g, w) = (g[i], w[i]);
                if w.is_nan() || g.is_nan() {
                    return w.is_nan() && g.is_nan();
                }
                if w.is_infinite() || g.is_infinite() {
                    return g == w;
                }
                (g - w).abs() <= t(i)
            })
            .map(|i| {
                format!(
                    "{}: got {:?}, want {:?} (|diff| {:.3e} > tolerance {:.3e})",
                    at(i),
                    g[i],
                    w[i],
                    (g[i] - w[i]).abs(),
                    t(i)
                )
            })
        }
    };
    match bad {
        None => Ok(()),
        Some(m) => Err(m),
    }
}
