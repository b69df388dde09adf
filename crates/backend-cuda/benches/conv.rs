//! Convolutions (issue 33: "convolutions at cuDNN speed"): a 3×3, padding-1 convolution
//! forward and backward (gradients of input and weight, no bias), f32 with TF32 off, for three
//! ResNet-sized layers; kiln-nn's `conv2d` (cuDNN when the backend can load it), then the same
//! with cuDNN refused (`set_cudnn(false)`, what `KILN_CUDNN=0` does: kiln's im2col path) as
//! `_im2col` rows. `bench/gpu_torch.py` times PyTorch's twin (`cudnn.benchmark = True`).
//! Then tensor-core rows: TF32 and bf16, with cuDNN's layout forced to NCHW, forced to NHWC
//! (operands transposed, transposes included) and `auto` (`_tf32_nchw`, `_bf16_nhwc`, ...).
//! Then the same layers through cuDNN's graph API (`set_cudnn_api(Graph)`, what
//! `KILN_CUDNN_API=graph` does) in f32, TF32 and bf16 (`_f32_graph`, `_tf32_graph`, ...), to
//! compare with the legacy API's rows above.
//! Device time from CUDA events, median of 5; prints `BENCH kiln <name> <value> ms` lines.
//!
//! Without a GPU it prints `skipped: no CUDA device (...)` and exits 0.

mod common;
use common::{report, time};

use kiln_autograd::Var;
use kiln_backend_cuda::{Cuda, CudaDevice, set_allow_tf32, try_gpu, unavailable_reason};
use kiln_backend_cuda::{CudnnApi, CudnnLayout, set_cudnn_api, set_cudnn_layout};
use kiln_core::{DType, Generator, Result, Tensor};
use kiln_nn::{Window, conv2d};

/// (batch, in channels, out channels, side) of each layer.
const LAYERS: &[(usize, usize, usize, usize)] =
    &[(64, 64, 64, 32), (128, 128, 128, 16), (32, 3, 64, 32)];

/// Median ms of one forward + backward of a 3×3 padding-1 convolution.
fn fwd_bwd(dev: &CudaDevice, (n, c, oc, s): (usize, usize, usize, usize), dt: DType) -> f64 {
    let t = |shape: &[usize], seed| -> Tensor<Cuda> {
        Generator::new(seed)
            .uniform::<Cuda>(shape, -1.0, 1.0, dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    let x = Var::param(t(&[n, c, s, s], 1));
    let w = Var::param(t(&[oc, c, 3, 3], 2));
    let gy = t(&[n, oc, s, s], 3);
    let window = Window::new(3).with_padding(1);
    time(dev, 5, 10, || -> Result<()> {
        let y = conv2d(&x, &w, None, window)?;
        y.backward_with(&gy)?;
        // What an optimizer does each step (gradients would accumulate otherwise).
        x.zero_grad();
        w.zero_grad();
        Ok(())
    })
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test` runs benches as tests: nothing to do
    }
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return;
    };
    set_allow_tf32(false);
    println!("kiln device: {}", dev.name().unwrap());
    match kiln_backend_cuda::cudnn_version() {
        Ok(v) => println!("kiln cuDNN: {v}"),
        Err(why) => println!("kiln cuDNN: unusable ({why}): the conv rows are the im2col path"),
    }
    for (tag, on) in [("", true), ("_im2col", false)] {
        kiln_backend_cuda::set_cudnn(on);
        for &l @ (n, c, _, s) in LAYERS {
            let name = format!("conv3x3_b{n}_c{c}_{s}_fwdbwd{tag}");
            report(&name, fwd_bwd(&dev, l, DType::F32), "ms");
        }
    }
    kiln_backend_cuda::set_cudnn(true);
    for (prec, dt) in [("tf32", DType::F32), ("bf16", DType::BF16)] {
        set_allow_tf32(prec == "tf32");
        for (tag, layout) in [
            ("nchw", CudnnLayout::Nchw),
            ("nhwc", CudnnLayout::Nhwc),
            ("auto", CudnnLayout::Auto),
        ] {
            set_cudnn_layout(layout);
            for &l @ (n, c, _, s) in LAYERS {
                let name = format!("conv3x3_b{n}_c{c}_{s}_fwdbwd_{prec}_{tag}");
                report(&name, fwd_bwd(&dev, l, dt), "ms");
            }
        }
    }
    set_cudnn_layout(CudnnLayout::Nchw);
    set_cudnn_api(CudnnApi::Graph);
    for (prec, dt) in [
        ("f32", DType::F32),
        ("tf32", DType::F32),
        ("bf16", DType::BF16),
    ] {
        set_allow_tf32(prec == "tf32");
        let before = kiln_backend_cuda::cudnn_graph_calls();
        for &l @ (n, c, _, s) in LAYERS {
            let name = format!("conv3x3_b{n}_c{c}_{s}_fwdbwd_{prec}_graph");
            report(&name, fwd_bwd(&dev, l, dt), "ms");
        }
        let calls = kiln_backend_cuda::cudnn_graph_calls() - before;
        println!("kiln conv {prec}: {calls} calls through the cuDNN graph API");
    }
    set_cudnn_api(CudnnApi::Legacy);
    set_cudnn_layout(CudnnLayout::Auto);
    set_allow_tf32(false);
}
