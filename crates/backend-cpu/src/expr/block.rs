//! One block of a program: typed registers of at most [`BLOCK`] elements and the slice kernels
//! that compute one instruction into one register.
//!
//! A value of a block is in a register, in an input's storage (a contiguous run read in place,
//! no copy), or uniform (a constant, a parameter, an input broadcast along the block, or an op of
//! uniform values, computed once). Kernels are plain loops over slices (or a slice and a
//! scalar), which LLVM vectorizes; their per-element functions are those of
//! `elementwise.rs`, so a fused result equals the op-by-op one.

use kiln_core::expr::{Instr, Program};
use kiln_core::{
    BinaryFn, BinaryOp, BinaryVisitor, CmpFn, CmpOp, CmpVisitor, DType, Real, UnaryFn, UnaryOp,
    UnaryVisitor,
};

use crate::convert::Conv;
use crate::fastmath;
use crate::storage::{CpuData, CpuElem};
use kiln_core::{bf16, f16};

/// `op` on floats of type `$t`, by the op table's definition (`BinaryOp::visit`), each
/// result then passed through `$post` (a scalar tail, or the identity) in the same loop.
macro_rules! float_binary {
    ($t:ty, $op:expr, $a:expr, $b:expr, $o:expr, $post:expr) => {{
        let (a, b, o): (Src<'_, $t>, Src<'_, $t>, &mut [$t]) = ($a, $b, $o);
        $op.visit(Map2 {
            a,
            b,
            o,
            post: $post,
        })
    }};
}

/// Elements per block: every register of a block stays in L1/L2 (numexpr's choice).
pub(super) const BLOCK: usize = 4096;

/// A typed scalar.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Sv {
    F32(f32),
    F64(f64),
    I64(i64),
    U8(u8),
    F16(f16),
    BF16(bf16),
}

impl Sv {
    /// `v` converted to `dtype` with `as` (rounded to nearest even for the 16-bit floats).
    pub(super) fn new(v: f64, dtype: DType) -> Sv {
        match dtype {
            DType::F32 => Sv::F32(v as f32),
            DType::I64 => Sv::I64(v as i64),
            DType::U8 => Sv::U8(v as u8),
            DType::F16 => Sv::F16(kiln_core::halfround::f16_from_f64(v)),
            DType::BF16 => Sv::BF16(kiln_core::halfround::bf16_from_f64(v)),
            _ => Sv::F64(v),
        }
    }
}

/// A scalar tail: up to two ops with a uniform operand (`x + c`, `x - c`, `c - x`, `x * c`,
/// `c * x`) applied to each result of an instruction inside that instruction's loop, instead
/// of as two more passes over the block (see `Step` in the parent module). Each op is written
/// `x * m + a`, two separately rounded operations (Rust never contracts them into a fused
/// multiply-add), which give the op's own result bit for bit: `x + c` is `x * 1 + c`, `x - c`
/// is `x * 1 + (-c)` (IEEE subtraction is the addition of the negation), `c - x` is
/// `x * -1 + c`, and `x * c` is `x * c + (-0)` (adding -0 changes no value, not even the sign
/// of a zero, where adding +0 would turn -0 into +0). A missing second op is `x * 1 + (-0)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Aff<T> {
    m: [T; 2],
    a: [T; 2],
}

macro_rules! aff {
    ($t:ty) => {
        impl Aff<$t> {
            /// The tail of `ops` (at most two): (op, uniform value, uniform on the left).
            pub(super) fn new(ops: impl IntoIterator<Item = (BinaryOp, $t, bool)>) -> Self {
                let mut t = Aff {
                    m: [1.0; 2],
                    a: [-0.0; 2],
                };
                for (k, (op, c, lhs)) in ops.into_iter().enumerate() {
                    (t.m[k], t.a[k]) = match (op, lhs) {
                        (BinaryOp::Add, _) => (1.0, c),
                        (BinaryOp::Sub, false) => (1.0, -c),
                        (BinaryOp::Sub, true) => (-1.0, c),
                        (BinaryOp::Mul, _) => (c, -0.0),
                        _ => unreachable!("no tail for {op:?} (planned)"),
                    };
                }
                t
            }

            #[inline(always)]
            pub(super) fn apply(&self, x: $t) -> $t {
                let x = x * self.m[0] + self.a[0];
                x * self.m[1] + self.a[1]
            }
        }
    };
}
aff!(f32);
aff!(f64);

/// The scalar tail of an instruction's kernel, if any.
#[derive(Clone, Copy, Debug)]
pub(super) enum Post {
    None,
    F32(Aff<f32>),
    F64(Aff<f64>),
}

/// A typed register. A 16-bit register holds an input's gathered elements or a cast's
/// rounded results: programs run widened (`Program::widened`), so no other instruction has a
/// 16-bit dtype.
pub(super) enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// Runs `$body` with `$v` bound to the vector inside a [`Buf`], whatever its dtype.
macro_rules! each_buf {
    ($b:expr, $v:ident => $body:expr) => {
        match $b {
            Buf::F32($v) => $body,
            Buf::F64($v) => $body,
            Buf::I64($v) => $body,
            Buf::U8($v) => $body,
            Buf::F16($v) => $body,
            Buf::BF16($v) => $body,
        }
    };
}

impl Buf {
    pub(super) fn new(dtype: DType, len: usize) -> Buf {
        match dtype {
            DType::F32 => Buf::F32(vec![0.0; len]),
            DType::I64 => Buf::I64(vec![0; len]),
            DType::U8 => Buf::U8(vec![0; len]),
            DType::F16 => Buf::F16(vec![f16::ZERO; len]),
            DType::BF16 => Buf::BF16(vec![bf16::ZERO; len]),
            _ => Buf::F64(vec![0.0; len]),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::F64(_) => DType::F64,
            Buf::I64(_) => DType::I64,
            Buf::U8(_) => DType::U8,
            Buf::F16(_) => DType::F16,
            Buf::BF16(_) => DType::BF16,
        }
    }

    fn len(&self) -> usize {
        each_buf!(self, v => v.len())
    }

    /// Element 0 as a scalar.
    fn first(&self) -> Sv {
        each_buf!(self, v => v[0].to_sv())
    }
}

/// Most block registers a thread keeps for its next frames.
const SPARE_REGS: usize = 32;

thread_local! {
    /// Block registers of this thread's finished frames, for the next ones. Why: a frame
    /// needs one 16–32 KiB register per instruction, and allocating (and zeroing) them per
    /// call cost a 9-instruction program 12–14 µs a call, most of it page faults of heap that
    /// the allocator had given back in between. Their contents are never read before an
    /// instruction writes them, so reused registers need no clearing.
    static SPARE: std::cell::RefCell<Vec<Buf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A block register of `dtype`, reused from this thread's spares when there is one.
fn take_reg(dtype: DType) -> Buf {
    let spare = SPARE.with(|s| {
        let mut s = s.borrow_mut();
        let i = s.iter().position(|b| b.dtype() == dtype)?;
        Some(s.swap_remove(i))
    });
    spare.unwrap_or_else(|| Buf::new(dtype, BLOCK))
}

/// The element types a program computes with.
pub(super) trait Elt: CpuElem {
    fn reg(b: &Buf) -> &[Self];
    fn reg_mut(b: &mut Buf) -> &mut [Self];
    fn sv(s: Sv) -> Self;
    fn to_sv(self) -> Sv;
}

macro_rules! elt {
    ($t:ty, $v:ident) => {
        impl Elt for $t {
            fn reg(b: &Buf) -> &[Self] {
                match b {
                    Buf::$v(v) => v,
                    _ => unreachable!("register of another dtype (validated program)"),
                }
            }
            fn reg_mut(b: &mut Buf) -> &mut [Self] {
                match b {
                    Buf::$v(v) => v,
                    _ => unreachable!("register of another dtype (validated program)"),
                }
            }
            fn sv(s: Sv) -> Self {
                match s {
                    Sv::$v(x) => x,
                    _ => unreachable!("scalar of another dtype (validated program)"),
                }
            }
            fn to_sv(self) -> Sv {
                Sv::$v(self)
            }
        }
    };
}
elt!(f32, F32);
elt!(f64, F64);
elt!(i64, I64);
elt!(u8, U8);
elt!(f16, F16);
elt!(bf16, BF16);

/// Where a value of the current block is.
#[derive(Clone, Copy, Debug)]
pub(super) enum Loc {
    /// In its register.
    Reg,
    /// The same everywhere in the block.
    Uni(Sv),
    /// Elements `start..start + len` of input `k`'s storage.
    In { k: usize, start: usize },
}

/// An operand of a slice kernel.
#[derive(Clone, Copy)]
pub(super) enum Src<'a, T> {
    S(&'a [T]),
    C(T),
}

impl<T: Copy> Src<'_, T> {
    #[inline(always)]
    fn get(&self, i: usize) -> T {
        match self {
            Src::S(s) => s[i],
            Src::C(c) => *c,
        }
    }
}

/// The registers and value locations of one block.
pub(super) struct Frame<'a> {
    pub(super) regs: Vec<Buf>,
    pub(super) locs: Vec<Loc>,
    pub(super) len: usize,
    /// Where in the block the elements computed next start (see [`Frame::exec`]); 0 but
    /// while the elementwise driver runs the last instruction a piece at a time.
    pub(super) base: usize,
    pub(super) inputs: &'a [&'a CpuData],
    /// Byte ranges (addresses) of the next block's inputs still to prefetch, and how many
    /// cache lines to request after each instruction (see [`Frame::prefetch_some`]).
    pub(super) prefetch: Vec<(usize, usize)>,
    pub(super) prefetch_step: usize,
}

impl Drop for Frame<'_> {
    fn drop(&mut self) {
        // (`try_with`: a frame dropped while the thread's locals are torn down just frees.)
        let _ = SPARE.try_with(|s| {
            let mut s = s.borrow_mut();
            for r in self.regs.drain(..).filter(|r| r.len() == BLOCK) {
                if s.len() == SPARE_REGS {
                    break;
                }
                s.push(r);
            }
        });
    }
}

impl<'a> Frame<'a> {
    pub(super) fn new(program: &Program, inputs: &'a [&'a CpuData]) -> Frame<'a> {
        Frame {
            regs: program.dtypes().iter().map(|&d| take_reg(d)).collect(),
            locs: vec![Loc::Uni(Sv::U8(0)); program.code().len()],
            len: 0,
            base: 0,
            inputs,
            prefetch: Vec::new(),
            prefetch_step: 0,
        }
    }

    /// Requests the next `prefetch_step` cache lines of the next block's inputs.
    ///
    /// Why: a block first waits for its inputs to arrive from memory, then computes from
    /// cache while memory idles; a streaming loop hides this, a block pipeline does not. Asking
    /// for the next block a few lines after each instruction overlaps the two (asking for all
    /// of it at once stalls on the processor's few outstanding-miss slots instead).
    pub(super) fn prefetch_some(&mut self) {
        let mut budget = self.prefetch_step;
        while budget > 0 {
            let Some(last) = self.prefetch.last_mut() else {
                return;
            };
            if last.0 >= last.1 {
                self.prefetch.pop();
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch is a hint: it never faults and changes no value, whatever the
            // address (and these addresses lie inside an input's storage).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    last.0 as *const i8,
                );
            }
            last.0 += 64;
            budget -= 1;
        }
    }

    #[inline(always)]
    pub(super) fn src<T: Elt>(&self, v: u32) -> Src<'_, T> {
        let v = v as usize;
        match self.locs[v] {
            Loc::Reg => Src::S(&T::reg(&self.regs[v])[self.base..self.base + self.len]),
            Loc::Uni(s) => Src::C(T::sv(s)),
            Loc::In { k, start } => Src::S(
                &T::slice(self.inputs[k]).expect("input dtype checked")
                    [start + self.base..start + self.base + self.len],
            ),
        }
    }

    /// Copies value `v` of the block into `out` (`len` elements).
    pub(super) fn read<T: Elt>(&self, v: u32, out: &mut [T]) {
        match self.src::<T>(v) {
            Src::S(s) => out.copy_from_slice(s),
            Src::C(c) => out.fill(c),
        }
    }

    /// As [`Frame::read`], into an output buffer in memory: large aligned copies use
    /// non-temporal stores, which write whole cache lines without first reading them from
    /// memory (a plain store reads every output line before overwriting it: a quarter of a
    /// two-input program's memory traffic) and leave the cache to the inputs.
    ///
    /// Unfenced: the caller calls [`store_fence`] before anyone else may read `out` (once per
    /// task rather than once per block: the fence waits for every streaming store in flight).
    pub(super) fn store_unfenced<T: Elt>(&self, v: u32, out: &mut [T]) {
        match self.src::<T>(v) {
            Src::S(s) => stream_copy(bytemuck::cast_slice(s), bytemuck::cast_slice_mut(out)),
            Src::C(c) => out.fill(c),
        }
    }

    /// Computes instruction `i` (an op, not a leaf) for the current block.
    pub(super) fn exec(&mut self, i: usize, ins: &Instr, dtype: DType) {
        self.exec_post(i, ins, dtype, Post::None)
    }

    /// Computes value `i` as instruction `head` followed by the tail `ops` (op, uniform
    /// operand, uniform on the left), in one loop (see [`Aff`]).
    pub(super) fn exec_tail(
        &mut self,
        i: usize,
        head: &Instr,
        dtype: DType,
        ops: &[(BinaryOp, u32, bool)],
    ) {
        let uni = |v: u32| match self.locs[v as usize] {
            Loc::Uni(s) => s,
            _ => unreachable!("a tail's operand is uniform (planned)"),
        };
        // (An iterator, not a `Vec`: this runs per instruction and block.)
        let post = match dtype {
            DType::F32 => Post::F32(Aff::<f32>::new(
                ops.iter().map(|&(o, v, l)| (o, f32::sv(uni(v)), l)),
            )),
            _ => Post::F64(Aff::<f64>::new(
                ops.iter().map(|&(o, v, l)| (o, f64::sv(uni(v)), l)),
            )),
        };
        self.exec_post(i, head, dtype, post)
    }

    fn exec_post(&mut self, i: usize, ins: &Instr, dtype: DType, post: Post) {
        let uni = |a: u32| matches!(self.locs[a as usize], Loc::Uni(_));
        // (Not `Instr::operands`, which allocates: this runs per instruction and block.)
        let uniform = match *ins {
            Instr::Unary(_, a) | Instr::Cast(_, a) | Instr::Reduce(_, a) => uni(a),
            Instr::Binary(_, a, b) | Instr::Cmp(_, a, b) => uni(a) && uni(b),
            Instr::Where(c, a, b) => uni(c) && uni(a) && uni(b),
            Instr::Input(_) | Instr::Param(_) | Instr::Const(_) => true,
        };
        let (len, base) = (self.len, self.base);
        if uniform {
            (self.len, self.base) = (1, 0);
        }
        let mut out = std::mem::replace(&mut self.regs[i], Buf::U8(Vec::new()));
        self.kernel(ins, dtype, &mut out, post);
        self.regs[i] = out;
        self.prefetch_some();
        (self.len, self.base) = (len, base);
        self.locs[i] = if uniform {
            Loc::Uni(self.regs[i].first())
        } else {
            Loc::Reg
        };
    }

    /// The kernel of one instruction, compiled for the widest vector unit the processor has
    /// (AVX-512 or AVX2 on x86-64, detected at run time, as `fastmath` does): the slice loops
    /// are then 16 or 8 lanes wide instead of SSE's 4. Same operations in the same order, so
    /// the same results on every path.
    fn kernel(&self, ins: &Instr, dtype: DType, out: &mut Buf, post: Post) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
            unsafe fn avx512(f: &Frame<'_>, ins: &Instr, dtype: DType, out: &mut Buf, p: Post) {
                f.kernel_body(ins, dtype, out, p)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(f: &Frame<'_>, ins: &Instr, dtype: DType, out: &mut Buf, p: Post) {
                f.kernel_body(ins, dtype, out, p)
            }
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
                // SAFETY: the processor has every feature `avx512` is compiled for (checked
                // just above); the function itself is safe Rust.
                return unsafe { avx512(self, ins, dtype, out, post) };
            }
            if has!("avx2") && has!("fma") {
                // SAFETY: as above, for AVX2 and FMA.
                return unsafe { avx2(self, ins, dtype, out, post) };
            }
        }
        self.kernel_body(ins, dtype, out, post)
    }

    #[inline(always)]
    fn kernel_body(&self, ins: &Instr, dtype: DType, out: &mut Buf, post: Post) {
        let (lo, n) = (self.base, self.len);
        match *ins {
            Instr::Unary(op, a) => match (out, post) {
                (Buf::F32(o), Post::None) => unary_f32(op, self.src(a), &mut o[lo..lo + n], None),
                (Buf::F32(o), Post::F32(t)) => {
                    unary_f32(op, self.src(a), &mut o[lo..lo + n], Some(t))
                }
                (Buf::F64(o), Post::None) => unary_f64(op, self.src(a), &mut o[lo..lo + n], |x| x),
                (Buf::F64(o), Post::F64(t)) => {
                    unary_f64(op, self.src(a), &mut o[lo..lo + n], |x| t.apply(x))
                }
                (Buf::I64(o), Post::None) => unary_i64(op, self.src(a), &mut o[lo..lo + n]),
                (Buf::U8(_), _) => unreachable!("no unary op on u8 (validated program)"),
                (Buf::F16(_) | Buf::BF16(_), _) => unreachable!("16-bit arithmetic (widened)"),
                _ => unreachable!("a tail on a float op of the same dtype only (planned)"),
            },
            Instr::Binary(op, a, b) if !matches!(post, Post::None) => match (out, post) {
                (Buf::F32(o), Post::F32(t)) => {
                    float_binary!(f32, op, self.src(a), self.src(b), &mut o[lo..lo + n], |x| t
                        .apply(x))
                }
                (Buf::F64(o), Post::F64(t)) => {
                    float_binary!(f64, op, self.src(a), self.src(b), &mut o[lo..lo + n], |x| t
                        .apply(x))
                }
                _ => unreachable!("a tail on a float op of the same dtype only (planned)"),
            },
            Instr::Binary(op, a, b) => match out {
                Buf::F32(o) => {
                    float_binary!(f32, op, self.src(a), self.src(b), &mut o[lo..lo + n], |x| x)
                }
                Buf::F64(o) => {
                    float_binary!(f64, op, self.src(a), self.src(b), &mut o[lo..lo + n], |x| x)
                }
                Buf::I64(o) => op.visit(IntMap2 {
                    a: self.src(a),
                    b: self.src(b),
                    o: &mut o[lo..lo + n],
                }),
                Buf::U8(o) => op.visit(IntMap2 {
                    a: self.src(a),
                    b: self.src(b),
                    o: &mut o[lo..lo + n],
                }),
                Buf::F16(_) | Buf::BF16(_) => unreachable!("16-bit arithmetic (widened)"),
            },
            Instr::Cmp(op, a, b) => {
                let o = &mut u8::reg_mut(out)[lo..lo + n];
                match self.operand_dtype(a) {
                    DType::F32 => cmp(op, self.src::<f32>(a), self.src(b), o),
                    DType::F64 => cmp(op, self.src::<f64>(a), self.src(b), o),
                    DType::I64 => cmp(op, self.src::<i64>(a), self.src(b), o),
                    DType::F16 => cmp(op, self.src::<f16>(a), self.src(b), o),
                    DType::BF16 => cmp(op, self.src::<bf16>(a), self.src(b), o),
                    _ => cmp(op, self.src::<u8>(a), self.src(b), o),
                }
            }
            Instr::Where(c, a, b) => {
                let c = self.src::<u8>(c);
                match out {
                    Buf::F32(o) => select(c, self.src(a), self.src(b), &mut o[lo..lo + n]),
                    Buf::F64(o) => select(c, self.src(a), self.src(b), &mut o[lo..lo + n]),
                    Buf::I64(o) => select(c, self.src(a), self.src(b), &mut o[lo..lo + n]),
                    Buf::U8(o) => select(c, self.src(a), self.src(b), &mut o[lo..lo + n]),
                    Buf::F16(o) => select(c, self.src(a), self.src(b), &mut o[lo..lo + n]),
                    Buf::BF16(o) => select(c, self.src(a), self.src(b), &mut o[lo..lo + n]),
                }
            }
            Instr::Cast(_, a) => {
                // The `cast` op's conversions (`convert.rs`), as the single-op kernel's.
                macro_rules! to {
                    ($x:expr) => {
                        each_buf!(out, o => map1($x, &mut o[lo..lo + n], Conv::conv))
                    };
                }
                match self.operand_dtype(a) {
                    DType::F32 => to!(self.src::<f32>(a)),
                    DType::F64 => to!(self.src::<f64>(a)),
                    DType::I64 => to!(self.src::<i64>(a)),
                    DType::F16 => to!(self.src::<f16>(a)),
                    DType::BF16 => to!(self.src::<bf16>(a)),
                    _ => to!(self.src::<u8>(a)),
                }
            }
            Instr::Input(_) | Instr::Param(_) | Instr::Const(_) | Instr::Reduce(..) => {
                unreachable!("leaves are placed by the driver ({dtype})")
            }
        }
    }

    /// The dtype of value `v`, from its register.
    #[inline(always)]
    fn operand_dtype(&self, v: u32) -> DType {
        self.regs[v as usize].dtype()
    }
}

// ---- slice kernels ---------------------------------------------------------------------------

#[inline(always)]
pub(super) fn map1<A: Copy, U>(a: Src<'_, A>, out: &mut [U], f: impl Fn(A) -> U) {
    match a {
        Src::S(x) => {
            for (o, &x) in out.iter_mut().zip(x) {
                *o = f(x);
            }
        }
        Src::C(c) => {
            for o in out.iter_mut() {
                *o = f(c);
            }
        }
    }
}

#[inline(always)]
pub(super) fn map2<A: Copy, B: Copy, U>(
    a: Src<'_, A>,
    b: Src<'_, B>,
    out: &mut [U],
    f: impl Fn(A, B) -> U,
) {
    match (a, b) {
        (Src::S(x), Src::S(y)) => {
            for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
                *o = f(x, y);
            }
        }
        (Src::S(x), Src::C(c)) => {
            for (o, &x) in out.iter_mut().zip(x) {
                *o = f(x, c);
            }
        }
        (Src::C(c), Src::S(y)) => {
            for (o, &y) in out.iter_mut().zip(y) {
                *o = f(c, y);
            }
        }
        (Src::C(c), Src::C(d)) => {
            for o in out.iter_mut() {
                *o = f(c, d);
            }
        }
    }
}

#[inline(always)]
fn select<T: Copy>(c: Src<'_, u8>, a: Src<'_, T>, b: Src<'_, T>, out: &mut [T]) {
    if let Src::C(c) = c {
        return map1(if c != 0 { a } else { b }, out, |x| x);
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = if c.get(i) != 0 { a.get(i) } else { b.get(i) };
    }
}

/// A comparison over a block, monomorphized per comparison (`CmpOp::visit`).
struct CmpMap<'a, 'b, T> {
    a: Src<'a, T>,
    b: Src<'a, T>,
    o: &'b mut [u8],
}

impl<T: Copy + PartialOrd> CmpVisitor for CmpMap<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn visit<F: CmpFn>(self) {
        map2(self.a, self.b, self.o, |x, y| F::f(x, y) as u8);
    }
}

#[inline(always)]
fn cmp<T: Copy + PartialOrd>(op: CmpOp, a: Src<'_, T>, b: Src<'_, T>, o: &mut [u8]) {
    op.visit(CmpMap { a, b, o })
}

/// A binary op over a block of floats, each result passed through `post`: the op table's
/// definition, monomorphized per op (`BinaryOp::visit`).
struct Map2<'a, 'b, T, P> {
    a: Src<'a, T>,
    b: Src<'a, T>,
    o: &'b mut [T],
    post: P,
}

impl<T: Real, P: Fn(T) -> T> BinaryVisitor for Map2<'_, '_, T, P> {
    type Output = ();
    #[inline(always)]
    fn visit<F: BinaryFn>(self) {
        let post = self.post;
        map2(self.a, self.b, self.o, |x: T, y: T| post(F::f(x, y)));
    }
}

/// A binary op over a block of integers (a validated program uses only the ops the table
/// defines for the dtype).
struct IntMap2<'a, 'b, T> {
    a: Src<'a, T>,
    b: Src<'a, T>,
    o: &'b mut [T],
}

impl BinaryVisitor for IntMap2<'_, '_, i64> {
    type Output = ();
    #[inline(always)]
    fn visit<F: BinaryFn>(self) {
        map2(self.a, self.b, self.o, F::int);
    }
}

impl BinaryVisitor for IntMap2<'_, '_, u8> {
    type Output = ();
    #[inline(always)]
    fn visit<F: BinaryFn>(self) {
        map2(self.a, self.b, self.o, F::byte);
    }
}

/// One unary op over a block, each result passed through `post`: the op table's definition,
/// monomorphized per op (`UnaryOp::visit`).
struct FloatMap<'a, 'b, T, P> {
    a: Src<'a, T>,
    o: &'b mut [T],
    post: P,
}

impl<T: Real, P: Fn(T) -> T> UnaryVisitor for FloatMap<'_, '_, T, P> {
    type Output = ();
    #[inline(always)]
    fn visit<F: UnaryFn>(self) {
        let post = self.post;
        map1(self.a, self.o, |x: T| post(F::f(x)));
    }
}

/// Unary `op` on f32, then the scalar tail `post` if any.
#[inline(always)]
pub(super) fn unary_f32(op: UnaryOp, a: Src<'_, f32>, o: &mut [f32], post: Option<Aff<f32>>) {
    // The vectorized polynomial of `fastmath`, as the single-op kernels use.
    let via = |f: &dyn Fn(&[f32], &mut [f32]), a: Src<'_, f32>, o: &mut [f32]| match a {
        Src::S(x) => f(x, o),
        Src::C(c) => {
            let mut r = [0.0f32];
            f(&[c], &mut r);
            o.fill(r[0]);
        }
    };
    match (op, post) {
        (UnaryOp::Exp, None) => via(&fastmath::exp_f32, a, o),
        (UnaryOp::Exp, Some(t)) => via(&|x, o| fastmath::exp_then_f32(x, o, t.m, t.a), a, o),
        (UnaryOp::Log, None) => via(&fastmath::ln_f32, a, o),
        (UnaryOp::Log, Some(t)) => via(&|x, o| fastmath::ln_then_f32(x, o, t.m, t.a), a, o),
        (UnaryOp::Sigmoid, _) => {
            via(&fastmath::sigmoid_f32, a, o);
            if let Some(t) = post {
                o.iter_mut().for_each(|v| *v = t.apply(*v));
            }
        }
        (_, None) => op.visit(FloatMap { a, o, post: |x| x }),
        (_, Some(t)) => op.visit(FloatMap {
            a,
            o,
            post: move |x| t.apply(x),
        }),
    }
}

/// Binary `op` on f32, then the scalar tail `post` if any.
#[inline(always)]
pub(super) fn binary_f32(
    op: BinaryOp,
    a: Src<'_, f32>,
    b: Src<'_, f32>,
    o: &mut [f32],
    post: Option<Aff<f32>>,
) {
    match post {
        None => float_binary!(f32, op, a, b, o, |x| x),
        Some(t) => float_binary!(f32, op, a, b, o, |x| t.apply(x)),
    }
}

/// Unary `op` on f64, each result passed through `post`.
#[inline(always)]
fn unary_f64(op: UnaryOp, a: Src<'_, f64>, o: &mut [f64], post: impl Fn(f64) -> f64) {
    op.visit(FloatMap { a, o, post })
}

/// Unary `op` on i64 (a validated program uses only the ops the table defines for i64).
struct IntMap<'a, 'b> {
    a: Src<'a, i64>,
    o: &'b mut [i64],
}

impl UnaryVisitor for IntMap<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn visit<F: UnaryFn>(self) {
        map1(self.a, self.o, F::int);
    }
}

#[inline(always)]
fn unary_i64(op: UnaryOp, a: Src<'_, i64>, o: &mut [i64]) {
    op.visit(IntMap { a, o })
}

/// `dst.copy_from_slice(src)`, with non-temporal stores where `dst` is 16-byte aligned and at
/// least 1 KiB (see [`Frame::store_unfenced`]); unfenced (see [`store_fence`]).
pub(super) fn stream_copy(src: &[u8], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= 1024 && (dst.as_ptr() as usize).is_multiple_of(16) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let n = dst.len() / 16 * 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..n).step_by(16) {
            // SAFETY: `i + 16 <= n <= len` for both slices (equal lengths, checked by the
            // tail's `copy_from_slice` below); `d + i` is 16-byte aligned (checked above), as
            // `_mm_stream_si128` requires; the load is unaligned-safe.
            unsafe {
                let x = _mm_loadu_si128(s.add(i) as *const __m128i);
                _mm_stream_si128(d.add(i) as *mut __m128i, x);
            }
        }
        dst[n..].copy_from_slice(&src[n..]);
        return;
    }
    dst.copy_from_slice(src);
}

/// Orders the streaming stores made so far by this thread before any later store, so whoever
/// reads the output after this task sees them (the end of a task is such a later store).
pub(super) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a fence has no memory-safety preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}
