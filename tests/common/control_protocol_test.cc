#include "ddprun/common/control_protocol.h"

#include <catch2/catch.hpp>
#include <string>

using namespace ddprun;

namespace {

// The message of the error a line gets; fails the test when the line parses.
std::string errorOf(const std::string& line) {
  const auto parsed = parseControlLine(line);
  REQUIRE_FALSE(parsed.isOk());
  CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
  return parsed.status().message();
}

const std::string kGroup =
    "group gen=7 rank=3 world=4 local_rank=1 local_world=2 addr=node-1.example:29500 port=29500 "
    "prefix=/torchelastic/job_1/g7 restart_count=0";

}  // namespace

TEST_CASE("every control message type round-trips through format and parse", "[common]") {
  const std::vector<ControlMessage> messages = {
      makeControl(ControlType::kHello, {{"v", "1"}, {"pid", "812"}, {"caps", ""}}),
      makeControl(ControlType::kHello, {{"v", "1000"}, {"pid", "4194304"}, {"caps", "inplace"}}),
      makeControl(ControlType::kWelcome, {{"v", "1"}, {"gen", "0"}, {"timeout_ms", "60000"}}),
      parseControlLine(kGroup).value(),
      makeControl(ControlType::kCaps, {{"add", "inplace"}}),
      makeControl(ControlType::kAbort, {{"gen", "7"}, {"reason", "membership"}}),
      makeControl(ControlType::kFault, {{"gen", "7"}, {"what", "peer_closed"}}),
      makeControl(ControlType::kAborted, {{"gen", "0"}}),
      makeControl(ControlType::kFormed, {{"gen", "8"}, {"rank", "0"}, {"world", "1"}}),
      makeControl(
          ControlType::kSynced,
          {{"gen", "8"}, {"step", "4611686018427387904"}, {"source", "0"}, {"discarded", "2"}}),
      makeControl(ControlType::kStep, {{"gen", "3"}, {"n", "90"}}),
      makeControl(ControlType::kGoodbye, {{"reason", "giveup"}}),
  };
  for (const ControlMessage& message : messages) {
    const std::string line = formatControlLine(message);
    INFO(line);
    REQUIRE(line.back() == '\n');
    const auto parsed = parseControlLine(std::string_view(line).substr(0, line.size() - 1));
    REQUIRE(parsed.isOk());
    CHECK(parsed.value() == message);
  }
  CHECK(formatControlLine(makeControl(ControlType::kStep, {{"gen", "3"}, {"n", "90"}})) ==
        "step gen=3 n=90\n");
  CHECK(std::string(controlTypeName(ControlType::kHello)) == "hello");
  CHECK(std::string(controlTypeName(ControlType::kGoodbye)) == "goodbye");
}

TEST_CASE("a parsed control message gives its fields as integers and strings", "[common]") {
  const ControlMessage group = parseControlLine(kGroup).value();
  CHECK(group.type == ControlType::kGroup);
  CHECK(group.num("rank") == 3);
  CHECK(group.num("port") == 29500);
  CHECK(group.str("addr") == "node-1.example:29500");
  CHECK(group.str("prefix") == "/torchelastic/job_1/g7");
  const auto synced =
      parseControlLine("synced gen=1 step=4611686018427387904 source=0 discarded=0");
  REQUIRE(synced.isOk());
  CHECK(synced->num("step") == (std::int64_t{1} << 62));
  CHECK(parseControlLine("hello v=1 pid=9 caps=").isOk());
  CHECK(parseControlLine("welcome v=1 gen=0 timeout_ms=007").value().num("timeout_ms") == 7);
}

TEST_CASE("a control line's unknown keys are dropped, so a newer peer may add keys", "[common]") {
  const auto parsed = parseControlLine("step gen=3 extra=1 n=90 later_key=");
  REQUIRE(parsed.isOk());
  CHECK(parsed.value() == makeControl(ControlType::kStep, {{"gen", "3"}, {"n", "90"}}));
}

TEST_CASE("control line framing errors name the problem", "[common]") {
  CHECK(errorOf("") == "control line: empty line");
  CHECK(errorOf("aborted gen=1" + std::string(1025 - 13, '0')) ==
        "control line: 1025 bytes, longer than 1024");
  CHECK(errorOf("aborted gen=1\x01") ==
        "control line: byte 0x01 at offset 13 is not printable ASCII");
  CHECK(errorOf("aborted gen=\xc3\xa9") ==
        "control line: byte 0xc3 at offset 12 is not printable ASCII");
  CHECK(errorOf("aborted gen=1\r").find("byte 0x0d at offset 13 is not printable ASCII (a CRLF") !=
        std::string::npos);
  CHECK(errorOf("aborted  gen=1") ==
        "control line: two spaces at offset 7 (tokens are separated by exactly one)");
  CHECK(errorOf("aborted gen=1 ") == "control line: trailing space");
  CHECK(errorOf(" aborted gen=1") == "control line: leading space");
  CHECK(errorOf("Hello v=1 pid=2 caps=") == "control line: unknown type 'Hello'");
  std::string many = "aborted gen=1";
  for (char c = 'a'; c < 'a' + 16; ++c) many += std::string(" x") + c + "=1";
  CHECK(errorOf(many) == "control line: 'aborted' has 17 fields, at most 16");
}

TEST_CASE("control line key and value errors name the field", "[common]") {
  CHECK(errorOf("aborted Gen=1") ==
        "control line: key 'Gen' in 'aborted' does not match [a-z_]{1,16}");
  CHECK(errorOf("aborted =1").find("key '' in 'aborted'") != std::string::npos);
  CHECK(errorOf("aborted abcdefghijklmnopq=1").find("does not match [a-z_]{1,16}") !=
        std::string::npos);
  CHECK(errorOf("aborted gen").find("'gen' in 'aborted' is not key=value") != std::string::npos);
  CHECK(errorOf("aborted gen=1 note=a,b") ==
        "control line: field 'note' of 'aborted' has ',' at offset 1, values match "
        "[A-Za-z0-9._:/\\[\\]-]");
  CHECK(errorOf("aborted gen=1 note=" + std::string(256, 'x')) ==
        "control line: field 'note' of 'aborted' is 256 bytes, at most 255");
  CHECK(errorOf("aborted gen=1 gen=2") == "control line: field 'gen' of 'aborted' appears twice");
  CHECK(errorOf("aborted x=1 x=2") == "control line: field 'x' of 'aborted' appears twice");
  CHECK(errorOf("step gen=1") == "control line: 'step' has no field 'n'");
  CHECK(errorOf("step gen=1 n=5a") ==
        "control line: field 'n' of 'step' is '5a', not a decimal integer (digits only)");
  CHECK(errorOf("step gen=1 n=+5").find("has '+' at offset 0") != std::string::npos);
  CHECK(errorOf("step gen=1 n=") ==
        "control line: field 'n' of 'step' is '', not a decimal integer (digits only)");
  CHECK(errorOf("step gen=1 n=-5").find("not a decimal integer") != std::string::npos);
  CHECK(errorOf("step gen=1 n=12345678901234567890") ==
        "control line: field 'n' of 'step' has 20 digits, at most 19");
  CHECK(errorOf("step gen=1 n=4611686018427387905") ==
        "control line: field 'n' of 'step' is 4611686018427387905, must be in "
        "0..4611686018427387904");
  CHECK(errorOf("step gen=0 n=1") ==
        "control line: field 'gen' of 'step' is 0, must be in 1..2147483647");
  CHECK(errorOf("hello v=1 pid=4194305 caps=") ==
        "control line: field 'pid' of 'hello' is 4194305, must be in 1..4194304");
  CHECK(errorOf("hello v=1 pid=1 caps=all") ==
        "control line: field 'caps' of 'hello' is 'all', must be one of (empty)|inplace");
  CHECK(errorOf("abort gen=1 reason=bored") ==
        "control line: field 'reason' of 'abort' is 'bored', must be one of "
        "failure|membership|leave");
}

TEST_CASE("control line cross-field and text checks: rank below world, addr and prefix",
          "[common]") {
  CHECK(errorOf("group gen=1 rank=7 world=4 local_rank=0 local_world=1 addr=h port=1 prefix=p "
                "restart_count=0") ==
        "control line: field 'rank' of 'group' is 7, must be below world 4");
  CHECK(errorOf("group gen=1 rank=0 world=4 local_rank=1 local_world=1 addr=h port=1 prefix=p "
                "restart_count=0") ==
        "control line: field 'local_rank' of 'group' is 1, must be below local_world 1");
  CHECK(errorOf("formed gen=1 rank=4 world=4") ==
        "control line: field 'rank' of 'formed' is 4, must be below world 4");
  CHECK(errorOf("group gen=1 rank=0 world=4 local_rank=0 local_world=1 addr= port=1 prefix=p "
                "restart_count=0") ==
        "control line: field 'addr' of 'group' is 0 bytes, must be 1..255");
  CHECK(errorOf("group gen=1 rank=0 world=4 local_rank=0 local_world=1 addr=h port=1 prefix=a:b "
                "restart_count=0") ==
        "control line: field 'prefix' of 'group' has ':' at offset 1, must match [A-Za-z0-9/_.-]");
  CHECK(errorOf("group gen=1 rank=0 world=4 local_rank=0 local_world=1 addr=h port=1 prefix=" +
                std::string(129, 'p') + " restart_count=0") ==
        "control line: field 'prefix' of 'group' is 129 bytes, must be 1..128");
  CHECK(errorOf("group gen=1 rank=0 world=4 local_rank=0 local_world=1 addr=h port=65536 "
                "prefix=p restart_count=0") ==
        "control line: field 'port' of 'group' is 65536, must be in 1..65535");
}

TEST_CASE("a control line error quotes at most 64 bytes of the line", "[common]") {
  const std::string type(300, 'x');
  const std::string message = errorOf(type + " gen=1");
  CHECK(message.size() < 64 + 60);
  CHECK(message.find(std::string(65, 'x')) == std::string::npos);
  CHECK(message.find("(300 bytes)") != std::string::npos);
  const std::string value = errorOf("step gen=1 n=" + std::string(200, 'z'));
  CHECK(value.find(std::string(41, 'z')) == std::string::npos);
}
