#!/usr/bin/env bash
# Issue 36's NAMM for every budget, end to end (docs/results.md, "The budget as an input"; about 2 h 10 min on
# 2 cores): four runs, each starting from the NAMM of the one before (`namm.init`), then the budget eval.
#  1. build/interruption-keep-balanced: both regimes (the threshold with prompt=keep, budgets 8-64), weighted;
#     its rows: training (seed 1), held-out (seed 2), and the longer held-out interruptions (seed 3);
#  2. build/interruption-long-tune: continued with long-interruption training rows (seed 6) at budgets 16 and 32;
#  3. build/interruption-long-tune2: continued with the threshold weighing 4;
#  4. build/interruption-budget-input: continued with the budget as an input (its embedding starting at zeros);
#  5. each NAMM at its threshold (with and without prompt=keep) and at budgets 8-64 beside StreamingLLM, H2O, TOVA,
#     L2 and SnapKV on both held-out sets: <OUT>/eval-budgets/results.html (paired t at each budget).
# The runs' specs name these directories (their namm.init), so they are fixed. Each step resumes or is skipped
# when its output exists. Run from the repository root with the binaries in $BUILD_DIR/bin.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BUILD_DIR:-build}/bin
MODEL=../shared/models/stories260K
MODEL_FLAGS=(--model "$MODEL/stories260K.bin" --tokenizer "$MODEL/tok512.bin")
LONG=(--pool 128 --prefix-range 200:200 --interruption-range 400:400 --story-tokens 300)
RUNS=(balanced:interruption-keep-budgets-balanced-cpu long-tune:interruption-keep-budgets-long-cpu
      long-tune2:interruption-keep-budgets-long-threshold-cpu budget-input:interruption-keep-budgets-input-cpu)

previous=
for run in "${RUNS[@]}"; do
  out=build/interruption-${run%%:*}
  [ "${run%%:*}" = balanced ] && out=build/interruption-keep-balanced
  mkdir -p "$out"
  if [ -n "$previous" ]; then
    for rows in "$previous"/interruption*.jsonl; do [ -s "$out/$(basename "$rows")" ] || cp "$rows" "$out/"; done
  fi
  [ "${run%%:*}" != long-tune ] || [ -s "$out/interruption_long.jsonl" ] || "$BIN/namm-worker" build-synthetic \
    --family interruption "${MODEL_FLAGS[@]}" --seed 6 --rows 256 "${LONG[@]}" --out "$out/interruption_long.jsonl"
  echo "=== $out: coordinator/runs/${run#*:}.yaml"
  KEEP_PROMPT=1 CONFIG="coordinator/runs/${run#*:}.yaml" OUT="$out" BUDGETS=8,16,32,64 scripts/interruption-experiment.sh
  [ -s "$out/interruption_long_heldout.jsonl" ] || "$BIN/namm-worker" build-synthetic --family interruption \
    "${MODEL_FLAGS[@]}" --seed 3 --rows 128 "${LONG[@]}" --out "$out/interruption_long_heldout.jsonl"
  namm="$out/interruption-namm.safetensors"
  [ -s "$out/eval-budgets/results.json" ] || "$BIN/namm-worker" eval "${MODEL_FLAGS[@]}" \
    --tasks syn/interruption_heldout,syn/interruption_long_heldout --rows 0:128 --data-dir "synthetic=$out" \
    --threads "${THREADS:-2}" --policies "namm:$namm,namm:$namm,prompt=keep,streaming,h2o,tova,l2,snapkv" \
    --budgets 8,16,32,64 --out "$out/eval-budgets"
  previous=$out
done
