#!/usr/bin/env bash
# The quality runs of one lent GPU session, in one command (the machine is lent for minutes, so everything runs at
# once and stops at a deadline; finished runs are kept, unfinished ones killed):
#   * the Multi30k recipe as it runs on an accelerator (training/recipes/multi30k.sh: 10-minute budget, bf16, batch
#     128), English-German and English-French, unchanged: does a GPU run of 10 minutes reach the CPU recipe's BLEU?
#   * the initialization study (benchmarks/init_study.py) at d_model 512 with half the learning rate
#     (INIT_ARGS, default "--widths 512 --lr_scale 0.5"), the rows the CPU could not run, on the GPU.
# All runs share the GPU and the cores, so a recipe run's steps in its 10 minutes are a lower bound of a run alone.
#
# Usage, from the project root on the GPU machine, after `bash ../shared/tools/gpu/prepare.sh` here and the two data
# folders copied to .gpu/data/ (the device tool carries .gpu):
#   source .gpu/env.sh && bash benchmarks/gpu_quality_run.sh .gpu/data OUT_DIR
# OUT_DIR gets recipe-runs.json, init-study.json and quality-logs.tar.gz (logs, results, generations; no weights).
set -uo pipefail
DATA="$1"
OUT="$2"
DEADLINE_SECONDS="${DEADLINE_SECONDS:-555}"  # the device tool's 600-second call, less the packing at the end
WORK="${WORK:-/tmp/quality}"
INIT_WORKERS="${INIT_WORKERS:-4}"
INIT_DEVICE="${INIT_DEVICE:-cuda}"
INIT_ARGS="${INIT_ARGS:---widths 512 --lr_scale 0.5}"
mkdir -p "$WORK/runs" "$OUT"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHON="${PYTHON:-python3}"
nvidia-smi -L 2>/dev/null; grep -m1 "model name" /proc/cpuinfo; nproc --all; uptime

pids=()
launch() {  # NAME DATA_SUBDIR PAIR
  setsid bash training/recipes/multi30k.sh "$DATA/$2" "$WORK/runs/$1" "$3" > "$WORK/$1.log" 2>&1 &
  pids+=($!)
}
launch gpu-recipe-en-de multi30k en-de
launch gpu-recipe-en-fr multi30k-en-fr en-fr
setsid "$PYTHON" benchmarks/init_study.py --device "$INIT_DEVICE" --workers "$INIT_WORKERS" --work_dir "$WORK/init" \
  --deadline_minutes "$(( (DEADLINE_SECONDS - 90) / 60 ))" --output "$WORK/init-study.json" $INIT_ARGS \
  > "$WORK/init-study.log" 2>&1 &
pids+=($!)

while (( SECONDS < DEADLINE_SECONDS )); do
  running=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=$((running + 1)); done
  (( running == 0 )) && break
  if (( SECONDS % 60 < 15 )); then
    logged=$(grep -ho "'loss': '[0-9.]*'.*'epoch'" "$WORK"/*.log 2>/dev/null | wc -l)
    echo "[$SECONDS s] $running running; $logged loss lines"
    grep -h "Recipe finished\|test_bleu" "$WORK"/*.log 2>/dev/null | tail -4
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  fi
  sleep 15
done
for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null; done
sleep 3
"$PYTHON" benchmarks/multi30k_runs.py "$WORK"/runs/* --output "$OUT/recipe-runs.json"
[ -f "$WORK/init-study.json" ] || "$PYTHON" benchmarks/init_study.py --summarize --work_dir "$WORK/init" \
  --output "$WORK/init-study.json" > /dev/null 2>&1
cp "$WORK/init-study.json" "$OUT/" 2>/dev/null
tail -n 40 "$WORK/init-study.log"
cd "$WORK" && tar czf "$OUT/quality-logs.tar.gz" --exclude='*.safetensors' --exclude='checkpoint-*' \
  --exclude='*.py' --exclude='*.bin' --exclude='tokenizer.json' --exclude='*.pt' --exclude='*.pth' \
  ./*.log init runs init-study.json 2>/dev/null
ls -la "$OUT"
