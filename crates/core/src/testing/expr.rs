//! Random expression programs for the backends' evaluator tests: expression trees over several
//! inputs, and inputs that are broadcast, transposed or sliced views. Each backend's
//! `tests/expr.rs` runs its fused evaluator against the op-by-op one on these; one generator
//! keeps the two backends' tests testing the same programs.

use proptest::prelude::*;

use crate::expr::Expr;
use crate::{Backend, BinaryOp, CmpOp, DType, Tensor, UnaryOp};

/// A random expression over numbered inputs, built into an [`Expr`] by [`Tree::build`].
#[derive(Clone, Debug)]
pub enum Tree {
    In(usize),
    Const(f64),
    /// The program's parameter 0.
    Param,
    Un(UnaryOp, Box<Tree>),
    Bin(BinaryOp, Box<Tree>, Box<Tree>),
    /// `where(cmp(a, b), c, d)`
    Sel(CmpOp, Box<Tree>, Box<Tree>, Box<Tree>, Box<Tree>),
    /// The subtree computed in the other float dtype, then cast back.
    Cast(Box<Tree>),
}

impl Tree {
    /// Whether some subtree is computed in the other dtype (in an f64 program, that part has
    /// f32's precision: tolerances must say so).
    pub fn has_cast(&self) -> bool {
        match self {
            Tree::In(_) | Tree::Const(_) | Tree::Param => false,
            Tree::Cast(_) => true,
            Tree::Un(_, a) => a.has_cast(),
            Tree::Bin(_, a, b) => a.has_cast() || b.has_cast(),
            Tree::Sel(_, a, b, c, d) => [a, b, c, d].iter().any(|t| t.has_cast()),
        }
    }

    /// The expression of a program whose inputs are `dtype`; `other` is the dtype that a
    /// [`Tree::Cast`] subtree is computed in. An input inside a cast is cast to `other` first,
    /// so no operation mixes dtypes (the IR rejects that); a parameter (which has one dtype)
    /// becomes the constant 0.3 there.
    pub fn build(&self, dtype: DType, other: DType) -> Expr {
        self.build_in(dtype, other, dtype)
    }

    /// [`Tree::build`] for a subtree computed in `at`.
    fn build_in(&self, at: DType, other: DType, input: DType) -> Expr {
        let b = |t: &Tree| t.build_in(at, other, input);
        match self {
            Tree::In(k) if at != input => Expr::input(*k).to_dtype(at),
            Tree::In(k) => Expr::input(*k),
            Tree::Const(c) => Expr::constant(*c),
            Tree::Param if at == input => Expr::param(0),
            Tree::Param => Expr::constant(0.3),
            Tree::Un(op, a) => b(a).unary(*op),
            Tree::Bin(op, x, y) => b(x).binary(*op, b(y)),
            Tree::Sel(op, x, y, c, d) => b(x).compare(*op, b(y)).where_cond(b(c), b(d)),
            Tree::Cast(a) => a.build_in(other, other, input).to_dtype(at),
        }
    }
}

/// Trees over `n_inputs` inputs, up to depth 4 and about 24 nodes, whose unary nodes draw from
/// `unary` (every [`UnaryOp::ALL`], or a subset where a backend's fused and op-by-op paths may
/// round differently), binary and comparison nodes from every op.
pub fn tree(n_inputs: usize, unary: &[UnaryOp]) -> BoxedStrategy<Tree> {
    let unary = unary.to_vec();
    let leaf = prop_oneof![
        4 => (0..n_inputs).prop_map(Tree::In),
        1 => (-2.0f64..2.0).prop_map(Tree::Const),
        1 => Just(Tree::Param),
    ];
    leaf.prop_recursive(4, 24, 3, move |inner| {
        prop_oneof![
            3 => (prop::sample::select(unary.clone()), inner.clone())
                .prop_map(|(op, a)| Tree::Un(op, Box::new(a))),
            4 => (prop::sample::select(BinaryOp::ALL.to_vec()), inner.clone(), inner.clone())
                .prop_map(|(op, a, b)| Tree::Bin(op, Box::new(a), Box::new(b))),
            1 => (prop::sample::select(CmpOp::ALL.to_vec()), inner.clone(), inner.clone(),
                  inner.clone(), inner.clone())
                .prop_map(|(op, a, b, c, d)| Tree::Sel(op, Box::new(a), Box::new(b),
                    Box::new(c), Box::new(d))),
            1 => inner.prop_map(|a| Tree::Cast(Box::new(a))),
        ]
    })
    .boxed()
}

/// How an input is laid out.
#[derive(Clone, Copy, Debug)]
pub enum View {
    Contiguous,
    /// Axes reversed (a transposed view of a contiguous tensor).
    Transposed,
    /// A narrowed window of a wider tensor.
    Sliced,
}

/// One input of a program: how it broadcasts against the iteration shape, and its view.
#[derive(Clone, Debug)]
pub struct Input {
    /// Which axes of the iteration shape this input broadcasts along (size 1 there).
    pub ones: Vec<bool>,
    /// Leading axes dropped (broadcast by rank).
    pub drop: usize,
    pub view: View,
    /// The seed of its random values.
    pub seed: u64,
}

/// Inputs for iteration shapes of rank up to `rank` (fit one to its shape with [`Input::fit`]).
pub fn input(rank: usize) -> BoxedStrategy<Input> {
    (
        prop::collection::vec(prop::bool::weighted(0.25), rank),
        0..=rank.min(1),
        prop_oneof![
            Just(View::Contiguous),
            Just(View::Transposed),
            Just(View::Sliced)
        ],
        any::<u64>(),
    )
        .prop_map(|(ones, drop, view, seed)| Input {
            ones,
            drop,
            view,
            seed,
        })
        .boxed()
}

/// The iteration shape: mostly small, sometimes long rows (past a block of 2048), one long
/// axis, or many rows (past a parallel chunk).
pub fn shape() -> BoxedStrategy<Vec<usize>> {
    prop_oneof![
        6 => prop::collection::vec(0usize..6, 0..=3),
        1 => prop::collection::vec(1usize..6, 1..=2).prop_map(|mut v| { v.push(3000); v }),
        1 => (40_000usize..70_000).prop_map(|n| vec![n]),
        1 => (2usize..5, 9000usize..20_000).prop_map(|(a, b)| vec![b, a]),
    ]
    .boxed()
}

impl Input {
    /// This input for an iteration shape of rank `rank`.
    pub fn fit(&self, rank: usize) -> Input {
        let mut i = self.clone();
        i.ones.resize(rank, false);
        i.drop = i.drop.min(rank);
        i
    }

    /// The input's tensor for iteration shape `shape`: `rand(dims)` makes a contiguous tensor
    /// of random values (from [`Input::seed`]) of the dims it is given, which is then viewed.
    pub fn make<B: Backend>(
        &self,
        shape: &[usize],
        rand: impl Fn(Vec<usize>) -> Tensor<B>,
    ) -> Tensor<B> {
        let dims: Vec<usize> = shape
            .iter()
            .zip(&self.ones)
            .skip(self.drop)
            .map(|(&d, &one)| if one { 1 } else { d })
            .collect();
        match self.view {
            View::Contiguous => rand(dims),
            View::Transposed => {
                let rev: Vec<usize> = dims.iter().rev().copied().collect();
                let perm: Vec<usize> = (0..dims.len()).rev().collect();
                rand(rev)
                    .permute(&perm)
                    .expect("a permutation of its own axes")
            }
            View::Sliced => {
                if dims.is_empty() {
                    return rand(dims);
                }
                let mut wide = dims.clone();
                let last = wide.len() - 1;
                wide[last] += 3;
                rand(wide)
                    .narrow(last as isize, 1, dims[last])
                    .expect("a window inside the tensor")
            }
        }
    }
}
