//! DDP and Chainer-style data parallelism on the CPU, ranks as threads ([`LocalGroup`]): the
//! parameters after a few steps on 2 ranks match one rank with the same global batch; no_sync
//! accumulates; a parameter without a gradient and a rank that leaves are errors, not hangs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_autograd::Var;
use kiln_backend_cpu::{Cpu, CpuDevice};
use kiln_core::testing::check_close;
use kiln_core::{DType, DistErrorKind, Generator, Reduction, Result, Tensor};
use kiln_dist::{
    Ddp, LocalGroup, ProcessGroup, ReduceOp, accumulate_grads_from, copy_parameters_from,
    scale_grads,
};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{LinearConfig, Module, Relu, Sequential};
use kiln_optim::{Optimizer, SgdConfig};

type B = Cpu;

fn dev() -> CpuDevice {
    CpuDevice::new(0).unwrap()
}

fn model(seed: u64) -> Sequential<B> {
    let mut g = Generator::new(seed);
    Sequential::new()
        .add(LinearConfig::new(12, 16).init::<B>(&dev(), &mut g).unwrap())
        .add(Relu)
        .add(LinearConfig::new(16, 5).init::<B>(&dev(), &mut g).unwrap())
}

/// A fixed global batch of `n` samples.
fn batch(step: u64, n: usize) -> (Tensor<B>, Tensor<B>) {
    let x = Generator::new(100 + step)
        .randn::<B>([n, 12], &dev())
        .unwrap();
    let y: Vec<i64> = (0..n).map(|i| ((i as u64 * 7 + step) % 5) as i64).collect();
    (x, Tensor::from_slice(&y, [n], &dev()).unwrap())
}

fn params(m: &Sequential<B>) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| p.tensor().to_vec::<f32>().unwrap())
        .collect()
}

fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], rtol: f32) {
    for (x, y) in a.iter().zip(b) {
        let wide = |v: &[f32]| v.iter().map(|&u| u as f64).collect::<Vec<_>>();
        let rtol = rtol as f64;
        if let Err(e) = check_close(&wide(x), &wide(y), rtol * 1e-3, rtol) {
            panic!("{e} (rtol {rtol})");
        }
    }
}

const STEPS: u64 = 5;
const GLOBAL: usize = 32;

fn single_rank() -> Vec<Vec<f32>> {
    let m = model(1);
    let mut opt = SgdConfig::new(0.1).init(m.parameters()).unwrap();
    for s in 0..STEPS {
        let (x, y) = batch(s, GLOBAL);
        opt.zero_grad();
        let loss =
            cross_entropy(&m.forward(&Var::constant(x)).unwrap(), &y, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
    params(&m)
}

#[test]
fn two_rank_ddp_matches_one_rank() {
    let reference = single_rank();
    let groups = LocalGroup::<B>::new(&[dev(), dev()], Duration::from_secs(20));
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<Vec<Vec<f32>>> {
                    let rank = g.rank();
                    // Rank 1 starts from different weights: the broadcast fixes that.
                    let m = model(1 + 10 * rank as u64);
                    let g: Arc<dyn ProcessGroup<B>> = Arc::new(g);
                    // A tiny bucket cap: several buckets, launched by hooks during backward.
                    let cfg = kiln_dist::DdpConfig {
                        bucket_cap_mb: 0.0003,
                        ..Default::default()
                    };
                    let ddp = Ddp::with_config(&m, g, cfg)?;
                    assert!(ddp.buckets().len() >= 3, "{:?}", ddp.buckets());
                    let mut opt = SgdConfig::new(0.1).init(m.parameters())?;
                    let local = GLOBAL / 2;
                    for s in 0..STEPS {
                        let (x, y) = batch(s, GLOBAL);
                        let x = x.narrow(0, rank * local, local)?;
                        let y = y.narrow(0, rank * local, local)?;
                        opt.zero_grad();
                        let loss =
                            cross_entropy(&m.forward(&Var::constant(x))?, &y, Reduction::Mean)?;
                        ddp.backward(&loss)?;
                        opt.step()?;
                    }
                    Ok(params(&m))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert_close(&results[0], &reference, 1e-4);
    assert_close(&results[1], &reference, 1e-4);
}

#[test]
fn no_sync_accumulates_and_the_next_backward_reduces_the_sum() {
    let groups = LocalGroup::<B>::new(&[dev(), dev()], Duration::from_secs(20));
    std::thread::scope(|s| {
        for g in groups {
            s.spawn(move || {
                let rank = g.rank();
                let m = model(3);
                let ddp = Ddp::new(&m, Arc::new(g)).unwrap();
                let (x, y) = batch(0, 8);
                let run = || {
                    let loss = cross_entropy(
                        &m.forward(&Var::constant(x.clone())).unwrap(),
                        &y,
                        Reduction::Mean,
                    )
                    .unwrap();
                    loss.mul_scalar((rank + 1) as f64).unwrap()
                };
                ddp.no_sync(|| run().backward().unwrap());
                ddp.backward(&run()).unwrap();
                // Each rank accumulated 2 × (rank + 1) × g; the mean over ranks is 3 g.
                let got = m.parameters()[0].grad().unwrap().to_vec::<f32>().unwrap();
                m.parameters()[0].zero_grad();
                run().backward().unwrap();
                let g1 = m.parameters()[0].grad().unwrap().to_vec::<f32>().unwrap();
                for (a, b) in got.iter().zip(&g1) {
                    let want = b * 3.0 / (rank + 1) as f32;
                    assert!(
                        (a - want).abs() <= 1e-5 * want.abs().max(1e-3),
                        "{a} vs {want}"
                    );
                }
            });
        }
    });
}

#[test]
fn a_parameter_without_gradient_is_an_error_naming_it() {
    let groups = LocalGroup::<B>::new(&[dev(), dev()], Duration::from_secs(20));
    std::thread::scope(|s| {
        for g in groups {
            s.spawn(move || {
                let rank = g.rank();
                let m = model(5);
                let ddp = Ddp::new(&m, Arc::new(g)).unwrap();
                let (x, _) = batch(0, 4);
                // Only the first layer takes part on rank 1.
                let out = if rank == 1 {
                    let first = m.named_parameters();
                    let w = &first[0].1;
                    Var::constant(x)
                        .matmul(&w.transpose(0, 1).unwrap())
                        .unwrap()
                } else {
                    m.forward(&Var::constant(x)).unwrap()
                };
                let r = ddp.backward(&out.sum_all().unwrap());
                if rank == 1 {
                    let e = r.unwrap_err();
                    assert_eq!(e.dist_kind(), Some(DistErrorKind::Mismatch), "{e}");
                    assert!(e.to_string().contains("got no gradient"), "{e}");
                    assert!(e.to_string().contains("2.weight"), "{e}");
                } else {
                    // The other rank is not left waiting: its step completes.
                    r.unwrap();
                }
            });
        }
    });
}

#[test]
fn a_rank_that_leaves_ends_the_other_with_an_error_not_a_hang() {
    let mut groups = LocalGroup::<B>::new(&[dev(), dev()], Duration::from_secs(30));
    let g1 = groups.pop().unwrap();
    let g0 = groups.pop().unwrap();
    let t = Instant::now();
    let h = std::thread::spawn(move || {
        let x = Tensor::<B>::ones([3], DType::F32, &dev()).unwrap();
        g0.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
        // Rank 1 is gone by now: the second collective fails at once.
        g0.all_reduce(&x, ReduceOp::Sum).map(drop)
    });
    let x = Tensor::<B>::ones([3], DType::F32, &dev()).unwrap();
    let r = g1.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), vec![2.0; 3]);
    drop(g1);
    let e = h.join().unwrap().unwrap_err();
    assert_eq!(e.dist_kind(), Some(DistErrorKind::PeerLost), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_missing_rank_times_out_with_its_number() {
    let mut groups = LocalGroup::<B>::new(&[dev(), dev(), dev()], Duration::from_millis(300));
    let _g2 = groups.pop().unwrap(); // alive, but never joins
    let _g1 = groups.pop().unwrap();
    let g0 = groups.pop().unwrap();
    let x = Tensor::<B>::ones([3], DType::F32, &dev()).unwrap();
    let e = g0.all_reduce(&x, ReduceOp::Avg).unwrap_err();
    assert_eq!(e.dist_kind(), Some(DistErrorKind::Timeout), "{e}");
    assert!(e.to_string().contains("[1, 2]"), "{e}");
}

#[test]
fn chainer_style_master_and_replica_match_one_device() {
    let reference = single_rank();
    let master = model(1);
    let replica = model(99);
    copy_parameters_from(&replica, &master).unwrap();
    let mut opt = SgdConfig::new(0.1).init(master.parameters()).unwrap();
    let half = GLOBAL / 2;
    for s in 0..STEPS {
        let (x, y) = batch(s, GLOBAL);
        opt.zero_grad();
        for p in replica.parameters() {
            p.zero_grad();
        }
        std::thread::scope(|sc| {
            for (i, m) in [&master, &replica].into_iter().enumerate() {
                let (x, y) = (
                    x.narrow(0, i * half, half).unwrap(),
                    y.narrow(0, i * half, half).unwrap(),
                );
                sc.spawn(move || {
                    let loss =
                        cross_entropy(&m.forward(&Var::constant(x)).unwrap(), &y, Reduction::Mean)
                            .unwrap();
                    loss.backward().unwrap();
                });
            }
        });
        accumulate_grads_from(&master, &replica).unwrap();
        scale_grads(&master, 0.5).unwrap();
        opt.step().unwrap();
        copy_parameters_from(&replica, &master).unwrap();
    }
    assert_close(&params(&master), &reference, 1e-4);
    assert_close(&params(&replica), &reference, 1e-4);
}

#[test]
fn a_tied_weight_is_reduced_once() {
    // Two 8x8 layers sharing one weight: three parameters (the weight, two biases) under four
    // names. DDP must place the weight in one bucket once, not under both names.
    let groups = LocalGroup::<B>::new(&[dev(), dev()], Duration::from_secs(20));
    std::thread::scope(|s| {
        for g in groups {
            s.spawn(move || {
                let mut rng = Generator::new(3);
                let a = LinearConfig::new(8, 8).init::<B>(&dev(), &mut rng).unwrap();
                let mut b = LinearConfig::new(8, 8).init::<B>(&dev(), &mut rng).unwrap();
                b.tie_weight(&a.weight).unwrap();
                let m = Sequential::new().add(a).add(b);
                assert_eq!(m.named_parameters().len(), 4);
                let g: Arc<dyn ProcessGroup<B>> = Arc::new(g);
                let ddp = Ddp::new(&m, g).unwrap();
                let placed: usize = ddp.buckets().iter().map(Vec::len).sum();
                assert_eq!(placed, 3, "{:?}", ddp.buckets());
            });
        }
    });
}

/// Rank `rank`'s running mean of the BatchNorm1d in `bn_model` after `STEPS` DDP steps on its
/// half of each batch (the halves differ, so the ranks' own statistics would too).
fn bn_running_means(broadcast_buffers: bool) -> Vec<Vec<f32>> {
    let groups = LocalGroup::<B>::new(&[dev(), dev()], Duration::from_secs(20));
    std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<Vec<f32>> {
                    let rank = g.rank();
                    let mut rng = Generator::new(5);
                    let m = Sequential::new()
                        .add(LinearConfig::new(12, 16).init::<B>(&dev(), &mut rng)?)
                        .add(kiln_nn::BatchNormConfig::new(16).init_1d::<B>(&dev())?)
                        .add(Relu)
                        .add(LinearConfig::new(16, 5).init::<B>(&dev(), &mut rng)?);
                    let cfg = kiln_dist::DdpConfig {
                        broadcast_buffers,
                        ..Default::default()
                    };
                    let ddp = Ddp::with_config(&m, Arc::new(g), cfg)?;
                    let mut opt = SgdConfig::new(0.1).init(m.parameters())?;
                    let local = GLOBAL / 2;
                    for s in 0..STEPS {
                        let (x, y) = batch(s, GLOBAL);
                        // Rank 1's half is shifted: its batch statistics differ from rank 0's.
                        let x = x.narrow(0, rank * local, local)?.add_scalar(rank as f64)?;
                        let y = y.narrow(0, rank * local, local)?;
                        opt.zero_grad();
                        let loss =
                            cross_entropy(&m.forward(&Var::constant(x))?, &y, Reduction::Mean)?;
                        ddp.backward(&loss)?;
                        opt.step()?;
                    }
                    let (_, mean) = m
                        .named_buffers()
                        .into_iter()
                        .find(|(n, _)| n.ends_with("running_mean"))
                        .expect("a running mean");
                    mean.tensor().to_vec::<f32>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    })
}

#[test]
fn buffers_follow_rank_0_after_each_step() {
    // PyTorch's broadcast_buffers=True: every rank ends with rank 0's running statistics.
    let synced = bn_running_means(true);
    assert_eq!(synced[0], synced[1]);
    // Off: each rank keeps its own (the test can tell the two apart).
    let own = bn_running_means(false);
    assert_ne!(own[0], own[1]);
    assert_eq!(
        own[0], synced[0],
        "rank 0's statistics are its own either way"
    );
}
