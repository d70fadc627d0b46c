// A unary gRPC call whose request is raw bytes, not a message: what a hostile client sends when
// its request is no valid protobuf (a string field that is not UTF-8, a cut varint).
#pragma once

#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

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

// A TCP connection to a gRPC server that sends HTTP/2's preface and an empty SETTINGS frame, as a
// client does, and no more: what a peer holding connections open does. With `silent`, it sends
// nothing at all.
class RawConnection {
 public:
  // Connects to `host`:`port` from `source` (addresses of 127.0.0.0/8); fd() < 0 when the
  // connection could not be made.
  RawConnection(const std::string& host, int port, const char* source = "127.0.0.1",
                bool silent = false) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return;
    sockaddr_in from{};
    from.sin_family = AF_INET;
    ::inet_pton(AF_INET, source, &from.sin_addr);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, host.c_str(), &to.sin_addr);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
        ::connect(fd_, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      ::close(fd_);
      fd_ = -1;
      return;
    }
    static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0";
    if (!silent && ::send(fd_, kPreface, sizeof kPreface - 1, MSG_NOSIGNAL) < 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  int fd() const { return fd_; }
  // Whether the server answered (its SETTINGS) within `ms`; false when it closed the connection
  // or said nothing.
  bool answered(int ms = 5000) {
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, ms) != 1) return false;
    char buf[256];
    return ::recv(fd_, buf, sizeof buf, 0) > 0;
  }
  // Whether the server closed the connection within `ms` (what it sent before, a GOAWAY, is read
  // and dropped).
  bool closedWithin(int ms) {
    if (fd_ < 0) return true;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      pollfd p{fd_, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) != 1) return false;
      char buf[256];
      if (::recv(fd_, buf, sizeof buf, 0) <= 0) return true;
    }
  }

 private:
  int fd_ = -1;
};

}  // namespace ddprun::testing
