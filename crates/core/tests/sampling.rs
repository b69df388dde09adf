//! `Generator::multinomial` and `sample_logits` on the f64 reference backend: the sampled
//! frequencies against the probabilities (chi-square bounds on fixed seeds, with and without
//! replacement), determinism per seed, the top-k restriction exactly, and the typed errors.
//! (`backend-cpu`'s tests check that the CPU draws the same samples.)

use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{DType, Error, Generator, Tensor, sample_logits};

type B = Reference;
const DEV: RefDevice = RefDevice(0);

fn t(v: &[f64], dims: &[usize]) -> Tensor<B> {
    Tensor::from_vec(v.to_vec(), dims.to_vec(), &DEV).unwrap()
}

fn ids(x: &Tensor<B>) -> Vec<i64> {
    x.to_vec::<i64>().unwrap()
}

/// Pearson's statistic of `counts` against `probs` (categories of probability 0 must be empty).
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            if p == 0.0 {
                assert_eq!(c, 0, "a category of probability 0 was drawn");
                return 0.0;
            }
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

fn counts(samples: impl IntoIterator<Item = i64>, c: usize) -> Vec<usize> {
    let mut k = vec![0; c];
    for s in samples {
        k[s as usize] += 1;
    }
    k
}

/// With replacement: 20,000 draws of weights (2, 4, 6, 8, 0) (not normalized); 3 degrees of
/// freedom, whose 99.9% quantile is 16.3.
#[test]
fn with_replacement_follows_the_probabilities() {
    let w = [2.0, 4.0, 6.0, 8.0, 0.0];
    let p: Vec<f64> = w.iter().map(|x| x / 20.0).collect();
    let x = Generator::new(1)
        .multinomial(&t(&w, &[5]), 20_000, true)
        .unwrap();
    assert_eq!(x.dims(), [20_000]);
    assert_eq!(x.dtype(), DType::I64);
    let chi = chi_square(&counts(ids(&x), 5), &p);
    assert!(chi < 16.3, "chi-square {chi}");
    // Two rows of different distributions, f32.
    let w2 = t(&[1.0, 0.0, 3.0, 0.0, 5.0, 5.0], &[2, 3])
        .to_dtype(DType::F32)
        .unwrap();
    let x = Generator::new(2).multinomial(&w2, 10_000, true).unwrap();
    assert_eq!(x.dims(), [2, 10_000]);
    let v = ids(&x);
    assert!(chi_square(&counts(v[..10_000].iter().copied(), 3), &[0.25, 0.0, 0.75]) < 10.8);
    assert!(chi_square(&counts(v[10_000..].iter().copied(), 3), &[0.0, 0.5, 0.5]) < 10.8);
}

/// Without replacement: each row's samples are distinct; the first pick follows `p` and the
/// second `P(j) = Σ_i p_i p_j / (1 - p_i)` (sequential drawing), over 20,000 identical rows.
#[test]
fn without_replacement_draws_sequentially() {
    let p = [0.1, 0.2, 0.3, 0.4];
    let rows = 20_000;
    let probs = t(&p, &[1, 4]).broadcast_to([rows, 4]).unwrap();
    let x = Generator::new(3).multinomial(&probs, 2, false).unwrap();
    assert_eq!(x.dims(), [rows, 2]);
    let v = ids(&x);
    assert!(
        v.chunks(2).all(|r| r[0] != r[1]),
        "samples of a row are distinct"
    );
    let first = counts(v.iter().step_by(2).copied(), 4);
    let second = counts(v.iter().skip(1).step_by(2).copied(), 4);
    let p2: Vec<f64> = (0..4)
        .map(|j| {
            (0..4)
                .filter(|&i| i != j)
                .map(|i| p[i] * p[j] / (1.0 - p[i]))
                .sum()
        })
        .collect();
    assert!(chi_square(&first, &p) < 16.3, "first pick {first:?}");
    assert!(
        chi_square(&second, &p2) < 16.3,
        "second pick {second:?} vs {p2:?}"
    );
    // Asking for every nonzero category gives a permutation of them.
    let x = Generator::new(4)
        .multinomial(&t(&[0.5, 0.0, 0.2, 0.3], &[4]), 3, false)
        .unwrap();
    let mut v = ids(&x);
    v.sort();
    assert_eq!(v, [0, 2, 3]);
}

#[test]
fn samples_are_deterministic_per_seed() {
    let p = t(&[0.2, 0.3, 0.5, 0.1, 0.9, 0.0], &[2, 3]);
    for replacement in [true, false] {
        let draw = |seed| {
            ids(&Generator::new(seed)
                .multinomial(&p, 2, replacement)
                .unwrap())
        };
        assert_eq!(draw(7), draw(7));
        let all: Vec<Vec<i64>> = (0..20).map(draw).collect();
        assert!(all.iter().any(|v| *v != all[0]), "seeds differ");
    }
    // A draw advances the generator: two calls differ, a reseed replays.
    let mut g = Generator::new(9);
    let a = ids(&g.multinomial(&p, 50, true).unwrap());
    let b = ids(&g.multinomial(&p, 50, true).unwrap());
    assert_ne!(a, b);
    g.manual_seed(9);
    assert_eq!(ids(&g.multinomial(&p, 50, true).unwrap()), a);
}

#[test]
fn bad_probabilities_are_typed_errors() {
    let mut g = Generator::new(0);
    let mut bad = |p: Tensor<B>, n: usize, repl: bool, what: &str| match g.multinomial(&p, n, repl)
    {
        Err(Error::InvalidArgument { op, msg }) => {
            assert_eq!(op, "multinomial");
            assert!(msg.contains(what), "{msg} should say {what}");
        }
        r => panic!(
            "{what}: expected an error, got {:?}",
            r.map(|x| x.dims().to_vec())
        ),
    };
    bad(
        t(&[0.5, -0.1, 0.6], &[3]),
        1,
        true,
        "negative, NaN or infinite",
    );
    bad(
        t(&[0.5, f64::NAN, 0.6], &[3]),
        1,
        true,
        "negative, NaN or infinite",
    );
    bad(
        t(&[0.5, f64::INFINITY], &[2]),
        1,
        true,
        "negative, NaN or infinite",
    );
    bad(
        t(&[0.5, 0.5, 0.0, 0.0], &[2, 2]),
        1,
        true,
        "1 rows sum to 0",
    );
    bad(t(&[0.5, 0.5], &[2]), 3, false, "without replacement");
    bad(t(&[0.5, 0.0, 0.0], &[3]), 2, false, "only 1 nonzero");
    bad(t(&[0.5, 0.5], &[2]), 0, true, "one sample");
    bad(t(&[0.5; 8], &[2, 2, 2]), 1, true, "[rows, C]");
    let ints = Tensor::<B>::from_vec(vec![1i64, 2], [2], &DEV).unwrap();
    assert!(matches!(
        g.multinomial(&ints, 1, true),
        Err(Error::DTypeMismatch {
            op: "multinomial",
            ..
        })
    ));
}

/// Top-k keeps exactly the `k` largest logits of each row (and those tied with the `k`-th):
/// over many draws every kept index appears and no other.
#[test]
fn sample_logits_keeps_exactly_the_top_k() {
    let logits = t(
        &[
            0.1, 2.0, -1.0, 3.0, 0.5, 2.5, // row 0: top 3 are 3, 5, 1
            1.0, 1.0, 1.0, 0.0, 2.0,
            1.0, // row 1: top 2 are 4 and the tie at 1.0 (0, 1, 2, 5)
        ],
        &[2, 6],
    );
    let mut g = Generator::new(11);
    let (mut seen0, mut seen1) = (vec![false; 6], vec![false; 6]);
    let many = Tensor::cat(&vec![logits.clone(); 500], 0).unwrap();
    for _ in 0..4 {
        let s = ids(&sample_logits(&many, 2.0, Some(3), &mut g).unwrap());
        for (r, &i) in s.iter().enumerate() {
            let seen = if r % 2 == 0 { &mut seen0 } else { &mut seen1 };
            seen[i as usize] = true;
        }
    }
    assert_eq!(
        seen0,
        [false, true, false, true, false, true],
        "row 0, k = 3"
    );
    // k = 3 in row 1: 2.0, then three values tied at 1.0 for places 2 to 4: all of them stay.
    assert_eq!(
        seen1,
        [true, true, true, false, true, true],
        "row 1, k = 3 with ties"
    );
    let mut seen = vec![false; 6];
    for &i in &ids(&sample_logits(&many, 1.0, Some(2), &mut g).unwrap()) {
        seen[i as usize] = true;
    }
    // Row 0's top 2 (3, 5) and row 1's (4 and the tied 1.0s).
    assert_eq!(seen, [true, true, true, true, true, true]);
    let row0 = t(&[0.1, 2.0, -1.0, 3.0, 0.5, 2.5], &[1, 6]);
    let s = ids(&sample_logits(
        &Tensor::cat(&vec![row0; 1000], 0).unwrap(),
        1.0,
        Some(2),
        &mut g,
    )
    .unwrap());
    assert!(s.iter().all(|&i| i == 3 || i == 5));
    assert!(s.contains(&3) && s.contains(&5));
    // k = 1 is argmax; a k above C is no restriction; leading axes are kept.
    let s = sample_logits(&logits.reshape([1, 2, 6]).unwrap(), 1.0, Some(1), &mut g).unwrap();
    assert_eq!(s.dims(), [1, 2]);
    assert_eq!(ids(&s)[0], 3);
    let s = ids(&sample_logits(&many, 1.0, Some(100), &mut g).unwrap());
    assert!(s.iter().step_by(2).any(|&i| i == 0 || i == 2 || i == 4));
}

#[test]
fn temperature_sharpens_and_bad_arguments_are_typed_errors() {
    let mut g = Generator::new(12);
    let logits = Tensor::cat(&vec![t(&[1.0, 2.0, 1.5], &[1, 3]); 300], 0).unwrap();
    let cold = ids(&sample_logits(&logits, 1e-3, None, &mut g).unwrap());
    assert!(
        cold.iter().all(|&i| i == 1),
        "a near-zero temperature is argmax"
    );
    let warm = ids(&sample_logits(&logits, 1.0, None, &mut g).unwrap());
    assert!(warm.iter().any(|&i| i != 1));
    let err = |r: kiln_core::Result<Tensor<B>>| match r {
        Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, "sample_logits"),
        r => panic!("expected an error, got {:?}", r.map(|x| x.dims().to_vec())),
    };
    err(sample_logits(&logits, 0.0, None, &mut g));
    err(sample_logits(&logits, f64::NAN, None, &mut g));
    err(sample_logits(&logits, 1.0, Some(0), &mut g));
    err(sample_logits(&t(&[1.0, f64::NAN], &[2]), 1.0, None, &mut g));
    err(sample_logits(
        &t(&[f64::NEG_INFINITY; 2], &[2]),
        1.0,
        None,
        &mut g,
    ));
    err(sample_logits(&t(&[1.0], &[]), 1.0, None, &mut g));
}
