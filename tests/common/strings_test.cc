#include "ddprun/common/strings.h"

#include <catch2/catch.hpp>
#include <cmath>

#include "ddprun/common/clock.h"

using namespace ddprun;

TEST_CASE("split keeps empty fields and join reverses it", "[common]") {
  CHECK(split("a,,b", ',') == std::vector<std::string>{"a", "", "b"});
  CHECK(split("", ',') == std::vector<std::string>{""});
  CHECK(join({"a", "b", "c"}, ", ") == "a, b, c");
}

TEST_CASE("number parsers reject partial and malformed input", "[common]") {
  CHECK(parseInt("42") == 42);
  CHECK(parseInt("-3") == -3);
  CHECK_FALSE(parseInt("4x").has_value());
  CHECK_FALSE(parseInt("").has_value());
  CHECK_FALSE(parseInt(" 4").has_value());
  CHECK_FALSE(parseInt("99999999999999999999999").has_value());
  CHECK(parseDouble("0.25") == 0.25);
  CHECK_FALSE(parseDouble("nan").has_value());
  CHECK_FALSE(parseDouble("1.5s").has_value());
  CHECK(parseBool("TRUE") == true);
  CHECK(parseBool("off") == false);
  CHECK_FALSE(parseBool("maybe").has_value());
}

TEST_CASE("seconds() converts without overflow, clamping to 0 .. 1e9 s", "[common]") {
  CHECK(ddprun::seconds(1.5) == std::chrono::milliseconds(1500));
  CHECK(ddprun::seconds(1e9) == std::chrono::seconds(1000000000));
  CHECK(ddprun::seconds(1e300) == std::chrono::seconds(1000000000));
  CHECK(ddprun::seconds(-5) == ddprun::Duration::zero());
  CHECK(ddprun::seconds(std::nan("")) == ddprun::Duration::zero());
  CHECK(ddprun::seconds(1e9) > ddprun::Duration::zero());
}

TEST_CASE("escapeControl writes control bytes as escapes and keeps everything else", "[common]") {
  CHECK(escapeControl("plain text, UTF-8 \xc3\xa9 kept") == "plain text, UTF-8 \xc3\xa9 kept");
  CHECK(escapeControl(std::string("a\nb\rc\td\x1b[31m\x7f") + '\0' + "e") ==
        "a\\nb\\rc\\td\\x1b[31m\\x7f\\x00e");
  CHECK(escapeControl(escapeControl("x\ny")) == "x\\ny");  // idempotent
}

TEST_CASE("a gRPC peer's host is its address without the port", "[common]") {
  CHECK(hostOfGrpcPeer("ipv4:10.0.0.7:41234") == "ipv4:10.0.0.7");
  CHECK(hostOfGrpcPeer("ipv6:[::1]:5555") == "ipv6:[::1]");
  CHECK(hostOfGrpcPeer("unix:/tmp/sock") == "unix:/tmp/sock");
  CHECK(hostPort("node-1", 29400) == "node-1:29400");
  CHECK(hostPort("10.0.0.7", 1) == "10.0.0.7:1");
  CHECK(hostPort("::1", 5555) == "[::1]:5555");
  CHECK(hostOfGrpcPeer("nonsense") == "nonsense");
}
