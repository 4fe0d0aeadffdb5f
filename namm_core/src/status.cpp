#include "namm/status.h"

#include <cstdio>
#include <cstdlib>

namespace namm {

namespace {
const char* CodeName(Status::Code code) {
  switch (code) {
    case Status::Code::kOk: return "OK";
    case Status::Code::kInvalidArgument: return "invalid argument";
    case Status::Code::kNotFound: return "not found";
    case Status::Code::kIOError: return "I/O error";
    case Status::Code::kCorruption: return "corrupt data";
    case Status::Code::kFailedPrecondition: return "failed precondition";
    case Status::Code::kUnimplemented: return "unimplemented";
    case Status::Code::kInternal: return "internal error";
  }
  return "unknown error";
}
}  // namespace

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + message_;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

Status Status::WithNote(const std::string& note) const {
  if (ok()) return *this;
  return Status(code_, message_ + "; " + note);
}

namespace internal {

void DieOnValueOfError(const Status& status) {
  std::fprintf(stderr, "namm: the value of an error was taken (a bug: check ok() first): %s\n", status.ToString().c_str());
  std::abort();
}

}  // namespace internal

}  // namespace namm
