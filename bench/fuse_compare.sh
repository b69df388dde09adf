#!/usr/bin/env bash
# Runs kiln's fused-expression criterion bench (crates/backend-cpu/benches/fuse.rs) and
# bench/fuse_numpy.py alternately, ROUNDS times (default 2), printing the machine, the load
# before each run and both sides' figures (issue 13's CPU target: a five-op chain over 32M f32,
# fused >= 3x kiln op by op and >= 3x numpy).
#
#   bash bench/fuse_compare.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
bin=$(cargo bench -p kiln-backend-cpu --bench fuse --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "fuse" and m.get("executable"):
        print(m["executable"])' | tail -1)
echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
for r in $(seq "$rounds"); do
    echo "== round $r: kiln (load $(cut -d' ' -f1-3 /proc/loadavg))"
    "$bin" --bench --warm-up-time 1 --measurement-time 5 --noplot 2>&1 | grep -E '^[a-z_0-9x/]+|time:' | grep -v change
    echo "== round $r: kiln, one thread (RAYON_NUM_THREADS=1)"
    RAYON_NUM_THREADS=1 "$bin" --bench --warm-up-time 1 --measurement-time 5 --noplot 2>&1 |
        grep -E '^[a-z_0-9x/]+|time:' | grep -v change
    echo "== round $r: numpy (load $(cut -d' ' -f1-3 /proc/loadavg))"
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/fuse_numpy.py
done
