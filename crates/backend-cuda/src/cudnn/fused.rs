//! A forward convolution with a per-channel bias and an activation in one cuDNN graph: the
//! CUDA backend's `Backend::conv2d_bias_act`, which kiln-nn's `ConvBnAct` runs in eval mode
//! (a batch norm folded into the convolution's weight and bias).
//!
//! Why: unfused, inference after a folded batch norm is a convolution, a bias add and a ReLU,
//! each a pass over the activations; cuDNN's runtime-fusion engines run the three as one
//! kernel whose epilogue adds the bias and clamps before the output is written.
//!
//! - **Graph**: `x`, `w` (as `graph.rs` builds them), the bias `[1, oc, 1, 1]` and `y`; the
//!   convolution writes a virtual f32 tensor, a pointwise `ADD` of the bias writes `y` (no
//!   activation) or a second virtual tensor, a pointwise `RELU_FWD` writes `y`. ReLU and none
//!   are offered; GELU is declined (the caller composes it).
//! - **Selection, caching, timing**: as `graph.rs` (heuristic mode A then FALLBACK, numerical
//!   notes filtered the same way, up to `MAX_CANDIDATES` plans timed, the fastest kept), per
//!   geometry, dtype, math and activation, in the device's cuDNN state.
//! - **Fallback**: a graph no engine serves (cuDNN's runtime fusion wants some dtypes and
//!   layouts only), a geometry first seen inside a CUDA graph capture, misaligned operands, or
//!   no plan whose workspace can be had: `Ok(None)`, and the caller runs the convolution, the
//!   bias add and the activation; `KILN_CUDNN_LOG=1` says so once per geometry.
//! - **Switch**: by default only TF32 convolutions take the graph (the one math where it
//!   measured faster, see `auto_serves`); `KILN_CUDNN_FUSION=1` (read once) or
//!   [`set_cudnn_fusion`]`(true)` allows it for every dtype, `=0` or `(false)` forbids it;
//!   [`cudnn_fused_calls`] counts the calls that ran fused.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as K,
};
use kiln_core::{Activation, Conv2dSpec, DType, Error, Layout, Result};

use super::algo::Dir;
use super::backend::Desc;
use super::desc::{Key, types};
use super::graph::{self, Candidate, TensorSpec};
use super::{bound, fits, log_choices, packed, slot};
use crate::CudaStorage;
use crate::device::DeviceState;
use crate::memory::alloc;

const OP: &str = "conv2d_bias_act";

/// The unique ids of the bias and the two virtual intermediates (`x`, `w`, `y` are
/// `graph.rs`'s).
const UID_BIAS: i64 = 4;
const UID_CONV: i64 = 5;
const UID_ADD: i64 = 6;

static SWITCH: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1: off; 2: on; 3: auto
static FUSED_CALLS: AtomicU64 = AtomicU64::new(0);

/// The switch: 1 off, 2 on for every dtype, 3 (the default) TF32 only (see [`auto_serves`]).
fn mode() -> u8 {
    match SWITCH.load(Ordering::Relaxed) {
        0 => {
            let m = match std::env::var("KILN_CUDNN_FUSION").as_deref() {
                Ok("0") => 1,
                Ok("1") => 2,
                _ => 3,
            };
            SWITCH.store(m, Ordering::Relaxed);
            m
        }
        v => v,
    }
}

/// Whether the fused graph may run: `KILN_CUDNN_FUSION=0` forbids it, `=1` allows it for
/// every dtype, unset (auto) for TF32 convolutions only (`auto_serves`).
pub fn cudnn_fusion() -> bool {
    mode() != 1
}

/// Allows (`true`: for every dtype) or forbids the fused convolution + bias + activation
/// graph; forbidden, `conv2d_bias_act` answers "not offered" and the three run one after the
/// other.
pub fn set_cudnn_fusion(on: bool) {
    SWITCH.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// The automatic choice: the fused graph for f32 convolutions with TF32 allowed, where it
/// measured faster than the convolution and one elementwise pass; ResNet-18's eval forward at
/// batch 256 on an H100 (2026-11-27): TF32 2.59 ms fused against 2.73 apart; strict f32 8.56
/// against 4.85 (the runtime-fusion engines' FMA kernels are slow); bf16 1.97 against 1.80.
fn auto_serves(dtype: DType, math: sys::cudnnMathType_t) -> bool {
    dtype == DType::F32 && math == sys::cudnnMathType_t::CUDNN_DEFAULT_MATH
}

/// How many convolutions ran through the fused graph since the process started (timing runs
/// not counted): lets tests and benchmarks see that it ran.
pub fn cudnn_fused_calls() -> u64 {
    FUSED_CALLS.load(Ordering::Relaxed)
}

/// The measured plans of one fused geometry, fastest first (none: not served), and the
/// descriptors they were built from.
pub(super) struct Entry {
    _graph: Vec<Desc>,
    plans: Vec<Candidate>,
}

/// Per device: each geometry and activation (true: ReLU) seen.
pub(super) type Cache = HashMap<(Key, bool), Entry>;

/// `Backend::conv2d_bias_act` on the CUDA backend (module docs): `Ok(None)` when not offered.
pub(crate) fn conv_bias_act(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    dtype: DType,
    spec: &Conv2dSpec,
    act: Activation,
) -> Result<Option<CudaStorage>> {
    let relu = match act {
        Activation::Identity => false,
        Activation::Relu => true,
        _ => return Ok(None),
    };
    // f64 has no runtime-fusion engine; the rest as the plain convolution.
    if !cudnn_fusion() || dtype == DType::F64 || !super::offered(dtype) {
        return Ok(None);
    }
    if !graph::graph_available() {
        return Ok(None);
    }
    let dims4 = |l: &Layout| <[usize; 4]>::try_from(l.dims()).ok();
    let (Some(xd), Some(wd)) = (dims4(x.1), dims4(w.1)) else {
        return Ok(None);
    };
    let Some(yd) = spec.output_dims(xd, wd) else {
        return Ok(None);
    };
    if bias.1.dims() != [wd[0]] || !fits(&[xd, wd, yd]) {
        return Ok(None);
    }
    let xb = packed(x.0.buffer()?, x.1, dtype)?;
    let wb = packed(w.0.buffer()?, w.1, dtype)?;
    let bb = packed(bias.0.buffer()?, bias.1, dtype)?;
    let dev = xb.state();
    if wb.state().ordinal() != dev.ordinal() || bb.state().ordinal() != dev.ordinal() {
        return Err(Error::invalid(OP, "operands on different devices"));
    }
    let tf32 = crate::blas::allow_tf32();
    let Some((_, _, math)) = types(dtype, tf32) else {
        return Ok(None);
    };
    if mode() == 3 && !auto_serves(dtype, math) {
        return Ok(None);
    }
    let key = Key {
        x: xd,
        w: wd,
        y: yd,
        spec: *spec,
        dtype,
        math,
    };
    let Some(slot) = slot(dev.ordinal()) else {
        return Ok(None);
    };
    dev.bind()?;
    let mut guard = slot.lock().unwrap_or_else(|e| e.into_inner());
    let Some(st) = bound(&mut guard, dev, OP)? else {
        return Ok(None);
    };
    if st
        .fused
        .get(&(key, relu))
        .is_some_and(|e| e.plans.is_empty())
    {
        // Measured before and not served: nothing to allocate.
        return Ok(None);
    }
    let out = alloc(dev, yd.iter().product::<usize>() * dtype.size_in_bytes())?;
    let call = Call {
        dev,
        handle: st.handle,
        key: &key,
        relu,
        ptrs: [
            xb.device_ptr(),
            wb.device_ptr(),
            bb.device_ptr(),
            out.device_ptr(),
        ],
    };
    if !call.run(&mut st.fused)? {
        return Ok(None);
    }
    drop(guard);
    if crate::device::sync_debug() && !dev.capturing() {
        dev.sync(OP)?;
    }
    Ok(Some(CudaStorage::ready(out)))
}

/// One fused call: the handle (bound, under the device's cuDNN lock), the geometry, and the
/// device pointers of `x`, `w`, the bias and `y`.
struct Call<'a> {
    dev: &'static DeviceState,
    handle: sys::cudnnHandle_t,
    key: &'a Key,
    relu: bool,
    ptrs: [u64; 4],
}

impl Call<'_> {
    /// Runs the fastest plan whose workspace can be had: `Ok(false)` when none ran (not
    /// served, not measurable now, no workspace), with nothing run.
    fn run(&self, cache: &mut Cache) -> Result<bool> {
        if !graph::aligned(&self.ptrs) {
            return Ok(false);
        }
        let entry = match cache.entry((*self.key, self.relu)) {
            MapEntry::Occupied(e) => e.into_mut(),
            MapEntry::Vacant(_) if self.dev.capturing() => return Ok(false),
            MapEntry::Vacant(v) => v.insert(self.measure()?),
        };
        graph::run_first(&entry.plans, &FUSED_CALLS, |c| self.execute(c))
    }

    /// Builds the graph and times its plans (synchronizes), as `graph.rs` does; a graph cuDNN
    /// refuses, or one no engine serves, gives an entry without plans.
    fn measure(&self) -> Result<Entry> {
        let (graph, mut parts) = match self.build() {
            Ok(v) => v,
            Err(e @ Error::OutOfMemory { .. }) => return Err(e),
            Err(e) => {
                self.log(&[], Some(&e));
                return Ok(Entry {
                    _graph: Vec::new(),
                    plans: Vec::new(),
                });
            }
        };
        let tf32 = self.key.math != sys::cudnnMathType_t::CUDNN_FMA_MATH;
        let cap = (self.dev.device().total_memory()? / 4).min(super::algo::MEASURE_WORKSPACE_CAP);
        let plans = graph::search(
            &graph,
            (self.key.dtype, tf32),
            (cap, graph::MAX_CANDIDATES),
            OP,
            |cfg| self.plan(cfg),
            |c| graph::time_plan(self.dev, "conv2d_bias_act timing", || self.execute(c)),
        );
        self.log(&plans, None);
        parts.push(graph);
        Ok(Entry {
            _graph: parts,
            plans,
        })
    }

    /// The finalized operation graph (convolution → bias add → ReLU) and its descriptors.
    fn build(&self) -> Result<(Desc, Vec<Desc>)> {
        let key = self.key;
        let tf32 = key.math != sys::cudnnMathType_t::CUDNN_FMA_MATH;
        let (data, compute, _) = types(key.dtype, tf32).ok_or_else(|| Error::DTypeMismatch {
            op: OP,
            expected: "f32, f16 or bf16".into(),
            got: key.dtype,
        })?;
        let [tx, tw, ty] = graph::tensors(key, OP)?;
        let oc = ty.dims[1];
        let tb = TensorSpec {
            uid: UID_BIAS,
            dims: [1, oc, 1, 1],
            strides: [oc, 1, 1, 1],
        };
        let x = graph::tensor(&tx, data, OP)?;
        let w = graph::tensor(&tw, data, OP)?;
        let b = graph::tensor(&tb, data, OP)?;
        let y = graph::tensor(&ty, data, OP)?;
        let conv_out = virtual_tensor(
            &TensorSpec {
                uid: UID_CONV,
                ..ty
            },
            compute,
        )?;
        let conv = graph::convolution(key, compute, OP)?;
        let conv_op = graph::operation(Dir::Forward, [&x, &w, &conv_out], &conv, key.dtype, OP)?;
        let mut parts = vec![x, w, b];
        let (add_out, relu_op) = if self.relu {
            let add_out = virtual_tensor(&TensorSpec { uid: UID_ADD, ..ty }, compute)?;
            let (relu_pw, relu_op) = pointwise(
                sys::cudnnPointwiseMode_t::CUDNN_POINTWISE_RELU_FWD,
                compute,
                &add_out,
                None,
                &y,
            )?;
            parts.push(relu_pw);
            (Some(add_out), Some(relu_op))
        } else {
            (None, None)
        };
        let (add_pw, add_op) = pointwise(
            sys::cudnnPointwiseMode_t::CUDNN_POINTWISE_ADD,
            compute,
            &conv_out,
            Some(&parts[2]),
            add_out.as_ref().unwrap_or(&y),
        )?;
        let mut ops = vec![conv_op.raw(), add_op.raw()];
        if let Some(r) = &relu_op {
            ops.push(r.raw());
        }
        let graph = Desc::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, OP)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, &[self.handle], OP)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops, OP)?;
        graph.finalize(OP)?;
        parts.extend([y, conv_out, conv, conv_op, add_pw, add_op]);
        parts.extend(add_out);
        parts.extend(relu_op);
        Ok((graph, parts))
    }

    /// An execution plan of `cfg` (an error when it does not finalize).
    fn plan(&self, cfg: &Desc) -> Result<Desc> {
        graph::plan(self.handle, cfg, OP)
    }

    /// Queues plan `c` ([`graph::execute`]) on `x`, `w`, the bias and `y`.
    fn execute(&self, c: &Candidate) -> Result<()> {
        let uids = [graph::UID_X, graph::UID_W, UID_BIAS, graph::UID_Y];
        graph::execute(self.dev, self.handle, c, (&uids, &self.ptrs), OP)
    }

    /// `KILN_CUDNN_LOG=1`: the plans measured, fastest first, or why the fused graph is not
    /// served (the caller then runs the three ops).
    fn log(&self, plans: &[Candidate], err: Option<&Error>) {
        if !log_choices() {
            return;
        }
        let k = self.key;
        let what = match err {
            Some(e) => format!("not served ({e}), conv + bias + activation unfused"),
            None if plans.is_empty() => {
                "no engine ran, conv + bias + activation unfused".to_string()
            }
            None => plans
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        };
        eprintln!(
            "kiln cudnn fused conv2d+bias{} x {:?} w {:?} {:?} {:?}: {what}",
            if self.relu { "+relu" } else { "" },
            k.x,
            k.w,
            k.dtype,
            k.math,
        );
    }
}

/// A finalized virtual (never materialized) tensor of `t`'s shape in `data`.
fn virtual_tensor(t: &TensorSpec, data: sys::cudnnDataType_t) -> Result<Desc> {
    let d = Desc::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR, OP)?;
    d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, &[data], OP)?;
    d.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &t.dims, OP)?;
    d.set(A::CUDNN_ATTR_TENSOR_STRIDES, &t.strides, OP)?;
    d.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[t.uid], OP)?;
    d.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[graph::ALIGNMENT], OP)?;
    d.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, &[true], OP)?;
    d.finalize(OP)?;
    Ok(d)
}

/// A pointwise `mode` (math in `prec`) from `x` (and `b`) to `y`: its pointwise descriptor and
/// the finalized operation.
fn pointwise(
    mode: sys::cudnnPointwiseMode_t,
    prec: sys::cudnnDataType_t,
    x: &Desc,
    b: Option<&Desc>,
    y: &Desc,
) -> Result<(Desc, Desc)> {
    let pw = Desc::new(K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, OP)?;
    pw.set(A::CUDNN_ATTR_POINTWISE_MODE, &[mode], OP)?;
    pw.set(A::CUDNN_ATTR_POINTWISE_MATH_PREC, &[prec], OP)?;
    pw.finalize(OP)?;
    let op = Desc::new(K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, OP)?;
    op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &pw, OP)?;
    op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, OP)?;
    if let Some(b) = b {
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, OP)?;
    }
    op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, OP)?;
    op.finalize(OP)?;
    Ok((pw, op))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variant pack's ids are the graph's: `x`, `w`, bias, `y`, all distinct from the
    /// virtual intermediates'.
    #[test]
    fn the_unique_ids_are_distinct() {
        let ids = [
            graph::UID_X,
            graph::UID_W,
            graph::UID_Y,
            UID_BIAS,
            UID_CONV,
            UID_ADD,
        ];
        for (i, a) in ids.iter().enumerate() {
            assert!(!ids[i + 1..].contains(a), "{a} twice");
        }
    }

    #[test]
    fn the_switch_turns_fusion_off() {
        let was = cudnn_fusion();
        set_cudnn_fusion(false);
        assert!(!cudnn_fusion());
        set_cudnn_fusion(true);
        assert!(cudnn_fusion());
        set_cudnn_fusion(was);
    }
}
