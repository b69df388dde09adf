//! One epoch's iterator ([`Epoch`]): inline, with a worker thread that gathers on the host, or
//! with the device gathering from pinned memory; and the gate that orders one epoch's worker
//! after the previous one's.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use kiln_core::{Backend, Error, Result};

use super::gather::{Gathered, Group, Job, TensorBatch, Uploaded};

/// The batches of one epoch. See [`DataLoader`](crate::DataLoader).
pub struct Epoch<B: Backend> {
    pub(super) state: State<B>,
    /// Batches not yet yielded.
    pub(super) remaining: usize,
    pub(super) times: LoaderTimes,
    /// Opens when this epoch's worker has stopped gathering (done, stopped or failed); the
    /// next epoch's worker waits for it. `None` without a worker.
    pub(super) finished: Option<Arc<Gate>>,
}

/// A one-way gate between two workers: closed until [`Gate::open`].
#[derive(Default)]
pub(crate) struct Gate {
    pub(super) open: std::sync::Mutex<bool>,
    pub(super) changed: std::sync::Condvar,
}

impl Gate {
    pub(super) fn open(&self) {
        *self.open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.changed.notify_all();
    }
    /// Wakes the waiters without opening (they check `stop`).
    pub(super) fn wake(&self) {
        let _g = self.open.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }
    /// Waits until the gate opens (true) or `stop` is set (false).
    pub(super) fn wait(&self, stop: &AtomicBool) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if *open {
                return true;
            }
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            open = self.changed.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Opens its gate when dropped: a worker's exit, however it ends.
pub(super) struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Where the consuming thread's time in [`Epoch::next`] went so far ([`Epoch::times`]): when a
/// step is bound by the host (small models on a GPU), this is what prefetching cannot hide.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoaderTimes {
    /// Waiting for the worker thread's next gathered group of batches (the loader is behind).
    pub waiting: std::time::Duration,
    /// Turning gathered groups into tensors on the device (the upload calls).
    pub uploading: std::time::Duration,
    /// Uploads so far (one per group of batches, see [`DataLoader::upload_bytes`](crate::DataLoader::upload_bytes)).
    pub uploads: usize,
}

/// What the worker sends: a group and its rows gathered on the host.
pub(super) type Sent<B> = Result<(Group, Gathered<B>)>;

// One state per epoch: the size of the worker variant does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum State<B: Backend> {
    /// No worker: batches are made in `next()`, one at a time.
    Inline {
        job: Arc<Job<B>>,
        next: usize,
    },
    /// A worker thread gathers groups of batches on the host; `next()` uploads them, one
    /// group ahead.
    Worker {
        job: Arc<Job<B>>,
        rx: Option<Receiver<Sent<B>>>,
        handle: Option<JoinHandle<()>>,
        stop: Arc<AtomicBool>,
        /// The group being handed out.
        current: Option<Uploaded<B>>,
        /// The next group, already uploaded (its copy runs while the current one trains).
        ahead: Option<Result<Uploaded<B>>>,
        /// Groups not yet received from the worker.
        unreceived: usize,
        /// The previous epoch's gate this worker waits on (woken to stop it).
        after: Option<Arc<Gate>>,
    },
    /// The device gathers each group from the dataset's pinned arrays: `next()` launches the
    /// gathers itself, up to `prefetch` groups ahead of the one being handed out.
    Device {
        job: Arc<Job<B>>,
        groups: Vec<Group>,
        /// Groups launched so far.
        launched: usize,
        prefetch: usize,
        current: Option<Uploaded<B>>,
        ahead: VecDeque<Uploaded<B>>,
    },
    Done,
}

impl<B: Backend> Epoch<B> {
    pub(super) fn start(job: Job<B>, prefetch: usize, after: Option<Arc<Gate>>) -> Self {
        let remaining = job.num_batches;
        let job = Arc::new(job);
        let times = LoaderTimes::default();
        if job.host_rows.is_some() && job.device_gather && remaining > 0 {
            let groups = job.groups();
            return Epoch {
                state: State::Device {
                    job,
                    groups,
                    launched: 0,
                    prefetch,
                    current: None,
                    ahead: VecDeque::new(),
                },
                remaining,
                times,
                finished: None,
            };
        }
        if prefetch == 0 || remaining == 0 {
            return Epoch {
                state: State::Inline { job, next: 0 },
                remaining,
                times,
                finished: None,
            };
        }
        let groups = job.groups();
        let (tx, rx) = sync_channel(prefetch);
        let stop = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(Gate::default());
        let (worker_stop, worker_job) = (stop.clone(), job.clone());
        let (worker_after, worker_done) = (after.clone(), OpenOnDrop(finished.clone()));
        let unreceived = groups.len();
        let spawned = std::thread::Builder::new()
            .name("kiln-data-loader".into())
            .spawn(move || {
                let _done = worker_done;
                if worker_after.is_none_or(|g| g.wait(&worker_stop)) {
                    worker(&worker_job, &groups, tx, &worker_stop);
                }
            });
        let state = match spawned {
            Ok(handle) => State::Worker {
                job,
                rx: Some(rx),
                handle: Some(handle),
                stop,
                current: None,
                ahead: None,
                unreceived,
                after,
            },
            // No thread (resource limits): prepare batches inline instead.
            Err(_) => {
                finished.open();
                State::Inline { job, next: 0 }
            }
        };
        Epoch {
            state,
            remaining,
            times,
            finished: Some(finished),
        }
    }

    /// Batches left in this epoch.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// The consuming thread's time in the worker's groups so far (zero without a worker).
    pub fn times(&self) -> LoaderTimes {
        self.times
    }

    /// Stops the worker (if any) and waits for it; returns its panic message if it panicked.
    pub(super) fn shut_down(&mut self) -> Option<String> {
        let panic = self.stop_worker();
        if matches!(self.state, State::Worker { .. }) {
            self.state = State::Done;
        }
        panic
    }

    /// Stops and joins the worker thread (if any), leaving the state as it is; returns its
    /// panic message if it panicked.
    pub(super) fn stop_worker(&mut self) -> Option<String> {
        let State::Worker {
            rx,
            handle,
            stop,
            after,
            ..
        } = &mut self.state
        else {
            return None;
        };
        stop.store(true, Ordering::Relaxed);
        if let Some(g) = after {
            g.wake(); // a worker still waiting for the previous epoch's
        }
        // Dropping the receiver wakes a worker blocked in `send`, which then exits.
        drop(rx.take());
        handle.take().and_then(|h| h.join().err()).map(|p| {
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into())
        })
    }

    /// The worker's next group, uploaded; `None` when the worker ended without sending it,
    /// or, without `wait`, when it has not sent it yet.
    pub(super) fn receive(&mut self, wait: bool) -> Option<Result<Uploaded<B>>> {
        let State::Worker {
            job,
            rx,
            unreceived,
            ..
        } = &mut self.state
        else {
            return None;
        };
        let t = std::time::Instant::now();
        let rx = rx.as_ref()?;
        let gathered = if wait {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        let received = std::time::Instant::now();
        self.times.waiting += received - t;
        let (group, gathered) = match gathered? {
            Ok(g) => g,
            Err(e) => return Some(Err(e)),
        };
        *unreceived -= 1;
        let item = job.upload(gathered).map(|batch| Uploaded {
            batch: Some(batch),
            rows: job.rows(group),
            next: 0,
            row: 0,
        });
        self.times.uploading += received.elapsed();
        self.times.uploads += 1;
        Some(item)
    }

    /// The error for a worker that ended early (it panicked), after joining it.
    pub(super) fn worker_failed(&mut self) -> Error {
        let msg = self
            .stop_worker()
            .unwrap_or_else(|| "it stopped early".into());
        Error::backend(
            "DataLoader",
            format!("the loader's worker thread failed: {msg}"),
        )
    }

    /// The next batch from the worker's groups: moves to the next group when the current one
    /// is handed out, and uploads the group after it at once, so that its DMA overlaps the
    /// steps of this one.
    pub(super) fn next_from_worker(&mut self) -> Result<TensorBatch<B>> {
        let State::Worker { current, ahead, .. } = &mut self.state else {
            unreachable!("called in the worker state")
        };
        if current.as_ref().is_none_or(Uploaded::exhausted) {
            *current = None;
            let group = match ahead.take() {
                Some(g) => Some(g),
                None => self.receive(true),
            };
            let group = match group {
                Some(g) => g?,
                None => return Err(self.worker_failed()),
            };
            let State::Worker { current, .. } = &mut self.state else {
                unreachable!("still in the worker state")
            };
            *current = Some(group);
        }
        let State::Worker {
            current,
            unreceived,
            ahead,
            ..
        } = &mut self.state
        else {
            unreachable!("still in the worker state")
        };
        let batch = current.as_mut().expect("set above").take();
        if batch.is_ok() && ahead.is_none() && *unreceived > 0 {
            // Upload the next group now if the worker has it; if not, the training thread does
            // not wait here: the group is taken (waiting then) when it is due. A worker that
            // ended early is reported then too.
            let next = self.receive(false);
            if let State::Worker { ahead, .. } = &mut self.state {
                *ahead = next;
            }
        }
        batch
    }

    /// The next batch gathered by the device: moves to the next group when the current one is
    /// handed out, and keeps `prefetch` groups launched beyond it, so that their gathers run
    /// on the copy stream while this group trains.
    pub(super) fn next_from_device(&mut self) -> Result<TensorBatch<B>> {
        let State::Device {
            job,
            groups,
            launched,
            prefetch,
            current,
            ahead,
        } = &mut self.state
        else {
            unreachable!("called in the device state")
        };
        let t = std::time::Instant::now();
        let times = &mut self.times;
        let mut launch = |launched: &mut usize| -> Result<Uploaded<B>> {
            let g = groups[*launched];
            *launched += 1;
            times.uploads += 1;
            job.gather_on_device(g)
        };
        if current.as_ref().is_none_or(Uploaded::exhausted) {
            *current = None;
            *current = Some(match ahead.pop_front() {
                Some(u) => u,
                None => launch(launched)?,
            });
        }
        let batch = current.as_mut().expect("set above").take();
        while ahead.len() < *prefetch && *launched < groups.len() {
            ahead.push_back(launch(launched)?);
        }
        self.times.uploading += t.elapsed();
        batch
    }
}

/// Gathers the epoch's groups of batches in order on the host (no driver calls: they stay on
/// the consuming thread, which launches the training step's kernels anyway).
pub(super) fn worker<B: Backend>(
    job: &Job<B>,
    groups: &[Group],
    tx: SyncSender<Sent<B>>,
    stop: &AtomicBool,
) {
    for &g in groups {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let item = job.gather(g).map(|gathered| (g, gathered));
        let failed = item.is_err();
        // A send error means the consumer is gone: stop quietly.
        if tx.send(item).is_err() || failed {
            return;
        }
    }
}

impl<B: Backend> Iterator for Epoch<B> {
    type Item = Result<TensorBatch<B>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            self.shut_down();
            return None;
        }
        let item = match &mut self.state {
            State::Done => return None,
            State::Inline { job, next } => {
                let g = Group {
                    start: *next,
                    end: *next + 1,
                };
                let item = job.gather(g).and_then(|g| job.upload(g));
                *next += 1;
                item
            }
            State::Worker { .. } => self.next_from_worker(),
            State::Device { .. } => self.next_from_device(),
        };
        self.remaining -= 1;
        if item.is_err() {
            // The first error ends the epoch.
            self.remaining = 0;
            self.shut_down();
            self.state = State::Done;
        }
        Some(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining))
    }
}

impl<B: Backend> Drop for Epoch<B> {
    fn drop(&mut self) {
        self.shut_down();
    }
}
