"""Joins `BENCH kiln ...` and `BENCH torch ...` lines into one table (markdown).
ratio = kiln/torch for throughputs (GB/s, TFLOP/s), torch/kiln for times (us, ms):
above 1 means kiln is faster."""
import sys

TARGET = {
    "exp_230400_x1000": 1.0,
    "exp_230400_x1000_wall": 1.0,
    "add_256M": 0.9,
    "sum_256M": 0.9,
    "chain6_64M": 1.0,
    "chain6_64M_unfused": None,
    "softmax_8192x8192": 1.0,
    "sgemm_4096": 0.97,
    "sgemm_8192": 0.97,
    "alloc_free_1000x230400": 1.0,
    "alloc1000_then_free1000_x230400": 1.0,
    "exp_230400_x1000_driverpool": None,
    "alloc_free_1000x230400_driverpool": None,
    "alloc1000_then_free1000_x230400_driverpool": None,
    # transfers of 256 MB (the transfers issue's targets)
    "h2d_pageable_256MB": 1.5,
    "h2d_pinned_256MB": 0.95,
    "d2h_pageable_256MB": 1.5,
    "d2h_into_buffer_256MB": 1.5,
    "d2h_pinned_256MB": 0.95,
    "h2d_pinned_256MB_call_returns": None,
    "exp_230400_to_host_x1000": 1.0,
    "exp_230400_into_buffer_x1000": 1.0,
}
rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 5 and p[0] == "BENCH":
        rows.setdefault(p[2], {})[p[1]] = (float(p[3]), p[4])
    elif "device:" in line:
        print(line.strip())
print("| workload | kiln | PyTorch | unit | ratio (>1: kiln faster) | target | met |")
print("|---|---|---|---|---|---|---|")
for name, r in rows.items():
    if "kiln" not in r or "torch" not in r:
        continue
    (k, unit), (t, _) = r["kiln"], r["torch"]
    ratio = k / t if unit in ("GB/s", "TFLOP/s") else t / k
    tgt = TARGET.get(name)
    met = "" if tgt is None else ("yes" if ratio >= tgt else "NO")
    print(f"| {name} | {k:.3f} | {t:.3f} | {unit} | {ratio:.3f} | {tgt if tgt else ''} | {met} |")
