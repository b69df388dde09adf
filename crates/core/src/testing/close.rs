//! Tolerance comparisons for tests outside the suite: one rule for every crate's tests.

/// Whether `got` is within `atol + rtol·|want|` of `want`, element by element; two NaNs, or two
/// equal values (infinities included), count as close. `Err` names the first element that is
/// not, or the lengths when they differ.
///
/// ```
/// use kiln_core::testing::check_close;
///
/// assert!(check_close(&[1.0, f64::NAN], &[1.0 + 1e-9, f64::NAN], 0.0, 1e-6).is_ok());
/// let e = check_close(&[1.0, 2.5], &[1.0, 2.0], 1e-6, 1e-6).unwrap_err();
/// assert_eq!(e, "element 1: got 2.5, want 2");
/// ```
pub fn check_close(got: &[f64], want: &[f64], atol: f64, rtol: f64) -> Result<(), String> {
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

/// Panics, naming `what`, unless `got` is within `tol·(1 + |want|)` of `want` element by element
/// ([`check_close`] with `atol = rtol = tol`: relative for large values, absolute near zero).
///
/// ```
/// kiln_core::testing::assert_close("sum", &[3.0000001], &[3.0], 1e-6);
/// ```
#[track_caller]
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    if let Err(e) = check_close(got, want, tol, tol) {
        panic!("{what}: {e} (tolerance {tol:e})");
    }
}
