#include "ddprun/common/control_protocol.h"

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddprun/common/strings.h"

namespace ddprun {
namespace {

constexpr std::size_t kMaxFields = 16;
constexpr std::size_t kMaxKey = 16;
constexpr std::size_t kMaxValue = 255;
constexpr std::size_t kMaxDigits = 19;
constexpr std::int64_t kI32 = 2147483647;
constexpr std::int64_t kMaxStep = std::int64_t{1} << 62;
// At most this many bytes of the line go into one quote of an error; a message quotes one
// token, or a key (at most kMaxKey once checked) and a value, so it stays under 64 bytes.
constexpr std::size_t kQuoteToken = 64;
constexpr std::size_t kQuoteValue = 40;

enum class Kind {
  kInt,     // decimal digits in [lo, hi], below the field `below` when that is set
  kChoice,  // one of the '|'-separated `choices` (an empty alternative allows "")
  kText,    // the value pattern, length in [lo, hi]
  kPrefix,  // [A-Za-z0-9/_.-], length in [lo, hi]
};

struct FieldSpec {
  std::string_view key;
  Kind kind;
  std::int64_t lo = 0;
  std::int64_t hi = 0;
  std::string_view choices;
  std::string_view below;
};

struct TypeSpec {
  ControlType type;
  std::string_view name;
  std::vector<FieldSpec> fields;  // all required
};

FieldSpec intField(std::string_view key, std::int64_t lo, std::int64_t hi,
                   std::string_view below = {}) {
  return FieldSpec{key, Kind::kInt, lo, hi, {}, below};
}
FieldSpec choiceField(std::string_view key, std::string_view choices) {
  return FieldSpec{key, Kind::kChoice, 0, 0, choices, {}};
}

// One entry per ControlType, in the enum's order (docs/in-place-recovery.md §1, v1).
const std::vector<TypeSpec>& schema() {
  static const std::vector<TypeSpec> table = {
      {ControlType::kHello,
       "hello",
       {intField("v", 1, 1000), intField("pid", 1, 4194304), choiceField("caps", "|inplace")}},
      {ControlType::kWelcome,
       "welcome",
       {intField("v", 1, 1000), intField("gen", 0, kI32), intField("timeout_ms", 1, 86400000)}},
      {ControlType::kGroup,
       "group",
       {intField("gen", 1, kI32), intField("rank", 0, kI32 - 1, "world"),
        intField("world", 1, kI32), intField("local_rank", 0, kI32 - 1, "local_world"),
        intField("local_world", 1, kI32), FieldSpec{"addr", Kind::kText, 1, 255, {}, {}},
        intField("port", 1, 65535), FieldSpec{"prefix", Kind::kPrefix, 1, 128, {}, {}},
        intField("restart_count", 0, kI32)}},
      {ControlType::kCaps, "caps", {choiceField("add", "inplace")}},
      {ControlType::kAbort,
       "abort",
       {intField("gen", 0, kI32), choiceField("reason", "failure|membership|leave")}},
      {ControlType::kFault,
       "fault",
       {intField("gen", 0, kI32), choiceField("what", "peer_closed|timeout|cuda|other")}},
      {ControlType::kAborted, "aborted", {intField("gen", 0, kI32)}},
      {ControlType::kFormed,
       "formed",
       {intField("gen", 1, kI32), intField("rank", 0, kI32 - 1, "world"),
        intField("world", 1, kI32)}},
      {ControlType::kSynced,
       "synced",
       {intField("gen", 1, kI32), intField("step", 0, kMaxStep), intField("source", 0, kI32 - 1),
        intField("discarded", 0, kI32)}},
      {ControlType::kStep, "step", {intField("gen", 1, kI32), intField("n", 0, kMaxStep)}},
      {ControlType::kGoodbye, "goodbye", {choiceField("reason", "done|stop|error|giveup")}},
  };
  return table;
}

const TypeSpec& specOf(ControlType type) {
  const auto index = static_cast<std::size_t>(type);
  DDPRUN_CHECK(index < schema().size() && schema()[index].type == type,
               "control protocol: ControlType " + std::to_string(index) + " has no schema row");
  return schema()[index];
}

const TypeSpec* specNamed(std::string_view name) {
  for (const TypeSpec& spec : schema()) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

bool isValueChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '/' || c == '[' || c == ']' || c == '-';
}
bool isPrefixChar(char c) { return isValueChar(c) && c != ':' && c != '[' && c != ']'; }
bool isKeyChar(char c) { return (c >= 'a' && c <= 'z') || c == '_'; }

// 's', at most `max` bytes of it, and its length when it was longer.
std::string quote(std::string_view s, std::size_t max) {
  if (s.size() <= max) return "'" + escapeControl(s) + "'";
  return "'" + escapeControl(s.substr(0, max)) + "...' (" + std::to_string(s.size()) + " bytes)";
}

Status lineError(const std::string& what) { return invalidArgument("control line: " + what); }

Status fieldError(const TypeSpec& type, std::string_view key, const std::string& what) {
  return lineError("field '" + std::string(key) + "' of '" + std::string(type.name) + "' " + what);
}

// Decimal digits only, 1..kMaxDigits of them (which fits in 64 unsigned bits).
std::optional<std::uint64_t> parseDigits(std::string_view s) {
  if (s.empty() || s.size() > kMaxDigits) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

// Empty line, length, bytes, spaces: what holds whatever the type.
Status checkFraming(std::string_view line) {
  if (line.empty()) return lineError("empty line");
  if (line.size() > kMaxControlLine) {
    return lineError(std::to_string(line.size()) + " bytes, longer than " +
                     std::to_string(kMaxControlLine));
  }
  static constexpr char kHex[] = "0123456789abcdef";
  for (std::size_t i = 0; i < line.size(); ++i) {
    const auto b = static_cast<unsigned char>(line[i]);
    if (b >= 0x20 && b <= 0x7e) continue;
    std::string what = std::string("byte 0x") + kHex[b >> 4] + kHex[b & 15] + " at offset " +
                       std::to_string(i) + " is not printable ASCII";
    if (b == '\r' && i + 1 == line.size()) what += " (a CRLF line end: lines end with '\\n' only)";
    return lineError(what);
  }
  if (line.front() == ' ') return lineError("leading space");
  if (line.back() == ' ') return lineError("trailing space");
  const auto twice = line.find("  ");
  if (twice != std::string_view::npos) {
    return lineError("two spaces at offset " + std::to_string(twice) + " (tokens are separated " +
                     "by exactly one)");
  }
  return Status::ok();
}

// `key=value`: its syntax, and no key twice. A key the type knows goes into `fields`.
Status parseToken(const TypeSpec& type, std::string_view token, std::set<std::string>& seen,
                  std::map<std::string, std::string>& fields) {
  const auto eq = token.find('=');
  if (eq == std::string_view::npos) {
    return lineError(quote(token, kQuoteToken) + " in '" + std::string(type.name) +
                     "' is not key=value");
  }
  const std::string_view key = token.substr(0, eq);
  const std::string_view value = token.substr(eq + 1);
  bool key_ok = !key.empty() && key.size() <= kMaxKey;
  for (char c : key) key_ok = key_ok && isKeyChar(c);
  if (!key_ok) {
    return lineError("key " + quote(key, kQuoteToken) + " in '" + std::string(type.name) +
                     "' does not match [a-z_]{1,16}");
  }
  if (value.size() > kMaxValue) {
    return fieldError(type, key, "is " + std::to_string(value.size()) + " bytes, at most 255");
  }
  for (std::size_t i = 0; i < value.size(); ++i) {
    if (isValueChar(value[i])) continue;
    return fieldError(type, key,
                      "has '" + std::string(1, value[i]) + "' at offset " + std::to_string(i) +
                          ", values match [A-Za-z0-9._:/\\[\\]-]");
  }
  if (!seen.insert(std::string(key)).second) return fieldError(type, key, "appears twice");
  for (const FieldSpec& field : type.fields) {
    if (field.key == key) fields.emplace(std::string(key), std::string(value));
  }
  return Status::ok();
}

// "failure|membership|leave"; an empty alternative reads "(empty)".
std::string describeChoices(std::string_view choices) {
  std::string out;
  for (const std::string& choice : split(choices, '|')) {
    if (!out.empty()) out += '|';
    out += choice.empty() ? "(empty)" : choice;
  }
  return out;
}

Status checkInt(const TypeSpec& type, const FieldSpec& field, const std::string& value) {
  bool digits = !value.empty();
  for (char c : value) digits = digits && c >= '0' && c <= '9';
  if (!digits) {
    return fieldError(type, field.key,
                      "is " + quote(value, kQuoteValue) + ", not a decimal integer (digits only)");
  }
  if (value.size() > kMaxDigits) {
    return fieldError(type, field.key,
                      "has " + std::to_string(value.size()) + " digits, at most 19");
  }
  const auto v = parseDigits(value);
  if (*v < static_cast<std::uint64_t>(field.lo) || *v > static_cast<std::uint64_t>(field.hi)) {
    return fieldError(type, field.key,
                      "is " + value + ", must be in " + std::to_string(field.lo) + ".." +
                          std::to_string(field.hi));
  }
  return Status::ok();
}

Status checkField(const TypeSpec& type, const FieldSpec& field, const std::string& value) {
  switch (field.kind) {
    case Kind::kInt:
      return checkInt(type, field, value);
    case Kind::kChoice:
      for (const std::string& choice : split(field.choices, '|')) {
        if (choice == value) return Status::ok();
      }
      return fieldError(
          type, field.key,
          "is " + quote(value, kQuoteValue) + ", must be one of " + describeChoices(field.choices));
    case Kind::kText:
    case Kind::kPrefix: {
      const auto size = static_cast<std::int64_t>(value.size());
      if (size < field.lo || size > field.hi) {
        return fieldError(type, field.key,
                          "is " + std::to_string(size) + " bytes, must be " +
                              std::to_string(field.lo) + ".." + std::to_string(field.hi));
      }
      for (std::size_t i = 0; field.kind == Kind::kPrefix && i < value.size(); ++i) {
        if (isPrefixChar(value[i])) continue;
        return fieldError(type, field.key,
                          "has '" + std::string(1, value[i]) + "' at offset " + std::to_string(i) +
                              ", must match [A-Za-z0-9/_.-]");
      }
      return Status::ok();
    }
  }
  return Status::ok();
}

// Every key of the type present and valid, and each `below` relation (rank < world) holds.
Status checkSchema(const TypeSpec& type, const std::map<std::string, std::string>& fields) {
  for (const FieldSpec& field : type.fields) {
    const auto it = fields.find(std::string(field.key));
    if (it == fields.end()) {
      return lineError("'" + std::string(type.name) + "' has no field '" + std::string(field.key) +
                       "'");
    }
    DDPRUN_RETURN_IF_ERROR(checkField(type, field, it->second));
  }
  for (const FieldSpec& field : type.fields) {
    if (field.below.empty()) continue;
    const std::string& value = fields.at(std::string(field.key));
    const std::string& bound = fields.at(std::string(field.below));
    if (*parseDigits(value) >= *parseDigits(bound)) {
      return fieldError(
          type, field.key,
          "is " + value + ", must be below " + std::string(field.below) + " " + bound);
    }
  }
  return Status::ok();
}

}  // namespace

const char* controlTypeName(ControlType t) { return specOf(t).name.data(); }

std::int64_t ControlMessage::num(const std::string& key) const {
  const auto v = parseDigits(str(key));
  DDPRUN_CHECK(v && *v <= static_cast<std::uint64_t>(INT64_MAX),
               "control message '" + std::string(controlTypeName(type)) + "': field '" + key +
                   "' is not an integer");
  return static_cast<std::int64_t>(*v);
}

const std::string& ControlMessage::str(const std::string& key) const {
  const auto it = fields.find(key);
  DDPRUN_CHECK(it != fields.end(), "control message '" + std::string(controlTypeName(type)) +
                                       "' has no field '" + key + "'");
  return it->second;
}

bool ControlMessage::operator==(const ControlMessage& other) const {
  return type == other.type && fields == other.fields;
}

StatusOr<ControlMessage> parseControlLine(std::string_view line) {
  DDPRUN_RETURN_IF_ERROR(checkFraming(line));
  const std::vector<std::string> tokens = split(line, ' ');
  const TypeSpec* type = specNamed(tokens.front());
  if (type == nullptr) return lineError("unknown type " + quote(tokens.front(), kQuoteToken));
  if (tokens.size() - 1 > kMaxFields) {
    return lineError("'" + std::string(type->name) + "' has " + std::to_string(tokens.size() - 1) +
                     " fields, at most 16");
  }
  ControlMessage message;
  message.type = type->type;
  std::set<std::string> seen;
  for (std::size_t i = 1; i < tokens.size(); ++i) {
    DDPRUN_RETURN_IF_ERROR(parseToken(*type, tokens[i], seen, message.fields));
  }
  DDPRUN_RETURN_IF_ERROR(checkSchema(*type, message.fields));
  return message;
}

std::string formatControlLine(const ControlMessage& message) {
  std::string line = controlTypeName(message.type);
  for (const auto& [key, value] : message.fields) line += " " + key + "=" + value;
  const auto back = parseControlLine(line);
  DDPRUN_CHECK(back.isOk(), "formatControlLine: " + back.status().message());
  DDPRUN_CHECK(back.value() == message, "formatControlLine: '" +
                                            std::string(controlTypeName(message.type)) +
                                            "' carries a key its type does not know");
  return line + "\n";
}

ControlMessage makeControl(ControlType type, std::map<std::string, std::string> fields) {
  ControlMessage message;
  message.type = type;
  message.fields = std::move(fields);
  return message;
}

}  // namespace ddprun
