"""PyTorch twin of examples/gemm_layouts.rs: f32 GEMM in each layout, TF32 off."""
import sys, time
import torch

torch.backends.cuda.matmul.allow_tf32 = False
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
iters = 20
dev = "cuda"
a = torch.randn(n, n, device=dev)
b = torch.randn(n, n, device=dev)


def t(f):
    f()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) * 1e3 / iters


flop = 2.0 * n**3
for name, x, y in [("NN", a, b), ("NT", a, b.t()), ("TN", a.t(), b), ("TT", a.t(), b.t())]:
    ms = t(lambda: x @ y)
    print(f"torch gemm {name} n={n} ms={ms:.3f} tflops={flop / ms / 1e9:.2f}")
print(f"torch sum_axis0 n={n} ms={t(lambda: a.sum(0)):.3f}")
print(f"torch transpose_copy n={n} ms={t(lambda: a.t().contiguous()):.3f}")
