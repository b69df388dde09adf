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
//! the running statistics.
//!
//! [`ModuleExt::train`]: kiln_nn::ModuleExt::train
//! [`ModuleExt::eval`]: kiln_nn::ModuleExt::eval

use kiln_autograd::Var;
use kiln_core::{Backend, DType, Error, Generator, HostBuffer, Reduction, Result, Tensor};
use kiln_data::{ArrayDataset, DataLoader, Dataset};
use kiln_nn::loss::cross_entropy;
use kiln_nn::{
    AdaptiveAvgPool2d, BatchNorm, BatchNormConfig, Conv2d, Conv2dConfig, Linear, LinearConfig,
    Module,
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

/// Two 3×3 convolutions with BatchNorm and a residual connection (a 1×1 projection with
/// BatchNorm when the shape changes).
pub struct BasicBlock<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    downsample: Option<(Conv2d<B>, BatchNorm<B>)>,
}

impl<B: Backend> BasicBlock<B> {
    fn new(
        cin: usize,
        cout: usize,
        stride: usize,
        dev: &B::Device,
        g: &mut Generator,
    ) -> Result<Self> {
        let conv1 = conv(cin, cout, 3, stride, dev, g)?;
        let bn1 = bn(cout, dev)?;
        let conv2 = conv(cout, cout, 3, 1, dev, g)?;
        let bn2 = bn(cout, dev)?;
        let downsample = if stride != 1 || cin != cout {
            Some((conv(cin, cout, 1, stride, dev, g)?, bn(cout, dev)?))
        } else {
            None
        };
        Ok(BasicBlock {
            conv1,
            bn1,
            conv2,
            bn2,
            downsample,
        })
    }
}

impl<B: Backend> Module<B> for BasicBlock<B> {
    fn forward(&self, x: &Var<B>) -> Result<Var<B>> {
        let h = self.bn1.forward(&self.conv1.forward(x)?)?.relu()?;
        let h = self.bn2.forward(&self.conv2.forward(&h)?)?;
        let shortcut = match &self.downsample {
            Some((c, b)) => b.forward(&c.forward(x)?)?,
            None => x.clone(),
        };
        h.add(&shortcut)?.relu()
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed("conv1", self.conv1.named_parameters());
        v.extend(prefixed("bn1", self.bn1.named_parameters()));
        v.extend(prefixed("conv2", self.conv2.named_parameters()));
        v.extend(prefixed("bn2", self.bn2.named_parameters()));
        if let Some((c, b)) = &self.downsample {
            v.extend(prefixed("downsample.0", c.named_parameters()));
            v.extend(prefixed("downsample.1", b.named_parameters()));
        }
        v
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed("bn1", self.bn1.named_buffers());
        v.extend(prefixed("bn2", self.bn2.named_buffers()));
        if let Some((_, b)) = &self.downsample {
            v.extend(prefixed("downsample.1", b.named_buffers()));
        }
        v
    }
    fn set_training(&mut self, training: bool) {
        self.bn1.set_training(training);
        self.bn2.set_training(training);
        if let Some((_, b)) = &mut self.downsample {
            b.set_training(training);
        }
    }
    fn describe(&self) -> String {
        format!(
            "BasicBlock({} -> {}, downsample={})",
            self.conv1.config().in_channels,
            self.conv1.config().out_channels,
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
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
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
        let conv1 = conv(cfg.in_channels, w, 3, 1, dev, g)?;
        let bn1 = bn(w, dev)?;
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
            conv1,
            bn1,
            layers,
            pool: AdaptiveAvgPool2d::new([1, 1]),
            fc,
        })
    }

    pub fn config(&self) -> &ResNetConfig {
        &self.cfg
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
        let mut h = self.bn1.forward(&self.conv1.forward(x)?)?.relu()?;
        for blocks in &self.layers {
            for b in blocks {
                h = b.forward(&h)?;
            }
        }
        let h = self.pool.forward(&h)?.flatten_from(1)?;
        self.fc.forward(&h)
    }
    fn named_parameters(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed("conv1", self.conv1.named_parameters());
        v.extend(prefixed("bn1", self.bn1.named_parameters()));
        for (name, b) in self.children() {
            v.extend(prefixed(&name, b.named_parameters()));
        }
        v.extend(prefixed("fc", self.fc.named_parameters()));
        v
    }
    fn named_buffers(&self) -> Vec<(String, Var<B>)> {
        let mut v = prefixed("bn1", self.bn1.named_buffers());
        for (name, b) in self.children() {
            v.extend(prefixed(&name, b.named_buffers()));
        }
        v
    }
    fn set_training(&mut self, training: bool) {
        self.bn1.set_training(training);
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
