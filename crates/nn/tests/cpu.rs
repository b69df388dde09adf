//! The CPU backend against the f64 reference: same weights, same Dropout masks, same conv
//! outputs and the same training trajectory from the same seeds; gradient checks of conv2d and
//! max_pool2d on the CPU.

mod common;

use common::*;
use kiln_autograd::{CheckOptions, Var, check_backward};
use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Generator, RandDist};
use kiln_nn::{Window, conv2d, max_pool2d};

fn cpu() -> <Cpu as Backend>::Device {
    Cpu::parse_device("cpu").unwrap()
}

#[test]
fn dropout_masks_are_the_same_on_every_backend() {
    let a = dropout_masks::<Cpu>(&cpu(), 3);
    let b = dropout_masks::<Reference>(&RefDevice(0), 3);
    assert_eq!(a, b);
    assert_ne!(a[0], a[1]);
}

#[test]
fn conv_net_forward_matches_the_reference() {
    // f64: only summation order differs; f32: the CPU's f32 rounding against exact math.
    assert_close(
        "f64",
        &forward::<Cpu>(&cpu(), DType::F64),
        &forward::<Reference>(&RefDevice(0), DType::F64),
        1e-12,
    );
    assert_close(
        "f32",
        &forward::<Cpu>(&cpu(), DType::F32),
        &forward::<Reference>(&RefDevice(0), DType::F32),
        1e-5,
    );
}

#[test]
fn transformer_layers_match_the_reference() {
    for training in [true, false] {
        for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4)] {
            let a = transformer_forward_backward::<Cpu>(&cpu(), dt, training);
            let b = transformer_forward_backward::<Reference>(&RefDevice(0), dt, training);
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert_close(&format!("{dt} training={training} #{i}"), a, b, tol);
            }
        }
    }
}

#[test]
fn training_trajectory_matches_the_reference() {
    let (la, wa) = trajectory::<Cpu>(&cpu());
    let (lb, wb) = trajectory::<Reference>(&RefDevice(0));
    assert_close("losses", &la, &lb, 1e-4);
    assert!(la[4] < la[0], "loss decreases: {la:?}");
    for (i, (a, b)) in wa.iter().zip(&wb).enumerate() {
        assert_close(&format!("param {i}"), a, b, 1e-4);
    }
}

#[test]
fn conv2d_and_max_pool2d_gradients_on_cpu() {
    let d = cpu();
    let r = |dims: &[usize], seed| {
        Generator::new(seed)
            .sample::<Cpu>(
                dims.to_vec(),
                RandDist::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
                DType::F64,
                &d,
            )
            .unwrap()
    };
    let w = Window::new(3).with_padding(1).with_stride(2);
    check_backward(
        |v: &[Var<Cpu>]| conv2d(&v[0], &v[1], Some(&v[2]), w),
        &[r(&[2, 3, 6, 5], 1), r(&[4, 3, 3, 3], 2), r(&[4], 3)],
        &CheckOptions::default(),
    )
    .unwrap();
    check_backward(
        |v: &[Var<Cpu>]| max_pool2d(&v[0], Window::new(2).with_stride(2)),
        &[r(&[2, 3, 6, 4], 4)],
        &CheckOptions::default(),
    )
    .unwrap();
}
