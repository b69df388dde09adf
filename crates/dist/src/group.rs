//! Process groups: the collectives data parallelism needs, over any backend.
//!
//! [`ProcessGroup`] is the small interface DDP is written against. Its implementations:
//! - `NcclGroup` (`nccl` feature, CUDA tensors): NCCL on a communication stream, one thread or
//!   one process per GPU;
//! - [`LocalGroup`]: ranks that are threads of one process exchanging tensors through host
//!   memory, for any backend (CPU tests of everything above the collectives, and a fallback).
//!
//! Collectives are asynchronous: each returns a [`Work`] whose [`Work::wait`] hands back the
//! result, ordered before later work of the calling thread (for CUDA: the current stream waits
//! on the collective's event; the host does not block).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kiln_core::{Backend, DistErrorKind, Error, Result, Tensor};

/// A reduction of [`ProcessGroup::all_reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The mean over ranks.
    Avg,
}

/// A collective in flight; [`Work::wait`] returns its result.
pub struct Work<B: Backend> {
    wait: Box<dyn FnOnce() -> Result<Tensor<B>> + Send>,
}

impl<B: Backend> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Work")
    }
}

impl<B: Backend> Work<B> {
    /// A finished collective.
    pub fn ready(t: Tensor<B>) -> Self {
        Work {
            wait: Box::new(move || Ok(t)),
        }
    }
    /// A collective finished by `f`.
    pub fn from_fn(f: impl FnOnce() -> Result<Tensor<B>> + Send + 'static) -> Self {
        Work { wait: Box::new(f) }
    }
    /// The result, ordered before the calling thread's later work on its device.
    pub fn wait(self) -> Result<Tensor<B>> {
        (self.wait)()
    }
}

/// The collectives of one rank of a group. Every rank must issue the same collectives, on
/// tensors of the same shape and dtype, in the same order.
pub trait ProcessGroup<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The device this rank's tensors live on.
    fn device(&self) -> B::Device;
    /// Every rank gets the sum (or mean) of the ranks' `t`.
    fn all_reduce(&self, t: &Tensor<B>, op: ReduceOp) -> Result<Work<B>>;
    /// Every rank gets `root`'s `t`.
    fn broadcast(&self, t: &Tensor<B>, root: usize) -> Result<Work<B>>;
    /// The ranks' `t` stacked along a new leading axis, in rank order.
    fn all_gather(&self, t: &Tensor<B>) -> Result<Work<B>>;
    /// An error if the group failed (a peer died, a collective timed out); cheap, never blocks.
    fn check(&self) -> Result<()> {
        Ok(())
    }
    /// Waits on the host until every collective issued so far has finished (bounded by the
    /// group's timeout).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

// ---- LocalGroup ---------------------------------------------------------------------------

#[derive(Default)]
struct Round {
    data: Vec<Option<(Vec<f64>, Vec<usize>)>>,
    taken: usize,
}

struct Hub {
    world: usize,
    timeout: Duration,
    rounds: Mutex<(HashMap<u64, Round>, Vec<bool>)>,
    cv: Condvar,
}

/// A group whose ranks are threads of one process; tensors meet in host memory (as f64, so
/// sums are exact enough for any dtype kiln has). Works on every backend. Each collective
/// blocks until every rank has contributed, or errors after the timeout naming the ranks that
/// did not, or as soon as one of them has dropped its handle (a thread that ended).
pub struct LocalGroup<B: Backend> {
    hub: Arc<Hub>,
    rank: usize,
    seq: Mutex<u64>,
    device: B::Device,
}

impl<B: Backend> LocalGroup<B> {
    /// One handle per rank, rank `i` on `devices[i]`; give each to its thread.
    pub fn new(devices: &[B::Device], timeout: Duration) -> Vec<LocalGroup<B>> {
        let world = devices.len();
        let hub = Arc::new(Hub {
            world,
            timeout,
            rounds: Mutex::new((HashMap::new(), vec![true; world])),
            cv: Condvar::new(),
        });
        devices
            .iter()
            .enumerate()
            .map(|(rank, d)| LocalGroup {
                hub: hub.clone(),
                rank,
                seq: Mutex::new(0),
                device: d.clone(),
            })
            .collect()
    }

    /// Contributes `t` to this rank's next round and returns every rank's contribution.
    fn exchange(&self, op: &'static str, t: &Tensor<B>) -> Result<Vec<(Vec<f64>, Vec<usize>)>> {
        let seq = {
            let mut s = self.seq.lock().unwrap_or_else(|e| e.into_inner());
            *s += 1;
            *s
        };
        let mine = (t.to_f64_vec()?, t.dims().to_vec());
        let hub = &*self.hub;
        let start = Instant::now();
        let mut g = hub.rounds.lock().unwrap_or_else(|e| e.into_inner());
        {
            let round = g.0.entry(seq).or_insert_with(|| Round {
                data: vec![None; hub.world],
                taken: 0,
            });
            round.data[self.rank] = Some(mine);
        }
        hub.cv.notify_all();
        loop {
            let (rounds, alive) = &mut *g;
            let round = rounds
                .get_mut(&seq)
                .expect("present until every rank took it");
            let missing: Vec<usize> = (0..hub.world)
                .filter(|r| round.data[*r].is_none())
                .collect();
            if missing.is_empty() {
                let all = round.data.iter().map(|d| d.clone().unwrap()).collect();
                round.taken += 1;
                if round.taken == hub.world {
                    rounds.remove(&seq);
                }
                return Ok(all);
            }
            let dead: Vec<usize> = missing.iter().copied().filter(|r| !alive[*r]).collect();
            if !dead.is_empty() {
                return Err(Error::dist(
                    op,
                    DistErrorKind::PeerLost,
                    format!(
                        "rank {}: rank(s) {dead:?} left the group before collective #{seq}",
                        self.rank
                    ),
                ));
            }
            let Some(rem) = hub.timeout.checked_sub(start.elapsed()) else {
                return Err(Error::dist(
                    op,
                    DistErrorKind::Timeout,
                    format!(
                        "rank {}: rank(s) {missing:?} did not join collective #{seq} within {:.1} s",
                        self.rank,
                        hub.timeout.as_secs_f64()
                    ),
                ));
            };
            g = hub
                .cv
                .wait_timeout(g, rem)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn tensor(&self, v: &[f64], dims: Vec<usize>, like: &Tensor<B>) -> Result<Tensor<B>> {
        Tensor::<B>::from_slice(v, dims, &self.device)?.to_dtype(like.dtype())
    }
}

impl<B: Backend> Drop for LocalGroup<B> {
    fn drop(&mut self) {
        let mut g = self.hub.rounds.lock().unwrap_or_else(|e| e.into_inner());
        g.1[self.rank] = false;
        self.hub.cv.notify_all();
    }
}

impl<B: Backend> ProcessGroup<B> for LocalGroup<B> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.hub.world
    }
    fn device(&self) -> B::Device {
        self.device.clone()
    }
    fn all_reduce(&self, t: &Tensor<B>, op: ReduceOp) -> Result<Work<B>> {
        const OP: &str = "all_reduce";
        let all = self.exchange(OP, t)?;
        let n = all[0].0.len();
        if let Some((r, _)) = all.iter().enumerate().find(|(_, d)| d.1 != all[0].1) {
            return Err(Error::dist(
                OP,
                DistErrorKind::Mismatch,
                format!(
                    "rank {r} contributed shape {:?}, rank 0 shape {:?}",
                    all[r].1, all[0].1
                ),
            ));
        }
        let mut acc = vec![0.0; n];
        for (d, _) in &all {
            for (a, x) in acc.iter_mut().zip(d) {
                *a += x;
            }
        }
        if op == ReduceOp::Avg {
            let w = self.hub.world as f64;
            acc.iter_mut().for_each(|a| *a /= w);
        }
        Ok(Work::ready(self.tensor(&acc, all[0].1.clone(), t)?))
    }
    fn broadcast(&self, t: &Tensor<B>, root: usize) -> Result<Work<B>> {
        if root >= self.hub.world {
            return Err(Error::invalid(
                "broadcast",
                format!("root {root} is not below the world size {}", self.hub.world),
            ));
        }
        let all = self.exchange("broadcast", t)?;
        let (v, dims) = &all[root];
        Ok(Work::ready(self.tensor(v, dims.clone(), t)?))
    }
    fn all_gather(&self, t: &Tensor<B>) -> Result<Work<B>> {
        let all = self.exchange("all_gather", t)?;
        let mut dims = vec![self.hub.world];
        dims.extend_from_slice(&all[0].1);
        let v: Vec<f64> = all.into_iter().flat_map(|(v, _)| v).collect();
        Ok(Work::ready(self.tensor(&v, dims, t)?))
    }
}
