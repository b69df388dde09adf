"""Joins `BENCH kiln ...` and `BENCH torch ...` (or `BENCH cupy ...`) lines into one table
(markdown). The reference of a row is PyTorch, or CuPy where PyTorch has no twin.
ratio = kiln/reference for throughputs (GB/s, TFLOP/s), reference/kiln for times (us, ms):
above 1 means kiln is faster. Rows kiln reports alone (unit `frac`: a fraction of another kiln
row in the same run) are listed after the table against ABS_TARGET."""
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
    # issue 13: user-defined fused work and user kernels
    "copy_64M": None,
    "fuse5_64M": None,
    "user_exp_230400_x1000": 1 / 0.6,  # kiln <= 0.6x CuPy's time
    "user_exp_230400_x1000_wall": None,
    "lse_8192x8192": 1.5,
    "lse_8192x8192_manual": 1.5,
}
# kiln-only rows: the value itself against a target
ABS_TARGET = {
    "fuse5_64M_of_copy": 0.9,  # a fused five-op chain at >= 0.9x device copy bandwidth
}
rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 5 and p[0] == "BENCH":
        rows.setdefault(p[2], {})[p[1]] = (float(p[3]), p[4])
    elif "device:" in line:
        print(line.strip())
print("| workload | kiln | reference | unit | ratio (>1: kiln faster) | target | met |")
print("|---|---|---|---|---|---|---|")
alone = []
for name, r in rows.items():
    ref = "torch" if "torch" in r else "cupy" if "cupy" in r else None
    if "kiln" not in r:
        continue
    if ref is None:
        alone.append(name)
        continue
    (k, unit), (t, _) = r["kiln"], r[ref]
    ratio = k / t if unit in ("GB/s", "TFLOP/s") else t / k
    tgt = TARGET.get(name)
    met = "" if tgt is None else ("yes" if ratio >= tgt else "NO")
    label = "PyTorch" if ref == "torch" else "CuPy"
    tgt_s = f"{tgt:.3g}" if tgt else ""
    print(f"| {name} | {k:.3f} | {t:.3f} ({label}) | {unit} | {ratio:.3f} | {tgt_s} | {met} |")
if alone:
    print()
    print("| kiln alone | value | unit | target | met |")
    print("|---|---|---|---|---|")
    for name in alone:
        k, unit = rows[name]["kiln"]
        tgt = ABS_TARGET.get(name)
        met = "" if tgt is None else ("yes" if k >= tgt else "NO")
        print(f"| {name} | {k:.3f} | {unit} | {tgt if tgt else ''} | {met} |")
