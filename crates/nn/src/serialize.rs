//! Named tensors to and from the safetensors format.
//!
//! safetensors is what PyTorch (`safetensors.torch.save_file` / `load_file`), Candle and Burn
//! read and write, so a file written here loads into a PyTorch `state_dict` when the names match
//! (see [`crate::Module::named_parameters`]). Data is stored little-endian, row-major, whatever
//! the tensor's layout or device: tensors are read back to the host (a synchronization) and
//! uploaded to the device the caller names on load.
//!
//! Every failure is a [`kiln_core::Error`] naming the file: an unreadable file is
//! [`Error::Io`], a malformed one or one holding a dtype kiln lacks is [`Error::Corrupt`].

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use kiln_core::fsutil::{io_error, write_atomically};
use kiln_core::{Backend, DType, Error, HostBuffer, Result, Tensor};
use safetensors::{Dtype, SafeTensors, View};

/// One tensor ready to be written: host data in little-endian bytes.
struct HostView {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &HostView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn to_st_dtype(d: DType) -> Result<Dtype> {
    Ok(match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        #[allow(unreachable_patterns)]
        other => {
            return Err(Error::invalid(
                "save_safetensors",
                format!("dtype {other} has no safetensors mapping yet"),
            ));
        }
    })
}

fn le_bytes(h: &HostBuffer) -> Vec<u8> {
    match h {
        HostBuffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostBuffer::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostBuffer::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostBuffer::U8(v) => v.clone(),
        HostBuffer::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostBuffer::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn host_view<B: Backend>(t: &Tensor<B>) -> Result<HostView> {
    Ok(HostView {
        dtype: to_st_dtype(t.dtype())?,
        shape: t.dims().to_vec(),
        bytes: le_bytes(&t.to_host()?),
    })
}

/// Serializes named tensors into safetensors bytes. `metadata` goes into the header's
/// `__metadata__` (string to string), as PyTorch's `save_file(..., metadata=...)` does.
/// Names must be unique.
pub fn to_safetensors_bytes<B: Backend>(
    tensors: &[(String, Tensor<B>)],
    metadata: Option<BTreeMap<String, String>>,
) -> Result<Vec<u8>> {
    const OP: &str = "save_safetensors";
    let mut views = BTreeMap::new();
    for (name, t) in tensors {
        if views.insert(name.clone(), host_view(t)?).is_some() {
            return Err(Error::invalid(
                OP,
                format!("tensor name `{name}` given twice"),
            ));
        }
    }
    let meta = metadata.map(|m| m.into_iter().collect());
    safetensors::serialize(views.iter().map(|(k, v)| (k.as_str(), v)), meta)
        .map_err(|e| Error::invalid(OP, e.to_string()))
}

/// Writes named tensors to a safetensors file at `path` (see [`to_safetensors_bytes`]).
///
/// The file is replaced atomically ([`kiln_core::fsutil::write_atomically`]): it is written to
/// a temporary file beside `path`, synced to disk and renamed into place, so a crash or an error
/// midway leaves the previous checkpoint intact and no partial file behind.
pub fn save_safetensors<B: Backend>(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor<B>)],
    metadata: Option<BTreeMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    let bytes = to_safetensors_bytes(tensors, metadata)?;
    write_atomically(path, |w| w.write_all(&bytes).map_err(io_error(path)))
}

/// The tensors of a safetensors file, by name (sorted), plus its `__metadata__`.
pub struct SafetensorsFile<B: Backend> {
    pub tensors: BTreeMap<String, Tensor<B>>,
    pub metadata: BTreeMap<String, String>,
}

/// Parses safetensors `bytes` and uploads every tensor to `device`. `origin` names the source
/// in error messages (a path, or `<bytes>`).
pub fn from_safetensors_bytes<B: Backend>(
    bytes: &[u8],
    origin: &str,
    device: &B::Device,
) -> Result<SafetensorsFile<B>> {
    let corrupt = |msg: String| Error::Corrupt {
        path: origin.to_string(),
        msg,
    };
    let (_, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| corrupt(format!("bad header: {e}")))?;
    let metadata = meta
        .metadata()
        .clone()
        .map(|m| m.into_iter().collect())
        .unwrap_or_default();
    let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(format!("{e}")))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in st.iter() {
        let data = view.data();
        let host = match view.dtype() {
            Dtype::F32 => HostBuffer::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("chunk of 4")))
                    .collect(),
            ),
            Dtype::F64 => HostBuffer::F64(
                data.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")))
                    .collect(),
            ),
            Dtype::I64 => HostBuffer::I64(
                data.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
                    .collect(),
            ),
            Dtype::U8 | Dtype::BOOL => HostBuffer::U8(data.to_vec()),
            Dtype::F16 => HostBuffer::F16(
                data.chunks_exact(2)
                    .map(|c| kiln_core::f16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            Dtype::BF16 => HostBuffer::BF16(
                data.chunks_exact(2)
                    .map(|c| kiln_core::bf16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            other => {
                return Err(corrupt(format!(
                    "tensor `{name}` has dtype {other:?}, which kiln does not support \
                     (f32, f64, f16, bf16, i64, u8)"
                )));
            }
        };
        let t = Tensor::from_host(&host, view.shape().to_vec(), device)?;
        tensors.insert(name.to_string(), t);
    }
    Ok(SafetensorsFile { tensors, metadata })
}

/// Reads a safetensors file and uploads every tensor to `device`.
pub fn load_safetensors<B: Backend>(
    path: impl AsRef<Path>,
    device: &B::Device,
) -> Result<SafetensorsFile<B>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    from_safetensors_bytes(&bytes, &path.display().to_string(), device)
}

/// Checks that `loaded` holds exactly the tensors `expected` names, with the same shapes and
/// dtypes; one error lists every missing, unexpected and mismatched tensor. Used before any
/// parameter is assigned, so a bad file leaves a model unchanged.
pub fn check_state_dict<B: Backend>(
    op: &'static str,
    origin: &str,
    expected: &[(String, Tensor<B>)],
    loaded: &BTreeMap<String, Tensor<B>>,
) -> Result<()> {
    let mut missing = Vec::new();
    let mut mismatched = Vec::new();
    for (name, t) in expected {
        match loaded.get(name) {
            None => missing.push(name.clone()),
            Some(l) if l.shape() != t.shape() || l.dtype() != t.dtype() => {
                mismatched.push(format!(
                    "`{name}`: expected {} {}, file has {} {}",
                    t.dtype(),
                    t.shape(),
                    l.dtype(),
                    l.shape()
                ))
            }
            Some(_) => {}
        }
    }
    let unexpected: Vec<&String> = loaded
        .keys()
        .filter(|k| !expected.iter().any(|(n, _)| n == *k))
        .collect();
    if missing.is_empty() && unexpected.is_empty() && mismatched.is_empty() {
        return Ok(());
    }
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing tensors: {}", quote(&missing)));
    }
    if !unexpected.is_empty() {
        let u: Vec<String> = unexpected.into_iter().cloned().collect();
        parts.push(format!("unexpected tensors: {}", quote(&u)));
    }
    if !mismatched.is_empty() {
        parts.push(format!("wrong shape or dtype: {}", mismatched.join(", ")));
    }
    Err(Error::invalid(
        op,
        format!("{origin} does not match the model: {}", parts.join("; ")),
    ))
}

fn quote(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
