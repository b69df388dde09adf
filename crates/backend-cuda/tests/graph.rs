//! CUDA graphs on a real GPU: replays see new static inputs, a captured SGD step trains like
//! the eager one, the graph's memory is private, and what a capture cannot record is refused
//! with a typed error that leaves the device usable.
//!
//! Without a GPU each test prints `skipped: no CUDA device 0 (<reason>)` and returns.

use kiln_autograd::Var;
use kiln_backend_cuda::{Cuda, CudaDevice, CudaGraph, gpu_or_skip, write_static};
use kiln_core::{DType, Error, Generator, RandDist, Reduction, Tensor};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{LinearConfig, Module, Relu, Sequential};
use kiln_optim::{AdamConfig, Optimizer, SgdConfig};

const F32: DType = DType::F32;

fn ramp(n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| ((i % 97) as f32 - 40.0) * scale).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn replays_read_new_static_inputs() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let w = Tensor::<Cuda>::from_vec(ramp(64 * 32, 0.01), [64, 32], &dev).unwrap();
    let x = Tensor::<Cuda>::zeros([16, 64], F32, &dev).unwrap();
    // A matmul, then a fused elementwise tail (deferred, so forced at the capture's end).
    let (graph, y) = CudaGraph::capture(&dev, || {
        x.matmul(&w)?.relu()?.mul_scalar(2.0)?.add_scalar(1.0)
    })
    .unwrap();
    assert!(graph.node_count() >= 2, "{graph:?}");
    for step in 0..3 {
        let host = ramp(16 * 64, 0.1 * (step + 1) as f32);
        let xs = Tensor::<Cuda>::from_vec(host.clone(), [16, 64], &dev).unwrap();
        write_static(&x, &xs).unwrap();
        graph.replay().unwrap();
        let got = y.to_vec::<f32>().unwrap();
        let want = xs
            .matmul(&w)
            .and_then(|t| t.relu())
            .and_then(|t| t.mul_scalar(2.0))
            .and_then(|t| t.add_scalar(1.0))
            .and_then(|t| t.to_vec::<f32>())
            .unwrap();
        assert!(
            max_diff(&got, &want) < 1e-4,
            "step {step}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn memory_of_a_graph_is_not_handed_out_after_the_capture() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let n = 1 << 16;
    let x = Tensor::<Cuda>::from_vec(ramp(n, 1.0), [n], &dev).unwrap();
    let (graph, y) = CudaGraph::capture(&dev, || {
        // A temporary freed inside the capture: its block is written by every replay.
        let t = x.exp()?;
        t.realize()?;
        t.add_scalar(1.0)?.sum_all()
    })
    .unwrap();
    // Eager allocations of the temporary's size after the capture must get other blocks.
    let others: Vec<Tensor<Cuda>> = (0..8)
        .map(|i| Tensor::<Cuda>::full([n], i as f64, F32, &dev).unwrap())
        .collect();
    for o in &others {
        o.realize().unwrap();
    }
    graph.replay().unwrap();
    graph.replay().unwrap();
    for (i, o) in others.iter().enumerate() {
        let v = o.to_vec::<f32>().unwrap();
        assert!(
            v.iter().all(|&e| e == i as f32),
            "tensor {i} allocated after the capture was overwritten by a replay"
        );
    }
    let want: f64 = ramp(n, 1.0).iter().map(|&v| (v as f64).exp() + 1.0).sum();
    let got = y.to_scalar().unwrap();
    assert!(((got - want) / want).abs() < 1e-4, "{got} vs {want}");
    assert!(graph.memory_bytes() > 0);
}

fn mlp(dev: &CudaDevice) -> Sequential<Cuda> {
    let widths = [64, 48, 32, 10];
    let mut g = Generator::new(3);
    let mut m = Sequential::new();
    for i in 0..3 {
        m = m.add(
            LinearConfig::new(widths[i], widths[i + 1])
                .init::<Cuda>(dev, &mut g)
                .unwrap(),
        );
        if i < 2 {
            m = m.add(Relu);
        }
    }
    m
}

#[test]
fn a_captured_sgd_step_trains_like_the_eager_one() {
    let Some(dev) = gpu_or_skip(0) else { return };
    captured_step_trains_like_the_eager_one(&dev, None, 1e-5);
}

/// The mixed-precision issue: a step under `autocast(bf16)` (matmuls in bf16, the loss in
/// f32, f32 parameters) captured in a graph replays as the eager step computes.
#[test]
fn a_captured_autocast_bf16_step_trains_like_the_eager_one() {
    let Some(dev) = gpu_or_skip(0) else { return };
    captured_step_trains_like_the_eager_one(&dev, Some(DType::BF16), 1e-3);
}

/// Trains two copies of one MLP, one eagerly and one by replaying a captured step, with
/// autocast to `amp` when given, and checks the losses and parameters agree within `tol`.
fn captured_step_trains_like_the_eager_one(dev: &CudaDevice, amp: Option<DType>, tol: f64) {
    let dev = *dev;
    let batch = 32;
    let x =
        Var::constant(Tensor::<Cuda>::from_vec(ramp(batch * 64, 0.02), [batch, 64], &dev).unwrap());
    let labels: Vec<i64> = (0..batch).map(|i| (i * 7 % 10) as i64).collect();
    let y = Tensor::<Cuda>::from_vec(labels, [batch], &dev).unwrap();
    let (eager, captured) = (mlp(&dev), mlp(&dev));
    let sgd = SgdConfig::new(0.05).with_momentum(0.9);
    let mut opt_e = sgd.init(eager.parameters()).unwrap();
    let mut opt_c = sgd.init(captured.parameters()).unwrap();
    let step = |m: &Sequential<Cuda>, o: &mut dyn Optimizer<Cuda>| {
        let _amp = amp.map(kiln_autograd::autocast).transpose()?;
        let loss = cross_entropy(&m.forward(&x)?, &y, Reduction::Mean)?;
        o.zero_grad();
        loss.backward()?;
        o.step()?;
        Ok::<_, Error>(loss.tensor())
    };
    // The first momentum step cannot be captured (it initializes the buffers): refused.
    let first = CudaGraph::capture(&dev, || step(&captured, &mut opt_c));
    assert!(
        matches!(&first, Err(e) if e.to_string().contains("first momentum step")),
        "{first:?}"
    );
    // Both take the warm-up step eagerly (the refused capture changed nothing).
    let le = step(&eager, &mut opt_e).unwrap().to_scalar().unwrap();
    let lc = step(&captured, &mut opt_c).unwrap().to_scalar().unwrap();
    assert_eq!(le, lc, "the refused capture changed the model");
    let (graph, loss) = CudaGraph::capture(&dev, || step(&captured, &mut opt_c)).unwrap();
    let mut losses = Vec::new();
    for i in 0..6 {
        let le = step(&eager, &mut opt_e).unwrap().to_scalar().unwrap();
        graph.replay().unwrap();
        let lc = loss.to_scalar().unwrap();
        assert!(
            (le - lc).abs() <= tol * le.abs().max(1.0),
            "step {i}: eager {le}, graph {lc}"
        );
        losses.push(lc);
    }
    assert!(
        losses[5] < losses[0],
        "the replays do not train: {losses:?}"
    );
    for (pe, pc) in eager.parameters().iter().zip(captured.parameters()) {
        let (a, b) = (
            pe.tensor().to_vec::<f32>().unwrap(),
            pc.tensor().to_vec::<f32>().unwrap(),
        );
        assert!(
            (max_diff(&a, &b) as f64) < tol,
            "parameters differ by {}",
            max_diff(&a, &b)
        );
    }
}

#[test]
fn what_a_capture_cannot_record_is_refused_and_the_device_stays_usable() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Tensor::<Cuda>::from_vec(ramp(1024, 0.5), [32, 32], &dev).unwrap();
    let usable = || {
        let v = x.narrow(0, 0, 1).unwrap().add_scalar(1.0).unwrap();
        assert_eq!(v.to_vec::<f32>().unwrap()[0], ramp(1, 0.5)[0] + 1.0);
    };
    let refused = |r: kiln_core::Result<()>, what: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains("CUDA graph"), "{what}: {e}");
        usable();
    };
    refused(
        CudaGraph::capture(&dev, || x.exp()?.to_vec::<f32>().map(|_| ())).map(|_| ()),
        "a copy to the host",
    );
    refused(
        CudaGraph::capture(&dev, || {
            Tensor::<Cuda>::from_vec(vec![1.0f32; 4], [4], &dev).map(|_| ())
        })
        .map(|_| ()),
        "a copy from the host",
    );
    refused(
        CudaGraph::capture(&dev, || kiln_backend_cuda::synchronize(&dev)).map(|_| ()),
        "a device synchronization",
    );
    refused(
        CudaGraph::capture(&dev, || {
            Generator::new(1)
                .sample::<Cuda>(
                    [4],
                    RandDist::Uniform {
                        low: 0.0,
                        high: 1.0,
                    },
                    F32,
                    &dev,
                )
                .map(|_| ())
        })
        .map(|_| ()),
        "random numbers",
    );
    // An ordinary error inside the closure ends the capture and comes back as it was.
    let bad = CudaGraph::capture(&dev, || {
        x.matmul(&Tensor::<Cuda>::zeros([3, 3], F32, &dev)?)
    });
    assert!(matches!(bad, Err(Error::ShapeMismatch { .. })), "{bad:?}");
    usable();
    // Adam's bias correction would freeze: refused.
    let m = mlp(&dev);
    let mut adam = AdamConfig::new(1e-3).init(m.parameters()).unwrap();
    let xin = Var::constant(Tensor::<Cuda>::zeros([4, 64], F32, &dev).unwrap());
    let r = CudaGraph::capture(&dev, || {
        let out = m.forward(&xin)?.sum_all()?;
        adam.zero_grad();
        out.backward()?;
        adam.step()
    });
    assert!(
        matches!(&r, Err(e) if e.to_string().contains("Adam")),
        "{r:?}"
    );
    usable();
    // A strided view cannot be written in place; a contiguous part can.
    let e = write_static(&x.t().unwrap(), &x);
    assert!(e.is_err(), "a transposed destination was accepted");
    let top = x.narrow(0, 16, 16).unwrap();
    write_static(&top, &x.narrow(0, 0, 16).unwrap()).unwrap();
    let v = x.to_vec::<f32>().unwrap();
    assert_eq!(
        v[16 * 32..],
        v[..16 * 32],
        "rows 0..16 copied onto rows 16..32"
    );
    // Captures do not nest.
    let nested = CudaGraph::capture(&dev, || CudaGraph::capture(&dev, || x.exp()).map(|_| ()));
    assert!(
        matches!(&nested, Err(e) if e.to_string().contains("nest")),
        "{nested:?}"
    );
    usable();
}

#[test]
fn the_profiler_records_a_capture_and_times_each_replay() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Tensor::<Cuda>::from_vec(ramp(1 << 20, 0.001), [1024, 1024], &dev).unwrap();
    let (r, p) = kiln_core::profile::profile(|| {
        let (graph, y) = CudaGraph::capture(&dev, || x.matmul(&x)?.exp()?.sum_all())?;
        graph.replay()?;
        graph.replay()?;
        let v = y.to_scalar()?;
        Ok::<_, Error>(v)
    });
    assert!(r.unwrap().is_finite());
    let replays: Vec<_> = p
        .records()
        .iter()
        .filter(|r| r.name == "cuda graph")
        .collect();
    assert_eq!(replays.len(), 2, "{p}");
    // Both replays are timed on the device (the first two launches of a name always are), and
    // each covers at least the 1024³ matmul it replays.
    for r in &replays {
        let d = r.device_time.expect("a replay has device time");
        assert!(d.dur_ns > 1_000, "{r:?}");
    }
    // The captured launches are recorded on the host, without device time (they ran later).
    let captured = p
        .records()
        .iter()
        .filter(|r| r.name != "cuda graph" && matches!(r.kind, kiln_core::profile::Kind::Launch(_)))
        .count();
    assert!(captured >= 2, "{p}");
}

#[test]
fn a_graph_dropped_while_another_is_captured_does_not_spoil_the_capture() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Tensor::<Cuda>::from_vec(ramp(4096, 0.01), [64, 64], &dev).unwrap();
    let (g1, y1) = CudaGraph::capture(&dev, || x.matmul(&x)).unwrap();
    g1.replay().unwrap();
    let want = x
        .matmul(&x)
        .unwrap()
        .add_scalar(1.0)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    // Dropping the first graph and its output inside the second capture would wait for the
    // device (its memory goes back to the driver), which a capture cannot do: deferred.
    let (g2, y2) = CudaGraph::capture(&dev, || {
        drop(g1);
        drop(y1);
        x.matmul(&x)?.add_scalar(1.0)
    })
    .unwrap();
    g2.replay().unwrap();
    assert!(max_diff(&y2.to_vec::<f32>().unwrap(), &want) < 1e-3);
}

#[test]
fn a_panic_inside_a_capture_leaves_the_thread_and_device_usable() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let x = Tensor::<Cuda>::from_vec(ramp(1024, 0.5), [1024], &dev).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = CudaGraph::capture(&dev, || -> kiln_core::Result<()> {
            let _y = x.exp()?;
            panic!("a user's bug inside the step");
        });
    }));
    assert!(r.is_err());
    // The thread is no longer capturing: eager work runs and reads back, and a new capture
    // works.
    let v = x.add_scalar(1.0).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(v[0], ramp(1, 0.5)[0] + 1.0);
    let (g, y) = CudaGraph::capture(&dev, || x.mul_scalar(2.0)).unwrap();
    g.replay().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap()[1], ramp(2, 0.5)[1] * 2.0);
}
