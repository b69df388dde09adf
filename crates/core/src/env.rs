//! Settings read from the environment by more than one crate, parsed in one place so that
//! every reader applies the same rules and reports the same error.

use std::time::Duration;

use crate::error::{DistErrorKind, Error, Result};

/// The variable holding the timeout of distributed setup and collectives, in seconds.
pub const DIST_TIMEOUT_VAR: &str = "KILN_DIST_TIMEOUT_S";

/// The default timeout of distributed setup and of each collective, in seconds (like a
/// generous PyTorch `timeout`).
pub const DEFAULT_DIST_TIMEOUT_S: f64 = 300.0;

/// Parses a [`DIST_TIMEOUT_VAR`] value: seconds, fractions allowed; `None` (unset) gives
/// [`DEFAULT_DIST_TIMEOUT_S`]. An unparsable, infinite or non-positive value is a
/// [`DistErrorKind::Environment`] error naming the variable.
pub fn parse_dist_timeout(v: Option<&str>) -> Result<Duration> {
    let Some(v) = v else {
        return Ok(Duration::from_secs_f64(DEFAULT_DIST_TIMEOUT_S));
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err(Error::dist(
            DIST_TIMEOUT_VAR,
            DistErrorKind::Environment,
            format!("`{v}` is not a positive number of seconds"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dist_timeout() {
        assert_eq!(parse_dist_timeout(None).unwrap(), Duration::from_secs(300));
        assert_eq!(
            parse_dist_timeout(Some(" 2.5 ")).unwrap(),
            Duration::from_millis(2500)
        );
        for bad in ["", "0", "-1", "abc", "inf", "NaN"] {
            let e = parse_dist_timeout(Some(bad)).unwrap_err();
            assert_eq!(
                e.dist_kind(),
                Some(DistErrorKind::Environment),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(DIST_TIMEOUT_VAR), "{bad}: {e}");
        }
    }
}
