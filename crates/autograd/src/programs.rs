//! What the ops written as expression programs share (`norm.rs`, `batch_norm.rs`): a memo of
//! built programs by key (each distinct shape class is built and lowered once per process), and
//! the numbering of a program's inputs in the order they are taken.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_core::expr::{Expr, Program};
use kiln_core::{DType, Result};

/// A process-wide memo of programs by key (a `static` in each op's module).
pub(crate) type Memo<K> = OnceLock<Mutex<HashMap<K, Arc<Program>>>>;

/// The program of `key` from `memo`, or built by `build` (the number of inputs, all of `dtype`,
/// and the outputs) and remembered.
pub(crate) fn memoized<K: Eq + Hash + Copy>(
    memo: &Memo<K>,
    key: K,
    dtype: DType,
    build: impl FnOnce(K) -> (usize, Vec<Expr>),
) -> Result<Arc<Program>> {
    let memo = memo.get_or_init(Default::default);
    if let Some(p) = memo.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(p.clone());
    }
    let (inputs, outputs) = build(key);
    let p = Arc::new(Program::from_exprs(&vec![dtype; inputs], &outputs)?);
    memo.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, p.clone());
    Ok(p)
}

/// Inputs in order, as `Expr::input`s numbered as they are taken.
pub(crate) struct Inputs(pub(crate) usize);

impl Inputs {
    pub(crate) fn next(&mut self) -> Expr {
        self.0 += 1;
        Expr::input(self.0 - 1)
    }
    pub(crate) fn next_if(&mut self, present: bool) -> Option<Expr> {
        present.then(|| self.next())
    }
}
