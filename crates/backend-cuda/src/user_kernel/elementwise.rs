//! [`ElementwiseKernel`]: a CUDA C body run once per element of its broadcast arguments.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kiln_core::{DType, Error, Layout, Result, Shape, Tensor};

use super::params::{Bound, CType, Param, concrete, parse_params, resolve};
use super::source::{self, Slot, Spec};
use super::{
    KernelArg, Taken, UserKey, access, common_device, held_buffers, kernel, merged, push_scalar,
};
use crate::codegen::Access;
use crate::device::{Func, KERNEL_EPOCH, state};
use crate::launch::{Args, Dims, Strides};
use crate::memory::alloc;
use crate::storage::CudaStorage;
use crate::types::{Cuda, CudaDevice};

const OP: &str = "ElementwiseKernel";
/// Threads per block.
const BLOCK: u32 = 256;

/// An elementwise kernel from a few lines of CUDA C (CuPy's `ElementwiseKernel`).
///
/// ```no_run
/// # use kiln_backend_cuda::{Cuda, ElementwiseKernel};
/// # use kiln_core::{DType, Generator, Tensor};
/// # fn main() -> kiln_core::Result<()> {
/// # let dev = kiln_backend_cuda::try_gpu(0).unwrap();
/// let sqdiff = ElementwiseKernel::new("T x, T y", "T z", "z = (x - y) * (x - y)", "sqdiff")?;
/// let x = Generator::new(1).uniform::<Cuda>([4, 5], -1.0, 1.0, &dev)?;
/// let y = Generator::new(2).uniform::<Cuda>([5], -1.0, 1.0, &dev)?; // broadcast
/// let z = sqdiff.call1(&[(&x).into(), (&y).into()])?; // T = float, z: [4, 5] f32
/// # Ok(()) }
/// ```
///
/// Parameters are `[raw] TYPE NAME`, comma-separated. `TYPE` is a concrete type (`float32` or
/// `float`, `float64`/`double`, `int64`, `uint8`, and `int32`/`int` for scalars) or a
/// placeholder (any other identifier), resolved at each call from the dtypes of the tensors
/// bound to parameters of that type. In the body an input is the `const` value of its
/// element, an output a reference to its element, a `raw` parameter the tensor's pointer
/// (indexed by the body; the tensor must be contiguous), a scalar its value; `i` is the index
/// of the element and `n` the number of elements. Tensor inputs and outputs broadcast
/// together (numpy rules).
#[derive(Clone, Debug)]
pub struct ElementwiseKernel {
    name: String,
    /// Inputs, then outputs.
    params: Vec<Param>,
    n_in: usize,
    body: String,
    preamble: String,
    id: u128,
    /// The last call's plan (shared by clones).
    last: LastPlan,
}

/// What a call derives from its arguments' dtypes, shapes, strides and devices alone, kept for
/// the next call with the same [`signature`]: a loop calling a kernel on same-shaped tensors
/// then skips binding, type resolution, broadcasting, dimension merging and the kernel lookup
/// (against a stand-in driver, most of the gap between a user kernel's call and a built-in
/// op's).
struct Plan {
    sig: Vec<u64>,
    /// The [`KERNEL_EPOCH`] `f` belongs to.
    epoch: u64,
    dev: CudaDevice,
    shape: Shape,
    out_types: Vec<DType>,
    slots: Vec<Slot>,
    /// Every parameter's concrete type.
    types: Vec<CType>,
    dims: Dims,
    strides: Vec<Strides>,
    f: Func,
    n: usize,
}

/// A one-entry memo of [`Plan`]s.
#[derive(Clone, Default)]
struct LastPlan(Arc<Mutex<Option<Arc<Plan>>>>);

impl LastPlan {
    fn get(&self, sig: &[u64], epoch: u64) -> Option<Arc<Plan>> {
        let last = self.0.lock().unwrap();
        last.as_ref()
            .filter(|p| p.epoch == epoch && p.sig == sig)
            .cloned()
    }
    fn put(&self, plan: Arc<Plan>) {
        *self.0.lock().unwrap() = Some(plan);
    }
}

impl std::fmt::Debug for LastPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LastPlan")
    }
}

/// A call's signature: for each argument, whether it is a tensor and, if so, its device,
/// dtype, dimensions and strides (not its offset: pointers are computed per call, but whether
/// it needs 64-bit indexing); then the same for each output given.
fn signature(inputs: &[KernelArg], given: &[&mut Tensor<Cuda>]) -> Vec<u64> {
    let mut sig = Vec::with_capacity(8 * (inputs.len() + given.len()));
    let tensor = |sig: &mut Vec<u64>, t: &Tensor<Cuda>| {
        let l = t.layout();
        // (Whether the offset takes the extent past 32-bit indexing is part of the plan.)
        let wide = (l.storage_extent() >= (1 << 31)) as u64;
        sig.push(
            1 + (wide << 1) + ((t.device().ordinal() as u64) << 8) + ((t.dtype() as u64) << 32),
        );
        sig.push(l.rank() as u64);
        sig.extend(l.dims().iter().map(|&d| d as u64));
        sig.extend(l.strides().iter().map(|&s| s as u64));
    };
    for a in inputs {
        match a {
            KernelArg::Tensor(t) => tensor(&mut sig, t),
            _ => sig.push(0),
        }
    }
    for t in given {
        tensor(&mut sig, t);
    }
    sig
}

impl ElementwiseKernel {
    /// A kernel named `name` (a C identifier; the compiled function's name) with parameter
    /// lists `in_params` and `out_params` (at least one output) and `body`. Nothing is
    /// compiled until the first call; a malformed parameter list is an error here.
    pub fn new(in_params: &str, out_params: &str, body: &str, name: &str) -> Result<Self> {
        let ins = parse_params(OP, in_params)?;
        let outs = parse_params(OP, out_params)?;
        if outs.is_empty() {
            return Err(Error::invalid(OP, format!("kernel `{name}` has no output")));
        }
        check_name(name)?;
        for o in &outs {
            if ins.iter().any(|p| p.name == o.name) {
                return Err(Error::invalid(
                    OP,
                    format!("`{}` is both an input and an output of `{name}`", o.name),
                ));
            }
        }
        let n_in = ins.len();
        let mut k = ElementwiseKernel {
            name: name.to_string(),
            params: ins.into_iter().chain(outs).collect(),
            n_in,
            body: body.to_string(),
            preamble: String::new(),
            id: 0,
            last: LastPlan::default(),
        };
        k.rehash();
        Ok(k)
    }

    /// Code placed before the kernel (helper device functions, constants).
    pub fn with_preamble(mut self, preamble: &str) -> Self {
        self.preamble = preamble.to_string();
        self.rehash();
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn rehash(&mut self) {
        let decl = format!("{:?}", (&self.params, self.n_in));
        self.id = crate::nvrtc::fnv128(&[
            b"elementwise",
            self.name.as_bytes(),
            decl.as_bytes(),
            self.body.as_bytes(),
            self.preamble.as_bytes(),
        ]);
        // Another definition: plans made for the old one (shared with clones) do not apply.
        self.last = LastPlan::default();
    }

    /// Runs the kernel over `inputs` (one per input parameter, in order) and returns the
    /// outputs, allocated in the broadcast shape of the tensor inputs with their parameters'
    /// types.
    pub fn call(&self, inputs: &[KernelArg]) -> Result<Vec<Tensor<Cuda>>> {
        self.run(inputs, &mut [])
    }

    /// [`ElementwiseKernel::call`] for a kernel with one output.
    pub fn call1(&self, inputs: &[KernelArg]) -> Result<Tensor<Cuda>> {
        if self.params.len() - self.n_in != 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "call1 on `{}`, which has {} outputs (use call)",
                    self.name,
                    self.params.len() - self.n_in
                ),
            ));
        }
        Ok(self.call(inputs)?.remove(0))
    }

    /// Runs the kernel writing into `outputs` (one per output parameter, in order), which take
    /// part in broadcasting and must have the broadcast shape. Each must own its storage (no
    /// other tensor shares it).
    pub fn call_into(&self, inputs: &[KernelArg], outputs: &mut [&mut Tensor<Cuda>]) -> Result<()> {
        let n_out = self.params.len() - self.n_in;
        if outputs.len() != n_out {
            return Err(Error::invalid(
                OP,
                format!(
                    "kernel `{}` has {n_out} output(s), {} were given",
                    self.name,
                    outputs.len()
                ),
            ));
        }
        self.run(inputs, outputs).map(drop)
    }

    fn run(
        &self,
        inputs: &[KernelArg],
        given: &mut [&mut Tensor<Cuda>],
    ) -> Result<Vec<Tensor<Cuda>>> {
        if inputs.len() != self.n_in {
            return Err(arity(&self.name, &self.params[..self.n_in], inputs.len()));
        }
        let sig = signature(inputs, given);
        let epoch = KERNEL_EPOCH.load(Ordering::SeqCst);
        let plan = match self.last.get(&sig, epoch) {
            Some(p) => p,
            None => {
                let p = Arc::new(self.plan(inputs, given, sig, epoch)?);
                self.last.put(p.clone());
                p
            }
        };
        self.launch(&plan, inputs, given)
    }

    /// Everything a call derives from its arguments' dtypes, shapes, strides and devices: the
    /// checks, the resolved types, the iteration shape, how each argument is addressed, and
    /// the compiled kernel.
    fn plan(
        &self,
        inputs: &[KernelArg],
        given: &[&mut Tensor<Cuda>],
        sig: Vec<u64>,
        epoch: u64,
    ) -> Result<Plan> {
        let (ins, outs) = self.params.split_at(self.n_in);
        let mut bound = Vec::with_capacity(self.params.len());
        for (p, a) in ins.iter().zip(inputs) {
            bound.push(bind(&self.name, p, a)?);
        }
        for g in given.iter() {
            bound.push(Bound::Tensor(g.dtype()));
        }
        bound.resize(self.params.len(), Bound::Output);
        let r = resolve(OP, &self.name, &self.params, &bound, None)?;
        let tensors = inputs.iter().filter_map(|a| match a {
            KernelArg::Tensor(t) => Some(*t),
            _ => None,
        });
        let dev = common_device(OP, tensors.chain(given.iter().map(|t| &**t)))?
            .ok_or_else(|| no_tensor(&self.name))?;
        let shape = self.iteration_shape(inputs, given)?;
        let out_types = outs
            .iter()
            .map(|p| {
                let c = concrete(&p.ty, &r);
                c.dtype().ok_or_else(|| int_output(&self.name, &p.name))
            })
            .collect::<Result<Vec<_>>>()?;
        let n = shape.elem_count();
        let (layouts, slots) = self.operands(inputs, given, &shape)?;
        let wide = n >= (1 << 31)
            || layouts
                .iter()
                .flatten()
                .any(|l| l.storage_extent() >= (1 << 31));
        let strided: Vec<&[usize]> = layouts
            .iter()
            .zip(&slots)
            .filter(|(_, s)| **s == Slot::Tensor(Access::Strided))
            .map(|(l, _)| l.as_ref().expect("tensor slot").strides())
            .collect();
        let (dims, strides) = merged(OP, shape.dims(), &strided)?;
        let key = UserKey {
            id: self.id,
            types: r.iter().map(|(_, c)| *c).collect(),
            slots: slots.clone(),
            wide,
            split: 0,
        };
        let s = state(&dev)?;
        let spec = Spec {
            name: &self.name,
            inputs: ins,
            outputs: outs,
            preamble: &self.preamble,
        };
        let f = kernel(s, OP, &self.name, &key, || {
            source::elementwise(&spec, &self.body, &r, &slots, wide)
        })?;
        let types = self.params.iter().map(|p| concrete(&p.ty, &r)).collect();
        Ok(Plan {
            sig,
            epoch,
            dev,
            shape,
            out_types,
            slots,
            types,
            dims,
            strides,
            f,
            n,
        })
    }

    /// The iteration shape: every non-raw tensor (inputs and given outputs) broadcast
    /// together; given outputs must have it, raw operands must be contiguous.
    fn iteration_shape(&self, inputs: &[KernelArg], given: &[&mut Tensor<Cuda>]) -> Result<Shape> {
        let (ins, outs) = self.params.split_at(self.n_in);
        let mut shape: Option<Shape> = None;
        let shaped = ins
            .iter()
            .zip(inputs)
            .filter(|(p, _)| !p.raw)
            .filter_map(|(_, a)| match a {
                KernelArg::Tensor(t) => Some(t.shape()),
                _ => None,
            })
            .chain(
                given
                    .iter()
                    .zip(outs)
                    .filter(|(_, p)| !p.raw)
                    .map(|(t, _)| t.shape()),
            );
        for s in shaped {
            shape = Some(match shape {
                None => s.clone(),
                Some(have) => have.broadcast_with(OP, s)?,
            });
        }
        let shape = shape.ok_or_else(|| no_tensor(&self.name))?;
        for (g, p) in given.iter().zip(outs) {
            if !p.raw && g.shape() != &shape {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: shape.clone(),
                    rhs: g.shape().clone(),
                });
            }
        }
        for (t, p) in given.iter().zip(outs).filter(|(_, p)| p.raw) {
            if !t.is_contiguous() {
                return Err(not_contiguous(&self.name, &p.name));
            }
        }
        for (p, a) in ins.iter().zip(inputs) {
            if let (true, KernelArg::Tensor(t)) = (p.raw, a)
                && !t.is_contiguous()
            {
                return Err(not_contiguous(&self.name, &p.name));
            }
        }
        Ok(shape)
    }

    /// Per parameter, its layout broadcast to `shape` (tensors) and its slot.
    fn operands(
        &self,
        inputs: &[KernelArg],
        given: &[&mut Tensor<Cuda>],
        shape: &Shape,
    ) -> Result<(Vec<Option<Layout>>, Vec<Slot>)> {
        let (ins, outs) = self.params.split_at(self.n_in);
        let n = shape.elem_count();
        let contiguous = Layout::contiguous(shape.clone());
        let mut layouts: Vec<Option<Layout>> = Vec::with_capacity(self.params.len());
        let mut slots: Vec<Slot> = Vec::with_capacity(self.params.len());
        for (p, a) in ins.iter().zip(inputs) {
            match a {
                KernelArg::Tensor(_) if p.raw => {
                    layouts.push(None);
                    slots.push(Slot::Raw);
                }
                KernelArg::Tensor(t) => {
                    let l = t.layout().broadcast_to(shape)?;
                    slots.push(Slot::Tensor(access(l.dims(), l.strides())));
                    layouts.push(Some(l));
                }
                _ => {
                    layouts.push(None);
                    slots.push(Slot::Scalar);
                }
            }
        }
        for (j, p) in outs.iter().enumerate() {
            if p.raw {
                layouts.push(None);
                slots.push(Slot::Raw);
                continue;
            }
            let l = match given.get(j) {
                Some(g) => g.layout().clone(),
                None => contiguous.clone(),
            };
            slots.push(Slot::Tensor(match access(l.dims(), l.strides()) {
                Access::Bcast if n > 1 => Access::Strided, // only for 1-element shapes
                a => a,
            }));
            layouts.push(Some(l));
        }
        Ok((layouts, slots))
    }

    /// Runs `plan` over this call's buffers: the per-call part (pointers, output buffers,
    /// stream bookkeeping, the launch).
    fn launch(
        &self,
        plan: &Plan,
        inputs: &[KernelArg],
        given: &mut [&mut Tensor<Cuda>],
    ) -> Result<Vec<Tensor<Cuda>>> {
        let outs = &self.params[self.n_in..];
        let (n, f, slots) = (plan.n, plan.f, &plan.slots);
        let s = state(&plan.dev)?;

        // Buffers: inputs computed (pending work runs) and marked used on this stream.
        let held = held_buffers(inputs)?;
        let mut taken = Vec::with_capacity(given.len());
        for (g, p) in given.iter_mut().zip(outs) {
            taken.push(Taken::new(OP, &p.name, g)?);
        }
        let mut fresh = Vec::new();
        let mut out_ptrs = Vec::with_capacity(outs.len());
        for (j, t) in plan.out_types.iter().enumerate() {
            match taken.get_mut(j) {
                Some(tk) => out_ptrs.push(tk.write_ptr()?),
                None => {
                    let b = alloc(s, n * t.size_in_bytes())?;
                    out_ptrs.push(b.device_ptr());
                    fresh.push(b);
                }
            }
        }
        let mut args = Args::new();
        args.push(n as u64).push(plan.dims);
        let mut st = plan.strides.iter();
        for (k, slot) in slots.iter().copied().enumerate() {
            let ptr = if k < self.n_in {
                match (&inputs[k], &held[k]) {
                    (KernelArg::Tensor(t), Some(b)) => Some(
                        b.device_ptr() + (t.layout().offset() * t.dtype().size_in_bytes()) as u64,
                    ),
                    (a, _) => {
                        push_scalar(&mut args, a, plan.types[k]);
                        None
                    }
                }
            } else {
                Some(out_ptrs[k - self.n_in])
            };
            if let Some(ptr) = ptr {
                args.push(ptr);
                if slot == Slot::Tensor(Access::Strided) {
                    args.push(*st.next().expect("one per strided operand"));
                }
            }
        }
        if n > 0 {
            s.launch(OP, f, s.grid_1d(n as u64, BLOCK), BLOCK, 0, args.ptrs())?;
        }
        drop(held);
        drop(taken);
        Ok(fresh
            .into_iter()
            .zip(plan.out_types.iter().skip(given.len()))
            .map(|(b, &dt)| Tensor::from_storage(CudaStorage::ready(b), plan.shape.clone(), dt))
            .collect())
    }
}

pub(super) fn check_name(name: &str) -> Result<()> {
    if !super::params::is_ident(name) || name.starts_with("_k") {
        return Err(Error::invalid(
            "user kernel",
            format!("kernel name `{name}` is not a C identifier (or starts with `_k`)"),
        ));
    }
    Ok(())
}

/// What a call binds to input parameter `p`.
pub(super) fn bind(kernel: &str, p: &Param, a: &KernelArg) -> Result<Bound> {
    match a {
        KernelArg::Tensor(t) => Ok(Bound::Tensor(t.dtype())),
        _ if p.raw => Err(Error::invalid(
            OP,
            format!(
                "kernel `{kernel}`: raw parameter `{}` needs a tensor, got {}",
                p.name,
                a.describe()
            ),
        )),
        _ => Ok(Bound::Scalar),
    }
}

pub(super) fn arity(kernel: &str, ins: &[Param], got: usize) -> Error {
    let names: Vec<&str> = ins.iter().map(|p| p.name.as_str()).collect();
    Error::invalid(
        "user kernel",
        format!(
            "kernel `{kernel}` takes {} input argument(s) ({}), got {got}",
            ins.len(),
            names.join(", ")
        ),
    )
}

pub(super) fn no_tensor(kernel: &str) -> Error {
    Error::invalid(
        "user kernel",
        format!("kernel `{kernel}`: no tensor argument to take the device and shape from"),
    )
}

pub(super) fn not_contiguous(kernel: &str, param: &str) -> Error {
    Error::invalid(
        "user kernel",
        format!(
            "kernel `{kernel}`: raw parameter `{param}` needs a contiguous tensor (call \
             .contiguous() first)"
        ),
    )
}

pub(super) fn int_output(kernel: &str, param: &str) -> Error {
    Error::invalid(
        "user kernel",
        format!(
            "kernel `{kernel}`: output `{param}` has type int; outputs are tensors of f32, f64, \
             i64 or u8"
        ),
    )
}
