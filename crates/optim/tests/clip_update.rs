//! Gradient clipping's coefficient applied inside the optimizers' update (`Var::scale_grad`,
//! `Tensor::fused_update_scaled`) gives the update of multiplying every gradient first (the
//! bits on the reference and the CPU, within a few ulps on a GPU; the same generic code), for
//! AdamW and SGD with momentum over more parameters than one multi-tensor launch takes; on
//! the GPU without a launch per gradient. Without a GPU the CUDA test prints `skipped: no
//! CUDA device ...`.

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip, thread_launches};
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Generator, RandDist};
use kiln_optim::{AdamWConfig, Optimizer, SgdConfig, clip_grad_norm};

/// 30 parameters of 1 to 3,000 elements with gradients (the first with a norm far above 1, so
/// clipping scales), the same values on every call.
fn params<B: Backend>(dev: &B::Device) -> Vec<Var<B>> {
    let mut g = Generator::new(5);
    let normal = RandDist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    (0..30)
        .map(|i| {
            let n = [1, 7, 384, 3000][i % 4];
            let p = Var::param(g.sample::<B>([n], normal, DType::F32, dev).unwrap());
            let grad = g.sample::<B>([n], normal, DType::F32, dev).unwrap();
            p.set_grad(Some(grad)).unwrap();
            p
        })
        .collect()
}

fn values<B: Backend>(ps: &[Var<B>]) -> Vec<f32> {
    ps.iter()
        .flat_map(|p| p.tensor().to_vec::<f32>().unwrap())
        .collect()
}

/// Two steps of `make`'s optimizer after clipping at 1.0, with the coefficient left to the
/// update and with every gradient multiplied first (`set_grad` of the clipped gradient):
/// the same parameters, bit for bit where the update is evaluated op for op (`ulps` 0: the
/// reference, the CPU), and within `ulps` units in the last place on a GPU, whose update
/// kernels let NVRTC contract a multiply and an add (the gradient's product with the factor
/// may fuse into the add after it; a wrong factor would be off by far more).
fn clipped_steps_agree<B: Backend>(
    dev: &B::Device,
    ulps: f32,
    make: &dyn Fn(Vec<Var<B>>) -> Box<dyn Optimizer<B>>,
) {
    let (folded, first) = (params::<B>(dev), params::<B>(dev));
    let (mut a, mut b) = (make(folded.clone()), make(first.clone()));
    for step in 0..2 {
        if step == 1 {
            for ps in [&folded, &first] {
                for (p, q) in ps.iter().zip(params::<B>(dev)) {
                    p.set_grad(q.grad()).unwrap();
                }
            }
        }
        clip_grad_norm(&folded, 1.0).unwrap();
        assert!(
            folded[0].grad_parts().unwrap().1.is_some(),
            "the factor is left to the update"
        );
        a.step().unwrap();
        clip_grad_norm(&first, 1.0).unwrap();
        for p in &first {
            p.set_grad(p.grad()).unwrap();
        }
        assert!(first[0].grad_parts().unwrap().1.is_none());
        b.step().unwrap();
        let (a, b) = (values(&folded), values(&first));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / (y.abs().max(1.0) * f32::EPSILON))
            .fold(0.0f32, f32::max);
        assert!(
            worst <= ulps,
            "{} step {step}: {worst} ulps apart (allowed {ulps})",
            B::NAME
        );
    }
}

fn all_rules<B: Backend>(dev: &B::Device, ulps: f32) {
    clipped_steps_agree::<B>(dev, ulps, &|ps| {
        Box::new(
            AdamWConfig::new(1e-2)
                .with_weight_decay(0.1)
                .init(ps)
                .unwrap(),
        )
    });
    clipped_steps_agree::<B>(dev, ulps, &|ps| {
        Box::new(
            SgdConfig::new(0.1)
                .with_momentum(0.9)
                .with_nesterov(true)
                .init(ps)
                .unwrap(),
        )
    });
}

#[test]
fn reference() {
    all_rules::<Reference>(&RefDevice(0), 0.0);
}

#[test]
fn cpu() {
    all_rules::<Cpu>(&Cpu::device(0), 0.0);
}

#[test]
fn cuda() {
    let Some(dev) = gpu_or_skip(0) else { return };
    all_rules::<Cuda>(&dev, 8.0);
    // The step after clipping launches no multiply per gradient: the 30 gradients' update
    // (two multi-tensor launches at 24 tensors a launch) and the coefficient's cast.
    let ps = params::<Cuda>(&dev);
    let mut opt = AdamWConfig::new(1e-2).init(ps.clone()).unwrap();
    clip_grad_norm(&ps, 1.0).unwrap();
    let before = thread_launches();
    opt.step().unwrap();
    let launched = thread_launches() - before;
    assert!(launched <= 4, "{launched} launches for the clipped step");
}
