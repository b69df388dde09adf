//! Device names: the one parser of the strings a user writes for a device (`cpu`, `cuda:1`).
//!
//! Why in core: each backend's [`Backend::parse_device`](crate::Backend::parse_device) and every
//! program that picks its backend at run time (the examples' `--device`) read the same names.
//! One parser gives them one set of rules and one error, [`Error::BadDevice`], that names the
//! string.

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// The device family a name names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// `cpu`, `cpu:N`: the CPU backend's (virtual) devices.
    Cpu,
    /// `cuda`, `cuda:N`, or the synonyms `gpu`, `gpu:N`: NVIDIA GPUs.
    Cuda,
}

impl DeviceKind {
    /// The family's name as a device name displays it (`cpu`, `cuda`).
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// A parsed device name: a family and an ordinal, before any check that the device exists.
///
/// ```
/// use kiln_core::{DeviceKind, DeviceSpec};
///
/// assert_eq!(DeviceSpec::parse("cuda:1")?, DeviceSpec::new(DeviceKind::Cuda, 1));
/// assert_eq!(DeviceSpec::parse(" GPU ")?, DeviceSpec::new(DeviceKind::Cuda, 0));
/// assert_eq!(DeviceSpec::parse("cpu")?.to_string(), "cpu");
/// assert!(DeviceSpec::parse("tpu:0").is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    pub ordinal: usize,
}

/// What [`DeviceSpec::parse`] accepts, for messages.
const ANY_DEVICE: &str = "a device name (`cpu`, `cpu:N`, `cuda`, `cuda:N`, `gpu` or `gpu:N`)";

impl DeviceSpec {
    pub fn new(kind: DeviceKind, ordinal: usize) -> Self {
        DeviceSpec { kind, ordinal }
    }

    /// Parses `cpu`, `cpu:N`, `cuda`, `cuda:N`, `gpu` or `gpu:N` (`gpu` is `cuda`), ignoring
    /// ASCII case and surrounding whitespace; a bare family name is ordinal 0. `N` is decimal
    /// digits only. Anything else is [`Error::BadDevice`] naming the string.
    pub fn parse(name: &str) -> Result<DeviceSpec> {
        let bad = || Error::BadDevice {
            op: "parse_device",
            name: name.to_string(),
            expected: ANY_DEVICE,
        };
        let s = name.trim().to_ascii_lowercase();
        let (family, ordinal) = match s.split_once(':') {
            Some((family, n)) => {
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                (family, n.parse::<usize>().map_err(|_| bad())?)
            }
            None => (s.as_str(), 0),
        };
        let kind = match family {
            "cpu" => DeviceKind::Cpu,
            "cuda" | "gpu" => DeviceKind::Cuda,
            _ => return Err(bad()),
        };
        Ok(DeviceSpec { kind, ordinal })
    }

    /// [`DeviceSpec::parse`] for a backend of family `kind`: the ordinal, or
    /// [`Error::BadDevice`] when the name does not parse or names another family.
    pub fn parse_ordinal(name: &str, kind: DeviceKind) -> Result<usize> {
        let expected = match kind {
            DeviceKind::Cpu => "a CPU device (`cpu` or `cpu:N`)",
            DeviceKind::Cuda => "a CUDA device (`cuda`, `cuda:N`, `gpu` or `gpu:N`)",
        };
        match DeviceSpec::parse(name) {
            Ok(spec) if spec.kind == kind => Ok(spec.ordinal),
            _ => Err(Error::BadDevice {
                op: "parse_device",
                name: name.to_string(),
                expected,
            }),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DeviceSpec::parse(s)
    }
}

/// `cpu` for CPU 0 (how the CPU backend displays its default device), `cpu:N`, `cuda:N`.
impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, self.ordinal) {
            (DeviceKind::Cpu, 0) => f.write_str("cpu"),
            (kind, n) => write!(f, "{}:{n}", kind.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_set_of_rules() {
        let ok = [
            ("cpu", DeviceKind::Cpu, 0),
            ("cpu:2", DeviceKind::Cpu, 2),
            ("cuda", DeviceKind::Cuda, 0),
            ("cuda:0", DeviceKind::Cuda, 0),
            (" CUDA:3 ", DeviceKind::Cuda, 3),
            ("gpu", DeviceKind::Cuda, 0),
            ("gpu:1", DeviceKind::Cuda, 1),
        ];
        for (s, kind, n) in ok {
            assert_eq!(
                DeviceSpec::parse(s).unwrap(),
                DeviceSpec::new(kind, n),
                "{s}"
            );
        }
        for bad in [
            "",
            "tpu",
            "cuda:",
            "cuda:x",
            "cuda:-1",
            "cuda:+1",
            "cuda1",
            "cpu:1:2",
            "cuda :1",
            "cpu: 1",
            "gpu:99999999999999999999999",
        ] {
            let e = DeviceSpec::parse(bad).unwrap_err();
            assert!(
                matches!(&e, Error::BadDevice { name, .. } if name == bad),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
        assert_eq!(DeviceSpec::new(DeviceKind::Cuda, 0).to_string(), "cuda:0");
        assert_eq!(DeviceSpec::new(DeviceKind::Cpu, 0).to_string(), "cpu");
        assert_eq!(DeviceSpec::new(DeviceKind::Cpu, 3).to_string(), "cpu:3");
        assert_eq!(
            DeviceSpec::parse_ordinal("gpu:2", DeviceKind::Cuda).unwrap(),
            2
        );
        let e = DeviceSpec::parse_ordinal("cuda:0", DeviceKind::Cpu).unwrap_err();
        assert!(e.to_string().contains("not a CPU device"), "{e}");
    }
}
