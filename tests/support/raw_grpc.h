// A unary gRPC call whose request is raw bytes, not a message: what a hostile client sends when
// its request is no valid protobuf (a string field that is not UTF-8, a cut varint).
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>

namespace ddprun::testing {

// Calls `method` ("/package.Service/Method") on `channel` with `request` as the message's bytes
// and the token as ddprun sends it (none when empty); returns the call's status (DEADLINE_EXCEEDED
// after 10 s).
inline grpc::Status rawUnaryCall(const std::shared_ptr<grpc::Channel>& channel,
                                 const std::string& method, const std::string& request,
                                 const std::string& token = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  grpc::Slice slice(request);
  grpc::ByteBuffer in(&slice, 1);
  grpc::ByteBuffer out;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &in, &out,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

// A protobuf field `number` of wire type 2 (a string) holding `bytes` (under 128 of them).
inline std::string rawStringField(int number, const std::string& bytes) {
  return std::string(1, static_cast<char>(number << 3 | 2)) +
         std::string(1, static_cast<char>(bytes.size())) + bytes;
}

}  // namespace ddprun::testing
