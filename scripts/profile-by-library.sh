#!/usr/bin/env bash
# Where a command's CPU time goes, by library, and the share in arithmetic kernels (docs/performance.md):
#   scripts/profile-by-library.sh OUT.data -- COMMAND [ARGS...]
# Records every thread's samples with perf (software cpu-clock: virtual machines often lack hardware counters),
# then prints the samples' share per shared object and the share in arithmetic kernels (scripts/perf-share.py).
# Needs Debian's linux-perf.
set -euo pipefail
[ $# -ge 3 ] && [ "$2" = "--" ] || { echo "usage: $0 OUT.data -- COMMAND [ARGS...]" >&2; exit 2; }
out=$1
shift 2
perf record -q -e cpu-clock -F 999 -g -o "$out" -- "$@" > /dev/null
"$(dirname "$0")/perf-share.py" "$out"
