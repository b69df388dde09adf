//! A linear layer's and a matrix product's two gradient products run at once on the CUDA
//! backend (`Backend::concurrently`: the second on the device's side stream): the gradients
//! are the bits the same products give one after the other, the side stream was used, and the
//! work after the join (a `tanh` backward reading the input gradient) sees the finished
//! product. The gradient reaching the products is deferred (both read it: it must be computed
//! before the side stream starts), and the device runs behind the host, so that a missing
//! order shows as other bits. Small products stay on the current stream. `cargo xtask
//! test-gpu` carries this binary to the GPU.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

mod common;

use std::sync::Mutex;

use common::{assert_close, f64s, normal};
use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{Cuda, gpu_or_skip, set_concurrency, side_stream_runs};
use kiln_core::{Backend, DType, Tensor};

/// The switch and the counter are process-wide: the tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

/// The gradients of `tanh(x0) · wᵀ + b` and of `tanh(a0) · m` (batched `a0`, shared `m`)
/// under the weights `gy`, `gz`: `[dx0, dw, db, da0, dm]` as f64 vectors.
/// With `busy`, a long product is queued first, so that the device runs behind the host
/// through the whole backward pass: both streams then start their halves at the same moment,
/// where a missing order between them shows.
fn grads<B: Backend>(
    inputs: &[Tensor<B>; 6],
    gy: &Tensor<B>,
    gz: &Tensor<B>,
    busy: bool,
) -> Vec<Vec<f64>> {
    let _busy = busy.then(|| {
        let t = Tensor::<B>::ones([4096, 4096], DType::F32, gy.device()).unwrap();
        (0..4).map(|_| t.matmul(&t).unwrap()).collect::<Vec<_>>()
    });
    let [x0, w, b, a0, m, _] = inputs.clone().map(Var::param);
    // The gradients reaching the products are deferred (a scaling the CUDA backend records
    // and fuses later): realized only when a product reads them.
    let y = x0.tanh().unwrap().linear(&w, Some(&b)).unwrap();
    y.mul_scalar(1.5).unwrap().backward_with(gy).unwrap();
    let z = a0.tanh().unwrap().matmul(&m).unwrap();
    z.mul_scalar(0.75).unwrap().backward_with(gz).unwrap();
    [&x0, &w, &b, &a0, &m]
        .iter()
        .map(|v| f64s(&v.grad().expect("a gradient")))
        .collect()
}

/// Inputs large enough for the side stream (each product 3.2 or 2.1 GFLOP).
fn inputs<B: Backend>(dev: &B::Device) -> ([Tensor<B>; 6], Tensor<B>, Tensor<B>) {
    let t = |dims: &[usize], seed| normal::<B>(dims, seed, DType::F32, dev);
    (
        [
            t(&[4096, 512], 1),
            t(&[768, 512], 2),
            t(&[768], 3),
            t(&[8, 512, 256], 4),
            t(&[256, 1024], 5),
            t(&[1], 6),
        ],
        t(&[4096, 768], 7),
        t(&[8, 512, 1024], 8),
    )
}

#[test]
fn gradient_products_on_the_side_stream_equal_the_sequential_ones() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (xs, gy, gz) = inputs::<Cuda>(&dev);
    // Once first: every shape's GEMM choice is measured (gemm_tune) before the comparison.
    set_concurrency(false);
    let sequential = grads(&xs, &gy, &gz, true);
    // Three rounds, each after a run with other gradients, so that the blocks the concurrent
    // run gets back from the cache hold other numbers: a product reading one before it is
    // written then shows (without the realization before the fork: one round failed one run
    // in two on an H200, three rounds three runs in three).
    let other = |t: &Tensor<Cuda>| t.mul_scalar(-3.0).unwrap();
    let before = side_stream_runs();
    let mut concurrent = Vec::new();
    for _ in 0..3 {
        set_concurrency(false);
        grads(&xs, &other(&gy), &other(&gz), true);
        set_concurrency(true);
        concurrent.push(grads(&xs, &gy, &gz, true));
    }
    let ran = side_stream_runs() - before;
    set_concurrency(false);
    let again = grads(&xs, &gy, &gz, true);
    set_concurrency(true);
    assert_eq!(
        ran, 6,
        "the linear and the matmul backward each used the side stream once a round"
    );
    for (i, name) in ["dx0", "dw", "db", "da0", "dm"].iter().enumerate() {
        assert!(
            concurrent.iter().all(|c| c[i] == sequential[i]) && again[i] == sequential[i],
            "{name}: the concurrent products' bits differ from the sequential ones'"
        );
    }
    // And the values are right: against the CPU (f32, other summation orders).
    let host = |t: &Tensor<Cuda>| {
        let v: Vec<f32> = f64s(t).into_iter().map(|v| v as f32).collect();
        Tensor::<Cpu>::from_vec(v, t.dims().to_vec(), &Cpu::device(0)).unwrap()
    };
    let want = grads(&xs.each_ref().map(host), &host(&gy), &host(&gz), false);
    for (i, name) in ["dx0", "dw", "db", "da0", "dm"].iter().enumerate() {
        assert_close(name, &concurrent[0][i], &want[i], 2e-3);
    }
}

#[test]
fn small_products_stay_on_the_current_stream() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let x = Var::param(normal::<Cuda>(&[64, 100], 9, DType::F32, &dev));
    let w = Var::param(normal::<Cuda>(&[10, 100], 10, DType::F32, &dev));
    let before = side_stream_runs();
    let y = x.linear(&w, None).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert!(x.grad().is_some() && w.grad().is_some());
    assert_eq!(side_stream_runs(), before, "a 128 kFLOP pair forked");
}
