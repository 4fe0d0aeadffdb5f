#!/usr/bin/env bash
# The inference engine and namm-worker on a GPU node whose libtorch comes from a PyTorch install (python3 -c
# 'import torch'). The node needs a C++ compiler, CMake, Ninja and that PyTorch; what else the worker builds with
# (gRPC, protobuf, yaml-cpp, ..., nlohmann-json, PCRE2, GoogleTest) and the data its tests read come along in a
# folder made on a machine with scripts/install-deps.sh's packages, a build of this tree and ../shared:
#
#   scripts/device-check.sh pack DIR       copies those headers and libraries (DIR/usr, DIR/worker-deps.tar.xz:
#                                          scripts/device-worker-deps.py) and the stories260K model and GPT-2
#                                          tokenizer (DIR/shared) into DIR, and the coordinator and its benchmark
#                                          as built here (BUILD_DIR, default build) with their shared libraries
#                                          and data (DIR/coordinator.tar.xz)
#   scripts/device-check.sh run DIR OUT    on the node: builds namm_core, the engine, their tests,
#                                          worker_generation_bench and namm-worker (NAMM_WORKER_ONLY, our CUDA
#                                          kernels; the engine alone, NAMM_ENGINE_ONLY, if the worker's libraries
#                                          are not there) in build-device, runs the tests (the engine on CUDA
#                                          against the CPU among them) and the benchmarks on the GPU, the same
#                                          benchmark without our kernels, a short training run (the coordinator
#                                          from DIR, namm-worker on the GPU) and the coordinator's benchmark on
#                                          the node's cores; logs go to OUT (machine.txt, build*.log, steps.log),
#                                          each step's tail to stdout
#
# `run` keeps going past a failed step so that one pass reports everything; it exits non-zero if any failed.
# DEADLINE_S=N skips the steps that would start after N seconds (a node lent for a limited time); ONLY_STEPS=REGEX
# runs only the steps whose names match (and the builds); BUILD_TARGETS="T1 T2" builds only those targets.
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
  cp "$build/bin/coordinator_bench" "$build/bin/namm-sim-worker" "$build/bin/namm-coordinator" "$stage/bin/"
  ldd "$stage/bin/coordinator_bench" "$stage/bin/namm-sim-worker" "$stage/bin/namm-coordinator" | awk '/=> \//{print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' |
    xargs -I{} cp -L {} "$stage/lib/"
  cp tasks/*.yaml "$stage/share/namm/tasks/"
  cp -r "$shared/data/longbench" "$stage/shared/data/"
  # The data path compiled into the benchmark, where `run` links the unpacked data.
  sed -n 's/^NAMM_SHARED_DIR:PATH=//p' "$build/CMakeCache.txt" >"$stage/shared_dir"
  tar -C "$stage" -cJf "$dir/coordinator.tar.xz" .
  rm -rf "$stage"
  # What namm-worker builds with beyond the engine's needs: headers, CMake files, libraries, protoc.
  stage=$(mktemp -d)
  python3 scripts/device-worker-deps.py "$build" "$stage/usr"
  tar -C "$stage" -cJf "$dir/worker-deps.tar.xz" .
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

# namm-worker's libraries (packed from a Debian machine): with them the build is NAMM_WORKER_ONLY (the engine,
# its tests and benchmarks, and namm-worker), without them NAMM_ENGINE_ONLY.
arch=$(gcc -print-multiarch)
scope=(-DNAMM_ENGINE_ONLY=ON)
prefixes="$torch_prefix;$dir/usr"
if [ -f "$dir/worker-deps.tar.xz" ]; then
  deps=$dir/worker-deps
  [ -d "$deps/usr" ] || { mkdir -p "$deps" && tar -C "$deps" -xJf "$dir/worker-deps.tar.xz"; }
  # protoc loads Debian's libprotoc from there; the rest of the build keeps the node's own libraries.
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$deps/usr/lib/$arch" "$deps/usr/bin/protoc" >"$deps/protoc"
  chmod +x "$deps/protoc"
  # PyTorch ships a newer {fmt} among its headers than the one Debian's spdlog is built with: -I directories are
  # searched before the -isystem ones the packages' targets add, so spdlog sees its own.
  mkdir -p "$deps/first" && ln -sfn "$deps/usr/include/fmt" "$deps/first/fmt"
  # DT_RPATH rather than RUNPATH: the node's loader then finds the libraries those libraries load there too.
  scope=(-DNAMM_WORKER_ONLY=ON "-DProtobuf_PROTOC_EXECUTABLE=$deps/protoc" "-DCMAKE_CXX_FLAGS=-I$deps/first"
    -DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags)
  prefixes="$prefixes;$deps/usr"
fi
configure() {  # configure BUILD_DIR [CMAKE_ARGS...]
  local build=$1
  shift
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${scope[@]}" -DNAMM_WERROR=OFF \
    -DNAMM_WITH_CUDA=ON "-DCMAKE_PREFIX_PATH=$prefixes" "-DNAMM_SHARED_DIR=$dir/shared" \
    "-DNAMM_SYSTEM_PYTHON=$python" "$@"
}
targets=()
for t in ${BUILD_TARGETS:-}; do targets+=(--target "$t"); done
# Our CUDA kernels (NAMM_CUDA_KERNELS); should they not build here, the engine without them, so that the
# rest still runs.
build=${BUILD_DIR:-build-device}  # beside DIR, so that a rerun on the same node rebuilds only what changed
kernels=ON
TAIL_LINES=5 step configure configure "$build" -DNAMM_CUDA_KERNELS=ON &&
  TAIL_LINES=25 step build cmake --build "$build" -j "$(nproc)" "${targets[@]}" -- -k 0
if [ $? -ne 0 ] && ! [ -x "$build/bin/worker_generation_bench" ]; then
  grep -E "error|Error" "$out/build.log" | head -40
  kernels=OFF
  build=$build-torch-ops
  TAIL_LINES=5 step configure_without_kernels configure "$build" -DNAMM_CUDA_KERNELS=OFF
  TAIL_LINES=25 step build_without_kernels cmake --build "$build" -j "$(nproc)" "${targets[@]}" -- -k 0
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
# Llama 3 8B's shape at full depth (32 layers, its vocabulary) at the two prompt lengths of the paper's H100
# table (base 4.0 / 15.52 s, NAMM 4.54 / 17.6 s, evicting 3.97 / 13.61 s per sample): the full cache, the NAMM
# without eviction and the evicting NAMM, 512-token prefill chunks.
llama3_8b_full=layers=32,dim=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256
for n in 12099 32641; do
  step "bench_llama3_8b_32_layers_$n" timeout 400 "$bench" --device cuda:0 --dtype bf16 --random-model "$llama3_8b_full" \
    --prompt-tokens "$n" --new-tokens 32 --repeats 1 --chunk 512 --only "NAMM, full|NAMM, evicting|blocks"
done
# The full cache's attention fused against in blocks, in one process, where the engine chooses between them
# (LlamaModel::Attend: fused for chunks of 512 rows or more, decode steps over 8k keys or more).
for chunk in 128 512; do
  step "bench_8b_bf16_16k_fused_vs_blocks_chunk$chunk" timeout 300 "$bench" --device cuda:0 --dtype bf16 \
    --random-model "$shape" --prompt-tokens 16384 --new-tokens 32 --repeats 3 --chunk "$chunk" --only blocks
done
# Where the no-eviction NAMM's time goes at 12k (the policy's calls timed).
step bench_llama3_8b_32_layers_12099_profile timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b_full" --prompt-tokens 12099 --new-tokens 32 --repeats 1 --chunk 512 --only "NAMM, full" \
  --profile 1
step bench_llama3_8b_32_layers_32641_profile timeout 300 "$bench" --device cuda:0 --dtype bf16 \
  --random-model "$llama3_8b_full" --prompt-tokens 32641 --new-tokens 32 --repeats 1 --chunk 512 \
  --only "NAMM, evicting" --profile 1
# A short training run with the worker daemon on the GPU: the coordinator (packed from a Debian machine) and
# namm-worker (built here) over gRPC on loopback, the demo's run spec on stories260K.
if [ -x "$bin/namm-worker" ] && [ -f "$dir/coordinator.tar.xz" ]; then
  coord=$dir/coordinator
  [ -d "$coord/bin" ] || { mkdir -p "$coord" && tar -C "$coord" -xJf "$dir/coordinator.tar.xz"; }
  train=$dir/training
  rm -rf "$train" && mkdir -p "$train/synthetic"
  # The demo's spec with its stages shortened (4 + 2 generations -> 2 + 1) unless TRAINING_FULL=1.
  shorten='s/generations: 4$/generations: 2/;t;s/generations: 2$/generations: 1/'
  [ "${TRAINING_FULL:-0}" = 1 ] && shorten=
  sed -e "s#\.\./shared#$dir/shared#g" -e "$shorten" coordinator/runs/stories-cpu.yaml >"$train/spec.yaml"
  # The coordinator's Debian libraries stay out of the worker it starts.
  printf '#!/bin/sh\nunset LD_LIBRARY_PATH\nexec %s "$@"\n' "$(cd "$bin" && pwd)/namm-worker" >"$train/namm-worker"
  chmod +x "$train/namm-worker"
  training_run() {
    "$bin/namm-worker" build-synthetic --model "$dir/shared/models/stories260K/stories260K.bin" \
      --tokenizer "$dir/shared/models/stories260K/tok512.bin" --out "$train/synthetic/story_recall.jsonl" \
      --rows 64 || return
    LD_LIBRARY_PATH=$coord/lib timeout "${TRAINING_TIMEOUT_S:-300}" "$coord/bin/namm-coordinator" run \
      --config "$train/spec.yaml" --db "$train/stories.db" --local-workers 1 --device cuda:0 \
      --worker-binary "$train/namm-worker" --tasks-dir tasks --data-dir "synthetic=$train/synthetic" --log-level warn
    local rc=$?
    LD_LIBRARY_PATH=$coord/lib "$coord/bin/namm-coordinator" status --db "$train/stories.db" --generations
    return $rc
  }
  TAIL_LINES=40 step training_worker_on_gpu training_run
fi
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
  [ -d "$coord/bin" ] || { mkdir -p "$coord" && tar -C "$coord" -xJf "$dir/coordinator.tar.xz"; }
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
