#!/usr/bin/env bash
# Where a command's CPU time goes, by library, and the share in arithmetic kernels (docs/performance.md):
#   scripts/profile-by-library.sh OUT.data -- COMMAND [ARGS...]
# Records every thread's samples with perf (software cpu-clock: virtual machines often lack hardware counters),
# then prints the samples' share per shared object and the share in arithmetic kernels: our CPU kernels
# (namm::cpu::avx512/avx2/baseline and rope_rows) and BLAS (libopenblas). Needs Debian's linux-perf.
set -euo pipefail
[ $# -ge 3 ] && [ "$2" = "--" ] || { echo "usage: $0 OUT.data -- COMMAND [ARGS...]" >&2; exit 2; }
out=$1
shift 2
perf record -q -e cpu-clock -F 999 -g -o "$out" -- "$@" > /dev/null
perf report -i "$out" --stdio --no-children --sort dso,sym -g none --percent-limit 0 2> /dev/null | python3 -c '
import re, sys
by_dso, kernels, total = {}, 0.0, 0.0
for line in sys.stdin:
    m = re.match(r"\s+([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)", line)
    if not m:
        continue
    share, dso, sym = float(m.group(1)), m.group(2), m.group(3)
    total += share
    by_dso[dso] = by_dso.get(dso, 0.0) + share
    if "openblas" in dso or re.search(r"namm::cpu::(avx512|avx2|baseline)::|namm::cpu::rope_rows", sym):
        kernels += share
for dso, share in sorted(by_dso.items(), key=lambda kv: -kv[1]):
    if share >= 0.5:
        print(f"{share:6.1f}%  {dso}")
print(f"{kernels:6.1f}%  in arithmetic kernels (ours or BLAS), of {total:.1f}% sampled")
'
