//! Helpers shared by this crate's integration tests (each test file includes it as
//! `mod common;`).

/// `Ok` when `got` and `want` have the same length and each pair is both NaN, equal (equal
/// infinities included), or within `atol + rtol * |want|`; otherwise the first difference.
pub fn close(got: &[f64], want: &[f64], atol: f64, rtol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} values, want {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan())
            || g == w
            || (g.is_finite() && w.is_finite() && (g - w).abs() <= atol + rtol * w.abs());
        if !ok {
            return Err(format!("element {i}: got {g}, want {w}"));
        }
    }
    Ok(())
}
