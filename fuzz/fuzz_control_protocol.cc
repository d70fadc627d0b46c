// libFuzzer target: the control channel's codec (common/src/control_protocol.cc), fed one line as
// a peer would send it (without its '\n'). Checks beyond "no crash": a refusal is one clean line
// of bounded length; an accepted line formats to a line that parses again to the same message, and
// formatting that message again gives the same line (format is a fixed point after one round).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ddprun/common/control_protocol.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  const auto parsed = ddprun::parseControlLine(line);
  if (!parsed.isOk()) {
    FUZZ_CHECK(isOneCleanLine(parsed.status().message()));
    FUZZ_CHECK(parsed.status().message().size() <= 256);
    return 0;
  }
  const std::string formatted = ddprun::formatControlLine(parsed.value());
  FUZZ_CHECK(!formatted.empty() && formatted.back() == '\n');
  FUZZ_CHECK(formatted.size() - 1 <= ddprun::kMaxControlLine);
  const auto again =
      ddprun::parseControlLine(std::string_view(formatted).substr(0, formatted.size() - 1));
  FUZZ_CHECK(again.isOk());
  FUZZ_CHECK(again.value() == parsed.value());
  FUZZ_CHECK(ddprun::formatControlLine(again.value()) == formatted);
  return 0;
}
