#!/usr/bin/env python3
"""Summarizes the last criterion run of the kiln CPU bench (`criterion_summary.py [DIR]
[GROUP...]`, all groups when none is named) the way bench/cpu_numpy.py reports:
median and min over samples of the time per iteration (each criterion sample is the mean of
many iterations, so its min is, if anything, kinder to the other side)."""

import json
import pathlib
import statistics
import sys

WORK = {  # elements (or flops) per iteration, to print a rate
    "sgemm_1024": (2 * 1024**3, "GFLOP/s"),
    "exp_230400": (230_400, "Gelem/s"),
    "add_32m": (32 << 20, "Gelem/s"),
    "misc": (512_000, "Gelem/s"),
}

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")
# Further arguments: the groups to show (target/criterion also keeps other benches' last runs).
only = set(sys.argv[2:])
for f in sorted(root.glob("*/*/new/sample.json")):
    group, name = f.parts[-4], f.parts[-3]
    if only and group not in only:
        continue
    s = json.loads(f.read_text())
    per = [t / i for t, i in zip(s["times"], s["iters"])]  # ns per iteration
    med, best = statistics.median(per) / 1e9, min(per) / 1e9
    work, unit = WORK.get(group, (1, "Gop/s"))
    print(
        f"{group + '/' + name:32s} median {med * 1e6:10.1f} us  {work / med / 1e9:8.2f} {unit}"
        f"   (min {best * 1e6:10.1f} us  {work / best / 1e9:8.2f})"
    )
