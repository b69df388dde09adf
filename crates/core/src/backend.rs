//! The `Backend` trait: the small, enum-driven surface every device implements.
//!
//! A backend owns untyped storage buffers and runs kernels over them. It never sees a `Tensor`:
//! it gets storages, their [`Layout`]s (shape, strides, offset) and the dtype, and returns new
//! storages holding contiguous (row-major, offset 0) results. Validation (shapes, dtypes,
//! devices, axes) happens once, in `Tensor`, before a backend is called; a backend only reports
//! what it alone can know (out of memory, an index out of range, a driver failure).
//!
//! Every kernel accepts strided inputs: transposed, sliced and broadcast (stride 0) views.
//! Broadcasting between two operands is already resolved when a backend sees them: both layouts
//! have the output's shape.
//!
//! Adding an op is one enum variant here, one arm per backend, one arm in the reference backend
//! and one gradient in kiln-autograd; the conformance suite then tests it everywhere.

use std::fmt::{Debug, Display};
use std::hash::Hash;

pub use crate::attention_layout::{attention_output_layout, attention_packed_layouts};
pub use crate::epilogue::{Activation, EpilogueGrads, EpilogueOutputs};
pub use crate::host::HostBuffer;
use crate::host::{HostRows, HostSource};
use crate::ir::{Program, rules};
pub use crate::op::{BinaryOp, CmpOp, GradFrom, ReduceOp, UnaryOp};
pub use crate::unscale::{FOUND_NON_FINITE, UnscaleSlot};
pub use crate::update::{UpdateRule, UpdateSlot};
use crate::{DType, Error, Layout, Result, Shape};

/// Distributions for [`Backend::rand`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RandDist {
    /// Uniform on `[low, high)`.
    Uniform { low: f64, high: f64 },
    /// Gaussian with the given mean and standard deviation (Box–Muller).
    Normal { mean: f64, std: f64 },
    /// Dropout's keep mask, drawn as [`DType::U8`] only: 1 where the element's f32 uniform
    /// on `[0, 1)` (the stream `Uniform { low: 0, high: 1 }` draws in f32) is at least `p`
    /// rounded to f32, else 0 (`rand(..) >= p`, the attention kernels' test). One pass that
    /// writes a byte an element, where the uniforms and a comparison would write four and read
    /// them again.
    Keep { p: f64 },
}

impl RandDist {
    /// Whether `dtype` can hold draws of this distribution: the float dtypes for uniforms and
    /// normals, [`DType::U8`] for [`RandDist::Keep`].
    pub fn supports(&self, dtype: DType) -> bool {
        match self {
            RandDist::Keep { .. } => dtype == DType::U8,
            _ => dtype.is_float(),
        }
    }
}

/// Memory held by a backend on one device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in live tensors.
    pub in_use: usize,
    /// Highest `in_use` since the device was initialized (or the peak was reset).
    pub peak: usize,
    /// Bytes the backend holds from the system, cached free blocks included.
    pub reserved: usize,
}

/// What a fused attention kernel computes ([`Backend::attention_forward`]):
/// `dropout(softmax(q kᵀ · scale + causal mask)) · v` per batch entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Multiplies the scores `q kᵀ` (PyTorch's default is `1/√d`).
    pub scale: f64,
    /// Query `i` sees keys `0..=i` only (top-left aligned when `Tq != Tk`, PyTorch's
    /// `is_causal`).
    pub causal: bool,
    /// Dropout probability on the attention weights (0: none). Weight `n` (the row-major
    /// index over `[batch.., Tq, Tk]`) is kept, scaled by `1/(1 - p)`, when the f32 uniform of
    /// [`crate::philox`] for counter `n` and key `dropout_key` is at least `p` (the composed
    /// path's `rand_like` + `compare_scalar(Ge, p)` in f32), so forward and backward use the same
    /// mask (drawn again, or kept by the forward: [`AttentionOutputs`]) and an f32 composed
    /// attention drawn with the same key drops the same weights. A backend may instead draw
    /// from its library's generator keyed by `dropout_key` (the CUDA backend's 16-bit attention
    /// on cuDNN's engines): each weight is still kept with probability `1 - p`, forward and
    /// backward use one mask, but the draws differ from this stream's.
    pub dropout_p: f64,
    /// The Philox key of the dropout mask ([`Generator::next_key`](crate::Generator::next_key)).
    pub dropout_key: u64,
}

/// One operand of a fused attention call: a storage and its layout.
pub type Operand<'a, S> = (&'a S, &'a Layout);

/// The tensor mask of a fused attention call ([`Backend::attention_forward`]), laid out in the
/// scores' shape `[batch.., Tq, Tk]` (zero strides where it broadcasts), on top of
/// [`AttentionSpec::causal`].
pub enum AttnMaskOperand<'a, S> {
    /// `u8`, nonzero where query `i` may attend to key `j` (PyTorch's boolean `attn_mask`).
    Keep(Operand<'a, S>),
    /// Of the call's dtype, added to the scaled scores (`-inf` forbids a pair); it gets no
    /// gradient.
    Additive(Operand<'a, S>),
}

// Not derived: the derive would ask `S: Copy` of the storage, which only the references need.
impl<S> Clone for AttnMaskOperand<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for AttnMaskOperand<'_, S> {}

/// One output of a fused attention call: a fresh storage holding exactly the output's elements
/// and the layout to view it with (offset 0; see [`attention_output_layout`]).
pub type AttentionOutput<S> = (S, Layout);

/// The outputs of [`Backend::attention_forward`]: the attention `[batch.., Tq, dv]` in the
/// inputs' dtype with its layout (O mirrors q's axis order: [`attention_output_layout`]), the
/// log-sum-exp of each row of scaled scores `[batch.., Tq]` in f32, contiguous (`+inf` for a
/// row with no key left, so that `exp(s - lse)` is 0 there), and, with dropout, what the
/// backend kept of the mask for its backward (opaque: the CUDA backend's bits, one per weight),
/// which the caller hands back to [`Backend::attention_backward`].
pub type AttentionOutputs<S> = (AttentionOutput<S>, S, Option<S>);

/// The outputs of [`Backend::attention_backward`]: the gradients `dq`, `dk`, `dv` in the shapes
/// of `q`, `k`, `v`. dQ/dK/dV mirror q/k/v's layouts: either three storages, each laid out by
/// [`attention_output_layout`], or — when `q`, `k` and `v` are the three head views of one
/// packed projection ([`attention_packed_layouts`]) — one storage holding all three in the
/// operands' own layout, so the gradient of the packed projection is that storage as is (no
/// zero-filled buffer, no slice assignments, no sum).
#[derive(Debug)]
pub struct AttentionGrads<S> {
    /// Fresh storages (one or three).
    pub storages: Vec<S>,
    /// For `dq`, `dk`, `dv` in turn: the index in `storages` of the one it lies in, and its
    /// layout there.
    pub grads: [(usize, Layout); 3],
}

impl<S> AttentionGrads<S> {
    /// Three separate gradients, each in its own storage.
    pub fn separate(
        dq: AttentionOutput<S>,
        dk: AttentionOutput<S>,
        dv: AttentionOutput<S>,
    ) -> Self {
        AttentionGrads {
            storages: vec![dq.0, dk.0, dv.0],
            grads: [(0, dq.1), (1, dk.1), (2, dv.1)],
        }
    }
}

/// What a fused layer norm or RMS norm computes ([`Backend::layer_norm_forward`]): each row of
/// `cols` elements (the normalized trailing axes, flattened) of `rows` rows normalized on its
/// own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    /// Layer norm (subtracts the row mean; the biased variance) or RMS norm (the mean square).
    pub centered: bool,
    /// Added to the variance (or mean square) before the reciprocal square root.
    pub eps: f64,
    /// The number of rows (the product of the leading axes).
    pub rows: usize,
    /// The number of normalized elements of a row.
    pub cols: usize,
}

/// The outputs of [`Backend::layer_norm_forward`]: `y` (contiguous, the input's shape and
/// dtype), the row means `[rows]` (layer norm only) and the row `rstd = 1/√(var + eps)` `[rows]`,
/// both in the input's compute dtype (f32 for f32 and the 16-bit floats, f64 for f64).
pub type NormOutputs<S> = (S, Option<S>, S);

/// The outputs of [`Backend::layer_norm_backward`]: `dx` (contiguous, the input's shape and
/// dtype), and `dw`, `db` `[cols]` in the input's dtype where asked for.
pub type NormGrads<S> = (Option<S>, Option<S>, Option<S>);

/// The geometry of a 2-d convolution over `[n, c, h, w]` ([`Backend::conv2d`]): PyTorch's
/// `stride`, `padding` (zeros, on both sides), `dilation` and `groups`, per spatial axis
/// (height, width).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dSpec {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Conv2dSpec {
    /// The output `[n, oc, oh, ow]` of input `x` `[n, c, h, w]` and weight `w`
    /// `[oc, c/groups, kh, kw]` (PyTorch's formula), or `None` when they do not fit: a zero
    /// stride, dilation or group count, channels not divisible by the groups, or a window larger
    /// than the padded input.
    pub fn output_dims(&self, x: [usize; 4], w: [usize; 4]) -> Option<[usize; 4]> {
        let [n, c, h, wd] = x;
        let [oc, cg, kh, kw] = w;
        let g = self.groups;
        if g == 0 || self.stride.contains(&0) || self.dilation.contains(&0) {
            return None;
        }
        if cg * g != c || !oc.is_multiple_of(g) || kh == 0 || kw == 0 {
            return None;
        }
        let len = |i: usize, k: usize, axis: usize| {
            let span = self.dilation[axis] * (k - 1) + 1;
            let padded = i + 2 * self.padding[axis];
            (padded >= span).then(|| (padded - span) / self.stride[axis] + 1)
        };
        Some([n, oc, len(h, kh, 0)?, len(wd, kw, 1)?])
    }
}

/// A compute device family (CPU, CUDA, the f64 reference).
///
/// All methods are associated functions: state lives in the storages and in per-device state the
/// backend keeps itself. See the module docs for the contract every kernel follows.
pub trait Backend: Sized + Clone + Copy + Debug + Send + Sync + 'static {
    /// One device of this backend. `Display` gives `cpu`, `cuda:1`, ...
    type Device: Clone + Debug + Display + PartialEq + Eq + Hash + Send + Sync + 'static;
    /// One untyped buffer on one device.
    type Storage: Debug + Send + Sync + 'static;

    /// A short name for messages (`cpu`, `cuda`, `reference`).
    const NAME: &'static str;

    // ---- devices -------------------------------------------------------------------------

    /// The devices usable now (empty when, e.g., no GPU or no driver is present).
    fn devices() -> Vec<Self::Device>;
    /// Parses `cpu`, `cuda`, `cuda:1`, ...; an error when the name is not this backend's or the
    /// device does not exist.
    fn parse_device(name: &str) -> Result<Self::Device>;
    /// Waits until all work queued on `device` has finished.
    fn synchronize(device: &Self::Device) -> Result<()>;
    /// Whether the calling thread is recording work on `device` into a graph (CUDA graph
    /// capture) instead of running it: then nothing may synchronize, time or read back values
    /// on that device. Default: `false` (a backend without graphs never captures).
    fn is_capturing(device: &Self::Device) -> bool {
        let _ = device;
        false
    }
    /// Runs `first`, then `second`, and returns both results; neither may read what the other
    /// writes. A backend may run their device work concurrently where it pays: `(dtype,
    /// flops)` is the smaller one's arithmetic, the backend's hint of whether it does. CUDA
    /// queues `second` on a side stream that starts where the current stream stands, and makes
    /// the current stream wait for it before returning, so that later work sees both results
    /// (a linear layer's two gradient products fill each other's last partial wave of blocks).
    /// Realize every deferred value both read before the call ([`Tensor::realize`]): one
    /// realized inside `first` would be computed after `second` may have read it.
    /// Default: one after the other.
    fn concurrently<R1, R2>(
        device: &Self::Device,
        (dtype, flops): (DType, u64),
        first: impl FnOnce() -> Result<R1>,
        second: impl FnOnce() -> Result<R2>,
    ) -> Result<(R1, R2)> {
        let _ = (device, dtype, flops);
        let a = first()?;
        Ok((a, second()?))
    }
    fn memory_stats(device: &Self::Device) -> Result<MemoryStats>;
    /// Returns cached, unused memory to the system.
    fn empty_cache(device: &Self::Device) -> Result<()>;

    // ---- memory --------------------------------------------------------------------------

    fn storage_device(storage: &Self::Storage) -> Self::Device;
    /// A buffer of `len` elements, all equal to `value` (converted with an `as` cast).
    fn fill(device: &Self::Device, dtype: DType, len: usize, value: f64) -> Result<Self::Storage>;
    fn from_host(device: &Self::Device, data: &HostBuffer) -> Result<Self::Storage>;
    /// Runs any work still deferred for `storage` (a backend may defer elementwise ops to fuse
    /// them, as the CUDA backend does); without a host synchronization. Default: nothing to do.
    fn realize(storage: &Self::Storage) -> Result<()> {
        let _ = storage;
        Ok(())
    }
    /// Whether `storage` still holds deferred work ([`Backend::realize`] would run it).
    /// Default: never.
    fn is_deferred(storage: &Self::Storage) -> bool {
        let _ = storage;
        false
    }
    /// The elements of `layout`, in row-major order.
    fn to_host(storage: &Self::Storage, layout: &Layout, dtype: DType) -> Result<HostBuffer>;

    // ---- host transfers without waste (defaults go through `HostBuffer`) -------------------

    /// A storage of `dtype` on `device` holding `src.bytes`, without an intermediate host copy
    /// where the backend can avoid one. A GPU backend copies pinned sources asynchronously,
    /// keeping `src.owner` alive until the copy is done; any other source is copied before the
    /// call returns (the caller may reuse its memory at once).
    fn from_host_source(
        device: &Self::Device,
        dtype: DType,
        src: HostSource<'_>,
    ) -> Result<Self::Storage> {
        Self::from_host(
            device,
            &HostBuffer::from_bytes("from_host", dtype, src.bytes)?,
        )
    }
    /// Several storages from host sources at once, like [`Self::from_host_source`] on each (a
    /// batch's features and labels): a GPU backend orders all of them with one event instead
    /// of one each.
    fn from_host_sources(
        device: &Self::Device,
        srcs: Vec<(DType, HostSource<'_>)>,
    ) -> Result<Vec<Self::Storage>> {
        srcs.into_iter()
            .map(|(dtype, src)| Self::from_host_source(device, dtype, src))
            .collect()
    }
    /// Rows `rows` of each of `srcs` gathered into new storages on `device` by the device
    /// itself, reading straight from page-locked host memory (a GPU reads mapped host memory
    /// over the bus, so the host copies nothing): the DataLoader's path for a pinned dataset.
    /// Asynchronous like a pinned upload: the sources stay alive until the gather is done, and
    /// work that reads a storage waits for it. `Ok(None)` when the backend cannot (the caller
    /// gathers on the host instead); the default. A row number out of range is an error.
    fn gather_host_rows(
        device: &Self::Device,
        srcs: &[HostRows],
        rows: &[usize],
    ) -> Result<Option<Vec<Self::Storage>>> {
        let _ = (device, srcs, rows);
        Ok(None)
    }
    /// Rows `rows` (consecutive) of each of `srcs` copied into new storages on `device`, as
    /// [`Self::gather_host_rows`] would gather them: decoded on the device where the rows hold
    /// bytes ([`HostRows::bytes_over`]), with the sources' known id bounds. The DataLoader's path
    /// for an epoch in order over a pinned dataset: a GPU moves each range by one DMA on a copy
    /// engine and decodes it on its copy stream, off the caller's stream. Asynchronous like a
    /// pinned upload. `Ok(None)` when the backend cannot (the caller uploads the stored bytes
    /// and decodes them itself); the default. A range past an array's rows is an error.
    fn copy_host_rows(
        device: &Self::Device,
        srcs: &[HostRows],
        rows: std::ops::Range<usize>,
    ) -> Result<Option<Vec<Self::Storage>>> {
        let _ = (device, srcs, rows);
        Ok(None)
    }
    /// Whether [`Self::gather_host_rows`] can run on `device` (it returns `Ok(None)` when not).
    fn gathers_host_rows(device: &Self::Device) -> bool {
        let _ = device;
        false
    }
    /// Takes ownership of a host buffer (saves a copy on host backends).
    fn from_host_owned(device: &Self::Device, data: HostBuffer) -> Result<Self::Storage> {
        Self::from_host(device, &data)
    }
    /// The elements of `layout` as host bytes, when the storage lives in host memory and the
    /// layout is contiguous (`owner` set to the storage, so a device copy may run
    /// asynchronously). `None` for device memory: the caller reads it with [`Self::to_host_bytes`].
    fn host_source<'a>(
        storage: &'a std::sync::Arc<Self::Storage>,
        layout: &Layout,
        dtype: DType,
    ) -> Option<HostSource<'a>> {
        let _ = (storage, layout, dtype);
        None
    }
    /// Writes the elements of `layout` in row-major order into `out` (exactly `elem_count *
    /// size` bytes), synchronizing with the device: reading into a buffer the caller owns, so
    /// a loop reuses its memory.
    fn to_host_bytes(
        storage: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        out: &mut [u8],
    ) -> Result<()> {
        let h = Self::to_host(storage, layout, dtype)?;
        out.copy_from_slice(h.as_bytes());
        Ok(())
    }
    /// The bytes of a contiguous host storage, writable (for `Tensor::copy_from` of another
    /// backend's tensor); `None` when the storage is device memory or `layout` is not
    /// contiguous.
    fn host_bytes_mut<'a>(
        storage: &'a mut Self::Storage,
        layout: &Layout,
        dtype: DType,
    ) -> Option<&'a mut [u8]> {
        let _ = (storage, layout, dtype);
        None
    }
    /// A copy of the elements of `layout` in page-locked host memory (`Tensor::pin_memory`);
    /// only host backends with a registered pinned allocator support it.
    fn pin_memory(storage: &Self::Storage, layout: &Layout, dtype: DType) -> Result<Self::Storage> {
        let _ = (storage, layout, dtype);
        Err(Error::invalid(
            "pin_memory",
            format!(
                "the {} backend's memory cannot be pinned (only CPU tensors can)",
                Self::NAME
            ),
        ))
    }
    /// Whether the storage lies in page-locked host memory.
    fn is_pinned(storage: &Self::Storage) -> bool {
        let _ = storage;
        false
    }
    /// The elements of `layout`, contiguous, in a new buffer on `dst` (which may be the same
    /// device: `copy_to` always copies).
    fn copy_to_device(
        storage: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        dst: &Self::Device,
    ) -> Result<Self::Storage>;
    /// Writes the elements of `src_layout` into `dst` at `dst_layout` (same shape), in place.
    /// Used to build concatenations and by in-place updates.
    fn copy_into(
        src: &Self::Storage,
        src_layout: &Layout,
        dst: &mut Self::Storage,
        dst_layout: &Layout,
        dtype: DType,
    ) -> Result<()>;
    /// The elements of `layout`, contiguous, in a new buffer on the same device.
    fn contiguous(storage: &Self::Storage, layout: &Layout, dtype: DType) -> Result<Self::Storage>;
    /// `len` random values from Philox4x32-10 under key `seed`, exactly as [`crate::philox`]
    /// defines (an f32, 16-bit or keep-mask element `i` takes word `i % 4` of counter `i / 4`;
    /// an f64 uniform or any normal takes counter `i`), so every backend draws the same numbers.
    /// A [`Generator`](crate::Generator) passes a fresh key per draw
    /// ([`philox::draw_key`](crate::philox::draw_key)).
    fn rand(
        device: &Self::Device,
        dtype: DType,
        len: usize,
        seed: u64,
        dist: RandDist,
    ) -> Result<Self::Storage>;

    // ---- kernels -------------------------------------------------------------------------

    fn unary(
        op: UnaryOp,
        s: &Self::Storage,
        layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// `op(lhs, rhs)`; both layouts have the output's shape (broadcast by stride 0).
    fn binary(
        op: BinaryOp,
        lhs: &Self::Storage,
        lhs_layout: &Layout,
        rhs: &Self::Storage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// `op(x, scalar)`, or `op(scalar, x)` when `scalar_lhs`. The scalar is a kernel argument;
    /// for `i64`/`u8` it is first converted to the dtype (`as`), then the op is exact.
    fn binary_scalar(
        op: BinaryOp,
        s: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        scalar: f64,
        scalar_lhs: bool,
    ) -> Result<Self::Storage>;
    /// A `u8` mask; both layouts have the output's shape.
    fn compare(
        op: CmpOp,
        lhs: &Self::Storage,
        lhs_layout: &Layout,
        rhs: &Self::Storage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// `cond ? on_true : on_false` elementwise; `cond` is `u8` and any nonzero byte selects
    /// `on_true`; all three layouts have the output's shape.
    #[allow(clippy::too_many_arguments)]
    fn where_cond(
        cond: &Self::Storage,
        cond_layout: &Layout,
        on_true: &Self::Storage,
        true_layout: &Layout,
        on_false: &Self::Storage,
        false_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// Reduces the given (sorted, distinct) axes; the output is contiguous with those axes kept
    /// as size 1. Arg reductions get exactly one axis and return `i64`.
    fn reduce(
        op: ReduceOp,
        s: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        axes: &[usize],
    ) -> Result<Self::Storage>;
    /// Batched matrix product. `lhs_layout` is `[batch, m, k]`, `rhs_layout` is `[batch, k, n]`;
    /// each matrix is either row-major (`strides[2] == 1`, leading dimension `strides[1]`) or
    /// column-major (`strides[1] == 1`, leading dimension `strides[2]`), with a leading dimension
    /// of at least 1 and at least the matrix's inner extent; the batch stride is arbitrary
    /// (0 broadcasts). Output: `[batch, m, n]`, contiguous.
    fn matmul(
        lhs: &Self::Storage,
        lhs_layout: &Layout,
        rhs: &Self::Storage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// Softmax (or log-softmax when `log`) over the last axis; output contiguous.
    fn softmax(
        s: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        log: bool,
    ) -> Result<Self::Storage>;
    /// Softmax cross-entropy per row: `logits` is `[n, c]`, `labels` is `i64` `[n]`; returns
    /// `[n]` losses `logsumexp(row) - row[label]`. A label outside `0..c` is
    /// [`Error::IndexOutOfRange`].
    fn cross_entropy(
        logits: &Self::Storage,
        logits_layout: &Layout,
        labels: &Self::Storage,
        labels_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// Gradient of [`Backend::cross_entropy`] w.r.t. the logits, in one kernel:
    /// `(softmax(row) - onehot(label)) * grad[row]`, with `grad` of shape `[n]`; output `[n, c]`.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        logits: &Self::Storage,
        logits_layout: &Layout,
        labels: &Self::Storage,
        labels_layout: &Layout,
        grad: &Self::Storage,
        grad_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage>;
    /// Converts every element (`as` semantics: float to int truncates and saturates).
    fn cast(s: &Self::Storage, layout: &Layout, from: DType, to: DType) -> Result<Self::Storage>;
    /// Picks entries `ids` (1-d, `i64`) along `axis`; the output has `dims[axis] = ids.len()`.
    /// An index outside `0..dims[axis]` is [`Error::IndexOutOfRange`] (also for `gather` and
    /// `scatter_add`).
    #[allow(clippy::too_many_arguments)]
    fn index_select(
        s: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        ids: &Self::Storage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<Self::Storage>;
    /// `torch.gather`: `out[i][j][k] = s[i][ids[i][j][k]][k]` for `axis == 1`, and so on.
    /// `ids` has the same rank as `s` and the output's shape; other dims of `ids` must not exceed
    /// those of `s`.
    fn gather(
        s: &Self::Storage,
        layout: &Layout,
        dtype: DType,
        ids: &Self::Storage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<Self::Storage>;
    /// Out of place `torch.scatter_add`: a copy of `base` (contiguous) with
    /// `out[..ids[i][j]..] += src[i][j]` along `axis`. `ids` and `src` have the same shape.
    /// Summation order is unspecified on the GPU (results may differ in the last bits).
    #[allow(clippy::too_many_arguments)]
    fn scatter_add(
        base: &Self::Storage,
        base_layout: &Layout,
        dtype: DType,
        ids: &Self::Storage,
        ids_layout: &Layout,
        src: &Self::Storage,
        src_layout: &Layout,
        axis: usize,
    ) -> Result<Self::Storage>;

    /// The gradient of `y = op(x)` with respect to `x`, `g · op'(x)`, where `op'` is computed
    /// from `saved`: `x` or `y`, as [`UnaryOp::grad_reads`] says (for an op whose rule reads
    /// neither, `saved` is only a buffer of the right shape). Float dtypes; both layouts have
    /// the output's shape (`g` may be a broadcast view). The default runs the op table's rule
    /// through [`Backend::eval_expr`] ([`unary_backward_by_rule`]); a backend that defers
    /// elementwise work records it instead.
    fn unary_backward(
        op: UnaryOp,
        saved: &Self::Storage,
        saved_layout: &Layout,
        g: &Self::Storage,
        g_layout: &Layout,
        dtype: DType,
    ) -> Result<Self::Storage> {
        unary_backward_by_rule::<Self>(op, saved, saved_layout, g, g_layout, dtype)
    }

    /// Applies `rule` to every slot and returns, per slot, the new parameter and the new state
    /// buffers (out of place). With `grad_scale` (one element of `dtype` on the slots' device)
    /// every gradient is multiplied by it first, inside the update
    /// ([`UpdateRule::program_scaled`]). The default evaluates the rule's expression program
    /// ([`UpdateRule::program`]) once per slot through [`Backend::eval_expr`]: one fused pass
    /// per parameter on a backend that fuses programs (the CPU), op by op on one that does not
    /// (the reference). A GPU backend overrides it with a multi-tensor kernel that updates all
    /// parameters in a handful of launches.
    #[allow(clippy::type_complexity)]
    fn fused_update(
        rule: &UpdateRule,
        dtype: DType,
        slots: &[UpdateSlot<'_, Self::Storage>],
        grad_scale: Option<&Self::Storage>,
    ) -> Result<Vec<(Self::Storage, Vec<Self::Storage>)>> {
        let (program, params) = rule.program_scaled(dtype, grad_scale.is_some())?;
        slots
            .iter()
            .map(|slot| {
                let l = Layout::contiguous([slot.len]);
                // The factor's one element, read for every element of the slot.
                let one = Layout::from_parts(l.shape().clone(), [0], 0);
                let mut inputs = vec![(slot.param, &l), (slot.grad, &l)];
                inputs.extend(slot.state.iter().map(|s| (*s, &l)));
                inputs.extend(grad_scale.map(|s| (s, &one)));
                let dev = Self::storage_device(slot.param);
                let mut outs = Self::eval_expr(&dev, &program, l.shape(), &inputs, &params)?;
                if outs.is_empty() {
                    return Err(Error::backend(
                        "fused_update",
                        "the update program returned no outputs",
                    ));
                }
                let p = outs.remove(0);
                Ok((p, outs))
            })
            .collect()
    }

    /// Unscales the gradients of dynamic loss scaling and checks them for inf/NaN in one pass
    /// (PyTorch's `_amp_foreach_non_finite_check_and_unscale_`): returns, per slot, `g · inv`
    /// (out of place, `dtype`, computed in f32 for the 16-bit floats and in `dtype` otherwise,
    /// rounded once: [`crate::unscale::unscale_program`]), and one f32 flag of one element on
    /// the slots' device: 0 when every unscaled element is finite, [`FOUND_NON_FINITE`] when
    /// some is inf or NaN. `slots` is not empty, of one float `dtype` and one device (the
    /// caller checks). The default evaluates the program once per slot through
    /// [`Backend::eval_expr`] and unites the flags with a maximum ([`unscale_check_composed`]);
    /// a GPU backend overrides it with one multi-tensor kernel for all slots.
    fn unscale_check(
        dtype: DType,
        inv_scale: f64,
        slots: &[UnscaleSlot<'_, Self::Storage>],
    ) -> Result<(Vec<Self::Storage>, Self::Storage)> {
        unscale_check_composed::<Self>(dtype, inv_scale, slots)
    }

    /// The sum of the squares of every element of `slots` (each `len` contiguous elements of
    /// `dtype`, a float dtype; at least one slot; one device), accumulated in f64, as a storage
    /// of one f64 element on their device: gradient clipping's global norm, squared (PyTorch's
    /// `_foreach_norm` and the sum of its results). The default evaluates
    /// [`crate::unscale::sq_sum_program`] once per slot through [`Backend::eval_expr`] and adds
    /// the sums in slot order ([`sq_sum_composed`]); a GPU backend overrides it with one
    /// multi-tensor kernel for all slots (in an order of summation of its own, the same on every
    /// call).
    fn sq_sum(dtype: DType, slots: &[UnscaleSlot<'_, Self::Storage>]) -> Result<Self::Storage> {
        sq_sum_composed::<Self>(dtype, slots)
    }

    /// Fused scaled dot-product attention in the flash-attention manner: `q` `[batch.., Tq,
    /// d]`, `k` `[batch.., Tk, d]`, `v` `[batch.., Tk, dv]` (the same batch axes, no
    /// broadcasting between them), without storing the `Tq × Tk` scores. Returns the output
    /// with its layout (contiguous, or mirroring q's axis order as [`attention_output_layout`]
    /// lays it out) and the row log-sum-exps ([`AttentionOutputs`]), which
    /// [`Backend::attention_backward`] recomputes the weights from (it must accept the output in
    /// the layout it returned).
    ///
    /// `mask`, when given, is a boolean or an additive mask ([`AttnMaskOperand`]) in the scores'
    /// shape. A row whose keys are all masked (by `false`, or by `-inf` added) gives an output
    /// of zeros and a log-sum-exp of `+inf`. A backend may offer some masks and not others.
    ///
    /// `Ok(None)` means "not offered" for this call (dtype, head size, layout): the caller
    /// (kiln-autograd's `scaled_dot_product_attention`) composes attention from products and a
    /// softmax instead. The default offers nothing, so the CPU and the reference backend keep
    /// the composed path; a backend that returns `Some` here must implement the backward too.
    fn attention_forward(
        q: Operand<'_, Self::Storage>,
        k: Operand<'_, Self::Storage>,
        v: Operand<'_, Self::Storage>,
        mask: Option<AttnMaskOperand<'_, Self::Storage>>,
        dtype: DType,
        spec: AttentionSpec,
    ) -> Result<Option<AttentionOutputs<Self::Storage>>> {
        let _ = (q, k, v, mask, dtype, spec);
        Ok(None)
    }

    /// The gradients `(dq, dk, dv)` (in the shapes of `q`, `k`, `v`, each with its layout: a
    /// backend may keep them contiguous or mirror its operand's axis order as
    /// [`attention_output_layout`] does) of a fused
    /// attention whose forward gave `out` and `lse`, for the output gradient `g`, by
    /// recomputing the weights tile by tile from `lse` (the `Tq × Tk` matrix is never stored).
    /// `attn_mask` is the forward's tensor mask, `mask` what the forward kept of its dropout
    /// mask.
    /// `Ok(None)` when not offered (the default); a backend that fused the forward must offer it.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: Operand<'_, Self::Storage>,
        k: Operand<'_, Self::Storage>,
        v: Operand<'_, Self::Storage>,
        attn_mask: Option<AttnMaskOperand<'_, Self::Storage>>,
        out: Operand<'_, Self::Storage>,
        lse: Operand<'_, Self::Storage>,
        mask: Option<&Self::Storage>,
        g: Operand<'_, Self::Storage>,
        dtype: DType,
        spec: AttentionSpec,
    ) -> Result<Option<AttentionGrads<Self::Storage>>> {
        let _ = (q, k, v, attn_mask, out, lse, mask, g, dtype, spec);
        Ok(None)
    }

    /// Layer norm (`spec.centered`) or RMS norm over the last `spec.cols` elements of each row
    /// of `x` in one pass (PyTorch's `vectorized_layer_norm_kernel`): the row statistics in the
    /// compute dtype ([`NormOutputs`]),
    /// then `(x - mean) · rstd · w + b` (or `x · rstd · w`), `weight` and `bias` `[cols]` of
    /// `dtype` when given. Any layouts (a backend may copy to contiguous first).
    ///
    /// `Ok(None)` means "not offered" for this call (dtype, row length): the caller
    /// (kiln-autograd's `Var::layer_norm`) runs its composed expression programs instead. The
    /// default offers nothing, so the CPU backend keeps the composed path (the reference backend
    /// offers it by plain loops, the CUDA backend by its kernels); a backend that answers `Some`
    /// must answer [`Backend::layer_norm_backward`] for its result.
    fn layer_norm_forward(
        x: Operand<'_, Self::Storage>,
        weight: Option<Operand<'_, Self::Storage>>,
        bias: Option<Operand<'_, Self::Storage>>,
        dtype: DType,
        spec: NormSpec,
    ) -> Result<Option<NormOutputs<Self::Storage>>> {
        let _ = (x, weight, bias, dtype, spec);
        Ok(None)
    }

    /// The gradients of a [`Backend::layer_norm_forward`] for the output gradient `g` (the
    /// shape of `x`, of `dtype`), from the forward's input, statistics and weight:
    /// `dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ x̂))` with `ĝ = g · w` (no `mean(ĝ)` term for RMS
    /// norm), `dw = Σ_rows g x̂`, `db = Σ_rows g`, each computed only where `needs` (dx, dw, db)
    /// asks. `dx_acc` (the shape of `x`, of `dtype`), when given, is added to `dx` in the same
    /// pass: the gradient already accumulated for `x` by its other readers (a residual
    /// connection), which the backward engine would otherwise add by a pass of its own.
    /// `Ok(None)` when not offered (the default).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        x: Operand<'_, Self::Storage>,
        mean: Option<Operand<'_, Self::Storage>>,
        rstd: Operand<'_, Self::Storage>,
        weight: Option<Operand<'_, Self::Storage>>,
        g: Operand<'_, Self::Storage>,
        dx_acc: Option<Operand<'_, Self::Storage>>,
        dtype: DType,
        spec: NormSpec,
        needs: [bool; 3],
    ) -> Result<Option<NormGrads<Self::Storage>>> {
        let _ = (x, mean, rstd, weight, g, dx_acc, dtype, spec, needs);
        Ok(None)
    }

    // ---- linear layers with fused epilogues (offered by a backend, or not) ------------------

    /// `act(x · wᵀ + bias)` by one library product whose epilogue adds the bias and applies the
    /// activation (module [`crate::epilogue`]): `x` `[m, k]`, `w` `[n, k]`, `bias` `[n]`, of
    /// `dtype` except the bias, which may be f32 under 16-bit operands where the library wants
    /// it so; any layout (the backend declines what it cannot take). With `keep_aux` the result
    /// carries what [`Backend::linear_epilogue_backward`] needs.
    ///
    /// `Ok(None)` means "not offered" for this call (dtype, activation, alignment): the caller
    /// (kiln-autograd's `Var::linear_act`) composes a product, a bias add and the activation.
    /// The default offers nothing. A backend that answers `Some` with `keep_aux` must offer the
    /// backward for that result.
    #[allow(clippy::too_many_arguments)]
    fn linear_epilogue(
        x: Operand<'_, Self::Storage>,
        w: Operand<'_, Self::Storage>,
        bias: Option<(Operand<'_, Self::Storage>, DType)>,
        dtype: DType,
        act: Activation,
        keep_aux: bool,
    ) -> Result<Option<EpilogueOutputs<Self::Storage>>> {
        let _ = (x, w, bias, dtype, act, keep_aux);
        Ok(None)
    }

    /// The gradients of a [`Backend::linear_epilogue`] for the output gradient `g` `[m, n]`
    /// (of `dtype`), from `x`, `w`, the forward's `aux` and the activation: `dpre = g · act'`,
    /// `dx = dpre · w`, `dw = dpreᵀ · x` and `db = Σ_rows dpre` (when `bias_dtype` is given),
    /// the bias gradient and the activation's derivative in the products' epilogues where the
    /// library offers them (cuBLASLt's `DRELU_BGRAD`, `DGELU_BGRAD`, `BGRADB`). `Ok(None)` when
    /// not offered (the default).
    #[allow(clippy::too_many_arguments)]
    fn linear_epilogue_backward(
        x: Operand<'_, Self::Storage>,
        w: Operand<'_, Self::Storage>,
        aux: Option<&Self::Storage>,
        g: Operand<'_, Self::Storage>,
        dtype: DType,
        bias_dtype: Option<DType>,
        act: Activation,
    ) -> Result<Option<EpilogueGrads<Self::Storage>>> {
        let _ = (x, w, aux, g, dtype, bias_dtype, act);
        Ok(None)
    }

    // ---- library convolutions (offered by a backend, or not) -------------------------------

    /// Whether [`Backend::conv2d`] may answer `Some` for operands of `dtype` on `device` (a cheap
    /// check, so that a caller prepares nothing, such as an autocast copy, for a convolution
    /// the backend will not run). Default: `false`.
    fn offers_conv2d(device: &Self::Device, dtype: DType) -> bool {
        let _ = (device, dtype);
        false
    }
    /// A 2-d convolution (cross-correlation, as every framework computes it) by the backend's
    /// own library: `x` `[n, c, h, w]` and `w` `[oc, c/groups, kh, kw]`, of one float dtype,
    /// any layouts; returns `[n, oc, oh, ow]` contiguous. The caller has checked the shapes
    /// ([`Conv2dSpec::output_dims`]). `Ok(None)` (the default) when the backend does not offer
    /// it for these operands: the caller then computes it from generic ops (im2col and one
    /// GEMM), as the CPU does. A backend that answers `Some` here must also answer
    /// [`Backend::conv2d_backward_data`] and [`Backend::conv2d_backward_filter`] for the same
    /// operands, so that a recorded convolution can be differentiated.
    fn conv2d(
        x: &Self::Storage,
        x_layout: &Layout,
        w: &Self::Storage,
        w_layout: &Layout,
        dtype: DType,
        spec: &Conv2dSpec,
    ) -> Result<Option<Self::Storage>> {
        let _ = (x, x_layout, w, w_layout, dtype, spec);
        Ok(None)
    }
    /// `act(conv2d(x, w) + bias)` in one library call (an inference epilogue: a convolution
    /// whose output gets a per-channel `bias` `[oc]` added and `act` applied before it is
    /// written), for the folded Conv + BatchNorm (+ ReLU) of kiln-nn's `ConvBnAct` in eval
    /// mode: `x` `[n, c, h, w]`, `w` `[oc, c/groups, kh, kw]` and `bias` of one float dtype,
    /// any layouts; returns `[n, oc, oh, ow]` contiguous. Forward only: nothing is recorded,
    /// no gradient is offered. The caller has checked the shapes ([`Conv2dSpec::output_dims`]).
    /// `Ok(None)` (the default) when not offered for these operands or this activation: the
    /// caller then runs the convolution, the bias add and the activation one after the other.
    #[allow(clippy::too_many_arguments)]
    fn conv2d_bias_act(
        x: Operand<'_, Self::Storage>,
        w: Operand<'_, Self::Storage>,
        bias: Operand<'_, Self::Storage>,
        dtype: DType,
        spec: &Conv2dSpec,
        act: Activation,
    ) -> Result<Option<Self::Storage>> {
        let _ = (x, w, bias, dtype, spec, act);
        Ok(None)
    }
    /// The gradient of [`Backend::conv2d`] with respect to its input, `[n, c, h, w]` =
    /// `x_dims`, from the weight and the output's gradient `dy` `[n, oc, oh, ow]`; contiguous.
    /// `Ok(None)` (the default) when not offered.
    #[allow(clippy::too_many_arguments)]
    fn conv2d_backward_data(
        w: &Self::Storage,
        w_layout: &Layout,
        dy: &Self::Storage,
        dy_layout: &Layout,
        dtype: DType,
        x_dims: [usize; 4],
        spec: &Conv2dSpec,
    ) -> Result<Option<Self::Storage>> {
        let _ = (w, w_layout, dy, dy_layout, dtype, x_dims, spec);
        Ok(None)
    }
    /// The gradient of [`Backend::conv2d`] with respect to its weight, `[oc, c/groups, kh, kw]`
    /// = `w_dims`, from the input and the output's gradient `dy`; contiguous. `Ok(None)` (the
    /// default) when not offered.
    #[allow(clippy::too_many_arguments)]
    fn conv2d_backward_filter(
        x: &Self::Storage,
        x_layout: &Layout,
        dy: &Self::Storage,
        dy_layout: &Layout,
        dtype: DType,
        w_dims: [usize; 4],
        spec: &Conv2dSpec,
    ) -> Result<Option<Self::Storage>> {
        let _ = (x, x_layout, dy, dy_layout, dtype, w_dims, spec);
        Ok(None)
    }

    /// Evaluates an expression program (module `expr`) over `inputs`, each laid out in the
    /// iteration shape `shape` (broadcast by stride 0), with `params` converted to the
    /// parameters' dtypes. Returns one contiguous buffer per output: the iteration shape for
    /// elementwise outputs, the kept shape (reduction axes set to 1) for reduced ones. A backend
    /// without a fused evaluator returns `kiln_core::expr::eval_composed::<Self>(...)` (one of
    /// its kernels per instruction); a fused evaluator must agree with that within float
    /// rounding. (No default: it would make this module import the evaluators above it.)
    fn eval_expr(
        device: &Self::Device,
        program: &Program,
        shape: &Shape,
        inputs: &[(&Self::Storage, &Layout)],
        params: &[f64],
    ) -> Result<Vec<Self::Storage>>;
}

/// [`Backend::unary_backward`] by the op table's rule ([`UnaryOp::vjp`]): the program
/// `g · op'(saved)` (inputs: the saved operand, `g`) run by the backend's own
/// [`Backend::eval_expr`]. The deferral's lowering splices the same program into its chains, so
/// a backward computes the same bits deferred or not.
pub fn unary_backward_by_rule<B: Backend>(
    op: UnaryOp,
    s: &B::Storage,
    ls: &Layout,
    g: &B::Storage,
    lg: &Layout,
    dtype: DType,
) -> Result<B::Storage> {
    if !dtype.is_float() {
        return Err(Error::DTypeMismatch {
            op: "unary_backward",
            expected: "a float dtype (f32, f64, f16, bf16)".into(),
            got: dtype,
        });
    }
    let program = rules::unary_backward_program(op, dtype)?;
    let dev = B::storage_device(s);
    let mut out = B::eval_expr(&dev, &program, lg.shape(), &[(s, ls), (g, lg)], &[])?;
    Ok(out.swap_remove(0))
}

/// The composed [`Backend::sq_sum`]: [`crate::unscale::sq_sum_program`] evaluated per slot,
/// the sums added in slot order with [`crate::unscale::sum_pair_program`].
pub fn sq_sum_composed<B: Backend>(
    dtype: DType,
    slots: &[UnscaleSlot<'_, B::Storage>],
) -> Result<B::Storage> {
    const OP: &str = "sq_sum";
    let Some(first) = slots.first() else {
        return Err(Error::invalid(
            OP,
            "no tensors: the sum lives on their device",
        ));
    };
    let program = crate::unscale::sq_sum_program(dtype)?;
    let add = crate::unscale::sum_pair_program()?;
    let dev = B::storage_device(first.grad);
    let one = Layout::contiguous([1]);
    // The one output of `p` over `shape`, or an error naming `what` returned none.
    let eval = |p: &Program, shape: &Shape, inputs: &[(&B::Storage, &Layout)], what: &str| {
        B::eval_expr(&dev, p, shape, inputs, &[])?
            .into_iter()
            .next()
            .ok_or_else(|| Error::backend(OP, format!("the {what} program returned no output")))
    };
    let sum = |slot: &UnscaleSlot<'_, B::Storage>| {
        let l = Layout::contiguous([slot.len]);
        eval(&program, l.shape(), &[(slot.grad, &l)], "sum")
    };
    let mut total = sum(first)?;
    for slot in &slots[1..] {
        let s = sum(slot)?;
        total = eval(&add, one.shape(), &[(&total, &one), (&s, &one)], "add")?;
    }
    Ok(total)
}

/// The composed [`Backend::unscale_check`]: [`crate::unscale::unscale_program`] evaluated per
/// slot by the backend's own [`Backend::eval_expr`], the per-slot flags united by a maximum.
/// Public so that a backend overriding the op can fall back to it (and tests compare with it).
pub fn unscale_check_composed<B: Backend>(
    dtype: DType,
    inv_scale: f64,
    slots: &[UnscaleSlot<'_, B::Storage>],
) -> Result<(Vec<B::Storage>, B::Storage)> {
    const OP: &str = "unscale_check";
    let Some(first) = slots.first() else {
        return Err(Error::invalid(
            OP,
            "no gradients: the flag lives on their device",
        ));
    };
    let program = crate::unscale::unscale_program(dtype)?;
    let dev = B::storage_device(first.grad);
    let one = Layout::contiguous([1]);
    let mut outs = Vec::with_capacity(slots.len());
    let mut flag: Option<B::Storage> = None;
    for slot in slots {
        let l = Layout::contiguous([slot.len]);
        let mut r = B::eval_expr(&dev, &program, l.shape(), &[(slot.grad, &l)], &[inv_scale])?;
        if r.len() != 2 {
            return Err(Error::backend(
                OP,
                format!("the unscale program returned {} outputs, not 2", r.len()),
            ));
        }
        let f = r.pop().expect("two outputs");
        outs.push(r.pop().expect("two outputs"));
        flag = Some(match flag {
            None => f,
            Some(prev) => {
                let union = crate::unscale::flag_union_program()?;
                let mut u =
                    B::eval_expr(&dev, &union, one.shape(), &[(&prev, &one), (&f, &one)], &[])?;
                u.swap_remove(0)
            }
        });
    }
    Ok((outs, flag.expect("at least one slot")))
}
