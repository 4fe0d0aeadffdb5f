# syntax=docker/dockerfile:1
# namm-worker image: namm-worker built against PyTorch's CUDA libtorch (pip wheel) with NVIDIA's CUDA toolkit for
# Debian 12. Build from the repository root (downloads about 8 GB: CUDA toolkit, torch and its CUDA libraries):
#
#   docker build -f deploy/docker/worker.Dockerfile -t namm-worker .
#   docker build -f deploy/docker/worker.Dockerfile -t namm-worker:cpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu --build-arg NAMM_WITH_CUDA=OFF .
#
# Why Debian 12 plus NVIDIA's apt repository rather than an nvidia/cuda or pytorch/pytorch base image: those are
# Ubuntu images, and the build needs CMake >= 3.25 and the Debian 12 packages of scripts/install-deps.sh (the
# project's single list of dependencies). The CUDA image also runs on machines without a GPU with --device cpu.
#
# At run time the GPU driver comes from the host (NVIDIA Container Toolkit: `docker run --gpus`, compose
# `deploy.resources.reservations.devices`, Kubernetes `nvidia.com/gpu`). Mounts: the model (--model), the
# benchmark data (--data-dir), the run's shared secret (/run/secrets/namm_token).

ARG TORCH_VERSION=2.7.1
# PyTorch's wheel index: cu126 (CUDA 12.6, matching the toolkit below), or .../whl/cpu for a CPU-only image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG CUDA_PACKAGE_VERSION=12-6
ARG NAMM_WITH_CUDA=ON
# The wheel's Python; Debian 12's python3 is 3.11. The runtime stage keeps the venv's layout under this prefix
# because torch's libraries find their CUDA libraries through relative RPATHs.
ARG TORCH_SITE=/opt/torch/lib/python3.11/site-packages

FROM debian:12 AS build
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG CUDA_PACKAGE_VERSION
ARG NAMM_WITH_CUDA
ARG TORCH_SITE
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /usr/src/namm

COPY scripts/install-deps.sh scripts/install-deps.sh
# Debian's libtorch-dev (CPU-only, from the dependency script) is removed again: its headers and CMake package in
# /usr would compete with the CUDA libtorch this image builds against.
RUN scripts/install-deps.sh \
 && apt-get purge -y libtorch-dev \
 && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*

# CUDA toolkit (nvcc, headers, the libraries torch's CMake package looks for) from NVIDIA's Debian 12 repository.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && curl -fsSL -o /tmp/cuda-keyring.deb \
      https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
 && dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb \
 && apt-get update \
 && apt-get install -y --no-install-recommends "cuda-toolkit-${CUDA_PACKAGE_VERSION}" \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/local/cuda/bin:${PATH} \
    CUDAToolkit_ROOT=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"

# libtorch from PyTorch's wheel, in a virtual environment (Debian's Python is externally managed). The wheel must
# use the C++11 ABI, like every Debian library namm links (gRPC, protobuf, spdlog, ...): wheels do from 2.7 on.
# CUDA wheels bring their CUDA libraries as nvidia-* packages under site-packages/nvidia (empty for CPU wheels).
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/torch \
 && /opt/torch/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && /opt/torch/bin/python -c 'import torch, sys; sys.exit(0 if torch.compiled_with_cxx11_abi() else "this torch wheel uses the pre-C++11 ABI: pick torch >= 2.7")' \
 && test -d "${TORCH_SITE}/torch/lib" \
 && mkdir -p "${TORCH_SITE}/nvidia"

COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DNAMM_BUILD_TESTS=OFF -DNAMM_BUILD_BENCH=OFF \
      -DNAMM_WITH_CUDA="${NAMM_WITH_CUDA}" -DNAMM_CUDA_ARCHITECTURES="75;80;86;89;90" \
      -DCMAKE_PREFIX_PATH="$(/opt/torch/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
 && cmake --build build --target namm-worker -j "$(nproc)"

FROM debian:12-slim
ARG TORCH_SITE
ENV DEBIAN_FRONTEND=noninteractive
# The shared libraries namm-worker links besides libtorch (ldd of a Debian 12 build), and the data its task metrics
# read at run time: jieba's dictionary (python3-jieba) and UniDic for MeCab (unidic-mecab).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates \
      libabsl20220623 libc-ares2 libfmt9 libgomp1 libgrpc++1.51 libgrpc29 libicu72 libmecab2 \
      libopenblas0-pthread libpcre2-8-0 libprometheus-cpp-core1.0 libprotobuf32 libre2-9 libspdlog1.10 \
      libsqlite3-0 libssl3 libyaml-cpp0.7 \
      python3-jieba unidic-mecab \
 && rm -rf /var/lib/apt/lists/*
# libtorch and the CUDA libraries of the wheel (cuDNN, cuBLAS, the CUDA runtime, ...), at the same paths as in the
# build stage: the binary's RPATH and torch's relative RPATHs stay valid. The loader is told about them too,
# because namm-worker links the CUDA runtime itself (device memory metrics), which lives among the wheel's.
COPY --from=build ${TORCH_SITE}/torch/lib ${TORCH_SITE}/torch/lib
COPY --from=build ${TORCH_SITE}/nvidia ${TORCH_SITE}/nvidia
RUN { echo "${TORCH_SITE}/torch/lib"; for d in "${TORCH_SITE}"/nvidia/*/lib; do if [ -d "$d" ]; then echo "$d"; fi; done; } \
      > /etc/ld.so.conf.d/namm-torch.conf \
 && ldconfig
COPY --from=build /usr/src/namm/build/bin/namm-worker /usr/local/bin/namm-worker
COPY --from=build /usr/src/namm/tasks/*.yaml /usr/local/share/namm/tasks/
# Fail the image build, not the first start, when a library is missing. libcuda.so.1 is the host driver's,
# mounted into the container only when it runs with a GPU.
RUN if ldd /usr/local/bin/namm-worker | grep "not found" | grep -v "libcuda\.so"; then exit 1; fi \
 && /usr/local/bin/namm-worker serve --help > /dev/null
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/namm --create-home --shell /usr/sbin/nologin namm \
 && install -d -o namm -g namm /var/lib/namm/synthetic
# /var/lib/namm/synthetic: where `namm-worker build-synthetic` can write the story-recall rows (compose mounts a
# volume there; a fresh volume takes the directory's owner).
USER namm
WORKDIR /var/lib/namm
# The NVIDIA Container Toolkit exposes the GPUs and the driver's compute libraries.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
EXPOSE 9101
# The first SIGTERM drains: running prompts finish and are reported, the rest of the leases go back. Give the
# container a stop timeout long enough for that (compose stop_grace_period, Kubernetes
# terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/namm-worker"]
CMD ["serve", "--coordinator", "coordinator:50051", "--token-file", "/run/secrets/namm_token", \
     "--model", "/models/model", "--device", "cuda:0", "--metrics-listen", "0.0.0.0:9101", \
     "--tasks-dir", "/usr/local/share/namm/tasks", \
     "--tls-ca", "/etc/namm/tls/ca.pem", "--tls-cert", "/etc/namm/tls/worker.pem", "--tls-key", "/etc/namm/tls/worker.key"]
