// Fuzz target: what workers send the coordinator. The first byte picks the message; the rest is its protobuf
// encoding, parsed and checked as the gRPC handlers do before anything else.
#include <cstddef>
#include <cstdint>
#include <set>

#include <google/protobuf/stubs/logging.h>

#include "message_checks.h"

// Protobuf logs every string field with invalid UTF-8 it meets: quiet, the parse result is what counts.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const void* body = data + 1;
  const int length = static_cast<int>(size - 1);
  using namespace namm;
  switch (data[0] % 4) {
    case 0: {
      v1::RegisterRequest r;
      if (r.ParseFromArray(body, length)) (void)coordinator::CheckRegister(r);
      break;
    }
    case 1: {
      v1::ReportRequest r;
      std::set<int64_t> prompts;
      if (!r.ParseFromArray(body, length)) break;
      (void)coordinator::CheckReport(r, &prompts);
      for (const v1::PromptResult& result : r.results()) (void)coordinator::CheckResult(result);
      for (const v1::PromptFailure& failure : r.failures()) (void)coordinator::CheckFailure(failure);
      break;
    }
    case 2: {
      v1::HeartbeatRequest r;
      if (r.ParseFromArray(body, length)) (void)coordinator::CheckIdCount(r.lease_ids_size(), "a heartbeat");
      break;
    }
    default: {
      v1::DrainRequest r;
      if (r.ParseFromArray(body, length)) (void)coordinator::CheckIdCount(r.returned_lease_ids_size(), "a drain");
      break;
    }
  }
  return 0;
}
