#!/usr/bin/env bash
# Training benchmarks side by side: kiln (a prebuilt bench_train binary) against PyTorch eager
# on the GPU, or against numpy by hand on the CPU, in one run on one machine; then one table.
#
# Usage, from the repository root (no Rust toolchain needed where it runs):
#   bash bench/run_train.sh BIN [cuda|cpu] [bench args...]
#     BIN          the release binary, e.g. target/gpu-bundle/bench_train
#                  (cargo build --release --example bench_train, then copy
#                  target/release/examples/bench_train there)
#     cuda (default): kiln --device cuda vs bench/train_torch.py (logreg, mlp-small, mlp-large)
#     cpu:            kiln --device cpu  vs bench/train_numpy.py (logreg, mlp-small)
#     bench args:     passed to both sides, e.g. --which mlp-small --steps 100 --repeats 3
# Environment: ROUNDS=N runs the two sides alternately N times (default 1) and the table takes
# the median over rounds (for noisy, shared CPUs).
#
# Prints each side's result lines (`kiln|torch|numpy <workload> <device> key=value ...`), then
# the table: ms per step on each side, the speedup (other / kiln) and the issue's target.
# Exits non-zero if a side failed (the table still shows what ran).

set -u
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
    sed -n '2,18p' "$0"
    exit 2
fi
BIN=$1
shift
MODE=cuda
case "${1:-}" in
cuda | cpu)
    MODE=$1
    shift
    ;;
esac
if [ ! -f "$BIN" ]; then
    echo "run_train.sh: no binary at $BIN (build it with cargo build --release --example bench_train)" >&2
    exit 2
fi
if [ ! -x "$BIN" ]; then
    # A carried file may lose its mode bits: run a private executable copy.
    tmpbin=$(mktemp)
    cp "$BIN" "$tmpbin" && chmod +x "$tmpbin" && BIN=$tmpbin
fi
export KILN_KERNEL_CACHE="${KILN_KERNEL_CACHE:-${TMPDIR:-/tmp}/kiln-kernel-cache}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ROUNDS=${ROUNDS:-1}

out=$(mktemp)
echo "== run_train.sh $MODE $* ($(date -u '+%Y-%m-%d %H:%M UTC'))"
echo "host: $(uname -srm); $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
if git rev-parse --short HEAD >/dev/null 2>&1; then
    echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ local changes)')"
fi
if [ "$MODE" = cuda ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader |
        sed 's/^/gpu: /'
fi

status=0
for round in $(seq "$ROUNDS"); do
    [ "$ROUNDS" -gt 1 ] && echo "-- round $round/$ROUNDS"
    echo "-- kiln ($BIN --device $MODE $*)"
    "$BIN" --device "$MODE" "$@" 2>&1 | tee -a "$out"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "kiln side FAILED" >&2; status=1; }
    if [ "$MODE" = cuda ]; then
        echo "-- torch ($PY bench/train_torch.py --device cuda $*)"
        "$PY" bench/train_torch.py --device cuda "$@" 2>&1 | tee -a "$out"
        [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "torch side FAILED" >&2; status=1; }
    else
        # numpy as shipped: without the OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE overrides some
        # machines set (they pin an older kernel); train_numpy.py prints the kernel it runs.
        echo "-- numpy ($PY bench/train_numpy.py $*, OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset)"
        env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$PY" bench/train_numpy.py "$@" 2>&1 | tee -a "$out"
        [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "numpy side FAILED" >&2; status=1; }
    fi
done

"$PY" - "$out" "$MODE" <<'EOF' || status=1
import statistics
import sys
from collections import defaultdict

path, mode = sys.argv[1], sys.argv[2]
# (side, workload) -> list of dicts (one per round)
runs = defaultdict(list)
for line in open(path):
    parts = line.split()
    if (len(parts) < 4 or parts[0] not in ("kiln", "torch", "numpy")
            or parts[1] not in ("logreg", "mlp-small", "mlp-large")
            or not parts[3].startswith("steps=")):
        continue  # headers, notes, errors: shown above, not parsed
    kv = dict(p.split("=", 1) for p in parts[3:] if "=" in p)
    kv["device"] = parts[2]
    runs[(parts[0], parts[1])].append(kv)

other = "torch" if mode == "cuda" else "numpy"
# Targets of issues 4 and 5 (GPU) and 32 (CPU): speedup = other ms / kiln ms must reach this;
# on the CPU kiln's process CPU time must also stay within CPU_BOUND x numpy's.
targets = {
    "cuda": {"logreg": 5.0, "mlp-small": 3.0, "mlp-large": 1 / 1.05},
    "cpu": {"logreg": 1.2, "mlp-small": 1.2},
}[mode]
CPU_BOUND = 1.5
labels = {5.0: ">= 5x", 3.0: ">= 3x", 1 / 1.05: "within 5%", 1.2: ">= 1.2x"}


def ms(side, wl):
    r = runs.get((side, wl))
    if not r:
        return None, None, None
    vals = [float(x["ms_per_step"]) for x in r]
    return statistics.median(vals), r[-1]["device"], r[-1]


print()
hdr = f"{'workload':<10} {'steps':>6} {'kiln ms/step':>13} {other + ' ms/step':>14} " \
      f"{'speedup':>8} {'kiln steps/s':>13} {other + ' steps/s':>14} {'target':>10}  verdict"
print(hdr)
print("-" * len(hdr))
for wl in ("logreg", "mlp-small", "mlp-large"):
    k, kdev, kr = ms("kiln", wl)
    o, odev, orr = ms(other, wl)
    if k is None and o is None:
        continue
    t = targets.get(wl)
    speed = o / k if (k and o) else None
    verdict = "-"
    if speed is not None and t is not None:
        verdict = "MET" if speed >= t else "MISSED"
    notes = []
    if kdev and odev and kdev.split(":")[0] != odev.split(":")[0]:
        notes.append(f"DEVICE MISMATCH kiln {kdev} vs {other} {odev}")
    if mode == "cuda" and kdev and not kdev.startswith("cuda"):
        notes.append(f"kiln ran on {kdev}, not a GPU")
    if kr and orr and kr.get("steps") != orr.get("steps"):
        notes.append(f"steps differ: kiln {kr.get('steps')}, {other} {orr.get('steps')}")
    if notes:  # a figure from the wrong device is no verdict
        verdict = "INVALID"
    kc = [float(x["cpu_ms_per_step"]) for x in runs.get(("kiln", wl), []) if "cpu_ms_per_step" in x]
    oc = [float(x["cpu_ms_per_step"]) for x in runs.get((other, wl), []) if "cpu_ms_per_step" in x]
    if mode == "cpu" and kc and oc:
        kc, oc = statistics.median(kc), statistics.median(oc)
        notes.append(f"process CPU ms/step kiln {kc:.4f} {other} {oc:.4f} "
                     f"(kiln / {other} {kc / oc:.2f}x, bound {CPU_BOUND}x)")
        if verdict == "MET" and kc > CPU_BOUND * oc:
            verdict = "MISSED (CPU time)"
    if wl == "logreg" and kr and orr:
        a, b = float(kr["final_cost"]), float(orr["final_cost"])
        rel = abs(a - b) / max(abs(b), 1e-12)
        notes.append(f"final_cost kiln {a:.6f} {other} {b:.6f} (rel diff {rel:.1e})")
    f = lambda v, fmt: (fmt % v) if v is not None else "n/a"
    steps = (kr or orr or {}).get("steps", "?")
    print(f"{wl:<10} {steps:>6} {f(k, '%.4f'):>13} {f(o, '%.4f'):>14} "
          f"{f(speed, '%.2fx'):>8} {f(1e3 / k if k else None, '%.1f'):>13} "
          f"{f(1e3 / o if o else None, '%.1f'):>14} "
          f"{labels.get(t, '-'):>10}  {verdict}" + ("  [" + "; ".join(notes) + "]" if notes else ""))
print(f"\n(speedup = {other} ms/step / kiln ms/step; medians of each side's repeats"
      + (f", then of {len(next(iter(runs.values())))} rounds" if runs and len(next(iter(runs.values()))) > 1 else "")
      + f"; devices: kiln {next((r[-1]['device'] for (s, _), r in runs.items() if s == 'kiln'), 'n/a')}, "
      f"{other} {next((r[-1]['device'] for (s, _), r in runs.items() if s == other), 'n/a')})")
EOF
rm -f "$out" ${tmpbin:+"$tmpbin"}
exit $status
