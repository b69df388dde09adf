//! The backend marker [`Cpu`] and its virtual devices, at the bottom of the crate so that any
//! module can name them without importing the crate root (which implements `Backend` for
//! [`Cpu`] by calling down into the modules).
//!
//! Every CPU device shares host memory, yet `cpu:0` and `cpu:1` are distinct devices: an op
//! that mixes them is a device-mismatch error and moving data between them is an explicit copy.
//! That lets model-parallel code and the device rules be exercised in CI without a GPU.

use std::fmt;

use kiln_core::{DeviceKind, DeviceSpec, Error, Result};

/// The CPU backend. See the crate docs; its `Backend` implementation is in the crate root.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cpu;

impl Cpu {
    /// `cpu:n` (`cpu` for 0).
    ///
    /// # Panics
    /// When `n >= MAX_CPU_DEVICES`; use [`CpuDevice::new`] for a fallible version.
    pub fn device(n: usize) -> CpuDevice {
        CpuDevice::new(n).expect("CPU device ordinal out of range")
    }
}

/// The highest virtual ordinal plus one (`cpu:0` .. `cpu:63`).
pub const MAX_CPU_DEVICES: usize = 64;

/// One virtual CPU device. `Display` gives `cpu` for ordinal 0 and `cpu:N` otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuDevice {
    ordinal: usize,
}

impl CpuDevice {
    /// `cpu:ordinal`; an error when `ordinal >= MAX_CPU_DEVICES`.
    pub fn new(ordinal: usize) -> Result<Self> {
        if ordinal >= MAX_CPU_DEVICES {
            return Err(Error::invalid(
                "cpu device",
                format!(
                    "ordinal {ordinal} is out of range (virtual CPU devices are cpu:0..cpu:{})",
                    MAX_CPU_DEVICES - 1
                ),
            ));
        }
        Ok(CpuDevice { ordinal })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Parses `cpu` or `cpu:N` by kiln-core's one device-name parser
    /// ([`DeviceSpec::parse`](kiln_core::DeviceSpec::parse): ASCII case and surrounding
    /// whitespace ignored); another family's name is [`Error::BadDevice`](kiln_core::Error).
    pub fn parse(name: &str) -> Result<Self> {
        CpuDevice::new(DeviceSpec::parse_ordinal(name, DeviceKind::Cpu)?)
    }
}

impl fmt::Display for CpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ordinal == 0 {
            f.write_str("cpu")
        } else {
            write!(f, "cpu:{}", self.ordinal)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display() {
        assert_eq!(CpuDevice::parse("cpu").unwrap().to_string(), "cpu");
        assert_eq!(CpuDevice::parse("cpu:0").unwrap().to_string(), "cpu");
        assert_eq!(CpuDevice::parse("cpu:3").unwrap().to_string(), "cpu:3");
        for bad in [
            "", "gpu", "cuda:0", "cpu:", "cpu:x", "cpu1", "cpu:-1", "cpu:64", "cpu: 1",
        ] {
            let e = CpuDevice::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("parse_device") || e.contains("cpu device"),
                "{bad}: {e}"
            );
        }
    }
}
