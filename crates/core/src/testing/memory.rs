//! Memory and data movement: devices, fills, host round trips, copies, contiguous copies of views,
//! copies into strided destinations, and the joins built on them (`cat`, `stack`).

use super::*;

pub(super) fn g_devices<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    out.checks += 1;
    let d = &p.dx;
    let r = (|| -> Check {
        let all = X::devices();
        if !all.contains(d) {
            return Err(format!(
                "devices() = {all:?} does not list the device under test {d}"
            ));
        }
        for dev in &all {
            let name = dev.to_string();
            match X::parse_device(&name) {
                Ok(back) if &back == dev => {}
                other => {
                    return Err(format!(
                        "parse_device({name:?}) gave {other:?}, expected {dev:?}"
                    ));
                }
            }
        }
        if X::parse_device("no-such-device:7").is_ok() {
            return Err("parse_device(\"no-such-device:7\") succeeded".into());
        }
        let t = Tensor::<X>::ones([3, 5], DType::F32, d).map_err(msg)?;
        if &X::storage_device(t.storage()) != d {
            return Err(format!(
                "storage_device of a tensor made on {d} is {}",
                X::storage_device(t.storage())
            ));
        }
        X::synchronize(d).map_err(|e| format!("synchronize({d}): {e}"))?;
        let m = X::memory_stats(d).map_err(|e| format!("memory_stats({d}): {e}"))?;
        if m.peak < m.in_use || m.reserved < m.in_use {
            return Err(format!(
                "memory_stats({d}) = {m:?}: peak and reserved must be at least in_use"
            ));
        }
        X::empty_cache(d).map_err(|e| format!("empty_cache({d}): {e}"))?;
        if t.to_vec::<f32>().map_err(msg)? != vec![1.0; 15] {
            return Err("a live tensor changed after empty_cache".into());
        }
        Ok(())
    })();
    if let Err(m) = r {
        out.failures
            .push(format!("[devices] {} on {d}: {m}", X::NAME));
    }
}

pub(super) fn g_fill<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shape(0, 4, 6), select(ALL.to_vec()), -1e4..1e4f64, 0..8u8);
    p.run(out, "fill", strat, |(dims, dtype, raw, special)| {
        let value = match dtype {
            d if d.is_float() => match special {
                0 => f64::NAN,
                1 => f64::NEG_INFINITY,
                2 => -0.0,
                _ => raw,
            },
            DType::I64 => raw.round(),
            _ => (raw.abs().round() % 256.0).floor(),
        };
        let (g, w) = (
            Tensor::<X>::full(dims.clone(), value, dtype, &p.dx),
            Tensor::<Y>::full(dims.clone(), value, dtype, &p.dy),
        );
        p.expect(
            &format!("fill {dtype} value {value:?}"),
            &[],
            g,
            w,
            &Tol::Bits,
        )
    });
}

pub(super) fn g_host<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shapes(0, 4, 6), select(ALL.to_vec()))
        .prop_flat_map(|(dims, dtype)| spec(dims, dtype, Dom::any(dtype), true));
    p.run(out, "host_roundtrip", strat, |s| {
        // A contiguous upload must come back exactly as given.
        let host = s.host();
        let t = Tensor::<X>::from_host(&host, s.storage_dims(), &p.dx).map_err(msg)?;
        let back = t.to_host().map_err(msg)?;
        compare_values(&back, &host, &s.storage_dims(), &Tol::Bits)
            .map_err(|m| format!("from_host/to_host {} {:?}: {m}", s.dtype, s.storage_dims()))?;
        // Strided reads.
        let a = p.build(&s)?;
        let (g, w) = both!(a => a
            .to_host()
            .and_then(|h| Tensor::from_host(&h, a.shape().clone(), a.device())));
        p.expect(
            &format!("to_host of a view, {}", s.dtype),
            &[("x", &a.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

pub(super) fn g_copy<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shapes(0, 4, 6), select(ALL.to_vec()))
        .prop_flat_map(|(dims, dtype)| spec(dims, dtype, Dom::any(dtype), true));
    p.run(out, "copy_to/to_device", strat, |s| {
        let a = p.build(&s)?;
        let what = format!("copy_to, {}", s.dtype);
        let x = &a.0;
        let same = x.to_device(&p.dx).map_err(msg)?;
        if !same.same_storage(x) {
            return Err(format!(
                "{what}: to_device to the tensor's own device copied"
            ));
        }
        let c = x.copy_to(&p.dx).map_err(msg)?;
        if c.same_storage(x) {
            return Err(format!("{what}: copy_to the same device did not copy"));
        }
        if !c.is_contiguous() {
            return Err(format!("{what}: copy is not contiguous ({:?})", c.layout()));
        }
        let (g, w) = both!(a => a.copy_to(a.device()));
        p.expect(&what, &[("x", x)], g, w, &Tol::Bits)?;
        // Every other device of the backend, there and back.
        for d in X::devices().into_iter().filter(|d| d != &p.dx) {
            let there = x.to_device(&d).map_err(msg)?;
            if there.device() != &d {
                return Err(format!(
                    "{what}: to_device({d}) gave a tensor on {}",
                    there.device()
                ));
            }
            let back = there.copy_to(&p.dx);
            p.expect(
                &format!("copy to {d} and back, {}", s.dtype),
                &[("x", x)],
                back,
                Ok(a.1.clone()),
                &Tol::Bits,
            )?;
        }
        Ok(())
    });
}

pub(super) fn g_contiguous<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (shapes(0, 4, 6), select(ALL.to_vec()))
        .prop_flat_map(|(dims, dtype)| spec(dims, dtype, Dom::any(dtype), true));
    p.run(out, "contiguous", strat, |s| {
        let a = p.build(&s)?;
        let (g, w) = both!(a => a.contiguous());
        if let Ok(g) = &g
            && (!g.is_contiguous() || g.layout().offset() != 0)
        {
            return Err(format!("contiguous gave layout {:?}", g.layout()));
        }
        p.expect(
            &format!("contiguous {}", s.dtype),
            &[("x", &a.0)],
            g,
            w,
            &Tol::Bits,
        )?;
        let (g, w) = both!(a => a.flatten_all());
        p.expect(
            &format!("reshape (flatten) {}", s.dtype),
            &[("x", &a.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

pub(super) fn g_copy_into<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    // Direct: write a strided source into a strided (never broadcast) region of a buffer
    // filled with a sentinel; the whole buffer must match, untouched entries included.
    let strat = (shape(0, 4, 5), select(ALL.to_vec())).prop_flat_map(|(dims, dtype)| {
        (
            spec(dims.clone(), dtype, Dom::any(dtype), true),
            spec(dims, dtype, Dom::any(dtype), false),
        )
    });
    p.run(out, "copy_into", strat, |(src, dst)| {
        let a = p.build(&src)?;
        let dl = dst.layout().map_err(msg)?;
        let n: usize = dst.storage_dims().iter().product();
        let whole = Layout::contiguous(dst.storage_dims());
        let dtype = src.dtype;
        let run_x = || -> Result<HostBuffer> {
            let mut st = X::fill(&p.dx, dtype, n, 7.0)?;
            X::copy_into(a.0.storage(), a.0.layout(), &mut st, &dl, dtype)?;
            X::to_host(&st, &whole, dtype)
        };
        let run_y = || -> Result<HostBuffer> {
            let mut st = Y::fill(&p.dy, dtype, n, 7.0)?;
            Y::copy_into(a.1.storage(), a.1.layout(), &mut st, &dl, dtype)?;
            Y::to_host(&st, &whole, dtype)
        };
        let want = run_y().map_err(|e| format!("oracle copy_into failed: {e}"))?;
        let got = run_x().map_err(|e| format!("copy_into {dtype} into {dl:?}: {e}"))?;
        compare_values(&got, &want, &dst.storage_dims(), &Tol::Bits).map_err(|m| {
            format!(
                "copy_into {dtype}: {}\n  into layout {dl:?} of a {n}-element buffer: {m}",
                describe("src", &a.0)
            )
        })
    });
    // Through the Tensor API: slice_assign of a strided source into a strided tensor.
    let strat = (
        shape(1, 4, 5),
        select(ALL.to_vec()),
        any::<prop::sample::Index>(),
        0..3usize,
    )
        .prop_flat_map(|(dims, dtype, ax, start)| {
            let axis = ax.index(dims.len());
            let len = dims[axis].saturating_sub(start);
            let mut sd = dims.clone();
            sd[axis] = len;
            let start = start.min(dims[axis]);
            (
                Just((axis, start)),
                spec(dims, dtype, Dom::any(dtype), true),
                spec(sd, dtype, Dom::any(dtype), true),
            )
        });
    p.run(out, "slice_assign", strat, |((axis, start), base, src)| {
        let (a, b) = (p.build(&base)?, p.build(&src)?);
        let (g, w) = both!(a, b => a.clone().slice_assign(axis as isize, start, b));
        p.expect(
            &format!("slice_assign axis {axis} start {start}"),
            &[("base", &a.0), ("src", &b.0)],
            g,
            w,
            &Tol::Bits,
        )
    });
}

pub(super) fn g_cat_stack<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        shape(1, 4, 5),
        select(ALL.to_vec()),
        any::<prop::sample::Index>(),
        prop::collection::vec(0..=4usize, 1..=4),
        any::<bool>(),
    )
        .prop_flat_map(|(dims, dtype, ax, lens, neg)| {
            let axis = ax.index(dims.len());
            let parts: Vec<_> = lens
                .iter()
                .map(|&l| {
                    let mut d = dims.clone();
                    d[axis] = l;
                    spec(d, dtype, Dom::any(dtype), true)
                })
                .collect();
            let axis = if neg {
                axis as isize - dims.len() as isize
            } else {
                axis as isize
            };
            (Just(axis), parts)
        });
    p.run(out, "cat", strat, |(axis, parts)| {
        let built = parts
            .iter()
            .map(|s| p.build(s))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let xs: Vec<Tensor<X>> = built.iter().map(|b| b.0.clone()).collect();
        let ys: Vec<Tensor<Y>> = built.iter().map(|b| b.1.clone()).collect();
        let ins: Vec<(&str, &Tensor<X>)> = xs.iter().map(|t| ("part", t)).collect();
        p.expect(
            &format!("cat axis {axis} {}", parts[0].dtype),
            &ins,
            Tensor::cat(&xs, axis),
            Tensor::cat(&ys, axis),
            &Tol::Bits,
        )
    });
    let strat = (
        shape(0, 3, 5),
        select(ALL.to_vec()),
        1..=4usize,
        any::<prop::sample::Index>(),
    )
        .prop_flat_map(|(dims, dtype, n, ax)| {
            let axis = ax.index(dims.len() + 1) as isize;
            (
                Just(axis),
                prop::collection::vec(spec(dims, dtype, Dom::any(dtype), true), n),
            )
        });
    p.run(out, "stack", strat, |(axis, parts)| {
        let built = parts
            .iter()
            .map(|s| p.build(s))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let xs: Vec<Tensor<X>> = built.iter().map(|b| b.0.clone()).collect();
        let ys: Vec<Tensor<Y>> = built.iter().map(|b| b.1.clone()).collect();
        let ins: Vec<(&str, &Tensor<X>)> = xs.iter().map(|t| ("part", t)).collect();
        p.expect(
            &format!("stack axis {axis} {}", parts[0].dtype),
            &ins,
            Tensor::stack(&xs, axis),
            Tensor::stack(&ys, axis),
            &Tol::Bits,
        )
    });
}
