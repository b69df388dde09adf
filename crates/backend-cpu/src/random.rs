//! Seeded random tensors drawn from Philox4x32-10 through [`kiln_core::philox`] itself, so the
//! CPU draws bit for bit what every other backend draws, however the work is split across
//! threads. f32 (and 16-bit) uniforms take four elements from each Philox call.

use kiln_core::{DType, RandDist, Result, bf16, f16, philox};

use crate::CpuDevice;
use crate::elementwise::dtype_err;
use crate::storage::{CpuElem, CpuStorage, alloc, storage};
use crate::strided::par_out;

fn fill_with<T: CpuElem>(
    device: CpuDevice,
    len: usize,
    f: impl Fn(u64) -> T + Sync,
) -> Result<CpuStorage> {
    let mut out = alloc::<T>("rand", device, len)?;
    par_out(&mut out, 1, |s, o| {
        for (j, v) in o.iter_mut().enumerate() {
            *v = f((s + j) as u64);
        }
    });
    Ok(storage(device, out))
}

/// `len` f32 uniforms of `seed` (four from each Philox call, [`philox::uniform_f32x4`]),
/// each stored through `conv`.
fn fill_uniform_f32<T: CpuElem>(
    device: CpuDevice,
    len: usize,
    seed: u64,
    (low, high): (f32, f32),
    conv: impl Fn(f32) -> T + Sync,
) -> Result<CpuStorage> {
    let mut out = alloc::<T>("rand", device, len)?;
    par_out(&mut out, 1, |s, o| {
        let (mut group, mut u) = (u64::MAX, [0.0f32; 4]);
        for (j, v) in o.iter_mut().enumerate() {
            let i = (s + j) as u64;
            if i / 4 != group {
                group = i / 4;
                u = philox::uniform_f32x4(seed, group, low, high);
            }
            *v = conv(u[(i % 4) as usize]);
        }
    });
    Ok(storage(device, out))
}

pub(crate) fn rand(
    device: CpuDevice,
    dtype: DType,
    len: usize,
    seed: u64,
    dist: RandDist,
) -> Result<CpuStorage> {
    match (dtype, dist) {
        (DType::F32, RandDist::Uniform { low, high }) => {
            fill_uniform_f32(device, len, seed, (low as f32, high as f32), |u| u)
        }
        (DType::F32, RandDist::Normal { mean, std }) => {
            let (mean, std) = (mean as f32, std as f32);
            fill_with(device, len, |i| philox::normal_f32(seed, i, mean, std))
        }
        (DType::F64, RandDist::Uniform { low, high }) => {
            fill_with(device, len, |i| philox::uniform_f64(seed, i, low, high))
        }
        (DType::F64, RandDist::Normal { mean, std }) => {
            fill_with(device, len, |i| philox::normal_f64(seed, i, mean, std))
        }
        // The 16-bit floats: drawn in f32, then rounded (as the reference does).
        (DType::F16, RandDist::Uniform { low, high }) => {
            fill_uniform_f32(device, len, seed, (low as f32, high as f32), f16::from_f32)
        }
        (DType::BF16, RandDist::Uniform { low, high }) => {
            fill_uniform_f32(device, len, seed, (low as f32, high as f32), bf16::from_f32)
        }
        (DType::F16, RandDist::Normal { mean, std }) => fill_with(device, len, |i| {
            f16::from_f32(philox::normal_f32(seed, i, mean as f32, std as f32))
        }),
        (DType::BF16, RandDist::Normal { mean, std }) => fill_with(device, len, |i| {
            bf16::from_f32(philox::normal_f32(seed, i, mean as f32, std as f32))
        }),
        // Dropout's keep mask: the f32 uniforms on [0, 1) compared in f32.
        (DType::U8, RandDist::Keep { p }) => {
            let p = p as f32;
            fill_uniform_f32(device, len, seed, (0.0, 1.0), |u| u8::from(u >= p))
        }
        (_, RandDist::Keep { .. }) => Err(dtype_err("rand", "u8 for a keep mask", dtype)),
        _ => Err(dtype_err("rand", "f32, f64, f16 or bf16", dtype)),
    }
}
