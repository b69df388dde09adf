//! CUDA graphs: a block of kiln work captured once and replayed with one launch
//! (`torch.cuda.CUDAGraph`, `cudaStreamBeginCapture`).
//!
//! # Why
//!
//! A small model's training step is launch-bound: ~20 kernels of a few microseconds each, and
//! 3–5 µs of host time to launch each one. A graph replays all of them with one
//! `cuGraphLaunch`, so the step costs what the GPU needs and the host is free.
//!
//! # How
//!
//! [`CudaGraph::capture`] runs a closure with a side stream current and that stream in capture
//! mode: the closure's kiln code runs as usual on the host — shapes are checked, autograd
//! builds its graph, the optimizer steps — but every kernel, cuBLAS call and device copy is
//! recorded instead of run. Deferred (fused) work recorded in the closure is launched into the
//! graph before the capture ends. [`CudaGraph::replay`] then runs the recorded work on the
//! caller's current stream, on **the same device addresses**, which fixes the rules:
//!
//! - **Private memory.** Every buffer allocated during the capture comes from a pool of the
//!   graph's own (`pool::GraphPool`); it never returns to the device's cache while the graph
//!   or a tensor holding it lives, so nothing outside the graph can be overwritten by a
//!   replay. Buffers from before the capture that the captured work uses are kept alive by the
//!   graph.
//! - **Static inputs and outputs.** Tensors created before the capture and read by it are the
//!   graph's inputs: put the next batch into them with [`write_static`], which writes in place
//!   (every handle to that storage sees it). Tensors created in the closure are its outputs:
//!   after each replay they hold that replay's values (not before the first replay: capturing
//!   runs nothing).
//! - **State is updated in place.** Under capture, `Tensor::fused_update` (what kiln-optim's
//!   optimizers use) writes the new parameters and momentum buffers into the old ones, so each
//!   replay starts from the previous one's result. What a replay would freeze is refused with a
//!   typed error: Adam's bias correction (a function of the step count), SGD's first momentum
//!   step (take one eager step first, as PyTorch's warm-up), random numbers.
//! - **No host round trips.** Copies from or to the host and waits for the device are refused
//!   during a capture (typed errors naming the op). So is anything that reads a value on the
//!   host, like `Tensor::to_vec` or an index check that must synchronize: check labels before
//!   the capture (uploaded ids carry their host-checked range), and read the loss after a
//!   replay.
//!
//! The capture uses the driver's relaxed mode, so other threads may keep using the device.
//! Dropping a graph waits for the device to be idle (a replay may still be running).
//!
//! ```no_run
//! # use kiln_backend_cuda::{Cuda, CudaDevice, CudaGraph, write_static};
//! # use kiln_core::{DType, Tensor};
//! # fn main() -> kiln_core::Result<()> {
//! let dev = CudaDevice::new(0);
//! let w = Tensor::<Cuda>::ones([256, 256], DType::F32, &dev)?;
//! let x = Tensor::<Cuda>::zeros([64, 256], DType::F32, &dev)?; // a static input
//! let (graph, y) = CudaGraph::capture(&dev, || x.matmul(&w)?.relu())?;
//! for step in 0..10 {
//!     write_static(&x, &Tensor::<Cuda>::full([64, 256], step as f64, DType::F32, &dev)?)?;
//!     graph.replay()?;
//!     println!("{}", y.sum_all()?.to_scalar()?);
//! }
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cudarc::driver::sys;
use kiln_core::{Error, Result, Tensor};

use crate::device::{DeviceState, capture_active, check, set_capture, state, sync_debug};
use crate::pool::GraphPool;
use crate::stream::Stream;
use crate::types::{Cuda, CudaDevice};

/// Work captured once on one GPU, replayed with one launch (see the module docs).
pub struct CudaGraph {
    dev: &'static DeviceState,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: usize,
    pool: Arc<GraphPool>,
}
// SAFETY: graph handles may be used from any thread with the device's context current, which
// every method ensures (`bind`); the driver's graph calls are thread-safe for distinct graphs,
// and a replay only reads `exec`.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaGraph({} nodes, {} bytes on {})",
            self.nodes,
            self.pool.bytes(),
            self.dev.device()
        )
    }
}

impl CudaGraph {
    /// Captures the device work of `f` on `dev` (see the module docs); returns the graph and
    /// what `f` returned. Nothing runs until [`CudaGraph::replay`]. An error of `f`, or an op
    /// that cannot be captured, ends the capture and is returned; the device stays usable.
    pub fn capture<R>(dev: &CudaDevice, f: impl FnOnce() -> Result<R>) -> Result<(CudaGraph, R)> {
        const OP: &str = "CudaGraph::capture";
        let st = state(dev)?;
        if capture_active() {
            return Err(Error::invalid(
                OP,
                format!(
                    "a capture is already running in this thread (asked for one on {dev}): \
                     captures do not nest"
                ),
            ));
        }
        let stream = Stream::new(dev)?;
        let s = stream.as_raw();
        // The capture's work follows everything queued so far on the caller's stream.
        st.order(st.stream(), s, OP)?;
        let pool = Arc::new(GraphPool {
            ordinal: st.ordinal(),
            free: Default::default(),
            blocks: Default::default(),
            keep: Default::default(),
            release: crate::memory::release_graph_blocks,
        });
        let guard = stream.enter();
        // SAFETY: a live stream of the bound context, not capturing (it is a fresh or spare
        // stream of ours, and captures do not nest).
        check(
            unsafe {
                sys::cuStreamBeginCapture_v2(
                    s,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            },
            OP,
        )?;
        set_capture(Some(pool.clone()));
        let mut ender = EndOnUnwind(Some(s));
        let out = f();
        // Deferred work recorded in `f` joins the graph now (or is forgotten if `f` failed).
        let forced = crate::lazy::force_captured(out.is_ok());
        set_capture(None);
        ender.0 = None;
        let mut graph = std::ptr::null_mut();
        // SAFETY: the stream began capturing above, on this thread; valid out-pointer.
        let ended = check(unsafe { sys::cuStreamEndCapture(s, &mut graph) }, OP);
        drop(guard);
        // What other graphs left while this one was captured can go now.
        crate::memory::release_deferred_graph_blocks(st.ordinal());
        release_deferred_graphs(st);
        let destroy = |g: sys::CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph returned by the capture, owned here and not instantiated.
                unsafe { sys::cuGraphDestroy(g) };
            }
        };
        let out = match (out, forced, ended) {
            (Ok(r), Ok(()), Ok(())) => r,
            (Err(e), _, _) | (Ok(_), Err(e), _) | (Ok(_), Ok(()), Err(e)) => {
                destroy(graph);
                return Err(e);
            }
        };
        let mut nodes = 0;
        // SAFETY: a valid graph; a null node array asks for the count only.
        unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) };
        let mut exec = std::ptr::null_mut();
        // SAFETY: a valid graph of this context; valid out-pointer.
        if let Err(e) = check(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            OP,
        ) {
            destroy(graph);
            return Err(e);
        }
        // Moves the graph's setup to the device now rather than at the first replay.
        // SAFETY: an instantiated graph of this context and a live stream of it.
        let uploaded = check(unsafe { sys::cuGraphUpload(exec, st.stream()) }, OP);
        if let Err(e) = uploaded {
            // SAFETY: created above, destroyed once.
            unsafe { sys::cuGraphExecDestroy(exec) };
            destroy(graph);
            return Err(e);
        }
        Ok((
            CudaGraph {
                dev: st,
                graph,
                exec,
                nodes,
                pool,
            },
            out,
        ))
    }

    /// Runs the captured work once on the calling thread's current stream of the graph's
    /// device (asynchronously, like any launch).
    pub fn replay(&self) -> Result<()> {
        const OP: &str = "CudaGraph::replay";
        self.dev.bind()?;
        self.dev.refuse_in_capture(OP, "replaying a graph")?;
        let _prof = crate::profile::launch(self.dev, "cuda graph", false);
        // SAFETY: an instantiated graph of this (bound) context; every buffer it uses is kept
        // alive by `self` (its pool and the buffers the pool keeps).
        check(
            unsafe { sys::cuGraphLaunch(self.exec, self.dev.stream()) },
            OP,
        )?;
        if sync_debug() {
            self.dev.sync(OP)?;
        }
        Ok(())
    }

    /// The number of nodes (kernels, copies, memsets) in the graph.
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// Bytes of device memory private to this graph (see the module docs).
    pub fn memory_bytes(&self) -> usize {
        self.pool.bytes()
    }

    pub fn device(&self) -> CudaDevice {
        self.dev.device()
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.dev.bind().is_err() {
            return;
        }
        if self.dev.capturing() {
            // Waiting for the device now would invalidate the capture: after it, then.
            let mut d = DEFERRED_GRAPHS.lock().unwrap();
            d.push((self.dev.ordinal(), self.exec as usize, self.graph as usize));
            return;
        }
        // SAFETY: this device's context is current; a replay may still be running, so wait
        // for the device before destroying what it uses. Each handle is destroyed once.
        unsafe {
            sys::cuCtxSynchronize();
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

/// Ends a capture whose closure panicked (while unwinding out of [`CudaGraph::capture`]), so
/// that the thread and the stream are left as they were before it.
struct EndOnUnwind(Option<sys::CUstream>);

impl Drop for EndOnUnwind {
    fn drop(&mut self) {
        let Some(s) = self.0 else { return };
        set_capture(None);
        let _ = crate::lazy::force_captured(false);
        let mut graph = std::ptr::null_mut();
        // SAFETY: the stream is capturing, begun on this thread; the partial graph, if any, is
        // destroyed once.
        unsafe {
            sys::cuStreamEndCapture(s, &mut graph);
            if !graph.is_null() {
                sys::cuGraphDestroy(graph);
            }
        }
    }
}

/// Graphs dropped while their thread captured another one on the same device: `(ordinal,
/// exec, graph)`, destroyed when that capture ends.
static DEFERRED_GRAPHS: std::sync::Mutex<Vec<(usize, usize, usize)>> =
    std::sync::Mutex::new(Vec::new());

fn release_deferred_graphs(dev: &DeviceState) {
    let mine: Vec<_> = {
        let mut d = DEFERRED_GRAPHS.lock().unwrap();
        let (mine, rest): (Vec<_>, Vec<_>) = d.drain(..).partition(|g| g.0 == dev.ordinal());
        *d = rest;
        mine
    };
    if mine.is_empty() || dev.bind().is_err() {
        return;
    }
    // SAFETY: this device's context is current and no capture runs on this thread; the
    // device is idle after the synchronize, and each deferred handle is destroyed once.
    unsafe {
        sys::cuCtxSynchronize();
        for (_, exec, graph) in mine {
            sys::cuGraphExecDestroy(exec as sys::CUgraphExec);
            sys::cuGraphDestroy(graph as sys::CUgraph);
        }
    }
}

/// Writes the values of `src` into `dst`'s own storage, in place, on the current stream: how
/// new data reaches a graph's static input (see the module docs). Unlike kiln's other ops,
/// this changes a tensor's values under every handle to its storage. `dst` must be contiguous
/// (a whole tensor, or a contiguous part such as leading rows), of `src`'s shape, dtype and
/// device; `src` may be any view.
pub fn write_static(dst: &Tensor<Cuda>, src: &Tensor<Cuda>) -> Result<()> {
    const OP: &str = "write_static";
    dst.check_same_device(OP, src)?;
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: dst.dtype().to_string(),
            got: src.dtype(),
        });
    }
    if dst.shape() != src.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: dst.shape().clone(),
            rhs: src.shape().clone(),
        });
    }
    let size = dst.dtype().size_in_bytes();
    let bytes = dst.shape().elem_count() * size;
    if !dst.layout().is_contiguous() {
        return Err(Error::invalid(
            OP,
            format!(
                "the destination must be contiguous (a graph's input or a contiguous part of \
                 it), got strides {:?}",
                dst.layout().strides()
            ),
        ));
    }
    let src = src.contiguous()?;
    let d = dst.storage().buffer()?;
    let s = src.storage().buffer()?;
    if bytes == 0 {
        return Ok(());
    }
    let dev = d.state();
    let (doff, soff) = (dst.layout().offset() * size, src.layout().offset() * size);
    let stream = dev.stream();
    let _prof = crate::profile::d2d(dev, OP, stream, bytes);
    // SAFETY: both ranges lie inside their live buffers (both layouts are contiguous, of the
    // same element count, within their storages); ordered on the current stream, after every
    // earlier use there.
    check(
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                d.device_ptr() + doff as u64,
                s.device_ptr() + soff as u64,
                bytes,
                stream,
            )
        },
        OP,
    )?;
    d.contents_changed();
    Ok(())
}
