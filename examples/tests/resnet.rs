//! Keeps `examples/resnet` true: a very narrow ResNet-18 (CIFAR form) trains for a few epochs
//! on a few hundred padded MNIST digits on the CPU and its training loss falls; its state dict
//! has torchvision's names, buffers included; evaluation mode is deterministic, uses the
//! running statistics, and its folded convolutions (`ConvBnAct`) give the unfolded layers'
//! output.

use kiln_autograd::{Var, no_grad};
use kiln_backend_cpu::Cpu;
use kiln_core::{Backend, Generator};
use kiln_data::{DataLoader, Mnist};
use kiln_examples::models::evaluate;
use kiln_examples::resnet::{ResNet, ResNetConfig, pad_to_32, train_epoch};
use kiln_nn::{Module, ModuleExt};
use kiln_optim::SgdConfig;

#[test]
fn tiny_resnet_loss_falls_on_the_cpu() {
    let dev = Cpu::device(0);
    let data = Mnist::load(Mnist::bundled_dir()).unwrap();
    let train_set = pad_to_32(&data.train.take(256)).unwrap();
    let test_set = pad_to_32(&data.test.take(100)).unwrap();
    let mut train = DataLoader::<Cpu>::new(train_set, 32, &dev)
        .unwrap()
        .shuffle(0);
    let mut test = DataLoader::<Cpu>::new(test_set, 100, &dev).unwrap();
    let mut model = ResNet::<Cpu>::new(
        ResNetConfig::resnet18(1, 10, 4),
        &dev,
        &mut Generator::new(0),
    )
    .unwrap();

    // torchvision's names; 20 convolutions' BatchNorms (17 in the main path + 3 projections)
    // with three buffers each; the optimizer gets the parameters only.
    let names: Vec<String> = model.state_dict().into_iter().map(|(n, _)| n).collect();
    for n in [
        "conv1.weight",
        "bn1.running_mean",
        "layer1.0.conv1.weight",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.num_batches_tracked",
        "layer4.1.bn2.bias",
        "fc.weight",
        "fc.bias",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing from {names:?}");
    }
    assert_eq!(model.named_buffers().len(), 20 * 3);
    assert_eq!(model.parameters().len(), 20 + 20 * 2 + 2);

    let mut opt = SgdConfig::new(0.05)
        .with_momentum(0.9)
        .with_weight_decay(5e-4)
        .init(model.parameters())
        .unwrap();
    let mut losses = Vec::new();
    for _ in 0..4 {
        let (l, seen) = train_epoch(&mut model, &mut train, &mut opt).unwrap();
        assert_eq!(seen, 256);
        assert!(l.is_finite());
        losses.push(l);
    }
    assert!(
        losses[3] < losses[0] - 0.3,
        "the training loss should fall: {losses:?}"
    );
    let nbt = &model.named_buffers()[2];
    assert_eq!(nbt.0, "bn1.num_batches_tracked");
    assert_eq!(nbt.1.tensor().to_vec::<i64>().unwrap(), [4 * 8]);

    // Evaluation: finite, deterministic, and leaves the running statistics alone.
    let (tl, acc) = evaluate(&mut model, &mut test).unwrap();
    assert!(tl.is_finite() && (0.0..=1.0).contains(&acc), "{tl} {acc}");
    let x = Var::constant(test.iter().next().unwrap().unwrap().0);
    let a = model.forward(&x).unwrap().tensor().to_vec::<f32>().unwrap();
    let b = model.forward(&x).unwrap().tensor().to_vec::<f32>().unwrap();
    assert_eq!(a, b);
    assert_eq!(nbt.1.tensor().to_vec::<i64>().unwrap(), [4 * 8]);

    // The folded eval forward (each batch norm folded into its convolution), recording or
    // not, equals convolution, batch norm and ReLU one after the other.
    let folded = no_grad(|| model.forward(&x)).unwrap();
    model.set_fold(false);
    let unfolded = model.forward(&x).unwrap();
    model.set_fold(true);
    let host = |v: &Var<Cpu>| -> Vec<f64> {
        let t = v.tensor().to_dtype(kiln_core::DType::F64).unwrap();
        t.to_vec::<f64>().unwrap()
    };
    let want = host(&unfolded);
    let close = |what: &str, got: &[f64]| {
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-4, "{what}: max error {err}");
    };
    close("no_grad", &host(&folded));
    close(
        "recording",
        &a.into_iter().map(f64::from).collect::<Vec<_>>(),
    );
    assert_eq!(<Cpu as Backend>::NAME, "cpu");
}
