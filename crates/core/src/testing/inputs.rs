//! Input generators: value domains ([`Dom`]) drawn from a seed, shapes (small, large and
//! broadcast-compatible) and strided views (permuted, narrowed, broadcast) of each input.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Dom {
    pub(super) lo: f64,
    pub(super) hi: f64,
    /// Magnitudes below this are pushed out to it (divisors, `recip`).
    pub(super) avoid: f64,
    /// Fraction of integer values (ties for arg reductions and comparisons, exact zeros).
    pub(super) ties: f64,
    /// Fraction of NaN (floats only).
    pub(super) nan: f64,
    /// Mix in NaN, ±inf, -0, subnormals, extremes (data-movement checks).
    pub(super) specials: bool,
}

impl Dom {
    pub(super) const fn range(lo: f64, hi: f64) -> Dom {
        Dom {
            lo,
            hi,
            avoid: 0.0,
            ties: 0.125,
            nan: 0.0,
            specials: false,
        }
    }
    pub(super) const fn avoid(mut self, a: f64) -> Dom {
        self.avoid = a;
        self
    }
    pub(super) const fn ties(mut self, t: f64) -> Dom {
        self.ties = t;
        self
    }
    pub(super) const fn nan(mut self, p: f64) -> Dom {
        self.nan = p;
        self
    }
    pub(super) const fn specials(mut self) -> Dom {
        self.specials = true;
        self
    }
    /// Any value for `dtype` (data movement).
    pub(super) fn any(dtype: DType) -> Dom {
        match dtype {
            DType::U8 => Dom::range(0.0, 255.0).specials(),
            DType::I64 => Dom::range(-1e6, 1e6).specials(),
            _ => Dom::range(-100.0, 100.0).specials(),
        }
    }
}

/// splitmix64: values come from a seed so that proptest only shrinks shapes and views.
pub(super) struct Mix(u64);

impl Mix {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(super) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }
}

pub(super) fn gen_values(dom: &Dom, dtype: DType, n: usize, seed: u64) -> HostBuffer {
    let mut r = Mix(seed);
    let real = |r: &mut Mix| {
        let x = if r.unit() < dom.ties {
            (dom.lo + (dom.hi - dom.lo) * r.unit())
                .round()
                .clamp(dom.lo, dom.hi)
        } else {
            dom.lo + (dom.hi - dom.lo) * r.unit()
        };
        if x.abs() < dom.avoid {
            if x < 0.0 { -dom.avoid } else { dom.avoid }
        } else {
            x
        }
    };
    match dtype {
        d if d.is_float() => {
            const SPECIAL: [f64; 8] = [
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                -0.0,
                1e-40,    // subnormal in f32
                1e-310,   // subnormal in f64 (0 in f32)
                3.0e38,   // near f32::MAX
                -1.7e308, // near -f64::MAX (-inf in f32)
            ];
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    if dom.specials && r.unit() < 0.15 {
                        SPECIAL[(r.next() % 8) as usize]
                    } else if dom.nan > 0.0 && r.unit() < dom.nan {
                        f64::NAN
                    } else {
                        real(&mut r)
                    }
                })
                .collect();
            HostBuffer::from_f64(dtype, &v)
        }
        DType::I64 => HostBuffer::I64(
            (0..n)
                .map(|_| {
                    if dom.specials && r.unit() < 0.15 {
                        [i64::MIN, i64::MAX, -1, 0][(r.next() % 4) as usize]
                    } else {
                        real(&mut r).round() as i64
                    }
                })
                .collect(),
        ),
        _ => HostBuffer::U8((0..n).map(|_| real(&mut r).round() as u8).collect()),
    }
}

/// How an input tensor is laid out over its storage: stored with its axes permuted by `perm`,
/// each axis narrowed from `start[i]` out of `start[i] + dim + extra[i]` entries, and the axes
/// with `bcast[i]` stored with size 1 and broadcast (stride 0).
#[derive(Clone, Debug)]
pub(super) struct View {
    pub(super) perm: Vec<usize>,
    pub(super) start: Vec<usize>,
    pub(super) extra: Vec<usize>,
    pub(super) bcast: Vec<bool>,
}

/// One generated input: dtype, logical shape, view and the seed of its values.
#[derive(Clone)]
pub(super) struct Spec {
    pub(super) dtype: DType,
    pub(super) dims: Vec<usize>,
    pub(super) view: View,
    pub(super) dom: Dom,
    pub(super) seed: u64,
}

impl Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.dtype, self.dims)?;
        let v = &self.view;
        let ident = v.perm.iter().enumerate().all(|(i, &p)| i == p);
        if !ident {
            write!(f, " perm {:?}", v.perm)?;
        }
        if v.start.iter().chain(&v.extra).any(|&s| s > 0) {
            write!(f, " narrowed start {:?} extra {:?}", v.start, v.extra)?;
        }
        if v.bcast.iter().any(|&b| b) {
            write!(f, " broadcast {:?}", v.bcast)?;
        }
        write!(f, " seed {:#x}", self.seed)
    }
}

impl Spec {
    pub(super) fn pre_dims(&self) -> Vec<usize> {
        let v = &self.view;
        (0..self.dims.len())
            .map(|i| {
                if v.bcast[i] {
                    1
                } else {
                    v.start[i] + self.dims[i] + v.extra[i]
                }
            })
            .collect()
    }

    pub(super) fn storage_dims(&self) -> Vec<usize> {
        let pre = self.pre_dims();
        self.view.perm.iter().map(|&p| pre[p]).collect()
    }

    pub(super) fn host(&self) -> HostBuffer {
        let n = self.storage_dims().iter().product();
        gen_values(&self.dom, self.dtype, n, self.seed)
    }

    pub(super) fn inverse_perm(&self) -> Vec<usize> {
        let mut inv = vec![0; self.view.perm.len()];
        for (j, &p) in self.view.perm.iter().enumerate() {
            inv[p] = j;
        }
        inv
    }

    /// The layout alone (for direct backend calls).
    pub(super) fn layout(&self) -> Result<Layout> {
        let mut l = Layout::contiguous(self.storage_dims()).permute(&self.inverse_perm())?;
        for i in 0..self.dims.len() {
            if !self.view.bcast[i] {
                l = l.narrow(i, self.view.start[i], self.dims[i])?;
            }
        }
        l.broadcast_to(&self.dims.clone().into())
    }

    pub(super) fn build<B: Backend>(&self, dev: &B::Device) -> Result<Tensor<B>> {
        let mut t = Tensor::<B>::from_host(&self.host(), self.storage_dims(), dev)?
            .permute(&self.inverse_perm())?;
        for i in 0..self.dims.len() {
            if !self.view.bcast[i] {
                t = t.narrow(i as isize, self.view.start[i], self.dims[i])?;
            }
        }
        t.broadcast_to(self.dims.clone())
    }
}

pub(super) fn view_strategy(rank: usize, bcast: bool) -> BoxedStrategy<View> {
    (
        Just((0..rank).collect::<Vec<_>>()).prop_shuffle(),
        prop::collection::vec(0..3usize, rank),
        prop::collection::vec(0..3usize, rank),
        prop::collection::vec(prop::bool::weighted(if bcast { 0.2 } else { 0.0 }), rank),
        prop::bool::weighted(0.3),
    )
        .prop_map(move |(perm, start, extra, bcast, plain)| {
            if plain {
                View {
                    perm: (0..rank).collect(),
                    start: vec![0; rank],
                    extra: vec![0; rank],
                    bcast: vec![false; rank],
                }
            } else {
                View {
                    perm,
                    start,
                    extra,
                    bcast,
                }
            }
        })
        .boxed()
}

pub(super) fn spec(dims: Vec<usize>, dtype: DType, dom: Dom, bcast: bool) -> BoxedStrategy<Spec> {
    (view_strategy(dims.len(), bcast), any::<u64>())
        .prop_map(move |(view, seed)| Spec {
            dtype,
            dims: dims.clone(),
            view,
            dom,
            seed,
        })
        .boxed()
}

pub(super) fn dim(max: usize) -> BoxedStrategy<usize> {
    prop_oneof![1 => Just(0usize), 3 => Just(1usize), 10 => 2..=max].boxed()
}

pub(super) fn shape(min_rank: usize, max_rank: usize, max_dim: usize) -> BoxedStrategy<Vec<usize>> {
    prop::collection::vec(dim(max_dim), min_rank..=max_rank).boxed()
}

/// Occasionally large shapes (up to ~85k elements, runs longer than 1024, axes of several
/// hundred), so that backends' blocked, vectorized and multi-threaded paths are exercised too.
pub(super) fn big_shape(min_rank: usize) -> BoxedStrategy<Vec<usize>> {
    let s = prop_oneof![
        (1000..=70_000usize).prop_map(|n| vec![n]),
        (2..=40usize, 1000..=2100usize).prop_map(|(a, b)| vec![a, b]),
        (1000..=2100usize, 2..=40usize).prop_map(|(a, b)| vec![a, b]),
        (2..=4usize, 90..=130usize, 90..=130usize).prop_map(|(a, b, c)| vec![a, b, c]),
    ];
    s.prop_filter("rank", move |d| d.len() >= min_rank).boxed()
}

/// [`shape`] with a large shape in about one case of twenty.
pub(super) fn shapes(
    min_rank: usize,
    max_rank: usize,
    max_dim: usize,
) -> BoxedStrategy<Vec<usize>> {
    prop_oneof![19 => shape(min_rank, max_rank, max_dim), 1 => big_shape(min_rank)].boxed()
}

/// Derives an operand shape that broadcasts to `out`: leading axes dropped, some set to 1.
pub(super) fn operand_dims(out: &[usize], drop: usize, ones: &[bool]) -> Vec<usize> {
    let drop = drop.min(out.len());
    out[drop..]
        .iter()
        .zip(&ones[drop..])
        .map(|(&d, &one)| if one { 1 } else { d })
        .collect()
}

pub(super) fn broadcast_shapes(max_rank: usize) -> BoxedStrategy<(Vec<usize>, Vec<usize>)> {
    shapes(0, max_rank, 6)
        .prop_flat_map(|out| {
            let r = out.len();
            (
                Just(out),
                0..=r,
                0..=r,
                prop::collection::vec(prop::bool::weighted(0.2), r),
                prop::collection::vec(prop::bool::weighted(0.2), r),
                prop::bool::weighted(0.6),
            )
        })
        .prop_map(|(out, da, db, oa, ob, full_a)| {
            // Mostly one operand has the full shape; sometimes both broadcast.
            let a = if full_a {
                out.clone()
            } else {
                operand_dims(&out, da, &oa)
            };
            let b = operand_dims(&out, db, &ob);
            (a, b)
        })
        .boxed()
}

pub(super) const FLOATS: [DType; 4] = DType::FLOATS;
pub(super) const ALL: [DType; 6] = DType::ALL;

pub(super) fn dtypes_where(f: impl Fn(DType) -> bool) -> Vec<DType> {
    ALL.into_iter().filter(|&d| f(d)).collect()
}

pub(super) fn msg(e: Error) -> String {
    e.to_string()
}
