#include "ddprun/common/strings.h"

#include <unistd.h>  // environ

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace ddprun {

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) {
      out.emplace_back(s.substr(start));
      return out;
    }
    out.emplace_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

std::string quotePeerText(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return escapeControl(s);
  return escapeControl(s.substr(0, max_bytes)) + "... (" + std::to_string(s.size()) + " bytes)";
}

bool hasControlByte(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return true;
  }
  return false;
}

std::string escapeControl(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if (b >= 0x20 && b != 0x7f) {
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += sep;
    out += parts[i];
  }
  return out;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

bool startsWith(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.substr(0, prefix.size()) == prefix;
}

bool endsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string toLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string replaceAll(std::string s, std::string_view from, std::string_view to) {
  if (from.empty()) return s;
  for (size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size()) {
    s.replace(pos, from.size(), to);
  }
  return s;
}

std::optional<long long> parseInt(std::string_view s) {
  if (s.empty() || s.size() > 30) return std::nullopt;
  std::string buf(s);
  if (std::isspace(static_cast<unsigned char>(buf[0]))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(buf.c_str(), &end, 10);
  if (errno != 0 || end != buf.c_str() + buf.size()) return std::nullopt;
  return v;
}

std::optional<double> parseDouble(std::string_view s) {
  if (s.empty() || s.size() > 64) return std::nullopt;
  std::string buf(s);
  if (std::isspace(static_cast<unsigned char>(buf[0]))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(buf.c_str(), &end);
  if (errno != 0 || end != buf.c_str() + buf.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<bool> parseBool(std::string_view s) {
  std::string l = toLower(s);
  if (l == "1" || l == "true" || l == "yes" || l == "on") return true;
  if (l == "0" || l == "false" || l == "no" || l == "off") return false;
  return std::nullopt;
}

std::map<std::string, std::string> environmentMap() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string_view::npos)
      env[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
  }
  return env;
}

std::string hostOfGrpcPeer(const std::string& peer) {
  const auto colon = peer.rfind(':');
  const auto kind = peer.find(':');
  return colon == std::string::npos || colon == kind ? peer : peer.substr(0, colon);
}

std::string hostPort(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace ddprun
