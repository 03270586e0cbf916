#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (../shared/tools/gpu/README.md): gpu_benchmark.py with its JSON and
# log under $OUT, cut off at 8 minutes so the session keeps device time for a rerun. The benchmark rewrites its JSON
# after every section, so a run cut short still brings back what it measured.
#
# Here, once:   bash ../shared/tools/gpu/prepare.sh          (the pinned wheels into .gpu/, about 21 MB)
# Then the device tool's run, from the project root, with carry [".gpu"] and timeout_s 540:
#   bash benchmarks/gpu_run.sh                 (extra arguments go to gpu_benchmark.py, e.g. --ours-padded-layout)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
source .gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1
# SIGTERM at 480 s (Python writes nothing more, the JSON of the finished sections stays), SIGKILL 15 s later.
timeout --kill-after=15 480 python3 benchmarks/gpu_benchmark.py --output "$OUT/gpu-benchmark.json" "$@" \
  2>&1 | tee "$OUT/gpu-benchmark.log"
status=${PIPESTATUS[0]}
echo "gpu_benchmark.py exit status $status (124: cut off at 480 s)"
exit "$status"
