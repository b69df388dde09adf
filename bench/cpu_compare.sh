#!/usr/bin/env bash
# Runs the kiln CPU criterion bench and bench/cpu_numpy.py alternately, ROUNDS times (default 3),
# printing the machine, the load before each run, and both sides' figures, so that every kiln
# number has a numpy number taken minutes apart on the same machine.
#
#   bash bench/cpu_compare.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
bin=$(cargo bench -p kiln-backend-cpu --bench cpu --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cpu" and m.get("executable"):
        print(m["executable"])' | tail -1)
echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
for r in $(seq "$rounds"); do
    echo "== round $r: kiln (load $(cut -d' ' -f1-3 /proc/loadavg))"
    "$bin" --bench --warm-up-time 1 --measurement-time 4 --noplot >/dev/null 2>&1
    python3 bench/criterion_summary.py target/criterion sgemm_1024 exp_230400 add_32m misc
    echo "== round $r: kiln, one thread (RAYON_NUM_THREADS=1 MATMUL_NUM_THREADS=1)"
    RAYON_NUM_THREADS=1 MATMUL_NUM_THREADS=1 "$bin" --bench --warm-up-time 1 \
        --measurement-time 4 --noplot >/dev/null 2>&1
    python3 bench/criterion_summary.py target/criterion sgemm_1024 exp_230400 add_32m misc
    echo "== round $r: numpy (load $(cut -d' ' -f1-3 /proc/loadavg))"
    # This machine sets OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for old OpenBLAS builds; they slow a
    # current numpy, so they are unset for the numpy run only.
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/cpu_numpy.py
done
