#!/usr/bin/env python3
"""numpy side of the fused-expression benchmark (crates/backend-cpu/benches/fuse.rs runs kiln's).

Same workloads, same sizes, same statistic (median and min per call):

- chain5_32m: exp(a * b + 1) * 0.5 - b over two 32M-element float32 vectors, as numpy users
  write it (five ufunc calls, each allocating its result), and with preallocated temporaries
  (`out=`, no allocation);
- lse_rows_4096x4096: log(sum(exp(x - m), axis=1)) + m given the row maxima m.

Run it with the OpenBLAS overrides of this machine removed (as bench/cpu_numpy.py says):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/fuse_numpy.py
"""

import platform
import statistics
import time

import numpy as np


def bench(fn, min_time=3.0, min_reps=10):
    """(median, min) seconds per call."""
    fn()
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def report(name, secs):
    med, best = secs
    print(f"{name:40s} median {med * 1e3:9.2f} ms   (min {best * 1e3:9.2f} ms)")


def main():
    print(f"numpy {np.__version__}, python {platform.python_version()}")
    rng = np.random.default_rng(0)
    n = 32 << 20
    a = rng.random(n, dtype=np.float32)
    b = rng.random(n, dtype=np.float32)

    def chain():
        return np.exp(a * b + 1.0) * 0.5 - b

    t1 = np.empty_like(a)
    t2 = np.empty_like(a)

    def chain_out():
        np.multiply(a, b, out=t1)
        np.add(t1, 1.0, out=t1)
        np.exp(t1, out=t1)
        np.multiply(t1, 0.5, out=t1)
        np.subtract(t1, b, out=t2)
        return t2

    assert np.allclose(chain(), chain_out())
    report("chain5_32m/expression", bench(chain))
    report("chain5_32m/out=", bench(chain_out))

    r = 4096
    x = rng.uniform(-5.0, 5.0, (r, r)).astype(np.float32)
    m = x.max(axis=1, keepdims=True)

    def lse():
        return np.log(np.exp(x - m).sum(axis=1, keepdims=True)) + m

    report("lse_rows_4096x4096/expression", bench(lse))


if __name__ == "__main__":
    main()
