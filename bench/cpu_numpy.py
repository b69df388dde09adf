#!/usr/bin/env python3
"""numpy side of the CPU benchmarks (crates/backend-cpu/benches/cpu.rs runs the kiln side).

Prints one line per workload with the median time and the throughput, and the versions,
BLAS and threads in use, so that BENCHMARKS.md can show both sides measured on one machine.

Run it with the OpenBLAS overrides of this machine removed, or numpy falls back to a slow
generic kernel:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/cpu_numpy.py
"""

import os
import platform
import statistics
import time

import numpy as np


def bench(fn, min_time=1.0, min_reps=10):
    """(median, min) seconds per call over enough repetitions to fill about `min_time`."""
    fn()  # warm up (page in, pick kernels)
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def report(name, secs, work, unit):
    med, best = secs
    print(
        f"{name:32s} median {med * 1e6:10.1f} us  {work / med / 1e9:8.2f} {unit}"
        f"   (min {best * 1e6:10.1f} us  {work / best / 1e9:8.2f})"
    )


def main():
    print(f"numpy {np.__version__}, python {platform.python_version()}")
    try:
        from threadpoolctl import threadpool_info

        for p in threadpool_info():
            print(
                f"  blas: {p.get('internal_api')} {p.get('version')} "
                f"arch={p.get('architecture')} threads={p.get('num_threads')} "
                f"({os.path.basename(p.get('filepath', ''))})"
            )
    except ImportError:
        print("  (threadpoolctl not installed: pip install threadpoolctl)")
    print(
        "  OPENBLAS_CORETYPE="
        + os.environ.get("OPENBLAS_CORETYPE", "<unset>")
        + " OPENBLAS_L2_SIZE="
        + os.environ.get("OPENBLAS_L2_SIZE", "<unset>")
    )

    rng = np.random.default_rng(0)
    n = 1024
    a = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    b = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    c = np.empty((n, n), np.float32)
    flops = 2 * n**3
    report("sgemm_1024 a@b (out=)", bench(lambda: np.matmul(a, b, out=c)), flops, "GFLOP/s")
    report("sgemm_1024 a.T@b (out=)", bench(lambda: np.matmul(a.T, b, out=c)), flops, "GFLOP/s")
    report("sgemm_1024 a@b (alloc)", bench(lambda: a @ b), flops, "GFLOP/s")

    x = rng.uniform(-5, 5, 230_400).astype(np.float32)
    y = np.empty_like(x)
    report("exp_230400 (out=)", bench(lambda: np.exp(x, out=y)), x.size, "Gelem/s")
    report("exp_230400 (alloc)", bench(lambda: np.exp(x)), x.size, "Gelem/s")

    m = 32 << 20
    p = rng.uniform(0, 1, m).astype(np.float32)
    q = rng.uniform(0, 1, m).astype(np.float32)
    r = np.empty_like(p)
    report("add_32m (out=)", bench(lambda: np.add(p, q, out=r), min_time=2.0), m, "Gelem/s")
    report("add_32m (alloc)", bench(lambda: p + q, min_time=2.0), m, "Gelem/s")

    s = rng.uniform(-5, 5, (512, 1000)).astype(np.float32)

    def softmax():
        e = np.exp(s - s.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    report("softmax_512x1000", bench(softmax), s.size, "Gelem/s")
    report("sum_rows_512x1000", bench(lambda: s.sum(axis=1)), s.size, "Gelem/s")
    report("sum_cols_512x1000", bench(lambda: s.sum(axis=0)), s.size, "Gelem/s")


if __name__ == "__main__":
    main()
