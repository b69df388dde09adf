#!/usr/bin/env python3
"""Checks that weights saved by kiln load into the equivalent PyTorch nn.Sequential and give
the same logits.

kiln names parameters exactly like a PyTorch ``state_dict`` of the same ``nn.Sequential``
(``0.weight``, ``0.bias``, ``2.weight``, ...; Linear weights are ``[out, in]``), so
``load_state_dict(strict=True)`` must accept the file as is, with no renaming or transposing.

Produce the two files with the MNIST example (any device), then run this script where torch and
safetensors are installed (the GPU machine has both):

    cargo run --release --example mnist -- --epochs 1 --save mlp.safetensors \
        --dump-logits mlp_logits.safetensors
    python3 bench/mnist_torch_check.py --weights mlp.safetensors --logits mlp_logits.safetensors

``--dump-logits`` writes ``x`` (the first test images, as the model sees them) and ``logits``
(kiln's output for them, in eval mode). The script exits non-zero when the state dict does not
load strictly or when a logit differs from PyTorch's float64 result by more than
``atol + rtol * |logit|`` (defaults 1e-5 and 1e-6, i.e. ``torch.allclose``; it also says whether
the plain 1e-5 absolute bound holds).
"""

import argparse
import sys

import torch
from safetensors.torch import load_file
from torch import nn


def mlp(n_in=784, hidden=(100, 100), n_out=10):
    layers, d = [], n_in
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    layers.append(nn.Linear(d, n_out))
    return nn.Sequential(*layers)


def lenet():
    # Must match `lenet` in examples/examples/mnist.rs, layer for layer (indices are names).
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", required=True, help="kiln --save file (safetensors)")
    p.add_argument("--logits", required=True, help="kiln --dump-logits file (x and logits)")
    p.add_argument("--arch", choices=["auto", "mlp", "lenet"], default="auto")
    p.add_argument("--atol", type=float, default=1e-5)
    # f32 logits of magnitude ~25 carry ~2e-6 rounding per operation, so a long dot product
    # lands near 1e-5 in absolute terms; the test is allclose-style: |d| <= atol + rtol*|ref|.
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    state = load_file(args.weights)
    arch = args.arch
    if arch == "auto":
        arch = "lenet" if state["0.weight"].dim() == 4 else "mlp"
    if arch == "lenet":
        model = lenet()
    else:
        # Widths come from the file, so `--hidden`-style variants check too.
        n = len([k for k in state if k.endswith(".weight")])
        ws = [state[f"{2 * i}.weight"] for i in range(n)]
        model = mlp(ws[0].shape[1], [w.shape[0] for w in ws[:-1]], ws[-1].shape[0])
    model.load_state_dict(state, strict=True)  # raises on missing/unexpected/shape mismatch
    model = model.to(args.device).eval()

    ref = load_file(args.logits)
    x, want = ref["x"].to(args.device), ref["logits"].to(args.device)
    # TF32 would perturb the comparison on Ampere+; kiln's default is full precision too.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with torch.no_grad():
        # The verdict compares kiln's f32 logits with PyTorch's in f64 (the exact answer for
        # these weights), so only kiln's own rounding counts; PyTorch's f32 result is shown too
        # (two f32 implementations differ by both their roundings).
        got64 = model.double()(x.double())
        got32 = model.float()(x.float())
    err = (got64 - want.double()).abs()
    diff = err.max().item()
    ok = bool((err <= args.atol + args.rtol * got64.abs()).all())
    diff32 = (got32 - want.float()).abs().max().item()
    agree = (got64.argmax(1) == want.argmax(1)).float().mean().item()
    print(
        f"arch={arch} device={args.device} inputs={tuple(x.shape)} "
        f"max|logit|={want.abs().max().item():.2f}\n"
        f"  max|torch f64 - kiln f32| = {diff:.3e} (allclose atol {args.atol:g}, "
        f"rtol {args.rtol:g}: {'ok' if ok else 'FAIL'}; atol alone: "
        f"{'ok' if diff <= args.atol else 'exceeded'})\n"
        f"  max|torch f32 - kiln f32| = {diff32:.3e}\n"
        f"  argmax agreement = {agree:.4f}"
    )
    if not ok:
        print("FAIL: logits differ", file=sys.stderr)
        sys.exit(1)
    print("OK: kiln weights load into torch (strict) and give the same logits")


if __name__ == "__main__":
    main()
