//! Copies between devices (the copy suite and the `copy_to` case) and compositions of several ops.

use super::*;

pub(super) fn copy_suite<B: Backend>(a: &B::Device, b: &B::Device) -> Result<()> {
    use kiln_core::Error;
    let opts = CheckOptions::default();
    let x = Tensor::<B>::from_vec(vec![0.5f64, -1.0, 2.0, 0.25, 1.5, -0.75], [2, 3], a)?;
    let w = Tensor::<B>::from_vec(vec![1.0f64, 2.0, -1.0], [3], b)?;
    // x lives on a, w on b: compute on b, bring the result back to a.
    check_backward(
        |v| {
            v[0].to_device(b)?
                .mul(&v[1])?
                .tanh()?
                .copy_to(a)?
                .sum(&[1], false)
        },
        &[x.clone(), w.clone()],
        &opts,
    )?;
    check_backward(
        |v| v[0].t()?.copy_to(b)?.exp(),
        std::slice::from_ref(&x),
        &opts,
    )?;
    // The gradient arrives on the source device.
    let xv = Var::param(x.clone());
    xv.to_device(b)?.square()?.sum_all()?.backward()?;
    let g = xv
        .grad()
        .ok_or_else(|| Error::invalid("copy_suite", "no gradient"))?;
    if g.device() != a {
        return Err(Error::invalid(
            "copy_suite",
            format!("gradient on {} instead of {a}", g.device()),
        ));
    }
    let same = xv.to_device(a)?;
    if !same.ptr_eq(&xv) {
        return Err(Error::invalid(
            "copy_suite",
            "to_device to its own device made a copy",
        ));
    }
    if a != b {
        let err = match xv.mul(&Var::param(w.broadcast_to([2, 3])?)) {
            Ok(_) => return Err(Error::invalid("copy_suite", "mixing devices did not fail")),
            Err(e) => e.to_string(),
        };
        let (na, nb) = (a.to_string(), b.to_string());
        if !(err.contains("mul") && err.contains(&na) && err.contains(&nb)) {
            return Err(Error::invalid(
                "copy_suite",
                format!("mixing devices error does not name the op and both devices: {err}"),
            ));
        }
    }
    Ok(())
}

/// Copies between devices, and compositions of several ops.
pub(super) fn device_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    // ---- devices ----
    c.push((
        "copy_to".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let other = B::devices()
                .into_iter()
                .find(|d| d != dev)
                .unwrap_or_else(|| dev.clone());
            prop(cfg, input_of(dims(0, 3)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].copy_to(&other)?.tanh()?.to_device(dev)
                })
            })
        }),
    ));

    // ---- compositions ----
    c.push((
        "composite/reuse".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            prop(cfg, input_of(dims(0, 3)), |x| {
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    let x = &v[0];
                    x.mul(x)?.add(&x.exp()?.mul(x)?)?.sub(&x.sin()?)
                })
            })
        }),
    ));
    c.push((
        "composite/logreg".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (1usize..=6, 1usize..=5, lay(), any::<u64>());
            prop(cfg, s, |(n, f, lx, seed)| {
                let x = In {
                    dims: vec![n, f],
                    lay: lx,
                    seed,
                }
                .build::<B>(Vals::Normal, dev)?;
                let y = ids::<B>(&[n], 2, seed, dev)?.to_dtype(DType::F64)?;
                let w = In {
                    dims: vec![f],
                    lay: Lay::Contiguous,
                    seed: seed.wrapping_add(1),
                }
                .build::<B>(Vals::Normal, dev)?;
                let b = Tensor::<B>::zeros([], DType::F64, dev)?;
                check(cfg, &[x, w, b], |v| {
                    let y = Var::constant(y.to_dtype(v[0].dtype())?);
                    let p = v[0].matmul(&v[1])?.add(&v[2])?.sigmoid()?;
                    let xent = y.neg()?.mul(&p.log()?)?.sub(
                        &y.scalar_binary(BinaryOp::Sub, 1.0)?
                            .mul(&p.scalar_binary(BinaryOp::Sub, 1.0)?.log()?)?,
                    )?;
                    xent.mean_all()?
                        .add(&v[1].square()?.sum_all()?.mul_scalar(0.01)?)
                })
            })
        }),
    ));
    c
}
