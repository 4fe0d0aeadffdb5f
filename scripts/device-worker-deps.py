#!/usr/bin/env python3
"""Copies into PREFIX what namm-worker needs of this machine's Debian packages to build on a GPU node whose
libtorch comes from PyTorch (scripts/device-check.sh pack, -DNAMM_WORKER_ONLY=ON there):

  - the headers the worker's sources include, as compiled here (BUILD/compile_commands.json, gcc -M), from the
    libraries named below only (never the C library's or libtorch's, which the node has in its own versions);
  - those packages' CMake package files and every file their imported targets name (CMake checks they exist);
  - their shared libraries with the libraries those load (their sonames and link names), and the code generators
    (protoc, grpc_cpp_plugin).

Usage: device-worker-deps.py BUILD PREFIX
"""
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

ARCH = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True, check=True).stdout.strip()
LIB = f"/usr/lib/{ARCH}"
# Header trees of the libraries the node lacks (nlohmann-json, PCRE2 and GoogleTest are packed by the caller).
HEADERS = re.compile(r"^/usr/include/(boost|google|grpc|grpcpp|grpc\+\+|absl|yaml-cpp|spdlog|fmt|CLI|prometheus|"
                     rf"unicode|openssl|{ARCH}/openssl|re2|zlib\.h|zconf\.h|mecab\.h|ares[^/]*\.h)(/|$)")
# CMake package files: what find_package(gRPC/yaml-cpp/...) reads; FindProtobuf, FindOpenSSL, FindZLIB and
# FindICU are CMake's own modules and search PREFIX like any other.
CMAKE_DIRS = ["grpc", "absl", "prometheus-cpp", "yaml-cpp", "spdlog", "fmt", "Boost-1.74.0", "boost_headers-1.74.0",
              "BoostDetectToolset-1.74.0.cmake", "civetweb"]
# Libraries linked by name (find_library or a Find module) rather than by an imported target.
LINKED = ["libprotobuf", "libprotoc", "libssl", "libcrypto", "libz", "libicuuc", "libicudata", "libicui18n",
          "libmecab", "libcares", "libre2"]
SYSTEM = re.compile(r"/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so")


def worker_sources(build):
    keep = ("proto/", "namm_core/src", "tasks/src", "worker/")
    root = os.path.dirname(os.path.abspath(build)) + "/"
    for entry in json.load(open(os.path.join(build, "compile_commands.json"))):
        rel = entry["file"].replace(root, "")
        rel_build = rel.split("/", 1)[1] if rel.startswith(os.path.basename(build) + "/") else rel
        if rel_build.startswith(keep) and not rel.endswith(".cu"):
            yield entry


def dependencies(entry):
    args, skip = [], False
    for arg in shlex.split(entry["command"]):
        if skip:
            skip = False
        elif arg in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif arg not in ("-c", "-MD", "-MMD"):
            args.append(arg)
    run = subprocess.run(args + ["-M", "-MF", "/dev/stdout", "-E", "-o", "/dev/null"], cwd=entry["directory"],
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"gcc -M {entry['file']} failed:\n{run.stderr[-2000:]}")
    return [t for t in run.stdout.replace("\\\n", " ").split() if t.startswith("/usr/")]


def destination(path, prefix):
    return prefix + path[len("/usr"):] if path.startswith("/usr/") else prefix + path


def copy(path, prefix, copied):
    """Copies PATH (a file or symbolic link, with the chain of links to its file) under PREFIX."""
    while path not in copied and os.path.lexists(path):
        copied.add(path)
        dest = destination(path, prefix)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if os.path.islink(path):
            if not os.path.lexists(dest):
                os.symlink(os.readlink(path), dest)
            path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
        else:
            shutil.copy2(path, dest)
            return


def libraries_loaded(path):
    run = subprocess.run(["ldd", path], capture_output=True, text=True)
    found = [m.group(1) for m in re.finditer(r"=> (/\S+)", run.stdout) if not SYSTEM.search(m.group(1))]
    return ["/usr" + f if f.startswith("/lib/") else f for f in found]  # merged /usr: one tree under PREFIX


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    build, prefix = sys.argv[1], os.path.abspath(sys.argv[2])
    copied = set()
    headers = set()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for deps in pool.map(dependencies, list(worker_sources(build))):
            headers.update(d for d in deps if HEADERS.match(d))
    headers.update(os.path.join("/usr/include", f) for f in os.listdir("/usr/include") if re.match(r"ares.*\.h$", f))
    for header in sorted(headers):
        copy(header, prefix, copied)
    # gRPC's CMake files find RE2 by its own CMake files or else pkg-config, which a node may lack; Debian ships
    # only the pkg-config file, so RE2's imported target is written here.
    os.makedirs(f"{prefix}/lib/{ARCH}/cmake/re2", exist_ok=True)
    with open(f"{prefix}/lib/{ARCH}/cmake/re2/re2Config.cmake", "w") as config:
        config.write("if(NOT TARGET re2::re2)\n  add_library(re2::re2 SHARED IMPORTED)\n"
                     "  set_target_properties(re2::re2 PROPERTIES IMPORTED_LOCATION \"${CMAKE_CURRENT_LIST_DIR}/../../libre2.so\")\n"
                     "endif()\nset(re2_FOUND TRUE)\n")

    named = []
    for name in CMAKE_DIRS:
        path = f"{LIB}/cmake/{name}"
        if not os.path.exists(path):
            sys.exit(f"missing CMake package files {path}")
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for f in files:
            copy(f, prefix, copied)
            if f.endswith(".cmake"):
                named += re.findall(r'"\$\{_IMPORT_PREFIX\}(/[^"]+)"', open(f).read())
    for cli11 in ("/usr/share/cmake/CLI11", "/usr/share/cmake/nlohmann_json"):
        for d, _, fs in os.walk(cli11):
            for f in fs:
                copy(os.path.join(d, f), prefix, copied)
    libraries = []
    for rel in named:
        path = "/usr" + rel
        if os.path.isdir(path):
            continue  # include directories: the headers above
        if not os.path.lexists(path):
            sys.exit(f"an imported target names {path}, which is missing")
        copy(path, prefix, copied)
        libraries.append(os.path.realpath(path))
    for stem in LINKED:
        for f in sorted(os.listdir(LIB)):
            if f.startswith(stem + ".so"):
                copy(f"{LIB}/{f}", prefix, copied)
                libraries.append(os.path.realpath(f"{LIB}/{f}"))
    for tool in ("/usr/bin/protoc", "/usr/bin/grpc_cpp_plugin"):
        copy(os.path.realpath(tool), prefix, copied)
        if tool != os.path.realpath(tool):
            copy(tool, prefix, copied)
        libraries.append(os.path.realpath(tool))
    # The libraries those load, by the soname they load them by.
    seen = set()
    while libraries:
        path = libraries.pop()
        if path in seen or not (path.endswith(".so") or ".so." in path or path.startswith("/usr/bin/")):
            continue
        seen.add(path)
        for loaded in libraries_loaded(path):
            copy(loaded, prefix, copied)
            libraries.append(os.path.realpath(loaded))
    # Imported targets name libraries by their file; programs load them by soname.
    for path in sorted(p for p in copied if ".so" in p and not os.path.islink(p) and os.path.isfile(p)):
        dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
        soname = re.search(r"Library soname: \[([^\]]+)\]", dynamic)
        link = os.path.join(os.path.dirname(destination(path, prefix)), soname.group(1)) if soname else None
        if link and not os.path.lexists(link):
            os.symlink(os.path.basename(path), link)
    print(f"{len(headers)} headers, {len(copied)} files and links in {prefix}")


if __name__ == "__main__":
    main()
