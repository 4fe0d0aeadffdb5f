#!/usr/bin/env bash
# Installs every Debian package namm needs to build, test and run. Idempotent: packages already
# present are skipped, so `make` and `make test` call it on every run at almost no cost.
# This script is the single source of build dependencies: CI (.ci/run), `make`, and the README use it.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config git
  # tensor library. Debian's libtorch falls back to reference BLAS unless an optimized BLAS
  # provider is installed (measured 5 vs 94 GFLOP/s on a 1024^2 float32 matmul).
  libtorch-dev libopenblas0-pthread libopenblas-dev liblapacke-dev
  # distribution, storage, observability
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libssl-dev
  libsqlite3-dev libsqlitecpp-dev sqlite3 zlib1g-dev
  prometheus-cpp-dev
  # the observability tests check expositions with promtool and scrape them with a real Prometheus server;
  # the deploy check parses YAML with PyYAML
  prometheus python3-yaml
  # the model-family tests compare our forward pass with one written in numpy (system python3); the reference
  # checkpoint tests read and write the reference's ckpt.pt with torch.load / torch.save
  python3-numpy python3-torch
  libboost-dev libboost-system-dev
  # configuration, logging, CLI, JSON, regexes
  libcli11-dev libyaml-cpp-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libpcre2-dev libicu-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  # the partition test (ctest -L long) cuts a worker off in a network namespace
  iproute2
  # the TLS tests make their certificates with the openssl command
  openssl
  # the report tests render eval's and the coordinator's HTML reports in headless Chromium
  chromium
  # namm-api's client tests run the official OpenAI client (npm) under Node.js, and curl
  nodejs curl
  # task metrics: jieba's dictionary and HMM tables (read at run time, never copied), MeCab + UniDic
  python3-jieba libmecab-dev mecab unidic-mecab
)

# `make fuzz` only: clang with libFuzzer and the sanitizer runtimes.
if [ "${1:-}" = "--fuzz" ]; then
  packages+=(clang libclang-rt-14-dev)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# The official OpenAI client for namm-api's tests, from npm (tests/server/package.json pins its version).
install_openai_client() {
  local dir
  dir="$(cd "$(dirname "$0")/.." && pwd)/tests/server"
  [ -f "$dir/node_modules/openai/package.json" ] && return 0
  if ! command -v npm > /dev/null; then
    $SUDO apt-get install -y -qq --no-install-recommends npm  # Debian's nodejs comes without npm
  fi
  echo "install-deps: installing the openai npm package into $dir/node_modules"
  (cd "$dir" && npm install --no-audit --no-fund --no-package-lock --silent)
}

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if [ ${#missing[@]} -eq 0 ]; then
  install_openai_client
  exit 0
fi

echo "install-deps: installing ${#missing[@]} missing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_openai_client
