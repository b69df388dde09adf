//! The measured choice between cuDNN and im2col (`conv_route.rs`): a stem-like shape (3 input
//! channels) is measured once and then served by the winner, and whichever path wins, the
//! output and the gradients of input, weight and bias equal both paths'; a ResNet-sized shape
//! (576 taps) is never measured; with routing off nothing is; under autocast the routed
//! convolution still runs in the low dtype.
//!
//! Without a GPU every test prints `skipped: no CUDA device 0 (<reason>)`.

use std::sync::Mutex;

use kiln_autograd::{Var, autocast};
use kiln_backend_cuda::{Cuda, CudaDevice, gpu_or_skip};
use kiln_core::testing::check_close;
use kiln_core::{DType, Generator, Tensor};
use kiln_nn::{Window, conv_routes_measured, conv2d, conv2d_im2col_path, set_conv_routing};

/// Routing and its table are process-wide: each test holds this.
static ROUTE: Mutex<()> = Mutex::new(());

fn window() -> Window {
    Window {
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
    }
}

/// Output and gradients of `sum(conv(x, w) * r)`, routed or by one named path.
fn run(dev: &CudaDevice, x: [usize; 4], oc: usize, path: &str) -> [Vec<f64>; 3] {
    let mut g = Generator::new(7);
    let xt = g.normal::<Cuda>(x, 0.0, 1.0, dev).unwrap();
    let wt = g.normal::<Cuda>([oc, x[1], 3, 3], 0.0, 0.3, dev).unwrap();
    let r = g
        .normal::<Cuda>([x[0], oc, x[2], x[3]], 0.0, 1.0, dev)
        .unwrap();
    let (xv, wv) = (Var::param(xt), Var::param(wt));
    let y = match path {
        "routed" => conv2d(&xv, &wv, None, window()),
        "im2col" => conv2d_im2col_path(&xv, &wv, None, window(), 1),
        _ => xv
            .conv2d_native(
                &wv,
                kiln_core::Conv2dSpec {
                    stride: [1, 1],
                    padding: [1, 1],
                    dilation: [1, 1],
                    groups: 1,
                },
            )
            .map(|y| y.expect("cuDNN offered")),
    }
    .unwrap();
    y.mul(&Var::constant(r))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let host = |t: Tensor<Cuda>| t.to_f64_vec().unwrap();
    [
        host(y.tensor()),
        host(xv.grad().unwrap()),
        host(wv.grad().unwrap()),
    ]
}

fn gpu_with_cudnn() -> Option<CudaDevice> {
    let dev = gpu_or_skip(0)?;
    if let Err(why) = kiln_backend_cuda::cudnn_version() {
        eprintln!("skipped: cuDNN is unusable ({why}), so nothing is routed");
        return None;
    }
    Some(dev)
}

#[test]
fn a_stem_shape_is_measured_once_and_both_paths_agree() {
    let _one = ROUTE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu_with_cudnn() else { return };
    kiln_backend_cuda::set_allow_tf32(false);
    set_conv_routing(true);
    let shape = [4, 3, 16, 16];
    let before = conv_routes_measured();
    let routed = run(&dev, shape, 16, "routed");
    assert_eq!(
        conv_routes_measured(),
        before + 1,
        "the stem shape was not measured"
    );
    let again = run(&dev, shape, 16, "routed");
    assert_eq!(
        conv_routes_measured(),
        before + 1,
        "the same shape was measured twice"
    );
    let lib = run(&dev, shape, 16, "cudnn");
    let own = run(&dev, shape, 16, "im2col");
    for (k, what) in ["output", "input grad", "weight grad"].iter().enumerate() {
        check_close(&routed[k], &lib[k], 1e-4, 1e-4)
            .unwrap_or_else(|e| panic!("{what} vs cuDNN: {e}"));
        check_close(&routed[k], &own[k], 1e-4, 1e-4)
            .unwrap_or_else(|e| panic!("{what} vs im2col: {e}"));
        // The same path again: equal but for atomics (im2col's scatter-add, some library
        // algorithms), which reorder sums.
        check_close(&again[k], &routed[k], 1e-5, 1e-5)
            .unwrap_or_else(|e| panic!("{what}: the second routed run differs: {e}"));
    }
}

#[test]
fn a_resnet_shape_and_routing_off_measure_nothing() {
    let _one = ROUTE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu_with_cudnn() else { return };
    set_conv_routing(true);
    let before = conv_routes_measured();
    run(&dev, [2, 64, 8, 8], 64, "routed");
    assert_eq!(
        conv_routes_measured(),
        before,
        "a 576-tap shape was measured"
    );
    set_conv_routing(false);
    run(&dev, [2, 3, 12, 12], 8, "routed");
    assert_eq!(
        conv_routes_measured(),
        before,
        "routing off, yet a shape was measured"
    );
    set_conv_routing(true);
}

#[test]
fn under_autocast_a_routed_convolution_runs_in_the_low_dtype() {
    let _one = ROUTE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = gpu_with_cudnn() else { return };
    set_conv_routing(true);
    let x = Var::param(Tensor::<Cuda>::ones([2, 3, 10, 10], DType::F32, &dev).unwrap());
    let w = Var::param(Tensor::<Cuda>::ones([8, 3, 3, 3], DType::F32, &dev).unwrap());
    let y = {
        let _amp = autocast(DType::BF16).unwrap();
        conv2d(&x, &w, None, window()).unwrap()
    };
    assert_eq!(y.dtype(), DType::BF16);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
}
