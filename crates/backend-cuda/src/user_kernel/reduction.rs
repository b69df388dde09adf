//! [`ReductionKernel`]: map, reduce and post-map snippets over chosen axes.

use std::sync::Arc;

use kiln_core::{Error, Layout, Result, Shape, Tensor};

use super::elementwise::{arity, bind, check_name, int_output, no_tensor, not_contiguous};
use super::params::{Bound, CType, Param, ParamType, Resolved, concrete, parse_params, resolve};
use super::source::{self, Reduction, Slot, Spec};
use super::{
    KernelArg, Taken, UserKey, access, common_device, held_buffers, kernel, merged, push_scalar,
};
use crate::codegen::Access;
use crate::device::{DeviceState, Func, state};
use crate::launch::{Args, Dims, Strides};
use crate::memory::{Buffer, alloc};
use crate::storage::CudaStorage;
use crate::types::Cuda;

const OP: &str = "ReductionKernel";
/// Most threads per block.
const BLOCK: u32 = 256;

/// A reduction from a few lines of CUDA C (CuPy's `ReductionKernel`).
///
/// ```no_run
/// # use kiln_backend_cuda::{Cuda, ReductionKernel};
/// # use kiln_core::{DType, Generator, Tensor};
/// # fn main() -> kiln_core::Result<()> {
/// # let dev = kiln_backend_cuda::try_gpu(0).unwrap();
/// let l2 = ReductionKernel::new("T x", "T y", "x * x", "a + b", "y = sqrt(a)", "0", "l2norm")?;
/// let x = Generator::new(1).uniform::<Cuda>([8, 100], -1.0, 1.0, &dev)?;
/// let rows = l2.call(&[(&x).into()], Some(&[1]), false)?; // [8]
/// let all = l2.call(&[(&x).into()], None, false)?; // [] (every axis)
/// # Ok(()) }
/// ```
///
/// Parameters follow [`crate::ElementwiseKernel`]'s rules (names `a` and `b` are taken). The
/// map expression is evaluated per element of the broadcast tensor inputs, converted to the
/// accumulator type (by default the first output's type; see
/// [`ReductionKernel::with_reduce_type`]), and combined with the reduce expression over `a`
/// and `b`, starting from the identity; the post-map statement then sees the result as `a`
/// and writes the outputs, which have the shape of the kept axes.
///
/// Each kept element is reduced by one block of up to 256 threads (a shared-memory tree after
/// each thread's own fold). With few kept elements and long reductions (a full reduction of a
/// large tensor) each kept element's range is split over many blocks and their accumulators
/// combined, in a fixed order, by a second launch of the same kernel; before, one block alone
/// read a whole tensor at one multiprocessor's bandwidth.
#[derive(Clone, Debug)]
pub struct ReductionKernel {
    name: String,
    params: Vec<Param>,
    n_in: usize,
    map: String,
    reduce: String,
    post_map: String,
    identity: String,
    reduce_type: Option<ParamType>,
    preamble: String,
    id: u128,
}

impl ReductionKernel {
    /// A reduction named `name` (a C identifier) with parameter lists `in_params` and
    /// `out_params` (at least one output), the map expression, the reduce expression (over
    /// `a` and `b`), the post-map statement (`a` is the reduced value), and the identity (a C
    /// expression). Nothing is compiled until the first call.
    pub fn new(
        in_params: &str,
        out_params: &str,
        map_expr: &str,
        reduce_expr: &str,
        post_map_expr: &str,
        identity: &str,
        name: &str,
    ) -> Result<Self> {
        let ins = parse_params(OP, in_params)?;
        let outs = parse_params(OP, out_params)?;
        if outs.is_empty() {
            return Err(Error::invalid(OP, format!("kernel `{name}` has no output")));
        }
        check_name(name)?;
        for p in ins.iter().chain(&outs) {
            if p.name == "a" || p.name == "b" {
                return Err(Error::invalid(
                    OP,
                    format!("kernel `{name}`: `a` and `b` name the reduced values, not parameters"),
                ));
            }
            if outs.iter().filter(|o| o.name == p.name).count()
                + ins.iter().filter(|i| i.name == p.name).count()
                > 1
            {
                return Err(Error::invalid(
                    OP,
                    format!("`{}` is declared twice in `{name}`", p.name),
                ));
            }
        }
        if outs.iter().any(|p| p.raw) {
            return Err(Error::invalid(
                OP,
                format!("kernel `{name}`: outputs of a reduction cannot be raw"),
            ));
        }
        let n_in = ins.len();
        let mut k = ReductionKernel {
            name: name.to_string(),
            params: ins.into_iter().chain(outs).collect(),
            n_in,
            map: map_expr.to_string(),
            reduce: reduce_expr.to_string(),
            post_map: post_map_expr.to_string(),
            identity: identity.to_string(),
            reduce_type: None,
            preamble: String::new(),
            id: 0,
        };
        k.rehash();
        Ok(k)
    }

    /// The accumulator's type: concrete (`float64` to sum f32 values in double) or a
    /// placeholder of the parameter lists.
    pub fn with_reduce_type(mut self, ty: &str) -> Result<Self> {
        self.reduce_type = Some(match CType::parse(ty) {
            Some(c) => ParamType::Concrete(c),
            None if super::params::is_ident(ty) => ParamType::Placeholder(ty.to_string()),
            None => {
                return Err(Error::invalid(
                    OP,
                    format!("reduce type `{ty}` is neither a type nor a placeholder"),
                ));
            }
        });
        self.rehash();
        Ok(self)
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
        let decl = format!("{:?}", (&self.params, self.n_in, &self.reduce_type));
        self.id = crate::nvrtc::fnv128(&[
            b"reduction",
            self.name.as_bytes(),
            decl.as_bytes(),
            self.map.as_bytes(),
            self.reduce.as_bytes(),
            self.post_map.as_bytes(),
            self.identity.as_bytes(),
            self.preamble.as_bytes(),
        ]);
    }

    /// Reduces `inputs` (one per input parameter) over `axes` of their broadcast shape (`None`:
    /// every axis; negative axes count from the end) and returns the outputs, allocated in the
    /// kept shape (with the reduced axes as 1s when `keepdims`).
    pub fn call(
        &self,
        inputs: &[KernelArg],
        axes: Option<&[isize]>,
        keepdims: bool,
    ) -> Result<Vec<Tensor<Cuda>>> {
        self.run(inputs, axes, keepdims, &mut [])
    }

    /// [`ReductionKernel::call`] writing into `outputs` (one per output parameter, each of
    /// the kept shape and owning its storage).
    pub fn call_into(
        &self,
        inputs: &[KernelArg],
        axes: Option<&[isize]>,
        keepdims: bool,
        outputs: &mut [&mut Tensor<Cuda>],
    ) -> Result<()> {
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
        self.run(inputs, axes, keepdims, outputs).map(drop)
    }

    /// A call: types, shapes, operands, the kernel, its arguments, the launch. Each step is a
    /// function below; the order of the checks is the order of the errors a caller sees.
    fn run(
        &self,
        inputs: &[KernelArg],
        axes: Option<&[isize]>,
        keepdims: bool,
        given: &mut [&mut Tensor<Cuda>],
    ) -> Result<Vec<Tensor<Cuda>>> {
        let (ins, outs) = self.params.split_at(self.n_in);
        let (r, acc) = self.resolve_types(inputs, given)?;
        let tensors = inputs.iter().filter_map(|a| match a {
            KernelArg::Tensor(t) => Some(*t),
            _ => None,
        });
        let dev = common_device(OP, tensors.chain(given.iter().map(|t| &**t)))?
            .ok_or_else(|| no_tensor(&self.name))?;
        let shape = self.iteration_shape(inputs)?;
        let axes: Vec<usize> = match axes {
            None => (0..shape.rank()).collect(),
            Some(a) => shape.axes(OP, a)?,
        };
        let g = Geometry::new(&shape, axes, keepdims);
        for t in given.iter() {
            if t.shape() != &g.out_shape {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: g.out_shape.clone(),
                    rhs: t.shape().clone(),
                });
            }
        }
        let out_types = outs
            .iter()
            .map(|p| {
                concrete(&p.ty, &r)
                    .dtype()
                    .ok_or_else(|| int_output(&self.name, &p.name))
            })
            .collect::<Result<Vec<_>>>()?;
        let ops = self.operands(inputs, given, &shape, &g, keepdims)?;
        let mut types: Vec<CType> = r.iter().map(|(_, c)| *c).collect();
        types.push(acc);
        let held = held_buffers(inputs)?;
        // Few kept elements and long reductions: split over many blocks, as expression
        // programs are (`codegen::split_parts`).
        let parts = crate::codegen::split_parts(g.n_kept, g.n_red);
        let split = if parts == 1 {
            0
        } else {
            self.split_lanes(inputs, &ops, &held, &r, g.n_kept)
        };
        let key = UserKey {
            id: self.id,
            types,
            slots: ops.slots.clone(),
            wide: ops.wide,
            split,
        };
        let s = state(&dev)?;
        let spec = Spec {
            name: &self.name,
            inputs: ins,
            outputs: outs,
            preamble: &self.preamble,
        };
        let red = Reduction {
            map: &self.map,
            reduce: &self.reduce,
            post_map: &self.post_map,
            identity: &self.identity,
            acc,
        };
        let f = kernel(s, OP, &self.name, &key, || {
            source::reduction(&spec, &red, &r, &ops.slots, ops.wide, split)
        })?;
        let mut taken = Vec::with_capacity(given.len());
        for (t, p) in given.iter_mut().zip(outs) {
            taken.push(Taken::new(OP, &p.name, t)?);
        }
        let mut fresh = Vec::new();
        let mut out_ptrs = Vec::with_capacity(outs.len());
        for (j, t) in out_types.iter().enumerate() {
            match taken.get_mut(j) {
                Some(tk) => out_ptrs.push(tk.write_ptr()?),
                None => {
                    let b = alloc(s, g.n_kept * t.size_in_bytes())?;
                    out_ptrs.push(b.device_ptr());
                    fresh.push(b);
                }
            }
        }
        let args = self.args(inputs, &held, &ops, &r, &out_ptrs, &g);
        launch(s, f, args, &g, parts, acc)?;
        drop(held);
        drop(taken);
        Ok(fresh
            .into_iter()
            .zip(out_types.iter().skip(given.len()))
            .map(|(b, &dt)| Tensor::from_storage(CudaStorage::ready(b), g.out_shape.clone(), dt))
            .collect())
    }

    /// Binds the arguments (and the given outputs' dtypes) to the parameters and resolves the
    /// type placeholders, the accumulator's included.
    fn resolve_types(
        &self,
        inputs: &[KernelArg],
        given: &[&mut Tensor<Cuda>],
    ) -> Result<(Resolved, CType)> {
        let (ins, outs) = self.params.split_at(self.n_in);
        if inputs.len() != ins.len() {
            return Err(arity(&self.name, ins, inputs.len()));
        }
        let mut bound = Vec::with_capacity(self.params.len());
        for (p, a) in ins.iter().zip(inputs) {
            bound.push(bind(&self.name, p, a)?);
        }
        for g in given.iter() {
            bound.push(Bound::Tensor(g.dtype()));
        }
        bound.resize(self.params.len(), Bound::Output);
        let acc_ty = self
            .reduce_type
            .clone()
            .unwrap_or_else(|| outs[0].ty.clone());
        let r = resolve(OP, &self.name, &self.params, &bound, Some(&acc_ty))?;
        let acc = concrete(&acc_ty, &r);
        Ok((r, acc))
    }

    /// The broadcast shape of the non-raw tensor inputs (raw ones must be contiguous).
    fn iteration_shape(&self, inputs: &[KernelArg]) -> Result<Shape> {
        let mut shape: Option<Shape> = None;
        for (p, a) in self.params[..self.n_in].iter().zip(inputs) {
            match a {
                KernelArg::Tensor(t) if p.raw && !t.is_contiguous() => {
                    return Err(not_contiguous(&self.name, &p.name));
                }
                KernelArg::Tensor(t) if !p.raw => {
                    shape = Some(match shape {
                        None => t.shape().clone(),
                        Some(have) => have.broadcast_with(OP, t.shape())?,
                    });
                }
                _ => {}
            }
        }
        shape.ok_or_else(|| no_tensor(&self.name))
    }

    /// Per operand its slot, and per tensor operand its strides along the kept axes and
    /// (inputs) along the reduced ones, merged; whether indices need 64 bits.
    fn operands(
        &self,
        inputs: &[KernelArg],
        given: &[&mut Tensor<Cuda>],
        shape: &Shape,
        g: &Geometry,
        keepdims: bool,
    ) -> Result<Operands> {
        let (ins, outs) = self.params.split_at(self.n_in);
        let mut slots: Vec<Slot> = Vec::with_capacity(self.params.len());
        let mut kstr: Vec<Vec<usize>> = Vec::new();
        let mut rstr: Vec<Vec<usize>> = Vec::new();
        let mut extents: Vec<usize> = Vec::new();
        for (p, a) in ins.iter().zip(inputs) {
            match a {
                KernelArg::Tensor(_) if p.raw => slots.push(Slot::Raw),
                KernelArg::Tensor(t) => {
                    let l = t.layout().broadcast_to(shape)?;
                    let rs = pick(l.strides(), &g.axes);
                    slots.push(Slot::Tensor(access(&g.rdims, &rs)));
                    kstr.push(pick(l.strides(), &g.kept_axes));
                    rstr.push(rs);
                    extents.push(l.storage_extent());
                }
                _ => slots.push(Slot::Scalar),
            }
        }
        let contiguous = Layout::contiguous(g.out_shape.clone());
        for j in 0..outs.len() {
            let l = given.get(j).map_or(&contiguous, |t| t.layout());
            let ks = if keepdims {
                pick(l.strides(), &g.kept_axes)
            } else {
                l.strides().to_vec()
            };
            kstr.push(ks);
            extents.push(l.storage_extent());
            slots.push(Slot::Tensor(Access::Contig));
        }
        let wide = g.n_kept.saturating_mul(g.n_red.max(1)) >= (1 << 31)
            || extents.iter().any(|&e| e >= (1 << 31));
        let krefs: Vec<&[usize]> = kstr.iter().map(|v| v.as_slice()).collect();
        let (kd, ks) = merged(OP, &g.kdims, &krefs)?;
        let strided_red: Vec<&[usize]> = rstr
            .iter()
            .zip(slots.iter().filter(|s| matches!(s, Slot::Tensor(_))))
            .filter(|(_, s)| **s == Slot::Tensor(Access::Strided))
            .map(|(v, _)| v.as_slice())
            .collect();
        let (rd, rs) = merged(OP, &g.rdims, &strided_red)?;
        Ok(Operands {
            slots,
            kstr,
            wide,
            kd,
            ks,
            rd,
            rs,
        })
    }

    /// The lanes of a split reduction's loads: 4 (groups of 4 f32 as one 16-byte load) when
    /// every contiguous input is f32 with 16-byte aligned rows, else 1.
    fn split_lanes(
        &self,
        inputs: &[KernelArg],
        ops: &Operands,
        held: &[Option<Arc<Buffer>>],
        r: &Resolved,
        n_kept: usize,
    ) -> u32 {
        let mut tensor = 0; // index among the tensor operands (`kstr`)
        let mut vec = true;
        for (k, p) in self.params[..self.n_in].iter().enumerate() {
            let (KernelArg::Tensor(t), Slot::Tensor(a)) = (&inputs[k], ops.slots[k]) else {
                continue;
            };
            if a == Access::Contig {
                let b = held[k].as_ref().expect("a tensor's buffer");
                let at = b.device_ptr() + (t.layout().offset() * 4) as u64;
                vec &= concrete(&p.ty, r) == CType::F32
                    && at.is_multiple_of(16)
                    && (n_kept == 1 || ops.kstr[tensor].iter().all(|s| s % 4 == 0));
            }
            tensor += 1;
        }
        if vec { 4 } else { 1 }
    }

    /// The kernel's arguments: sizes and merged dims, then per parameter its pointer (and
    /// strides) or scalar value.
    fn args(
        &self,
        inputs: &[KernelArg],
        held: &[Option<Arc<Buffer>>],
        ops: &Operands,
        r: &Resolved,
        out_ptrs: &[u64],
        g: &Geometry,
    ) -> Args {
        let mut args = Args::new();
        args.push(g.n_kept as u64)
            .push(g.n_red as u64)
            .push(ops.kd)
            .push(ops.rd);
        let mut ks_it = ops.ks.iter();
        let mut rs_it = ops.rs.iter();
        for (k, p) in self.params.iter().enumerate() {
            let slot = ops.slots[k];
            let ptr = if k < self.n_in {
                match (&inputs[k], &held[k]) {
                    (KernelArg::Tensor(t), Some(b)) => Some(
                        b.device_ptr() + (t.layout().offset() * t.dtype().size_in_bytes()) as u64,
                    ),
                    (a, _) => {
                        push_scalar(&mut args, a, concrete(&p.ty, r));
                        None
                    }
                }
            } else {
                Some(out_ptrs[k - self.n_in])
            };
            let Some(ptr) = ptr else { continue };
            args.push(ptr);
            if let Slot::Tensor(a) = slot {
                args.push(*ks_it.next().expect("one per tensor operand"));
                if k < self.n_in && a == Access::Strided {
                    args.push(*rs_it.next().expect("one per strided input"));
                }
            }
        }
        args
    }
}

/// The axes of a call and the sizes they give.
struct Geometry {
    axes: Vec<usize>,
    kept_axes: Vec<usize>,
    kdims: Vec<usize>,
    rdims: Vec<usize>,
    n_kept: usize,
    n_red: usize,
    /// The outputs' shape: the kept dims (with 1s for the reduced axes when `keepdims`).
    out_shape: Shape,
}

impl Geometry {
    fn new(shape: &Shape, axes: Vec<usize>, keepdims: bool) -> Self {
        let dims = shape.dims();
        let kept_axes: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
        let out_shape = Shape::new(if keepdims {
            (0..dims.len())
                .map(|a| if axes.contains(&a) { 1 } else { dims[a] })
                .collect::<Vec<_>>()
        } else {
            kept_axes.iter().map(|&a| dims[a]).collect()
        });
        let kdims = pick(dims, &kept_axes);
        let rdims = pick(dims, &axes);
        Geometry {
            n_kept: kdims.iter().product(),
            n_red: rdims.iter().product(),
            axes,
            kept_axes,
            kdims,
            rdims,
            out_shape,
        }
    }
}

/// The operands of a call (see [`ReductionKernel::operands`]).
struct Operands {
    slots: Vec<Slot>,
    /// Per tensor operand, its strides along the kept axes (before merging).
    kstr: Vec<Vec<usize>>,
    wide: bool,
    kd: Dims,
    ks: Vec<Strides>,
    rd: Dims,
    rs: Vec<Strides>,
}

/// The entries of `v` at `which`.
fn pick(v: &[usize], which: &[usize]) -> Vec<usize> {
    which.iter().map(|&a| v[a]).collect()
}

/// Launches the kernel: once, a block per kept element; or, split, phase 0 folding each part
/// into partial accumulators and phase 1 folding those and post-mapping.
fn launch(
    s: &'static DeviceState,
    f: Func,
    mut args: Args,
    g: &Geometry,
    parts: usize,
    acc: CType,
) -> Result<()> {
    let (n_kept, n_red) = (g.n_kept, g.n_red);
    if n_kept > 0 && parts > 1 {
        let slots = n_kept * parts;
        let size = match acc {
            CType::I32 => 4,
            c => c.dtype().map_or(8, |d| d.size_in_bytes()),
        };
        let partials = alloc(s, slots * size)?;
        for (phase, blocks) in [(0u32, slots), (1, n_kept)] {
            let mut a = args.clone();
            a.push(parts as u64).push(phase).push(partials.device_ptr());
            let grid = (blocks.min(s.sm_count() as usize * 16) as u32, 1);
            s.launch(OP, f, grid, BLOCK, 0, a.ptrs())?;
        }
    } else if n_kept > 0 {
        let block = if n_red >= BLOCK as usize {
            BLOCK
        } else {
            (n_red.next_power_of_two() as u32).clamp(32, BLOCK)
        };
        let blocks = n_kept.min(s.sm_count() as usize * 16).max(1);
        s.launch(OP, f, (blocks as u32, 1), block, 0, args.ptrs())?;
    }
    Ok(())
}
