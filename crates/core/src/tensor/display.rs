//! `Display` for tensors: the values (abbreviated when large) and the device,
//! e.g. `[[1, 2, 3]] @cuda:0`.

use std::fmt;

use super::Tensor;
use crate::backend::Backend;
use crate::{DType, HostBuffer};

/// Above this many elements, each axis shows only its first and last `EDGE` entries.
const THRESHOLD: usize = 1000;
const EDGE: usize = 3;

impl<B: Backend> fmt::Display for Tensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_host() {
            Ok(host) => {
                let values = format_values(&host);
                let abbreviate = self.elem_count() > THRESHOLD;
                let strides = self.shape().contiguous_strides();
                write_nested(f, &values, self.dims(), &strides, 0, 0, abbreviate)?;
            }
            Err(e) => write!(f, "<unreadable: {e}>")?,
        }
        if self.dtype() != DType::F32 {
            write!(f, " {}", self.dtype())?;
        }
        write!(f, " @{}", self.device())
    }
}

fn format_values(host: &HostBuffer) -> Vec<String> {
    match host {
        HostBuffer::F32(v) => v.iter().map(|x| format_float(*x as f64, 6)).collect(),
        HostBuffer::F64(v) => v.iter().map(|x| format_float(*x, 8)).collect(),
        HostBuffer::I64(v) => v.iter().map(|x| x.to_string()).collect(),
        HostBuffer::U8(v) => v.iter().map(|x| x.to_string()).collect(),
        // About 3.3 and 2.4 significant decimal digits.
        HostBuffer::F16(v) => v.iter().map(|x| format_float(x.to_f64(), 4)).collect(),
        HostBuffer::BF16(v) => v.iter().map(|x| format_float(x.to_f64(), 3)).collect(),
    }
}

/// Shortest of the exact representation and `digits` significant digits.
fn format_float(x: f64, digits: usize) -> String {
    let plain = format!("{x}");
    if plain.len() <= digits + 3 {
        return plain;
    }
    let e = format!("{x:.*e}", digits - 1);
    // `1.00000e-7` reads better as `1e-7`: drop the mantissa's trailing zeros.
    let e = match e.split_once('e') {
        Some((m, exp)) if m.contains('.') => {
            format!("{}e{exp}", m.trim_end_matches('0').trim_end_matches('.'))
        }
        _ => e,
    };
    let f = format!("{:.*}", digits, x);
    let f = f.trim_end_matches('0').trim_end_matches('.').to_string();
    if f.len() <= e.len() && x.abs() >= 1e-4 {
        f
    } else {
        e
    }
}

fn write_nested(
    f: &mut fmt::Formatter<'_>,
    values: &[String],
    dims: &[usize],
    strides: &[usize],
    base: usize,
    depth: usize,
    abbreviate: bool,
) -> fmt::Result {
    let Some((&d, rest)) = dims.split_first() else {
        return f.write_str(&values[base]);
    };
    f.write_str("[")?;
    // Rows of an inner block line up under the block's first row, as numpy prints them.
    let row_sep = format!(",\n{}", " ".repeat(depth + 1));
    let mut first = true;
    let mut i = 0;
    while i < d {
        if abbreviate && d > 2 * EDGE && i == EDGE {
            if rest.is_empty() {
                f.write_str(", ...")?;
            } else {
                write!(f, "{row_sep}...")?;
            }
            i = d - EDGE;
            continue;
        }
        if !first {
            f.write_str(if rest.is_empty() { ", " } else { &row_sep })?;
        }
        first = false;
        write_nested(
            f,
            values,
            rest,
            &strides[1..],
            base + i * strides[0],
            depth + 1,
            abbreviate,
        )?;
        i += 1;
    }
    f.write_str("]")
}
