//! Parameter lists of user kernels (`"T x, raw T y, float32 alpha"`) and the resolution of
//! their type placeholders from the arguments of a call. Pure: no device.

use kiln_core::{DType, Error, Result};

/// A C type a parameter can have: the four tensor dtypes, and `int` for scalars.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CType {
    F32,
    F64,
    I64,
    U8,
    /// 32-bit `int`: scalar parameters only (no tensor has this dtype).
    I32,
}

impl CType {
    /// The C spelling in generated source (`common.cuh` typedefs `i64` and `u8`).
    pub fn c_name(self) -> &'static str {
        match self.dtype() {
            Some(d) => crate::sources::ctype(d),
            None => "int",
        }
    }
    /// The tensor dtype of this type (`None` for `int`).
    pub fn dtype(self) -> Option<DType> {
        match self {
            CType::F32 => Some(DType::F32),
            CType::F64 => Some(DType::F64),
            CType::I64 => Some(DType::I64),
            CType::U8 => Some(DType::U8),
            CType::I32 => None,
        }
    }
    /// The type of tensors of `dtype` (`None` for a dtype kernels cannot take).
    pub fn of_dtype(dtype: DType) -> Option<CType> {
        match dtype {
            DType::F32 => Some(CType::F32),
            DType::F64 => Some(CType::F64),
            DType::I64 => Some(CType::I64),
            DType::U8 => Some(CType::U8),
            _ => None,
        }
    }
    /// A concrete type name, numpy's or C's (`float32`/`float`, `float64`/`double`,
    /// `int64`/`i64`/`long`, `uint8`/`u8`/`bool`, `int32`/`int`).
    pub fn parse(name: &str) -> Option<CType> {
        Some(match name {
            "float32" | "float" | "f32" => CType::F32,
            "float64" | "double" | "f64" => CType::F64,
            "int64" | "i64" | "long" => CType::I64,
            "uint8" | "u8" | "bool" => CType::U8,
            "int32" | "int" | "i32" => CType::I32,
            _ => return None,
        })
    }
}

/// The declared type of a parameter: concrete, or a placeholder resolved per call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ParamType {
    Concrete(CType),
    Placeholder(String),
}

/// One parameter of a kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    pub name: String,
    pub ty: ParamType,
    /// `raw`: the kernel gets the tensor's pointer and indexes it itself (no broadcasting).
    pub raw: bool,
}

/// Whether `s` is a C identifier.
pub fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(f) if f == '_' || f.is_ascii_alphabetic())
        && c.all(|x| x == '_' || x.is_ascii_alphanumeric())
}

/// Names the generated code defines itself: a parameter may not take them.
const RESERVED: &[&str] = &["i", "n", "raw", "const", "int", "float", "double", "void"];

/// Parses a comma-separated parameter list (`""` is no parameter). `op` names the kernel kind
/// in errors.
pub fn parse_params(op: &'static str, list: &str) -> Result<Vec<Param>> {
    let mut out: Vec<Param> = Vec::new();
    if list.trim().is_empty() {
        return Ok(out);
    }
    for part in list.split(',') {
        let toks: Vec<&str> = part.split_whitespace().collect();
        let (raw, toks) = match toks.first() {
            Some(&"raw") => (true, &toks[1..]),
            _ => (false, &toks[..]),
        };
        let [ty, name] = toks else {
            return Err(Error::invalid(
                op,
                format!(
                    "parameter `{}` is not `[raw] TYPE NAME` (a comma-separated list such as \
                     `T x, raw T y, float32 alpha`)",
                    part.trim()
                ),
            ));
        };
        if !is_ident(name) || RESERVED.contains(name) || name.starts_with("_k") {
            return Err(Error::invalid(
                op,
                format!(
                    "parameter name `{name}` is not allowed (a C identifier, not one of {RESERVED:?} \
                     nor starting with `_k`)"
                ),
            ));
        }
        if out.iter().any(|p| p.name == *name) {
            return Err(Error::invalid(
                op,
                format!("parameter `{name}` is declared twice"),
            ));
        }
        let ty = match CType::parse(ty) {
            Some(c) => ParamType::Concrete(c),
            None if is_ident(ty) => ParamType::Placeholder(ty.to_string()),
            None => {
                return Err(Error::invalid(
                    op,
                    format!(
                        "`{ty}` in parameter `{}` is neither a type nor a placeholder",
                        part.trim()
                    ),
                ));
            }
        };
        out.push(Param {
            name: name.to_string(),
            ty,
            raw,
        });
    }
    Ok(out)
}

/// What a call binds to a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// A tensor of this dtype.
    Tensor(DType),
    /// A scalar (its own type does not resolve placeholders; it is converted to the
    /// parameter's type).
    Scalar,
    /// Nothing yet: an output the call allocates.
    Output,
}

/// The placeholders' types, in order of first appearance in `params` then `extra` (a
/// reduction's accumulator type).
pub type Resolved = Vec<(String, CType)>;

/// Resolves every placeholder from the tensors bound to parameters of that type, and checks
/// concrete types against their tensors. Errors: a tensor of a dtype no kernel takes, tensors
/// that disagree on one placeholder, a tensor whose dtype is not its parameter's type, and a
/// placeholder no tensor determines.
pub fn resolve(
    op: &'static str,
    kernel: &str,
    params: &[Param],
    bound: &[Bound],
    extra: Option<&ParamType>,
) -> Result<Resolved> {
    debug_assert_eq!(params.len(), bound.len());
    let mut out: Resolved = Vec::new();
    for (p, b) in params.iter().zip(bound) {
        let Bound::Tensor(dtype) = *b else { continue };
        let Some(c) = CType::of_dtype(dtype) else {
            return Err(Error::DTypeMismatch {
                op,
                expected: format!("f32, f64, i64 or u8 for `{}` of kernel `{kernel}`", p.name),
                got: dtype,
            });
        };
        match &p.ty {
            ParamType::Concrete(want) => {
                if *want != c {
                    return Err(Error::DTypeMismatch {
                        op,
                        expected: format!(
                            "{} for `{}` of kernel `{kernel}`",
                            want.c_name(),
                            p.name
                        ),
                        got: dtype,
                    });
                }
            }
            ParamType::Placeholder(t) => match out.iter().find(|(n, _)| n == t) {
                Some((_, have)) if *have != c => {
                    return Err(Error::DTypeMismatch {
                        op,
                        expected: format!(
                            "{} for `{}` of kernel `{kernel}` (placeholder {t} is {} from an \
                             earlier argument)",
                            have.c_name(),
                            p.name,
                            have.c_name()
                        ),
                        got: dtype,
                    });
                }
                Some(_) => {}
                None => out.push((t.clone(), c)),
            },
        }
    }
    let used = params.iter().map(|p| &p.ty).chain(extra);
    for ty in used {
        if let ParamType::Placeholder(t) = ty
            && !out.iter().any(|(n, _)| n == t)
        {
            return Err(Error::invalid(
                op,
                format!(
                    "kernel `{kernel}`: type placeholder `{t}` cannot be resolved: no tensor \
                     argument is bound to a parameter of type {t} (pass one, or give the \
                     parameter a concrete type such as float32)"
                ),
            ));
        }
    }
    Ok(out)
}

/// The concrete type of `ty` under `r` (resolved by [`resolve`]).
pub fn concrete(ty: &ParamType, r: &Resolved) -> CType {
    match ty {
        ParamType::Concrete(c) => *c,
        ParamType::Placeholder(t) => {
            r.iter()
                .find(|(n, _)| n == t)
                .expect("resolve checked every placeholder")
                .1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_types_placeholders_and_raw() {
        let p = parse_params("k", "T x, raw T y,float32 alpha ,  int64 n2").unwrap();
        assert_eq!(p.len(), 4);
        assert_eq!(p[0].ty, ParamType::Placeholder("T".into()));
        assert!(!p[0].raw && p[1].raw);
        assert_eq!(p[2].ty, ParamType::Concrete(CType::F32));
        assert_eq!(p[2].name, "alpha");
        assert_eq!(p[3].ty, ParamType::Concrete(CType::I64));
        assert!(parse_params("k", "  ").unwrap().is_empty());
    }

    #[test]
    fn rejects_malformed_lists() {
        for bad in [
            "T", "T x y", "T 1x", "T x, T x", "T i", "T _kfoo", "T* x", ", T x",
        ] {
            assert!(parse_params("k", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn resolves_placeholders_from_tensors_only() {
        let p = parse_params("k", "T x, T y, U s, float64 z").unwrap();
        let b = [
            Bound::Tensor(DType::F32),
            Bound::Scalar,
            Bound::Tensor(DType::I64),
            Bound::Tensor(DType::F64),
        ];
        let r = resolve("k", "k", &p, &b, None).unwrap();
        assert_eq!(r, vec![("T".into(), CType::F32), ("U".into(), CType::I64)]);
        assert_eq!(concrete(&p[1].ty, &r), CType::F32);
        // T only bound to scalars: unresolvable
        let b = [
            Bound::Scalar,
            Bound::Scalar,
            Bound::Tensor(DType::I64),
            Bound::Tensor(DType::F64),
        ];
        let e = resolve("k", "k", &p, &b, None).unwrap_err().to_string();
        assert!(e.contains("placeholder `T` cannot be resolved"), "{e}");
        // disagreeing tensors
        let b = [
            Bound::Tensor(DType::F32),
            Bound::Tensor(DType::F64),
            Bound::Tensor(DType::I64),
            Bound::Tensor(DType::F64),
        ];
        assert!(matches!(
            resolve("k", "k", &p, &b, None),
            Err(Error::DTypeMismatch {
                got: DType::F64,
                ..
            })
        ));
        // a concrete parameter with a tensor of another dtype
        let b = [
            Bound::Tensor(DType::F32),
            Bound::Scalar,
            Bound::Tensor(DType::I64),
            Bound::Tensor(DType::F32),
        ];
        assert!(matches!(
            resolve("k", "k", &p, &b, None),
            Err(Error::DTypeMismatch {
                got: DType::F32,
                ..
            })
        ));
        // an extra type (a reduction's accumulator) must resolve too
        let b = [
            Bound::Tensor(DType::F32),
            Bound::Scalar,
            Bound::Tensor(DType::I64),
            Bound::Tensor(DType::F64),
        ];
        let extra = ParamType::Placeholder("R".into());
        assert!(resolve("k", "k", &p, &b, Some(&extra)).is_err());
    }
}
