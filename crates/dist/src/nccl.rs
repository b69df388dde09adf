//! The NCCL process group for CUDA tensors: [`NcclGroup`] implements [`ProcessGroup`] for
//! `kiln_backend_cuda::Cuda` with `kiln_backend_cuda::NcclComm`.
//!
//! This module names a concrete backend, which kiln's crates above the backends otherwise do
//! not: the process-group trait is generic, and its NCCL implementation has to live where both
//! the trait and the CUDA backend are in view. It is behind the `nccl` feature (on by default;
//! it builds without CUDA or NCCL, both loaded at run time).

use std::sync::Arc;

use kiln_backend_cuda::{Cuda, CudaDevice, NcclComm, NcclId, NcclReduceOp};
use kiln_core::{DistErrorKind, Error, Result, Tensor};

use crate::env::DistEnv;
use crate::group::{ProcessGroup, ReduceOp, Work};
use crate::rendezvous::{Links, rendezvous};

/// One rank of an NCCL communicator (see [`NcclGroup::from_env`], [`NcclGroup::init_all`]).
pub struct NcclGroup {
    comm: Arc<NcclComm>,
    links: Option<Links>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup({:?})", self.comm)
    }
}

impl NcclGroup {
    /// The process-per-GPU form: this process is `env.rank` of `env.world_size` on GPU
    /// `env.local_rank`. Rank 0 makes NCCL's id and hands it out over the TCP rendezvous;
    /// every rank then joins the communicator. The rendezvous links stay open: a peer
    /// process that dies aborts the communicator at once with an error naming that rank.
    ///
    /// The GPU is `cuda:LOCAL_RANK`, or `cuda:0` when the process sees exactly one GPU (a
    /// launcher that binds one GPU per task through `CUDA_VISIBLE_DEVICES`, as `srun` can).
    pub fn from_env(env: &DistEnv) -> Result<NcclGroup> {
        let ordinal = if kiln_backend_cuda::device_count() == 1 {
            0
        } else {
            env.local_rank
        };
        let dev = kiln_backend_cuda::try_gpu(ordinal).ok_or_else(|| {
            Error::dist(
                "NcclGroup::from_env",
                DistErrorKind::Environment,
                format!(
                    "LOCAL_RANK {} has no GPU: {} CUDA device(s) visible",
                    env.local_rank,
                    kiln_backend_cuda::device_count()
                ),
            )
        })?;
        let (id, links) = rendezvous(env, || Ok(NcclId::new()?.0.to_vec()))?;
        let id: [u8; 128] = id.try_into().map_err(|v: Vec<u8>| {
            Error::dist(
                "rendezvous",
                DistErrorKind::Rendezvous,
                format!("rank 0 sent {} bytes, not a 128-byte NCCL id", v.len()),
            )
        })?;
        let comm = Arc::new(NcclComm::init_rank_timeout(
            &dev,
            &NcclId(id),
            env.rank,
            env.world_size,
            env.timeout,
        )?);
        let weak = Arc::downgrade(&comm);
        links.watch(move |_peer, msg| {
            if let Some(c) = weak.upgrade() {
                c.abort_with(DistErrorKind::PeerLost, &msg);
            }
        });
        Ok(NcclGroup {
            comm,
            links: Some(links),
        })
    }

    /// The thread-per-GPU form: one group per device of one process (`ncclCommInitAll`);
    /// element `i` is rank `i` on `devs[i]`. Give each to its own thread.
    pub fn init_all(devs: &[CudaDevice]) -> Result<Vec<NcclGroup>> {
        Ok(NcclComm::init_all(devs)?
            .into_iter()
            .map(|c| NcclGroup {
                comm: Arc::new(c),
                links: None,
            })
            .collect())
    }

    pub fn comm(&self) -> &NcclComm {
        &self.comm
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // Finish this rank's collectives before telling the peers that it leaves cleanly.
        let _ = self.comm.synchronize();
        if let Some(l) = &self.links {
            l.goodbye();
        }
    }
}

fn work(c: kiln_backend_cuda::Collective) -> Work<Cuda> {
    Work::from_fn(move || c.wait())
}

impl ProcessGroup<Cuda> for NcclGroup {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn device(&self) -> CudaDevice {
        self.comm.device()
    }
    fn all_reduce(&self, t: &Tensor<Cuda>, op: ReduceOp) -> Result<Work<Cuda>> {
        let op = match op {
            ReduceOp::Sum => NcclReduceOp::Sum,
            ReduceOp::Avg => NcclReduceOp::Avg,
        };
        self.comm.all_reduce(t, op).map(work)
    }
    fn broadcast(&self, t: &Tensor<Cuda>, root: usize) -> Result<Work<Cuda>> {
        self.comm.broadcast(t, root).map(work)
    }
    fn all_gather(&self, t: &Tensor<Cuda>) -> Result<Work<Cuda>> {
        self.comm.all_gather(t).map(work)
    }
    fn check(&self) -> Result<()> {
        self.comm.check()
    }
    fn synchronize(&self) -> Result<()> {
        self.comm.synchronize()
    }
}
