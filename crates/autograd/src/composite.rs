//! Composite ops (kiln-core's `composite_table!`: `leaky_relu(negative_slope)`, `elu(alpha)`,
//! ...) on variables: each a fused function whose backward the IR derives (`crate::fuse`), and one
//! generated method per table entry.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use kiln_core::{Backend, CompositeOp, Result};

use crate::fuse::{Fused, fuse};
use crate::var::Var;

impl<B: Backend> Var<B> {
    /// Composite `op` of kiln-core's op table with its scalar parameters (what its generated
    /// method, e.g. `leaky_relu(negative_slope)`, calls): one fused forward program, and a
    /// backward program derived from it by the IR (`crate::fuse`).
    pub fn composite(&self, op: CompositeOp, params: &[f64]) -> Result<Self> {
        if params.len() != op.params().len() {
            // The tensor op names the mismatch.
            return self.tensor().composite(op, params).map(Var::constant);
        }
        Ok(composite_fused(op)
            .vars_with(&[self], params)?
            .swap_remove(0))
    }
}

/// The fused function of composite `op`, made once per process.
fn composite_fused(op: CompositeOp) -> Fused {
    static MEMO: OnceLock<Mutex<HashMap<CompositeOp, Fused>>> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    let mut m = memo.lock().unwrap_or_else(|e| e.into_inner());
    m.entry(op)
        .or_insert_with(|| fuse(move |_| op.expr()))
        .clone()
}

macro_rules! var_composite_methods {
    ($($(#[doc = $doc:literal])* $V:ident $method:ident($($param:ident),*) { $($body:tt)* })*) => {
        impl<B: Backend> Var<B> {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self, $($param: f64),*) -> Result<Self> {
                    self.composite(CompositeOp::$V, &[$($param),*])
                }
            )*
        }
    };
}
kiln_core::composite_table!(var_composite_methods);
