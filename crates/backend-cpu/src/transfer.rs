//! Copies between host memory and CPU storages, and between storages: `fill`, `from_host`,
//! `to_host` (into a new `Vec` or the caller's bytes), `pin_memory` and `copy_into`. Kept out of
//! the crate root so that lib.rs is the `Backend` implementation alone, dispatching each call by
//! dtype to the typed functions here.

use kiln_core::{Error, Layout, Result};

use crate::device::CpuDevice;
use crate::elementwise::{dtype_err, slice};
use crate::storage::{self, CpuElem, CpuStorage, HostVec, alloc};
use crate::strided::{self, map1, par_out};

pub(crate) fn fill_t<T: CpuElem>(device: CpuDevice, len: usize, value: T) -> Result<CpuStorage> {
    let mut out = alloc::<T>("fill", device, len)?;
    par_out(&mut out, 1, |_, o| o.fill(value));
    Ok(storage::storage(device, out))
}

/// A storage holding a copy of `bytes` (native endianness) as elements of `T`.
pub(crate) fn from_bytes_t<T: CpuElem>(
    op: &'static str,
    device: CpuDevice,
    bytes: &[u8],
) -> Result<CpuStorage> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(Error::invalid(
            op,
            format!(
                "{} bytes are not a whole number of {} elements",
                bytes.len(),
                T::DTYPE
            ),
        ));
    }
    let mut out = alloc::<T>(op, device, bytes.len() / size)?;
    bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(bytes);
    Ok(storage::storage(device, out))
}

/// The elements of `layout`, in row-major order, in a new `Vec`.
pub(crate) fn to_host_t<T: CpuElem>(s: &CpuStorage, layout: &Layout) -> Result<Vec<T>> {
    let a = slice::<T>("to_host", s)?;
    let mut out = storage::zeroed_vec::<T>("to_host", s.device(), layout.elem_count())?;
    copy_out(a, layout, &mut out);
    Ok(out)
}

/// Copies the elements of `layout` over `a`, in row-major order, into `out`.
fn copy_out<T: CpuElem>(a: &[T], layout: &Layout, out: &mut [T]) {
    match layout.contiguous_range() {
        Some(r) => out.copy_from_slice(&a[r]),
        None => map1(a, layout, out, |x, o| o.copy_from_slice(x)),
    }
}

/// The caller's byte buffer `out` filled with the elements of `layout` (no intermediate `Vec`
/// unless `out` is not aligned for `T`).
pub(crate) fn to_bytes_t<T: CpuElem>(
    s: &CpuStorage,
    layout: &Layout,
    out: &mut [u8],
) -> Result<()> {
    let a = slice::<T>("to_host", s)?;
    match bytemuck::try_cast_slice_mut::<u8, T>(out) {
        Ok(o) => copy_out(a, layout, o),
        Err(_) => out.copy_from_slice(bytemuck::cast_slice(&to_host_t::<T>(s, layout)?)),
    }
    Ok(())
}

/// The elements of `layout` in a new pinned buffer, copied once.
pub(crate) fn pin_t<T: CpuElem>(s: &CpuStorage, layout: &Layout) -> Result<HostVec<T>> {
    const OP: &str = "pin_memory";
    let a = slice::<T>(OP, s)?;
    if let Some(r) = layout.contiguous_range() {
        return HostVec::pinned(OP, &a[r]);
    }
    let mut v = HostVec::pinned_zeroed(OP, layout.elem_count())?;
    map1(a, layout, &mut v, |x, o| o.copy_from_slice(x));
    Ok(v)
}

pub(crate) fn copy_into_t<T: CpuElem>(
    src: &CpuStorage,
    ls: &Layout,
    dst: &mut CpuStorage,
    ld: &Layout,
) -> Result<()> {
    let got = dst.dtype();
    let s = slice::<T>("copy_into", src)?;
    let d = T::slice_mut(dst.data_mut()?)
        .ok_or_else(|| dtype_err("copy_into", T::DTYPE.as_str(), got))?;
    strided::copy_strided(s, ls, d, ld);
    Ok(())
}
