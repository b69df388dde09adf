//! # kiln-dist
//!
//! Training on several devices, above kiln-autograd and kiln-nn, generic over the backend:
//!
//! - [`env`](mod@env): a process's place from the launcher's variables (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or Slurm's), so kiln programs run under
//!   `torchrun --no-python`, `srun`, or kiln's launcher ([`launch`]);
//! - [`rendezvous`]: rank 0 hands out NCCL's id over TCP, with a deadline and errors naming
//!   the missing rank; the links stay open to notice a dead peer at once;
//! - [`group`]: the [`ProcessGroup`] trait (all-reduce, broadcast, all-gather, asynchronous
//!   [`Work`]) with [`LocalGroup`] (threads, any backend) and, with the `nccl` feature,
//!   [`NcclGroup`] (CUDA, NCCL on a communication stream, watchdog and abort);
//! - [`ddp`]: PyTorch DDP's data parallelism ([`Ddp`]): parameters broadcast from rank 0,
//!   gradients averaged in ~25 MB buckets launched by gradient hooks while backward runs,
//!   `no_sync`, an error for a parameter without a gradient;
//! - [`chainer`]: Chainer's master/replica data parallelism (`accumulate_grads_from`,
//!   `copy_parameters_from`);
//! - [`launch`]: kiln's launcher, one process per GPU, ending the survivors when one fails.
//!
//! Failures end in [`kiln_core::Error::Distributed`] (with a [`kiln_core::DistErrorKind`])
//! within the timeout `KILN_DIST_TIMEOUT_S` (seconds, default 300), never in a hang. NVLink
//! multicast stays off: the launcher sets [`env::NVLS_OFF`] for every process it starts.

pub mod chainer;
pub mod ddp;
pub mod env;
pub mod group;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rendezvous;

pub use chainer::{accumulate_grads_from, copy_parameters_from, scale_grads};
pub use ddp::{Ddp, DdpConfig, all_reduce_grads, assign_buckets};
pub use env::DistEnv;
pub use group::{LocalGroup, ProcessGroup, ReduceOp, Work};
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;
