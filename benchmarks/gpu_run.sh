#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (no network there): gpu_benchmark.py with its JSON and
# log under $OUT. Its default sections should take about 4 minutes on one H100, compiles included (an estimate from
# the last H100 run's compile times, not yet measured); it is cut off at LIMIT
# seconds (default 330) so that a 10-minute device command, or a rerun within the session's device time, still fits.
# The benchmark rewrites its JSON after every section, so a run cut short still brings back what it measured.
#
# Here, once:   the pinned wheels the GPU machine lacks into .gpu/ (about 21 MB; the workspace's GPU tools prepare them)
# Then the device tool's run, from the project root, with carry [".gpu"] and timeout_s 360:
#   bash benchmarks/gpu_run.sh                 (extra arguments go to gpu_benchmark.py, e.g. --sections trainer)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
LIMIT="${LIMIT:-330}"
mkdir -p "$OUT"
source .gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1
# SIGTERM at LIMIT (Python writes nothing more, the JSON of the finished sections stays), SIGKILL 15 s later.
timeout --kill-after=15 "$LIMIT" python3 benchmarks/gpu_benchmark.py --output "$OUT/gpu-benchmark.json" "$@" \
  2>&1 | tee "$OUT/gpu-benchmark.log"
status=${PIPESTATUS[0]}
echo "gpu_benchmark.py exit status $status (124: cut off at $LIMIT s)"
exit "$status"
