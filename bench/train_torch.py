"""PyTorch side of the training benchmarks: the workloads of examples/examples/bench_train.rs in
PyTorch eager (autograd, nn.Sequential, F.cross_entropy, torch.optim.SGD), printing the same
`torch <workload> <device> key=value ...` lines that bench/run_train.sh compares with kiln's.

    python3 bench/train_torch.py --device cuda --which all
    python3 bench/train_torch.py --device cpu --which mlp-small   # no GPU: runs on the CPU

TF32 is off (allow_tf32 = False, or fp32_precision = "ieee" on PyTorch >= 2.9; kiln's default). Timing as in
kiln: warm-up, then `--repeats` runs of `--steps` steps, the device synchronized before each
clock read, median reported; nothing is read back inside the timed loop. Same data as kiln (a
fixed hash of the element index), so logreg's final_cost must match kiln's.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def tf32_off():
    """Turns TF32 off for matmuls (PyTorch's default, made explicit) and says how. PyTorch >= 2.9
    has `fp32_precision` and raises if the legacy `allow_tf32` is then read, so use one API
    only: the new one where it exists."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        try:
            m.fp32_precision = "ieee"
            return f"matmul.fp32_precision={m.fp32_precision}"
        except Exception as e:  # an unexpected build: fall back to the legacy switch
            print(f"fp32_precision not settable ({e}); using allow_tf32", file=sys.stderr)
    m.allow_tf32 = False
    return f"matmul.allow_tf32={m.allow_tf32}"


TF32 = tf32_off()


def pick_device(name):
    if name.startswith("cuda") or name.startswith("gpu"):
        if torch.cuda.is_available():
            d = torch.device("cuda:0" if name in ("cuda", "gpu") else name.replace("gpu", "cuda"))
            torch.cuda.set_device(d)
            return d
        print("no CUDA device found (torch.cuda.is_available() is False); falling back to cpu",
              file=sys.stderr, flush=True)
    return torch.device("cpu")


def data(rows, cols, dev):
    """Element k = (k * 2654435761 mod 2^32) / 2^32 * 2 - 1, in f64, rounded to f32."""
    k = torch.arange(rows * cols, dtype=torch.int64)
    h = (k * 2654435761) & 0xFFFFFFFF
    x = (h.double() / 4294967296.0 * 2.0 - 1.0).float().reshape(rows, cols)
    return x.to(dev)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev, steps, repeats, warmup, step, reset=None, after_warmup=None):
    for _ in range(warmup):
        step()
    if after_warmup:
        after_warmup()
    totals, last = [], None
    for _ in range(repeats):
        if reset:
            reset()
        sync(dev)
        c, t = time.process_time(), time.perf_counter()
        for _ in range(steps):
            last = step()
        sync(dev)
        totals.append(((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3))
    return totals, last


def report(workload, dev, steps, repeats, totals, extra=""):
    """One result line; `totals` holds (wall ms, process CPU ms) per repeat."""
    total = statistics.median(w for w, _ in totals)
    ms = total / steps
    cpu = statistics.median(c for _, c in totals) / steps
    print(
        f"torch {workload} {dev} steps={steps} repeats={repeats} total_ms={total:.3f} "
        f"ms_per_step={ms:.6f} min_ms_per_step={min(w for w, _ in totals) / steps:.6f} "
        f"steps_per_s={1e3 / ms:.1f} cpu_ms_per_step={cpu:.6f}{extra}",
        flush=True,
    )


def logreg(dev, steps, repeats, warmup):
    n, feats, lr, l2 = 400, 784, 0.01, 0.01
    x = data(n, feats, dev)
    y = (x[:, 0] > 0).float()
    neg_y, one_minus_y = -y, 1 - y  # constants of the cost, computed once (as kiln does)
    w = torch.zeros(feats, device=dev, requires_grad=True)
    b = torch.zeros((), device=dev, requires_grad=True)

    def reset():
        with torch.no_grad():
            w.zero_()
            b.zero_()

    def step():
        p = torch.sigmoid(x @ w + b)
        xent = neg_y * torch.log(p) - one_minus_y * torch.log(1 - p)
        cost = xent.mean() + l2 * (w**2).sum()
        cost.backward()
        with torch.no_grad():  # Theano's updates; in place (`w -= ...` would rebind a local)
            w.sub_(lr * w.grad)
            b.sub_(lr * b.grad)
        w.grad = None
        b.grad = None
        return cost

    totals, cost = timed(dev, steps, repeats, warmup, step, reset)
    report("logreg", dev, steps, repeats, totals, f" final_cost={cost.item():.6f}")


def mlp(name, widths, batch, dev, steps, repeats, warmup, precision="f32"):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # PyTorch's default (foreach on CUDA)
    x = data(batch, widths[0], dev)
    labels = (torch.arange(batch) % widths[-1]).to(dev)

    low = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision)
    # f16 as kiln's: autocast with a GradScaler (one overflow check per step); bf16 needs none.
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "f16")

    def step():
        with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
            loss = F.cross_entropy(model(x), labels)
        opt.zero_grad()  # set_to_none=True, as kiln's zero_grad
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    totals, loss = timed(dev, steps, repeats, warmup, step)
    arch = "-".join(map(str, widths))
    report(name, dev, steps, repeats, totals,
           f" batch={batch} arch={arch} loss={loss.item():.6f} precision={precision}")


class _Block(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


def resnet18_eval(dev, steps, repeats, warmup, precision="f32"):
    """kiln's `resnet18-eval` workload: the same ResNet-18's eval-mode forward under
    torch.no_grad at batch 256 (after two training-mode forwards), eager (conv, BatchNorm and
    ReLU apart: PyTorch folds nothing in eager mode), cudnn.benchmark on."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    model = _resnet18_model(dev)
    batch = 256
    x = data(batch, 3 * 32 * 32, dev).reshape(batch, 3, 32, 32)
    low = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision)
    with torch.no_grad():
        for _ in range(2):
            model(x)
    model.eval()

    def step():
        with torch.no_grad(), torch.autocast(dev.type, dtype=low or torch.float32,
                                             enabled=low is not None):
            return model(x)

    totals, y = timed(dev, steps, repeats, warmup, step)
    report("resnet18-eval", dev, steps, repeats, totals,
           f" batch={batch} arch=resnet18-cifar-w64 fold=off precision={precision}"
           f" checksum={y.double().abs().sum().item():.4f}")


def _resnet18_model(dev):
    """ResNet-18 in its CIFAR form (kiln's `examples/resnet`), on `dev`."""
    nn = torch.nn
    layers, cin = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()], 64
    for stage in range(4):
        cout = 64 << stage
        for i in range(2):
            layers.append(_Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers).to(dev)


def resnet18(dev, steps, repeats, warmup, precision="f32"):
    """kiln's `resnet18` workload: ResNet-18 (CIFAR form, width 64) at batch 256, SGD momentum
    0.9, weight decay 5e-4, cudnn.benchmark on; peak_mib is torch.cuda.max_memory_allocated."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    # cuDNN's convolutions default to TF32 in PyTorch (matmuls do not): f32 here means IEEE f32,
    # as kiln's, and tf32 turns it on for both (the same API family as tf32_off's).
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    model = _resnet18_model(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    batch = 256
    x = data(batch, 3 * 32 * 32, dev).reshape(batch, 3, 32, 32)
    labels = (torch.arange(batch) % 10).to(dev)
    low = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "f16")

    def step():
        with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
            loss = F.cross_entropy(model(x), labels)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    # peak_mib over the whole run, step_peak_mib over the timed steps (as kiln's bench_train:
    # the warm-up's cuDNN algorithm search holds workspaces a steady step does not).
    cuda = dev.type == "cuda"
    warm = {}

    def after_warmup():
        if cuda:
            sync(dev)
            warm["peak"] = torch.cuda.max_memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)

    totals, loss = timed(dev, steps, repeats, warmup, step, after_warmup=after_warmup)
    step_peak = torch.cuda.max_memory_allocated(dev) if cuda else float("nan")
    peak = max(warm.get("peak", 0), step_peak) if cuda else float("nan")
    report("resnet18", dev, steps, repeats, totals,
           f" batch={batch} arch=resnet18-cifar-w64 loss={loss.item():.6f} precision={precision}"
           f" peak_mib={peak / 2**20:.0f} step_peak_mib={step_peak / 2**20:.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu if no GPU)")
    ap.add_argument("--which", default="all", choices=["logreg", "mlp-small", "mlp-large", "all", "resnet18",
                                                   "resnet18-eval"])
    ap.add_argument("--steps", type=int, help="steps per repeat (logreg 10000, mlp-small 200, mlp-large 20)")
    ap.add_argument("--repeats", type=int, help="timed repeats, median reported (logreg 3, MLPs 5)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps (200, 20, 3)")
    ap.add_argument("--precision", default="f32", choices=["f32", "tf32", "bf16", "f16"],
                    help="the MLPs' precision, as kiln's bench_train: autocast bf16, or f16 with a "
                         "GradScaler; tf32 turns TF32 on")
    a = ap.parse_args()
    if a.precision == "tf32":
        m = torch.backends.cuda.matmul
        if hasattr(m, "fp32_precision"):
            m.fp32_precision = "tf32"
        else:
            m.allow_tf32 = True
    dev = pick_device(a.device)

    def pick(steps, repeats, warmup):
        return (max(1, a.steps or steps), max(1, a.repeats or repeats),
                warmup if a.warmup is None else a.warmup)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {dev} ({name}), TF32 off ({TF32}), "
          f"{torch.get_num_threads()} CPU threads", file=sys.stderr, flush=True)
    if a.which in ("logreg", "all"):
        logreg(dev, *pick(10000, 3, 200))
    if a.which in ("mlp-small", "all"):
        mlp("mlp-small", [784, 100, 100, 10], 100, dev, *pick(200, 5, 20), a.precision)
    if a.which == "mlp-large" or (a.which == "all" and dev.type == "cuda"):
        mlp("mlp-large", [784, 4096, 4096, 4096, 10], 4096, dev, *pick(20, 5, 3), a.precision)
    elif a.which == "all":
        print("skipping mlp-large on cpu (ask for it with --which mlp-large)", file=sys.stderr)
    if a.which == "resnet18":
        resnet18(dev, *pick(10, 5, 3), a.precision)
    if a.which == "resnet18-eval":
        resnet18_eval(dev, *pick(20, 5, 3), a.precision)


if __name__ == "__main__":
    main()
