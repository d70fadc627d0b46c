#include "ddprun/snapshot/version.h"

#include <algorithm>
#include <charconv>

#include "ddprun/common/deflate.h"
#include "ddprun/common/strings.h"

namespace ddprun::snapshot {

namespace {
std::optional<uint64_t> parseUint(const std::string& s) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}
}  // namespace

std::string versionText(uint64_t version) {
  return std::to_string(version >> 32) + "." + std::to_string(version & 0xffffffffu);
}

bool isReplicatedPart(std::string_view part, bool top) {
  if (part.empty() || part.size() > 255 || part == "." || part == "..") return false;
  if (part.find(".tmp") != std::string_view::npos || part.substr(0, 7) == ".ddprun") return false;
  if (top && part == "lost+found") return false;
  return std::none_of(part.begin(), part.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c == '/' || c < 0x20 || c == 0x7f;
  });
}

bool isReplicatedName(const std::string& name) {
  if (name.size() > kMaxReplicatedName) return false;
  for (size_t begin = 0;;) {
    const size_t end = std::min(name.find('/', begin), name.size());
    if (!isReplicatedPart(std::string_view(name).substr(begin, end - begin), begin == 0)) {
      return false;
    }
    if (end == name.size()) return true;
    begin = end + 1;
  }
}

namespace {

// One held version as a line: "NAME\tVERSION\tSIZE\tCRC32" ("-" for a CRC-32 still being
// computed: the fetch learns it from the source; "deleted", with size 0, for a tombstone). Names
// hold no tab or newline (isReplicatedName).
constexpr const char* kDeletedField = "deleted";

std::string versionLine(const SnapshotVersion& v) {
  const std::string crc = v.deleted       ? std::string(kDeletedField)
                          : v.crc_pending ? std::string("-")
                                          : std::to_string(v.crc32);
  return v.name + "\t" + std::to_string(v.version) + "\t" + std::to_string(v.size) + "\t" + crc +
         "\n";
}

std::optional<SnapshotVersion> parseVersionLine(const std::string& line) {
  if (std::count(line.begin(), line.end(), '\t') != 3) return std::nullopt;
  auto fields = split(line, '\t');
  if (fields.size() != 4 || !isReplicatedName(fields[0])) return std::nullopt;
  auto version = parseUint(fields[1]);
  auto size = parseUint(fields[2]);
  const bool pending = fields[3] == "-";
  const bool deleted = fields[3] == kDeletedField;
  auto crc = pending || deleted ? std::optional<uint64_t>(0) : parseUint(fields[3]);
  if (!version || !size || !crc || *crc > 0xffffffffull || (deleted && *size != 0)) {
    return std::nullopt;
  }
  SnapshotVersion v{fields[0], *version, *size, static_cast<uint32_t>(*crc)};
  v.crc_pending = pending;
  v.deleted = deleted;
  return v;
}

constexpr const char* kVersionTableHeader = "ddprun snapshot versions 1";

}  // namespace

namespace {
constexpr std::string_view kDeflatedHoldings = "ddprun-holdings-z1 ";
constexpr size_t kDeflateHoldingsFrom = 1024;
}  // namespace

std::string encodeHoldings(const std::string& endpoint, const std::vector<SnapshotVersion>& held) {
  std::string out = endpoint + "\n";
  for (const auto& v : held) out += versionLine(v);
  if (out.size() < kDeflateHoldingsFrom) return out;
  auto packed = deflateFast(out);
  if (!packed) return out;
  return std::string(kDeflatedHoldings) + std::to_string(out.size()) + "\n" + *packed;
}

StatusOr<std::pair<std::string, std::vector<SnapshotVersion>>> decodeHoldings(
    const std::string& stored) {
  std::string inflated;
  if (stored.compare(0, kDeflatedHoldings.size(), kDeflatedHoldings) == 0) {
    const size_t nl = stored.find('\n');
    const auto size =
        nl == std::string::npos
            ? std::nullopt
            : parseInt(stored.substr(kDeflatedHoldings.size(), nl - kDeflatedHoldings.size()));
    if (!size || *size <= 0)
      return invalidArgument("snapshot holdings: a malformed deflated header");
    if (static_cast<uint64_t>(*size) > kMaxHoldingsBytes) {
      return invalidArgument("snapshot holdings: they state " + std::to_string(*size) +
                             " bytes inflated, more than the " + std::to_string(kMaxHoldingsBytes) +
                             " any node publishes");
    }
    auto text =
        inflateExactly(std::string_view(stored).substr(nl + 1), static_cast<uint64_t>(*size));
    if (!text.isOk()) return invalidArgument("snapshot holdings: " + text.status().message());
    inflated = std::move(text).value();
  }
  // Line by line in place: a value of newlines or tabs costs no string per line.
  const std::string_view text = inflated.empty() ? std::string_view(stored) : inflated;
  const size_t first_end = std::min(text.find('\n'), text.size());
  const std::string endpoint(text.substr(0, first_end));
  if (endpoint.empty()) return invalidArgument("snapshot holdings: no replication endpoint");
  std::vector<SnapshotVersion> held;
  for (size_t at = first_end + 1; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string line(text.substr(at, end - at));
    at = end + 1;
    if (line.empty()) continue;
    if (held.size() >= kMaxHeldVersions) {
      return invalidArgument("snapshot holdings: more than " + std::to_string(kMaxHeldVersions) +
                             " versions");
    }
    auto v = parseVersionLine(line);
    if (!v) {
      return invalidArgument("snapshot holdings: malformed line '" + quotePeerText(line) + "'");
    }
    if (!isPossibleVersion(v->version)) {
      return invalidArgument("snapshot holdings: line '" + quotePeerText(line) +
                             "' has a version from round " + std::to_string(v->version >> 32) +
                             ", which no job reaches");
    }
    held.push_back(std::move(*v));
  }
  return std::make_pair(endpoint, std::move(held));
}

std::string encodeVersionTable(const std::vector<SnapshotVersion>& held) {
  std::string out = std::string(kVersionTableHeader) + "\n";
  for (const auto& v : held) {
    if (v.version != 0 && !v.crc_pending) out += versionLine(v);
  }
  return out;
}

StatusOr<std::map<std::string, SnapshotVersion>> decodeVersionTable(const std::string& text) {
  auto lines = split(text, '\n');
  if (lines.empty() || lines[0] != kVersionTableHeader) {
    return invalidArgument("not a version table (its first line is not '" +
                           std::string(kVersionTableHeader) + "')");
  }
  std::map<std::string, SnapshotVersion> table;
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    auto v = parseVersionLine(lines[i]);
    const std::string where = "line " + std::to_string(i + 1) + " ('" +
                              escapeControl(lines[i].substr(0, 300)) +
                              (lines[i].size() > 300 ? "...'" : "'");
    if (!v || v->crc_pending) return invalidArgument(where + ") is not NAME VERSION SIZE CRC32");
    if (!isPossibleVersion(v->version)) {
      return invalidArgument(where + ") has a version from round " +
                             std::to_string(v->version >> 32) + ", which no job reaches");
    }
    if (!table.emplace(v->name, *v).second) {
      return invalidArgument(where + ") names " + v->name + " a second time");
    }
  }
  return table;
}

uint64_t recordedVersion(const std::map<std::string, SnapshotVersion>& table,
                         const std::string& name, uint64_t size, uint32_t crc32) {
  auto it = table.find(name);
  if (it == table.end() || it->second.deleted || it->second.size != size ||
      it->second.crc32 != crc32) {
    return 0;
  }
  return it->second.version;
}

}  // namespace ddprun::snapshot
