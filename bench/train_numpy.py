"""numpy side of the CPU training benchmarks: the workloads of
examples/examples/bench_train.rs written by hand in numpy (forward, loss, backward, update),
printing the same `numpy <workload> <device> key=value ...` lines that bench/run_train.sh
compares with kiln's.

    python3 bench/train_numpy.py --which mlp-small
    python3 bench/train_numpy.py --which all      # logreg + mlp-small (mlp-large only by name)

Same data as kiln (a fixed hash of the element index, see `data`), so logreg's final_cost
must match kiln's; the MLP starts from PyTorch-style uniform weights (numpy's RNG, so its loss
differs from kiln's in the digits, not in magnitude). float32 throughout, as kiln.
Benchmark against an unmodified numpy: bench/run_train.sh unsets OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE for this command only and prints which BLAS kernel numpy then uses.
"""

import argparse
import platform
import statistics
import sys
import time

import numpy as np

F32 = np.float32


def data(rows, cols):
    """Element k = (k * 2654435761 mod 2^32) / 2^32 * 2 - 1, in f64, rounded to f32."""
    k = np.arange(rows * cols, dtype=np.uint64)
    h = (k * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)
    return (h.astype(np.float64) / 4294967296.0 * 2.0 - 1.0).astype(F32).reshape(rows, cols)


def report(workload, sizes, totals, extra=""):
    """One result line; `totals` holds (wall ms, process CPU ms) per repeat."""
    steps, repeats = sizes
    total = statistics.median(w for w, _ in totals)
    ms = total / steps
    cpu = statistics.median(c for _, c in totals) / steps
    print(
        f"numpy {workload} cpu steps={steps} repeats={repeats} total_ms={total:.3f} "
        f"ms_per_step={ms:.6f} min_ms_per_step={min(w for w, _ in totals) / steps:.6f} "
        f"steps_per_s={1e3 / ms:.1f} cpu_ms_per_step={cpu:.6f}{extra}",
        flush=True,
    )


def timed(sizes, warmup, step, reset=None):
    steps, repeats = sizes
    for _ in range(warmup):
        step()
    totals, last = [], None
    for _ in range(repeats):
        if reset:
            reset()
        c, t = time.process_time(), time.perf_counter()
        for _ in range(steps):
            last = step()
        totals.append(((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3))
    return totals, last


def logreg(sizes, warmup):
    n, feats, lr, l2 = 400, 784, F32(0.01), F32(0.01)
    x = data(n, feats)
    y = (x[:, 0] > 0).astype(F32)
    neg_y, one_minus_y = -y, F32(1) - y
    st = {}

    def reset():
        st["w"] = np.zeros(feats, F32)
        st["b"] = F32(0)

    def step():
        w, b = st["w"], st["b"]
        p = 1 / (1 + np.exp(-(x @ w + b)))
        cost = (neg_y * np.log(p) - one_minus_y * np.log(1 - p)).mean() + l2 * (w * w).sum()
        # d cost / d z = (p - y) / n for the sigmoid + cross-entropy pair.
        gz = (p - y) / F32(n)
        gw = x.T @ gz + (2 * l2) * w
        gb = gz.sum()
        st["w"] = w - lr * gw
        st["b"] = F32(b - lr * gb)
        return cost

    reset()
    totals, cost = timed(sizes, warmup, step, reset)
    report("logreg", sizes, totals, f" final_cost={float(cost):.6f}")


def mlp(name, widths, batch, sizes, warmup, lr=F32(0.1)):
    rng = np.random.default_rng(0)
    params = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        bound = 1 / np.sqrt(fan_in)  # PyTorch's Linear default, for both W and b
        params.append(
            [
                rng.uniform(-bound, bound, (fan_out, fan_in)).astype(F32),
                rng.uniform(-bound, bound, fan_out).astype(F32),
            ]
        )
    x = data(batch, widths[0])
    labels = np.arange(batch) % widths[-1]
    rows = np.arange(batch)

    def step():
        # forward, keeping each layer's input
        acts, h = [], x
        for i, (w, b) in enumerate(params):
            acts.append(h)
            h = h @ w.T + b
            if i + 1 < len(params):
                np.maximum(h, 0, out=h)
        # softmax cross-entropy (mean over the batch) and its gradient softmax - onehot
        h -= h.max(axis=1, keepdims=True)
        e = np.exp(h)
        s = e.sum(axis=1, keepdims=True)
        loss = float(np.log(s[:, 0]).mean() - h[rows, labels].mean())
        g = e / s
        g[rows, labels] -= 1
        g /= F32(batch)
        # backward and SGD, last layer first
        for i in range(len(params) - 1, -1, -1):
            w, b = params[i]
            a = acts[i]
            gw = g.T @ a
            gb = g.sum(axis=0)
            if i > 0:
                g = g @ w
                g *= a > 0  # ReLU'(input of layer i) from its output a
            w -= lr * gw
            b -= lr * gb
        return loss

    totals, loss = timed(sizes, warmup, step)
    arch = "-".join(map(str, widths))
    report(name, sizes, totals, f" batch={batch} arch={arch} loss={loss:.6f}")


def blas_info():
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(
            f"{i.get('internal_api')} {i.get('version')} kernel={i.get('architecture')} "
            f"threads={i.get('num_threads')}"
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        ) or "unknown"
    except ImportError:
        return "unknown (pip install threadpoolctl to see the kernel)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", default="all", choices=["logreg", "mlp-small", "mlp-large", "all"])
    ap.add_argument("--steps", type=int, help="steps per repeat (logreg 10000, mlp-small 200, mlp-large 20)")
    ap.add_argument("--repeats", type=int, help="timed repeats, median reported (logreg 3, MLPs 5)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps (200, 20, 3)")
    a = ap.parse_args()

    def pick(steps, repeats, warmup):
        return (max(1, a.steps or steps), max(1, a.repeats or repeats)), (
            warmup if a.warmup is None else a.warmup
        )

    print(
        f"numpy {np.__version__} python {platform.python_version()} blas: {blas_info()}",
        file=sys.stderr,
        flush=True,
    )
    if a.which in ("logreg", "all"):
        logreg(*pick(10000, 3, 200))
    if a.which in ("mlp-small", "all"):
        mlp("mlp-small", [784, 100, 100, 10], 100, *pick(200, 5, 20))
    if a.which == "mlp-large":
        mlp("mlp-large", [784, 4096, 4096, 4096, 10], 4096, *pick(20, 5, 3))
    elif a.which == "all":
        print("skipping mlp-large on cpu (ask for it with --which mlp-large)", file=sys.stderr)


if __name__ == "__main__":
    main()
