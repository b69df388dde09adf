//! The inputs of the cases: layouts ([`Lay`]), value domains ([`Vals`]) and shapes.

use super::*;

/// How an input tensor is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lay {
    Contiguous,
    /// A transposed view of a tensor whose last two axes are swapped (column-major matrices).
    Transposed,
    /// A view narrowed on the last axis out of a wider tensor (strided, with an offset).
    Narrowed,
}

/// The values an input holds.
#[derive(Clone, Copy, Debug)]
pub(super) enum Vals {
    Normal,
    /// Uniform in [0.5, 2): for log, sqrt, recip, pow bases.
    Positive,
    /// |x| in [0.5, 1.5) with a random sign: away from the kinks of abs, relu, sign, and from
    /// the pole of 1/x (whose third derivative would swamp a central difference near 0).
    AwayFromZero,
    /// k + [0.1, 0.9): away from the jumps of floor and ceil.
    AwayFromInt,
    /// Standard normal values moved at least 0.05 away from each of these points (kinks).
    AwayFrom(&'static [f64]),
    /// Odd (or even) multiples of 0.05: two grids never tie (maximum/minimum, clamp).
    Grid {
        odd: bool,
    },
    /// Distinct values 0.05 apart (max/min reductions).
    Distinct,
}

/// One input: its logical dims, layout and value seed.
#[derive(Clone, Debug)]
pub struct In {
    pub dims: Vec<usize>,
    pub lay: Lay,
    pub seed: u64,
}

pub(super) fn lay() -> impl Strategy<Value = Lay> {
    prop_oneof![
        Just(Lay::Contiguous),
        Just(Lay::Transposed),
        Just(Lay::Narrowed)
    ]
}

pub(super) fn input_of(dims: impl Strategy<Value = Vec<usize>>) -> impl Strategy<Value = In> {
    (dims, lay(), any::<u64>()).prop_map(|(dims, lay, seed)| In { dims, lay, seed })
}

pub(super) fn dims(min_rank: usize, max_rank: usize) -> impl Strategy<Value = Vec<usize>> {
    vec(1usize..=4, min_rank..=max_rank)
}

pub(super) fn host_values(v: Vals, n: usize, seed: u64) -> Vec<f64> {
    let u = |i: usize, lo: f64, hi: f64| philox::uniform_f64(seed, i as u64, lo, hi);
    match v {
        Vals::Normal => (0..n)
            .map(|i| philox::normal_f64(seed, i as u64, 0.0, 1.0))
            .collect(),
        Vals::Positive => (0..n).map(|i| u(i, 0.5, 2.0)).collect(),
        Vals::AwayFromZero => (0..n)
            .map(|i| {
                let x = u(i, -1.0, 1.0);
                x.signum() * (0.5 + x.abs())
            })
            .collect(),
        Vals::AwayFrom(kinks) => (0..n)
            .map(|i| {
                let x = philox::normal_f64(seed, i as u64, 0.0, 1.0);
                match kinks.iter().find(|&&k| (x - k).abs() < 0.05) {
                    Some(&k) => k + if x < k { -0.05 } else { 0.05 } + (x - k),
                    None => x,
                }
            })
            .collect(),
        Vals::AwayFromInt => (0..n)
            .map(|i| u(i, -3.0, 3.0).floor() + 0.1 + 0.8 * u(i + n, 0.0, 1.0))
            .collect(),
        Vals::Grid { odd } => (0..n)
            .map(|i| {
                let k = u(i, -20.0, 20.0).floor();
                (2.0 * k + if odd { 1.0 } else { 0.0 }) * 0.05
            })
            .collect(),
        Vals::Distinct => {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| u(a, 0.0, 1.0).total_cmp(&u(b, 0.0, 1.0)));
            let mut out = vec![0.0; n];
            for (rank, &i) in order.iter().enumerate() {
                out[i] = (rank as f64 - n as f64 / 2.0) * 0.05 + 0.01;
            }
            out
        }
    }
}

impl In {
    /// The f64 tensor on `dev`, laid out as asked.
    pub(super) fn build<B: Backend>(&self, v: Vals, dev: &B::Device) -> Result<Tensor<B>> {
        let r = self.dims.len();
        let lay = match self.lay {
            _ if r == 0 => Lay::Contiguous,
            Lay::Transposed if r < 2 => Lay::Narrowed,
            l => l,
        };
        let mut sdims = self.dims.clone();
        match lay {
            Lay::Transposed => sdims.swap(r - 2, r - 1),
            Lay::Narrowed => sdims[r - 1] += 3,
            Lay::Contiguous => {}
        }
        let n: usize = sdims.iter().product();
        let t = Tensor::<B>::from_vec(host_values(v, n, self.seed), sdims, dev)?;
        match lay {
            Lay::Transposed => t.transpose(-2, -1),
            Lay::Narrowed => t.narrow(-1, 1, self.dims[r - 1]),
            Lay::Contiguous => Ok(t),
        }
    }
}

/// `len` random indices in `0..n` as an `i64` tensor of `dims`.
pub(super) fn ids<B: Backend>(
    dims: &[usize],
    n: usize,
    seed: u64,
    dev: &B::Device,
) -> Result<Tensor<B>> {
    let len: usize = dims.iter().product();
    let v: Vec<i64> = (0..len)
        .map(|i| {
            let x = philox::uniform_f64(seed ^ 0x9e37_79b9, i as u64, 0.0, n as f64);
            (x as i64).min(n as i64 - 1)
        })
        .collect();
    Tensor::from_vec(v, dims.to_vec(), dev)
}

/// Broadcast-compatible pair of shapes: one full shape, the other with some axes set to 1 and
/// some leading axes dropped (either side).
pub(super) fn bcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (dims(0, 3), vec(any::<bool>(), 3), 0usize..=3, any::<bool>()).prop_map(
        |(full, ones, drop, swap)| {
            let mut small: Vec<usize> = full
                .iter()
                .zip(&ones)
                .map(|(&d, &o)| if o { 1 } else { d })
                .collect();
            let drop = drop.min(small.len());
            small.drain(..drop);
            if swap { (small, full) } else { (full, small) }
        },
    )
}

/// A non-empty subset of the axes of a rank-`r` tensor.
pub(super) fn axes_of(r: usize, mask: &[bool]) -> Vec<isize> {
    let a: Vec<isize> = (0..r).filter(|&i| mask[i]).map(|i| i as isize).collect();
    if a.is_empty() {
        (0..r as isize).collect()
    } else {
        a
    }
}
