//! Fused optimizer updates (SGD, Adam, AdamW) against the composed reference.

use super::*;

/// A random SGD or Adam(W) rule whose update stays moderate (|update| of order 1 at most).
fn update_rule() -> BoxedStrategy<UpdateRule> {
    let sgd = (
        1e-4..0.1f64,
        select(vec![0.0, 0.9, 0.5]),
        select(vec![0.0, 0.1]),
        any::<bool>(),
        select(vec![0.0, 0.01, 0.1]),
        any::<bool>(),
    )
        .prop_map(
            |(lr, momentum, dampening, nesterov, weight_decay, first_step)| UpdateRule::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
                first_step,
            },
        );
    let adam = (
        1e-4..0.1f64,
        0.8..0.99f64,
        0.9..0.9999f64,
        select(vec![1e-8, 1e-6, 1e-3]),
        select(vec![0.0, 0.01, 0.1]),
        any::<bool>(),
        1..=10i32,
    )
        .prop_map(
            |(lr, beta1, beta2, eps, weight_decay, decoupled, t)| UpdateRule::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
                bias_correction1: 1.0 - beta1.powi(t),
                bias_correction2: 1.0 - beta2.powi(t),
            },
        );
    prop_oneof![sgd, adam].boxed()
}

/// Per element, a bound on the magnitude of every term of the update (for the tolerance):
/// `[param, state...]` outputs all get `|p| + |g| + Σ|state| + lr·|direction|`.
fn update_mags(rule: &UpdateRule, p: &[f64], g: &[f64], st: &[Vec<f64>]) -> Vec<f64> {
    (0..p.len())
        .map(|i| {
            let (p, g) = (p[i].abs(), g[i].abs());
            let s: f64 = st.iter().map(|v| v[i].abs()).sum();
            let dir = match *rule {
                UpdateRule::Sgd {
                    lr,
                    momentum,
                    weight_decay,
                    ..
                } => lr * (g + weight_decay * p + momentum * s) * (1.0 + momentum),
                UpdateRule::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    bias_correction1,
                    bias_correction2,
                    ..
                } => {
                    let gg = g + weight_decay * p;
                    let m = beta1 * st[0][i].abs() + (1.0 - beta1) * gg;
                    let v = beta2 * st[1][i].abs();
                    lr * weight_decay * p
                        + lr / bias_correction1 * m / ((v / bias_correction2).sqrt() + eps)
                        + gg * gg
                }
            };
            p + g + s + dir
        })
        .collect()
}

pub(super) fn g_fused_update<X: Backend, Y: Backend>(p: &Pair<X, Y>, out: &mut Outcome) {
    let strat = (
        update_rule(),
        select(FLOATS.to_vec()),
        prop::collection::vec(prop_oneof![39 => shape(0, 3, 6), 1 => big_shape(1)], 1..=4),
    )
        .prop_flat_map(|(rule, dtype, dims)| {
            let n_state = rule.state_count();
            let adam = matches!(rule, UpdateRule::Adam { .. });
            let slots: Vec<_> = dims
                .into_iter()
                .map(|d| {
                    let states: Vec<_> = (0..n_state)
                        .map(|j| {
                            // Adam's second moment is positive.
                            let dom = if adam && j == 1 {
                                Dom::range(0.05, 2.0)
                            } else {
                                Dom::range(-1.0, 1.0)
                            };
                            spec(d.clone(), dtype, dom, true)
                        })
                        .collect();
                    (
                        spec(d.clone(), dtype, Dom::range(-2.0, 2.0), true),
                        spec(d, dtype, Dom::range(-1.0, 1.0), true),
                        states,
                    )
                })
                .collect();
            // Half the cases multiply the gradients by a factor inside the update (a clipping
            // coefficient: at most 1, down to 0.05).
            let scale = prop::option::of(spec(vec![], dtype, Dom::range(0.05, 1.0), false));
            (Just(rule), slots, scale)
        });
    p.run(out, "fused_update", strat, |(rule, slots, scale)| {
        let mut ps = Vec::new();
        let mut gs = Vec::new();
        let mut ss = Vec::new();
        for (sp, sg, sst) in &slots {
            ps.push(p.build(sp)?);
            gs.push(p.build(sg)?);
            ss.push(
                sst.iter()
                    .map(|s| p.build(s))
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            );
        }
        let px: Vec<Tensor<X>> = ps.iter().map(|t| t.0.clone()).collect();
        let py: Vec<Tensor<Y>> = ps.iter().map(|t| t.1.clone()).collect();
        let gx: Vec<Tensor<X>> = gs.iter().map(|t| t.0.clone()).collect();
        let gy: Vec<Tensor<Y>> = gs.iter().map(|t| t.1.clone()).collect();
        let sx: Vec<Vec<Tensor<X>>> = ss
            .iter()
            .map(|v| v.iter().map(|t| t.0.clone()).collect())
            .collect();
        let sy: Vec<Vec<Tensor<Y>>> = ss
            .iter()
            .map(|v| v.iter().map(|t| t.1.clone()).collect())
            .collect();
        let scale = scale.as_ref().map(|s| p.build(s)).transpose()?;
        let got =
            Tensor::<X>::fused_update_scaled(&rule, &px, &gx, &sx, scale.as_ref().map(|s| &s.0));
        let want =
            Tensor::<Y>::fused_update_scaled(&rule, &py, &gy, &sy, scale.as_ref().map(|s| &s.1));
        let factor = match &scale {
            Some(s) => s.1.to_scalar().map_err(msg)?,
            None => 1.0,
        };
        let (got, want) = match (got, want) {
            (Err(_), Err(_)) => return Ok(()),
            (Err(e), Ok(_)) => return Err(format!("fused_update {rule:?} failed: {e}")),
            (Ok(_), Err(e)) => {
                return Err(format!(
                    "fused_update {rule:?}: {} failed with {e} but {} did not",
                    Y::NAME,
                    X::NAME
                ));
            }
            (Ok(g), Ok(w)) => (g, w),
        };
        if got.len() != want.len() {
            return Err(format!(
                "fused_update returned {} slots, expected {}",
                got.len(),
                want.len()
            ));
        }
        for (i, ((gp, gst), (wp, wst))) in got.into_iter().zip(want).enumerate() {
            let host = |t: &Tensor<Y>| t.to_f64_vec().map_err(msg);
            let st_vals = ss[i]
                .iter()
                .map(|t| host(&t.1))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let g: Vec<f64> = host(&gs[i].1)?.iter().map(|g| g * factor).collect();
            let mag = update_mags(&rule, &host(&ps[i].1)?, &g, &st_vals);
            let tol = p.accum(slots[i].0.dtype, 32.0, Some(mag));
            let dtype = slots[i].0.dtype;
            let mut ins = vec![("param", &ps[i].0), ("grad", &gs[i].0)];
            ins.extend(ss[i].iter().map(|t| ("state", &t.0)));
            ins.extend(scale.iter().map(|t| ("grad scale", &t.0)));
            p.expect(
                &format!("fused_update {rule:?} {dtype}: slot {i} param"),
                &ins,
                Ok(gp),
                Ok(wp),
                &tol,
            )?;
            if gst.len() != wst.len() {
                return Err(format!(
                    "fused_update slot {i}: {} state buffers, expected {}",
                    gst.len(),
                    wst.len()
                ));
            }
            for (j, (g, w)) in gst.into_iter().zip(wst).enumerate() {
                p.expect(
                    &format!("fused_update {rule:?} {dtype}: slot {i} state {j}"),
                    &ins,
                    Ok(g),
                    Ok(w),
                    &tol,
                )?;
            }
        }
        Ok(())
    });
}
