#include "ddprun/common/status.h"

#include <catch2/catch.hpp>

using namespace ddprun;

namespace {
StatusOr<int> half(int x) {
  if (x % 2 != 0) return invalidArgument("odd: " + std::to_string(x));
  return x / 2;
}
StatusOr<int> quarter(int x) {
  DDPRUN_ASSIGN_OR_RETURN(int h, half(x));
  return half(h);
}
}  // namespace

TEST_CASE("a status carries its code and message and prints them gRPC-style", "[common]") {
  Status st = invalidArgument("bad --nnodes");
  CHECK_FALSE(st.isOk());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(static_cast<int>(StatusCode::kUnauthenticated) == 16);
  CHECK(st.toString() == "INVALID_ARGUMENT: bad --nnodes");
  CHECK(Status::ok().toString() == "OK");
  CHECK(st.withContext("parsing").message() == "parsing: bad --nnodes");
}

TEST_CASE("StatusOr propagates the first error through ASSIGN_OR_RETURN", "[common]") {
  REQUIRE(quarter(8).isOk());
  CHECK(*quarter(8) == 2);
  auto r = quarter(6);
  REQUIRE_FALSE(r.isOk());
  CHECK(r.status().message() == "odd: 3");
}
