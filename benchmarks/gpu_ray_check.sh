#!/usr/bin/env bash
# Issue 34, item 6: `bertforge train --gpu` through Ray Train (TorchTrainer, use_gpu=True,
# NCCL) on one GPU worker of a local Ray, to a checkpoint, then the same command again, which
# must resume from it. Ray and bertforge must be importable (on the lent machine: installed
# into /tmp/site from wheels, benchmarks/README.md). The log is OUT/gpu_ray_check.log.
#
#   OUT=/tmp/rc bash benchmarks/gpu_ray_check.sh              # GPU
#   SMOKE=1 OUT=/tmp/rc bash benchmarks/gpu_ray_check.sh      # CPU: tiny, no --gpu
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for results}"
DATA=${DATA:-.gpu-data/shards-128}
BERTFORGE=${BERTFORGE:-bertforge}
RUN=${RUN:-/tmp/gpu-ray-run}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_ray_check.log") 2>&1

if [ "${SMOKE:-0}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=
  ARGS=(--preset tiny --micro-batch-size 8 --global-batch-size 16 --precision fp32)
else
  # BERT-large, the phase-1 recipe at a short run's batch: 512 sequences a step. (The run of
  # 2026-11-26 needed --eval-every 0: the validation split of 269 rows was smaller than the
  # H200's micro-batch of 512, which the loop now evaluates in smaller batches.)
  ARGS=(--recipe bert_large_phase1 --global-batch-size 512 --gpu --peak-tflops 989 --eval-every 0)
fi
ARGS+=(--data "$DATA" --run-dir "$RUN" --workers 1 --checkpoint-every 10 --log-every 5
       --warmup-steps 2)

status=0
for steps in 10 20; do  # the second run must resume from the first one's checkpoint
  echo "[gpu_ray_check] train to step $steps: start $(date -u +%T)"
  started=$SECONDS
  timeout 240 "$BERTFORGE" train "${ARGS[@]}" --max-steps "$steps" || status=1
  echo "[gpu_ray_check] exit status so far $status after $((SECONDS - started)) s"
done
grep -h '"step"' "$RUN/metrics.jsonl" > "$OUT/gpu_ray_check_metrics.jsonl" 2>/dev/null
cp "$RUN/config.json" "$OUT/gpu_ray_check_config.json" 2>/dev/null
echo "[gpu_ray_check] done $(date -u +%T), status $status"
exit $status
