//! The GradScaler's gradient unscale and inf/NaN check ([`kiln_core::Backend::unscale_check`])
//! as one multi-tensor kernel (`kernels/amp.cu`, whose header explains it); and gradient
//! clipping's squared global norm ([`kiln_core::Backend::sq_sum`]) as one multi-tensor kernel
//! and a fold, over the same table of tensors.
//!
//! The composed default evaluates one program per gradient (a launch each, and one more per
//! flag union); here one launch takes up to [`UNSCALE_MAX`] gradients of a dtype, after one
//! memset that zeroes the flag: two operations on the stream for a ResNet-18's 62 gradients.
//! Both go to the calling thread's current stream, so they are ordered after the backward that
//! wrote the gradients, and under CUDA graph capture they are recorded like any launch (the
//! output buffers then come from the graph's pool; the pointer table is a kernel argument, so
//! a replay needs no upload).

use cudarc::driver::sys;
use kiln_core::{DType, Error, Result, UnscaleSlot};

use crate::device::check;
use crate::launch::Args;
use crate::memory::{Buffer, alloc};
use crate::sources::Module;
use crate::storage::CudaStorage;

/// Gradients per launch: `UNSCALE_MAX` of `amp.cu` (its `UnscaleArgs` fills 3 KB of the 4 KB
/// of kernel parameters).
pub(crate) const UNSCALE_MAX: usize = 128;

const BLOCK: u32 = 256;

/// [`unscale_check`] over storages ([`on_buffers`]).
pub(crate) fn unscale_check_storages(
    dtype: DType,
    inv_scale: f64,
    slots: &[UnscaleSlot<'_, CudaStorage>],
) -> Result<(Vec<CudaStorage>, CudaStorage)> {
    let (outs, flag) = on_buffers(slots, |b| unscale_check(dtype, inv_scale, b))?;
    Ok((
        outs.into_iter().map(CudaStorage::ready).collect(),
        CudaStorage::ready(flag),
    ))
}

/// The unscaled gradients (new buffers) and the flag (one f32: 0, or 1 when some unscaled
/// element is inf or NaN) of `slots`, all of `dtype` on one device.
pub(crate) fn unscale_check(
    dtype: DType,
    inv_scale: f64,
    slots: &[UnscaleSlot<'_, Buffer>],
) -> Result<(Vec<Buffer>, Buffer)> {
    const OP: &str = "unscale_check";
    let Some(first) = slots.first() else {
        return Err(Error::invalid(
            OP,
            "no gradients: the flag lives on their device",
        ));
    };
    let name = checked(OP, dtype, slots)?;
    let dev = first.grad.state();
    dev.bind()?;
    let f = dev.func(Module::Amp, &["unscale", "check", name])?;
    let outs = slots
        .iter()
        .map(|s| alloc(dev, s.len * dtype.size_in_bytes()))
        .collect::<Result<Vec<_>>>()?;
    let flag = alloc(dev, 4)?;
    // SAFETY: the range is exactly `flag` (one f32); ordered on the current stream, before the
    // launches that may set it.
    check(
        unsafe { sys::cuMemsetD32Async(flag.device_ptr(), 0, 1, dev.stream()) },
        OP,
    )?;
    for (chunk, out_chunk) in slots.chunks(UNSCALE_MAX).zip(outs.chunks(UNSCALE_MAX)) {
        let ys: Vec<u64> = out_chunk.iter().map(Buffer::device_ptr).collect();
        let words = table(chunk, &ys);
        let total = words[chunk.len()];
        let mut args = Args::new();
        args.push_words(&words);
        match dtype {
            DType::F64 => args.push(inv_scale),
            _ => args.push(inv_scale as f32),
        };
        args.push(flag.device_ptr());
        dev.launch(OP, f, dev.grid_1d(total, BLOCK), BLOCK, 0, args.ptrs())?;
    }
    Ok((outs, flag))
}

/// The kernels' dtype token for `dtype` (a float dtype), after checking that every slot lies
/// on the first one's device and its buffer holds `len` elements of `dtype`.
fn checked(
    op: &'static str,
    dtype: DType,
    slots: &[UnscaleSlot<'_, Buffer>],
) -> Result<&'static str> {
    let name = match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => {
            return Err(Error::DTypeMismatch {
                op,
                expected: "f32, f64, f16 or bf16".into(),
                got: dtype,
            });
        }
    };
    let Some(first) = slots.first() else {
        return Ok(name);
    };
    for s in slots {
        if s.grad.device() != first.grad.device() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: first.grad.device().to_string(),
                rhs: s.grad.device().to_string(),
            });
        }
        if s.grad.len_bytes() < s.len * dtype.size_in_bytes() {
            return Err(Error::backend(
                op,
                format!(
                    "a buffer of {} bytes for {} elements of {dtype}",
                    s.grad.len_bytes(),
                    s.len
                ),
            ));
        }
    }
    Ok(name)
}

/// The words of `UnscaleArgs` for up to [`UNSCALE_MAX`] gradients: the prefix offsets
/// (`start[0..=count]`, zero past `count`), `count`, then the input and output pointers
/// (`outs`: device addresses, one per slot, or none where the kernel writes no outputs).
fn table(slots: &[UnscaleSlot<'_, Buffer>], outs: &[u64]) -> Vec<u64> {
    debug_assert!(slots.len() <= UNSCALE_MAX && (outs.len() == slots.len() || outs.is_empty()));
    let (x0, y0) = (UNSCALE_MAX + 2, 2 * UNSCALE_MAX + 2);
    let mut w = vec![0u64; 3 * UNSCALE_MAX + 2];
    for (t, s) in slots.iter().enumerate() {
        w[t + 1] = w[t] + s.len as u64;
        w[x0 + t] = s.grad.device_ptr();
        w[y0 + t] = outs.get(t).copied().unwrap_or(0);
    }
    w[UNSCALE_MAX + 1] = slots.len() as u64;
    w
}

/// [`sq_sum`] over storages ([`on_buffers`]).
pub(crate) fn sq_sum_storages(
    dtype: DType,
    slots: &[UnscaleSlot<'_, CudaStorage>],
) -> Result<CudaStorage> {
    Ok(CudaStorage::ready(on_buffers(slots, |b| sq_sum(dtype, b))?))
}

/// `f` over the slots' computed buffers (deferred work runs here), held while it borrows them.
fn on_buffers<R>(
    slots: &[UnscaleSlot<'_, CudaStorage>],
    f: impl FnOnce(&[UnscaleSlot<'_, Buffer>]) -> Result<R>,
) -> Result<R> {
    let held = slots
        .iter()
        .map(|s| s.grad.buffer())
        .collect::<Result<Vec<_>>>()?;
    let bslots: Vec<UnscaleSlot<'_, Buffer>> = held
        .iter()
        .zip(slots)
        .map(|(g, s)| UnscaleSlot {
            grad: &**g,
            len: s.len,
        })
        .collect();
    f(&bslots)
}

/// Blocks of `sq_sum_<S>` per SM: enough loads in flight to read the gradients at the memory's
/// rate, few enough parts for one block to fold.
const SQ_SUM_BLOCKS_PER_SM: u64 = 8;

/// The sum of the squares of every element of `slots` (f64, one element, a new buffer), all of
/// `dtype` on one device: per [`UNSCALE_MAX`] slots one `sq_sum_<S>` launch into per-block
/// parts and one `sq_sum_fold` that adds them to the total (`amp.cu`). The grid depends only
/// on the device and the elements of the launch, so a call's bits are the same every time.
pub(crate) fn sq_sum(dtype: DType, slots: &[UnscaleSlot<'_, Buffer>]) -> Result<Buffer> {
    const OP: &str = "sq_sum";
    let Some(first) = slots.first() else {
        return Err(Error::invalid(
            OP,
            "no tensors: the sum lives on their device",
        ));
    };
    let name = checked(OP, dtype, slots)?;
    let dev = first.grad.state();
    dev.bind()?;
    let f = dev.func(Module::Amp, &["sq", "sum", name])?;
    let fold = dev.func(Module::Amp, &["sq", "sum", "fold"])?;
    let out = alloc(dev, 8)?;
    let most = dev.sm_count() as u64 * SQ_SUM_BLOCKS_PER_SM;
    let parts = alloc(dev, most as usize * 8)?;
    for (i, chunk) in slots.chunks(UNSCALE_MAX).enumerate() {
        let words = table(chunk, &[]);
        let total = words[chunk.len()];
        let blocks = total.div_ceil(BLOCK as u64).clamp(1, most);
        let mut args = Args::new();
        args.push_words(&words);
        args.push(parts.device_ptr());
        dev.launch(OP, f, (blocks as u32, 1), BLOCK, 0, args.ptrs())?;
        let mut args = Args::new();
        args.push(parts.device_ptr())
            .push(blocks)
            .push(out.device_ptr())
            .push(i32::from(i > 0));
        dev.launch(OP, fold, (1, 1), BLOCK, 0, args.ptrs())?;
    }
    Ok(out)
}
