// Status and StatusOr<T>: how the control plane (launcher, agent, rendezvous) reports expected
// failures from the world (a bad flag, a peer gone, a port taken). Codes map 1:1 to gRPC codes so
// a status can cross the wire unchanged. Value types; no threading rules beyond those of their
// contents. Broken invariants are not statuses: they abort (see DDPRUN_CHECK).
#pragma once

#include <cstdlib>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace ddprun {

// Same numbering as grpc::StatusCode.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

const char* statusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }

  bool isOk() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message", or "OK".
  std::string toString() const;

  // Prepends context: "while X: <message>".
  Status withContext(const std::string& context) const;

  bool operator==(const Status& other) const {
    return code_ == other.code_ && message_ == other.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

inline Status invalidArgument(std::string msg) {
  return Status(StatusCode::kInvalidArgument, std::move(msg));
}
inline Status notFound(std::string msg) { return Status(StatusCode::kNotFound, std::move(msg)); }
inline Status failedPrecondition(std::string msg) {
  return Status(StatusCode::kFailedPrecondition, std::move(msg));
}
inline Status unavailable(std::string msg) {
  return Status(StatusCode::kUnavailable, std::move(msg));
}
inline Status internalError(std::string msg) {
  return Status(StatusCode::kInternal, std::move(msg));
}
inline Status deadlineExceeded(std::string msg) {
  return Status(StatusCode::kDeadlineExceeded, std::move(msg));
}

[[noreturn]] void checkFailed(const char* expr, const char* file, int line, const std::string& msg);

// Aborts loudly on a broken invariant (never for input from the world).
#define DDPRUN_CHECK(cond, msg)                                           \
  do {                                                                    \
    if (!(cond)) ::ddprun::checkFailed(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    DDPRUN_CHECK(!status_.isOk(), "StatusOr constructed from an OK status without a value");
  }

  bool isOk() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & {
    DDPRUN_CHECK(isOk(), "value() on an error StatusOr: " + status_.toString());
    return *value_;
  }
  const T& value() const& {
    DDPRUN_CHECK(isOk(), "value() on an error StatusOr: " + status_.toString());
    return *value_;
  }
  T&& value() && {
    DDPRUN_CHECK(isOk(), "value() on an error StatusOr: " + status_.toString());
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace ddprun

// Returns early from a function returning Status or StatusOr when `expr` is not OK.
#define DDPRUN_RETURN_IF_ERROR(expr)           \
  do {                                         \
    ::ddprun::Status _ddprun_st = (expr);      \
    if (!_ddprun_st.isOk()) return _ddprun_st; \
  } while (0)

#define DDPRUN_CONCAT_INNER(a, b) a##b
#define DDPRUN_CONCAT(a, b) DDPRUN_CONCAT_INNER(a, b)
#define DDPRUN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.isOk()) return tmp.status();              \
  lhs = std::move(tmp).value()
// `DDPRUN_ASSIGN_OR_RETURN(auto x, parse());`
#define DDPRUN_ASSIGN_OR_RETURN(lhs, expr) \
  DDPRUN_ASSIGN_OR_RETURN_IMPL(DDPRUN_CONCAT(_ddprun_so_, __LINE__), lhs, expr)
