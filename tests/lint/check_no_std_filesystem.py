#!/usr/bin/env python3
"""Fails when code that links libtorch (worker/, namm_core/) uses std::filesystem.

PyTorch's binary libtorch exports its own statically linked std::filesystem, which a program linked with it
calls instead of the system's and crashes in (pytorch/pytorch#133437). namm/file_util.h has POSIX equivalents.

  check_no_std_filesystem.py ROOT   (prints each use as FILE:LINE; exit 1 if any)
"""
import pathlib
import re
import sys

USE = re.compile(r"std::filesystem|#include\s*<filesystem>")


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    found = 0
    for folder in ("worker", "namm_core"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".cpp", ".h", ".inc"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("//", 1)[0]
                if USE.search(code):
                    print(f"{path.relative_to(root)}:{number}: {line.strip()}")
                    found += 1
    if found:
        print(f"{found} uses of std::filesystem where libtorch links; use namm/file_util.h")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
