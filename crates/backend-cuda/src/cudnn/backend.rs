//! cuDNN's backend (graph) API at its lowest level: an owned descriptor, destroyed on drop, and
//! typed attribute setters and getters over `cudnnBackendSetAttribute`/`GetAttribute`.
//!
//! Why typed wrappers: each attribute has one element type and count (an `INT64` array of the
//! tensor's rank for dimensions, one `BACKEND_DESCRIPTOR` for an operand, a `HANDLE` passed by
//! pointer to the handle, ...), and a mismatch is only caught by cuDNN at run time as
//! `CUDNN_STATUS_BAD_PARAM`. Here the Rust type of the slice fixes the element type, so each
//! call site only names the attribute. Enumerations read back (numerical notes) are read as
//! plain `u32`s, so a value this binding's enums do not know is skipped, never undefined
//! behaviour.

use std::ffi::c_void;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptorType_t as Kind,
};
use kiln_core::Result;

use super::status;

/// The backend API's entry points kiln calls, checked before the graph path is first used
/// (cudarc panics on a symbol it cannot find).
pub(super) const SYMBOLS: &[&str] = &[
    "cudnnBackendCreateDescriptor",
    "cudnnBackendDestroyDescriptor",
    "cudnnBackendSetAttribute",
    "cudnnBackendGetAttribute",
    "cudnnBackendFinalize",
    "cudnnBackendExecute",
];

/// One backend descriptor, destroyed on drop.
pub(super) struct Desc(sys::cudnnBackendDescriptor_t);

// SAFETY: descriptors are host objects with no thread affinity; they are used only under the
// device's cuDNN lock (`mod.rs`).
unsafe impl Send for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by `cudnnBackendCreateDescriptor` and destroyed once, here; an
            // error on destruction cannot be acted on in a drop.
            unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
        }
    }
}

/// The element type of one attribute value, and its backend type tag.
pub(super) trait Element: Copy {
    const TY: Ty;
}

impl Element for i64 {
    const TY: Ty = Ty::CUDNN_TYPE_INT64;
}
impl Element for f32 {
    const TY: Ty = Ty::CUDNN_TYPE_FLOAT;
}
impl Element for f64 {
    const TY: Ty = Ty::CUDNN_TYPE_DOUBLE;
}
impl Element for sys::cudnnDataType_t {
    const TY: Ty = Ty::CUDNN_TYPE_DATA_TYPE;
}
impl Element for sys::cudnnConvolutionMode_t {
    const TY: Ty = Ty::CUDNN_TYPE_CONVOLUTION_MODE;
}
impl Element for sys::cudnnBackendHeurMode_t {
    const TY: Ty = Ty::CUDNN_TYPE_HEUR_MODE;
}
impl Element for sys::cudnnPointwiseMode_t {
    const TY: Ty = Ty::CUDNN_TYPE_POINTWISE_MODE;
}
impl Element for sys::cudnnReduceTensorOp_t {
    const TY: Ty = Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE;
}
impl Element for sys::cudnnRngDistribution_t {
    const TY: Ty = Ty::CUDNN_TYPE_RNG_DISTRIBUTION;
}
/// C's `bool` (one byte, as Rust's), for flags such as a tensor's `IS_VIRTUAL`.
impl Element for bool {
    const TY: Ty = Ty::CUDNN_TYPE_BOOLEAN;
}
impl Element for sys::cudnnHandle_t {
    const TY: Ty = Ty::CUDNN_TYPE_HANDLE;
}
impl Element for sys::cudnnBackendDescriptor_t {
    const TY: Ty = Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR;
}
/// A device pointer (`VOID_PTR`), for the variant pack; its own type, since a descriptor is a
/// `*mut c_void` too.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct DevPtr(pub *mut c_void);

impl Element for DevPtr {
    const TY: Ty = Ty::CUDNN_TYPE_VOID_PTR;
}

impl Desc {
    /// A new, empty descriptor of `kind`.
    pub fn new(kind: Kind, op: &'static str) -> Result<Desc> {
        let mut d = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the descriptor is owned by the returned guard.
        status(
            unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut d) },
            op,
        )?;
        Ok(Desc(d))
    }

    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.0
    }

    /// Sets `attr` to the elements of `values` (their type gives the backend type).
    pub fn set<T: Element>(&self, attr: Attr, values: &[T], op: &'static str) -> Result<()> {
        // SAFETY: a live descriptor; `values` holds `len` elements of the type named by `T::TY`
        // and outlives the call (cuDNN copies what it keeps).
        status(
            unsafe {
                sys::cudnnBackendSetAttribute(
                    self.0,
                    attr,
                    T::TY,
                    values.len() as i64,
                    values.as_ptr().cast(),
                )
            },
            op,
        )
    }

    /// Sets `attr` to one other descriptor (an operand, the graph, the engine config, ...).
    pub fn set_desc(&self, attr: Attr, d: &Desc, op: &'static str) -> Result<()> {
        self.set(attr, &[d.0], op)
    }

    /// Finalizes the descriptor (its attributes are then fixed).
    pub fn finalize(&self, op: &'static str) -> Result<()> {
        // SAFETY: a live descriptor.
        status(unsafe { sys::cudnnBackendFinalize(self.0) }, op)
    }

    /// Reads up to `out.len()` elements of `attr` into `out`; how many cuDNN wrote.
    pub fn get<T: Element>(&self, attr: Attr, out: &mut [T], op: &'static str) -> Result<usize> {
        let mut n = 0i64;
        // SAFETY: a live descriptor; `out` has room for `len` elements of `T::TY`'s type.
        status(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    self.0,
                    attr,
                    T::TY,
                    out.len() as i64,
                    &mut n,
                    out.as_mut_ptr().cast(),
                )
            },
            op,
        )?;
        Ok(n.clamp(0, out.len() as i64) as usize)
    }

    /// How many elements `attr` holds (asked with no room to write them).
    pub fn count(&self, attr: Attr, ty: Ty, op: &'static str) -> Result<usize> {
        let mut n = 0i64;
        // SAFETY: a live descriptor; zero elements requested, so the null array is not written.
        status(
            unsafe {
                sys::cudnnBackendGetAttribute(self.0, attr, ty, 0, &mut n, std::ptr::null_mut())
            },
            op,
        )?;
        Ok(n.max(0) as usize)
    }

    /// Reads `attr` into descriptors created empty here as `kind` (`count` of them), as the
    /// backend API fills descriptor-valued attributes: the caller creates, cuDNN fills.
    pub fn get_descs(
        &self,
        attr: Attr,
        kind: Kind,
        count: usize,
        op: &'static str,
    ) -> Result<Vec<Desc>> {
        let descs = (0..count)
            .map(|_| Desc::new(kind, op))
            .collect::<Result<Vec<_>>>()?;
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        let got = self.get(attr, &mut raw, op)?;
        let mut descs = descs;
        descs.truncate(got);
        Ok(descs)
    }

    /// Reads an enumeration-valued array attribute (numerical notes, ...) as plain integers.
    pub fn get_enums(&self, attr: Attr, ty: Ty, max: usize, op: &'static str) -> Result<Vec<u32>> {
        let mut out = vec![0u32; max];
        let mut n = 0i64;
        // SAFETY: a live descriptor; `out` has room for `max` 4-byte enumeration values (C
        // enums are `int`-sized), read as integers.
        status(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    self.0,
                    attr,
                    ty,
                    max as i64,
                    &mut n,
                    out.as_mut_ptr().cast(),
                )
            },
            op,
        )?;
        out.truncate(n.clamp(0, max as i64) as usize);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag<T: Element>() -> Ty {
        T::TY
    }

    /// Each Rust element type carries the backend type tag cuDNN reads its values as: a wrong
    /// tag is only a `BAD_PARAM` at run time on a GPU, so it is pinned here.
    #[test]
    fn element_types_carry_their_backend_tags() {
        assert_eq!(tag::<i64>(), Ty::CUDNN_TYPE_INT64);
        assert_eq!(tag::<f32>(), Ty::CUDNN_TYPE_FLOAT);
        assert_eq!(tag::<f64>(), Ty::CUDNN_TYPE_DOUBLE);
        assert_eq!(tag::<sys::cudnnDataType_t>(), Ty::CUDNN_TYPE_DATA_TYPE);
        assert_eq!(
            tag::<sys::cudnnConvolutionMode_t>(),
            Ty::CUDNN_TYPE_CONVOLUTION_MODE
        );
        assert_eq!(
            tag::<sys::cudnnBackendHeurMode_t>(),
            Ty::CUDNN_TYPE_HEUR_MODE
        );
        assert_eq!(tag::<sys::cudnnHandle_t>(), Ty::CUDNN_TYPE_HANDLE);
        assert_eq!(
            tag::<sys::cudnnPointwiseMode_t>(),
            Ty::CUDNN_TYPE_POINTWISE_MODE
        );
        assert_eq!(tag::<bool>(), Ty::CUDNN_TYPE_BOOLEAN);
        assert_eq!(
            tag::<sys::cudnnBackendDescriptor_t>(),
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR
        );
        assert_eq!(tag::<DevPtr>(), Ty::CUDNN_TYPE_VOID_PTR);
    }

    /// Values are passed as arrays of the C types: enums are `int`-sized, pointers and the
    /// device-pointer wrapper pointer-sized.
    #[test]
    fn elements_have_the_c_sizes() {
        use std::mem::size_of;
        assert_eq!(size_of::<sys::cudnnDataType_t>(), 4);
        assert_eq!(size_of::<sys::cudnnConvolutionMode_t>(), 4);
        assert_eq!(size_of::<sys::cudnnBackendHeurMode_t>(), 4);
        assert_eq!(size_of::<DevPtr>(), size_of::<*mut c_void>());
        assert_eq!(size_of::<sys::cudnnPointwiseMode_t>(), 4);
        assert_eq!(size_of::<bool>(), 1);
    }
}
