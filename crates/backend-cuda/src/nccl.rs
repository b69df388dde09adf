//! NCCL collectives between GPUs (cudarc's `nccl` module, loaded at run time like the rest of
//! CUDA: the crate builds and runs without NCCL; [`nccl_version`] says whether it is there).
//!
//! A [`NcclComm`] is one rank of a communicator, bound to one GPU. It is created from a
//! [`NcclId`] that every rank shares (rank 0 makes it with [`NcclId::new`] and hands it to the
//! others: over TCP in `kiln-dist`, or by cloning it to threads), or for one process driving
//! several GPUs with [`NcclComm::init_all`].
//!
//! **Streams.** Each communicator has its own *communication stream* on its GPU. A collective
//! is ordered after the work that the calling thread's current stream has queued so far (an
//! event), runs on the communication stream, and returns a [`Collective`]: the output tensor
//! plus the event that marks its end. [`Collective::wait`] makes the caller's current stream
//! wait for it (the host does not block), so the compute stream keeps running ahead while the
//! transfer overlaps it — what DDP needs to overlap gradient all-reduce with backward.
//! Every buffer a collective reads or writes is recorded on the communication stream, so the
//! allocator does not reuse it before the collective has passed.
//!
//! **Failures never hang.** Communicators made by [`NcclComm::init_rank`] are *non-blocking*
//! (NCCL's `blocking = 0` config): setup and every call return at once and are polled with
//! `ncclCommGetAsyncError` against a deadline. A watchdog thread per communicator (PyTorch's
//! NCCL watchdog) follows every collective in flight; when one has not finished within the
//! timeout, or NCCL reports an asynchronous error (a peer that died, a network failure), it
//! calls `ncclCommAbort`, which ends the stuck kernels, so streams waiting on them move on;
//! the communicator is marked aborted and every later call — and [`NcclComm::check`] — returns
//! an [`Error::Distributed`] naming the collective, the rank and the cause.
//! The timeout is `KILN_DIST_TIMEOUT_S` seconds (default 300, like a generous PyTorch
//! `timeout`; tests set a few seconds), or [`NcclComm::set_timeout`].
//!
//! **Few CTAs.** kiln's collectives are meant to run beside compute (DDP reduces a bucket
//! while backward computes the next gradients), and every thread block NCCL runs is one a GEMM
//! cannot use. Communicators are therefore created with at most [`DEFAULT_MAX_CTAS`] CTAs
//! (NCCL's `maxCTAs` config) unless `NCCL_MAX_CTAS` is set, which then applies as usual.
//! Measured on 2 H200s (NVLink), DDP of a 784-4096x3-10 MLP: NCCL's default 18.87 ms a step,
//! 1 CTA 20.31, 2 18.64, 4 18.47, 8 18.40. A collective that nothing overlaps may be slower
//! with 8 than with NCCL's default (set `NCCL_MAX_CTAS` for such work).
//!
//! Multicast (NVLS) is never used: kiln does not call `cuMulticastCreate`, and launchers set
//! `NCCL_NVLS_ENABLE=0`.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::nccl::sys as nsys;
use kiln_core::{DType, DistErrorKind, Error, Result, Tensor};

use crate::storage::CudaStorage;
use crate::stream::{Event, Stream};
use crate::types::{Cuda, CudaDevice};

/// The most CTAs (thread blocks) a kiln communicator's collectives use, unless the
/// environment sets `NCCL_MAX_CTAS` (see the module docs).
pub const DEFAULT_MAX_CTAS: i32 = 8;

/// The default timeout of a collective and of communicator setup, in seconds, and the parser
/// of `KILN_DIST_TIMEOUT_S` (one definition in kiln-core, shared with kiln-dist).
pub use kiln_core::env::{
    DEFAULT_DIST_TIMEOUT_S as DEFAULT_TIMEOUT_S, parse_dist_timeout as parse_timeout,
};

/// The timeout from `KILN_DIST_TIMEOUT_S` (seconds, fractions allowed; default
/// [`DEFAULT_TIMEOUT_S`]). An unparsable or non-positive value is an error naming it.
pub fn timeout_from_env() -> Result<Duration> {
    parse_timeout(
        std::env::var(kiln_core::env::DIST_TIMEOUT_VAR)
            .ok()
            .as_deref(),
    )
}

/// NCCL's version as `major * 10000 + minor * 100 + patch` (e.g. 22703), or an error saying
/// that libnccl could not be loaded.
pub fn nccl_version() -> Result<i32> {
    static V: OnceLock<std::result::Result<i32, String>> = OnceLock::new();
    V.get_or_init(|| {
        // SAFETY: only tries to dlopen libnccl by its candidate names.
        if !unsafe { nsys::is_culib_present() } {
            return Err(
                "libnccl not found: cudarc loads `libnccl.so` (or `libnccl.so.<CUDA major>`); \
                 where only `libnccl.so.2` is installed, link `libnccl.so` to it in a directory \
                 on LD_LIBRARY_PATH (bench/multi_gpu.sh does)"
                    .into(),
            );
        }
        let mut v = 0;
        // SAFETY: valid out-pointer; the library is present.
        let r = unsafe { nsys::ncclGetVersion(&mut v) };
        if r != nsys::ncclResult_t::ncclSuccess {
            return Err(format!("ncclGetVersion failed: {}", err_string(r)));
        }
        Ok(v)
    })
    .clone()
    .map_err(|e| Error::dist("nccl", DistErrorKind::Library, e))
}

fn err_string(r: nsys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static string for any result code.
    let p = unsafe { nsys::ncclGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: a NUL-terminated static string from NCCL.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    format!("{r:?} ({})", s.to_string_lossy())
}

fn kind_of(r: nsys::ncclResult_t) -> DistErrorKind {
    match r {
        nsys::ncclResult_t::ncclRemoteError | nsys::ncclResult_t::ncclSystemError => {
            DistErrorKind::PeerLost
        }
        _ => DistErrorKind::Library,
    }
}

/// NCCL's unique id: 128 opaque bytes that every rank of one communicator must share.
#[derive(Clone, Copy)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x?}..)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id (rank 0 makes it and publishes it to the others).
    pub fn new() -> Result<NcclId> {
        nccl_version()?;
        let mut id = nsys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: valid out-pointer; the library is present.
        let r = unsafe { nsys::ncclGetUniqueId(&mut id) };
        if r != nsys::ncclResult_t::ncclSuccess {
            return Err(Error::dist("ncclGetUniqueId", kind_of(r), err_string(r)));
        }
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }
    fn raw(&self) -> nsys::ncclUniqueId {
        nsys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// A reduction of [`NcclComm::all_reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The mean over ranks (NCCL's `ncclAvg`, one pass).
    Avg,
    Max,
    Min,
}

impl ReduceOp {
    fn raw(self) -> nsys::ncclRedOp_t {
        match self {
            ReduceOp::Sum => nsys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => nsys::ncclRedOp_t::ncclAvg,
            ReduceOp::Max => nsys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => nsys::ncclRedOp_t::ncclMin,
        }
    }
}

fn nccl_dtype(op: &'static str, d: DType) -> Result<nsys::ncclDataType_t> {
    Ok(match d {
        DType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DType::F64 => nsys::ncclDataType_t::ncclFloat64,
        // NCCL reduces 16-bit floats in 16 bits (as PyTorch's DDP does for 16-bit gradients).
        DType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DType::BF16 => nsys::ncclDataType_t::ncclBfloat16,
        DType::I64 => nsys::ncclDataType_t::ncclInt64,
        DType::U8 => nsys::ncclDataType_t::ncclUint8,
        #[allow(unreachable_patterns)]
        other => {
            return Err(Error::DTypeMismatch {
                op,
                expected: "f32, f64, f16, bf16, i64 or u8".into(),
                got: other,
            });
        }
    })
}

/// State shared by a communicator, its collectives and its watchdog.
struct Shared {
    comm: Mutex<CommHandle>,
    aborted: AtomicBool,
    /// Why the communicator was aborted (first cause wins).
    cause: Mutex<Option<(DistErrorKind, String)>>,
    timeout_ms: AtomicU64,
    rank: usize,
    world: usize,
    dev: CudaDevice,
}

struct CommHandle(nsys::ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread; calls on it are serialized by the
// mutex except ncclCommGetAsyncError/ncclCommAbort, which NCCL allows concurrently.
unsafe impl Send for CommHandle {}

impl Shared {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }
    fn where_(&self) -> String {
        format!("rank {} of {} on {}", self.rank, self.world, self.dev)
    }
    /// An error if the communicator was aborted.
    fn alive(&self, op: &'static str) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            let cause = self.cause.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let (kind, why) = cause.unwrap_or((DistErrorKind::Aborted, "aborted".into()));
            return Err(Error::dist(
                op,
                kind,
                format!("{} (the communicator was aborted: {why})", self.where_()),
            ));
        }
        Ok(())
    }
    /// Runs `f` on the live communicator handle, under the lock that `abort` also takes, so a
    /// handle is never used after the watchdog freed it.
    fn with_comm<R>(&self, op: &'static str, f: impl FnOnce(nsys::ncclComm_t) -> R) -> Result<R> {
        let c = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if c.0.is_null() {
            drop(c);
            self.alive(op)?;
            return Err(Error::dist(
                op,
                DistErrorKind::Aborted,
                format!("{}: the communicator is gone", self.where_()),
            ));
        }
        Ok(f(c.0))
    }
    /// Aborts the communicator once, remembering why.
    fn abort(&self, kind: DistErrorKind, why: String) {
        {
            let mut c = self.cause.lock().unwrap_or_else(|e| e.into_inner());
            if c.is_none() {
                *c = Some((kind, why));
            }
        }
        self.aborted.store(true, Ordering::Release);
        let mut c = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if !c.0.is_null() {
            // SAFETY: a live communicator (non-null under the lock). ncclCommAbort ends
            // pending operations and frees it; the handle is nulled so nothing uses it again.
            unsafe { nsys::ncclCommAbort(c.0) };
            c.0 = std::ptr::null_mut();
        }
    }
    /// The clean shutdown, which every rank reaches: `ncclCommFinalize` (collective: it flushes
    /// this rank's work and waits, bounded by the timeout, until the peers finalize too), then
    /// `ncclCommDestroy`. Freeing a communicator while a peer on the same node still runs (an
    /// abort right away) can free buffers that peer's proxy thread still reads, which crashed
    /// the surviving process (SIGSEGV) on 2 H200s. On an error or the timeout: abort.
    fn finalize(&self) {
        const OP: &str = "NcclComm::drop (ncclCommFinalize)";
        // SAFETY: a live communicator (`with_comm`); finalizing it is a documented call.
        let Ok(r) = self.with_comm(OP, |c| unsafe { nsys::ncclCommFinalize(c) }) else {
            return;
        };
        if self.call(OP, r).is_err() {
            self.abort(DistErrorKind::Aborted, "ncclCommFinalize failed".into());
            return;
        }
        let mut c = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if !c.0.is_null() {
            // SAFETY: a live, finalized communicator; nulled so nothing uses it again.
            unsafe { nsys::ncclCommDestroy(c.0) };
            c.0 = std::ptr::null_mut();
        }
    }
    /// NCCL's asynchronous error state: `Ok(true)` when idle/ready, `Ok(false)` while an
    /// operation is still in progress (non-blocking communicators), an error otherwise.
    fn poll(&self, op: &'static str) -> Result<bool> {
        self.alive(op)?;
        let mut st = nsys::ncclResult_t::ncclSuccess;
        let r = self.with_comm(op, |c| {
            // SAFETY: a live communicator (`with_comm`), valid out-pointer.
            unsafe { nsys::ncclCommGetAsyncError(c, &mut st) }
        })?;
        if r != nsys::ncclResult_t::ncclSuccess {
            return Err(Error::dist(op, kind_of(r), err_string(r)));
        }
        match st {
            nsys::ncclResult_t::ncclSuccess => Ok(true),
            nsys::ncclResult_t::ncclInProgress => Ok(false),
            e => {
                let why = format!("NCCL reported {}", err_string(e));
                self.abort(kind_of(e), why.clone());
                Err(Error::dist(
                    op,
                    kind_of(e),
                    format!("{}: {why}", self.where_()),
                ))
            }
        }
    }
    /// Waits (polling) until a non-blocking call has completed; aborts at the deadline.
    fn wait_ready(&self, op: &'static str) -> Result<()> {
        let start = Instant::now();
        let timeout = self.timeout();
        loop {
            if self.poll(op)? {
                return Ok(());
            }
            if start.elapsed() > timeout {
                let why = format!(
                    "{op} did not complete within {:.1} s (KILN_DIST_TIMEOUT_S); a peer rank may be \
                     missing or dead",
                    timeout.as_secs_f64()
                );
                self.abort(DistErrorKind::Timeout, why.clone());
                return Err(Error::dist(
                    op,
                    DistErrorKind::Timeout,
                    format!("{}: {why}", self.where_()),
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    /// Checks the result of an NCCL call on this communicator (in-progress → wait).
    fn call(&self, op: &'static str, r: nsys::ncclResult_t) -> Result<()> {
        match r {
            nsys::ncclResult_t::ncclSuccess => Ok(()),
            nsys::ncclResult_t::ncclInProgress => self.wait_ready(op),
            e => {
                // An argument error leaves the communicator usable; anything else does not.
                if !matches!(
                    e,
                    nsys::ncclResult_t::ncclInvalidArgument | nsys::ncclResult_t::ncclInvalidUsage
                ) {
                    self.abort(kind_of(e), format!("{op} failed: {}", err_string(e)));
                }
                Err(Error::dist(
                    op,
                    kind_of(e),
                    format!("{}: {}", self.where_(), err_string(e)),
                ))
            }
        }
    }
}

/// A collective the watchdog follows until its event completes.
struct Watched {
    op: &'static str,
    event: Arc<Event>,
    start: Instant,
}

/// One rank of an NCCL communicator, bound to one GPU, with its communication stream and
/// watchdog. `Send + Sync`; collectives on one communicator are issued in the order of the
/// calls (every rank must issue the same collectives in the same order, as with any NCCL
/// communicator).
pub struct NcclComm {
    shared: Arc<Shared>,
    stream: Stream,
    watch: Mutex<Option<mpsc::Sender<Watched>>>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    /// One rank per process (`init_rank`): dropped with finalize + destroy, in step with the
    /// peers. Communicators of one process (`init_all`) are aborted: their drops run one
    /// after another, so a collective finalize would wait for a peer dropped later.
    finalize_on_drop: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm({})", self.shared.where_())
    }
}

fn undef_config() -> nsys::ncclConfig_t {
    // NCCL_CONFIG_INITIALIZER: size, magic, version, then every field "undefined" (INT_MIN or
    // NULL). NCCL copies min(size, its own sizeof) bytes, so a newer header than the library
    // is fine (see NCCL's parseCommConfig).
    const UNDEF: i32 = i32::MIN;
    nsys::ncclConfig_t {
        size: std::mem::size_of::<nsys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// A communicator's config: NCCL's defaults, `blocking` as given, and at most
/// [`DEFAULT_MAX_CTAS`] CTAs unless `NCCL_MAX_CTAS` is set.
fn comm_config(blocking: bool) -> nsys::ncclConfig_t {
    let mut cfg = undef_config();
    cfg.blocking = i32::from(blocking);
    if std::env::var_os("NCCL_MAX_CTAS").is_none() {
        cfg.maxCTAs = DEFAULT_MAX_CTAS;
    }
    cfg
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world` on `dev` (`ncclCommInitRankConfig`,
    /// non-blocking). Every rank must call this; it returns when all have joined, or an error
    /// after the timeout ([`timeout_from_env`]) naming the rank that waited.
    pub fn init_rank(dev: &CudaDevice, id: &NcclId, rank: usize, world: usize) -> Result<NcclComm> {
        Self::init_rank_timeout(dev, id, rank, world, timeout_from_env()?)
    }

    /// [`NcclComm::init_rank`] with an explicit timeout.
    pub fn init_rank_timeout(
        dev: &CudaDevice,
        id: &NcclId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        const OP: &str = "ncclCommInitRank";
        nccl_version()?;
        if world == 0 || rank >= world {
            return Err(Error::invalid(
                OP,
                format!("rank {rank} is not below the world size {world}"),
            ));
        }
        // Binds the device's context to this thread (NCCL picks the current device).
        let stream = Stream::with_priority(dev, -1)?;
        let mut cfg = comm_config(false);
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; the id is 128 bytes; the device's context is
        // current on this thread (bound by `Stream::with_priority`).
        let r = unsafe {
            nsys::ncclCommInitRankConfig(&mut comm, world as i32, id.raw(), rank as i32, &mut cfg)
        };
        let shared = Arc::new(Shared {
            comm: Mutex::new(CommHandle(comm)),
            aborted: AtomicBool::new(false),
            cause: Mutex::new(None),
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            rank,
            world,
            dev: *dev,
        });
        if comm.is_null() {
            return Err(Error::dist(
                OP,
                kind_of(r),
                format!("{}: {}", shared.where_(), err_string(r)),
            ));
        }
        shared.call(OP, r)?;
        let mut comm = Self::finish(shared, stream);
        comm.finalize_on_drop = true;
        Ok(comm)
    }

    /// One communicator per GPU for one process driving them all (what `ncclCommInitAll`
    /// does, as one group of `ncclCommInitRankConfig` calls so that the config applies):
    /// element `i` is rank `i` on `devs[i]`. Use each from its own thread (or group the calls).
    pub fn init_all(devs: &[CudaDevice]) -> Result<Vec<NcclComm>> {
        const OP: &str = "ncclCommInitAll";
        nccl_version()?;
        let timeout = timeout_from_env()?;
        let id = NcclId::new()?;
        let mut comms: Vec<nsys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
        let mut streams = Vec::with_capacity(devs.len());
        // SAFETY: starts a group that the matching `ncclGroupEnd` below closes.
        let r = unsafe { nsys::ncclGroupStart() };
        if r != nsys::ncclResult_t::ncclSuccess {
            return Err(Error::dist(OP, kind_of(r), err_string(r)));
        }
        let mut first_err = None;
        for (rank, d) in devs.iter().enumerate() {
            // Binds the device's context to this thread: NCCL takes the current device.
            match Stream::with_priority(d, -1) {
                Ok(s) => streams.push(s),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
            let mut cfg = comm_config(true);
            // SAFETY: a valid out-pointer slot and config; the id is 128 bytes; `d`'s context
            // is current. Inside a group the call only records the request.
            let r = unsafe {
                nsys::ncclCommInitRankConfig(
                    &mut comms[rank],
                    devs.len() as i32,
                    id.raw(),
                    rank as i32,
                    &mut cfg,
                )
            };
            if r != nsys::ncclResult_t::ncclSuccess {
                first_err = Some(Error::dist(OP, kind_of(r), err_string(r)));
                break;
            }
        }
        // SAFETY: ends the group started above; it runs the recorded initializations (one
        // process owns every rank, so no peer can be missing).
        let r = unsafe { nsys::ncclGroupEnd() };
        if let Some(e) = first_err {
            return Err(e);
        }
        if r != nsys::ncclResult_t::ncclSuccess {
            return Err(Error::dist(OP, kind_of(r), err_string(r)));
        }
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (c, s))| {
                let shared = Arc::new(Shared {
                    comm: Mutex::new(CommHandle(c)),
                    aborted: AtomicBool::new(false),
                    cause: Mutex::new(None),
                    timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
                    rank,
                    world: devs.len(),
                    dev: devs[rank],
                });
                Self::finish(shared, s)
            })
            .collect())
    }

    fn finish(shared: Arc<Shared>, stream: Stream) -> NcclComm {
        let (tx, rx) = mpsc::channel::<Watched>();
        let sh = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("kiln-nccl-watchdog-{}", shared.rank))
            .spawn(move || watchdog(sh, rx))
            .ok();
        NcclComm {
            shared,
            stream,
            watch: Mutex::new(Some(tx)),
            watchdog,
            finalize_on_drop: false,
        }
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }
    pub fn world_size(&self) -> usize {
        self.shared.world
    }
    pub fn device(&self) -> CudaDevice {
        self.shared.dev
    }
    /// The communication stream (collectives run there).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
    /// The timeout of collectives and of waits on them.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout()
    }
    pub fn set_timeout(&self, t: Duration) {
        self.shared
            .timeout_ms
            .store(t.as_millis().max(1) as u64, Ordering::Relaxed);
    }
    /// Polls NCCL's asynchronous error state: an error when the communicator failed or was
    /// aborted (by the watchdog after a timeout, or by [`NcclComm::abort`]).
    pub fn check(&self) -> Result<()> {
        self.shared.poll("NcclComm::check").map(drop)
    }
    /// Whether the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::Acquire)
    }
    /// Aborts the communicator (`ncclCommAbort`): pending collectives end, every later call
    /// returns an error with `why`.
    pub fn abort(&self, why: &str) {
        self.shared.abort(DistErrorKind::Aborted, why.to_string());
    }
    /// [`NcclComm::abort`] with the class of the cause (e.g. [`DistErrorKind::PeerLost`] when
    /// a rendezvous link reported a dead peer).
    pub fn abort_with(&self, kind: DistErrorKind, why: &str) {
        self.shared.abort(kind, why.to_string());
    }

    /// Orders the communication stream after the caller's current stream, records `t`'s
    /// memory there, and returns its contiguous form and device address.
    fn input(&self, op: &'static str, t: &Tensor<Cuda>) -> Result<(Tensor<Cuda>, u64)> {
        if *t.device() != self.shared.dev {
            return Err(Error::DeviceMismatch {
                op,
                lhs: format!("a communicator of {}", self.shared.dev),
                rhs: format!("a tensor on {}", t.device()),
            });
        }
        let t = t.contiguous()?;
        let ptr =
            t.storage().device_ptr()? + (t.layout().offset() * t.dtype().size_in_bytes()) as u64;
        self.stream.record_tensor(&t)?;
        Ok((t, ptr))
    }

    fn output(&self, shape: Vec<usize>, dtype: DType) -> Result<(Tensor<Cuda>, u64)> {
        let n: usize = shape.iter().product();
        let storage = CudaStorage::alloc(&self.shared.dev, (n * dtype.size_in_bytes()).max(1))?;
        let ptr = storage.device_ptr()?;
        let out = Tensor::<Cuda>::from_storage(storage, shape, dtype);
        self.stream.record_tensor(&out)?;
        Ok((out, ptr))
    }

    /// Runs `launch` on the communication stream after the caller's current stream, and
    /// hands the collective to the watchdog.
    fn launch(
        &self,
        op: &'static str,
        out: Tensor<Cuda>,
        launch: impl FnOnce(nsys::ncclComm_t, nsys::cudaStream_t) -> nsys::ncclResult_t,
    ) -> Result<Collective> {
        self.shared.alive(op)?;
        let current = Stream::current(&self.shared.dev)?;
        self.stream.wait_stream(&current)?;
        let stream = self.stream.as_raw() as nsys::cudaStream_t;
        // Profiled as a device-to-device transfer of the output's bytes, on the
        // communication stream.
        let prof = crate::profile::d2d(
            crate::device::state(&self.shared.dev)?,
            op,
            self.stream.as_raw(),
            out.elem_count() * out.dtype().size_in_bytes(),
        );
        let r = self.shared.with_comm(op, |c| launch(c, stream))?;
        self.shared.call(op, r)?;
        drop(prof);
        let event = Arc::new(self.stream.record_event()?);
        if let Some(tx) = &*self.watch.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = tx.send(Watched {
                op,
                event: event.clone(),
                start: Instant::now(),
            });
        }
        Ok(Collective {
            out,
            event,
            shared: self.shared.clone(),
            op,
        })
    }

    /// All-reduce of `t` over the ranks (out of place): every rank gets the sum/mean/max/min.
    pub fn all_reduce(&self, t: &Tensor<Cuda>, op: ReduceOp) -> Result<Collective> {
        const OP: &str = "all_reduce";
        let dt = nccl_dtype(OP, t.dtype())?;
        let (src, sptr) = self.input(OP, t)?;
        let (out, optr) = self.output(src.dims().to_vec(), src.dtype())?;
        let n = src.elem_count();
        self.launch(OP, out, |comm, s| {
            // SAFETY: both buffers hold `n` elements of `dt` on this communicator's device and
            // are recorded on its stream; the stream belongs to the same context.
            unsafe {
                nsys::ncclAllReduce(
                    sptr as *const c_void,
                    optr as *mut c_void,
                    n,
                    dt,
                    op.raw(),
                    comm,
                    s,
                )
            }
        })
        .inspect(|_| drop(src))
    }

    /// Broadcast from `root`: every rank gets root's `t` (the others' `t` gives shape and
    /// dtype, and must match root's).
    pub fn broadcast(&self, t: &Tensor<Cuda>, root: usize) -> Result<Collective> {
        const OP: &str = "broadcast";
        if root >= self.shared.world {
            return Err(Error::invalid(
                OP,
                format!(
                    "root {root} is not below the world size {}",
                    self.shared.world
                ),
            ));
        }
        let dt = nccl_dtype(OP, t.dtype())?;
        let (src, sptr) = self.input(OP, t)?;
        let (out, optr) = self.output(src.dims().to_vec(), src.dtype())?;
        let n = src.elem_count();
        self.launch(OP, out, |comm, s| {
            // SAFETY: as in all_reduce.
            unsafe {
                nsys::ncclBroadcast(
                    sptr as *const c_void,
                    optr as *mut c_void,
                    n,
                    dt,
                    root as i32,
                    comm,
                    s,
                )
            }
        })
        .inspect(|_| drop(src))
    }

    /// All-gather: the ranks' `t` (same shape everywhere) stacked along a new leading axis of
    /// length `world_size`, in rank order.
    pub fn all_gather(&self, t: &Tensor<Cuda>) -> Result<Collective> {
        const OP: &str = "all_gather";
        let dt = nccl_dtype(OP, t.dtype())?;
        let (src, sptr) = self.input(OP, t)?;
        let mut shape = vec![self.shared.world];
        shape.extend_from_slice(src.dims());
        let (out, optr) = self.output(shape, src.dtype())?;
        let n = src.elem_count();
        self.launch(OP, out, |comm, s| {
            // SAFETY: the output holds `world * n` elements; as in all_reduce otherwise.
            unsafe {
                nsys::ncclAllGather(sptr as *const c_void, optr as *mut c_void, n, dt, comm, s)
            }
        })
        .inspect(|_| drop(src))
    }

    /// Waits on the host until every collective issued so far has finished, or errors after
    /// the timeout (aborting the communicator).
    pub fn synchronize(&self) -> Result<()> {
        let e = self.stream.record_event()?;
        wait_event(&self.shared, "NcclComm::synchronize", &e)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Stop the watchdog first (it holds the shared state).
        self.watch.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = self.watchdog.take() {
            let _ = h.join();
        }
        if self.shared.aborted.load(Ordering::Acquire) {
            return;
        }
        // Finish this rank's outstanding work (bounded by the timeout), then finalize with the
        // peers and destroy (`Shared::finalize`); a peer that died or never finalizes makes it
        // an abort after the timeout, never a hang.
        if self.synchronize().is_ok() && self.finalize_on_drop {
            self.shared.finalize();
        } else {
            self.shared.abort(
                DistErrorKind::Aborted,
                "the communicator was dropped".into(),
            );
        }
    }
}

/// Polls `event` until it completes, NCCL reports an error, or the timeout passes (then the
/// communicator is aborted).
fn wait_event(shared: &Shared, op: &'static str, e: &Event) -> Result<()> {
    let start = Instant::now();
    loop {
        if e.query()? {
            return shared.alive(op);
        }
        shared.poll(op)?;
        let timeout = shared.timeout();
        if start.elapsed() > timeout {
            let why = format!(
                "{op} did not finish within {:.1} s (KILN_DIST_TIMEOUT_S); a peer rank may have \
                 died or stopped issuing collectives",
                timeout.as_secs_f64()
            );
            shared.abort(DistErrorKind::Timeout, why.clone());
            return Err(Error::dist(
                op,
                DistErrorKind::Timeout,
                format!("{}: {why}", shared.where_()),
            ));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The watchdog: follows collectives in flight, in order; aborts the communicator when one
/// outlives the timeout or NCCL reports an asynchronous error.
fn watchdog(shared: Arc<Shared>, rx: mpsc::Receiver<Watched>) {
    let mut pending: std::collections::VecDeque<Watched> = Default::default();
    loop {
        let next = if pending.is_empty() {
            match rx.recv() {
                Ok(w) => Some(w),
                Err(_) => return,
            }
        } else {
            match rx.recv_timeout(Duration::from_millis(2)) {
                Ok(w) => Some(w),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        pending.extend(next);
        while let Ok(w) = rx.try_recv() {
            pending.push_back(w);
        }
        if shared.aborted.load(Ordering::Acquire) {
            pending.clear();
            continue;
        }
        while let Some(w) = pending.front() {
            match w.event.query() {
                Ok(true) => {
                    pending.pop_front();
                }
                Ok(false) => break,
                Err(e) => {
                    shared.abort(DistErrorKind::Library, format!("{}: {e}", w.op));
                    break;
                }
            }
        }
        if pending.is_empty() {
            continue;
        }
        if shared.poll("watchdog").is_err() {
            continue;
        }
        if let Some(w) = pending.front() {
            let timeout = shared.timeout();
            if w.start.elapsed() > timeout {
                shared.abort(
                    DistErrorKind::Timeout,
                    format!(
                        "{} issued by {} did not finish within {:.1} s (KILN_DIST_TIMEOUT_S); a \
                         peer rank may have died or stopped issuing collectives",
                        w.op,
                        shared.where_(),
                        timeout.as_secs_f64()
                    ),
                );
            }
        }
    }
}

/// A collective in flight: its output and the event marking its end on the communication
/// stream.
pub struct Collective {
    out: Tensor<Cuda>,
    event: Arc<Event>,
    shared: Arc<Shared>,
    op: &'static str,
}

impl std::fmt::Debug for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Collective({} on {})", self.op, self.shared.where_())
    }
}

impl Collective {
    /// Makes the calling thread's current stream wait for the collective (the host does not
    /// block) and returns its output. An error if the communicator was aborted already.
    pub fn wait(self) -> Result<Tensor<Cuda>> {
        self.shared.alive(self.op)?;
        Stream::current(&self.shared.dev)?.wait_event(&self.event)?;
        Ok(self.out)
    }
    /// Waits on the host until the collective has finished (bounded by the timeout, after
    /// which the communicator is aborted and the error names the collective), then
    /// [`Collective::wait`]s.
    pub fn synchronize(self) -> Result<Tensor<Cuda>> {
        wait_event(&self.shared, self.op, &self.event)?;
        self.wait()
    }
    /// Whether it has finished (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        self.event.query()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_parsing() {
        assert_eq!(parse_timeout(None).unwrap(), Duration::from_secs(300));
        assert_eq!(
            parse_timeout(Some("2.5")).unwrap(),
            Duration::from_millis(2500)
        );
        for bad in ["", "0", "-1", "abc", "inf"] {
            let e = parse_timeout(Some(bad)).unwrap_err();
            assert_eq!(
                e.dist_kind(),
                Some(DistErrorKind::Environment),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn config_is_initialized_like_nccl_config_initializer() {
        let c = undef_config();
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.size, std::mem::size_of::<nsys::ncclConfig_t>());
        assert_eq!(c.blocking, i32::MIN);
    }

    #[test]
    fn without_nccl_is_an_error_not_a_panic() {
        // On machines without libnccl this must be a typed error; with it, a version.
        match nccl_version() {
            Ok(v) => assert!(v > 20000, "{v}"),
            Err(e) => assert_eq!(e.dist_kind(), Some(DistErrorKind::Library), "{e}"),
        }
    }
}
