//! Lone elementwise ops over computed buffers: the one path of every op of the op table when
//! it runs by itself (realized, or with fusion off), as a generated program of one op.
//!
//! # Why a module of its own
//!
//! A lone op's host time is its whole cost (a realized `exp` in a loop: ~0.4 µs of host work
//! against the stand-in driver), so it has a path of its own over `expr_run.rs`'s planning and
//! launching: the few plans this thread used last are found by comparison alone ([`LONE`]),
//! and up to three operands pass without allocating. Inputs whose layouts a kernel cannot take
//! are copied contiguous first.
//!
//! Layer: beside `expr_run.rs`, which it calls; `ops/` calls it.

use std::cell::RefCell;
use std::sync::Arc;

use kiln_core::expr::Program;
use kiln_core::{DType, Error, Layout, Result, Shape};

use crate::device::DeviceState;
use crate::expr_run::{Caller, Parts, Planned, planned_parts, run_planned, run_planned_one};
use crate::memory::Buffer;

/// Runs the program of one op (`name`, for errors and the profiler) over computed buffers, in
/// the iteration `shape`: the one path of every elementwise op of the op table, fused or not
/// (a chain and a lone op are both generated from the table). Inputs whose layouts a kernel
/// cannot take (more than 8 dimensions that do not merge) are first copied contiguous.
pub(crate) fn run_single(
    name: &'static str,
    program: &Program,
    inputs: &[(&Arc<Buffer>, &Layout)],
    shape: &Shape,
    contiguous: impl Fn(&Buffer, &Layout, DType) -> Result<Buffer>,
) -> Result<Buffer> {
    run_single_parts(name, Parts::of(program), inputs, shape, &[], contiguous)
}

/// [`run_single`] of the program `parts` define, with scalar parameters `params` (kernel
/// arguments: a new value reuses the kernel). The program is built only the first time this
/// thread plans the call ([`planned_parts`]), so a binary op or a scalar op costs no
/// allocation on the host once warm. Errors of the call name the op.
pub(crate) fn run_single_parts(
    name: &'static str,
    parts: Parts<'_>,
    inputs: &[(&Arc<Buffer>, &Layout)],
    shape: &Shape,
    params: &[f64],
    contiguous: impl Fn(&Buffer, &Layout, DType) -> Result<Buffer>,
) -> Result<Buffer> {
    let dev = inputs[0].0.state();
    for (b, _) in &inputs[1..] {
        if b.state().ordinal() != dev.ordinal() {
            return Err(Error::DeviceMismatch {
                op: name,
                lhs: inputs[0].0.device().to_string(),
                rhs: b.device().to_string(),
            });
        }
    }
    dev.bind()?;
    let plan = |layouts: &[&Layout]| {
        if let Some(p) = lone_hit(parts, shape, layouts, params.len()) {
            return Ok(p);
        }
        match planned_parts(parts, shape, layouts, params) {
            Ok(Some(p)) => {
                lone_note(&p);
                Ok(p)
            }
            Ok(None) => Err(Error::backend(name, "internal: not a valid program")),
            // `check_call` names the IR ("expr"); the caller knows the op.
            Err(Error::Expr { kind, msg, .. }) => Err(Error::Expr {
                op: name,
                kind,
                msg,
            }),
            Err(e) => Err(e),
        }
    };
    let op = Caller::Op(name);
    // Up to 3 operands (`where`) without allocating: a lone op's host time is its cost.
    let n = inputs.len();
    let mut bufs: [&Buffer; 3] = [inputs[0].0; 3];
    let mut layouts: [&Layout; 3] = [inputs[0].1; 3];
    if n <= 3 {
        for (k, (b, l)) in inputs.iter().enumerate() {
            bufs[k] = b;
            layouts[k] = l;
        }
        let p = plan(&layouts[..n])?;
        if let Some(out) = run_first(dev, &p, &bufs[..n], &layouts[..n], params, op)? {
            return Ok(out);
        }
    }
    let layouts: Vec<&Layout> = inputs.iter().map(|(_, l)| *l).collect();
    let bufs: Vec<&Buffer> = inputs.iter().map(|(b, _)| &***b).collect();
    if n > 3 {
        let p = plan(&layouts)?;
        if let Some(out) = run_first(dev, &p, &bufs, &layouts, params, op)? {
            return Ok(out);
        }
    }
    let flat = Layout::contiguous(shape.clone());
    let copies = inputs
        .iter()
        .zip(parts.inputs)
        .map(|((b, l), &dt)| contiguous(b, l, dt))
        .collect::<Result<Vec<Buffer>>>()?;
    let bufs: Vec<&Buffer> = copies.iter().collect();
    let layouts = vec![&flat; bufs.len()];
    let p = plan(&layouts)?;
    match run_first(dev, &p, &bufs, &layouts, params, op)? {
        Some(out) => Ok(out),
        None => Err(Error::backend(
            name,
            "internal: a single op over contiguous inputs did not plan as one kernel",
        )),
    }
}

/// The first output of `p` run over `bufs` ([`run_planned_one`] when it is the only one).
fn run_first(
    dev: &'static DeviceState,
    p: &Planned,
    bufs: &[&Buffer],
    layouts: &[&Layout],
    params: &[f64],
    caller: Caller,
) -> Result<Option<Buffer>> {
    if p.outputs() == 1 {
        return run_planned_one(dev, p, bufs, layouts, params, caller);
    }
    Ok(run_planned(dev, p, bufs, layouts, params, caller)?.map(|mut o| o.swap_remove(0)))
}

/// The lone ops this thread planned last (`run_single_parts`), most recent first: an op repeated on operands of the same layouts (a loop's realized
/// op) finds its plan by comparing a few instructions, dtypes and layouts, without
/// fingerprinting the program, hashing the layouts and searching [`PLANNED`]. A miss costs
/// at most [`LONE_LEN`] comparisons that mostly fail at the first instruction that differs.
const LONE_LEN: usize = 8;

thread_local! {
    static LONE: RefCell<Vec<std::rc::Rc<Planned>>> =
        const { RefCell::new(Vec::new()) };
}

/// The plan of the lone op `parts` that [`lone_note`] remembered for these operands, moved
/// to the front.
fn lone_hit(
    parts: Parts<'_>,
    shape: &Shape,
    layouts: &[&Layout],
    params: usize,
) -> Option<std::rc::Rc<Planned>> {
    LONE.with(|l| {
        let mut l = l.borrow_mut();
        let at = (l.iter()).position(|e| e.is_plan_of(parts, shape, layouts, params))?;
        l[..=at].rotate_right(1);
        Some(l[0].clone())
    })
}

/// Remembers the plan of a lone op for [`lone_hit`], in front, forgetting the oldest.
fn lone_note(p: &std::rc::Rc<Planned>) {
    LONE.with(|l| {
        let mut l = l.borrow_mut();
        if l.len() == LONE_LEN {
            l.pop();
        }
        l.insert(0, p.clone());
    })
}
