#!/usr/bin/env python3
"""Torch-free companion of mnist_torch_check.py: recomputes the logits of kiln's saved MNIST
model with numpy, following PyTorch's definitions (Linear: x @ W.T + b with W [out, in];
Conv2d: cross-correlation with W [oc, c, kh, kw]; MaxPool2d(2); nn.Sequential indices as
names), and compares them with the logits kiln wrote (--dump-logits). Runs anywhere numpy is.

    python3 bench/mnist_numpy_check.py --weights mlp.safetensors --logits mlp_logits.safetensors
"""

import argparse
import json
import struct
import sys

import numpy as np

DT = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "U8": np.uint8}


def load(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        buf = raw[8 + n + a : 8 + n + b]
        out[k] = np.frombuffer(buf, dtype=np.dtype(DT[v["dtype"]]).newbyteorder("<")).reshape(
            v["shape"]
        )
    return out


def conv2d(x, w, b, pad):
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    out = np.zeros((n, oc, oh, ow), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i : i + oh, j : j + ow]  # n c oh ow
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out + b[None, :, None, None]


def pool2(x):
    n, c, h, w = x.shape
    return x[:, :, : h // 2 * 2, : w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--logits", required=True)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--rtol", type=float, default=1e-6)
    a = p.parse_args()
    s = {k: v.astype(np.float64) for k, v in load(a.weights).items()}
    ref = load(a.logits)
    x = ref["x"].astype(np.float64)
    relu = lambda t: np.maximum(t, 0)
    lin = lambda t, i: t @ s[f"{i}.weight"].T + s[f"{i}.bias"]
    if s["0.weight"].ndim == 4:
        h = pool2(relu(conv2d(x, s["0.weight"], s["0.bias"], 2)))
        h = pool2(relu(conv2d(h, s["3.weight"], s["3.bias"], 0)))
        h = h.reshape(h.shape[0], -1)
        got = lin(relu(lin(relu(lin(h, 7)), 9)), 11)
    else:
        n = len([k for k in s if k.endswith(".weight")])
        h = x
        for i in range(n):
            h = lin(h, 2 * i)
            if i < n - 1:
                h = relu(h)
        got = h
    err = np.abs(got - ref["logits"])
    diff = err.max()
    ok = bool((err <= a.atol + a.rtol * np.abs(got)).all())
    print(
        f"inputs {x.shape}: max|logit| {np.abs(got).max():.2f}, max|numpy(f64)-kiln| = "
        f"{diff:.3e} (allclose atol {a.atol:g} rtol {a.rtol:g}; atol alone "
        f"{'ok' if diff <= a.atol else 'exceeded'})"
    )
    if not ok:
        print("FAIL", file=sys.stderr)
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
