#!/usr/bin/env bash
# Issue 34's whole GPU check in one call of the lent machine (benchmarks/README.md, "The GPU
# check in one call"): install, throughput with the transformers peer rows, the kernel profile
# of the defaults, of FP8 GEMMs and of the compiled peer (inductor's Triton kernels put against
# the memory bandwidth, and their sources brought back), the real loop's proof run (with a
# profile of the loop), the fast path's parity with its twins, the eager paths, fp32 and FP8,
# and the variants' A/B. Each stage writes its files under OUT as it finishes and has a time
# limit of its own, so a stage that runs long costs only itself; the log is OUT/gpu_check.log.
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine: OUT set, .whl carried
#   STAGES="throughput" bash benchmarks/gpu_check.sh          # one stage again
#   STAGES="parity variants" bash benchmarks/gpu_check.sh     # parity and the experiments
#   SMOKE=1 OUT=/tmp/gc bash benchmarks/gpu_check.sh          # CPU smoke run (tiny, 2 steps)
#
# Variables: OUT (where results go), STAGES (default "throughput profile proof"; "parity" adds
# gpu_parity.py, "fidelity" gradient_fidelity.py (each precision path's loss and gradients
# against fp64's at fixed weights), "attention" attention_kernels.py (SDPA's kernels alone by
# backend, padding mask and dropout), "variants" gpu_throughput.py at 128 tokens without the
# peer, once with the defaults and once per experiment in VARIANTS, in one table),
# PROFILE_CASES (gpu_profile.py's --cases), PROFILE_LIMIT and VARIANT_LIMIT (seconds),
# VARIANT_SEQ_LENS (the variants' sequence lengths on a GPU, default 128; "512" for the
# length where attention is a quarter of the step),
# PARITY_FLAGS (more of gpu_parity.py's flags, e.g. --rel-tolerance 5e-3), THROUGHPUT_FLAGS and
# PROOF_FLAGS (more of gpu_throughput.py's and gpu_proof_run.py's, e.g. --fp8 --packing: the
# issue's table and the real loop with an experiment that won its variant run), VARIANTS (see
# below), COMMIT (recorded in every result: the tree has no .git there), DATA (shards for the
# proof run, default .gpu-data/shards-128), PYTHON (default python3), SMOKE=1 (CPU, tiny
# model, a few minutes, most of them compiling the peer).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for results}"
STAGES=${STAGES:-"throughput profile proof"}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DATA=${DATA:-.gpu-data/shards-128}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

if [ "${SMOKE:-0}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=
  THROUGHPUT=(--device cpu --config tiny --seq-lens 64 --micro-batch 4 --steps 2 --warmup 1
              --num-batches 2 --peak-tflops 1 --peer)
  # bf16 named: fp864x4 needs autocast, and "auto" is fp32 on an AVX2 machine.
  PROFILE=(--device cpu --config tiny --cases "${PROFILE_CASES:-ours64x4,hfc64x4,fp864x4}"
           --warmup 1 --timed 1 --profiled 1 --engine-args=--precision=bf16)
  PROOF=(--preset tiny --steps 20 --micro-batch 8 --lr 3e-3 --precision fp32 --min-drop 0
         --log-every 5)
  # --compile: as on a GPU, where the layers are compiled by default (a --compile-mode
  # variant needs them compiled; on a CPU it only times the compile).
  VARIANT_ARGS=(--device cpu --config tiny --seq-lens 64 --micro-batch 4 --steps 2 --warmup 1
                --num-batches 2 --peak-tflops 1 --compile)
  # --fp8: torch's _scaled_mm runs on the CPU too (slowly); under bf16 only, which "auto"
  # gives on a CPU with native bf16 (an AVX2 machine resolves fp32 and refuses it).
  PARITY=(--preset tiny --steps 20 --micro-batch 8 --lr 3e-3 --fp8)
  FIDELITY=(--preset tiny --micro-batch 8 --batches 2 --train-steps 10 --lr 3e-3 --fp8)
  ATTENTION=(--device cpu --shapes 64x4 --heads 2 --head-size 16 --warmup 1 --repeats 2
    --backends cudnn,flash,efficient,math,jagged-flash,jagged-efficient,jagged-math)
  LIMIT=(600 600 600 600 600 600 600)
else
  # Where nothing is installed (the lent machine): DeepSpeed and its missing dependencies as
  # wheels in .whl, and this checkout, into /tmp/site (benchmarks/README.md says how).
  if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --no-cache-dir --upgrade --target /tmp/site . .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  nvidia-smi -L
  THROUGHPUT=(--seq-lens 128,512 --steps 30 --warmup 10)
  # The defaults and the compiled peer (whose compile finds the throughput stage's cache).
  # The "before" case (ZeRO-2, eager) is committed twice (2026-11-26 and -27); FP8's
  # (fp8128x256, where its casts spend their time) is an experiment since its tensor-wise
  # recipe ran 0.98x the defaults on 2026-11-28: PROFILE_CASES=fp8128x256,ours128x256.
  PROFILE=(--cases "${PROFILE_CASES:-ours128x256,hfc128x256}" --warmup 10 --timed 10
           --profiled 3)
  PROOF=(--steps 120)
  VARIANT_ARGS=(--seq-lens "${VARIANT_SEQ_LENS:-128}" --steps 30 --warmup 10)
  PARITY=(--steps 100 --fp8)
  # BERT-large past its warm-up (30 steps of the fast path's arithmetic at the recipe's peak
  # rate), then its loss and gradients by each path against fp64's on 4 other batches.
  FIDELITY=(--micro-batch 64 --batches 4 --train-steps 30 --fp8)
  # SDPA's kernels alone at 128 x 256 and 512 x 64: 4 backends x mask x dropout (unmeasured
  # on a GPU: 64 rows of 25 short calls, seconds).
  ATTENTION=()
  # Seconds per stage (variants: each of its runs), in the order of the array: throughput,
  # profile, proof, a variant, parity, fidelity (unmeasured on a GPU: three compiles of a
  # layer and ~40 steps; 2 min 38 s to 4 min 25 s for 2 layers of BERT-large at 8 x 128 on 2
  # CPU cores), attention (unmeasured: no compile, seconds). The default three 9.7 minutes at most (on 2026-11-27:
  # 262, 61 and 99 s; on 2026-11-28 the throughput took 309 s, and the profile, which then
  # compiled the peer afresh and FP8 as a third case, ran past its 120), "parity variants"
  # with the default three variants 9.2 (on 2026-11-28: 200 s and 43-58 s a variant): each
  # inside one 10-minute call. PROFILE_LIMIT and VARIANT_LIMIT override theirs.
  LIMIT=(320 120 140 90 280 180 90)
fi

# Scratch of the stages that run the loop: a rerun on a warm machine starts afresh (the proof
# run would resume the last call's finished run and refuse to overwrite its export).
rm -rf /tmp/gpu-proof /tmp/gpu-parity /tmp/gpu-variants /tmp/gpu-kernels /tmp/gpu-fidelity

status=0
stage() {  # name, time limit, command...
  local name=$1 limit=$2
  shift 2
  case " $STAGES " in *" $name "*) ;; *) return ;; esac
  echo "[gpu_check] $name: start $(date -u +%T), limit ${limit}s"
  local started=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "[gpu_check] $name: exit $rc after $((SECONDS - started)) s"
  [ "$rc" = 0 ] || status=1
}

# gpu_throughput.py's variants of the defaults (experiments, or a default turned off), each a
# row beside the defaults measured in the same call: space-separated "tag:flags", the flags
# separated by commas without spaces ("tag:" alone: no flags). VARIANT_LIMIT overrides a run's
# time limit, e.g. 300 for "gemm-epilogue:--compile-mode=max-autotune-no-cudagraphs" (minutes
# of tuning).
# By default the opt-in FP8 GEMMs (training.fp8) and dropout off (a diagnostic: what
# dropout's masks cost a step, cuDNN's attention dropout included, never a way to train)
# beside the defaults. Others:
# "buckets:--gradient-buckets", several ranks' stage-0 reduction (gradient buckets,
# all-reduced during the backward) run here over one rank: its cost on one GPU, and that it
# runs on NCCL's and autograd's streams (one rank's all-reduce leaves the values as they are,
# so the same loss shows the buckets' bookkeeping, not the ordering of the streams: that takes
# two GPUs; its arithmetic is held on two CPU ranks); "fp32-residual:--no-bf16-residual", the
# fp32 residual stream against the default bf16 one (1.032x on 2026-11-27);
# "tuned:--inductor-config=coordinate_descent_tuning=True" and
# "fused-rng:--inductor-config=fallback_random=False" (masks drawn inside the fused kernels,
# the default before ATen's masks), inductor settings as experiments;
# "lanes:--dropout-mask=lanes" and "math-attention:--attention=math" (figures of 2026-11-28 in
# benchmarks/README.md); "packing:--packing", up to 3 instances a row as `train --packing`
# (the synthetic batches' 4.6 % of padding at 128 tokens falls to 0.4 %);
# "pdl:--inductor-config=triton.enable_pdl=True" (Hopper's programmatic dependent launch for
# inductor's kernels) and "aggressive:--inductor-config=aggressive_fusion=True". With FP8 on a
# CPU name bf16 ("fp8:--fp8,--precision=bf16"): "auto" resolves fp32 where bf16 is emulated.
VARIANTS=${VARIANTS:-"defaults: fp8:--fp8 no-dropout:--no-dropout"}

# Seconds and no compile: first, so that a call cut short still has it.
stage attention "${LIMIT[6]}" "$PYTHON" benchmarks/attention_kernels.py "${ATTENTION[@]}" \
  --commit "$COMMIT" --output-dir "$OUT"
stage throughput "${LIMIT[0]}" "$PYTHON" benchmarks/gpu_throughput.py "${THROUGHPUT[@]}" \
  ${THROUGHPUT_FLAGS:-} --commit "$COMMIT" --output-dir "$OUT"
stage profile "${PROFILE_LIMIT:-${LIMIT[1]}}" "$PYTHON" benchmarks/gpu_profile.py "${PROFILE[@]}" \
  --commit "$COMMIT" --output-dir "$OUT" --kernel-sources /tmp/gpu-kernels
# The Triton kernels the profiled cases ran, to read where there is no GPU (one file: at most
# 8 come back, and the default stages write 7 besides).
if compgen -G "/tmp/gpu-kernels/*" >/dev/null; then
  tar -czf "$OUT/inductor_kernels.tar.gz" -C /tmp/gpu-kernels .
fi
# The proof run's run directory and export stay out of OUT (only 8 files come back).
stage proof "${LIMIT[2]}" "$PYTHON" benchmarks/gpu_proof_run.py --data "$DATA" \
  --output-dir /tmp/gpu-proof "${PROOF[@]}" ${PROOF_FLAGS:-} --commit "$COMMIT"
cp /tmp/gpu-proof/gpu_proof_run-* "$OUT/" 2>/dev/null
stage parity "${LIMIT[4]}" "$PYTHON" benchmarks/gpu_parity.py --data "$DATA" \
  --output-dir /tmp/gpu-parity "${PARITY[@]}" ${PARITY_FLAGS:-} --commit "$COMMIT"
cp /tmp/gpu-parity/gpu_parity-* "$OUT/" 2>/dev/null
stage fidelity "${LIMIT[5]}" "$PYTHON" benchmarks/gradient_fidelity.py --data "$DATA" \
  --output-dir /tmp/gpu-fidelity "${FIDELITY[@]}" --commit "$COMMIT"
cp /tmp/gpu-fidelity/gradient_fidelity-* "$OUT/" 2>/dev/null
case " $STAGES " in *" variants "*)
  for variant in $VARIANTS; do
    case $variant in *:*) ;; *) echo "[gpu_check] VARIANTS: $variant is not tag:flags"; exit 2;; esac
    tag=${variant%%:*}
    flags=${variant#*:}
    echo "[gpu_check] variant $tag: ${flags:-the defaults}"
    stage variants "${VARIANT_LIMIT:-${LIMIT[3]}}" "$PYTHON" benchmarks/gpu_throughput.py \
      "${VARIANT_ARGS[@]}" ${flags//,/ } --no-peer --tag "variant-$tag" --commit "$COMMIT" \
      --output-dir /tmp/gpu-variants
    # After each run, so that a call cut short still brings back the runs it finished. At
    # most 8 files come back from the lent machine: the table, and each run's in one archive.
    if compgen -G "/tmp/gpu-variants/*.json" >/dev/null; then
      "$PYTHON" benchmarks/ab_table.py /tmp/gpu-variants/gpu_throughput_*variant-*.json \
        > "$OUT/variants.md" || status=1
      tar -czf "$OUT/variants.tar.gz" -C /tmp/gpu-variants .
    fi
  done
  cat "$OUT/variants.md" 2>/dev/null
esac
echo "[gpu_check] done $(date -u +%T), status $status"
exit $status
