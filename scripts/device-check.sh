#!/usr/bin/env bash
# The inference engine on a GPU node whose libtorch comes from a PyTorch install (python3 -c 'import torch').
# The node needs a C++ compiler, CMake, Ninja and that PyTorch; what else the engine builds with (nlohmann-json,
# PCRE2, GoogleTest) and the data its tests read come along in a folder made on a machine with
# scripts/install-deps.sh's packages and ../shared:
#
#   scripts/device-check.sh pack DIR       copies those headers and static libraries (DIR/usr) and the
#                                          stories260K model and GPT-2 tokenizer (DIR/shared) into DIR
#   scripts/device-check.sh run DIR OUT    on the node: builds namm_core, the engine, their tests and
#                                          worker_generation_bench (NAMM_ENGINE_ONLY) in build-device, runs the
#                                          tests (the engine on CUDA against the CPU among them) and the benchmark
#                                          on the GPU; logs go to OUT (machine.txt, build.log, steps.log),
#                                          each step's tail to stdout
#
# `run` keeps going past a failed step so that one pass reports everything; it exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
dir=${2:-}
if [ -z "$mode" ] || [ -z "$dir" ]; then
  echo "usage: $0 pack DIR | run DIR OUT" >&2
  exit 2
fi
dir=$(mkdir -p "$dir" && cd "$dir" && pwd)

if [ "$mode" = pack ]; then
  set -e
  shared=${NAMM_SHARED_DIR:-../shared}
  arch=$(gcc -print-multiarch)
  mkdir -p "$dir/usr/include" "$dir/usr/lib/$arch/cmake" "$dir/usr/share/cmake" "$dir/shared/models" "$dir/shared/tokenizers"
  cp -r /usr/include/nlohmann /usr/include/gtest /usr/include/gmock /usr/include/pcre2.h "$dir/usr/include/"
  cp -r /usr/share/cmake/nlohmann_json "$dir/usr/share/cmake/"
  cp -r "/usr/lib/$arch/cmake/GTest" "$dir/usr/lib/$arch/cmake/"
  # Static libraries only, so that the binaries need nothing of them at run time.
  cp /usr/lib/$arch/lib{gtest,gtest_main,gmock,gmock_main,pcre2-8}.a "$dir/usr/lib/$arch/"
  cp -r "$shared/models/stories260K" "$dir/shared/models/"
  cp -r "$shared/tokenizers/gpt2" "$dir/shared/tokenizers/"
  du -sh "$dir"
  exit 0
fi

if [ "$mode" != run ]; then
  echo "unknown mode '$mode': pack or run" >&2
  exit 2
fi
out=${3:?usage: $0 run DIR OUT}
mkdir -p "$out"
failed=()
step() {  # step NAME COMMAND...: runs COMMAND; its output goes to OUT/NAME.log for the build, else to
          # OUT/steps.log (few files: a node may send back only a handful), and its tail to stdout
  local name=$1
  shift
  local log=$out/$name.log
  [ "$name" = build ] || log=$(mktemp)
  echo "== $name: $*"
  local start=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-15}" "$log"
  echo "== $name: exit $rc in $((SECONDS - start)) s"
  if [ "$name" != build ]; then
    { echo "== $name: $* (exit $rc)"; cat "$log"; } >>"$out/steps.log"
    rm -f "$log"
  fi
  [ $rc -eq 0 ] || failed+=("$name")
  return $rc
}

# CMake finds the CUDA toolkit libtorch was built against by its compiler.
[ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
python=$(command -v python3)
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11 abi",
    torch.compiled_with_cxx11_abi())'
  ${CXX:-c++} --version | head -1
  cmake --version | head -1
  nproc
} 2>&1 | tee "$out/machine.txt"

build=${BUILD_DIR:-build-device}  # beside DIR, so that a rerun on the same node rebuilds only what changed
TAIL_LINES=5 step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNAMM_ENGINE_ONLY=ON \
  -DNAMM_WERROR=OFF -DNAMM_WITH_CUDA=ON "-DCMAKE_PREFIX_PATH=$torch_prefix;$dir/usr" \
  "-DNAMM_SHARED_DIR=$dir/shared" "-DNAMM_SYSTEM_PYTHON=$python"
TAIL_LINES=25 step build cmake --build "$build" -j "$(nproc)" -- -k 0
grep -E "error|Error" "$out/build.log" | head -40

bin=$build/bin
bench=$bin/worker_generation_bench
shape=layers=2,dim=2048,heads=16,kv_heads=4,ffn=7168,vocab=32000       # issue 18's 8B-shaped model
llama3_8b=layers=2,dim=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000  # Llama 3 8B's layers (fewer, smaller vocabulary)
# Most telling first: the engine on CUDA, then the benchmark, then the CPU suites (libtorch's version differs).
TAIL_LINES=30 step cuda_engine_tests timeout 300 "$bin/engine_tests" --gtest_filter='EngineOnCuda.*'
step cuda_namm_policy timeout 60 "$bin/namm_core_tests" --gtest_filter='*Cuda*'
export TAIL_LINES=12
step parts timeout 300 "$bench" --device cuda:0 --parts 1024,4096,16384,32768 --repeats 5
TAIL_LINES=24 step bench_8b_bf16_4k timeout 300 "$bench" --device cuda:0 --dtype bf16 --random-model "$shape" \
  --prompt-tokens 4096 --new-tokens 32 --repeats 5 --profile 1
step bench_stories_cuda timeout 300 "$bench" --device cuda:0 --repeats 3
step bench_8b_fp32_4k timeout 300 "$bench" --device cuda:0 --dtype fp32 --random-model "$shape" \
  --prompt-tokens 4096 --new-tokens 32 --repeats 3
TAIL_LINES=24 step bench_llama3_8b_layers_bf16_4k timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b" --prompt-tokens 4096 --new-tokens 32 --repeats 3 --profile 1
TAIL_LINES=8 step engine_tests timeout 300 "$bin/engine_tests"
TAIL_LINES=8 step namm_core_tests timeout 300 "$bin/namm_core_tests"
TAIL_LINES=24 step bench_8b_bf16_16k timeout 300 "$bench" --device cuda:0 --dtype bf16 --random-model "$shape" \
  --prompt-tokens 16384 --new-tokens 32 --repeats 3 --profile 1
TAIL_LINES=24 step bench_llama3_8b_layers_bf16_16k timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b" --prompt-tokens 16384 --new-tokens 32 --repeats 3 --profile 1

if [ ${#failed[@]} -gt 0 ]; then
  echo "device-check: failed steps: ${failed[*]}"
  exit 1
fi
echo "device-check: every step passed"
