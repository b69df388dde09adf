//! Per geometry and direction: which memory format runs (NCHW, or NHWC through transposes,
//! `nhwc.rs`) with which algorithms, measured once and cached, and the call that runs the
//! choice.
//!
//! With the layout switch at `auto`, the first call of a geometry and direction outside a
//! capture searches the algorithms in both formats (`algo::measure`), then times each format's
//! whole call with CUDA events (NCHW: the best algorithm; NHWC: the input transposes, the best
//! algorithm, the output transpose) and keeps the faster. Forced to one format, only that one
//! is searched. Inside a capture, a direction not decided yet runs NCHW (NHWC when forced)
//! with cuDNN's heuristic ranking, as before.

use std::ffi::c_void;

use cudarc::cudnn::sys;
use kiln_core::{DType, Error, Result};

use super::algo::{self, Candidate, Dir, Operands};
use super::desc::{Key, Plan};
use super::log_choices;
use super::nhwc::{self, CudnnLayout, Format};
use crate::device::DeviceState;
use crate::memory::Buffer;

/// Timed runs per format when `auto` compares them (the fastest counts, after a warm-up).
const TIMED_RUNS: usize = 3;

/// One geometry's descriptors per format, the algorithms measured per format and direction
/// ([`Dir::index`], fastest first), the format `auto` picked per direction, and whether cuDNN
/// can run all three directions on it at all (its heuristic lists an algorithm for each): a
/// convolution is offered only then, so that its gradients are never refused after its
/// forward ran. The NHWC plan exists only for tensor-core math and when it too offers all
/// three directions.
pub(super) struct Geometry {
    nchw: Plan,
    nhwc: Option<Plan>,
    chosen: [[Option<Vec<Candidate>>; 3]; 2],
    picked: [Option<Format>; 3],
    pub offered: bool,
}

/// Whether `key`'s math runs on tensor cores (f32 with TF32, bf16, f16): only then is NHWC
/// considered.
fn tensor_core(key: &Key) -> bool {
    key.dtype != DType::F64 && key.math != sys::cudnnMathType_t::CUDNN_FMA_MATH
}

/// Whether cuDNN's heuristic lists an algorithm for each direction on `plan`.
fn offers_all(h: sys::cudnnHandle_t, plan: &Plan, key: &Key) -> Result<bool> {
    for dir in [Dir::Forward, Dir::Data, Dir::Filter] {
        plan.set_math(key.math, dir.op())?;
        if algo::heuristic(h, plan, key.math, dir)?.is_empty() {
            return Ok(false);
        }
    }
    Ok(true)
}

impl Geometry {
    pub fn new(h: sys::cudnnHandle_t, key: &Key) -> Result<Geometry> {
        let nchw = Plan::new(key, Format::Nchw.cudnn())?;
        let offered = offers_all(h, &nchw, key)?;
        // NHWC is an option, never a requirement: descriptors cuDNN refuses mean NCHW only.
        let nhwc = if offered && tensor_core(key) {
            Plan::new(key, Format::Nhwc.cudnn())
                .ok()
                .filter(|p| offers_all(h, p, key).unwrap_or(false))
        } else {
            None
        };
        Ok(Geometry {
            nchw,
            nhwc,
            chosen: Default::default(),
            picked: [None; 3],
            offered,
        })
    }

    fn plan(&self, f: Format) -> &Plan {
        match f {
            Format::Nhwc => self.nhwc.as_ref().unwrap_or(&self.nchw),
            Format::Nchw => &self.nchw,
        }
    }
}

/// One convolution call: the device, handle and key, the direction, the packed NCHW operands
/// (cuDNN's order for the direction, `algo::Operands`) and the NCHW output.
pub(super) struct Call<'a> {
    pub dev: &'static DeviceState,
    pub handle: sys::cudnnHandle_t,
    pub key: &'a Key,
    pub dir: Dir,
    pub a: &'a Buffer,
    pub b: &'a Buffer,
    pub out: &'a Buffer,
}

impl Call<'_> {
    /// The NCHW dimensions of the two operands and the output, in cuDNN's order for the
    /// direction.
    fn dims(&self) -> [[usize; 4]; 3] {
        let k = self.key;
        match self.dir {
            Dir::Forward => [k.x, k.w, k.y],
            Dir::Data => [k.w, k.y, k.x],
            Dir::Filter => [k.x, k.y, k.w],
        }
    }

    fn nchw_ops(&self) -> Operands {
        Operands {
            a: self.a.device_ptr(),
            b: self.b.device_ptr(),
            out: self.out.device_ptr(),
        }
    }

    /// NHWC copies of the two operands and an NHWC output buffer (scratch, freed on drop,
    /// stream-ordered).
    fn stage(&self) -> Result<[Buffer; 3]> {
        let [da, db, dout] = self.dims();
        let dt = self.key.dtype;
        Ok([
            nhwc::to_nhwc(self.a, da, dt)?,
            nhwc::to_nhwc(self.b, db, dt)?,
            nhwc::scratch(self.dev, dout, dt)?,
        ])
    }

    /// Searches the algorithms of `f` on this call's operands (staged into NHWC for NHWC).
    fn measure(&self, geo: &Geometry, f: Format) -> Result<Vec<Candidate>> {
        let plan = geo.plan(f);
        plan.set_math(self.key.math, self.dir.op())?;
        let found = match f {
            Format::Nchw => algo::measure(
                self.dev,
                self.handle,
                plan,
                self.key.math,
                self.dir,
                self.nchw_ops(),
            )?,
            Format::Nhwc => {
                let staged = self.stage()?;
                let ops = staged_operands(&staged);
                algo::measure(self.dev, self.handle, plan, self.key.math, self.dir, ops)?
            }
        };
        if log_choices() {
            let list: Vec<String> = found.iter().take(4).map(|c| c.to_string()).collect();
            let k = self.key;
            eprintln!(
                "kiln cudnn {} {} x {:?} w {:?} {:?} {:?}: {}",
                self.dir.op(),
                f.name(),
                k.x,
                k.w,
                k.dtype,
                k.math,
                if list.is_empty() {
                    "nothing ran".into()
                } else {
                    list.join("; ")
                }
            );
        }
        Ok(found)
    }

    /// Searches `f`'s algorithms for this direction unless they were already (never while
    /// capturing: the heuristic ranking runs then).
    fn ensure(&self, geo: &mut Geometry, f: Format) -> Result<()> {
        let i = self.dir.index();
        if geo.chosen[f.index()][i].is_none() && !self.dev.capturing() {
            let found = self.measure(geo, f)?;
            geo.chosen[f.index()][i] = Some(found);
        }
        Ok(())
    }

    /// The fastest measured NCHW algorithm's time for this direction, ms (searching first);
    /// `None` when nothing was measured (inside a capture, or only the heuristic's ranking).
    pub fn best_nchw_ms(&self, geo: &mut Geometry) -> Result<Option<f32>> {
        self.ensure(geo, Format::Nchw)?;
        Ok(geo.chosen[Format::Nchw.index()][self.dir.index()]
            .as_ref()
            .and_then(|c| c.first())
            .map(|c| c.time())
            .filter(|&t| t > 0.0))
    }

    /// The format this call runs in (module docs), measuring what the switch asks for.
    pub fn choose(&self, geo: &mut Geometry) -> Result<Format> {
        let i = self.dir.index();
        let f = match (nhwc::cudnn_layout(), geo.nhwc.is_some()) {
            (_, false) | (CudnnLayout::Nchw, _) => Format::Nchw,
            (CudnnLayout::Nhwc, true) => Format::Nhwc,
            (CudnnLayout::Auto, true) => match geo.picked[i] {
                Some(f) => f,
                None if self.dev.capturing() => Format::Nchw,
                None => {
                    let f = self.compare(geo)?;
                    geo.picked[i] = Some(f);
                    f
                }
            },
        };
        self.ensure(geo, f)?;
        // NHWC descriptors the heuristic accepted but on which no algorithm ran in the search:
        // NCHW (whose own empty search falls back to the heuristic ranking, as it always has).
        if f == Format::Nhwc
            && geo.chosen[f.index()][i]
                .as_ref()
                .is_some_and(|c| c.is_empty())
        {
            self.ensure(geo, Format::Nchw)?;
            return Ok(Format::Nchw);
        }
        Ok(f)
    }

    /// `auto`'s first call of a direction: both formats searched, then each one's whole call
    /// timed (NHWC with its transposes); the faster. A failure on the NHWC side (its scratch,
    /// or cuDNN refusing) leaves NCHW.
    fn compare(&self, geo: &mut Geometry) -> Result<Format> {
        let i = self.dir.index();
        self.ensure(geo, Format::Nchw)?;
        let nhwc = self.ensure(geo, Format::Nhwc);
        let have = |f: Format, g: &Geometry| {
            g.chosen[f.index()][i]
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        };
        if nhwc.is_err() || !have(Format::Nhwc, geo) {
            self.log_pick(Format::Nchw, None, None, nhwc.err());
            return Ok(Format::Nchw);
        }
        if !have(Format::Nchw, geo) {
            self.log_pick(Format::Nhwc, None, None, None);
            return Ok(Format::Nhwc);
        }
        let t_nchw = nhwc::time_ms(self.dev, TIMED_RUNS, || self.run(geo, Format::Nchw))?;
        match nhwc::time_ms(self.dev, TIMED_RUNS, || self.run(geo, Format::Nhwc)) {
            Ok(t_nhwc) => {
                let f = if t_nhwc < t_nchw {
                    Format::Nhwc
                } else {
                    Format::Nchw
                };
                self.log_pick(f, Some(t_nchw), Some(t_nhwc), None);
                Ok(f)
            }
            Err(e) => {
                self.log_pick(Format::Nchw, Some(t_nchw), None, Some(e));
                Ok(Format::Nchw)
            }
        }
    }

    /// `KILN_CUDNN_LOG=1`: both formats' whole-call times (`-`: not timed, the other format's
    /// search ran nothing) and the one kept.
    fn log_pick(&self, won: Format, nchw: Option<f32>, nhwc: Option<f32>, err: Option<Error>) {
        if !log_choices() {
            return;
        }
        let ms = |t: Option<f32>| t.map_or("-".to_string(), |t| format!("{t:.3} ms"));
        let won = won.name();
        let k = self.key;
        eprintln!(
            "kiln cudnn {} x {:?} w {:?} {:?}: nchw {}, nhwc {} with transposes -> {won}{}",
            self.dir.op(),
            k.x,
            k.w,
            k.dtype,
            ms(nchw),
            ms(nhwc),
            err.map_or(String::new(), |e| format!(" (nhwc failed: {e})")),
        );
    }

    /// Runs the call in format `f` with its measured algorithms (cuDNN's heuristic ranking if
    /// none were: inside a capture, or nothing ran in the search); NHWC stages the operands
    /// and transposes the result into the NCHW output.
    pub fn run(&self, geo: &Geometry, f: Format) -> Result<()> {
        let (op, i) = (self.dir.op(), self.dir.index());
        let plan = geo.plan(f);
        let heuristic;
        let cands: &[Candidate] = match &geo.chosen[f.index()][i] {
            Some(c) if !c.is_empty() => c,
            _ => {
                plan.set_math(self.key.math, op)?;
                heuristic = algo::heuristic(self.handle, plan, self.key.math, self.dir)?;
                &heuristic
            }
        };
        // alpha = 1, beta = 0, as f64 for doubles and f32 otherwise (cuDNN's scaling
        // parameters).
        let (d, s) = ([1.0f64, 0.0], [1.0f32, 0.0]);
        let scalars = if self.key.dtype == DType::F64 {
            (
                &d[0] as *const f64 as *const c_void,
                &d[1] as *const f64 as *const c_void,
            )
        } else {
            (
                &s[0] as *const f32 as *const c_void,
                &s[1] as *const f32 as *const c_void,
            )
        };
        let (dev, h, dir) = (self.dev, self.handle, self.dir);
        match f {
            Format::Nchw => algo::execute(dev, h, plan, dir, cands, self.nchw_ops(), scalars),
            Format::Nhwc => {
                let staged = self.stage()?;
                let ops = staged_operands(&staged);
                algo::execute(dev, h, plan, dir, cands, ops, scalars)?;
                nhwc::to_nchw(&staged[2], self.dims()[2], self.out, self.key.dtype)?;
                nhwc::count_nhwc_call();
                Ok(())
            }
        }
    }
}

/// The device pointers of operands staged into NHWC ([`Call::stage`]'s `[a, b, out]`).
fn staged_operands([a, b, out]: &[Buffer; 3]) -> Operands {
    Operands {
        a: a.device_ptr(),
        b: b.device_ptr(),
        out: out.device_ptr(),
    }
}
