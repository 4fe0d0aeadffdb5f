// Converting libtorch exceptions into Status at namm_core's module edges.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <utility>

#include "namm/status.h"

namespace namm::internal {

// Runs f() (returning Status or Result<T>); an exception becomes an error whose message starts with `what`.
// Out of device memory is not this module's error: it propagates, so that the caller that can act on it
// (the serve executor retries with smaller prefill chunks) sees it.
template <typename F>
auto catch_torch_errors(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return std::forward<F>(f)();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const std::exception& e) {
    std::string message = e.what();
    // c10::Error appends a C++ backtrace after the first line; keep the message only.
    auto newline = message.find('\n');
    if (newline != std::string::npos) message.resize(newline);
    return Status::InvalidArgument(what + ": " + message);
  }
}

}  // namespace namm::internal
