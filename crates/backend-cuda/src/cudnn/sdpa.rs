//! Fused attention through cuDNN's graph API for f16 and bf16: the flash-attention kernels
//! PyTorch's `scaled_dot_product_attention` runs on Hopper (cuDNN's `sm90` engines, built on
//! `wgmma`), which kiln's own `mma.sync` kernels (`kernels/attention_tc.cu`) do not reach: on
//! an H200 (2026-11-28) those took 2× cuDNN's time for a bf16 forward at (8, 16, 2048, 64).
//!
//! cuDNN has no attention operation before 9.13 (and its unified one takes a causal mask only
//! from 9.21), so this builds the expanded operation graph that cudnn-frontend's composite
//! SDPA nodes lower to, which cuDNN's runtime-fusion engines recognize as attention. Written
//! from those nodes (`scaled_dot_product_flash_attention.h`, `softmax.h`,
//! `diagonal_band_mask.h`, `rng.h`), for the cases kiln asks for: a bias (a tensor mask,
//! `attention_cudnn.rs`) or none, top-left causal mask or none, dropout or none, one head
//! count for q, k and v.
//!
//! - **Forward**: `S = Q·Kᵀ` (K described transposed), `S·scale`, `+ bias`, the causal mask as
//!   `row ≥ col ? S : -inf` (two `GEN_INDEX`, a `CMP_GE` and a `BINARY_SELECT`), the softmax
//!   with its statistics (row max, `exp(S - max)`, row sum, `lse = max + log(sum)` written
//!   out, `P = exp / sum` in the inputs' type), with dropout `P ∘ mask / (1 - p)` (the mask
//!   drawn by cuDNN's Philox generator from the call's seed), `O = P·V`.
//! - **Backward**: `Σ = rowsum(dO ∘ O)` (written to a scratch buffer), the weights
//!   `P = exp(S·scale + bias - lse)` recomputed and masked, `dV = Pᵀ·dO`,
//!   `dS = P ∘ (dO·Vᵀ - Σ)·scale`, `dK = dSᵀ·Q` (with dropout the same mask drawn again from the same seed, as cudnn-frontend does),
//!   `dQ = dS·K` (through an f32 accumulator when the engine's `dP` workspace would pass
//!   256 MiB, as cudnn-frontend decides).
//! - The log-sum-exps are kiln's (`Backend::attention_forward`'s second output: natural log of
//!   the scaled scores' row sums, f32 `[batch.., Tq]`), so a forward run here and a backward
//!   run by kiln's kernels (or the reverse) agree.
//! - **Selection**: per shape, layout and direction, heuristic mode A's first engine config
//!   that finalizes is made into a plan and run once on the call's own buffers
//!   (`graph::search`, [`MAX_CANDIDATES`]); a graph no engine serves is remembered and the
//!   call answers "not served" (`Ok(false)`), and kiln's kernels run it. Nothing is measured
//!   during a CUDA graph capture (a shape first seen there is not served). Under the default
//!   switch small problems ([`MIN_WORK`]) and shapes past [`MAX_GRAPHS`] stay on kiln's
//!   kernels: a new graph costs about half a second, its plan's kernels compiled by cuDNN.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as K,
    cudnnDataType_t as D, cudnnPointwiseMode_t as Pw,
};
use kiln_core::{DType, Error, Layout, Result};

use super::backend::{Desc, DevPtr};
use super::graph::{self, ALIGNMENT, Candidate};
use super::{bound, log_choices, slot};
use crate::device::DeviceState;
use crate::memory::alloc;

const FWD: &str = "scaled_dot_product_attention";
const BWD: &str = "scaled_dot_product_attention_backward";

static SWITCH: AtomicU8 = AtomicU8::new(0); // 0: read the environment; 1: off; 2: on; 3: default
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Whether 16-bit attention may run on cuDNN's fused engines where they serve the call: by
/// default on compute capability 9.0 and up, where they measured faster than kiln's kernels;
/// `KILN_CUDNN_ATTENTION=0` or [`set_cudnn_attention`]`(Some(false))`: never; `=1` or
/// `Some(true)`: on any GPU cuDNN serves. Answers for a Hopper GPU under the default.
pub fn cudnn_attention() -> bool {
    switch() != 1
}

fn switch() -> u8 {
    match SWITCH.load(Ordering::Relaxed) {
        0 => {
            let v = match std::env::var("KILN_CUDNN_ATTENTION").as_deref() {
                Ok("0") => 1,
                Ok("1") => 2,
                _ => 3,
            };
            SWITCH.store(v, Ordering::Relaxed);
            v
        }
        v => v,
    }
}

/// Turns cuDNN's fused attention on (`Some(true)`: wherever cuDNN serves the call, whatever
/// the GPU), off (`Some(false)`: kiln's kernels always), or back to the default (`None`: on
/// compute capability 9.0 and up). Process-wide; overrides `KILN_CUDNN_ATTENTION`.
pub fn set_cudnn_attention(on: Option<bool>) {
    let v = match on {
        Some(false) => 1,
        Some(true) => 2,
        None => 3,
    };
    SWITCH.store(v, Ordering::Relaxed);
}

/// Attention calls (forward or backward) that ran on cuDNN, for tests and benchmarks.
pub fn cudnn_attention_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// Plans made and timed per graph: heuristic mode A's first (a config that does not finalize
/// or run is skipped for the next). On an H200 (2026-11-28, all configs timed) the first was the
/// fastest in each of the six graphs measured (forward and backward at both benchmark shapes,
/// and with dropout at the GPT's), and each plan finalized compiles kernels: one keeps a new
/// graph's first call to about half a second.
const MAX_CANDIDATES: usize = 1;

/// Under the default switch, problems of fewer multiply-adds in `Q·Kᵀ` (`b·h·Tq·Tk·d`) stay
/// on kiln's kernels: each new shape costs a graph and its plans (see [`MAX_CANDIDATES`]),
/// which a run of small, varying shapes (generation, one growing context after another)
/// would pay again and again for microseconds of attention. Training at the GPT example's
/// shape is 1.6 G.
const MIN_WORK: i64 = 1 << 26;

/// At most this many graphs per device under the default switch; shapes past it stay on
/// kiln's kernels.
const MAX_GRAPHS: usize = 64;

/// One operand: its device address (offset included) and layout (`[b, h, t, d]` or `[n, t,
/// d]`, unit stride on the last axis).
pub(crate) type Operand<'a> = (u64, &'a Layout);

/// One call: the operands of the forward (`q`, `k`, `v`, then `o`) or of the backward (`q`,
/// `k`, `v`, `o`, `dO`, then `dQ`, `dK`, `dV`), and the f32 log-sum-exps.
pub(crate) struct Call<'a> {
    pub dtype: DType,
    pub causal: bool,
    pub scale: f32,
    /// Dropout on the weights: its probability (0: none) and the seed of cuDNN's Philox
    /// generator (the mask is a function of the seed and the weight's position, so the
    /// backward draws the forward's mask again).
    pub dropout: (f64, u64),
    pub tensors: &'a [Operand<'a>],
    pub lse: u64,
    /// An additive bias of the call's dtype over `[b, h, Tq, Tk]`: its device address, dims
    /// (1 on a broadcast head axis) and strides (0 on broadcast batch and query axes).
    pub bias: Option<(u64, [i64; 4], [i64; 4])>,
}

/// The shape, layouts and direction of one graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    backward: bool,
    dtype: DType,
    causal: bool,
    /// The dropout probability's bits (0: none): a constant of the graph.
    dropout: u64,
    /// `[b, h, s_q, s_kv, d, dv]`.
    dims: [i64; 6],
    /// Each operand's strides over `[b, h, t, d]`, in [`Call::tensors`]' order.
    strides: [[i64; 4]; 8],
    /// The bias's dims and strides ([`Call::bias`]).
    bias: Option<([i64; 4], [i64; 4])>,
}

/// A measured graph: its descriptors (kept alive with the plans) and plans, fastest first
/// (none: not served).
pub(super) struct Entry {
    _parts: Vec<Desc>,
    plans: Vec<Candidate>,
}

/// Per device: each graph measured.
pub(super) type Cache = HashMap<Key, Entry>;

// Unique ids: the operands (variant pack), then the virtual tensors.
const UID_Q: i64 = 1;
const UID_K: i64 = 2;
const UID_V: i64 = 3;
const UID_O: i64 = 4;
const UID_DO: i64 = 5;
const UID_DQ: i64 = 6;
const UID_DK: i64 = 7;
const UID_DV: i64 = 8;
const UID_LSE: i64 = 9;
const UID_SCALE: i64 = 10;
const UID_NEG_INF: i64 = 11;
const UID_ONE: i64 = 12;
const UID_SUM: i64 = 13;
const UID_DQ_ACC: i64 = 14;
const UID_SEED: i64 = 15;
const UID_OFFSET: i64 = 16;
const UID_KEEP_SCALE: i64 = 17;
const UID_DROP_INV: i64 = 18;
const UID_BIAS: i64 = 19;
const UID_VIRTUAL: i64 = 100;

/// `[b, h, t, d]` dims and strides of a rank-4 layout, or of a rank-3 one as one head.
fn bhtd(l: &Layout) -> Option<([i64; 4], [i64; 4])> {
    let (d, s) = (l.dims(), l.strides());
    let (d, s): ([usize; 4], [usize; 4]) = match d.len() {
        4 => (d.try_into().ok()?, s.try_into().ok()?),
        3 => ([d[0], 1, d[1], d[2]], [s[0], s[0], s[1], s[2]]),
        _ => return None,
    };
    if s[3] != 1 && d[3] > 1 {
        return None;
    }
    let i = |v: usize| i64::try_from(v).ok().filter(|&v| v <= i32::MAX as i64);
    Some((
        [i(d[0])?, i(d[1])?, i(d[2])?, i(d[3])?],
        [i(s[0])?, i(s[1])?, i(s[2])?, i(s[3])?],
    ))
}

/// The graph key of `call`, or `None` when cuDNN is not asked for it (dtype, head sizes,
/// layouts).
fn key_of(call: &Call<'_>, backward: bool) -> Option<Key> {
    if !matches!(call.dtype, DType::F16 | DType::BF16) {
        return None;
    }
    let mut strides = [[0i64; 4]; 8];
    let mut dims = Vec::with_capacity(call.tensors.len());
    for (i, (_, l)) in call.tensors.iter().enumerate() {
        let (d, s) = bhtd(l)?;
        strides[i] = s;
        dims.push(d);
    }
    let (q, k, v) = (dims[0], dims[1], dims[2]);
    // One batch and head count, d = dv (the engines' common case), head sizes of 8k to 128.
    let same_bh = dims.iter().all(|x| x[0] == q[0] && x[1] == q[1]);
    if !same_bh || k[3] != q[3] || v[3] != q[3] || v[2] != k[2] || q[3] % 8 != 0 || q[3] > 128 {
        return None;
    }
    if q[2] < 2 && k[2] < 2 {
        return None;
    }
    if !(0.0..1.0).contains(&call.dropout.0) {
        return None;
    }
    Some(Key {
        backward,
        dtype: call.dtype,
        causal: call.causal,
        dropout: call.dropout.0.to_bits(),
        dims: [q[0], q[1], q[2], k[2], q[3], v[3]],
        strides,
        bias: call.bias.map(|(_, d, s)| (d, s)),
    })
}

/// Whether a problem of `Q·Kᵀ` dimensions `[b, h, Tq, Tk, d]` is below [`MIN_WORK`].
fn small(dims: [i64; 5]) -> bool {
    dims.iter().fold(1i64, |a, &x| a.saturating_mul(x)) < MIN_WORK
}

/// Whether the default switch leaves a call with these `q` and `k` to kiln's kernels for its
/// size ([`MIN_WORK`]): known before a mask is written out for it.
pub(crate) fn too_small(q: &Layout, k: &Layout) -> bool {
    let (Some((qd, _)), Some((kd, _))) = (bhtd(q), bhtd(k)) else {
        return false;
    };
    switch() != 2 && small([qd[0], qd[1], qd[2], kd[2], qd[3]])
}

/// Whether cuDNN's attention is asked on a device of compute capability `arch`.
pub(crate) fn wanted(arch: u32, dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && match switch() {
            1 => false,
            2 => true,
            _ => arch >= 90,
        }
        && super::usable(dtype)
        && graph::graph_available()
}

/// Runs the forward (`backward` false) or backward of `call` on cuDNN: `Ok(false)` when not
/// served, with nothing run (the caller then runs kiln's kernels). `must`: the size and count
/// limits of the default switch do not apply (the backward of a forward that ran here with
/// dropout, whose mask only cuDNN can draw again).
pub(crate) fn run(
    dev: &'static DeviceState,
    call: &Call<'_>,
    (backward, must): (bool, bool),
) -> Result<bool> {
    let op = if backward { BWD } else { FWD };
    let Some(key) = key_of(call, backward) else {
        return Ok(false);
    };
    let ptrs: Vec<u64> = call
        .tensors
        .iter()
        .map(|t| t.0)
        .chain([call.lse])
        .chain(call.bias.map(|b| b.0))
        .collect();
    if !graph::aligned(&ptrs) {
        return Ok(false);
    }
    let Some(slot) = slot(dev.ordinal()) else {
        return Ok(false);
    };
    dev.bind()?;
    let mut guard = slot.lock().unwrap_or_else(|e| e.into_inner());
    let Some(st) = bound(&mut guard, dev, op)? else {
        return Ok(false);
    };
    let g = Graph {
        dev,
        handle: st.handle,
        key,
        call,
        op,
    };
    let [b, h, tq, tk, d, _] = key.dims;
    let limited =
        !(must || switch() == 2) && (small([b, h, tq, tk, d]) || st.sdpa.len() >= MAX_GRAPHS);
    let entry = match st.sdpa.entry(key) {
        MapEntry::Occupied(e) => e.into_mut(),
        MapEntry::Vacant(_) if dev.capturing() || limited => return Ok(false),
        MapEntry::Vacant(v) => v.insert(g.measure()?),
    };
    graph::run_first(&entry.plans, &CALLS, |c| g.execute(c))
}

/// One graph being built or run.
struct Graph<'a> {
    dev: &'static DeviceState,
    handle: sys::cudnnHandle_t,
    key: Key,
    call: &'a Call<'a>,
    op: &'static str,
}

/// The descriptors of a graph under construction, kept alive until the graph is.
struct Builder {
    op: &'static str,
    parts: Vec<Desc>,
    ops: Vec<sys::cudnnBackendDescriptor_t>,
    next_uid: i64,
}

/// A tensor of the graph: its index in `Builder::parts`.
#[derive(Clone, Copy)]
struct T(usize);

impl Builder {
    fn desc(&self, t: T) -> &Desc {
        &self.parts[t.0]
    }

    /// A tensor descriptor: an operand with id `uid`, or without one a virtual tensor (never
    /// materialized) with the next free id; `by_value` for a scalar passed by host pointer.
    fn tensor(
        &mut self,
        data: D,
        dims: [i64; 4],
        strides: [i64; 4],
        uid: Option<i64>,
        by_value: bool,
    ) -> Result<T> {
        let op = self.op;
        let d = Desc::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR, op)?;
        d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, &[data], op)?;
        d.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims, op)?;
        d.set(A::CUDNN_ATTR_TENSOR_STRIDES, &strides, op)?;
        let id = uid.unwrap_or_else(|| {
            self.next_uid += 1;
            self.next_uid
        });
        d.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id], op)?;
        d.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT], op)?;
        if uid.is_none() {
            d.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, &[true], op)?;
        }
        if by_value {
            d.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, &[true], op)?;
        }
        d.finalize(op)
            .map_err(|e| Error::backend(op, format!("tensor {id}: {e}")))?;
        self.parts.push(d);
        Ok(T(self.parts.len() - 1))
    }

    /// A virtual tensor of `data`, packed `dims`.
    fn virt(&mut self, data: D, dims: [i64; 4]) -> Result<T> {
        self.tensor(data, dims, packed(dims), None, false)
    }

    /// A virtual tensor with explicit strides.
    fn virt_strided(&mut self, data: D, dims: [i64; 4], strides: [i64; 4]) -> Result<T> {
        self.tensor(data, dims, strides, None, false)
    }

    /// A by-value f32 scalar, its value passed with each execution.
    fn scalar(&mut self, uid: i64) -> Result<T> {
        self.tensor(D::CUDNN_DATA_FLOAT, [1; 4], [1; 4], Some(uid), true)
    }

    /// The dropout mask of `dims`: Bernoulli draws, 1 with probability `1 - p`, from cuDNN's
    /// Philox generator at the by-value seed and offset.
    fn keep_mask(&mut self, p: f64, dims: [i64; 4]) -> Result<T> {
        let op = self.op;
        let seed = self.tensor(D::CUDNN_DATA_INT64, [1; 4], [1; 4], Some(UID_SEED), true)?;
        let offset = self.tensor(D::CUDNN_DATA_INT64, [1; 4], [1; 4], Some(UID_OFFSET), true)?;
        let mask = self.virt(D::CUDNN_DATA_FLOAT, dims)?;
        let rng = Desc::new(K::CUDNN_BACKEND_RNG_DESCRIPTOR, op)?;
        rng.set(
            A::CUDNN_ATTR_RNG_DISTRIBUTION,
            &[sys::cudnnRngDistribution_t::CUDNN_RNG_DISTRIBUTION_BERNOULLI],
            op,
        )?;
        rng.set(A::CUDNN_ATTR_RNG_BERNOULLI_DIST_PROBABILITY, &[1.0 - p], op)?;
        rng.finalize(op)
            .map_err(|e| Error::backend(op, format!("dropout generator: {e}")))?;
        let d = Desc::new(K::CUDNN_BACKEND_OPERATION_RNG_DESCRIPTOR, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_RNG_YDESC, self.desc(mask), op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_RNG_DESC, &rng, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_RNG_SEED, self.desc(seed), op)?;
        d.set_desc(
            A::CUDNN_ATTR_OPERATION_RNG_OFFSET_DESC,
            self.desc(offset),
            op,
        )?;
        self.parts.push(rng);
        self.push_op(d, "dropout mask")?;
        Ok(mask)
    }

    fn push_op(&mut self, d: Desc, what: &str) -> Result<()> {
        let op = self.op;
        d.finalize(op)
            .map_err(|e| Error::backend(op, format!("{what}: {e}")))?;
        self.ops.push(d.raw());
        self.parts.push(d);
        Ok(())
    }

    /// `y = mode(x [, b [, t]])`, math in `prec`, `axis` for `GEN_INDEX`.
    fn pointwise(
        &mut self,
        mode: Pw,
        prec: D,
        ins: &[T],
        y: T,
        axis: Option<i64>,
        what: &str,
    ) -> Result<()> {
        let op = self.op;
        let pw = Desc::new(K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, op)?;
        pw.set(A::CUDNN_ATTR_POINTWISE_MODE, &[mode], op)?;
        pw.set(A::CUDNN_ATTR_POINTWISE_MATH_PREC, &[prec], op)?;
        if let Some(a) = axis {
            pw.set(A::CUDNN_ATTR_POINTWISE_AXIS, &[a], op)?;
        }
        pw.finalize(op)
            .map_err(|e| Error::backend(op, format!("{what} descriptor: {e}")))?;
        let d = Desc::new(K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &pw, op)?;
        let attrs = [
            A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
            A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
            A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
        ];
        for (&a, &t) in attrs.iter().zip(ins) {
            d.set_desc(a, self.desc(t), op)?;
        }
        d.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, self.desc(y), op)?;
        d.set(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, &[1.0f32], op)?;
        d.set(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, &[1.0f32], op)?;
        self.parts.push(pw);
        self.push_op(d, what)
    }

    /// A pointwise op into a new virtual f32 tensor of `dims`.
    fn pw_f32(&mut self, mode: Pw, ins: &[T], dims: [i64; 4], what: &str) -> Result<T> {
        let y = self.virt(D::CUDNN_DATA_FLOAT, dims)?;
        self.pointwise(mode, D::CUDNN_DATA_FLOAT, ins, y, None, what)?;
        Ok(y)
    }

    /// `c = a · b` (batched over the first two axes), f32 math.
    fn matmul(&mut self, a: T, b: T, c: T, what: &str) -> Result<()> {
        let op = self.op;
        let mm = Desc::new(K::CUDNN_BACKEND_MATMUL_DESCRIPTOR, op)?;
        mm.set(A::CUDNN_ATTR_MATMUL_COMP_TYPE, &[D::CUDNN_DATA_FLOAT], op)?;
        mm.finalize(op)
            .map_err(|e| Error::backend(op, format!("{what} descriptor: {e}")))?;
        let d = Desc::new(K::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, self.desc(a), op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, self.desc(b), op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, self.desc(c), op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &mm, op)?;
        self.parts.push(mm);
        self.push_op(d, what)
    }

    /// `y = reduce(x)` over the axes where `y` has extent 1, f32 math.
    fn reduce(&mut self, max: bool, x: T, y: T, what: &str) -> Result<()> {
        let op = self.op;
        let r = Desc::new(K::CUDNN_BACKEND_REDUCTION_DESCRIPTOR, op)?;
        let mode = if max {
            sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX
        } else {
            sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD
        };
        r.set(A::CUDNN_ATTR_REDUCTION_OPERATOR, &[mode], op)?;
        r.set(
            A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            &[D::CUDNN_DATA_FLOAT],
            op,
        )?;
        r.finalize(op)
            .map_err(|e| Error::backend(op, format!("{what} descriptor: {e}")))?;
        let d = Desc::new(K::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &r, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, self.desc(x), op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, self.desc(y), op)?;
        self.parts.push(r);
        self.push_op(d, what)
    }

    /// `y` viewing `x` with other dims and strides (a transpose of the last two axes here).
    fn reshape(&mut self, x: T, y: T, what: &str) -> Result<()> {
        let op = self.op;
        let d = Desc::new(K::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, self.desc(x), op)?;
        d.set_desc(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, self.desc(y), op)?;
        self.push_op(d, what)
    }

    /// `s` with the keys after each query's position set to `-inf` (top-left causal mask).
    fn causal(&mut self, s: T, dims: [i64; 4], neg_inf: T) -> Result<T> {
        let row = self.virt(D::CUDNN_DATA_INT32, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            D::CUDNN_DATA_FLOAT,
            &[s],
            row,
            Some(2),
            "causal row index",
        )?;
        let col = self.virt(D::CUDNN_DATA_INT32, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            D::CUDNN_DATA_FLOAT,
            &[s],
            col,
            Some(3),
            "causal column index",
        )?;
        let keep = self.virt(D::CUDNN_DATA_BOOLEAN, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_CMP_GE,
            D::CUDNN_DATA_BOOLEAN,
            &[row, col],
            keep,
            None,
            "causal comparison",
        )?;
        self.pw_f32(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            &[s, neg_inf, keep],
            dims,
            "causal select",
        )
    }

    /// The finalized operation graph of every op pushed.
    fn finish(&mut self, handle: sys::cudnnHandle_t) -> Result<Desc> {
        let op = self.op;
        let g = Desc::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, op)?;
        g.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, &[handle], op)?;
        g.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &self.ops, op)?;
        g.finalize(op)
            .map_err(|e| Error::backend(op, format!("operation graph: {e}")))?;
        Ok(g)
    }
}

/// The tensors [`Graph::scores`] makes.
struct Scores {
    q: T,
    kt: T,
    lse: T,
    scale: T,
    s: T,
}

/// Packed strides of `dims`.
fn packed(d: [i64; 4]) -> [i64; 4] {
    [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1]
}

/// `dims`/`strides` with the last two axes swapped.
fn transposed((d, s): ([i64; 4], [i64; 4])) -> ([i64; 4], [i64; 4]) {
    ([d[0], d[1], d[3], d[2]], [s[0], s[1], s[3], s[2]])
}

/// The engines' workspace for `dP` in the backward, as cudnn-frontend sizes it: above
/// 256 MiB, `dQ` is accumulated in an f32 buffer instead.
fn dp_workspace_fits(k: &Key) -> bool {
    let [b, h, sq, skv, _, _] = k.dims;
    let r = |x: i64| (x + 63) / 64 * 64;
    b * h * r(sq) * r(skv) * 2 <= 256 << 20
}

impl Graph<'_> {
    fn io(&self) -> D {
        match self.key.dtype {
            DType::F16 => D::CUDNN_DATA_HALF,
            _ => D::CUDNN_DATA_BFLOAT16,
        }
    }

    fn operand(&self, b: &mut Builder, i: usize, uid: i64) -> Result<T> {
        let [bb, h, sq, skv, d, dv] = self.key.dims;
        let dims = match i {
            0 | 3 | 4 | 5 => [bb, h, sq, if i == 0 || i == 5 { d } else { dv }],
            1 | 6 => [bb, h, skv, d],
            _ => [bb, h, skv, dv],
        };
        b.tensor(self.io(), dims, self.key.strides[i], Some(uid), false)
    }

    /// What both directions start from: Q, Kᵀ (K's descriptor with the last two axes
    /// swapped), the log-sum-exps, the by-value scale, and the scaled scores `S = Q·Kᵀ·scale
    /// (+ bias)` (f32, the products' ops pushed here).
    fn scores(&self, b: &mut Builder) -> Result<Scores> {
        let [bb, h, sq, skv, d, _] = self.key.dims;
        let q = self.operand(b, 0, UID_Q)?;
        let (kd, ks) = transposed(([bb, h, skv, d], self.key.strides[1]));
        let kt = b.tensor(self.io(), kd, ks, Some(UID_K), false)?;
        let row = [bb, h, sq, 1];
        let lse = b.tensor(D::CUDNN_DATA_FLOAT, row, packed(row), Some(UID_LSE), false)?;
        let scale = b.scalar(UID_SCALE)?;
        let sdims = [bb, h, sq, skv];
        let s = b.virt(D::CUDNN_DATA_FLOAT, sdims)?;
        b.matmul(q, kt, s, "Q·Kᵀ")?;
        let mut s = b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[s, scale], sdims, "scale")?;
        if let Some((dims, strides)) = self.key.bias {
            let bias = b.tensor(self.io(), dims, strides, Some(UID_BIAS), false)?;
            s = b.pw_f32(Pw::CUDNN_POINTWISE_ADD, &[s, bias], sdims, "bias")?;
        }
        Ok(Scores {
            q,
            kt,
            lse,
            scale,
            s,
        })
    }

    /// The forward graph (module docs).
    fn build_forward(&self, b: &mut Builder) -> Result<Desc> {
        let [bb, h, sq, skv, _, _] = self.key.dims;
        let drop = f64::from_bits(self.key.dropout);
        let io = self.io();
        let v = self.operand(b, 2, UID_V)?;
        let o = self.operand(b, 3, UID_O)?;
        let row = [bb, h, sq, 1];
        let sdims = [bb, h, sq, skv];
        let Scores { lse, mut s, .. } = self.scores(b)?;
        if self.key.causal {
            let neg_inf = b.scalar(UID_NEG_INF)?;
            s = b.causal(s, sdims, neg_inf)?;
        }
        let max = b.virt(D::CUDNN_DATA_FLOAT, row)?;
        b.reduce(true, s, max, "row max")?;
        let sub = b.pw_f32(Pw::CUDNN_POINTWISE_SUB, &[s, max], sdims, "S - max")?;
        let e = b.pw_f32(Pw::CUDNN_POINTWISE_EXP, &[sub], sdims, "exp")?;
        let sum = b.virt(D::CUDNN_DATA_FLOAT, row)?;
        b.reduce(false, e, sum, "row sum")?;
        let log = b.pw_f32(Pw::CUDNN_POINTWISE_LOG, &[sum], row, "log sum")?;
        b.pointwise(
            Pw::CUDNN_POINTWISE_ADD,
            D::CUDNN_DATA_FLOAT,
            &[max, log],
            lse,
            None,
            "lse",
        )?;
        let p = b.virt(if drop > 0.0 { D::CUDNN_DATA_FLOAT } else { io }, sdims)?;
        b.pointwise(
            Pw::CUDNN_POINTWISE_DIV,
            D::CUDNN_DATA_FLOAT,
            &[e, sum],
            p,
            None,
            "P",
        )?;
        let p = if drop > 0.0 {
            let mask = b.keep_mask(drop, sdims)?;
            let kept = b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[p, mask], sdims, "P∘mask")?;
            let keep_scale = b.scalar(UID_KEEP_SCALE)?;
            let pd = b.virt(io, sdims)?;
            b.pointwise(
                Pw::CUDNN_POINTWISE_MUL,
                D::CUDNN_DATA_FLOAT,
                &[kept, keep_scale],
                pd,
                None,
                "dropout scale",
            )?;
            pd
        } else {
            p
        };
        b.matmul(p, v, o, "P·V")?;
        b.finish(self.handle)
    }

    /// The backward graph (module docs).
    fn build_backward(&self, b: &mut Builder) -> Result<Desc> {
        let [bb, h, sq, skv, d, dv] = self.key.dims;
        let drop = f64::from_bits(self.key.dropout);
        let io = self.io();
        let (vd, vs) = transposed(([bb, h, skv, dv], self.key.strides[2]));
        let vt = b.tensor(io, vd, vs, Some(UID_V), false)?;
        let o = self.operand(b, 3, UID_O)?;
        let g = self.operand(b, 4, UID_DO)?;
        let dq = self.operand(b, 5, UID_DQ)?;
        let dk = self.operand(b, 6, UID_DK)?;
        let dvt = self.operand(b, 7, UID_DV)?;
        let row = [bb, h, sq, 1];
        // With dropout Σ is scaled by 1 - p (cudnn-frontend's `Dropout_scale_inv`), else by 1.
        let one = b.scalar(if drop > 0.0 { UID_DROP_INV } else { UID_ONE })?;

        // Σ = rowsum(dO ∘ O), written out.
        let go = b.virt_strided(
            D::CUDNN_DATA_FLOAT,
            [bb, h, sq, dv],
            [h * sq * dv, sq * dv, h * dv, 1],
        )?;
        b.pointwise(
            Pw::CUDNN_POINTWISE_MUL,
            D::CUDNN_DATA_FLOAT,
            &[g, o],
            go,
            None,
            "dO∘O",
        )?;
        let rs = b.virt(D::CUDNN_DATA_FLOAT, row)?;
        b.reduce(false, go, rs, "rowsum(dO∘O)")?;
        let sum = b.tensor(D::CUDNN_DATA_FLOAT, row, packed(row), Some(UID_SUM), false)?;
        b.pointwise(
            Pw::CUDNN_POINTWISE_MUL,
            D::CUDNN_DATA_FLOAT,
            &[rs, one],
            sum,
            None,
            "Σ",
        )?;

        // P = exp(S·scale - lse), masked.
        let sdims = [bb, h, sq, skv];
        let Scores {
            q,
            kt,
            lse,
            scale,
            s,
        } = self.scores(b)?;
        let mut s = b.pw_f32(Pw::CUDNN_POINTWISE_SUB, &[s, lse], sdims, "S - lse")?;
        if self.key.causal {
            let neg_inf = b.scalar(UID_NEG_INF)?;
            s = b.causal(s, sdims, neg_inf)?;
        }
        let p = b.pw_f32(Pw::CUDNN_POINTWISE_EXP, &[s], sdims, "P")?;
        let (mask, keep_scale) = if drop > 0.0 {
            (
                Some(b.keep_mask(drop, sdims)?),
                Some(b.scalar(UID_KEEP_SCALE)?),
            )
        } else {
            (None, None)
        };
        // The weights as the forward applied them: P ∘ mask / (1 - p) with dropout.
        let pd = match (mask, keep_scale) {
            (Some(m), Some(k)) => {
                let kept = b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[p, m], sdims, "P∘mask")?;
                b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[kept, k], sdims, "dropout scale")?
            }
            _ => p,
        };
        let tdims = [bb, h, skv, sq];
        let tstr = [h * sq * skv, sq * skv, 1, skv];
        let pt = b.virt_strided(io, tdims, tstr)?;
        b.reshape(pd, pt, "Pᵀ")?;
        b.matmul(pt, g, dvt, "Pᵀ·dO")?;

        // dS = P ∘ (mask ∘ dO·Vᵀ - Σ(1 - p)) / (1 - p) · scale, or P ∘ (dO·Vᵀ - Σ) · scale.
        let dp = b.virt(D::CUDNN_DATA_FLOAT, sdims)?;
        b.matmul(g, vt, dp, "dO·Vᵀ")?;
        let dp = match mask {
            Some(m) => b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[dp, m], sdims, "dP∘mask")?,
            None => dp,
        };
        let dp = b.pw_f32(Pw::CUDNN_POINTWISE_SUB, &[dp, sum], sdims, "dP - Σ")?;
        let mut ds = b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[dp, p], sdims, "P∘(dP - Σ)")?;
        if let Some(k) = keep_scale {
            ds = b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[ds, k], sdims, "dS dropout scale")?;
        }
        let ds = b.pw_f32(Pw::CUDNN_POINTWISE_MUL, &[ds, scale], sdims, "dS")?;
        let dst = b.virt_strided(io, tdims, tstr)?;
        b.reshape(ds, dst, "dSᵀ")?;
        b.matmul(dst, q, dk, "dSᵀ·Q")?;

        // K itself (its descriptor was Kᵀ), for dQ = dS·K.
        let (kd, ks) = ([bb, h, skv, d], self.key.strides[1]);
        let kk = b.virt_strided(io, kd, ks)?;
        b.reshape(kt, kk, "K")?;
        if dp_workspace_fits(&self.key) {
            b.matmul(ds, kk, dq, "dS·K")?;
        } else {
            let qd = [bb, h, sq, d];
            let acc = b.tensor(D::CUDNN_DATA_FLOAT, qd, packed(qd), Some(UID_DQ_ACC), false)?;
            b.matmul(ds, kk, acc, "dS·K")?;
            b.pointwise(
                Pw::CUDNN_POINTWISE_IDENTITY,
                D::CUDNN_DATA_FLOAT,
                &[acc],
                dq,
                None,
                "dQ",
            )?;
        }
        b.finish(self.handle)
    }

    /// Builds the graph and times its plans (synchronizes); a graph cuDNN refuses, or one no
    /// engine serves, gives an entry without plans.
    fn measure(&self) -> Result<Entry> {
        let mut b = Builder {
            op: self.op,
            parts: Vec::new(),
            ops: Vec::new(),
            next_uid: UID_VIRTUAL,
        };
        let built = if self.key.backward {
            self.build_backward(&mut b)
        } else {
            self.build_forward(&mut b)
        };
        let graph = match built {
            Ok(g) => g,
            Err(e @ Error::OutOfMemory { .. }) => return Err(e),
            Err(e) => {
                self.log(&[], Some(&e));
                return Ok(Entry {
                    _parts: Vec::new(),
                    plans: Vec::new(),
                });
            }
        };
        let cap = (self.dev.device().total_memory()? / 4).min(super::algo::MEASURE_WORKSPACE_CAP);
        let plans = graph::search(
            &graph,
            (self.key.dtype, false),
            (cap, MAX_CANDIDATES),
            self.op,
            |cfg| graph::plan(self.handle, cfg, self.op),
            |c| graph::time_plan(self.dev, "attention timing", || self.execute(c)),
        );
        self.log(&plans, None);
        b.parts.push(graph);
        Ok(Entry {
            _parts: b.parts,
            plans,
        })
    }

    /// Queues plan `c` on the call's operands, with the scratch the backward needs.
    fn execute(&self, c: &Candidate) -> Result<()> {
        let op = self.op;
        let call = self.call;
        let scale = call.scale;
        let neg_inf = f32::NEG_INFINITY;
        let one = 1.0f32;
        let (p, seed) = call.dropout;
        let (keep_scale, drop_inv) = ((1.0 / (1.0 - p)) as f32, (1.0 - p) as f32);
        // The generator's seed and offset, passed by value as int64 (the key's bits).
        let (seed, offset) = (seed as i64, 0i64);
        let host64 = |v: &i64| DevPtr(v as *const i64 as *mut c_void);
        let host = |v: &f32| DevPtr(v as *const f32 as *mut c_void);
        let dev_ptr = |p: u64| DevPtr(p as *mut c_void);
        let t = call.tensors;
        let mut uids = vec![UID_Q, UID_K, UID_V, UID_O];
        let mut ptrs: Vec<DevPtr> = t[..4].iter().map(|x| dev_ptr(x.0)).collect();
        uids.extend([UID_LSE, UID_SCALE]);
        ptrs.extend([dev_ptr(call.lse), host(&scale)]);
        if self.key.causal {
            uids.push(UID_NEG_INF);
            ptrs.push(host(&neg_inf));
        }
        if let Some((addr, _, _)) = call.bias {
            uids.push(UID_BIAS);
            ptrs.push(dev_ptr(addr));
        }
        let dropout = self.key.dropout != 0;
        if dropout {
            uids.extend([UID_SEED, UID_OFFSET, UID_KEEP_SCALE]);
            ptrs.extend([host64(&seed), host64(&offset), host(&keep_scale)]);
        }
        let [bb, h, sq, _, d, _] = self.key.dims;
        let rows = (bb * h * sq) as usize;
        let mut scratch = Vec::new();
        if self.key.backward {
            uids.extend([UID_DO, UID_DQ, UID_DK, UID_DV]);
            ptrs.extend(t[4..8].iter().map(|x| dev_ptr(x.0)));
            uids.push(if dropout { UID_DROP_INV } else { UID_ONE });
            ptrs.push(host(if dropout { &drop_inv } else { &one }));
            scratch.push(alloc(self.dev, rows * 4)?);
            uids.push(UID_SUM);
            ptrs.push(dev_ptr(scratch[0].device_ptr()));
            if !dp_workspace_fits(&self.key) {
                scratch.push(alloc(self.dev, rows * d as usize * 4)?);
                uids.push(UID_DQ_ACC);
                ptrs.push(dev_ptr(scratch[1].device_ptr()));
            }
        }
        // The scratch buffers are freed stream-ordered once the plan is queued.
        graph::execute_pack(self.dev, self.handle, c, (&uids, &ptrs), op)
    }

    /// `KILN_CUDNN_LOG=1`: the plans measured, fastest first, or why none serves the graph.
    fn log(&self, plans: &[Candidate], err: Option<&Error>) {
        if !log_choices() {
            return;
        }
        let what = match err {
            Some(e) => format!("not served ({e}), kiln's kernels run it"),
            None if plans.is_empty() => "no engine ran, kiln's kernels run it".to_string(),
            None => plans
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        };
        let k = &self.key;
        eprintln!(
            "kiln cudnn {} {:?} dims {:?} causal {} dropout {} bias {:?}: {what}",
            self.op,
            k.dtype,
            k.dims,
            k.causal,
            f64::from_bits(k.dropout),
            k.bias
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::Shape;

    #[test]
    fn head_views_map_to_bhtd_and_rank_three_to_one_head() {
        // A head view [2, 3, 5, 8] of a packed [2, 5, 3·8·3] projection.
        let l = Layout::from_parts(Shape::new([2, 3, 5, 8]), [360, 8, 72, 1], 0);
        assert_eq!(bhtd(&l), Some(([2, 3, 5, 8], [360, 8, 72, 1])));
        let l3 = Layout::contiguous(Shape::new(vec![4, 5, 8]));
        assert_eq!(bhtd(&l3), Some(([4, 1, 5, 8], [40, 40, 8, 1])));
        let strided = Layout::from_parts(Shape::new([2, 3, 5, 8]), [240, 80, 16, 2], 0);
        assert_eq!(bhtd(&strided), None);
    }

    #[test]
    fn the_dq_accumulator_follows_frontends_workspace_rule() {
        let key = |b, h, t| Key {
            backward: true,
            dtype: DType::BF16,
            causal: true,
            dropout: 0,
            dims: [b, h, t, t, 64, 64],
            strides: [[0; 4]; 8],
            bias: None,
        };
        assert!(dp_workspace_fits(&key(64, 6, 256)));
        assert!(!dp_workspace_fits(&key(8, 16, 2048)));
    }

    #[test]
    fn the_operand_ids_are_distinct() {
        let ids = [
            UID_Q,
            UID_K,
            UID_V,
            UID_O,
            UID_DO,
            UID_DQ,
            UID_DK,
            UID_DV,
            UID_LSE,
            UID_SCALE,
            UID_NEG_INF,
            UID_ONE,
            UID_SUM,
            UID_DQ_ACC,
            UID_SEED,
            UID_OFFSET,
            UID_KEEP_SCALE,
            UID_DROP_INV,
            UID_BIAS,
        ];
        let mut s = ids.to_vec();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), ids.len());
        assert!(ids.iter().all(|&i| i < UID_VIRTUAL));
    }
}
