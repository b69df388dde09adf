"""PyTorch side of `cargo xtask bench-gpu`: the same workloads as
crates/backend-cuda/benches/gpu.rs, timed the same way (CUDA events, median of 5), printing
`BENCH torch <name> <value> <unit>` lines for compare.py."""
import time

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")
dev = torch.device("cuda:0")


def report(name, value, unit):
    print(f"BENCH torch {name} {value:.4f} {unit}", flush=True)


def timed(reps, iters, f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            f()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / iters)
    out.sort()
    return out[len(out) // 2]


print(f"torch {torch.__version__} device: {torch.cuda.get_device_name(0)}")
g = torch.Generator(device=dev).manual_seed(0)


def rand(*shape):
    return torch.rand(*shape, device=dev, generator=g) * 2 - 1


x = rand(230_400)
y = torch.empty_like(x)
ms = timed(5, 1000, lambda: torch.exp(x, out=y))
report("exp_230400_x1000", ms * 1000.0, "ms")
report("exp_230400_x1000_driverpool", ms * 1000.0, "ms")
t0 = time.perf_counter()
for _ in range(1000):
    torch.exp(x, out=y)
torch.cuda.synchronize()
report("exp_230400_x1000_wall", (time.perf_counter() - t0) * 1e3, "ms")


def dropped():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    last = None
    for _ in range(1000):
        last = torch.exp(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


runs = sorted(dropped() for _ in range(7))
report("exp_230400_dropped_x1000_wall", runs[3], "ms")
report("exp_230400_record_drop_x1000_wall", runs[3], "ms")
report("exp_230400_dropped_x1000_unfused_wall", runs[3], "ms")

n = 256 << 20
a, b = rand(n), rand(n)
ms = timed(5, 5, lambda: a + b)
report("add_256M", 3 * 4 * n / (ms * 1e-3) / 1e9, "GB/s")
ms = timed(5, 5, lambda: a.sum())
report("sum_256M", 4 * n / (ms * 1e-3) / 1e9, "GB/s")
del a, b

n = 64 << 20
x6, y6 = rand(n), rand(n)
ms = timed(5, 5, lambda: ((x6 * y6 + 0.5).sigmoid() * x6 - y6).square())
report("chain6_64M", 12 * n / (ms * 1e-3) / 1e9, "GB/s")
report("chain6_64M_unfused", 12 * n / (ms * 1e-3) / 1e9, "GB/s")
del x6, y6

s = rand(8192, 8192)
ms = timed(5, 10, lambda: torch.softmax(s, dim=-1))
report("softmax_8192x8192", 2 * 4 * 8192 * 8192 / (ms * 1e-3) / 1e9, "GB/s")
del s

for m in (4096, 8192):
    p, q = rand(m, m), rand(m, m)
    ms = timed(5, 10 if m == 4096 else 3, lambda: p @ q)
    report(f"sgemm_{m}", 2 * m**3 / (ms * 1e-3) / 1e12, "TFLOP/s")
del p, q

for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
    m = 8192
    p, q = rand(m, m).to(dt), rand(m, m).to(dt)
    ms = timed(5, 5, lambda: p @ q)
    report(f"gemm_{tag}_{m}", 2 * m**3 / (ms * 1e-3) / 1e12, "TFLOP/s")
    del p, q

n = 64 << 20
for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
    x6, y6 = rand(n).to(dt), rand(n).to(dt)
    ms = timed(5, 5, lambda: ((x6 * y6 + 0.5).sigmoid() * x6 - y6).square())
    report(f"chain6_64M_{tag}", 6 * n / (ms * 1e-3) / 1e9, "GB/s")
    ms = timed(5, 5, lambda: x6.clone())
    report(f"copy_64M_{tag}", 4 * n / (ms * 1e-3) / 1e9, "GB/s")
    del x6, y6

for _ in range(2):
    torch.empty(230_400, device=dev)
torch.cuda.synchronize()
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(1000):
        t = torch.empty(230_400, device=dev)
        del t
    torch.cuda.synchronize()
    best = min(best, (time.perf_counter() - t0) * 1e6)
report("alloc_free_1000x230400", best, "us")
report("alloc_free_1000x230400_driverpool", best, "us")
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    v = [torch.empty(230_400, device=dev) for _ in range(1000)]
    del v
    torch.cuda.synchronize()
    best = min(best, (time.perf_counter() - t0) * 1e6)
report("alloc1000_then_free1000_x230400", best, "us")
report("alloc1000_then_free1000_x230400_driverpool", best, "us")

# ---- host<->GPU transfers (twins of crates/backend-cuda/benches/transfer.rs): the user's
# whole call, wall clock, synchronized, median of 7.


def wall(f):
    for _ in range(2):
        f()
    v = []
    for _ in range(7):
        t = time.perf_counter()
        f()
        v.append(time.perf_counter() - t)
    v.sort()
    return v[len(v) // 2]


n = 64 << 20
nbytes = 4 * n
host = (torch.arange(n, dtype=torch.int64) % 977).to(torch.float32)
pinned = host.pin_memory()
gb = lambda s: nbytes / s / 1e9


def h2d(src, **kw):
    t = src.to(dev, **kw)
    torch.cuda.synchronize()
    del t


report("h2d_pageable_256MB", gb(wall(lambda: h2d(host))), "GB/s")
report("h2d_pinned_256MB", gb(wall(lambda: h2d(pinned, non_blocking=True))), "GB/s")
t0 = time.perf_counter()
gt = pinned.to(dev, non_blocking=True)
call = time.perf_counter() - t0
torch.cuda.synchronize()
report("h2d_pinned_256MB_call_returns", call * 1e3, "ms")
gt = host.to(dev)
torch.cuda.synchronize()
report("d2h_pageable_256MB", gb(wall(lambda: gt.cpu())), "GB/s")
buf = torch.empty(n, dtype=torch.float32)
report("d2h_into_buffer_256MB", gb(wall(lambda: buf.copy_(gt))), "GB/s")
pbuf = torch.empty(n, dtype=torch.float32).pin_memory()
report("d2h_pinned_256MB", gb(wall(lambda: pbuf.copy_(gt))), "GB/s")
del gt, buf, pbuf, pinned
x = rand(230_400)


def exp_loop():
    for _ in range(1000):
        torch.exp(x).cpu()


report("exp_230400_to_host_x1000", wall(exp_loop) * 1e3, "ms")
out = torch.empty(230_400, dtype=torch.float32)


def exp_into():
    for _ in range(1000):
        out.copy_(torch.exp(x))


report("exp_230400_into_buffer_x1000", wall(exp_into) * 1e3, "ms")

# ---- issue 13: user-defined fused work (twins of crates/backend-cuda/benches/fuse.rs) -------
n = 64 << 20
x5, y5 = rand(n), rand(n)
c5 = torch.empty_like(x5)
ms = timed(5, 10, lambda: c5.copy_(x5))
report("copy_64M", 8 * n / (ms * 1e-3) / 1e9, "GB/s")
ms = timed(5, 10, lambda: (x5 * y5 + 0.5).sigmoid() * x5 - y5)
report("fuse5_64M", 12 * n / (ms * 1e-3) / 1e9, "GB/s")
ms = timed(5, 10, lambda: torch.linalg.vector_norm(x5))
report("norm_64M", ms, "ms")
report("user_norm_64M", ms, "ms")
del x5, y5, c5

s = rand(8192, 8192)
ms = timed(5, 5, lambda: torch.logsumexp(s, dim=-1))
report("lse_8192x8192", ms, "ms")


def lse_manual():
    m = s.max(dim=-1, keepdim=True).values
    return (s - m).exp().sum(dim=-1, keepdim=True).log() + m


ms = timed(5, 5, lse_manual)
report("lse_8192x8192_manual", ms, "ms")
del s

# ---- training steps and the seeds' loops (twins of crates/backend-cuda/benches/steps.rs).
# Eager PyTorch under `torch`; the same step captured in a CUDA graph (torch.cuda.graph, the
# best a PyTorch user can do by hand) under `torch_graph`.


def report_graph(name, value, unit):
    print(f"BENCH torch_graph {name} {value:.4f} {unit}", flush=True)


def mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(dev)


def mlp_rows(name, widths, adam, iters):
    batch = 100
    x = torch.rand(batch, widths[0], device=dev, generator=g)
    y = (torch.arange(batch, device=dev) % widths[-1]).long()
    loss_fn = torch.nn.CrossEntropyLoss()

    def make(capturable):
        model = mlp(widths)
        if adam:
            # Eager: the default (foreach) Adam; a captured step needs capturable=True.
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=capturable)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()

        return model, opt, step

    _, _, step = make(False)
    eager = timed(5, iters, step)
    report(name, eager, "ms")
    if name == "mlp_small_sgd_step":
        # PyTorch's own profiler (CPU + CUDA activities through CUPTI) on the same step: the
        # reference for what kiln's profiler costs when on.
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts):
            step()  # CUPTI's start-up outside the timed rounds
        on = []
        for _ in range(5):
            with profile(activities=acts):
                on.append(timed(1, iters, step))
        on = sorted(on)[len(on) // 2]
        report(name + "_profiled", on, "ms")
        report("mlp_small_sgd_profile_on_overhead", 100.0 * (on / eager - 1.0), "%")
    # Capture: warm up on a side stream, then record one whole step into a graph.
    model, opt, step = make(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    replay = timed(5, iters, graph.replay)
    report_graph(name, replay, "ms")
    # The reference of kiln's own captured step (`<name>_graph`): PyTorch's captured step.
    report(name + "_graph", replay, "ms")


mlp_rows("mlp_small_sgd_step", [784, 100, 100, 10], False, 200)
mlp_rows("mlp_small_adam_step", [784, 100, 100, 10], True, 200)
mlp_rows("mlp_deep_sgd_step", [784, 1000, 1000, 2000, 1000, 1000, 10], False, 50)


def wall_sync(f):
    f()
    torch.cuda.synchronize()
    v = []
    for _ in range(5):
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        v.append(time.perf_counter() - t)
    v.sort()
    return v[2] * 1e3


a = rand(100, 100)


def d2l_host():
    log = []
    for _ in range(1000):
        log.append(torch.linalg.matrix_norm(a @ a).item())


def d2l_gpu():
    log = []
    for _ in range(1000):
        log.append(torch.linalg.matrix_norm(a @ a))


report("d2l_matmul_norm_x1000_host", wall_sync(d2l_host), "ms")
report("d2l_matmul_norm_x1000_gpu", wall_sync(d2l_gpu), "ms")



# ---- Backend::reduce's two paths in kiln (`reductions` in gpu.rs): the same reductions here,
# reported under both kiln row names so that each path has its ratio.
def reductions():
    rows = [
        ("sum_4096x4096_rows", (4096, 4096), (1,), False, torch.float32),
        ("sum_4096x4096_cols", (4096, 4096), (0,), False, torch.float32),
        ("max_4096x4096_rows", (4096, 4096), (1,), True, torch.float32),
        ("sum_16384x384_rows", (16384, 384), (1,), False, torch.float32),
        ("sum_16384x384_cols", (16384, 384), (0,), False, torch.float32),
        ("sum_bn_256x64x32x32", (256, 64, 32, 32), (0, 2, 3), False, torch.float32),
        ("sum_all_64M", (64 << 20,), (0,), False, torch.float32),
        ("sum_4096x4096_rows_bf16", (4096, 4096), (1,), False, torch.bfloat16),
    ]
    for name, shape, axes, is_max, dtype in rows:
        x = rand(*shape).to(dtype)
        f = (lambda: torch.amax(x, dim=axes)) if is_max else (lambda: torch.sum(x, dim=axes))
        ms = timed(5, 20, f)
        gbs = x.numel() * x.element_size() / (ms * 1e-3) / 1e9
        for tag in ("", "_kernels", "_generated"):
            report(f"reduce_{name}{tag}", gbs, "GB/s")
        del x


reductions()

# ---- issue 31: attention at the GPT example's shape (B=64, H=6, T=256, d=64, causal) -------
# and at a long-sequence one (attn_long_*: B=8, H=16, T=2048, d=64, causal). Twins of
# `attention` in crates/backend-cuda/benches/gpu.rs: forward alone (no_grad) and forward +
# backward (the gradients of q, k, v for a given output gradient), f32 (TF32 off) and bf16,
# through F.scaled_dot_product_attention (PyTorch picks its flash / memory-efficient kernel).
import torch.nn.functional as F

for name, (b, h, t, d) in (("gpt", (64, 6, 256, 64)), ("long", (8, 16, 2048, 64))):
    for dt, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        q, k, v = (rand(b, h, t, d).to(dt).requires_grad_() for _ in range(3))
        go = rand(b, h, t, d).to(dt)

        def attn_fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def attn_fwd_bwd():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(y, (q, k, v), go)

        report(f"attn_{name}_fwd_{tag}", timed(5, 20, attn_fwd), "ms")
        report(f"attn_{name}_fwd_bwd_{tag}", timed(5, 20, attn_fwd_bwd), "ms")
        if name == "gpt":
            # Training as the GPT runs it: dropout 0.2 on the weights.
            def attn_fwd_bwd_dropout():
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
                torch.autograd.grad(y, (q, k, v), go)

            report(f"attn_{name}_fwd_bwd_{tag}_dropout", timed(5, 20, attn_fwd_bwd_dropout), "ms")
        if name == "gpt":
            # Sequences of different lengths: sequence i keeps its first t - 2i keys (a boolean
            # attn_mask [b, 1, 1, t], True = take part), not causal.
            pos = torch.arange(t, device="cuda")
            keep = (pos[None, :] < (t - 2 * torch.arange(b, device="cuda"))[:, None])[:, None, None, :]

            def attn_fwd_bwd_padding():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
                torch.autograd.grad(y, (q, k, v), go)

            report(f"attn_{name}_fwd_bwd_{tag}_padding", timed(5, 20, attn_fwd_bwd_padding), "ms")
            # ALiBi's bias as a float attn_mask [1, h, t, t]: head i adds -2^(-8(i+1)/h) |q - k|.
            heads = torch.arange(h, device="cuda", dtype=torch.float64)[:, None, None]
            dist = (pos[:, None] - pos[None, :]).abs().to(torch.float64)
            alibi = (-torch.exp2(-8.0 * (heads + 1) / h) * dist)[None].to(dt)

            def attn_fwd_bwd_additive():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)
                torch.autograd.grad(y, (q, k, v), go)

            report(f"attn_{name}_fwd_bwd_{tag}_additive", timed(5, 20, attn_fwd_bwd_additive), "ms")
        del q, k, v, go

# Convolutions (issue 33; crates/backend-cuda/benches/conv.rs): a 3x3 padding-1 conv forward +
# backward (input and weight gradients, no bias), f32 with TF32 off, cuDNN's algorithms chosen
# by measurement (cudnn.benchmark) as kiln does; the timed loop starts after the warm-up calls
# of `timed`, so the search is not in the figure.
torch.backends.cudnn.benchmark = True
print(f"torch cuDNN: {torch.backends.cudnn.version()}")


def conv_fwd_bwd(n, c, oc, s):
    x = rand(n, c, s, s).requires_grad_()
    w = rand(oc, c, 3, 3).requires_grad_()
    gy = rand(n, oc, s, s)

    def step():
        y = torch.nn.functional.conv2d(x, w, padding=1)
        y.backward(gy)
        x.grad = None
        w.grad = None

    return timed(5, 10, step)


for n, c, oc, s in [(64, 64, 64, 32), (128, 128, 128, 16), (32, 3, 64, 32)]:
    report(f"conv3x3_b{n}_c{c}_{s}_fwdbwd", conv_fwd_bwd(n, c, oc, s), "ms")
