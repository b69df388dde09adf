"""CuPy side of `cargo xtask bench-gpu` (issue 13): CuPy's `ElementwiseKernel` twin of
crates/backend-cuda/benches/fuse.rs's `user_exp_230400_x1000`, timed the same way (CUDA
events, median of 5, 1000 launches, the output allocated by each call), printing
`BENCH cupy <name> <value> <unit>` lines for compare.py. Without CuPy it says so and exits 0."""
import time

try:
    import cupy as cp
except ImportError as e:
    print(f"skipped: cupy not available ({e})")
    raise SystemExit(0)


def report(name, value, unit):
    print(f"BENCH cupy {name} {value:.4f} {unit}", flush=True)


def timed(reps, iters, f):
    for _ in range(3):
        f()
    cp.cuda.Device(0).synchronize()
    out = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(iters):
            f()
        b.record()
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) / iters)
    out.sort()
    return out[len(out) // 2]


print(f"cupy {cp.__version__} device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
kexp = cp.ElementwiseKernel("T x", "T y", "y = exp(x)", "kexp")
x = cp.random.uniform(-1.0, 1.0, 230_400, dtype=cp.float32)
ms = timed(5, 1000, lambda: kexp(x))
report("user_exp_230400_x1000", ms * 1000.0, "ms")
t0 = time.perf_counter()
for _ in range(1000):
    kexp(x)
cp.cuda.Device(0).synchronize()
report("user_exp_230400_x1000_wall", (time.perf_counter() - t0) * 1e3, "ms")
