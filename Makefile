# namm front door. Every target first installs missing Debian packages (scripts/install-deps.sh).
#   make            configure + build (Release) into build/, binaries in build/bin/
#   make demo       build the binaries + a short real training run (coordinator + 2 CPU workers, stories260K)
#   make test       build + the default test suite (ctest, without the `long` label)
#   make test-long  build + the long soak/scale tests (ctest -L long)
#   make bench      build + every benchmark
#   make sanitize   ASan/UBSan build of everything in build-asan/, then the default test suite (fuzz replays included)
#   make tsan       ThreadSanitizer build in build-tsan/: the coordinator, worker client and distribution tests,
#                   default and long labels, and the CPU thread pool, batched engine and namm-api scheduler tests
#                   (not in CI: see docs/coordinator.md, "Sanitizers")
#   make fuzz       libFuzzer targets (clang, ASan/UBSan) in build-fuzz/, each run FUZZ_RUNS (1,000,000) times
#   make clean      remove build directories

BUILD_DIR   ?= build
ASAN_DIR    ?= build-asan
TSAN_DIR    ?= build-tsan
FUZZ_DIR    ?= build-fuzz
FUZZ_RUNS   ?= 1000000
BUILD_TYPE  ?= Release
JOBS        ?= $(shell nproc)
CMAKE_FLAGS ?=

GENERATOR := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)
CCACHE    := $(shell command -v ccache 2>/dev/null)
ifneq ($(CCACHE),)
LAUNCHER := -DCMAKE_C_COMPILER_LAUNCHER=$(CCACHE) -DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)
# Lets ccache cache compilations that use precompiled headers.
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
# A bounded cache (ccache's default is 5 GB): a Release and a sanitizer build of this tree take ~0.1 GB of it, and a
# cache kept between runs grows toward the bound (a CI machine ran out of disk during `make sanitize`). Set it to
# override.
export CCACHE_MAXSIZE ?= 1G
endif

.PHONY: all deps configure build demo test test-long bench sanitize tsan fuzz clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) $(GENERATOR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(LAUNCHER) $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Only what the demo runs, so that a fresh machine gets to it sooner than with `make build`.
demo: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target namm-coordinator namm-worker
	BUILD_DIR=$(BUILD_DIR) scripts/demo.sh

# A test without its own TIMEOUT property fails after 10 minutes instead of stalling the suite (ctest has no default).
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -LE long -j $(JOBS) --timeout 600

test-long: build
	cd $(BUILD_DIR) && ctest --output-on-failure -L long --timeout 3600

bench: build
	@for b in $(BUILD_DIR)/bin/*_bench; do echo "== $$b"; $$b || exit 1; done

# Every label but long, the programs the process tests start included; LeakSanitizer on (tests/sanitizers/ holds
# the suppressions, each with its reason). An allocation too large for any machine fails as it does without the
# sanitizer (allocator_may_return_null), for the error path a test checks, instead of aborting.
SANITIZER_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitizers/lsan.supp \
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/sanitizers/tsan.supp

sanitize: deps
	cmake -S . -B $(ASAN_DIR) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNAMM_SANITIZE=address \
	  -DNAMM_BUILD_BENCH=OFF $(LAUNCHER) $(CMAKE_FLAGS)
	cmake --build $(ASAN_DIR) -j $(JOBS)
	cd $(ASAN_DIR) && $(SANITIZER_ENV) ctest --output-on-failure -LE long -j $(JOBS) --timeout 1800

# The threads' code: the coordinator (service, scheduler, store, trainer), the worker client and the distribution
# tests that drive them, default and long labels; the kernels' pool, a batch's groups and memory updates on it, and
# namm-api's scheduler.
tsan: deps
	cmake -S . -B $(TSAN_DIR) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNAMM_SANITIZE=thread \
	  -DNAMM_BUILD_BENCH=OFF $(LAUNCHER) $(CMAKE_FLAGS)
	cmake --build $(TSAN_DIR) -j $(JOBS) --target coordinator_tests distribution_tests namm_core_tests worker_tests \
	  server_tests
	cd $(TSAN_DIR) && $(SANITIZER_ENV) ctest --output-on-failure -L 'coordinator|distribution|long' --timeout 7200
	cd $(TSAN_DIR) && $(SANITIZER_ENV) ctest --output-on-failure --timeout 1800 \
	  -R '^(CpuThreads|TaskPool|NammPolicy|BatchedGeneration|CompletionScheduler)\.'

fuzz:
	@scripts/install-deps.sh --fuzz
	cmake -S . -B $(FUZZ_DIR) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
	  -DCMAKE_CXX_COMPILER=clang++ -DNAMM_FUZZ=ON -DNAMM_BUILD_TESTS=OFF -DNAMM_BUILD_BENCH=OFF $(LAUNCHER) $(CMAKE_FLAGS)
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target fuzz_run_spec fuzz_namm_file fuzz_tokenizer_json fuzz_llama2c_tokenizer fuzz_chat_template \
	  fuzz_rpc_messages fuzz_torch_archive fuzz_openai_request
	scripts/fuzz.sh $(FUZZ_DIR) $(FUZZ_RUNS)

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(TSAN_DIR) $(FUZZ_DIR)
