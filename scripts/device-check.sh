#!/usr/bin/env bash
# The inference engine on a GPU node whose libtorch comes from a PyTorch install (python3 -c 'import torch').
# The node needs a C++ compiler, CMake, Ninja and that PyTorch; what else the engine builds with (nlohmann-json,
# PCRE2, GoogleTest) and the data its tests read come along in a folder made on a machine with
# scripts/install-deps.sh's packages and ../shared:
#
#   scripts/device-check.sh pack DIR       copies those headers and static libraries (DIR/usr) and the
#                                          stories260K model and GPT-2 tokenizer (DIR/shared) into DIR, and
#                                          the coordinator's benchmark as built here (BUILD_DIR, default build)
#                                          with its shared libraries and data (DIR/coordinator.tar.xz)
#   scripts/device-check.sh run DIR OUT    on the node: builds namm_core, the engine, their tests and
#                                          worker_generation_bench (NAMM_ENGINE_ONLY, our CUDA kernels) in
#                                          build-device, runs the tests (the engine on CUDA against the CPU among
#                                          them) and the benchmarks on the GPU, the same benchmark without our
#                                          kernels, and the coordinator's benchmark on the node's cores; logs go
#                                          to OUT (machine.txt, build*.log, steps.log), each step's tail to stdout
#
# `run` keeps going past a failed step so that one pass reports everything; it exits non-zero if any failed.
# DEADLINE_S=N skips the steps that would start after N seconds (a node lent for a limited time); ONLY_STEPS=REGEX
# runs only the steps whose names match (and the builds).
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
  # The coordinator's benchmark, as built here (BUILD_DIR), with the shared libraries it loads (not the C
  # library's), its task definitions and the LongBench data it reads: a node with more cores than this machine
  # measures the coordinator rather than the simulated workers' gRPC stacks beside it.
  build=${BUILD_DIR:-build}
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" "$stage/share/namm/tasks" "$stage/shared/data"
  cp "$build/bin/coordinator_bench" "$build/bin/namm-sim-worker" "$stage/bin/"
  ldd "$stage/bin/coordinator_bench" "$stage/bin/namm-sim-worker" | awk '/=> \//{print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' | xargs -I{} cp -L {} "$stage/lib/"
  cp tasks/*.yaml "$stage/share/namm/tasks/"
  cp -r "$shared/data/longbench" "$stage/shared/data/"
  # The data path compiled into the benchmark, where `run` links the unpacked data.
  sed -n 's/^NAMM_SHARED_DIR:PATH=//p' "$build/CMakeCache.txt" >"$stage/shared_dir"
  tar -C "$stage" -cJf "$dir/coordinator.tar.xz" .
  rm -rf "$stage"
  du -sh "$dir" "$dir/coordinator.tar.xz"
  exit 0
fi

if [ "$mode" != run ]; then
  echo "unknown mode '$mode': pack or run" >&2
  exit 2
fi
out=${3:?usage: $0 run DIR OUT}
mkdir -p "$out"
failed=()
deadline=${DEADLINE_S:-0}  # > 0: steps that would start after this many seconds are skipped (named at the end)
skipped=()
step() {  # step NAME COMMAND...: runs COMMAND; its output goes to OUT/NAME.log for builds, else to
          # OUT/steps.log (few files: a node may send back only a handful), and its tail to stdout
  local name=$1
  shift
  if [ "$deadline" -gt 0 ] && [ "$SECONDS" -ge "$deadline" ]; then
    skipped+=("$name")
    return 1
  fi
  if [ -n "${ONLY_STEPS:-}" ] && ! [[ $name =~ ^(configure|build)$|${ONLY_STEPS} ]]; then
    return 0  # not asked for
  fi
  local log=$out/$name.log
  [[ $name == build* ]] || log=$(mktemp)
  echo "== $name: $*"
  local start=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-15}" "$log"
  echo "== $name: exit $rc in $((SECONDS - start)) s"
  if [[ $name != build* ]]; then
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
  command -v nvcc && nvcc --version | tail -1
  nproc
} 2>&1 | tee "$out/machine.txt"

configure() {  # configure BUILD_DIR [CMAKE_ARGS...]
  local build=$1
  shift
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNAMM_ENGINE_ONLY=ON -DNAMM_WERROR=OFF \
    -DNAMM_WITH_CUDA=ON "-DCMAKE_PREFIX_PATH=$torch_prefix;$dir/usr" "-DNAMM_SHARED_DIR=$dir/shared" \
    "-DNAMM_SYSTEM_PYTHON=$python" "$@"
}
# Our CUDA kernels (NAMM_CUDA_KERNELS); should they not build here, the engine without them, so that the
# rest still runs.
build=${BUILD_DIR:-build-device}  # beside DIR, so that a rerun on the same node rebuilds only what changed
kernels=ON
TAIL_LINES=5 step configure configure "$build" -DNAMM_CUDA_KERNELS=ON &&
  TAIL_LINES=25 step build cmake --build "$build" -j "$(nproc)" -- -k 0
if [ $? -ne 0 ]; then
  grep -E "error|Error" "$out/build.log" | head -40
  kernels=OFF
  build=$build-torch-ops
  TAIL_LINES=5 step configure_without_kernels configure "$build" -DNAMM_CUDA_KERNELS=OFF
  TAIL_LINES=25 step build_without_kernels cmake --build "$build" -j "$(nproc)" -- -k 0
fi
echo "== the NAMM's CUDA kernels: $kernels"

bin=$build/bin
bench=$bin/worker_generation_bench
shape=layers=2,dim=2048,heads=16,kv_heads=4,ffn=7168,vocab=32000       # issue 18's 8B-shaped model
llama3_8b=layers=2,dim=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000  # Llama 3 8B's layers (fewer, smaller vocabulary)
# Most telling first: the engine on CUDA, then the benchmark, then the CPU suites (libtorch's version differs).
TAIL_LINES=30 step cuda_engine_tests timeout 300 "$bin/engine_tests" --gtest_filter='EngineOnCuda.*'
TAIL_LINES=20 step cuda_namm_core timeout 120 "$bin/namm_core_tests" --gtest_filter='*Cuda*'
export TAIL_LINES=24
step bench_8b_bf16_4k timeout 300 "$bench" --device cuda:0 --dtype bf16 --random-model "$shape" \
  --prompt-tokens 4096 --new-tokens 32 --repeats 5 --profile 1
step bench_8b_bf16_4k_chunk512 timeout 300 "$bench" --device cuda:0 --dtype bf16 --random-model "$shape" \
  --prompt-tokens 4096 --new-tokens 32 --repeats 5 --profile 1 --chunk 512
# The same benchmark without our kernels, on the same machine: what they change.
if [ "$kernels" = ON ]; then
  TAIL_LINES=5 step configure_torch_ops configure "$build-torch-ops" -DNAMM_CUDA_KERNELS=OFF &&
    TAIL_LINES=10 step build_torch_ops cmake --build "$build-torch-ops" -j "$(nproc)" --target worker_generation_bench
  step bench_8b_bf16_4k_torch_ops timeout 300 "$build-torch-ops/bin/worker_generation_bench" --device cuda:0 \
    --dtype bf16 --random-model "$shape" --prompt-tokens 4096 --new-tokens 32 --repeats 5 --profile 1
fi

# The coordinator's benchmark (packed by `pack`) on this machine's cores: simulated workers over loopback.
if [ -f "$dir/coordinator.tar.xz" ]; then
  coord=$dir/coordinator
  rm -rf "$coord" && mkdir -p "$coord" && tar -C "$coord" -xJf "$dir/coordinator.tar.xz"
  shared_dir=$(cat "$coord/shared_dir")  # where the benchmark was built to read ../shared
  if [ ! -e "$shared_dir/data/longbench" ]; then
    mkdir -p "$shared_dir/data" && ln -s "$coord/shared/data/longbench" "$shared_dir/data/longbench"
  fi
  coordinator_bench() { LD_LIBRARY_PATH=$coord/lib timeout 240 "$coord/bin/coordinator_bench" "$@"; }
  TAIL_LINES=12 step coordinator_1024_workers_process coordinator_bench --only throughput --workers 1024 \
    --worker-process 1
  TAIL_LINES=12 step coordinator_1024_workers coordinator_bench --only throughput --workers 1024
  TAIL_LINES=12 step coordinator_heterogeneous_256 coordinator_bench --only heterogeneous --workers 256
fi

step bench_llama3_8b_layers_bf16_4k timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b" --prompt-tokens 4096 --new-tokens 32 --repeats 3 --profile 1
step bench_llama3_8b_layers_bf16_4k_chunk512 timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b" --prompt-tokens 4096 --new-tokens 32 --repeats 3 --chunk 512
TAIL_LINES=12 step parts timeout 300 "$bench" --device cuda:0 --parts 1024,4096,16384,32768 --repeats 5
TAIL_LINES=12 step bench_stories_cuda timeout 300 "$bench" --device cuda:0 --repeats 3
TAIL_LINES=12 step bench_8b_fp32_4k timeout 300 "$bench" --device cuda:0 --dtype fp32 --random-model "$shape" \
  --prompt-tokens 4096 --new-tokens 32 --repeats 3
TAIL_LINES=8 step engine_tests timeout 300 "$bin/engine_tests"
TAIL_LINES=8 step namm_core_tests timeout 300 "$bin/namm_core_tests"
step bench_8b_bf16_16k timeout 300 "$bench" --device cuda:0 --dtype bf16 --random-model "$shape" \
  --prompt-tokens 16384 --new-tokens 32 --repeats 3 --profile 1
step bench_llama3_8b_layers_bf16_16k timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b" --prompt-tokens 16384 --new-tokens 32 --repeats 3 --profile 1

[ ${#skipped[@]} -eq 0 ] || echo "device-check: skipped at the deadline (${deadline} s): ${skipped[*]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "device-check: failed steps: ${failed[*]}"
  exit 1
fi
echo "device-check: every step passed"
