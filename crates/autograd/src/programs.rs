//! What the ops written as expression programs share (`norm.rs`, `batch_norm.rs`): a memo of
//! built programs by key (each distinct shape class is built and lowered once per process), and
//! the numbering (and typing) of a program's inputs in the order they are taken.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_core::expr::{Expr, Program};
use kiln_core::{DType, Result};

/// A process-wide memo of programs by key (a `static` in each op's module).
pub(crate) type Memo<K> = OnceLock<Mutex<HashMap<K, Arc<Program>>>>;

/// The program of `key` from `memo`, or built by `build` (the inputs it took, and the outputs)
/// and remembered.
pub(crate) fn memoized<K: Eq + Hash + Copy>(
    memo: &Memo<K>,
    key: K,
    build: impl FnOnce(K) -> (Inputs, Vec<Expr>),
) -> Result<Arc<Program>> {
    let memo = memo.get_or_init(Default::default);
    if let Some(p) = memo.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(p.clone());
    }
    let (inputs, outputs) = build(key);
    let p = Arc::new(Program::from_exprs(&inputs.dtypes, &outputs)?);
    memo.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, p.clone());
    Ok(p)
}

/// Inputs in order, as `Expr::input`s numbered as they are taken, each with its dtype.
///
/// Most inputs are of the program's *compute* dtype `dtype`; [`Inputs::next_of`] takes one
/// stored in another dtype (a bf16 activation beside f32 statistics) and widens it to `dtype`
/// inside the program, a cast the backends fuse into the load.
pub(crate) struct Inputs {
    dtype: DType,
    pub(crate) dtypes: Vec<DType>,
}

impl Inputs {
    pub(crate) fn new(dtype: DType) -> Self {
        Inputs {
            dtype,
            dtypes: Vec::new(),
        }
    }
    /// The next input, of the compute dtype.
    pub(crate) fn next(&mut self) -> Expr {
        self.next_of(self.dtype)
    }
    pub(crate) fn next_if(&mut self, present: bool) -> Option<Expr> {
        present.then(|| self.next())
    }
    /// The next input, stored as `stored`, in the compute dtype.
    pub(crate) fn next_of(&mut self, stored: DType) -> Expr {
        self.dtypes.push(stored);
        let e = Expr::input(self.dtypes.len() - 1);
        if stored == self.dtype {
            e
        } else {
            e.to_dtype(self.dtype)
        }
    }
}
