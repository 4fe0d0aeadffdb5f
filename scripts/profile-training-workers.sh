#!/usr/bin/env bash
# The share of a training worker's CPU samples in arithmetic kernels (issue 34's goal; docs/performance.md), as the
# interruption experiment runs them: `namm-coordinator run` of coordinator/runs/interruption-cpu.yaml with 2 local
# workers of one thread each, both workers recorded with perf for RECORD seconds from START seconds in (default
# 40 and 50: past start-up, model loading and the first reference scores), then the run stopped.
#   scripts/profile-training-workers.sh OUT.data [BIN_DIR]
# Needs the interruption rows in $ROWS (default build/interruption: scripts/interruption-experiment.sh step 1) and
# Debian's linux-perf. The run's database is a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 OUT.data [BIN_DIR]" >&2; exit 2; }
out=$(realpath -m "$1")
BIN=${2:-build/bin}
ROWS=${ROWS:-build/interruption}
START=${START:-40}
RECORD=${RECORD:-50}
[ -s "$ROWS/interruption.jsonl" ] || { echo "no $ROWS/interruption.jsonl (scripts/interruption-experiment.sh makes it)" >&2; exit 2; }
dir=$(mktemp -d)
trap 'kill "$run" 2> /dev/null || true; wait 2> /dev/null || true; rm -rf "$dir"' EXIT
"$BIN/namm-coordinator" run --config coordinator/runs/interruption-cpu.yaml --db "$dir/run.db" --local-workers 2 \
  --data-dir "synthetic=$ROWS" --log-level warn > "$dir/run.log" 2>&1 &
run=$!
sleep "$START"
workers=$(pgrep -d, -f "namm-worker serve .*--name local-") || { echo "no local worker running" >&2; cat "$dir/run.log" >&2; exit 1; }
perf record -q -e cpu-clock -F 999 -p "$workers" -o "$out" -- sleep "$RECORD" > /dev/null 2>&1
scripts/perf-share.py "$out"
