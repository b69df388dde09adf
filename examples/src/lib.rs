//! Shared support for kiln's examples: choosing the device at run time.
//!
//! A kiln program is generic over `B: Backend`, but the device comes from the command line as
//! a string (`cpu`, `cpu:1`, `cuda`, `cuda:1`). Something has to know every backend to turn
//! that string into a call of the generic code on the right one; the backends do not know each
//! other (each builds on kiln-core, not on the other: see the README's "Crates"), so it lives
//! here, where both are in view. The name itself is read by kiln-core's one parser,
//! [`DeviceSpec`].
//!
//! The program writes its body once as a [`Job`] and calls [`dispatch`]:
//!
//! ```no_run
//! use kiln_core::{Backend, DType, Result, Tensor};
//! use kiln_examples::{Job, dispatch};
//!
//! struct Hello;
//! impl Job for Hello {
//!     fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
//!         println!("{}", Tensor::<B>::ones([2, 2], DType::F32, &dev)?);
//!         Ok(())
//!     }
//! }
//!
//! fn main() -> Result<()> {
//!     dispatch("cuda", Hello) // on a machine without a GPU: a message, then the CPU
//! }
//! ```
//!
//! Asking for `cuda` or `cuda:N` follows Dive into Deep Learning's `try_gpu(i)`: when that GPU
//! is not there (no device, no driver, or fewer GPUs than `N + 1`), the program says so on
//! stderr (`no CUDA device found (<reason>); falling back to cpu`) and runs on the CPU, so one
//! command line works on every machine. A malformed name is an error, never a fallback.

pub mod gpt;
pub mod models;
pub mod resnet;

use std::fmt;

use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, CudaDevice};
use kiln_core::{Backend, DeviceKind, DeviceSpec, Result};

/// The body of a program, generic over the backend it runs on.
///
/// A trait rather than a closure because a closure cannot be generic over `B`.
pub trait Job {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()>;
}

/// A device that exists, on its backend: what a request resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolved {
    Cpu(<Cpu as Backend>::Device),
    Cuda(CudaDevice),
}

impl Resolved {
    /// Runs `job` on this device's backend.
    pub fn run(self, job: impl Job) -> Result<()> {
        match self {
            Resolved::Cpu(dev) => job.run::<Cpu>(dev),
            Resolved::Cuda(dev) => job.run::<Cuda>(dev),
        }
    }
}

impl fmt::Display for Resolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resolved::Cpu(d) => d.fmt(f),
            Resolved::Cuda(d) => d.fmt(f),
        }
    }
}

/// Where a device name led: the device, and why it is not the one asked for, if it is not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub device: Resolved,
    /// Set when a GPU was asked for and the CPU is used instead: the reason.
    pub fallback: Option<String>,
}

/// Kernel launches so far and the host nanoseconds spent inside `cuLaunchKernel` for them, when
/// `B` is the CUDA backend and `KILN_CUDA_LAUNCH_STATS=1`; `(0, 0)` otherwise.
pub fn launch_stats<B: Backend>() -> (u64, u64) {
    if B::NAME == "cuda" {
        kiln_backend_cuda::launch_stats()
    } else {
        (0, 0)
    }
}

/// The device's peak memory in use so far, in bytes, then the peak reset to the current use
/// where the backend can (CUDA), so that the next reading covers only what runs after: the
/// benchmarks read it after their warm-up, whose first steps hold transient buffers a steady
/// step does not (cuDNN's algorithm search times every algorithm with its largest workspace).
pub fn take_peak_memory<B: Backend>(dev: &B::Device) -> Result<usize> {
    let peak = B::memory_stats(dev)?.peak;
    if let Some(d) = (dev as &dyn std::any::Any).downcast_ref::<kiln_backend_cuda::CudaDevice>() {
        kiln_backend_cuda::reset_peak(d)?;
    }
    Ok(peak)
}

/// Fused elementwise programs built so far and the host nanoseconds spent compiling (or loading)
/// them, when `B` is the CUDA backend; `(0, 0)` otherwise.
pub fn fused_program_stats<B: Backend>() -> (u64, u64) {
    if B::NAME == "cuda" {
        kiln_backend_cuda::fused_program_stats()
    } else {
        (0, 0)
    }
}

/// Resolves a device name: the CPU device it names, or the GPU when present, else the CPU with
/// the reason recorded (d2l's `try_gpu(i)`). Errors for a malformed name or an out-of-range
/// CPU ordinal.
pub fn select(device: &str) -> Result<Selection> {
    let spec = DeviceSpec::parse(device)?;
    match spec.kind {
        DeviceKind::Cpu => Ok(Selection {
            device: Resolved::Cpu(<Cpu as Backend>::parse_device(&spec.to_string())?),
            fallback: None,
        }),
        DeviceKind::Cuda => match try_gpu(spec.ordinal) {
            Ok(device) => Ok(Selection {
                device,
                fallback: None,
            }),
            Err(reason) => Ok(Selection {
                device: Resolved::Cpu(<Cpu as Backend>::parse_device("cpu")?),
                fallback: Some(reason),
            }),
        },
    }
}

/// GPU `i`, or why it is not available.
fn try_gpu(i: usize) -> std::result::Result<Resolved, String> {
    if let Some(d) = kiln_backend_cuda::try_gpu(i) {
        return Ok(Resolved::Cuda(d));
    }
    Err(match kiln_backend_cuda::unavailable_reason() {
        Some(why) => why,
        None => format!(
            "cuda:{i} requested, {} GPU(s) present",
            kiln_backend_cuda::device_count()
        ),
    })
}

/// Parses `device`, prints a fallback message when a GPU was asked for but is missing, and
/// runs `job` on the chosen device's backend.
pub fn dispatch(device: &str, job: impl Job) -> Result<()> {
    let sel = select(device)?;
    if let Some(reason) = &sel.fallback {
        eprintln!(
            "no CUDA device found ({reason}); falling back to {}",
            sel.device
        );
    }
    sel.device.run(job)
}

/// Help text for a `--device` option.
pub const DEVICE_HELP: &str =
    "device to run on: cpu, cpu:N, cuda or cuda:N (falls back to cpu when no GPU is present)";

#[cfg(test)]
mod tests {
    use super::*;

    /// Records which backend and device it ran on.
    struct Probe<'a>(&'a mut Option<(String, String)>);
    impl Job for Probe<'_> {
        fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
            *self.0 = Some((B::NAME.to_string(), dev.to_string()));
            Ok(())
        }
    }

    fn ran_on(device: &str) -> Result<(String, String)> {
        let mut seen = None;
        dispatch(device, Probe(&mut seen))?;
        Ok(seen.expect("the job ran"))
    }

    #[test]
    fn cpu_names_run_on_the_cpu() {
        assert_eq!(ran_on("cpu").unwrap(), ("cpu".into(), "cpu".into()));
        assert_eq!(ran_on("cpu:1").unwrap(), ("cpu".into(), "cpu:1".into()));
        assert!(ran_on("cpu:100000").is_err());
        assert!(ran_on("tpu").is_err());
    }

    #[test]
    fn cuda_runs_on_a_gpu_or_falls_back_with_a_reason() {
        let sel = select("cuda:7").unwrap();
        let gpus = kiln_backend_cuda::device_count();
        if gpus > 7 {
            assert_eq!(sel.device.to_string(), "cuda:7");
        } else {
            // No GPU 7 here: the CPU, with the reason (no driver, no GPU, or too few).
            assert_eq!(sel.device.to_string(), "cpu");
            let reason = sel.fallback.as_deref().unwrap();
            match kiln_backend_cuda::unavailable_reason() {
                Some(why) => assert_eq!(reason, why),
                None => assert!(reason.contains("cuda:7") && reason.contains("present")),
            }
        }
        let (backend, dev) = ran_on("cuda").unwrap();
        if gpus == 0 {
            println!(
                "skipped the GPU half: no CUDA device ({})",
                sel.fallback.unwrap()
            );
            assert_eq!((backend.as_str(), dev.as_str()), ("cpu", "cpu"));
        } else {
            assert_eq!((backend.as_str(), dev.as_str()), ("cuda", "cuda:0"));
        }
    }
}

/// The `--precision` flag of the training examples (`mnist`, `bench_train`).
///
/// - `f32`: f32 everywhere, TF32 off (kiln's default, as PyTorch's).
/// - `tf32`: f32 storage, GPU products on TF32 tensor cores (`set_allow_tf32`); the CPU
///   computes in f32 (a note says so).
/// - `bf16`: the forward and the loss under `autocast(BF16)` (products in bf16, softmax,
///   losses and norms in f32; see `kiln_autograd::autocast`); f32 weights and optimizer; no
///   loss scaling (bf16 has f32's range).
/// - `f16`: the same under `autocast(F16)`, with a `kiln_optim::GradScaler` (f16's range
///   underflows small gradients): one host read of the overflow flag per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    F32,
    Tf32,
    Bf16,
    F16,
}

impl Precision {
    /// The autocast dtype of this precision, if any.
    pub fn autocast(self) -> Option<kiln_core::DType> {
        match self {
            Precision::Bf16 => Some(kiln_core::DType::BF16),
            Precision::F16 => Some(kiln_core::DType::F16),
            Precision::F32 | Precision::Tf32 => None,
        }
    }

    /// Whether the loss needs scaling (f16 only).
    pub fn needs_scaler(self) -> bool {
        self == Precision::F16
    }

    /// Sets the process-wide switches for backend `B`: `tf32` turns TF32 on for CUDA's f32
    /// products (other precisions leave the switch as it is); on another backend a `tf32`
    /// request is noted on stderr.
    pub fn apply<B: Backend>(self) {
        if self != Precision::Tf32 {
            return;
        }
        if B::NAME == "cuda" {
            kiln_backend_cuda::set_allow_tf32(true);
        } else {
            eprintln!(
                "note: --precision tf32 applies to GPU products only; the CPU computes in f32"
            );
        }
    }
}
