"""16-bit safetensors interchange with PyTorch (issue 30), run on a machine with PyTorch.

    python3 bench/safetensors_16bit_torch.py --write crates/nn/tests/data/torch_16bit.safetensors
        PyTorch's rounding of a fixed set of f32 values (edge cases: ties, subnormals,
        overflow, infinities, NaN, -0) and of 4,096 random ones to torch.float16 and
        torch.bfloat16, saved as tensors "f32", "f16", "bf16". kiln's test
        `crates/nn/tests/torch_safetensors.rs` loads it and checks its own rounding bit for bit.
    python3 bench/safetensors_16bit_torch.py --check FILE
        Loads a file kiln wrote (the same test writes one where KILN_SAFETENSORS_OUT points)
        and checks every tensor "f16"/"bf16" against PyTorch's rounding of tensor "f32".
        Prints one line `SAFETENSORS16 OK ...` or `SAFETENSORS16 FAIL ...`.

The file format is written and parsed here by hand (an 8-byte little-endian header length,
a JSON header, raw little-endian data), so only torch is needed, not the safetensors package."""
import argparse
import json
import struct

import torch

NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
TYPES = {v: k for k, v in NAMES.items()}


def values():
    edge = [0.0, -0.0, 1.0, -2.5, 0.1, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8,
            65504.0, 65519.0, 65520.0, 1e5, 6e-8, 3e-8, 2.9802322e-8, 1e-7, 6.1e-5,
            1e-30, 1e-40, 3.38e38, 3.4e38, float("inf"), float("-inf"), float("nan")]
    g = torch.Generator().manual_seed(30)
    scale = torch.logspace(-10, 10, 4096, dtype=torch.float64).to(torch.float32)
    rand = torch.randn(4096, generator=g) * scale
    return torch.cat([torch.tensor(edge, dtype=torch.float32), rand])


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def load(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        raw = bytearray(data[8 + n + a:8 + n + b])
        t = torch.frombuffer(raw, dtype=torch.uint8).view(TYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    return out


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--write")
    p.add_argument("--check")
    a = p.parse_args()
    if a.write:
        x = values()
        save(a.write, {"f32": x, "f16": x.to(torch.float16), "bf16": x.to(torch.bfloat16)})
        print(f"wrote {a.write}: {x.numel()} values, torch {torch.__version__}")
    if a.check:
        t = load(a.check)
        x = t["f32"]
        bad = []
        for name, dt in (("f16", torch.float16), ("bf16", torch.bfloat16)):
            want, got = x.to(dt), t[name]
            if got.dtype != dt or got.shape != want.shape:
                bad.append(f"{name}: {got.dtype} {tuple(got.shape)}")
                continue
            nan = torch.isnan(want)
            same = (bits(want) == bits(got)) | (nan & torch.isnan(got))
            if not bool(same.all()):
                i = int((~same).nonzero()[0])
                bad.append(f"{name}: {int((~same).sum())} differ, first at {i}: f32 {x[i].item()!r}"
                           f" torch {bits(want)[i].item() & 0xffff:#06x} kiln"
                           f" {bits(got)[i].item() & 0xffff:#06x}")
        verdict = "OK" if not bad else "FAIL " + "; ".join(bad)
        print(f"SAFETENSORS16 {verdict} ({x.numel()} values, torch {torch.__version__})")


if __name__ == "__main__":
    main()
