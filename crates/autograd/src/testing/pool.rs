//! Average pooling: `avg_pool2d` (kernel, stride, padding, `count_include_pad`) and
//! `adaptive_avg_pool2d` (outputs that divide the input, which take the one-mean road, and
//! outputs that do not, which take the two-GEMM road).

use super::*;

pub(super) fn pool_cases<B: Backend>() -> Vec<(String, Case<B>)> {
    let mut c: Vec<(String, Case<B>)> = Vec::new();
    c.push((
        "pool/avg_pool2d".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (
                input_of(vec(1usize..=6, 4)),
                vec(1usize..=3, 2),
                vec(1usize..=3, 2),
                vec(0usize..=1, 2),
                any::<bool>(),
            );
            prop(cfg, s, |(mut x, k, st, p, include_pad)| {
                let kernel = [k[0], k[1]];
                let padding = [p[0].min(k[0] / 2), p[1].min(k[1] / 2)];
                x.dims[0] = x.dims[0].min(2);
                x.dims[2] = x.dims[2].max(kernel[0]);
                x.dims[3] = x.dims[3].max(kernel[1]);
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].avg_pool2d(kernel, [st[0], st[1]], padding, include_pad)
                })
            })
        }),
    ));
    c.push((
        "pool/adaptive_avg_pool2d".into(),
        Box::new(|dev: &B::Device, cfg: &SuiteConfig| {
            let s = (input_of(vec(1usize..=7, 4)), vec(1usize..=4, 2));
            prop(cfg, s, |(mut x, out)| {
                x.dims[0] = x.dims[0].min(2);
                check(cfg, &[x.build::<B>(Vals::Normal, dev)?], |v| {
                    v[0].adaptive_avg_pool2d([out[0], out[1]])
                })
            })
        }),
    ));
    c
}
