// The coordinator's gRPC service in this process, over real gRPC on loopback, with its progress-log hook in the
// test's hands: what a worker is told when the coordinator cannot journal what it reported, and what happens when
// the log can be written again.
#include "worker_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>

#include "namm/v1/coordinator.grpc.pb.h"
#include "namm/worker/coordinator_client.h"
#include "namm/v1/protocol.h"

namespace namm::coordinator {
namespace {

const std::string kToken = "service-test-shared-secret-0123";

class ServiceFixture {
 public:
  ServiceFixture() {
    ServiceConfig config;
    config.token = kToken;
    config.run_name = "service-test";
    config.model_fingerprint = "sha256:" + std::string(64, 'c');
    config.param_count = 2;
    ServiceHooks hooks;
    hooks.log = [this](const ProgressEntries& entries) -> Status {
      if (fail_log) return Status::IOError("cannot append to the progress log: No space left on device (injected)");
      logged_results += static_cast<int>(entries.evaluations.size());
      logged_issued += static_cast<int>(entries.leases_issued.size());
      if (!entries.evaluations.empty()) issued_with_results = static_cast<int>(entries.leases_issued.size());
      return Status::Ok();
    };
    SchedulerOptions scheduler;
    scheduler.max_prompts_per_lease = 4;
    scheduler.guided_sizes = false;
    service = std::make_unique<WorkerService>(config, scheduler, hooks);
    auto phase = std::make_shared<PhaseData>();
    phase->generation = 0;
    phase->params[0] = {0.5f, -0.5f};
    service->StartPhase(phase, {{UnitKey{UnitKind::kCandidate, 0, "t/a", 0}, 1},
                                {UnitKey{UnitKind::kCandidate, 0, "t/a", 1}, 1}});
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    stub = v1::Coordinator::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  ~ServiceFixture() {
    service->End(v1::WorkBatch::END_SHUTDOWN);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  void Authorize(grpc::ClientContext& c) const {
    c.AddMetadata("x-namm-token", kToken);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  std::atomic<bool> fail_log{false};
  std::atomic<int> logged_results{0};
  std::atomic<int> logged_issued{0};
  std::atomic<int> issued_with_results{-1};  // lease records in the append that held the results
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<v1::Coordinator::Stub> stub;
};

// A report is answered OK only once its results are in the progress log: when the log cannot be written, the
// worker is told UNAVAILABLE (so it keeps them and sends them again) and nothing of the report was taken. Earlier,
// the log's failure was ignored and the report answered OK, so a restart lost results the worker had dropped. A
// failing log is no stop (it was, at the next tick, from its first failure on): leases are still handed out, their
// records wait, and once the log takes appends again the report sent again is acknowledged, the waiting lease
// record in the same append before its results.
TEST(WorkerService, AReportIsAcknowledgedOnlyOnceJournaled) {
  ServiceFixture f;
  v1::RegisterResponse reg;
  {
    grpc::ClientContext c;
    f.Authorize(c);
    v1::RegisterRequest request;
    request.set_worker_name("w");
    request.mutable_capabilities()->set_model_fingerprint("sha256:" + std::string(64, 'c'));
    request.mutable_capabilities()->set_device("cpu");
    request.mutable_capabilities()->set_max_concurrent_leases(1);
    request.set_protocol_version(v1::kProtocolVersion);
    ASSERT_TRUE(f.stub->Register(&c, request, &reg).ok());
  }
  f.fail_log = true;  // from before the lease is handed out: its record cannot be written either
  grpc::ClientContext stream;
  f.Authorize(stream);
  stream.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::LeasesRequest leases;
  leases.set_worker_id(reg.worker_id());
  auto reader = f.stub->Leases(&stream, leases);
  v1::WorkBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  ASSERT_EQ(batch.leases_size(), 1) << "sent although its record waits";
  const v1::Lease& lease = batch.leases(0);
  ASSERT_EQ(lease.prompts_size(), 2);

  v1::ReportRequest report;
  report.set_worker_id(reg.worker_id());
  report.set_lease_id(lease.lease_id());
  for (int64_t p : lease.prompts()) {
    v1::PromptResult* r = report.add_results();
    r->set_prompt(p);
    r->set_score(0.5);
    r->set_seconds(0.1);
  }
  const auto send = [&](v1::ReportResponse* response) {
    grpc::ClientContext c;
    f.Authorize(c);
    return f.stub->Report(&c, report, response);
  };
  v1::ReportResponse response;
  const grpc::Status refused = send(&response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_NE(refused.error_message().find("nothing of this report was taken; send it again"), std::string::npos);
  std::vector<EvaluationRecord> evaluations;
  std::vector<ReferenceResult> references;
  f.service->TakeResults(&evaluations, &references);
  EXPECT_TRUE(evaluations.empty()) << "nothing kept for the store";
  EXPECT_EQ(f.service->counters().units_done, 0) << "nothing counted as done";
  EXPECT_FALSE(f.service->PhaseDone());
  EXPECT_EQ(f.logged_issued.load(), 0);
  ServiceCounters failing = f.service->counters();
  EXPECT_GE(failing.journal_failures, 2) << "the lease's record and the report";
  EXPECT_TRUE(failing.journal_failing);

  // The disk is back: the report sent again is taken, after the lease record that waited.
  f.fail_log = false;
  const grpc::Status taken = send(&response);
  ASSERT_TRUE(taken.ok()) << taken.error_message();
  EXPECT_EQ(f.logged_results.load(), 2);
  EXPECT_EQ(f.logged_issued.load(), 1);
  EXPECT_EQ(f.issued_with_results.load(), 1) << "the waiting lease record goes with the next append";
  const ServiceCounters recovered = f.service->counters();
  EXPECT_EQ(recovered.units_done, 2);
  EXPECT_FALSE(recovered.journal_failing);
  EXPECT_EQ(recovered.journal_failures, failing.journal_failures);
  f.service->TakeResults(&evaluations, &references);
  EXPECT_EQ(evaluations.size(), 2u);
  EXPECT_TRUE(f.service->PhaseDone());
  stream.TryCancel();
  (void)reader->Finish();
}

// Every status the coordinator answers a report with has one handling in the worker (report_handling), checked
// here against the statuses this service really returns, their messages included: earlier the worker read any
// RESOURCE_EXHAUSTED as "report too large", so a report refused by the authentication lockout (which passes within
// a minute) was split, and a one-result report dropped.
TEST(WorkerService, EachStatusAReportGetsHasOneHandlingInTheWorker) {
  using worker::ReportHandling;
  using worker::report_handling;
  ServiceFixture f;
  const auto report = [&](const v1::ReportRequest& request, const std::string& token) {
    grpc::ClientContext c;
    c.AddMetadata("x-namm-token", token);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ReportResponse response;
    return f.stub->Report(&c, request, &response);
  };
  v1::ReportRequest small;
  small.set_worker_id("w-unknown");
  small.set_lease_id(1);
  v1::PromptResult* r = small.add_results();
  r->set_prompt(0);
  r->set_score(0.5);

  const grpc::Status unknown_worker = report(small, kToken);
  ASSERT_EQ(unknown_worker.error_code(), grpc::StatusCode::NOT_FOUND) << unknown_worker.error_message();
  EXPECT_EQ(report_handling(unknown_worker.error_code(), unknown_worker.error_message(), 1), ReportHandling::kReconnect);

  v1::ReportRequest oversized = small;  // past gRPC's 4 MiB receive limit
  v1::PromptFailure* failure = oversized.add_failures();
  failure->set_prompt(1);
  failure->set_error(std::string(5 << 20, 'x'));
  const grpc::Status too_large = report(oversized, kToken);
  ASSERT_EQ(too_large.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << too_large.error_message();
  EXPECT_EQ(report_handling(too_large.error_code(), too_large.error_message(), 2), ReportHandling::kSplit)
      << too_large.error_message();
  EXPECT_EQ(report_handling(too_large.error_code(), too_large.error_message(), 1), ReportHandling::kDrop);

  grpc::Status refused;
  for (int i = 0; i < 25 && refused.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED; ++i) {
    refused = report(small, "not-the-secret-0123456789abcdef");
    if (i == 0) {
      ASSERT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED) << refused.error_message();
      EXPECT_EQ(report_handling(refused.error_code(), refused.error_message(), 1), ReportHandling::kReconnect);
    }
  }
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << "the lockout: " << refused.error_message();
  EXPECT_EQ(report_handling(refused.error_code(), refused.error_message(), 1), ReportHandling::kRetry)
      << refused.error_message();
  EXPECT_EQ(report_handling(refused.error_code(), refused.error_message(), 8), ReportHandling::kRetry);

  for (const auto& [code, handling] : std::vector<std::pair<grpc::StatusCode, ReportHandling>>{
           {grpc::StatusCode::OK, ReportHandling::kTaken},
           {grpc::StatusCode::INVALID_ARGUMENT, ReportHandling::kDrop},
           {grpc::StatusCode::UNIMPLEMENTED, ReportHandling::kDrop},
           {grpc::StatusCode::FAILED_PRECONDITION, ReportHandling::kReconnect},
           {grpc::StatusCode::PERMISSION_DENIED, ReportHandling::kReconnect},
           {grpc::StatusCode::UNAVAILABLE, ReportHandling::kRetry},
           {grpc::StatusCode::DEADLINE_EXCEEDED, ReportHandling::kRetry},
           {grpc::StatusCode::INTERNAL, ReportHandling::kRetry},
           {grpc::StatusCode::CANCELLED, ReportHandling::kRetry}}) {
    EXPECT_EQ(report_handling(code, "", 3), handling) << code;
  }
}

}  // namespace
}  // namespace namm::coordinator
