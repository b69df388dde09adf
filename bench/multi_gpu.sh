#!/usr/bin/env bash
# Issue 12 on a 2-GPU machine: every multi-GPU check and benchmark, then a summary.
# Built by `cargo xtask multi-gpu` into target/gpu-bundle/ (binaries in multi/, MNIST in
# multi/mnist). Needs the NVIDIA driver, NCCL on the library path, python3 with PyTorch
# (torchrun). Usage: bash target/gpu-bundle/multi_gpu.sh      (about 4-6 minutes)
cd "$(dirname "$0")"
# NVLink multicast stays off in every process started from here (kiln's launcher sets the
# same for its children).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KILN_KERNEL_CACHE="${KILN_KERNEL_CACHE:-$PWD/.kernel-cache}"
# cudarc loads NCCL as libnccl.so (or libnccl.so.<CUDA major>), but the runtime package only
# has libnccl.so.2: point a libnccl.so in a private directory at the system's (or, failing
# that, PyTorch's) libnccl.so.2.
NCCL_LIB=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
if [ -z "$NCCL_LIB" ]; then
    NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
fi
if [ -n "$NCCL_LIB" ] && [ -e "$NCCL_LIB" ]; then
    mkdir -p .nccl && ln -sf "$NCCL_LIB" .nccl/libnccl.so
    export LD_LIBRARY_PATH="$PWD/.nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "NCCL: $NCCL_LIB"
else
    echo "NCCL: libnccl.so.2 not found (the NCCL checks will fail)"
fi
M=multi
DP=$M/data_parallel
MN="--data-dir $M/mnist"
LOG=$(mktemp -d)
OUT=$LOG/all.txt
declare -a RESULTS
pass=0; fail=0
note() { echo "$*" | tee -a "$OUT"; }
# check NAME EXPECT SECONDS cmd...: runs cmd with a time limit, logs its output. EXPECT is
# `ok` (exit 0) or `fail:REGEX` (a non-zero exit, not the time limit, whose output matches
# REGEX: the error must name the cause).
check() {
    local name=$1 expect=$2 limit=$3; shift 3
    echo; echo "=== $name: $*"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$LOG/$name.log" 2>&1
    local rc=$? dt=$((SECONDS - t0))
    cat "$LOG/$name.log" | tail -n 25
    cat "$LOG/$name.log" >> "$OUT"
    local ok=0
    if [ "$expect" = ok ] && [ $rc -eq 0 ]; then ok=1; fi
    if [ "${expect%%:*}" = fail ] && [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ] \
        && grep -Eq "${expect#fail:}" "$LOG/$name.log"; then ok=1; fi
    if [ $ok = 1 ]; then pass=$((pass+1)); RESULTS+=("PASS  $name (rc=$rc, ${dt}s)");
    else fail=$((fail+1)); RESULTS+=("FAIL  $name (rc=$rc, ${dt}s, expected $expect)"); fi
    return 0
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'; }

nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -n 4
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -lt 2 ]; then echo "skipped: issue 12's checks need 2 GPUs, $NGPU visible"; fi

# 1. NCCL collectives and the watchdog (kiln-backend-cuda tests/nccl.rs).
for t in $M/tests/*; do check "$(basename $t)" ok 180 "$t" --test-threads=1 --nocapture; done

# 2. 20 steps on 2 GPUs agree with 1 GPU (same seed, same global batch) within 1e-4 relative.
check verify-ddp-threads ok 120 $DP --mode ddp-threads --gpus 2 --model mnist --verify 20 $MN
check verify-ddp-procs ok 120 $DP --nproc 2 --model mnist --verify 20 $MN
check verify-chainer ok 120 $DP --mode chainer --gpus 2 --model mnist --verify 20 $MN
check verify-ddp-threads-big ok 120 $DP --mode ddp-threads --gpus 2 --model big --verify 20

# 3. MNIST to the one-GPU accuracy: data parallel (both forms), model parallel.
check mnist-1gpu ok 120 $DP --mode ddp-threads --gpus 1 --model mnist --epochs 10 $MN
check mnist-ddp-2gpu ok 120 $DP --mode ddp-threads --gpus 2 --model mnist --epochs 10 $MN
check mnist-ddp-procs-2gpu ok 120 $DP --nproc 2 --model mnist --epochs 10 $MN
check mnist-chainer-2gpu ok 120 $DP --mode chainer --gpus 2 --model mnist --epochs 10 $MN
check model-parallel ok 180 $M/model_parallel --epochs 5 $MN

# 4. Planted faults: the survivors end with an error naming the cause within the timeout.
check fault-rank-exits "fail:rank 1 is gone|did not finish within" 90 env KILN_DIST_TIMEOUT_S=20 KILN_LAUNCH_GRACE_S=40 \
    $DP --nproc 2 --model big --steps 200 --fail-rank 1 --fail-step 5
P=$(free_port)
check fault-rdzv-missing-rank "fail:rank\(s\) \[1\] of world size 2 did not join" 60 env RANK=0 WORLD_SIZE=2 MASTER_PORT=$P KILN_DIST_TIMEOUT_S=5 \
    $DP --mode ddp-procs --model big --steps 2
P=$(free_port)
check fault-rdzv-no-rank0 "fail:could not reach rank 0" 60 env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_PORT=$P KILN_DIST_TIMEOUT_S=5 \
    $DP --mode ddp-procs --model big --steps 2

# 5. Scaling beside PyTorch DDP (784-4096x3-10, global batch 8192, SGD, f32, TF32 off).
check bench-kiln-1gpu ok 180 $DP --mode ddp-threads --gpus 1 --model big --steps 30 --warmup 5
check bench-kiln-ddp-threads ok 180 $DP --mode ddp-threads --gpus 2 --model big --steps 30 --warmup 5
check bench-kiln-ddp-procs ok 180 $DP --nproc 2 --model big --steps 30 --warmup 5
check bench-kiln-chainer ok 180 $DP --mode chainer --gpus 2 --model big --steps 30 --warmup 5
check bench-torch-ddp ok 240 torchrun --nproc_per_node 2 --master_port "$(free_port)" ddp_torch.py --steps 30 --warmup 5
check torchrun-launches-kiln ok 180 torchrun --nproc_per_node 2 --master_port "$(free_port)" --no-python \
    $DP --mode ddp-procs --model big --steps 30 --warmup 5
check two-gpu-matmul ok 120 $M/two_gpu_matmul
# PyTorch's twin of two_gpu_matmul's 256 MB GPU-to-GPU copy (same measure: the call until both
# devices are idle, median of 5).
check torch-copy-peer ok 120 python3 - <<'PY'
import time, torch
src = torch.ones(64 << 20, device="cuda:0")
def once():
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    t = time.perf_counter()
    dst = src.to("cuda:1")
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    return time.perf_counter() - t
once()
s = sorted(once() for _ in range(5))[2]
print(f"torch copy_peer_256MB ms={s * 1e3:.3f} gb_per_s={4 * (64 << 20) / s / 1e9:.1f}")
PY

echo; echo "================ ISSUE 12 SUMMARY ================"
for r in "${RESULTS[@]}"; do echo "$r"; done
grep -h "^verify " "$OUT"
grep -h "test_accuracy=" "$OUT" | sed 's/^/accuracy: /'
grep -h "^one-sided all_reduce" "$OUT"
for n in fault-rank-exits fault-rdzv-missing-rank fault-rdzv-no-rank0; do
    echo "$n: $(grep -h 'error' "$LOG/$n.log" | head -n 2 | tr '\n' ' ')"
done
python3 - "$OUT" <<'PY'
import re, sys
rows, copies = {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"(kiln|torch) data_parallel mode=(\S+) model=Big gpus=(\d+) .*step_ms=([\d.]+) samples_per_s=(\d+)", line)
    if m:
        rows[(m[1], m[2], int(m[3]))] = float(m[5])  # the last run (the bench, not --verify)
    m = re.match(r"kiln two_gpu_matmul .* speedup=([\d.]+)", line)
    if m:
        print(f"two_gpu_matmul speedup: {float(m[1]):.3f}x (target >= 1.97)")
    m = re.match(r"(kiln|torch) copy_peer_256MB .* gb_per_s=([\d.]+)", line)
    if m:
        copies[m[1]] = float(m[2])
print("samples/s, MLP 784-4096x3-10, global batch 8192:")
for k, v in sorted(rows.items()):
    print(f"  {k[0]:5} {k[1]:12} gpus={k[2]}: {v:>10.0f}")
k1 = rows.get(("kiln", "ddp-threads", 1))
t1 = rows.get(("torch", "single", 1)); t2 = rows.get(("torch", "ddp", 2))
for mode in ("ddp-threads", "ddp-procs", "chainer"):
    k2 = rows.get(("kiln", mode, 2))
    if k1 and k2:
        s = f"kiln {mode}: 2-GPU speedup {k2 / k1:.3f}x (target >= 1.95)"
        if t2:
            s += f", vs torch DDP 2-GPU {k2 / t2:.3f}x (target >= 1.0)"
        print(s)
if t1 and t2:
    print(f"torch DDP: 2-GPU speedup {t2 / t1:.3f}x")
kc = copies.get("kiln"); tc = copies.get("torch")
if kc and tc:
    print(f"copy_peer 256 MB: kiln {kc:.1f} GB/s, torch {tc:.1f} GB/s, {kc / tc:.3f}x (target >= 0.95)")
PY
echo "ISSUE 12 CHECKS: $pass passed, $fail failed (logs in $LOG)"
[ "$fail" -eq 0 ]
