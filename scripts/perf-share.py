#!/usr/bin/env python3
"""Where a perf recording's CPU samples go, by library, and the share in arithmetic kernels (docs/performance.md).

    scripts/perf-share.py OUT.data

Counts every sample of `perf script` (exact: perf report's rounded percentages of a thousand symbols add up to a
few percent over 100). Arithmetic kernels: our CPU kernels (namm::cpu::avx512/avx2/baseline and rope_rows) and BLAS
(libopenblas). Only the sampled address counts, so a recording with call graphs gives the same figures.
"""
import collections
import re
import subprocess
import sys

if len(sys.argv) != 2:
    sys.exit("usage: perf-share.py OUT.data")
script = subprocess.run(["perf", "script", "-i", sys.argv[1], "-F", "ip,sym,dso", "--hide-call-graph"],
                        capture_output=True, text=True, check=True).stdout
by_dso, kernels, total = collections.Counter(), 0, 0
sample = re.compile(r"\s*[0-9a-f]+\s+(.*) \((.*)\)$")  # one line per sample: address, symbol, (library)
for line in script.splitlines():
    m = sample.match(line)
    if not m:
        continue
    sym, dso = m.group(1), m.group(2).rsplit("/", 1)[-1]
    total += 1
    by_dso[dso] += 1
    if "openblas" in dso or re.search(r"namm::cpu::(avx512|avx2|baseline)::|namm::cpu::rope_rows", sym):
        kernels += 1
if total == 0:
    sys.exit("no samples in " + sys.argv[1])
for dso, n in by_dso.most_common():
    if n >= total / 200:
        print(f"{100 * n / total:6.1f}%  {dso}")
print(f"{100 * kernels / total:6.1f}%  in arithmetic kernels (ours or BLAS), of {total} samples")
