// tests/open_sessions: opens sessions on an offloadd and leaves them open
// (never attached, they wait for the attach lease), for tests that must
// call as another Unix user (a forked test process cannot use gRPC once
// its threads run).
//
//   open_sessions ADDRESS COUNT
//
// Prints one line per OpenSession: "OK <session id> <token in hex>" or the gRPC status
// code's number and message. Exit 0 once all were tried, 2 for bad
// arguments.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "grpcpp/grpcpp.h"
#include "proto/offload.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: open_sessions ADDRESS COUNT\n");
    return 2;
  }
  const int count = std::atoi(argv[2]);
  auto stub = offload::v1::PartitionService::NewStub(
      grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials()));
  for (int i = 0; i < count; ++i) {
    grpc::ClientContext context;
    offload::v1::OpenSessionResponse opened;
    const grpc::Status status = stub->OpenSession(&context, {}, &opened);
    if (status.ok()) {
      std::printf("OK %llu %s\n", static_cast<unsigned long long>(opened.session().session_id()),
                  absl::BytesToHexString(opened.session().token()).c_str());
    } else {
      std::printf("%d %s\n", static_cast<int>(status.error_code()), status.error_message().c_str());
    }
  }
  return 0;
}
