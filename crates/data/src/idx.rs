//! The IDX file format (LeCun's MNIST format), plain or gzip-compressed.
//!
//! An IDX file is a 4-byte magic `0x00 0x00 <type> <ndims>`, then `ndims` big-endian `u32`
//! dimensions, then the elements, big-endian, row-major. Type codes: `0x08` u8, `0x09` i8,
//! `0x0B` i16, `0x0C` i32, `0x0D` f32, `0x0E` f64.
//!
//! The reader is strict because a dataset that is silently short trains a model on the wrong
//! data: the header must be well formed, the element count must not overflow, and the payload
//! must be exactly as long as the dimensions say (a truncated file and trailing bytes are both
//! [`Error::Corrupt`], naming the file and what was wrong). A missing or unreadable file is
//! [`Error::Io`] with its path. Nothing here panics on bad input.
//!
//! Compression is detected from the content (the gzip magic `1f 8b`), never from the file
//! name, so `train-images-idx3-ubyte` that is secretly gzipped still loads. Memory is bounded
//! by the data actually present: a header that claims terabytes does not allocate them.

use std::io::{self, Read, Write};
use std::path::Path;

use flate2::Compression;
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use kiln_core::{Error, Result};

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The elements of an IDX array, in the file's element type.
#[derive(Clone, Debug, PartialEq)]
pub enum IdxData {
    U8(Vec<u8>),
    I8(Vec<i8>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl IdxData {
    /// The IDX type code (third byte of the magic).
    pub fn type_code(&self) -> u8 {
        match self {
            IdxData::U8(_) => 0x08,
            IdxData::I8(_) => 0x09,
            IdxData::I16(_) => 0x0B,
            IdxData::I32(_) => 0x0C,
            IdxData::F32(_) => 0x0D,
            IdxData::F64(_) => 0x0E,
        }
    }

    /// The element type's name (`u8`, `i16`, ...), for messages.
    pub fn type_name(&self) -> &'static str {
        type_info(self.type_code()).map_or("?", |t| t.0)
    }

    pub fn len(&self) -> usize {
        match self {
            IdxData::U8(v) => v.len(),
            IdxData::I8(v) => v.len(),
            IdxData::I16(v) => v.len(),
            IdxData::I32(v) => v.len(),
            IdxData::F32(v) => v.len(),
            IdxData::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements widened to f64 (exact for every IDX type).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            IdxData::U8(v) => v.iter().map(|&x| x as f64).collect(),
            IdxData::I8(v) => v.iter().map(|&x| x as f64).collect(),
            IdxData::I16(v) => v.iter().map(|&x| x as f64).collect(),
            IdxData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            IdxData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            IdxData::F64(v) => v.clone(),
        }
    }

    /// Appends the elements, big-endian, to `out`.
    fn write_be(&self, out: &mut Vec<u8>) {
        match self {
            IdxData::U8(v) => out.extend_from_slice(v),
            IdxData::I8(v) => out.extend(v.iter().map(|&x| x as u8)),
            IdxData::I16(v) => v.iter().for_each(|x| out.extend(x.to_be_bytes())),
            IdxData::I32(v) => v.iter().for_each(|x| out.extend(x.to_be_bytes())),
            IdxData::F32(v) => v.iter().for_each(|x| out.extend(x.to_be_bytes())),
            IdxData::F64(v) => v.iter().for_each(|x| out.extend(x.to_be_bytes())),
        }
    }

    /// Decodes big-endian `bytes` (whose length is a multiple of the element size).
    fn from_be(code: u8, bytes: Vec<u8>) -> IdxData {
        fn chunks<const N: usize, T>(b: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
            b.chunks_exact(N)
                .map(|c| f(c.try_into().expect("chunks_exact gives N bytes")))
                .collect()
        }
        match code {
            0x08 => IdxData::U8(bytes),
            0x09 => IdxData::I8(bytes.iter().map(|&x| x as i8).collect()),
            0x0B => IdxData::I16(chunks(&bytes, i16::from_be_bytes)),
            0x0C => IdxData::I32(chunks(&bytes, i32::from_be_bytes)),
            0x0D => IdxData::F32(chunks(&bytes, f32::from_be_bytes)),
            _ => IdxData::F64(chunks(&bytes, f64::from_be_bytes)),
        }
    }
}

/// `(name, element size)` of an IDX type code, `None` when unsupported.
fn type_info(code: u8) -> Option<(&'static str, usize)> {
    Some(match code {
        0x08 => ("u8", 1),
        0x09 => ("i8", 1),
        0x0B => ("i16", 2),
        0x0C => ("i32", 4),
        0x0D => ("f32", 4),
        0x0E => ("f64", 8),
        _ => return None,
    })
}

/// An n-dimensional array as stored in an IDX file: dimensions plus row-major elements.
#[derive(Clone, Debug, PartialEq)]
pub struct Idx {
    dims: Vec<usize>,
    data: IdxData,
}

impl Idx {
    /// An array with `dims` over `data`; the element count must match and every dimension must
    /// fit the format's `u32` (with at least one and at most 255 dimensions).
    pub fn new(dims: impl Into<Vec<usize>>, data: IdxData) -> Result<Self> {
        let dims = dims.into();
        let bad = |msg: String| Err(Error::invalid("Idx::new", msg));
        if dims.is_empty() || dims.len() > 255 {
            return bad(format!(
                "an IDX array has 1 to 255 dimensions, got {}",
                dims.len()
            ));
        }
        if let Some(d) = dims.iter().find(|&&d| u32::try_from(d).is_err()) {
            return bad(format!("dimension {d} does not fit in the format's u32"));
        }
        let count = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if count != Some(data.len()) {
            return bad(format!(
                "dims {dims:?} need {} elements, the data has {}",
                count.map_or_else(|| "more than usize::MAX".into(), |c| c.to_string()),
                data.len()
            ));
        }
        Ok(Idx { dims, data })
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    pub fn data(&self) -> &IdxData {
        &self.data
    }
    pub fn into_data(self) -> IdxData {
        self.data
    }

    /// The uncompressed IDX encoding of this array.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (_, size) = type_info(self.data.type_code()).expect("every IdxData type is known");
        let mut out = Vec::with_capacity(4 + 4 * self.dims.len() + size * self.data.len());
        out.extend([0, 0, self.data.type_code(), self.dims.len() as u8]);
        for &d in &self.dims {
            out.extend((d as u32).to_be_bytes());
        }
        self.data.write_be(&mut out);
        out
    }
}

/// Reads an IDX file, plain or gzip-compressed (detected from its first bytes).
pub fn read_idx(path: impl AsRef<Path>) -> Result<Idx> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_idx(&bytes, &path.display().to_string())
}

/// Parses IDX `bytes` (plain or gzip); `name` is used in error messages.
pub fn parse_idx(bytes: &[u8], name: &str) -> Result<Idx> {
    if bytes.starts_with(&GZIP_MAGIC) {
        parse_stream(MultiGzDecoder::new(bytes), name, true, None)
    } else {
        parse_stream(bytes, name, false, Some(bytes.len()))
    }
}

/// Parses an IDX stream. `known_len` (the plain file's size) lets a truncated file be reported
/// before anything is allocated; for a gzip stream the payload is read incrementally instead.
fn parse_stream<R: Read>(
    mut r: R,
    name: &str,
    gzip: bool,
    known_len: Option<usize>,
) -> Result<Idx> {
    let corrupt = |msg: String| Error::Corrupt {
        path: name.to_string(),
        msg: if gzip {
            format!("{msg} (in the gzip-decompressed data)")
        } else {
            msg
        },
    };
    // A read error inside the decoder is a broken gzip stream, not an I/O failure: the bytes
    // are already in memory.
    let gz_err = |e: io::Error| Error::Corrupt {
        path: name.to_string(),
        msg: format!("invalid gzip data: {e}"),
    };

    let mut magic = [0u8; 4];
    let got = read_full(&mut r, &mut magic).map_err(gz_err)?;
    if got < 4 {
        return Err(corrupt(format!(
            "file too short for an IDX header: {got} bytes, the magic alone is 4"
        )));
    }
    if magic[0] != 0 || magic[1] != 0 {
        return Err(corrupt(format!(
            "bad magic {:02x} {:02x} {:02x} {:02x}: an IDX file starts with 00 00 <type> <ndims>",
            magic[0], magic[1], magic[2], magic[3]
        )));
    }
    let code = magic[2];
    let Some((type_name, elem_size)) = type_info(code) else {
        return Err(corrupt(format!(
            "unsupported element type code 0x{code:02x} (supported: 08 u8, 09 i8, 0b i16, \
             0c i32, 0d f32, 0e f64)"
        )));
    };
    let ndims = magic[3] as usize;
    if ndims == 0 {
        return Err(corrupt("the header declares 0 dimensions".into()));
    }

    let mut dim_bytes = vec![0u8; 4 * ndims];
    let got = read_full(&mut r, &mut dim_bytes).map_err(gz_err)?;
    if got < dim_bytes.len() {
        return Err(corrupt(format!(
            "truncated header: {ndims} dimensions need {} bytes after the magic, found {got}",
            dim_bytes.len()
        )));
    }
    let dims: Vec<usize> = dim_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes(c.try_into().expect("4 bytes")) as usize)
        .collect();
    let payload = dims
        .iter()
        .try_fold(elem_size, |a, &d| a.checked_mul(d))
        .ok_or_else(|| {
            corrupt(format!(
                "dims {dims:?} of {type_name} overflow the address space"
            ))
        })?;

    let header = 4 + 4 * ndims;
    if let Some(len) = known_len {
        let found = len - header;
        if found != payload {
            return Err(corrupt(length_msg(&dims, type_name, payload, found)));
        }
    }

    // `take` + `read_to_end` grows the buffer only as data arrives, so a lying header cannot
    // make us allocate more than the stream holds.
    let mut data = Vec::with_capacity(payload.min(1 << 26));
    (&mut r)
        .take(payload as u64)
        .read_to_end(&mut data)
        .map_err(gz_err)?;
    if data.len() < payload {
        return Err(corrupt(length_msg(&dims, type_name, payload, data.len())));
    }
    let mut extra = [0u8; 1];
    if read_full(&mut r, &mut extra).map_err(gz_err)? > 0 {
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).map_err(gz_err)?;
        return Err(corrupt(length_msg(
            &dims,
            type_name,
            payload,
            payload + 1 + rest.len(),
        )));
    }
    Ok(Idx {
        dims,
        data: IdxData::from_be(code, data),
    })
}

fn length_msg(dims: &[usize], type_name: &str, expected: usize, found: usize) -> String {
    let what = if found < expected {
        "truncated"
    } else {
        "trailing data"
    };
    format!(
        "{what}: dims {dims:?} of {type_name} need {expected} data bytes after the header, \
         found {found}"
    )
}

/// Like `read_exact`, but returns how many bytes it got instead of failing at end of stream.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Writes `idx` to `path`, gzip-compressed (best compression, no timestamp or file name in the
/// header, so the output is byte-for-byte reproducible) when `gzip`. The file is written under
/// a temporary name and renamed, so a failed write never leaves a half file at `path`.
pub fn write_idx(path: impl AsRef<Path>, idx: &Idx, gzip: bool) -> Result<()> {
    let path = path.as_ref();
    let io_err = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let raw = idx.to_bytes();
    let bytes = if gzip {
        let mut enc = GzEncoder::new(Vec::new(), Compression::best());
        enc.write_all(&raw).map_err(io_err)?;
        enc.finish().map_err(io_err)?
    } else {
        raw
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, &bytes).map_err(io_err)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    fn corrupt_msg(r: Result<Idx>) -> String {
        match r {
            Err(Error::Corrupt { path, msg }) => {
                assert_eq!(path, "test.idx");
                msg
            }
            other => panic!("expected Error::Corrupt, got {other:?}"),
        }
    }

    fn samples() -> Vec<Idx> {
        vec![
            Idx::new([2, 3], IdxData::U8(vec![0, 1, 2, 253, 254, 255])).unwrap(),
            Idx::new([3], IdxData::I8(vec![-128, 0, 127])).unwrap(),
            Idx::new([2, 1], IdxData::I16(vec![-300, 300])).unwrap(),
            Idx::new([1, 2, 1], IdxData::I32(vec![i32::MIN, 7])).unwrap(),
            Idx::new([2], IdxData::F32(vec![1.5, -0.0])).unwrap(),
            Idx::new([2], IdxData::F64(vec![f64::MAX, 1e-300])).unwrap(),
            Idx::new([0, 28, 28], IdxData::U8(vec![])).unwrap(),
        ]
    }

    #[test]
    fn round_trip_every_type_plain_and_gzip() {
        for idx in samples() {
            let raw = idx.to_bytes();
            assert_eq!(parse_idx(&raw, "test.idx").unwrap(), idx);
            assert_eq!(parse_idx(&gz(&raw), "test.idx").unwrap(), idx);
        }
    }

    #[test]
    fn known_encoding() {
        let idx = Idx::new([2], IdxData::I16(vec![1, -2])).unwrap();
        assert_eq!(
            idx.to_bytes(),
            [0, 0, 0x0B, 1, 0, 0, 0, 2, 0x00, 0x01, 0xff, 0xfe]
        );
    }

    #[test]
    fn write_and_read_files() {
        let dir = std::env::temp_dir().join(format!("kiln-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let idx = samples().remove(0);
        for gzip in [false, true] {
            // The name says nothing about compression: detection is by content.
            let p = dir.join(format!("a-{gzip}.bin"));
            write_idx(&p, &idx, gzip).unwrap();
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!(bytes.starts_with(&GZIP_MAGIC), gzip);
            assert_eq!(read_idx(&p).unwrap(), idx);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_file_is_io_error_with_path() {
        let p = std::env::temp_dir().join("kiln-no-such-dir/none-idx1-ubyte");
        match read_idx(&p) {
            Err(Error::Io { path, source }) => {
                assert!(path.contains("none-idx1-ubyte"));
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("expected Error::Io, got {other:?}"),
        }
    }

    #[test]
    fn truncated_payload() {
        let raw = samples()[0].to_bytes();
        for cut in [raw.len() - 1, 8 + 1] {
            let msg = corrupt_msg(parse_idx(&raw[..cut], "test.idx"));
            assert!(msg.contains("truncated"), "{msg}");
            let msg = corrupt_msg(parse_idx(&gz(&raw[..cut]), "test.idx"));
            assert!(msg.contains("truncated") && msg.contains("gzip"), "{msg}");
        }
    }

    #[test]
    fn truncated_header() {
        let raw = samples()[0].to_bytes();
        for cut in [0, 3, 4, 7, 11] {
            let msg = corrupt_msg(parse_idx(&raw[..cut], "test.idx"));
            assert!(msg.contains("short") || msg.contains("truncated"), "{msg}");
        }
    }

    #[test]
    fn trailing_garbage() {
        let mut raw = samples()[0].to_bytes();
        raw.extend([1, 2, 3]);
        let msg = corrupt_msg(parse_idx(&raw, "test.idx"));
        assert!(msg.contains("trailing") && msg.contains("found 9"), "{msg}");
        let msg = corrupt_msg(parse_idx(&gz(&raw), "test.idx"));
        assert!(msg.contains("trailing"), "{msg}");
    }

    #[test]
    fn bad_magic_and_type() {
        let raw = samples()[0].to_bytes();
        let mut b = raw.clone();
        b[0] = 1;
        assert!(corrupt_msg(parse_idx(&b, "test.idx")).contains("bad magic"));
        let mut b = raw.clone();
        b[2] = 0x0A;
        assert!(corrupt_msg(parse_idx(&b, "test.idx")).contains("unsupported element type"));
        let mut b = raw.clone();
        b[3] = 0;
        assert!(corrupt_msg(parse_idx(&b, "test.idx")).contains("0 dimensions"));
        // A text file is not an IDX file.
        assert!(corrupt_msg(parse_idx(b"label,pixel0\n", "test.idx")).contains("bad magic"));
    }

    #[test]
    fn wrong_dims() {
        // ndims says 3 but the dims and data are for [2, 3]: the length check catches it.
        let mut b = samples()[0].to_bytes();
        b[3] = 3;
        assert!(corrupt_msg(parse_idx(&b, "test.idx")).contains("need"));
        // A dimension larger than the data: truncated, and nothing huge is allocated (plain
        // or gzip).
        let mut b = samples()[0].to_bytes();
        b[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        let msg = corrupt_msg(parse_idx(&b, "test.idx"));
        assert!(msg.contains("truncated"), "{msg}");
        let msg = corrupt_msg(parse_idx(&gz(&b), "test.idx"));
        assert!(msg.contains("truncated"), "{msg}");
        // Dims whose product overflows.
        let mut b = vec![0, 0, 0x0E, 4];
        for _ in 0..4 {
            b.extend(u32::MAX.to_be_bytes());
        }
        assert!(corrupt_msg(parse_idx(&b, "test.idx")).contains("overflow"));
    }

    #[test]
    fn corrupt_gzip() {
        let z = gz(&samples()[0].to_bytes());
        // A flipped bit in the deflate stream or the CRC, a cut stream, garbage after it.
        let mut flipped = z.clone();
        let mid = z.len() / 2;
        flipped[mid] ^= 0x55;
        let mut bad_crc = z.clone();
        let n = z.len();
        bad_crc[n - 6] ^= 1;
        let mut trailing = z.clone();
        trailing.extend(b"garbage!");
        for (what, b) in [
            ("flipped", flipped),
            ("crc", bad_crc),
            ("cut", z[..n - 3].to_vec()),
            ("trailing", trailing),
        ] {
            let msg = corrupt_msg(parse_idx(&b, "test.idx"));
            assert!(msg.contains("gzip"), "{what}: {msg}");
        }
    }

    #[test]
    fn idx_new_validates() {
        assert!(Idx::new([2, 2], IdxData::U8(vec![1, 2, 3])).is_err());
        assert!(Idx::new(Vec::<usize>::new(), IdxData::U8(vec![1])).is_err());
        assert!(Idx::new([1usize << 33], IdxData::U8(vec![])).is_err());
    }
}
