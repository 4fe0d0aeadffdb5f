// A Prometheus /metrics endpoint: a small HTTP server (Boost.Asio, one thread) that answers GET /metrics with
// the text exposition of a prometheus-cpp registry. The coordinator and the workers each start one when given
// --metrics-listen; metric families are added to registry() by the code that owns the numbers
// (coordinator_metrics, worker_metrics).
//
// Why not prometheus-cpp's own exposer: it runs on civetweb, whose threads get a fixed ~100 KB stack, and with
// libtorch and OpenBLAS loaded the static thread-local storage alone (~105 KB) exceeds that, so civetweb cannot
// start a thread in namm-worker (pthread_create fails with EINVAL).
#pragma once

#include <memory>
#include <string>

#include "namm/status.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace namm {

// The version every *_info metric reports (the CMake project version).
const char* namm_version();

class MetricsEndpoint {
 public:
  // Serves /metrics on `listen` (HOST:PORT, or a port alone for 127.0.0.1; port 0 picks a free one). Fails with a message naming the address
  // when it is malformed, cannot be resolved, or is taken.
  static Result<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen);
  ~MetricsEndpoint();  // stops serving
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  prometheus::Registry& registry();
  int port() const;
  // http://HOST:PORT/metrics, with the port actually bound.
  const std::string& url() const;

 private:
  struct Impl;
  explicit MetricsEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm
