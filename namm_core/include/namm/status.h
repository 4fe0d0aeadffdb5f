// Status and Result<T>: how errors cross module boundaries in namm.
//
// A Status is either OK or carries a code and a message written for the person who has to act on it
// ("attention file a.npy: expected 3 dimensions [q_heads, n_new, n_keys], got 2"). Functions at module edges
// return Status or Result<T> instead of throwing; code inside a module may use exceptions (libtorch throws
// c10::Error) as long as they are converted at the edge. One deliberate exception: c10::OutOfMemoryError
// (out of device memory) propagates, so that the caller that can retry with less memory sees it (the worker's
// serve executor does, with smaller prefill chunks).
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace namm {

class Status {
 public:
  enum class Code {
    kOk = 0,
    kInvalidArgument,    // the caller passed something malformed
    kNotFound,           // a named file, tensor or key does not exist
    kIOError,            // the operating system refused a read or write
    kCorruption,         // stored data is malformed or inconsistent
    kFailedPrecondition, // the call is valid but not in the current state
    kUnimplemented,      // a valid request this build does not support
    kInternal,           // a bug in namm
  };

  Status() = default;  // OK
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }
  static Status NotFound(std::string msg) { return Status(Code::kNotFound, std::move(msg)); }
  static Status IOError(std::string msg) { return Status(Code::kIOError, std::move(msg)); }
  static Status Corruption(std::string msg) { return Status(Code::kCorruption, std::move(msg)); }
  static Status FailedPrecondition(std::string msg) {
    return Status(Code::kFailedPrecondition, std::move(msg));
  }
  static Status Unimplemented(std::string msg) { return Status(Code::kUnimplemented, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: <message>", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>" (same code); OK stays OK.
  Status WithContext(const std::string& context) const;
  // Returns a copy whose message is "<message>; <note>" (same code); OK stays OK.
  Status WithNote(const std::string& note) const;

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

namespace internal {
// Reached by taking the value of an error: a bug of the caller, which must check ok() first. Prints the error
// and aborts (instead of undefined behaviour).
[[noreturn]] void DieOnValueOfError(const Status& status);
}  // namespace internal

// Either a value or a non-OK Status. Taking the value of an error aborts with the error printed.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor): ergonomic returns
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok()) status_ = Status::Internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return Checked(); }
  const T& value() const& { return Checked(); }
  T&& value() && { return std::move(Checked()); }
  T* operator->() { return &Checked(); }
  const T* operator->() const { return &Checked(); }
  T& operator*() & { return Checked(); }
  const T& operator*() const& { return Checked(); }

 private:
  T& Checked() {
    if (!value_) internal::DieOnValueOfError(status_);
    return *value_;
  }
  const T& Checked() const {
    if (!value_) internal::DieOnValueOfError(status_);
    return *value_;
  }
  std::optional<T> value_;
  Status status_;
};

}  // namespace namm

#define NAMM_STATUS_CONCAT_INNER(a, b) a##b
#define NAMM_STATUS_CONCAT(a, b) NAMM_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define NAMM_RETURN_IF_ERROR(expr)          \
  do {                                      \
    ::namm::Status namm_status_ = (expr);   \
    if (!namm_status_.ok()) return namm_status_; \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its Status from the enclosing function.
#define NAMM_ASSIGN_OR_RETURN(lhs, expr) \
  NAMM_ASSIGN_OR_RETURN_IMPL(NAMM_STATUS_CONCAT(namm_result_, __LINE__), lhs, expr)
#define NAMM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
