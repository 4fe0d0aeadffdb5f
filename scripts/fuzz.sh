#!/usr/bin/env bash
# Runs each libFuzzer target of BUILD_DIR (made by `make fuzz`) for RUNS executions, starting from its seed corpus
# in tests/fuzz/corpus/<target> (read only: new inputs go to a scratch directory). A crash's input is kept as
# tests/fuzz/crashes/<target>/crash-<sha1> for ctest to replay; the script then fails. TARGETS (the third
# argument, names without fuzz_) picks some: `scripts/fuzz.sh build-fuzz 10000000 "torch_archive openai_request"`.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build-fuzz}
RUNS=${2:-1000000}
TARGETS=${3:-run_spec namm_file tokenizer_json llama2c_tokenizer chat_template rpc_messages torch_archive openai_request}
failed=()
for target in $TARGETS; do
  scratch=$(mktemp -d)
  mkdir -p "tests/fuzz/crashes/$target"
  echo "== fuzz_$target: $RUNS runs"
  start=$(date +%s)
  status=0
  max_len=65536
  [ "$target" = run_spec ] && max_len=8192  # a run spec is a page of YAML
  "$BUILD_DIR/bin/fuzz_$target" -runs="$RUNS" -max_len="$max_len" -print_final_stats=1 \
    -artifact_prefix="tests/fuzz/crashes/$target/" "$scratch" "tests/fuzz/corpus/$target" > "$scratch.log" 2>&1 ||
    status=$?
  grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)|ERROR|SUMMARY" "$scratch.log" || true
  rm -f "$scratch.log"
  echo "   $(( $(date +%s) - start )) s, exit status $status, corpus grew to $(ls "$scratch" | wc -l) new inputs"
  rm -rf "$scratch"
  [ "$status" -eq 0 ] || failed+=("$target")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in ${failed[*]} (inputs under tests/fuzz/crashes/)"
  exit 1
fi
echo "fuzz: every target ran $RUNS executions without a crash"
