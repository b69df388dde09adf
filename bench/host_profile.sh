#!/usr/bin/env bash
# Profiles kiln's CUDA host path on a machine with no GPU: builds bench/stub_cuda/stub.c (a
# stand-in driver, NVRTC and cuBLAS whose calls do nothing) as the libraries cudarc loads, then
# runs the command with them, under `perf record -g` when perf exists. What it measures is
# kiln's own host work per op (shape checks, plans, allocation, argument packing), without the
# driver's; kernels do not run, so results are garbage and only timings mean anything.
#
#   bash bench/host_profile.sh target/release/examples/op_overhead --device cuda
#   perf report -i target/stub-cuda/perf.data --no-children
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/stub-cuda
mkdir -p "$out"
cc -O2 -shared -fPIC -o "$out/libcuda.so" bench/stub_cuda/stub.c
for name in libcuda.so.1 libnvrtc.so libnvrtc.so.12 libnvrtc.so.13 libcublas.so libcublas.so.12 \
    libcublas.so.13; do
    cp "$out/libcuda.so" "$out/$name"
done
export LD_LIBRARY_PATH="$PWD/$out" KILN_KERNEL_CACHE="$PWD/$out/kernel-cache"
if command -v perf > /dev/null; then
    exec perf record -e cpu-clock -g -o "$out/perf.data" "$@"
fi
exec "$@"
