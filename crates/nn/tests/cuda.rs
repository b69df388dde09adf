//! CUDA against the CPU: the same seed gives the same weights, Dropout masks, conv outputs,
//! training trajectory and multi-head attention on the GPU (Philox is bit-identical on both;
//! the math differs only by summation order). Without a GPU every test prints `skipped: no CUDA device 0 (<reason>)`.

mod common;

use common::*;
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip};
use kiln_core::{Backend, DType};
use kiln_nn::{Module, ModuleExt};

fn cpu() -> <Cpu as Backend>::Device {
    Cpu::parse_device("cpu").unwrap()
}

#[test]
fn dropout_masks_match_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    assert_eq!(
        dropout_masks::<Cuda>(&dev, 3),
        dropout_masks::<Cpu>(&cpu(), 3)
    );
}

#[test]
fn conv_net_forward_matches_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        assert_close(
            &format!("{dt}"),
            &forward::<Cuda>(&dev, dt),
            &forward::<Cpu>(&cpu(), dt),
            tol,
        );
    }
}

#[test]
fn transformer_layers_match_the_cpu() {
    // Embedding, LayerNorm (with and without bias), RMSNorm, the tanh GELU and Dropout in
    // training and eval mode: outputs and every parameter's gradient.
    let Some(dev) = gpu_or_skip(0) else { return };
    for training in [true, false] {
        for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4)] {
            let a = transformer_forward_backward::<Cuda>(&dev, dt, training);
            let b = transformer_forward_backward::<Cpu>(&cpu(), dt, training);
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert_close(&format!("{dt} training={training} #{i}"), a, b, tol);
            }
        }
    }
}

#[test]
fn training_trajectory_matches_the_cpu() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let (la, wa) = trajectory::<Cuda>(&dev);
    let (lb, wb) = trajectory::<Cpu>(&cpu());
    assert_close("losses", &la, &lb, 1e-4);
    for (i, (a, b)) in wa.iter().zip(&wb).enumerate() {
        assert_close(&format!("param {i}"), a, b, 1e-4);
    }
}

#[test]
fn a_model_moves_between_backends_through_safetensors() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let g = small_net::<Cuda>(&dev, DType::F32);
    let c = small_net::<Cpu>(&cpu(), DType::F32);
    // Perturb the GPU model so the load is visible, then carry it to the CPU model by file.
    let p = g.parameters()[0].clone();
    p.set_tensor(p.tensor().mul_scalar(2.0).unwrap()).unwrap();
    let path =
        std::env::temp_dir().join(format!("kiln_nn_cuda_{}.safetensors", std::process::id()));
    g.save(&path).unwrap();
    c.load(&path).unwrap();
    for ((n, a), (_, b)) in g.state_dict().iter().zip(c.state_dict().iter()) {
        assert_eq!(host(a), host(b), "{n}");
    }
}

/// Multi-head attention (4 heads of 16, T = 37, causal and not; self-attention through the
/// packed node, cross-attention through three projections) in f32: the output and the
/// gradients of the inputs and of every parameter.
fn mha_forward_backward<B: Backend>(dev: &B::Device, causal: bool, cross: bool) -> Vec<Vec<f64>> {
    use kiln_autograd::AttnMask;
    use kiln_core::Generator;
    let mut g = Generator::new(31);
    let m = kiln_nn::MultiheadAttentionConfig::new(64, 4)
        .init::<B>(dev, &mut g)
        .unwrap();
    let draw = |g: &mut Generator, dims: [usize; 3]| {
        kiln_autograd::Var::param(g.uniform::<B>(dims, -1.0, 1.0, dev).unwrap())
    };
    let x = draw(&mut g, [2, 37, 64]);
    let kv = if cross {
        draw(&mut g, [2, 29, 64])
    } else {
        x.clone()
    };
    let seed = g.uniform::<B>([2, 37, 64], -1.0, 1.0, dev).unwrap();
    let mask = if causal {
        AttnMask::Causal
    } else {
        AttnMask::None
    };
    let y = m.forward_qkv(&x, &kv, &kv, &mask).unwrap();
    y.backward_with(&seed).unwrap();
    let mut out = vec![host(&y.tensor()), host(&x.grad().unwrap())];
    if cross {
        out.push(host(&kv.grad().unwrap()));
    }
    for (_, p) in m.named_parameters() {
        out.push(host(&p.grad().unwrap()));
    }
    out
}

#[test]
fn multihead_attention_matches_the_cpu() {
    // On the GPU self-attention takes the fused kernels over the packed projection (heads-last
    // output, one gradient buffer); the CPU composes. Cross-attention fuses too.
    let Some(dev) = gpu_or_skip(0) else { return };
    for causal in [false, true] {
        for cross in [false, true] {
            let a = mha_forward_backward::<Cuda>(&dev, causal, cross);
            let b = mha_forward_backward::<Cpu>(&cpu(), causal, cross);
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert_close(&format!("causal {causal} cross {cross} #{i}"), a, b, 1e-4);
            }
        }
    }
}
