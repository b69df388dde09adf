"""Whole models beside their PyTorch twins, on one GPU, for `cargo xtask bench-gpu`.

    python3 bench/models_gpu.py DIR

DIR holds kiln's `gpt` and `bench_train` examples (release builds); the twins are
`bench/gpt_torch.py` (eager and `torch.compile`) and `bench/train_torch.py`, found beside this
script. Prints `BENCH <side> <workload> <value> <unit>` lines that `compare.py` joins:

- `gpt_iter_{f32,tf32,bf16}`: ms per iteration of nanoGPT's shakespeare_char model (10.75M
  parameters, batch 64, context 256), iterations 31-60 of a 60-iteration run, evaluation of 4
  batches per split included on both sides; `torch` is PyTorch eager, `torch_compile` the same
  script with `--compile`; the corpus is `$GPT_DATA` where set (else each side's default);
- `gpt_peak_{f32,bf16}`: the GPU memory a whole GPT run held in tensors at its peak, MiB
  (kiln's allocator peak; PyTorch's `max_memory_allocated`);
- `resnet18_step_{f32,tf32,bf16}` and `resnet18_step_peak_{...}`: the ResNet-18 (CIFAR form)
  SGD step at batch 256 and the peak of a steady step, as `bench_train --which resnet18`;
- `resnet18_eval_{f32,tf32,bf16}` and `resnet18_eval_unfolded_{...}`: its eval forward under
  no_grad at batch 256, as `bench_train --which resnet18-eval`: kiln with each BatchNorm
  folded into its convolution (and cuDNN's fused conv+bias+ReLU graph where it serves), and
  with convolution, BatchNorm and ReLU apart; both beside PyTorch eager (which folds nothing).

Each kiln and PyTorch run is a child process, one after another; a run that fails prints why
and gives no row.
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GPT_ARGS = ["--iters", "60", "--eval-interval", "30", "--eval-iters", "4", "--sample", "0"]


def run(cmd, timeout=300):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"# timed out: {' '.join(cmd)}", flush=True)
        return ""
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        print(f"# failed ({p.returncode}): {' '.join(cmd)}: {' | '.join(tail)}", flush=True)
        return ""
    return p.stdout + p.stderr


def bench(side, name, value, unit):
    print(f"BENCH {side} {name} {value:.3f} {unit}", flush=True)


def gpt(side, cmd, prec):
    data = ["--data", os.environ["GPT_DATA"]] if os.environ.get("GPT_DATA") else []
    out = run(cmd + ["--device", "cuda", "--precision", prec] + GPT_ARGS + data)
    ms = re.findall(r"([\d.]+) ms per iteration", out)
    if ms:
        bench(side, f"gpt_iter_{prec}", float(ms[-1]), "ms")
    peak = re.search(r"peak GPU memory ([\d.]+) MiB", out)
    if peak and prec in ("f32", "bf16") and side != "torch_compile":
        bench(side, f"gpt_peak_{prec}", float(peak.group(1)), "MiB")


def resnet_eval(side, cmd, prec):
    """`resnet18_eval_{prec}` (kiln's batch norms folded) and `resnet18_eval_unfolded_{prec}`:
    ms per eval forward at batch 256 under no_grad, each beside PyTorch's eager forward."""
    out = run(cmd + ["--device", "cuda", "--which", "resnet18-eval", "--precision", prec])
    for line in out.splitlines():
        m = re.search(r"resnet18-eval .* ms_per_step=([\d.]+).*fold=(on|off)", line)
        if m:
            ms = float(m.group(1))
            if side == "torch":  # PyTorch's eager forward is the reference of both rows
                bench(side, f"resnet18_eval_{prec}", ms, "ms")
                bench(side, f"resnet18_eval_unfolded_{prec}", ms, "ms")
            else:
                unfolded = "_unfolded" if m.group(2) == "off" else ""
                bench(side, f"resnet18_eval{unfolded}_{prec}", ms, "ms")


def resnet(side, cmd, prec):
    out = run(cmd + ["--device", "cuda", "--which", "resnet18", "--precision", prec])
    m = re.search(r"ms_per_step=([\d.]+).*step_peak_mib=([\d.]+)", out)
    if m:
        bench(side, f"resnet18_step_{prec}", float(m.group(1)), "ms")
        bench(side, f"resnet18_step_peak_{prec}", float(m.group(2)), "MiB")


def main():
    bins = sys.argv[1]
    py = [sys.executable]
    for prec in ("f32", "tf32", "bf16"):
        gpt("kiln", [os.path.join(bins, "gpt")], prec)
        gpt("torch", py + [os.path.join(HERE, "gpt_torch.py")], prec)
        gpt("torch_compile", py + [os.path.join(HERE, "gpt_torch.py"), "--compile"], prec)
    for prec in ("f32", "tf32", "bf16"):
        resnet("kiln", [os.path.join(bins, "bench_train")], prec)
        resnet("torch", py + [os.path.join(HERE, "train_torch.py")], prec)
    for prec in ("f32", "tf32", "bf16"):
        resnet_eval("kiln", [os.path.join(bins, "bench_train")], prec)
        resnet_eval("torch", py + [os.path.join(HERE, "train_torch.py")], prec)


if __name__ == "__main__":
    main()
