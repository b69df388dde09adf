//! Which path a convolution takes where the backend offers its own: measured once per shape.
//!
//! # Why
//!
//! A library convolution (cuDNN) is the faster path for ResNet-sized layers, but not for every
//! shape: for a stem layer with a tiny reduction (3 input channels × 3 × 3 taps = 27) cuDNN's
//! kernels idle most of their tiles, and kiln's own im2col + GEMM is faster (H100, 2026-11-27,
//! batch 32, 3→64 channels, 32×32, f32, forward + backward: cuDNN 0.294 ms, im2col 0.194 ms).
//! Where the crossover lies depends on the device, the dtype and the library version, so it is
//! not a constant: as `torch.backends.cudnn.benchmark` does for algorithms, the first
//! convolution of a shape runs both paths on the caller's operands, times them, and the
//! faster one serves that shape from then on.
//!
//! # What is measured, and when
//!
//! Only shapes whose im2col reduction is short (`c/groups · kh · kw ≤` [`MAX_TAPS`]) and whose
//! column matrix is small (≤ [`MAX_COLUMNS`] elements) are candidates: there the library is
//! known to be weak and the measurement costs microseconds; every other shape takes the
//! library without a trial (im2col would hold 9× a ResNet layer's input and lose). The trial
//! runs forward and, when gradients are recorded, backward, under the caller's autocast
//! dtype, synchronizing the device around each timing (three rounds each, the faster round
//! counts). Nothing is measured while the device captures a graph (the library path is taken,
//! and the shape measured later). A device or backend error during the trial is returned: the
//! same operands would fail the convolution itself.
//!
//! The choice is per process; [`set_conv_routing`]`(false)` always takes the library path (for
//! comparisons, or bit-for-bit repeatable runs: the two paths round differently).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kiln_autograd::{Var, autocast_dtype, is_grad_enabled, no_grad};
use kiln_core::{Backend, Conv2dSpec, Result};

/// The longest im2col reduction (`c/groups · kh · kw`) for which the paths are compared.
pub const MAX_TAPS: usize = 64;
/// The largest column matrix (`c · kh · kw · oh · ow · n` elements) for which they are.
pub const MAX_COLUMNS: usize = 1 << 25;

static ROUTING: AtomicBool = AtomicBool::new(true);

/// Turns the measured choice on (the default) or off (always the library where offered).
pub fn set_conv_routing(on: bool) {
    ROUTING.store(on, Ordering::Relaxed);
}

/// Whether shapes are routed by measurement ([`set_conv_routing`]).
pub fn conv_routing() -> bool {
    ROUTING.load(Ordering::Relaxed)
}

/// The measured choices: a shape's key (backend, device, dtypes, shapes, geometry, whether
/// gradients were recorded) and whether im2col won.
static CHOICES: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);

/// One way of computing the convolution (library or im2col), without the bias.
type ConvPath<'a, B> = &'a dyn Fn(&Var<B>, &Var<B>) -> Result<Var<B>>;

/// How many shapes have been measured so far in this process.
pub fn conv_routes_measured() -> usize {
    CHOICES.lock().unwrap().as_ref().map_or(0, HashMap::len)
}

/// One convolution as the router sees it: `taps` is `c/groups · kh · kw`, `columns` the im2col
/// matrix's element count, `spec` the rest of the geometry (stride, padding, dilation, groups).
pub(crate) struct Candidate<'a, B: Backend> {
    pub x: &'a Var<B>,
    pub weight: &'a Var<B>,
    pub taps: usize,
    pub columns: usize,
    pub spec: Conv2dSpec,
}

/// Whether the convolution should take im2col although the backend offers its own. `library`
/// and `im2col` compute it each way (without the bias, which both add the same way).
pub(crate) fn prefer_im2col<B: Backend>(
    c: &Candidate<'_, B>,
    library: impl Fn(&Var<B>, &Var<B>) -> Result<Var<B>>,
    im2col: impl Fn(&Var<B>, &Var<B>) -> Result<Var<B>>,
) -> Result<bool> {
    if !conv_routing() || c.taps > MAX_TAPS || c.columns > MAX_COLUMNS {
        return Ok(false);
    }
    let dev = c.x.device();
    let grads = is_grad_enabled();
    let key = format!(
        "{} {dev:?} {} {:?} {} {:?} {:?} {:?} {grads}",
        B::NAME,
        c.x.dtype(),
        autocast_dtype(),
        c.x.shape(),
        c.weight.dtype(),
        c.weight.shape(),
        c.spec,
    );
    if let Some(&won) = CHOICES.lock().unwrap().get_or_insert_default().get(&key) {
        return Ok(won);
    }
    if B::is_capturing(&dev) {
        return Ok(false);
    }
    // Fresh leaves holding the caller's values: the trial records nothing on the caller's graph.
    let (x, w) = (
        Var::param(c.x.tensor().clone()),
        Var::param(c.weight.tensor().clone()),
    );
    let run = |f: ConvPath<'_, B>| -> Result<Duration> {
        B::synchronize(&dev)?;
        let t0 = Instant::now();
        if grads {
            f(&x, &w)?.sum_all()?.backward()?;
        } else {
            no_grad(|| f(&x, &w))?;
        }
        B::synchronize(&dev)?;
        Ok(t0.elapsed())
    };
    // One untimed round each (compiles, the library's own algorithm search), then the best of
    // three, alternating.
    run(&library)?;
    run(&im2col)?;
    let (mut lib, mut own) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        lib = lib.min(run(&library)?);
        own = own.min(run(&im2col)?);
    }
    let won = own < lib;
    CHOICES
        .lock()
        .unwrap()
        .get_or_insert_default()
        .insert(key, won);
    Ok(won)
}
