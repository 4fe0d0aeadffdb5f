#!/usr/bin/env bash
# make demo: a short real training run on this machine. The coordinator and two CPU workers (real processes on
# loopback, gRPC), the bundled stories260K model, the CPU-scale story-recall task built from it, a population of 8
# for 6 generations in 2 stages; then the best NAMM is exported and the training report written. One progress line
# per generation, and a summary of where everything is. Runs from the repository root with binaries in $BUILD_DIR/bin.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
BIN=$BUILD_DIR/bin
SHARED=${NAMM_SHARED_DIR:-../shared}
MODEL=$SHARED/models/stories260K
OUT=$BUILD_DIR/demo
SPEC=coordinator/runs/stories-cpu.yaml

if [ ! -f "$MODEL/stories260K.bin" ] || [ ! -f "$MODEL/tok512.bin" ]; then
  echo "demo: the stories260K model is not at $MODEL (set NAMM_SHARED_DIR to the shared data directory)" >&2
  exit 1
fi
# The spec names the model as ../shared/...: run from the repository root with the shared data beside it.
if [ "$(cd "$SHARED" && pwd)" != "$(cd ../shared 2>/dev/null && pwd)" ]; then
  echo "demo: $SPEC expects the shared data at ../shared; found it at $SHARED instead" >&2
  exit 1
fi

# A base port with itself and the next two free (coordinator, worker 0, worker 1).
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
METRICS_PORT=${DEMO_METRICS_PORT:-}
if [ -z "$METRICS_PORT" ]; then
  for p in $(seq 9464 3 9764); do
    if port_free "$p" && port_free $((p + 1)) && port_free $((p + 2)); then METRICS_PORT=$p; break; fi
  done
fi
[ -n "$METRICS_PORT" ] || { echo "demo: no free metrics ports between 9464 and 9766" >&2; exit 1; }

mkdir -p "$OUT"
# A fresh run every time: the database of an earlier demo would simply resume (and be finished already).
rm -f "$OUT/stories.db" "$OUT/stories.db-wal" "$OUT/stories.db-shm" "$OUT/stories-namm.safetensors"

start=$(date +%s)
if [ ! -s "$OUT/synthetic/story_recall.jsonl" ]; then
  echo "== building the story-recall task's 64 rows with the model ($OUT/synthetic)"
  "$BIN/namm-worker" build-synthetic --model "$MODEL/stories260K.bin" --tokenizer "$MODEL/tok512.bin" \
    --out "$OUT/synthetic/story_recall.jsonl" --rows 64 2>/dev/null
fi

echo "== training: namm-coordinator run --local-workers 2 ($SPEC)"
"$BIN/namm-coordinator" run --config "$SPEC" --db "$OUT/stories.db" --local-workers 2 \
  --data-dir "synthetic=$OUT/synthetic" --metrics-listen "127.0.0.1:$METRICS_PORT" --log-level warn

echo "== exporting the best NAMM"
"$BIN/namm-coordinator" export --db "$OUT/stories.db" --best --out "$OUT/stories-namm.safetensors"

echo "== training report"
"$BIN/namm-coordinator" report --db "$OUT/stories.db" --out "$OUT/report"

echo "== summary"
"$BIN/namm-coordinator" status --db "$OUT/stories.db" --generations
cat <<SUMMARY

demo finished in $(( $(date +%s) - start )) s
  database:        $OUT/stories.db   (namm-coordinator status --db $OUT/stories.db --generations)
  exported NAMM:   $OUT/stories-namm.safetensors   (namm-worker run-task --namm ... uses it)
  report:          $OUT/report/report.html   (training curves; CSVs beside it)
  metrics (while the run ran): coordinator http://127.0.0.1:$METRICS_PORT/metrics,
                   workers http://127.0.0.1:$((METRICS_PORT + 1))/metrics and http://127.0.0.1:$((METRICS_PORT + 2))/metrics
  dashboard:       dashboards/namm-training.json (Grafana; deploy/README.md runs Prometheus and Grafana with it)
SUMMARY
