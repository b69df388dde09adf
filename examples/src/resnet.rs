//! ResNet-18 in its CIFAR form, for `examples/resnet` and its integration test
//! (`examples/tests/resnet.rs`): a 3×3 stem (no 7×7 convolution, no max-pool), four stages of
//! two BasicBlocks at widths `w, 2w, 4w, 8w` (`w` = 64 for ResNet-18; smaller for a quick CPU
//! run), the first block of stages 2–4 halving the resolution with a 1×1 strided projection
//! shortcut, BatchNorm after every convolution, a global average pool and one linear layer.
//!
//! Parameter and buffer names are torchvision's `resnet18` (`conv1`, `bn1`,
//! `layer2.0.downsample.0`, `layer2.0.downsample.1.running_mean`, `fc`), so a state dict moves
//! between kiln and the PyTorch twin (`bench/resnet_torch.py`) unchanged.
//!
//! The model forwards `set_training` to its batch norms: [`ModuleExt::train`] and
//! [`ModuleExt::eval`] switch them between batch statistics (updating the running ones) and
//! the running statistics. Each convolution and its batch norm (and ReLU where one follows
//! directly) is a `kiln_nn::ConvBnAct`: in eval mode the batch norm is folded into the
//! convolution's weight and bias, and on CUDA the bias and ReLU run in the convolution's
//! epilogue (cuDNN's fused graph) for inference under `no_grad`; [`ResNet::set_fold`] turns
//! that off to compare.
//!
//! [`ModuleExt::train`]: kiln_nn::ModuleExt::train
//! [`ModuleExt::eval`]: kiln_nn::ModuleExt::eval

use kiln_autograd::Var;
use kiln_core::{
    Activation, Backend, DType, Error, Generator, HostBuffer, Reduction, Result, Tensor,
};
use kiln_data::{ArrayDataset, DataLoader, Dataset};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{
    AdaptiveAvgPool2d, BatchNorm, BatchNormConfig, Conv2d, Conv2dConfig, ConvBnAct, Linear,
    LinearConfig, Module,
};
use kiln_optim::Optimizer;

/// `prefix.name` for each of `named`.
fn prefixed<B: Backend>(prefix: &str, named: Vec<(String, Var<B>)>) -> Vec<(String, Var<B>)> {
    named
        .into_iter()
        .map(|(n, v)| (format!("{prefix}.{n}"), v))
        .collect()
}

fn conv<B: Backend>(
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    dev: &B::Device,
    g: &mut Generator,
) -> Result<Conv2d<B>> {
    Conv2dConfig::new(cin, cout, k)
        .with_stride(stride)
        .with_padding(k / 2)
        .with_bias(false)
        .init::<B>(dev, g)
}

fn bn<B: Backend>(c: usize, dev: &B::Device) -> Result<BatchNorm<B>> {
    BatchNormConfig::new(c).init_2d::<B>(dev)
}

/// A convolution (no bias, "same" padding) with its BatchNorm and activation, its parameters
/// and buffers named `conv` and `bn` (torchvision's names for them): in eval mode the batch
/// norm is folded into the convolution (`kiln_nn::ConvBnAct`).
fn conv_bn<B: Backend>(
    (cin, cout, k, stride): (usize, usize, usize, usize),
    act: Activation,
    names: (&str, &str),
    dev: &B::Device,
    g: &mut Generator,
) -> Result<ConvBnAct<B>> {
    let c = conv(cin, cout, k, stride, dev, g)?;
    Ok(ConvBnAct::new(c, bn(cout, dev)?, act)?.with_names(names.0, names.1))
}

/// Two 3×3 convolutions with BatchNorm and a residual connection (a 1×1 projection with
/// BatchNorm when the shape changes). Each convolution and its batch norm (and the first
/// one's ReLU) is one [`ConvBnAct`], so in eval mode the block runs three (or two) folded
/// convolutions.
pub struct BasicBlock<B: Backend> {
    /// `conv1`, `bn1`, ReLU.
    first: ConvBnAct<B>,
    /// `conv2`, `bn2` (the ReLU comes after the residual sum).
    second: ConvBnAct<B>,
    /// `downsample.0`, `downsample.1`.
    downsample: Option<ConvBnAct<B>>,
}

impl<B: Backend> BasicBlock<B> {
    fn new(
        cin: usize,
        cout: usize,
        stride: usize,
        dev: &B::Device,
        g: &mut Generator,
    ) -> Result<Self> {
        let relu = Activation::Relu;
        let first = conv_bn((cin, cout, 3, stride), relu, ("conv1", "bn1"), dev, g)?;
        let none = Activation::Identity;
        let second = conv_bn((cout, cout, 3, 1), none, ("conv2", "bn2"), dev, g)?;
        let downsample = if stride != 1 || cin != cout {
            let names = ("downsample.0", "downsample.1");
            Some(conv_bn((cin, cout, 1, stride), none, names, dev, g)?)
        } else {
            None
        };
        Ok(BasicBlock {
            first,
            second,
            downsample,
        })
    }

    /// Every `ConvBnAct` of the block.
    fn layers_mut(&mut self) -> impl Iterator<Item = &mut ConvBnAct<B>> {
        [&mut self.first, &mut self.second]
            .into_iter()
            .chain(self.downsample.as_mut())
    }
}

impl<B: Backend> Module<B> for BasicBlock<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        let h = self.second.forward(&self.first.forward(x)?)?;
        let shortcut = match &self.downsample {
            Some(d) => d.forward(x)?,
            None => x.clone(),
        };
        h.add(&shortcut)?.relu()
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = self.first.named_parameters();
        v.extend(self.second.named_parameters());
        if let Some(d) = &self.downsample {
            v.extend(d.named_parameters());
        }
        v
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        let mut v = self.first.named_buffers();
        v.extend(self.second.named_buffers());
        if let Some(d) = &self.downsample {
            v.extend(d.named_buffers());
        }
        v
    }
    fn set_training(&mut self, training: bool) {
        self.layers_mut().for_each(|l| l.set_training(training));
    }
    fn describe(&self) -> String {
        format!(
            "BasicBlock({} -> {}, downsample={})",
            self.first.conv.config().in_channels,
            self.first.conv.config().out_channels,
            self.downsample.is_some()
        )
    }
}

/// The shape of a [`ResNet`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Input channels (1 for MNIST, 3 for CIFAR).
    pub in_channels: usize,
    pub classes: usize,
    /// The first stage's width; the stages are `w, 2w, 4w, 8w` (64 for ResNet-18).
    pub width: usize,
    /// BasicBlocks per stage (`[2, 2, 2, 2]` for ResNet-18).
    pub blocks: [usize; 4],
}

impl ResNetConfig {
    /// ResNet-18 at base width `width` (64 is the real one).
    pub fn resnet18(in_channels: usize, classes: usize, width: usize) -> Self {
        ResNetConfig {
            in_channels,
            classes,
            width,
            blocks: [2, 2, 2, 2],
        }
    }
}

/// ResNet in its CIFAR form (module docs).
pub struct ResNet<B: Backend> {
    cfg: ResNetConfig,
    /// `conv1`, `bn1`, ReLU.
    stem: ConvBnAct<B>,
    layers: Vec<Vec<BasicBlock<B>>>,
    pool: AdaptiveAvgPool2d,
    fc: Linear<B>,
}

impl<B: Backend> ResNet<B> {
    /// The model with parameters drawn from `g` layer by layer, in the order the PyTorch twin
    /// creates its layers.
    pub fn new(cfg: ResNetConfig, dev: &B::Device, g: &mut Generator) -> Result<Self> {
        if cfg.width == 0 || cfg.in_channels == 0 || cfg.classes == 0 {
            return Err(Error::invalid(
                "ResNet::new",
                format!("width, in_channels and classes must be positive: {cfg:?}"),
            ));
        }
        let w = cfg.width;
        let stem = conv_bn(
            (cfg.in_channels, w, 3, 1),
            Activation::Relu,
            ("conv1", "bn1"),
            dev,
            g,
        )?;
        let mut layers = Vec::new();
        let mut cin = w;
        for (stage, &n) in cfg.blocks.iter().enumerate() {
            let cout = w << stage;
            let mut blocks = Vec::new();
            for i in 0..n {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                blocks.push(BasicBlock::new(cin, cout, stride, dev, g)?);
                cin = cout;
            }
            layers.push(blocks);
        }
        let fc = LinearConfig::new(cin, cfg.classes).init::<B>(dev, g)?;
        Ok(ResNet {
            cfg,
            stem,
            layers,
            pool: AdaptiveAvgPool2d::new([1, 1]),
            fc,
        })
    }

    pub fn config(&self) -> &ResNetConfig {
        &self.cfg
    }

    /// Whether eval mode folds each batch norm into its convolution (the default) or runs
    /// convolution, batch norm and activation one after the other (`ConvBnAct::set_fold`),
    /// for comparing the two.
    pub fn set_fold(&mut self, fold: bool) {
        self.stem.set_fold(fold);
        for blocks in &mut self.layers {
            for b in blocks {
                b.layers_mut().for_each(|l| l.set_fold(fold));
            }
        }
    }

    fn children(&self) -> impl Iterator<Item = (String, &BasicBlock<B>)> {
        self.layers.iter().enumerate().flat_map(|(s, blocks)| {
            blocks
                .iter()
                .enumerate()
                .map(move |(i, b)| (format!("layer{}.{i}", s + 1), b))
        })
    }
}

impl<B: Backend> Module<B> for ResNet<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        let mut h = self.stem.forward(x)?;
        for blocks in &self.layers {
            for b in blocks {
                h = b.forward(&h)?;
            }
        }
        let h = self.pool.forward(&h)?.flatten_from(1)?;
        self.fc.forward(&h)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = self.stem.named_parameters();
        for (name, b) in self.children() {
            v.extend(prefixed(&name, b.named_parameters()));
        }
        v.extend(prefixed("fc", self.fc.named_parameters()));
        v
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        let mut v = self.stem.named_buffers();
        for (name, b) in self.children() {
            v.extend(prefixed(&name, b.named_buffers()));
        }
        v
    }
    fn set_training(&mut self, training: bool) {
        self.stem.set_training(training);
        for blocks in &mut self.layers {
            for b in blocks {
                b.set_training(training);
            }
        }
    }
    fn describe(&self) -> String {
        format!("ResNet(CIFAR form, {:?})", self.cfg)
    }
}

/// MNIST's `[784]` digits as `[1, 32, 32]` images, zero-padded by 2 on every side (the CIFAR
/// geometry the network expects), once on the host.
pub fn pad_to_32(ds: &ArrayDataset) -> Result<ArrayDataset> {
    const OP: &str = "pad_to_32";
    let n = Dataset::len(ds);
    if ds.feature_dims().iter().product::<usize>() != 28 * 28 {
        return Err(Error::invalid(
            OP,
            format!(
                "expects 28x28 digits, got samples of {:?}",
                ds.feature_dims()
            ),
        ));
    }
    let src = ds.features().to_f64_vec();
    let mut out = vec![0.0; n * 32 * 32];
    for i in 0..n {
        for r in 0..28 {
            let from = i * 784 + r * 28;
            let to = i * 1024 + (r + 2) * 32 + 2;
            out[to..to + 28].copy_from_slice(&src[from..from + 28]);
        }
    }
    ArrayDataset::new(
        HostBuffer::from_f64(DType::F32, &out),
        [1, 32, 32],
        ds.labels().clone(),
        ds.label_dims().to_vec(),
        n,
    )
}

/// One pass over `loader` in training mode: the mean training loss (read from the device once,
/// at the end) and the samples seen.
pub fn train_epoch<B: Backend, O: Optimizer<B>>(
    model: &mut ResNet<B>,
    loader: &mut DataLoader<B>,
    opt: &mut O,
) -> Result<(f64, usize)> {
    model.set_training(true);
    let mut sum: Option<Tensor<B>> = None;
    let mut seen = 0;
    for batch in loader.iter() {
        let (x, y) = batch?;
        let n = y.elem_count();
        opt.zero_grad();
        let loss = cross_entropy(&model.forward(&Var::constant(x))?, &y, Reduction::Mean)?;
        loss.backward()?;
        opt.step()?;
        let l = loss.tensor().mul_scalar(n as f64)?;
        sum = Some(match sum {
            None => l,
            Some(s) => s.add(&l)?,
        });
        seen += n;
    }
    let mean = match sum {
        Some(s) => s.to_scalar()? / seen.max(1) as f64,
        None => f64::NAN,
    };
    Ok((mean, seen))
}
