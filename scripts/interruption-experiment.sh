#!/usr/bin/env bash
# The held-out experiment of docs/results.md, end to end on this machine (about 40 minutes on 2 cores):
#  1. the interruption task's rows: 512 training rows (seed 1) and 128 held-out rows (seed 2, other stories);
#  2. a NAMM evolved on the training rows (coordinator/runs/interruption-cpu.yaml, 2 local workers);
#  3. the stage's best NAMM exported, and the run's training report (with what the NAMM keeps on a training row);
#  4. `namm-worker eval` on the held-out rows: full cache, the oracle, the NAMM, and every baseline over 5 budgets;
#  5. the clean-context score (the story without its interruption) for reference.
# Each step resumes or is skipped when its output exists, so the script can be rerun after an interruption.
# Run from the repository root with the binaries in $BUILD_DIR/bin.
# Evolution over budgets (docs/results.md, issue 36): CONFIG=coordinator/runs/interruption-budgets-cpu.yaml
# OUT=build/interruption-budgets BUDGETS=8,16,32,64 (the eval then pairs the NAMM with each baseline per budget).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
BIN=$BUILD_DIR/bin
OUT=${OUT:-$BUILD_DIR/interruption}
CONFIG=${CONFIG:-coordinator/runs/interruption-cpu.yaml}
BUDGETS=${BUDGETS:-8,16,32,64,128}
# KEEP_PROMPT=1: the NAMM is evaluated as it was trained, with prompt=keep (a run whose tasks are
# "T@prompt=keep": interruption-keep-prompt-cpu.yaml).
NAMM_OPTIONS=${KEEP_PROMPT:+,prompt=keep}
MODEL=../shared/models/stories260K
MODEL_FLAGS=(--model "$MODEL/stories260K.bin" --tokenizer "$MODEL/tok512.bin")
mkdir -p "$OUT"

echo "== 1. rows"
[ -s "$OUT/interruption.jsonl" ] || "$BIN/namm-worker" build-synthetic --family interruption "${MODEL_FLAGS[@]}" \
  --seed 1 --rows 512 --pool 128 --out "$OUT/interruption.jsonl"
[ -s "$OUT/interruption_heldout.jsonl" ] || "$BIN/namm-worker" build-synthetic --family interruption "${MODEL_FLAGS[@]}" \
  --seed 2 --rows 128 --pool 128 --out "$OUT/interruption_heldout.jsonl"

echo "== 2. training (resumes the run in $OUT/run.db if there is one)"
"$BIN/namm-coordinator" run --config "$CONFIG" --db "$OUT/run.db" --local-workers 2 \
  --data-dir "synthetic=$OUT" --log-level warn

echo "== 3. the evolved NAMM, what it keeps on the first training row, and the training report"
"$BIN/namm-coordinator" export --db "$OUT/run.db" --best --force --out "$OUT/interruption-namm.safetensors"
"$BIN/namm-worker" eval "${MODEL_FLAGS[@]}" --tasks syn/interruption --rows 0:1 --data-dir "synthetic=$OUT" --threads 1 \
  --policies "namm:$OUT/interruption-namm.safetensors$NAMM_OPTIONS" --explain-rows 1 --overwrite --out "$OUT/explain" > /dev/null
explain=$(find "$OUT/explain" -path '*namm*' -name explain-row-0.html | head -1)
"$BIN/namm-coordinator" report --db "$OUT/run.db" --out "$OUT/report" --explain "$explain"

echo "== 4. held-out evaluation"
"$BIN/namm-worker" eval "${MODEL_FLAGS[@]}" --tasks syn/interruption_heldout --data-dir "synthetic=$OUT" --threads 1 \
  --policies "oracle,namm:$OUT/interruption-namm.safetensors$NAMM_OPTIONS,streaming,h2o,tova,l2,snapkv,fastgen,fastgen:recovery=0.5" \
  --budgets "$BUDGETS" --out "$OUT/eval"

echo "== 5. clean context (the held-out rows without their interruption), full cache"
"$BIN/namm-worker" run-task "${MODEL_FLAGS[@]}" --task syn/interruption_heldout --data-dir "synthetic=$OUT" \
  --clean-context --threads 1 | tail -1
