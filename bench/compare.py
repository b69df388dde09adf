"""Joins `BENCH kiln ...`, `BENCH torch ...`, `BENCH torch_graph ...`, `BENCH torch_compile ...`
and `BENCH cupy ...` lines into one table (markdown). The reference of a row is PyTorch (eager),
or CuPy where PyTorch has no twin. ratio = kiln/reference for throughputs (GB/s, TFLOP/s),
reference/kiln for times and memory (us, ms, MiB): above 1 means kiln is faster (or smaller);
"vs graph/compiled" compares with PyTorch's step captured in a CUDA graph, or `torch.compile`d.
Rows only kiln reports follow, each against a lower bound (ABS_TARGET: a fraction of another
kiln row in the same run) or an upper limit (LIMIT: the profiler's overhead in %, a time)."""
import sys

TARGET = {
    "exp_230400_x1000": 1.0,
    "exp_230400_x1000_wall": 1.0,
    # the first minute: the main job's first run with empty caches, below PyTorch's cold process
    "cold_start_mnist_2ep": 1.0,
    "warm_start_mnist_2ep": None,
    # the first-minute issue: a pending result dropped unread costs less than running it
    "exp_230400_dropped_x1000_wall": 1 / 0.6,  # kiln <= 0.6x PyTorch's time
    "exp_230400_record_drop_x1000_wall": None,
    "exp_230400_dropped_x1000_unfused_wall": None,
    "add_256M": 0.9,
    "sum_256M": 0.9,
    "chain6_64M": 1.0,
    "chain6_64M_unfused": None,
    "softmax_8192x8192": 1.0,
    "sgemm_4096": 0.97,
    "sgemm_8192": 0.97,
    # mixed precision (issue 30): tensor-core GEMMs, a bf16 chain against bf16 copy bandwidth
    "gemm_bf16_8192": 0.95,
    "gemm_f16_8192": 0.95,
    "chain6_64M_bf16": 1.0,
    "chain6_64M_f16": 1.0,
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
    "norm_64M": None,  # a full reduction split over blocks; no target in the issue
    "user_norm_64M": None,  # the same as a ReductionKernel
    # training steps and the seeds' loops (benches/steps.rs)
    "mlp_small_sgd_step": 1.0,
    "mlp_small_adam_step": 1.0,
    "mlp_deep_sgd_step": 0.95,
    # kiln's step captured in a CUDA graph against PyTorch's (issue 14: <= 0.5x its time)
    "mlp_small_sgd_step_graph": 2.0,
    "mlp_deep_sgd_step_graph": None,
    "d2l_matmul_norm_x1000_host": 1.0,
    "d2l_matmul_norm_x1000_gpu": 1.0,
    # issue 31: fused attention at the GPT's shape (B=64, H=6, T=256, d=64, causal), in ms.
    # No bound yet: the first kernels are f32 FMA (no tensor cores); the figures set one.
    "attn_gpt_fwd_f32": 1.0,
    "attn_gpt_fwd_bwd_f32": 1.0,
    "attn_gpt_fwd_bf16": 1.0,
    "attn_gpt_fwd_bwd_bf16": 1.0,
    # and with dropout 0.2 as the GPT trains (f32: kiln's 3xTF32 kernels keep the forward's bits)
    "attn_gpt_fwd_bwd_f32_dropout": 1.0,
    # and under a key-padding mask (a boolean attn_mask, fused since the sixteenth session)
    "attn_gpt_fwd_bwd_f32_padding": 1.0,
    "attn_gpt_fwd_bwd_bf16_padding": 1.0,
    # and under ALiBi's additive bias (a float attn_mask; fused on cuDNN in bf16 on Hopper)
    "attn_gpt_fwd_bwd_f32_additive": None,
    "attn_gpt_fwd_bwd_bf16_additive": 1.0,
    # issue 31: the GPT beside PyTorch eager (f32 >= 1.1x) and its peak memory (<= PyTorch's);
    # TF32 and bf16 against torch.compile below (TARGET_GRAPH).
    "gpt_iter_f32": 1.1,
    "gpt_iter_tf32": None,
    "gpt_iter_bf16": None,
    "gpt_peak_f32": 1.0,
    "gpt_peak_bf16": 1.0,
    # issue 33: the ResNet-18 step at batch 256 >= PyTorch eager, a steady step's peak <= its.
    "resnet18_step_f32": 1.0,
    "resnet18_step_tf32": 1.0,
    "resnet18_step_bf16": 1.0,
    "resnet18_step_peak_f32": 1.0,
    "resnet18_step_peak_tf32": 1.0,
    "resnet18_step_peak_bf16": 1.0,
    # issue 33: convolutions at cuDNN speed (3x3 padding 1, forward + both gradients, f32, TF32
    # off; PyTorch with cudnn.benchmark). The `_im2col` rows (kiln's own path) are kiln-only.
    "conv3x3_b64_c64_32_fwdbwd": 1.0,
    "conv3x3_b128_c128_16_fwdbwd": 1.0,
    "conv3x3_b32_c3_32_fwdbwd": 1.0,
}
# Against the CUDA-graph / torch.compile column: the small SGD step in half the captured time;
# the GPT in TF32 at least as fast as torch.compile, in bf16 in <= 0.9x its time.
TARGET_GRAPH = {
    "mlp_small_sgd_step": 2.0,
    "mlp_small_adam_step": 1.0,
    "gpt_iter_tf32": 1.0,
    "gpt_iter_bf16": 1 / 0.9,
}
# kiln-only rows: lower bounds.
ABS_TARGET = {
    "fuse5_64M_of_copy": 0.9,  # a fused five-op chain at >= 0.9x device copy bandwidth
    # the mixed-precision issue: 16-bit chains at >= 0.9x copy bandwidth (PyTorch's clone, same run)
    "chain6_64M_bf16_of_copy": 0.9,
    "chain6_64M_f16_of_copy": 0.9,
}
# kiln-only rows (or kiln's value of a shared row): upper limits.
LIMIT = {
    "mlp_small_sgd_profile_off_overhead": 1.0,
    "mlp_small_sgd_profile_on_overhead": 15.0,
    "d2l_matmul_norm_x1000_gpu": 12.0,
}


def ratio_of(k, t, unit):
    return k / t if unit in ("GB/s", "TFLOP/s") else t / k


rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 5 and p[0] == "BENCH":
        rows.setdefault(p[2], {})[p[1]] = (float(p[3]), p[4])
    elif "device:" in line:
        print(line.strip())

# 16-bit chains against the device's 16-bit copy bandwidth (PyTorch's clone row of the run).
for tag in ("bf16", "f16"):
    chain, copy = rows.get(f"chain6_64M_{tag}", {}), rows.get(f"copy_64M_{tag}", {})
    if "kiln" in chain and "torch" in copy:
        rows[f"chain6_64M_{tag}_of_copy"] = {"kiln": (chain["kiln"][0] / copy["torch"][0], "x")}

print("| workload | kiln | reference | PyTorch graph/compiled | unit | ratio (>1: kiln faster) | vs graph/compiled | target | met |")
print("|---|---|---|---|---|---|---|---|---|")
for name, r in rows.items():
    ref = "torch" if "torch" in r else "cupy" if "cupy" in r else None
    if "kiln" not in r or ref is None:
        continue
    (k, unit), (t, _) = r["kiln"], r[ref]
    ratio = ratio_of(k, t, unit)
    tgt = TARGET.get(name)
    met = "" if tgt is None else ("yes" if ratio >= tgt else "NO")
    gcol, gratio = "", ""
    second = "torch_graph" if "torch_graph" in r else "torch_compile" if "torch_compile" in r else None
    if second:
        gt = r[second][0]
        gr = ratio_of(k, gt, unit)
        gcol, gratio = f"{gt:.3f}", f"{gr:.3f}"
        gtgt = TARGET_GRAPH.get(name)
        if gtgt is not None:
            ok = "yes" if gr >= gtgt else "NO"
            met = f"{met} / graph x{gtgt}: {ok}" if met else f"graph x{gtgt}: {ok}"
    label = "PyTorch" if ref == "torch" else "CuPy"
    tgt_s = f"{tgt:.3g}" if tgt else ""
    print(f"| {name} | {k:.3f} | {t:.3f} ({label}) | {gcol} | {unit} | {ratio:.3f} | {gratio} | {tgt_s} | {met} |")
print()
print("| kiln only | value | unit | bound | met |")
print("|---|---|---|---|---|")
for name, r in rows.items():
    has_ref = "torch" in r or "cupy" in r
    if "kiln" not in r or (has_ref and name not in LIMIT):
        continue
    k, unit = r["kiln"]
    if name in LIMIT:
        lim = LIMIT[name]
        print(f"| {name} | {k:.3f} | {unit} | <= {lim} | {'yes' if k <= lim else 'NO'} |")
    elif name in ABS_TARGET:
        lo = ABS_TARGET[name]
        print(f"| {name} | {k:.3f} | {unit} | >= {lo} | {'yes' if k >= lo else 'NO'} |")
    else:
        print(f"| {name} | {k:.3f} | {unit} | | |")
