// The coordinator's gRPC service in this process, over real gRPC on loopback, with its progress-log hook in the
// test's hands: what a worker is told when the coordinator cannot journal what it reported.
#include "worker_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>

#include "namm/v1/coordinator.grpc.pb.h"
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
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<v1::Coordinator::Stub> stub;
};

// A report is answered OK only once its results are in the progress log: when the log cannot be written, the
// worker is told UNAVAILABLE (so it keeps them and sends them again) and nothing of the report was taken. Earlier,
// the log's failure was ignored and the report answered OK, so a restart lost results the worker had dropped.
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
  grpc::ClientContext stream;
  f.Authorize(stream);
  stream.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::LeasesRequest leases;
  leases.set_worker_id(reg.worker_id());
  auto reader = f.stub->Leases(&stream, leases);
  v1::WorkBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  ASSERT_EQ(batch.leases_size(), 1);
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
  f.fail_log = true;
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

  // The run stops on it (its loop reads JournalStatus): nothing more is journaled or acknowledged meanwhile, so
  // that no record lands after a torn one.
  EXPECT_NE(f.service->JournalStatus().message().find("No space left on device (injected)"), std::string::npos);
  f.fail_log = false;
  EXPECT_EQ(send(&response).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(f.logged_results.load(), 0);
  EXPECT_EQ(f.service->counters().units_done, 0);
  stream.TryCancel();
  (void)reader->Finish();
}

}  // namespace
}  // namespace namm::coordinator
