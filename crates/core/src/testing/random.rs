//! Philox random numbers: uniform and normal, bit for bit against the reference.

use super::*;

pub(super) fn g_rand<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let shapes = prop_oneof![8 => shape(0, 3, 6), 4 => shape(1, 2, 70), 1 => big_shape(1)];
    let strat = (
        shapes.clone(),
        select(FLOATS.to_vec()),
        any::<u64>(),
        -10.0..10.0f64,
        0.0..10.0f64,
    );
    p.run(
        out,
        "rand uniform",
        strat,
        |(dims, dtype, seed, low, width)| {
            let high = low + width;
            let (g, w) = (
                Generator::new(seed).sample::<X>(
                    dims.clone(),
                    RandDist::Uniform { low, high },
                    dtype,
                    &p.dx,
                ),
                Generator::new(seed).sample::<Y>(
                    dims.clone(),
                    RandDist::Uniform { low, high },
                    dtype,
                    &p.dy,
                ),
            );
            let tol = match dtype {
                // f32, and the 16-bit floats drawn in f32 and rounded, are Philox's bits.
                DType::F32 | DType::F16 | DType::BF16 => Tol::Bits,
                _ => Tol::Close {
                    rtol: 4.0 * f64::EPSILON,
                    atol: 4.0 * f64::EPSILON * (low.abs() + high.abs()),
                    k: 0.0,
                    mag: None,
                },
            };
            p.expect(
                &format!("rand uniform [{low}, {high}) seed {seed:#x} {dtype}"),
                &[],
                g,
                w,
                &tol,
            )
        },
    );
    let strat = (
        shapes,
        select(FLOATS.to_vec()),
        any::<u64>(),
        -5.0..5.0f64,
        0.0..3.0f64,
    );
    p.run(
        out,
        "rand normal",
        strat,
        |(dims, dtype, seed, mean, std)| {
            let (g, w) = (
                Generator::new(seed).sample::<X>(
                    dims.clone(),
                    RandDist::Normal { mean, std },
                    dtype,
                    &p.dx,
                ),
                Generator::new(seed).sample::<Y>(
                    dims.clone(),
                    RandDist::Normal { mean, std },
                    dtype,
                    &p.dy,
                ),
            );
            // A few ulps of the value's scale: |mean| + std·|z| with |z| <= ~8.
            let e = eps(dtype) * p.slack;
            let tol = Tol::Close {
                rtol: 8.0 * e,
                atol: 8.0 * e * (mean.abs() + 8.0 * std),
                k: 0.0,
                mag: None,
            };
            p.expect(
                &format!("rand normal mean {mean} std {std} seed {seed:#x} {dtype}"),
                &[],
                g,
                w,
                &tol,
            )
        },
    );
}
