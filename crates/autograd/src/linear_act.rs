//! [`Var::linear_act`]: a linear layer and its activation as one op, computed by the backend's
//! fused-epilogue product where it offers one (`Backend::linear_epilogue`, module
//! `kiln_core::epilogue`), composed otherwise.
//!
//! # Why
//!
//! Composed, `act(x · wᵀ + b)` is a product, then one elementwise pass over the output (the
//! bias add and the activation, fused) that reads and writes it all again; a library GEMM with
//! a bias-and-activation epilogue (cuBLASLt) does them as it stores its tiles. The composed
//! path is exactly `x.linear(w, b)?.unary(act)`, so turning the fused path off
//! ([`set_linear_epilogues`]) or running on a backend without it changes no bit of a CPU run.
//! kiln-nn's `Sequential` calls this for a `Linear` followed by a `Relu`, `Gelu` or `GeluTanh`,
//! so models get it without changing their code.

use std::sync::atomic::{AtomicBool, Ordering};

use kiln_core::backend::Operand;
use kiln_core::epilogue::{EpilogueGrads, EpilogueOutputs};
use kiln_core::{Activation, Backend, Error, Result, Tensor};

use crate::Var;
use crate::autocast::autocast_dtype;
use crate::var::is_grad_enabled;

static EPILOGUES: AtomicBool = AtomicBool::new(true);

/// Turns the backends' fused linear epilogues on or off for the whole process (on by default):
/// off, [`Var::linear_act`] always composes (for A/B comparisons, or to rule the library path
/// out while debugging).
pub fn set_linear_epilogues(on: bool) {
    EPILOGUES.store(on, Ordering::Relaxed);
}

/// Whether [`Var::linear_act`] asks the backend for a fused epilogue ([`set_linear_epilogues`]).
pub fn linear_epilogues_enabled() -> bool {
    EPILOGUES.load(Ordering::Relaxed)
}

fn operand<B: Backend>(t: &Tensor<B>) -> Operand<'_, B::Storage> {
    (t.storage(), t.layout())
}

impl<B: Backend> Var<B> {
    /// `act(self · wᵀ + b)`: [`Var::linear`] followed by the activation, as one op. Where the
    /// backend offers a product with a bias-and-activation epilogue for these operands (module
    /// docs) it runs that, and its backward; otherwise it is exactly
    /// `self.linear(w, b)?.unary(op)` (same values, same gradients, same autocast casts).
    pub fn linear_act(&self, w: &Self, b: Option<&Self>, act: Activation) -> Result<Self> {
        if linear_epilogues_enabled() {
            let (x, w, b) = if autocast_dtype().is_some() {
                let b = b.map(Var::autocast_low).transpose()?;
                (self.autocast_low()?, w.autocast_low()?, b)
            } else {
                (self.clone(), w.clone(), b.cloned())
            };
            if let Some(y) = fused(&x, &w, b.as_ref(), act)? {
                return Ok(y);
            }
        }
        let y = self.linear(w, b)?;
        match act.unary() {
            Some(op) => y.unary(op),
            None => Ok(y),
        }
    }
}

/// The backend's fused path, or `None` when the shapes do not fit a linear layer (the composed
/// path reports those) or the backend declines.
fn fused<B: Backend>(
    x: &Var<B>,
    w: &Var<B>,
    b: Option<&Var<B>>,
    act: Activation,
) -> Result<Option<Var<B>>> {
    const OP: &str = "linear_act";
    let (xt, wt) = (x.tensor(), w.tensor());
    let dtype = xt.dtype();
    if wt.rank() != 2
        || xt.rank() == 0
        || wt.dtype() != dtype
        || xt.dims()[xt.rank() - 1] != wt.dims()[1]
        || b.is_some_and(|b| b.shape().dims() != [wt.dims()[0]])
    {
        return Ok(None);
    }
    let (n, k) = (wt.dims()[0], wt.dims()[1]);
    let m = xt.elem_count() / k.max(1);
    let x2 = xt.reshape([m, k])?;
    let bt = b.map(Var::tensor);
    let mut inputs = vec![x, w];
    inputs.extend(b);
    let keep_aux = is_grad_enabled() && inputs.iter().any(|v| v.requires_grad());
    let bias = bt.as_ref().map(|t| (operand(t), t.dtype()));
    let Some(EpilogueOutputs { out, aux }) =
        B::linear_epilogue(operand(&x2), operand(&wt), bias, dtype, act, keep_aux)?
    else {
        return Ok(None);
    };
    let mut dims = xt.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = n;
    let y = Tensor::<B>::from_storage(out, dims, dtype);
    let bias_dtype = bt.as_ref().map(|t| t.dtype());
    Ok(Some(Var::from_op(OP, &inputs, y, move |g, needs| {
        let g2 = g.reshape([m, n])?;
        let g2 = if g2.dtype() == dtype {
            g2
        } else {
            g2.to_dtype(dtype)?
        };
        let grads = B::linear_epilogue_backward(
            operand(&x2),
            operand(&wt),
            aux.as_ref(),
            operand(&g2),
            dtype,
            bias_dtype,
            act,
        )?;
        let Some(EpilogueGrads { dx, dw, db }) = grads else {
            return Err(Error::backend(
                OP,
                "the backend ran the fused forward but offers no backward for it",
            ));
        };
        let dx = needs[0].then(|| Tensor::<B>::from_storage(dx, xt.shape().clone(), dtype));
        let dw = needs[1].then(|| Tensor::<B>::from_storage(dw, [n, k], dtype));
        let mut out = vec![dx, dw];
        if let Some(bd) = bias_dtype {
            let db = match (needs[2], db) {
                (true, Some(s)) => Some(Tensor::<B>::from_storage(s, [n], bd)),
                (true, None) => {
                    return Err(Error::backend(OP, "the backend gave no bias gradient"));
                }
                (false, _) => None,
            };
            out.push(db);
        }
        Ok(out)
    })))
}
