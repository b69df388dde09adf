//! The GradScaler's gradient unscale and inf/NaN check ([`kiln_core::Backend::unscale_check`])
//! as one multi-tensor kernel (`kernels/amp.cu`, whose header explains it).
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

/// [`unscale_check`] over storages: their computed buffers (deferred work runs here), held
/// while the kernel's slots borrow them.
pub(crate) fn unscale_check_storages(
    dtype: DType,
    inv_scale: f64,
    slots: &[UnscaleSlot<'_, CudaStorage>],
) -> Result<(Vec<CudaStorage>, CudaStorage)> {
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
    let (outs, flag) = unscale_check(dtype, inv_scale, &bslots)?;
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
    let name = match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: "f32, f64, f16 or bf16".into(),
                got: dtype,
            });
        }
    };
    let dev = first.grad.state();
    for s in slots {
        if s.grad.device() != first.grad.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: first.grad.device().to_string(),
                rhs: s.grad.device().to_string(),
            });
        }
        if s.grad.len_bytes() < s.len * dtype.size_in_bytes() {
            return Err(Error::backend(
                OP,
                format!(
                    "a gradient buffer of {} bytes for {} elements of {dtype}",
                    s.grad.len_bytes(),
                    s.len
                ),
            ));
        }
    }
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
        let words = table(chunk, out_chunk);
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

/// The words of `UnscaleArgs` for up to [`UNSCALE_MAX`] gradients: the prefix offsets
/// (`start[0..=count]`, zero past `count`), `count`, then the input and output pointers.
fn table(slots: &[UnscaleSlot<'_, Buffer>], outs: &[Buffer]) -> Vec<u64> {
    debug_assert!(slots.len() <= UNSCALE_MAX && outs.len() == slots.len());
    let (x0, y0) = (UNSCALE_MAX + 2, 2 * UNSCALE_MAX + 2);
    let mut w = vec![0u64; 3 * UNSCALE_MAX + 2];
    for (t, (s, o)) in slots.iter().zip(outs).enumerate() {
        w[t + 1] = w[t] + s.len as u64;
        w[x0 + t] = s.grad.device_ptr();
        w[y0 + t] = o.device_ptr();
    }
    w[UNSCALE_MAX + 1] = slots.len() as u64;
    w
}
