// The in-place recovery control channel's codec (docs/in-place-recovery.md §1): one message per
// printable-ASCII line, `type key=value ...`, between an agent and its workers over a Unix socket.
// The agent and the worker SDK share it, so both ends accept and refuse the same lines. It checks
// the framing and each type's keys and ranges against one schema table; a line it accepts has every
// key its type requires, in range, and nothing else (unknown keys are dropped, so a newer peer may
// add keys without a new version; a new type needs a new version).
//
// Pure functions on value types: no I/O, no state, callable from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "ddprun/common/status.h"

namespace ddprun {

enum class ControlType {
  kHello,
  kWelcome,
  kGroup,
  kCaps,
  kAbort,
  kFault,
  kAborted,
  kFormed,
  kSynced,
  kStep,
  kGoodbye
};

// The type's name on the wire: "hello", "welcome", ...
const char* controlTypeName(ControlType t);

constexpr std::size_t kMaxControlLine = 1024;  // bytes, without the '\n'
constexpr int kControlProtocolVersion = 1;

struct ControlMessage {
  ControlType type = ControlType::kHello;
  // Only the keys the type knows (parseControlLine drops the others).
  std::map<std::string, std::string> fields;

  // The field as an integer; DDPRUN_CHECK-fails if absent or not decimal digits (a message that
  // parseControlLine accepted has every integer field of its type).
  std::int64_t num(const std::string& key) const;
  // The field; DDPRUN_CHECK-fails if absent.
  const std::string& str(const std::string& key) const;

  bool operator==(const ControlMessage& other) const;
  bool operator!=(const ControlMessage& other) const { return !(*this == other); }
};

// Parses one line, without its trailing '\n' (a trailing '\r' is refused as any control byte).
// Errors are invalidArgument naming the problem and the field; they quote at most 64 bytes of the
// line, so a log line that carries one stays short whatever the peer sent.
StatusOr<ControlMessage> parseControlLine(std::string_view line);

// "type k=v k=v\n", keys in the map's order. A message that would not parse back to itself (a
// missing or unknown key, a value out of range) is a programming error: DDPRUN_CHECK fails.
std::string formatControlLine(const ControlMessage& message);

// makeControl(ControlType::kStep, {{"gen", "3"}, {"n", "90"}}).
ControlMessage makeControl(ControlType type, std::map<std::string, std::string> fields);

}  // namespace ddprun
