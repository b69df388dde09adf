"""The first minute on a fresh machine: the main job's first GPU run with kiln's kernel cache and
the CUDA driver's compute cache both empty, against a warm run (both caches filled by the cold
run), and a PyTorch process doing a tiny training with an empty driver cache.

    python3 bench/cold_start.py path/to/mnist [rounds]

Prints `BENCH` lines for bench/compare.py (seconds of wall time, whole process, import and
data loading included) and a verdict against the first-minute issue's targets: cold <= 2x warm,
and cold below PyTorch's cold process.

Also measured: a cold run with `KILN_PREBUILT=0` (the fixed kernels' CUBINs built into the binary
ignored, so everything compiles at run time: what cold meant before they existed), and, once, a
cold run with `KILN_CUDA_COMPILE_LOG=1` whose log is summarized (CUBINs per source, NVRTC's
milliseconds, the slowest compiles): where a cold start's seconds go.
"""
import collections
import re
import os
import statistics
import subprocess
import sys
import tempfile
import time

TORCH_TINY = """
import torch, torch.nn as nn, torch.nn.functional as F
dev = "cuda"
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)).to(dev)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
x = torch.rand(6000, 784, device=dev)
y = torch.randint(0, 10, (6000,), device=dev)
for epoch in range(2):
    for i in range(0, 6000, 100):
        loss = F.cross_entropy(m(x[i:i + 100]), y[i:i + 100])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(epoch, loss.item())
"""


def run(cmd, kiln_cache, cuda_cache, log=None, **extra):
    env = dict(os.environ, KILN_KERNEL_CACHE=kiln_cache, CUDA_CACHE_PATH=cuda_cache, **extra)
    # The measured runs get the user's default (prebuilt CUBINs used, no compile log).
    for k in ("KILN_PREBUILT", "KILN_CUDA_COMPILE_LOG"):
        if k not in extra:
            env.pop(k, None)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    if log is not None:
        log.extend(p.stderr.splitlines())
    return wall


LOG_LINE = re.compile(r"^kiln-cuda compile: (\S+) \[(\S+)\] sm_(\d+) (.*) ([0-9.]+) ms( \(on .*\))?$")


def summarize(lines):
    """Prints what KILN_CUDA_COMPILE_LOG=1 reported during one cold run."""
    per = collections.Counter()
    ms = collections.Counter()
    slow = []
    for line in lines:
        if line.startswith("kiln-cuda compile:") and "prebuilt CUBINs in this binary" in line:
            print(line)
        m = LOG_LINE.match(line)
        if not m:
            continue
        file, group, _, how, t, on = m.groups()
        how = how + (" (background)" if on else "")
        per[how] += 1
        ms[how] += float(t)
        slow.append((float(t), f"{file} [{group}] {how}"))
    for how in sorted(per):
        print(f"compile log: {per[how]:4d} x {how:40s} {ms[how]:9.1f} ms")
    for t, what in sorted(slow, reverse=True)[:8]:
        print(f"compile log: slowest {t:9.1f} ms  {what}")


def main():
    mnist = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    data = os.environ.get("MNIST_DIR", "data/mnist")
    job = [mnist, "--device", "cuda", "--epochs", "2", "--data-dir", data]
    cold, warm, torch_cold, unbuilt = [], [], [], []
    with tempfile.TemporaryDirectory() as k, tempfile.TemporaryDirectory() as c:
        lines = []
        wall = run(job, k, c, log=lines, KILN_CUDA_COMPILE_LOG="1")
        print(f"cold run with KILN_CUDA_COMPILE_LOG=1: {wall:.2f} s")
        summarize(lines)
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as k, tempfile.TemporaryDirectory() as c:
            cold.append(run(job, k, c))
            warm.append(run(job, k, c))
        with tempfile.TemporaryDirectory() as k, tempfile.TemporaryDirectory() as c:
            unbuilt.append(run(job, k, c, KILN_PREBUILT="0"))
        with tempfile.TemporaryDirectory() as c:
            torch_cold.append(run([sys.executable, "-c", TORCH_TINY], "", c))
    med = statistics.median
    print(f"cold  {' '.join(f'{v:.2f}' for v in cold)} s")
    print(f"warm  {' '.join(f'{v:.2f}' for v in warm)} s")
    print(f"cold, KILN_PREBUILT=0  {' '.join(f'{v:.2f}' for v in unbuilt)} s (everything compiled at run time)")
    print(f"torch {' '.join(f'{v:.2f}' for v in torch_cold)} s (tiny training, empty driver cache)")
    print(f"BENCH kiln cold_start_mnist_2ep {med(cold):.3f} s")
    print(f"BENCH kiln warm_start_mnist_2ep {med(warm):.3f} s")
    print(f"BENCH kiln cold_start_noprebuilt_mnist_2ep {med(unbuilt):.3f} s")
    # The reference of the cold row: PyTorch's cold tiny training (same row name for compare.py).
    print(f"BENCH torch cold_start_mnist_2ep {med(torch_cold):.3f} s")
    ok = med(cold) <= 2 * med(warm) and med(cold) < med(torch_cold)
    print(
        f"first minute: cold {med(cold):.2f} s = {med(cold) / med(warm):.1f}x warm "
        f"(target <= 2x), PyTorch cold {med(torch_cold):.2f} s: {'MET' if ok else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
