#!/usr/bin/env python3
"""The PyTorch twin of kiln's ``examples/resnet``: ResNet-18 in its CIFAR form on MNIST padded
to 32x32, with the same flags and output lines, so the two can be run one after the other on
the GPU machine and their ``samples/s``, losses and accuracies compared line by line.

    python3 bench/resnet_torch.py --device cuda                   # width 64, 10 epochs
    cargo run --release --example resnet -- --device cuda          # kiln, same run

Same as kiln: the bundled 4,000 training / 1,000 test digits of ``data/mnist`` (or
``--data-dir``), pixels / 255, zero-padded by 2 on every side; a 3x3 stem conv (no bias) +
BatchNorm + ReLU, no max-pool, BasicBlocks [2, 2, 2, 2] at widths w, 2w, 4w, 8w (stride 2 and a
1x1 conv + BatchNorm projection at the first block of stages 2-4), global average pool,
Linear; torchvision's parameter names; PyTorch's default initializers (which kiln's are);
SGD momentum 0.9, weight decay 5e-4, constant lr; BatchNorm momentum 0.1, eps 1e-5; the test
set in eval mode. Different: the random numbers (torch's generators, not kiln's Philox), so the
initial weights and the batch order differ; the distributions do not. TF32 is off, as in kiln.

State dicts move both ways (safetensors, the same names and buffers as kiln's, BatchNorm's
``num_batches_tracked`` included): ``--save``/``--load`` as kiln's flags, and
``--check-logits FILE`` (after ``--load``) runs the model in eval mode on the inputs ``x`` of a
file kiln's ``--dump-logits`` wrote and prints ``LOGITS max|diff| ...`` against its ``logits``.
"""

import argparse
import gzip
import os
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, in_channels, classes, width, blocks=(2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        cin = width
        for stage, n in enumerate(blocks):
            cout = width << stage
            layer = []
            for i in range(n):
                layer.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layer))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        for stage in range(4):
            h = getattr(self, f"layer{stage + 1}")(h)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def read_idx(path):
    """An IDX file (gzipped or not) as (dims, bytes)."""
    if not os.path.exists(path):
        path += ".gz"
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return dims, data[4 + 4 * ndim:]


def load_split(d, images, labels, limit=None):
    (n, h, w), pix = read_idx(os.path.join(d, images))
    (_,), lab = read_idx(os.path.join(d, labels))
    x = torch.frombuffer(bytearray(pix), dtype=torch.uint8).float().div_(255).view(n, 1, h, w)
    y = torch.frombuffer(bytearray(lab), dtype=torch.uint8).long()
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return F.pad(x, (2, 2, 2, 2)), y


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--train-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(HERE, "..", "data", "mnist"))
    p.add_argument("--save", help="save the trained weights (safetensors)")
    p.add_argument("--load", help="load weights (a file from kiln's or this --save) first")
    p.add_argument("--dump-logits", help="write x and eval-mode logits of 100 test digits")
    p.add_argument("--check-logits", help="compare with the logits of a kiln --dump-logits file")
    a = p.parse_args()

    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    tiny = dev.type == "cpu" and a.width is None
    width = a.width if a.width is not None else (8 if tiny else 64)
    epochs = a.epochs if a.epochs is not None else (1 if tiny else 10)
    torch.manual_seed(a.seed)

    data_dir = os.path.realpath(a.data_dir)
    xtr, ytr = load_split(data_dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                          a.train_samples)
    xte, yte = load_split(data_dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    xtr, ytr, xte, yte = (t.to(dev) for t in (xtr, ytr, xte, yte))

    model = ResNet(1, 10, width).to(dev)
    if a.load:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(a.load, device=str(dev)))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum,
                          weight_decay=a.weight_decay)
    n_params = sum(q.numel() for q in model.parameters())
    print(f"resnet: ResNet-18 (CIFAR form, width {width}), {n_params} parameters on {dev}, "
          f"{len(ytr)} train / {len(yte)} test digits padded to 32x32 from {data_dir}")
    print(f"SGD lr {a.lr}, momentum {a.momentum}, weight decay {a.weight_decay}, "
          f"batch {a.batch_size}, {epochs} epochs, seed {a.seed}")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    g = torch.Generator().manual_seed(a.seed)
    for epoch in range(1, epochs + 1):
        model.train()
        sync()
        t0 = time.perf_counter()
        perm = torch.randperm(len(ytr), generator=g).to(dev)
        total, seen = torch.zeros((), device=dev), 0
        for i in range(0, len(ytr), a.batch_size):
            idx = perm[i:i + a.batch_size]
            x, y = xtr[idx], ytr[idx]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach() * len(y)
            seen += len(y)
        train_loss = total.item() / max(seen, 1)
        sync()
        secs = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            test_loss, correct = 0.0, 0
            for i in range(0, len(yte), 500):
                logits = model(xte[i:i + 500])
                test_loss += F.cross_entropy(logits, yte[i:i + 500], reduction="sum").item()
                correct += (logits.argmax(1) == yte[i:i + 500]).sum().item()
        print(f"epoch {epoch:>3}  train loss {train_loss:.4f}  test loss "
              f"{test_loss / len(yte):.4f}  test acc {100 * correct / len(yte):>6.2f}%  "
              f"{seen / secs:>8.0f} samples/s")
    if epochs > 0:
        print(f"trained in {time.perf_counter() - start:.1f} s")
    exchange(model, a, xte, dev)


def exchange(model, a, xte, dev):
    """--save, --dump-logits and --check-logits (the state-dict exchange with kiln)."""
    from safetensors.torch import load_file, save_file
    model.eval()
    if a.save:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.save)
        print(f"saved weights to {a.save}")
    if a.dump_logits:
        x = xte[:100].contiguous()
        with torch.no_grad():
            save_file({"x": x, "logits": model(x).contiguous()}, a.dump_logits)
        print(f"wrote 100 inputs and their logits to {a.dump_logits}")
    if a.check_logits:
        f = load_file(a.check_logits, device=str(dev))
        with torch.no_grad():
            mine = model(f["x"])
        diff = (mine - f["logits"]).abs().max().item()
        scale = f["logits"].abs().max().item()
        same_x = torch.equal(f["x"], xte[:f["x"].shape[0]])
        agree = (mine.argmax(1) == f["logits"].argmax(1)).float().mean().item()
        print(f"LOGITS max|diff| {diff:.3g} (max|logit| {scale:.3g}), argmax agree "
              f"{100 * agree:.1f}%, inputs equal to this script's: {same_x}")


if __name__ == "__main__":
    main()
