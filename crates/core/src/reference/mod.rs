//! The f64 reference backend: plain loops, obviously correct, slow.
//!
//! [`Reference`] implements every op of the [`Backend`] trait as directly as the contract in
//! [`crate::backend`] reads, so that the conformance suite (`kiln_core::testing`, feature
//! `testing`) can compare a real backend against it. Storage keeps each dtype's values exactly (a
//! [`HostBuffer`]); float math runs in f64 and a result of dtype f32, f16 or bf16 is rounded to its
//! type once, at the end (so a 16-bit tensor of the reference holds only what the type can hold,
//! and every op's result is the exact one rounded to the type). That makes the reference (nearly) the exact answer for the given inputs, and a real
//! backend's error against it is its own error. Integer ops are exact (`i64` arithmetic wraps;
//! `Div` truncates toward zero and a division by zero gives 0). Random numbers come from
//! [`crate::philox`] itself.
//!
//! Every kernel first gathers its strided inputs into contiguous row-major buffers through
//! [`Layout::offsets`], then works on plain vectors with multi-indices. Nothing here is fast;
//! nothing needs to be.
//!
//! The backend has [`DEVICE_COUNT`] virtual devices (`ref`, `ref:1`, ...) so that device
//! checks (mixing devices, `to_device` vs `copy_to`) can be tested without hardware.

use std::fmt;

use crate::backend::{
    Backend, BinaryOp, CmpOp, HostBuffer, MemoryStats, RandDist, ReduceOp, UnaryOp,
};
use crate::backend::{NormGrads, NormOutputs, NormSpec, Operand};
use crate::epilogue::{Activation, EpilogueGrads, EpilogueOutputs};
use crate::epilogue_composed::{linear_epilogue_backward_composed, linear_epilogue_composed};
use crate::expr::Program;
use crate::{DType, Error, Layout, Result, Shape, philox};

mod norm;
mod values;
use values::*;

/// How many virtual devices the reference backend has.
pub const DEVICE_COUNT: usize = 2;

/// The f64 reference backend (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Reference;

/// A virtual device of the reference backend: `RefDevice(0)` displays as `ref`, `RefDevice(1)`
/// as `ref:1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RefDevice(pub usize);

impl fmt::Display for RefDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => f.write_str("ref"),
            i => write!(f, "ref:{i}"),
        }
    }
}

/// A buffer of the reference backend: the exact values, typed, on one virtual device.
#[derive(Clone, Debug)]
pub struct RefStorage {
    device: RefDevice,
    data: HostBuffer,
}

impl RefStorage {
    /// The values held, in storage order.
    pub fn data(&self) -> &HostBuffer {
        &self.data
    }
    pub fn device(&self) -> RefDevice {
        self.device
    }
}

fn check_device(op: &'static str, d: &RefDevice) -> Result<()> {
    if d.0 >= DEVICE_COUNT {
        return Err(Error::invalid(
            op,
            format!("device {d} does not exist (the reference backend has {DEVICE_COUNT})"),
        ));
    }
    Ok(())
}

fn new(device: RefDevice, data: HostBuffer) -> RefStorage {
    RefStorage { device, data }
}

// ---- the backend ---------------------------------------------------------------------------

impl Backend for Reference {
    type Device = RefDevice;
    type Storage = RefStorage;
    const NAME: &'static str = "reference";

    fn devices() -> Vec<RefDevice> {
        (0..DEVICE_COUNT).map(RefDevice).collect()
    }

    fn parse_device(name: &str) -> Result<RefDevice> {
        let idx = match name.strip_prefix("ref") {
            Some("") => Some(0),
            Some(rest) => rest.strip_prefix(':').and_then(|n| n.parse::<usize>().ok()),
            None => None,
        };
        match idx {
            Some(i) if i < DEVICE_COUNT => Ok(RefDevice(i)),
            _ => Err(Error::invalid(
                "parse_device",
                format!(
                    "{name:?} is not a reference device (expected ref or ref:N with N < {DEVICE_COUNT})"
                ),
            )),
        }
    }

    fn synchronize(device: &RefDevice) -> Result<()> {
        check_device("synchronize", device)
    }

    fn memory_stats(device: &RefDevice) -> Result<MemoryStats> {
        check_device("memory_stats", device)?;
        Ok(MemoryStats::default())
    }

    fn empty_cache(device: &RefDevice) -> Result<()> {
        check_device("empty_cache", device)
    }

    fn storage_device(storage: &RefStorage) -> RefDevice {
        storage.device
    }

    fn fill(device: &RefDevice, dtype: DType, len: usize, value: f64) -> Result<RefStorage> {
        check_device("fill", device)?;
        Ok(new(*device, HostBuffer::from_f64(dtype, &vec![value; len])))
    }

    fn from_host(device: &RefDevice, data: &HostBuffer) -> Result<RefStorage> {
        check_device("from_host", device)?;
        Ok(new(*device, data.clone()))
    }

    fn to_host(storage: &RefStorage, layout: &Layout, dtype: DType) -> Result<HostBuffer> {
        gather("to_host", storage, layout, dtype)
    }

    /// Gathers on the host (the reference has no device to read host memory), so that the
    /// DataLoader's device-gather path runs in tests without a GPU.
    fn gather_host_rows(
        device: &RefDevice,
        srcs: &[crate::HostRows],
        rows: &[usize],
    ) -> Result<Option<Vec<RefStorage>>> {
        const OP: &str = "gather_host_rows";
        check_device(OP, device)?;
        srcs.iter()
            .map(|s| {
                let (rb, n) = (s.row_bytes, s.rows());
                let mut out = Vec::with_capacity(rows.len() * rb);
                for &r in rows {
                    if r >= n {
                        return Err(Error::invalid(
                            OP,
                            format!("row {r} requested of an array of {n} rows"),
                        ));
                    }
                    out.extend_from_slice(&s.block.as_bytes()[r * rb..(r + 1) * rb]);
                }
                let data = match s.bytes_over {
                    Some(d) => HostBuffer::F32(out.iter().map(|&b| b as f32 / d).collect()),
                    None => HostBuffer::from_bytes(OP, s.dtype, &out)?,
                };
                Ok(new(*device, data))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The rows of the range, gathered as [`Self::gather_host_rows`] gathers them.
    fn copy_host_rows(
        device: &RefDevice,
        srcs: &[crate::HostRows],
        rows: std::ops::Range<usize>,
    ) -> Result<Option<Vec<RefStorage>>> {
        const OP: &str = "copy_host_rows";
        check_device(OP, device)?;
        if rows.start > rows.end {
            return Err(Error::invalid(
                OP,
                format!("rows {rows:?}: the range is inverted"),
            ));
        }
        if let Some(s) = srcs.iter().find(|s| rows.end > s.rows()) {
            return Err(Error::invalid(
                OP,
                format!("rows {rows:?} requested of an array of {} rows", s.rows()),
            ));
        }
        Self::gather_host_rows(device, srcs, &rows.collect::<Vec<_>>())
    }

    fn gathers_host_rows(device: &RefDevice) -> bool {
        device.0 < DEVICE_COUNT
    }

    fn copy_to_device(
        storage: &RefStorage,
        layout: &Layout,
        dtype: DType,
        dst: &RefDevice,
    ) -> Result<RefStorage> {
        check_device("copy_to_device", dst)?;
        Ok(new(*dst, gather("copy_to_device", storage, layout, dtype)?))
    }

    fn copy_into(
        src: &RefStorage,
        src_layout: &Layout,
        dst: &mut RefStorage,
        dst_layout: &Layout,
        dtype: DType,
    ) -> Result<()> {
        const OP: &str = "copy_into";
        if src_layout.dims() != dst_layout.dims() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: src_layout.shape().clone(),
                rhs: dst_layout.shape().clone(),
            });
        }
        let vals = gather(OP, src, src_layout, dtype)?;
        // Checks dst's dtype and extent the same way.
        gather(OP, dst, dst_layout, dtype)?;
        let pos = dst_layout.offsets();
        match (&mut dst.data, &vals) {
            (HostBuffer::F32(d), HostBuffer::F32(v)) => pos.zip(v).for_each(|(i, &x)| d[i] = x),
            (HostBuffer::F64(d), HostBuffer::F64(v)) => pos.zip(v).for_each(|(i, &x)| d[i] = x),
            (HostBuffer::I64(d), HostBuffer::I64(v)) => pos.zip(v).for_each(|(i, &x)| d[i] = x),
            (HostBuffer::U8(d), HostBuffer::U8(v)) => pos.zip(v).for_each(|(i, &x)| d[i] = x),
            (HostBuffer::F16(d), HostBuffer::F16(v)) => pos.zip(v).for_each(|(i, &x)| d[i] = x),
            (HostBuffer::BF16(d), HostBuffer::BF16(v)) => pos.zip(v).for_each(|(i, &x)| d[i] = x),
            _ => unreachable!("dtypes checked by gather"),
        }
        Ok(())
    }

    fn contiguous(storage: &RefStorage, layout: &Layout, dtype: DType) -> Result<RefStorage> {
        Ok(new(
            storage.device,
            gather("contiguous", storage, layout, dtype)?,
        ))
    }

    fn rand(
        device: &RefDevice,
        dtype: DType,
        len: usize,
        seed: u64,
        dist: RandDist,
    ) -> Result<RefStorage> {
        check_device("rand", device)?;
        let n = len as u64;
        let data = match (dtype, dist) {
            (DType::F32, RandDist::Uniform { low, high }) => HostBuffer::F32(
                (0..n)
                    .map(|i| philox::uniform_f32(seed, i, low as f32, high as f32))
                    .collect(),
            ),
            (DType::F32, RandDist::Normal { mean, std }) => HostBuffer::F32(
                (0..n)
                    .map(|i| philox::normal_f32(seed, i, mean as f32, std as f32))
                    .collect(),
            ),
            (DType::F64, RandDist::Uniform { low, high }) => HostBuffer::F64(
                (0..n)
                    .map(|i| philox::uniform_f64(seed, i, low, high))
                    .collect(),
            ),
            (DType::F64, RandDist::Normal { mean, std }) => HostBuffer::F64(
                (0..n)
                    .map(|i| philox::normal_f64(seed, i, mean, std))
                    .collect(),
            ),
            // The 16-bit floats: drawn in f32, then rounded (as every backend does).
            (DType::F16 | DType::BF16, RandDist::Uniform { low, high }) => HostBuffer::from_f64(
                dtype,
                &(0..n)
                    .map(|i| philox::uniform_f32(seed, i, low as f32, high as f32) as f64)
                    .collect::<Vec<_>>(),
            ),
            (DType::F16 | DType::BF16, RandDist::Normal { mean, std }) => HostBuffer::from_f64(
                dtype,
                &(0..n)
                    .map(|i| philox::normal_f32(seed, i, mean as f32, std as f32) as f64)
                    .collect::<Vec<_>>(),
            ),
            (DType::U8, RandDist::Keep { p }) => HostBuffer::U8(
                (0..n)
                    .map(|i| u8::from(philox::uniform_f32(seed, i, 0.0, 1.0) >= p as f32))
                    .collect(),
            ),
            (d, _) => return Err(unsupported("rand", d)),
        };
        Ok(new(*device, data))
    }

    fn unary(op: UnaryOp, s: &RefStorage, layout: &Layout, dtype: DType) -> Result<RefStorage> {
        let name = op.name();
        if !op.supports(dtype) {
            return Err(unsupported(name, dtype));
        }
        let x = gather(name, s, layout, dtype)?;
        let out = if dtype.is_float() {
            let v: Vec<f64> = floats(name, &x)?
                .into_iter()
                .map(|x| unary_f(op, x))
                .collect();
            float_out(dtype, &v)
        } else {
            let v = ints(&x)
                .into_iter()
                .map(|x| unary_i(op, x).ok_or_else(|| unsupported(name, dtype)))
                .collect::<Result<Vec<_>>>()?;
            int_out(dtype, v)
        };
        Ok(new(s.device, out))
    }

    fn binary(
        op: BinaryOp,
        lhs: &RefStorage,
        lhs_layout: &Layout,
        rhs: &RefStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        let a = gather(op.name(), lhs, lhs_layout, dtype)?;
        let b = gather(op.name(), rhs, rhs_layout, dtype)?;
        Ok(new(lhs.device, binary_bufs(op, &a, &b, dtype)?))
    }

    fn binary_scalar(
        op: BinaryOp,
        s: &RefStorage,
        layout: &Layout,
        dtype: DType,
        scalar: f64,
        scalar_lhs: bool,
    ) -> Result<RefStorage> {
        let name = op.name();
        if !op.supports(dtype) {
            return Err(unsupported(name, dtype));
        }
        let x = gather(name, s, layout, dtype)?;
        let out = if dtype.is_float() {
            let v: Vec<f64> = floats(name, &x)?
                .into_iter()
                .map(|x| {
                    if scalar_lhs {
                        binary_f(op, scalar, x)
                    } else {
                        binary_f(op, x, scalar)
                    }
                })
                .collect();
            float_out(dtype, &v)
        } else {
            // The scalar converts to the tensor's dtype first (`as`), then the op is exact.
            let c = match dtype {
                DType::U8 => scalar as u8 as i64,
                _ => scalar as i64,
            };
            let v = ints(&x)
                .into_iter()
                .map(|x| {
                    let r = if scalar_lhs {
                        binary_i(op, c, x)
                    } else {
                        binary_i(op, x, c)
                    };
                    r.ok_or_else(|| unsupported(name, dtype))
                })
                .collect::<Result<Vec<_>>>()?;
            int_out(dtype, v)
        };
        Ok(new(s.device, out))
    }

    fn compare(
        op: CmpOp,
        lhs: &RefStorage,
        lhs_layout: &Layout,
        rhs: &RefStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        let a = gather(op.name(), lhs, lhs_layout, dtype)?;
        let b = gather(op.name(), rhs, rhs_layout, dtype)?;
        let v: Vec<u8> = if dtype.is_float() {
            let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| op.eval(x, y) as u8)
                .collect()
        } else {
            let (a, b) = (ints(&a), ints(&b));
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| op.eval(x, y) as u8)
                .collect()
        };
        Ok(new(lhs.device, HostBuffer::U8(v)))
    }

    fn where_cond(
        cond: &RefStorage,
        cond_layout: &Layout,
        on_true: &RefStorage,
        true_layout: &Layout,
        on_false: &RefStorage,
        false_layout: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        const OP: &str = "where";
        let c = match gather(OP, cond, cond_layout, DType::U8)? {
            HostBuffer::U8(c) => c,
            _ => unreachable!("checked by gather"),
        };
        let t = gather(OP, on_true, true_layout, dtype)?;
        let f = gather(OP, on_false, false_layout, dtype)?;
        // Any nonzero condition byte selects `on_true`, as `cond ? a : b` in C.
        let out = select(&c, &t, &f);
        Ok(new(on_true.device, out))
    }

    fn reduce(
        op: ReduceOp,
        s: &RefStorage,
        layout: &Layout,
        dtype: DType,
        axes: &[usize],
    ) -> Result<RefStorage> {
        let name = op.name();
        let dims = layout.dims();
        if axes.iter().any(|&a| a >= dims.len()) {
            return Err(Error::invalid(
                name,
                format!("axes {axes:?} out of range for {}", layout.shape()),
            ));
        }
        if op.is_arg() && axes.len() != 1 {
            return Err(Error::invalid(name, "reduces exactly one axis"));
        }
        if op == ReduceOp::Sum && dtype == DType::U8 {
            return Err(unsupported(name, dtype));
        }
        let x = gather(name, s, layout, dtype)?;
        let mut out_dims = dims.to_vec();
        for &a in axes {
            out_dims[a] = 1;
        }
        let n_out: usize = out_dims.iter().product();
        // The output slot of every input element, and its position along the (arg) axis.
        let slots: Vec<(usize, usize)> = (0..x.len())
            .map(|flat| {
                let mut idx = unravel(flat, dims);
                let pos = axes.first().map_or(0, |&a| idx[a]);
                for &a in axes {
                    idx[a] = 0;
                }
                (ravel(&idx, &out_dims), pos)
            })
            .collect();
        let out = if dtype.is_float() {
            let v = floats(name, &x)?;
            match op {
                ReduceOp::Sum => {
                    let mut acc = vec![0.0; n_out];
                    for (&(o, _), &x) in slots.iter().zip(&v) {
                        acc[o] += x;
                    }
                    float_out(dtype, &acc)
                }
                ReduceOp::Max | ReduceOp::Min => {
                    let mut acc: Vec<Option<f64>> = vec![None; n_out];
                    for (&(o, _), &x) in slots.iter().zip(&v) {
                        acc[o] = Some(match acc[o] {
                            None => x,
                            Some(a) if op == ReduceOp::Max => nan_max(a, x),
                            Some(a) => nan_min(a, x),
                        });
                    }
                    let acc: Vec<f64> = acc.into_iter().map(|a| a.unwrap_or(f64::NAN)).collect();
                    float_out(dtype, &acc)
                }
                ReduceOp::ArgMax | ReduceOp::ArgMin => {
                    // (best value, its position); NaN is the extreme and the first one wins.
                    let mut best: Vec<Option<(f64, usize)>> = vec![None; n_out];
                    for (&(o, pos), &x) in slots.iter().zip(&v) {
                        let better = match best[o] {
                            None => true,
                            Some((b, _)) if b.is_nan() => false,
                            Some(_) if x.is_nan() => true,
                            Some((b, _)) if op == ReduceOp::ArgMax => x > b,
                            Some((b, _)) => x < b,
                        };
                        if better {
                            best[o] = Some((x, pos));
                        }
                    }
                    HostBuffer::I64(best.iter().map(|b| b.map_or(0, |b| b.1 as i64)).collect())
                }
            }
        } else {
            let v = ints(&x);
            match op {
                ReduceOp::Sum => {
                    let mut acc = vec![0i64; n_out];
                    for (&(o, _), &x) in slots.iter().zip(&v) {
                        acc[o] = acc[o].wrapping_add(x);
                    }
                    int_out(dtype, acc)
                }
                ReduceOp::Max | ReduceOp::Min => {
                    let mut acc: Vec<Option<i64>> = vec![None; n_out];
                    for (&(o, _), &x) in slots.iter().zip(&v) {
                        acc[o] = Some(match acc[o] {
                            None => x,
                            Some(a) if op == ReduceOp::Max => a.max(x),
                            Some(a) => a.min(x),
                        });
                    }
                    int_out(dtype, acc.into_iter().map(|a| a.unwrap_or(0)).collect())
                }
                ReduceOp::ArgMax | ReduceOp::ArgMin => {
                    let mut best: Vec<Option<(i64, usize)>> = vec![None; n_out];
                    for (&(o, pos), &x) in slots.iter().zip(&v) {
                        let better = match best[o] {
                            None => true,
                            Some((b, _)) if op == ReduceOp::ArgMax => x > b,
                            Some((b, _)) => x < b,
                        };
                        if better {
                            best[o] = Some((x, pos));
                        }
                    }
                    HostBuffer::I64(best.iter().map(|b| b.map_or(0, |b| b.1 as i64)).collect())
                }
            }
        };
        Ok(new(s.device, out))
    }

    fn matmul(
        lhs: &RefStorage,
        lhs_layout: &Layout,
        rhs: &RefStorage,
        rhs_layout: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        const OP: &str = "matmul";
        let (ld, rd) = (lhs_layout.dims(), rhs_layout.dims());
        if ld.len() != 3 || rd.len() != 3 || ld[0] != rd[0] || ld[2] != rd[1] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: lhs_layout.shape().clone(),
                rhs: rhs_layout.shape().clone(),
            });
        }
        let (batch, m, k, n) = (ld[0], ld[1], ld[2], rd[2]);
        let a = floats(OP, &gather(OP, lhs, lhs_layout, dtype)?)?;
        let b = floats(OP, &gather(OP, rhs, rhs_layout, dtype)?)?;
        let mut c = vec![0.0; batch * m * n];
        for p in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0;
                    for l in 0..k {
                        acc += a[(p * m + i) * k + l] * b[(p * k + l) * n + j];
                    }
                    c[(p * m + i) * n + j] = acc;
                }
            }
        }
        Ok(new(lhs.device, float_out(dtype, &c)))
    }

    fn softmax(s: &RefStorage, layout: &Layout, dtype: DType, log: bool) -> Result<RefStorage> {
        let op = if log { "log_softmax" } else { "softmax" };
        let x = floats(op, &gather(op, s, layout, dtype)?)?;
        let c = layout.dims().last().copied().unwrap_or(1);
        let mut out = Vec::with_capacity(x.len());
        if c > 0 {
            for row in x.chunks(c) {
                let m = row.iter().copied().fold(f64::NEG_INFINITY, nan_max);
                let sum: f64 = row.iter().map(|&v| (v - m).exp()).sum();
                out.extend(row.iter().map(|&v| {
                    if log {
                        v - m - sum.ln()
                    } else {
                        (v - m).exp() / sum
                    }
                }));
            }
        }
        Ok(new(s.device, float_out(dtype, &out)))
    }

    fn cross_entropy(
        logits: &RefStorage,
        logits_layout: &Layout,
        labels: &RefStorage,
        labels_layout: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        const OP: &str = "cross_entropy";
        let (x, y, c) = xent_inputs(OP, logits, logits_layout, labels, labels_layout, dtype)?;
        let mut out = Vec::with_capacity(y.len());
        for (i, &label) in y.iter().enumerate() {
            let row = &x[i * c..(i + 1) * c];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, nan_max);
            let lse = m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
            out.push(lse - row[label]);
        }
        Ok(new(logits.device, float_out(dtype, &out)))
    }

    fn cross_entropy_backward(
        logits: &RefStorage,
        logits_layout: &Layout,
        labels: &RefStorage,
        labels_layout: &Layout,
        grad: &RefStorage,
        grad_layout: &Layout,
        dtype: DType,
    ) -> Result<RefStorage> {
        const OP: &str = "cross_entropy_backward";
        let (x, y, c) = xent_inputs(OP, logits, logits_layout, labels, labels_layout, dtype)?;
        let g = floats(OP, &gather(OP, grad, grad_layout, dtype)?)?;
        if g.len() != y.len() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: logits_layout.shape().clone(),
                rhs: grad_layout.shape().clone(),
            });
        }
        let mut out = Vec::with_capacity(x.len());
        for (i, &label) in y.iter().enumerate() {
            let row = &x[i * c..(i + 1) * c];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, nan_max);
            let sum: f64 = row.iter().map(|&v| (v - m).exp()).sum();
            out.extend(row.iter().enumerate().map(|(j, &v)| {
                let onehot = if j == label { 1.0 } else { 0.0 };
                ((v - m).exp() / sum - onehot) * g[i]
            }));
        }
        Ok(new(logits.device, float_out(dtype, &out)))
    }

    fn cast(s: &RefStorage, layout: &Layout, from: DType, to: DType) -> Result<RefStorage> {
        let x = gather("cast", s, layout, from)?;
        // Direct `as` casts from the source type (never through f64: i64 -> f32 must round
        // once). A 16-bit source widens to f32 first (exact); a 16-bit target rounds once from
        // the source's value (from f64 for i64, itself rounded only beyond 2^53, where f16 is
        // infinite and bf16 keeps 8 bits).
        macro_rules! conv {
            ($v:expr) => {
                match to {
                    DType::F32 => HostBuffer::F32($v.iter().map(|&x| x as f32).collect()),
                    DType::F64 => HostBuffer::F64($v.iter().map(|&x| x as f64).collect()),
                    DType::I64 => HostBuffer::I64($v.iter().map(|&x| x as i64).collect()),
                    DType::U8 => HostBuffer::U8($v.iter().map(|&x| x as u8).collect()),
                    DType::F16 => HostBuffer::F16(
                        $v.iter()
                            .map(|&x| crate::halfround::f16_from_f64(x as f64))
                            .collect(),
                    ),
                    DType::BF16 => HostBuffer::BF16(
                        $v.iter()
                            .map(|&x| crate::halfround::bf16_from_f64(x as f64))
                            .collect(),
                    ),
                }
            };
        }
        let out = match &x {
            HostBuffer::F32(v) => conv!(v),
            HostBuffer::F64(v) => conv!(v),
            HostBuffer::I64(v) => conv!(v),
            HostBuffer::U8(v) => conv!(v),
            HostBuffer::F16(v) => conv!(v.iter().map(|x| x.to_f32()).collect::<Vec<_>>()),
            HostBuffer::BF16(v) => conv!(v.iter().map(|x| x.to_f32()).collect::<Vec<_>>()),
        };
        Ok(new(s.device, out))
    }

    fn index_select(
        s: &RefStorage,
        layout: &Layout,
        dtype: DType,
        ids: &RefStorage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<RefStorage> {
        const OP: &str = "index_select";
        let x = gather(OP, s, layout, dtype)?;
        let ids = ints(&gather(OP, ids, ids_layout, DType::I64)?);
        let dims = layout.dims();
        let ids = ids
            .iter()
            .map(|&i| check_index(OP, i, dims[axis]))
            .collect::<Result<Vec<_>>>()?;
        let mut out_dims = dims.to_vec();
        out_dims[axis] = ids.len();
        let n: usize = out_dims.iter().product();
        let pos = (0..n).map(|flat| {
            let mut idx = unravel(flat, &out_dims);
            idx[axis] = ids[idx[axis]];
            ravel(&idx, dims)
        });
        Ok(new(s.device, take(&x, pos)))
    }

    fn gather(
        s: &RefStorage,
        layout: &Layout,
        dtype: DType,
        ids: &RefStorage,
        ids_layout: &Layout,
        axis: usize,
    ) -> Result<RefStorage> {
        const OP: &str = "gather";
        let x = gather(OP, s, layout, dtype)?;
        let id_vals = ints(&gather(OP, ids, ids_layout, DType::I64)?);
        let (dims, id_dims) = (layout.dims(), ids_layout.dims());
        let pos = id_vals
            .iter()
            .enumerate()
            .map(|(flat, &id)| {
                let mut idx = unravel(flat, id_dims);
                idx[axis] = check_index(OP, id, dims[axis])?;
                if idx.iter().zip(dims).any(|(&i, &d)| i >= d) {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: layout.shape().clone(),
                        rhs: ids_layout.shape().clone(),
                    });
                }
                Ok(ravel(&idx, dims))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(new(s.device, take(&x, pos.into_iter())))
    }

    fn scatter_add(
        base: &RefStorage,
        base_layout: &Layout,
        dtype: DType,
        ids: &RefStorage,
        ids_layout: &Layout,
        src: &RefStorage,
        src_layout: &Layout,
        axis: usize,
    ) -> Result<RefStorage> {
        const OP: &str = "scatter_add";
        let b = gather(OP, base, base_layout, dtype)?;
        let id_vals = ints(&gather(OP, ids, ids_layout, DType::I64)?);
        let src_vals = gather(OP, src, src_layout, dtype)?;
        let (dims, id_dims) = (base_layout.dims(), ids_layout.dims());
        if src_layout.dims() != id_dims {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: ids_layout.shape().clone(),
                rhs: src_layout.shape().clone(),
            });
        }
        let dst = id_vals
            .iter()
            .enumerate()
            .map(|(flat, &id)| {
                let mut idx = unravel(flat, id_dims);
                idx[axis] = check_index(OP, id, dims[axis])?;
                if idx.iter().zip(dims).any(|(&i, &d)| i >= d) {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: base_layout.shape().clone(),
                        rhs: ids_layout.shape().clone(),
                    });
                }
                Ok(ravel(&idx, dims))
            })
            .collect::<Result<Vec<_>>>()?;
        let out = if dtype.is_float() {
            let mut acc = b.to_f64_vec();
            for (&d, &v) in dst.iter().zip(&src_vals.to_f64_vec()) {
                acc[d] += v;
            }
            float_out(dtype, &acc)
        } else {
            let mut acc = ints(&b);
            for (&d, &v) in dst.iter().zip(&ints(&src_vals)) {
                acc[d] = acc[d].wrapping_add(v);
            }
            if dtype == DType::U8 {
                HostBuffer::U8(acc.into_iter().map(|x| x as u8).collect())
            } else {
                HostBuffer::I64(acc)
            }
        };
        Ok(new(base.device, out))
    }

    /// Offered for every float dtype, by plain loops (module `norm`): the callers' fused path
    /// is then tested on the host.
    fn layer_norm_forward(
        x: Operand<'_, RefStorage>,
        weight: Option<Operand<'_, RefStorage>>,
        bias: Option<Operand<'_, RefStorage>>,
        dtype: DType,
        spec: NormSpec,
    ) -> Result<Option<NormOutputs<RefStorage>>> {
        norm::forward(x, weight, bias, dtype, spec)
    }

    fn layer_norm_backward(
        x: Operand<'_, RefStorage>,
        mean: Option<Operand<'_, RefStorage>>,
        rstd: Operand<'_, RefStorage>,
        weight: Option<Operand<'_, RefStorage>>,
        g: Operand<'_, RefStorage>,
        dx_acc: Option<Operand<'_, RefStorage>>,
        dtype: DType,
        spec: NormSpec,
        needs: [bool; 3],
    ) -> Result<Option<NormGrads<RefStorage>>> {
        norm::backward(x, mean, rstd, weight, g, dx_acc, dtype, spec, needs)
    }

    /// Offered for every activation, composed from the kernels above
    /// ([`crate::epilogue_composed`]): the callers' fused path is then tested on the host.
    fn linear_epilogue(
        x: Operand<'_, RefStorage>,
        w: Operand<'_, RefStorage>,
        bias: Option<(Operand<'_, RefStorage>, DType)>,
        dtype: DType,
        act: Activation,
        keep_aux: bool,
    ) -> Result<Option<EpilogueOutputs<RefStorage>>> {
        linear_epilogue_composed::<Self>(x, w, bias, dtype, act, keep_aux).map(Some)
    }

    fn linear_epilogue_backward(
        x: Operand<'_, RefStorage>,
        w: Operand<'_, RefStorage>,
        aux: Option<&RefStorage>,
        g: Operand<'_, RefStorage>,
        dtype: DType,
        bias_dtype: Option<DType>,
        act: Activation,
    ) -> Result<Option<EpilogueGrads<RefStorage>>> {
        linear_epilogue_backward_composed::<Self>(x, w, aux, g, dtype, bias_dtype, act).map(Some)
    }

    /// Op by op: the reference is the oracle the fused evaluators are tested against.
    fn eval_expr(
        device: &RefDevice,
        program: &Program,
        shape: &Shape,
        inputs: &[(&RefStorage, &Layout)],
        params: &[f64],
    ) -> Result<Vec<RefStorage>> {
        crate::expr::eval_composed::<Self>(device, program, shape, inputs, params)
    }
}

/// Gathers cross-entropy inputs: logits `[n, c]` as f64, labels checked against `0..c`.
fn xent_inputs(
    op: &'static str,
    logits: &RefStorage,
    logits_layout: &Layout,
    labels: &RefStorage,
    labels_layout: &Layout,
    dtype: DType,
) -> Result<(Vec<f64>, Vec<usize>, usize)> {
    let d = logits_layout.dims();
    if d.len() != 2 || labels_layout.dims() != [d[0]] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: logits_layout.shape().clone(),
            rhs: labels_layout.shape().clone(),
        });
    }
    let c = d[1];
    let x = floats(op, &gather(op, logits, logits_layout, dtype)?)?;
    let y = ints(&gather(op, labels, labels_layout, DType::I64)?)
        .into_iter()
        .map(|l| check_index(op, l, c))
        .collect::<Result<Vec<_>>>()?;
    Ok((x, y, c))
}

#[cfg(test)]
mod tests;
