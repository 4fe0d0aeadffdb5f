# syntax=docker/dockerfile:1
# namm-coordinator image: Debian 12, built with the repository's own dependency script, shipped on debian:12-slim
# with only the runtime libraries. Build from the repository root:
#
#   docker build -f deploy/docker/coordinator.Dockerfile -t namm-coordinator .
#
# The coordinator needs no GPU and no libtorch at run time. Mounts it expects (deploy/docker/compose.yaml):
#   /etc/namm/run.yaml          the run spec            /run/secrets/namm_token   the workers' shared secret
#   /var/lib/namm               the run's database (a volume: it must outlive the container)
#   benchmark data (--data-dir) for the prompt lengths that balance the leases

FROM debian:12 AS build
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /usr/src/namm
# The dependency list first, so that the (slow) package layer is reused while only the sources change.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN scripts/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# Only the coordinator: no tests, no benchmarks.
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DNAMM_BUILD_TESTS=OFF -DNAMM_BUILD_BENCH=OFF \
 && cmake --build build --target namm-coordinator -j "$(nproc)"

FROM debian:12-slim
ENV DEBIAN_FRONTEND=noninteractive
# The shared libraries namm-coordinator links (ldd of a Debian 12 build), nothing else.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates \
      libabsl20220623 libc-ares2 libfmt9 libgrpc++1.51 libgrpc29 libicu72 libmecab2 libopenblas0-pthread \
      libpcre2-8-0 libprometheus-cpp-core1.0 libprotobuf32 libre2-9 libspdlog1.10 libsqlite3-0 libssl3 \
      libyaml-cpp0.7 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/src/namm/build/bin/namm-coordinator /usr/local/bin/namm-coordinator
# Task definitions where an installed binary looks for them (PREFIX/share/namm/tasks); --tasks-dir below says so too.
COPY --from=build /usr/src/namm/tasks/*.yaml /usr/local/share/namm/tasks/
# Fail the image build, not the first start, when a library is missing.
RUN if ldd /usr/local/bin/namm-coordinator | grep "not found"; then exit 1; fi \
 && /usr/local/bin/namm-coordinator serve --help > /dev/null
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/namm --create-home --shell /usr/sbin/nologin namm
USER namm
WORKDIR /var/lib/namm
VOLUME ["/var/lib/namm"]
# gRPC for the workers; Prometheus metrics.
EXPOSE 50051 9100
# SIGTERM stores the results that arrived and exits 0; the same command resumes the run from the database.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/namm-coordinator"]
CMD ["serve", "--config", "/etc/namm/run.yaml", "--db", "/var/lib/namm/run.db", "--listen", "0.0.0.0:50051", \
     "--token-file", "/run/secrets/namm_token", "--metrics-listen", "0.0.0.0:9100", \
     "--tasks-dir", "/usr/local/share/namm/tasks", \
     "--tls-cert", "/etc/namm/tls/server.pem", "--tls-key", "/etc/namm/tls/server.key", \
     "--tls-client-ca", "/etc/namm/tls/ca.pem"]
