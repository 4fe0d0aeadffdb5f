#!/usr/bin/env python3
"""Fails when a tensor factory in worker/ or namm_core/ would put its tensor on the default device.

Every at::/torch:: factory (zeros, ones, empty, full, arange, tensor, from_blob, rand, ...) must take its
TensorOptions from a tensor or an options value (`x.options()`, `options_`, `options`), or build them with an
explicit `.device(...)` (`at::TensorOptions().dtype(at::kLong).device(at::kCPU)` for host staging). A factory
with no options, or with `TensorOptions()` and no device, silently lands on the CPU and breaks on CUDA the first
time it meets a CUDA tensor.

  check_tensor_factories.py ROOT   (prints each offending call as FILE:LINE: CALL; exit 1 if any)
"""
import pathlib
import re
import sys

FACTORIES = ("zeros|ones|empty|empty_strided|full|arange|tensor|from_blob|rand|randn|randint|randperm|"
             "linspace|logspace|eye|scalar_tensor")
CALL = re.compile(r"\b(?:at|torch)::(" + FACTORIES + r")\s*\(")


def arguments(text, open_paren):
    """The call's top-level arguments, from the '(' at open_paren; None if unbalanced."""
    depth, start, args = 0, open_paren + 1, []
    for i in range(open_paren, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append(text[start:i])
                return [a.strip() for a in args], i
        elif c == "," and depth == 1:
            args.append(text[start:i])
            start = i + 1
    return None, len(text)


def strip_comments(code):
    code = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), code, flags=re.S)
    return re.sub(r"//[^\n]*", "", code)


def offending(path):
    code = strip_comments(path.read_text())
    for m in CALL.finditer(code):
        args, end = arguments(code, m.end() - 1)
        if args is None:
            continue
        last = args[-1]
        explicit = "options" in last.lower() and ("TensorOptions()" not in last or ".device(" in last)
        if not explicit:
            line = code.count("\n", 0, m.start()) + 1
            yield line, " ".join(code[m.start():end + 1].split())


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    found = 0
    for folder in ("worker", "namm_core"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".cpp", ".h", ".cu", ".cuh"):
                continue
            for line, call in offending(path):
                print(f"{path.relative_to(root)}:{line}: {call}")
                found += 1
    if found:
        print(f"{found} tensor factories without an explicit device (take options from a tensor, or add .device(...))")
        return 1
    print("every tensor factory in worker/ and namm_core/ names its device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
