//! The convolutional-network layers: grouped and depthwise `Conv2d` (against per-group
//! convolutions and gradient checks), `BatchNorm2d`/`BatchNorm1d` (running statistics updated
//! in training mode and used in evaluation mode, buffers that optimizers never see, state dicts
//! with PyTorch's names), `GroupNorm`, the average pools, and the typed errors. PyTorch's
//! values are compared in `torch_conv_layers.rs`.

use std::collections::BTreeMap;

use kiln_autograd::{CheckOptions, Var, check_backward};
use kiln_backend_cpu::Cpu;
use kiln_core::{Backend, DType, Error, Generator, RandDist, Tensor};
use kiln_nn::{
    AdaptiveAvgPool2d, AvgPool2d, BatchNormConfig, Conv2dConfig, GroupNormConfig, Module,
    ModuleExt, Relu, Sequential, Window, conv2d, conv2d_grouped,
};
use kiln_optim::{Optimizer, SgdConfig};

type B = Cpu;

fn dev() -> <B as Backend>::Device {
    Cpu::device(0)
}

fn normal(dims: &[usize], seed: u64, dtype: DType) -> Tensor<B> {
    let d = RandDist::Normal {
        mean: 0.3,
        std: 1.2,
    };
    Generator::new(seed)
        .sample::<B>(dims.to_vec(), d, dtype, &dev())
        .unwrap()
}

fn host(t: &Tensor<B>) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

#[track_caller]
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    kiln_core::testing::assert_close(what, got, want, tol)
}

#[test]
fn grouped_conv_is_one_convolution_per_group() {
    // (c, oc, groups, stride, padding, dilation): grouped, depthwise, depthwise multiplier 2.
    for (c, oc, g, s, p, d) in [(4, 6, 2, 1, 1, 1), (3, 3, 3, 2, 1, 1), (3, 6, 3, 1, 2, 2)] {
        let x = Var::constant(normal(&[2, c, 6, 5], 1, DType::F64));
        let w = Var::param(normal(&[oc, c / g, 3, 3], 2, DType::F64));
        let b = Var::param(normal(&[oc], 3, DType::F64));
        let win = Window::new(3)
            .with_stride(s)
            .with_padding(p)
            .with_dilation(d);
        let y = conv2d_grouped(&x, &w, Some(&b), win, g).unwrap();
        let (cg, og) = (c / g, oc / g);
        let parts: Vec<Var<B>> = (0..g)
            .map(|i| {
                conv2d(
                    &x.narrow(1, i * cg, cg).unwrap(),
                    &w.narrow(0, i * og, og).unwrap(),
                    Some(&b.narrow(0, i * og, og).unwrap()),
                    win,
                )
                .unwrap()
            })
            .collect();
        let want = Var::cat(&parts, 1).unwrap();
        assert_eq!(y.dims(), want.dims());
        assert_close(
            &format!("groups {g}"),
            &host(&y.tensor()),
            &host(&want.tensor()),
            1e-12,
        );
        // The layer with the same weights.
        let layer = Conv2dConfig::new(c, oc, 3)
            .with_stride(s)
            .with_padding(p)
            .with_dilation(d)
            .with_groups(g)
            .with_dtype(DType::F64)
            .init::<B>(&dev(), &mut Generator::new(0))
            .unwrap();
        assert_eq!(layer.weight.dims(), [oc, c / g, 3, 3]);
        layer.weight.set_tensor(w.tensor()).unwrap();
        layer.bias.as_ref().unwrap().set_tensor(b.tensor()).unwrap();
        assert_close(
            &format!("layer groups {g}"),
            &host(&layer.forward(&x).unwrap().tensor()),
            &host(&want.tensor()),
            1e-12,
        );
    }
}

#[test]
fn grouped_conv_gradients_check() {
    let x = normal(&[2, 4, 5, 4], 4, DType::F64);
    let w = normal(&[4, 2, 3, 2], 5, DType::F64);
    let b = normal(&[4], 6, DType::F64);
    let win = Window {
        kernel: [3, 2],
        stride: [2, 1],
        padding: [1, 1],
        dilation: [1, 1],
    };
    check_backward(
        |v| conv2d_grouped(&v[0], &v[1], Some(&v[2]), win, 2),
        &[x, w, b],
        &CheckOptions::default(),
    )
    .unwrap();
    let (x, w) = (
        normal(&[1, 3, 4, 4], 7, DType::F64),
        normal(&[3, 1, 3, 3], 8, DType::F64),
    );
    check_backward(
        |v| conv2d_grouped(&v[0], &v[1], None, Window::new(3).with_padding(1), 3),
        &[x, w],
        &CheckOptions::default(),
    )
    .unwrap();
}

/// Per channel of `[n, c, h, w]`: the mean and the unbiased variance.
fn channel_stats(x: &[f64], [n, c, s]: [usize; 3]) -> (Vec<f64>, Vec<f64>) {
    let mut mean = vec![0.0; c];
    let mut var = vec![0.0; c];
    for ch in 0..c {
        let vals: Vec<f64> = (0..n)
            .flat_map(|i| (0..s).map(move |p| (i * c + ch) * s + p))
            .map(|j| x[j])
            .collect();
        let m = vals.iter().sum::<f64>() / vals.len() as f64;
        mean[ch] = m;
        var[ch] = vals.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (vals.len() - 1) as f64;
    }
    (mean, var)
}

#[test]
fn batch_norm_tracks_running_stats_in_training_and_uses_them_in_eval() {
    let (n, c, h, w) = (3, 2, 2, 3);
    let mut bn = BatchNormConfig::new(c)
        .with_dtype(DType::F64)
        .init_2d::<B>(&dev())
        .unwrap();
    let weight = normal(&[c], 9, DType::F64);
    let bias = normal(&[c], 10, DType::F64);
    bn.weight
        .as_ref()
        .unwrap()
        .set_tensor(weight.clone())
        .unwrap();
    bn.bias.as_ref().unwrap().set_tensor(bias.clone()).unwrap();
    let (x1, x2) = (
        normal(&[n, c, h, w], 11, DType::F64),
        normal(&[n, c, h, w], 12, DType::F64)
            .mul_scalar(2.0)
            .unwrap(),
    );
    let y_train = bn.forward(&Var::constant(x1.clone())).unwrap();
    bn.forward(&Var::constant(x2.clone())).unwrap();
    // momentum 0.1 from zeros and ones, with the unbiased batch variance.
    let (m1, v1) = channel_stats(&host(&x1), [n, c, h * w]);
    let (m2, v2) = channel_stats(&host(&x2), [n, c, h * w]);
    let rm: Vec<f64> = (0..c).map(|i| 0.1 * m2[i] + 0.9 * (0.1 * m1[i])).collect();
    let rv: Vec<f64> = (0..c)
        .map(|i| 0.1 * v2[i] + 0.9 * (0.1 * v1[i] + 0.9))
        .collect();
    let buf = |v: &Option<Var<B>>| host(&v.as_ref().unwrap().tensor());
    assert_close("running_mean", &buf(&bn.running_mean), &rm, 1e-12);
    assert_close("running_var", &buf(&bn.running_var), &rv, 1e-12);
    let nbt = bn.num_batches_tracked.as_ref().unwrap().tensor();
    assert_eq!((nbt.dtype(), nbt.rank()), (DType::I64, 0));
    assert_eq!(nbt.to_vec::<i64>().unwrap(), [2]);

    // Eval: the running statistics, and the buffers stay as they are.
    let before = buf(&bn.running_mean);
    bn.eval();
    let y_eval = bn.forward(&Var::constant(x1.clone())).unwrap();
    let (xs, ws, bs) = (host(&x1), host(&weight), host(&bias));
    let want: Vec<f64> = xs
        .iter()
        .enumerate()
        .map(|(j, v)| {
            let ch = (j / (h * w)) % c;
            (v - rm[ch]) / (rv[ch] + 1e-5).sqrt() * ws[ch] + bs[ch]
        })
        .collect();
    assert_close("eval output", &host(&y_eval.tensor()), &want, 1e-12);
    assert_eq!(buf(&bn.running_mean), before, "running_mean after eval");
    assert_eq!(
        bn.num_batches_tracked
            .as_ref()
            .unwrap()
            .tensor()
            .to_vec::<i64>()
            .unwrap(),
        [2]
    );
    // Training normalized with the batch's own statistics instead.
    let (bm, _) = channel_stats(&xs, [n, c, h * w]);
    let ys = host(&y_train.tensor());
    for ch in 0..c {
        let per: f64 = (0..n * h * w)
            .map(|k| {
                let (i, p) = (k / (h * w), k % (h * w));
                ys[(i * c + ch) * h * w + p]
            })
            .sum::<f64>()
            / (n * h * w) as f64;
        assert!((per - bs[ch]).abs() < 1e-12, "train output mean {per}");
        assert!((bm[ch] - rm[ch]).abs() > 1e-3);
    }
    assert!(host(&y_train.tensor()) != host(&y_eval.tensor()));
    // Back to training: the buffers move again.
    bn.train();
    bn.forward(&Var::constant(x1)).unwrap();
    assert_eq!(
        bn.num_batches_tracked
            .as_ref()
            .unwrap()
            .tensor()
            .to_vec::<i64>()
            .unwrap(),
        [3]
    );
}

#[test]
fn batch_norm_without_running_stats_or_momentum() {
    let x = normal(&[4, 3], 13, DType::F64);
    // No running statistics: no buffers, batch statistics in both modes.
    let mut bn = BatchNormConfig::new(3)
        .with_track_running_stats(false)
        .with_affine(false)
        .with_dtype(DType::F64)
        .init_1d::<B>(&dev())
        .unwrap();
    assert!(bn.named_buffers().is_empty() && bn.named_parameters().is_empty());
    let a = host(&bn.forward(&Var::constant(x.clone())).unwrap().tensor());
    bn.eval();
    let b = host(&bn.forward(&Var::constant(x.clone())).unwrap().tensor());
    assert_eq!(a, b);
    // momentum None: the cumulative average of the batch statistics.
    let bn = BatchNormConfig::new(3)
        .with_momentum(None)
        .with_dtype(DType::F64)
        .init_1d::<B>(&dev())
        .unwrap();
    let x2 = normal(&[4, 3], 14, DType::F64);
    bn.forward(&Var::constant(x.clone())).unwrap();
    bn.forward(&Var::constant(x2.clone())).unwrap();
    let (m1, _) = channel_stats(&host(&x), [4, 3, 1]);
    let (m2, _) = channel_stats(&host(&x2), [4, 3, 1]);
    let want: Vec<f64> = (0..3).map(|i| (m1[i] + m2[i]) / 2.0).collect();
    assert_close(
        "cumulative running_mean",
        &host(&bn.running_mean.as_ref().unwrap().tensor()),
        &want,
        1e-12,
    );
}

fn small_cnn(seed: u64) -> Sequential<B> {
    let mut g = Generator::new(seed);
    Sequential::new()
        .add(
            Conv2dConfig::new(2, 4, 3)
                .with_padding(1)
                .with_bias(false)
                .init::<B>(&dev(), &mut g)
                .unwrap(),
        )
        .add(BatchNormConfig::new(4).init_2d::<B>(&dev()).unwrap())
        .add(Relu)
        .add(
            Conv2dConfig::new(4, 4, 3)
                .with_groups(4)
                .init::<B>(&dev(), &mut g)
                .unwrap(),
        )
        .add(GroupNormConfig::new(2, 4).init::<B>(&dev()).unwrap())
        .add(AvgPool2d::new(2))
        .add(AdaptiveAvgPool2d::new([1, 1]))
}

#[test]
fn buffers_are_in_the_state_dict_but_not_trained() {
    let mut m = small_cnn(1);
    let names: Vec<String> = m.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "0.weight",
            "1.weight",
            "1.bias",
            "3.weight",
            "3.bias",
            "4.weight",
            "4.bias",
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
        ]
    );
    // Optimizers see the parameters only.
    assert_eq!(m.parameters().len(), 7);
    let mut opt = SgdConfig::new(0.1).init(m.parameters()).unwrap();
    let x = Var::constant(normal(&[3, 2, 4, 4], 15, DType::F32));
    m.forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    let after_one: BTreeMap<String, Vec<f64>> = m
        .state_dict()
        .into_iter()
        .map(|(n, t)| (n, host(&t)))
        .collect();
    assert_eq!(after_one["1.num_batches_tracked"], [1.0]);

    // Round trip through safetensors into a fresh model (other weights, fresh buffers).
    let path = std::env::temp_dir().join(format!("kiln-conv-layers-{}.st", std::process::id()));
    m.save(&path).unwrap();
    let mut fresh = small_cnn(2);
    assert_eq!(
        host(&fresh.named_buffers()[2].1.tensor()),
        [0.0],
        "a fresh num_batches_tracked"
    );
    fresh.load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    for (n, t) in fresh.state_dict() {
        assert_eq!(host(&t), after_one[&n], "{n} after load");
    }
    m.eval();
    fresh.eval();
    assert_eq!(
        host(&m.forward(&x).unwrap().tensor()),
        host(&fresh.forward(&x).unwrap().tensor())
    );
    // A state dict without the buffers does not load.
    let mut partial: BTreeMap<String, Tensor<B>> = m.state_dict().into_iter().collect();
    partial.remove("1.running_var");
    let e = fresh
        .load_tensors("partial", partial)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1.running_var"), "{e}");
}

#[test]
fn layers_reject_bad_shapes_with_typed_errors() {
    let x3 = Var::constant(normal(&[2, 3, 4], 16, DType::F32));
    let x4 = Var::constant(normal(&[2, 3, 4, 4], 16, DType::F32));
    let op = |r: kiln_core::Result<Var<B>>| match r {
        Err(Error::InvalidArgument { op, .. }) => op,
        Err(e) => panic!("unexpected {e}"),
        Ok(_) => panic!("expected an error"),
    };
    let bn2 = BatchNormConfig::new(3).init_2d::<B>(&dev()).unwrap();
    assert_eq!(op(bn2.forward(&x3)), "BatchNorm2d");
    let bn1 = BatchNormConfig::new(3).init_1d::<B>(&dev()).unwrap();
    assert_eq!(op(bn1.forward(&x4)), "BatchNorm1d");
    let bn_c = BatchNormConfig::new(5).init_2d::<B>(&dev()).unwrap();
    assert_eq!(op(bn_c.forward(&x4)), "BatchNorm2d");
    let gn = GroupNormConfig::new(2, 4).init::<B>(&dev()).unwrap();
    assert_eq!(op(gn.forward(&x4)), "GroupNorm");
    assert!(GroupNormConfig::new(2, 3).init::<B>(&dev()).is_err());
    assert!(
        BatchNormConfig::new(3)
            .with_momentum(Some(2.0))
            .init_2d::<B>(&dev())
            .is_err()
    );
    assert!(
        Conv2dConfig::new(3, 4, 3)
            .with_groups(2)
            .init::<B>(&dev(), &mut Generator::new(0))
            .is_err()
    );
    let w = Var::constant(normal(&[4, 2, 3, 3], 17, DType::F32));
    // 2 groups of 2 input channels need c = 4, not 3.
    assert_eq!(
        op(conv2d_grouped(&x4, &w, None, Window::new(3), 2)),
        "conv2d"
    );
    assert_eq!(
        op(conv2d_grouped(&x4, &w, None, Window::new(3), 0)),
        "conv2d"
    );
    assert_eq!(op(AvgPool2d::new(5).forward(&x4)), "avg_pool2d");
    assert_eq!(
        op(AdaptiveAvgPool2d::new([1, 1]).forward(&x3)),
        "adaptive_avg_pool2d"
    );
}

#[test]
fn max_pool_ceil_mode_keeps_the_partial_windows() {
    // 0..25 on a 5x5 plane, 2x2 windows, stride 2: floor mode gives 2x2; ceil mode adds the
    // partial last row and column of windows (PyTorch: 3x3), each the max of what it covers.
    let x = Var::param(
        Tensor::<B>::from_vec((0..25).map(|v| v as f32).collect(), [1, 1, 5, 5], &dev()).unwrap(),
    );
    let floor = kiln_nn::MaxPool2d::<B>::new(2).forward(&x).unwrap();
    assert_eq!(floor.dims(), [1, 1, 2, 2]);
    let pool = kiln_nn::MaxPool2d::<B>::new(2).with_ceil_mode(true);
    let y = pool.forward(&x).unwrap();
    assert_eq!(y.dims(), [1, 1, 3, 3]);
    let want = [6.0, 8.0, 9.0, 16.0, 18.0, 19.0, 21.0, 23.0, 24.0];
    assert_close("ceil_mode values", &host(&y.tensor()), &want, 0.0);
    y.sum_all().unwrap().backward().unwrap();
    let mut g = vec![0.0; 25];
    for v in want {
        g[v as usize] = 1.0;
    }
    assert_close("ceil_mode gradient", &host(&x.grad().unwrap()), &g, 0.0);
    // Kernel 3, stride 2, padding 1 on 6: floor 3 windows, ceil 4 (the last starts at 5, inside
    // the input); on 5, ceil gives 3 too (a 4th would start in the right padding).
    let w = kiln_nn::Window::new(3).with_stride(2).with_padding(1);
    let six = Var::constant(normal(&[1, 2, 6, 6], 3, DType::F32));
    let five = Var::constant(normal(&[1, 2, 5, 5], 4, DType::F32));
    assert_eq!(kiln_nn::max_pool2d(&six, w).unwrap().dims(), [1, 2, 3, 3]);
    assert_eq!(
        kiln_nn::max_pool2d_ceil(&six, w, true).unwrap().dims(),
        [1, 2, 4, 4]
    );
    assert_eq!(
        kiln_nn::max_pool2d_ceil(&five, w, true).unwrap().dims(),
        [1, 2, 3, 3]
    );
}
