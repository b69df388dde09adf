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
    // Dropout's keep mask: the reference's bits, and on the backend under test the f32
    // uniforms of the same key compared with p (rounded to f32) in f32.
    let strat = (
        prop_oneof![8 => shape(0, 3, 6), 4 => shape(1, 2, 70), 1 => big_shape(1)],
        any::<u64>(),
        prop_oneof![1 => Just(0.0f64), 1 => Just(0.2), 6 => 0.0..1.0f64, 1 => Just(1.0)],
    );
    p.run(out, "rand keep", strat, |(dims, seed, keep_p)| {
        let dist = RandDist::Keep { p: keep_p };
        let draw = || Generator::new(seed).sample::<X>(dims.clone(), dist, DType::U8, &p.dx);
        let w = Generator::new(seed).sample::<Y>(dims.clone(), dist, DType::U8, &p.dy);
        let what = format!("rand keep p {keep_p} seed {seed:#x}");
        p.expect(&what, &[], draw(), w, &Tol::Bits)?;
        let g = draw();
        let u = Generator::new(seed).rand::<X>(dims.clone(), &p.dx);
        let composed = u.and_then(|u| u.compare_scalar(CmpOp::Ge, keep_p as f32 as f64));
        let (g, c) = (
            g.and_then(|t| t.to_vec::<u8>()),
            composed.and_then(|t| t.to_vec::<u8>()),
        );
        match (g, c) {
            (Ok(g), Ok(c)) if g == c => Ok(()),
            (Ok(_), Ok(_)) => Err(format!("{what} on {}: not rand >= p", X::NAME)),
            (g, c) => Err(format!(
                "{what} on {}: {:?} / {:?}",
                X::NAME,
                g.err(),
                c.err()
            )),
        }
    });
    // Keep masks are u8 only, uniforms and normals float only: typed errors.
    let wrong = [
        (RandDist::Keep { p: 0.5 }, DType::F32),
        (
            RandDist::Uniform {
                low: 0.0,
                high: 1.0,
            },
            DType::U8,
        ),
    ];
    for (dist, dtype) in wrong {
        let r = Generator::new(1).sample::<X>([3], dist, dtype, &p.dx);
        if !matches!(r, Err(Error::DTypeMismatch { op: "rand", .. })) {
            out.failures.push(format!(
                "rand {dist:?} as {dtype} on {}: {r:?}, not a dtype error",
                X::NAME
            ));
        }
    }
}
