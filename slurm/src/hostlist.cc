#include "ddprun/slurm/hostlist.h"

#include <cctype>
#include <cstdint>

#include "ddprun/common/strings.h"

namespace ddprun::slurm {
namespace {

struct Range {
  uint64_t lo = 0;
  uint64_t hi = 0;
  size_t width = 0;  // digits of LO as written: the zero padding
};

// One piece of an entry: literal text, or a bracket group of ranges.
struct Piece {
  std::string text;
  std::vector<Range> ranges;  // empty for text
  uint64_t count() const {
    uint64_t n = 0;
    for (const auto& r : ranges) n += r.hi - r.lo + 1;
    return n;
  }
};

class Parser {
 public:
  Parser(std::string_view expr, const HostlistOptions& options) : expr_(expr), options_(options) {}

  StatusOr<std::vector<std::string>> run() {
    // Empty entries ("a,,b", a trailing comma) are skipped, as Slurm does.
    size_t i = skipSeparators(0);
    if (i == expr_.size()) return error("the hostlist names no hosts", 0);
    std::vector<std::vector<Piece>> entries;
    uint64_t total = 0;
    while (i < expr_.size()) {
      // An entry runs to the next comma or whitespace outside brackets.
      const size_t start = i;
      size_t end = i;
      int depth = 0;
      size_t open_at = 0;
      for (; end < expr_.size(); ++end) {
        const char c = expr_[end];
        if (c == '[') {
          if (depth > 0) return error("nested '['", end);
          depth = 1;
          open_at = end;
        } else if (c == ']') {
          if (depth == 0) return error("']' without a matching '['", end);
          depth = 0;
        } else if (depth == 0 && (c == ',' || isSpace(c))) {
          break;
        }
      }
      if (depth > 0) return error("'[' is never closed", open_at);
      DDPRUN_ASSIGN_OR_RETURN(auto pieces, parseEntry(start, end));
      uint64_t n = 1;
      for (const auto& p : pieces) {
        if (!p.ranges.empty()) n = multiplyCapped(n, p.count());
      }
      total += n;
      if (total > options_.max_hosts) {
        return error("expands to more than " + std::to_string(options_.max_hosts) + " hosts",
                     start);
      }
      entries.push_back(std::move(pieces));

      i = skipSeparators(end);
    }

    std::vector<std::string> hosts;
    hosts.reserve(total);
    for (const auto& pieces : entries) expand(pieces, 0, "", hosts);
    return hosts;
  }

 private:
  static bool isSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

  size_t skipSeparators(size_t i) const {
    while (i < expr_.size() && (isSpace(expr_[i]) || expr_[i] == ',')) ++i;
    return i;
  }

  uint64_t multiplyCapped(uint64_t a, uint64_t b) const {
    const uint64_t cap = static_cast<uint64_t>(options_.max_hosts) + 1;
    if (a == 0 || b == 0) return 0;
    if (a >= cap || b >= cap || a > cap / b) return cap;
    return a * b;
  }

  // `pos` is 0-based; messages count characters from 1 as editors do.
  Status error(const std::string& problem, size_t pos) const {
    std::string shown(expr_.substr(0, 120));
    if (expr_.size() > 120) shown += "...";
    return invalidArgument("invalid hostlist '" + shown + "': " + problem + " at character " +
                           std::to_string(pos + 1));
  }

  StatusOr<std::vector<Piece>> parseEntry(size_t start, size_t end) const {
    std::vector<Piece> pieces;
    size_t i = start;
    while (i < end) {
      if (expr_[i] != '[') {
        const size_t open = expr_.find('[', i);
        const size_t stop = open == std::string_view::npos || open > end ? end : open;
        pieces.push_back(Piece{std::string(expr_.substr(i, stop - i)), {}});
        i = stop;
        continue;
      }
      const size_t close = expr_.find(']', i);  // balanced: checked by the caller
      DDPRUN_ASSIGN_OR_RETURN(auto ranges, parseGroup(i + 1, close));
      pieces.push_back(Piece{"", std::move(ranges)});
      i = close + 1;
    }
    return pieces;
  }

  // The text between '[' and ']' at [start, end).
  StatusOr<std::vector<Range>> parseGroup(size_t start, size_t end) const {
    if (start == end) return error("empty brackets '[]'", start - 1);
    std::vector<Range> ranges;
    size_t i = start;
    while (true) {
      size_t stop = expr_.find(',', i);
      if (stop == std::string_view::npos || stop > end) stop = end;
      DDPRUN_ASSIGN_OR_RETURN(Range r, parseRange(i, stop));
      ranges.push_back(r);
      if (stop == end) break;
      i = stop + 1;
    }
    return ranges;
  }

  // "N" or "LO-HI" at [start, end).
  StatusOr<Range> parseRange(size_t start, size_t end) const {
    if (start == end) return error("empty range in brackets", start);
    size_t dash = expr_.find('-', start);
    if (dash == std::string_view::npos || dash >= end) dash = end;
    Range r;
    DDPRUN_ASSIGN_OR_RETURN(r.lo, parseNumber(start, dash, "range start"));
    r.width = dash - start;
    r.hi = r.lo;
    if (dash < end) {
      DDPRUN_ASSIGN_OR_RETURN(r.hi, parseNumber(dash + 1, end, "range end"));
      if (r.hi < r.lo) {
        return error("descending range " + std::string(expr_.substr(start, end - start)) +
                         " (write LO-HI with LO <= HI)",
                     start);
      }
    }
    if (r.hi - r.lo >= options_.max_hosts) {
      return error("range " + std::string(expr_.substr(start, end - start)) +
                       " expands to more than " + std::to_string(options_.max_hosts) + " hosts",
                   start);
    }
    return r;
  }

  StatusOr<uint64_t> parseNumber(size_t start, size_t end, const char* what) const {
    if (start == end) return error(std::string("missing ") + what, start);
    if (end - start > 18) return error(std::string(what) + " has too many digits", start);
    uint64_t v = 0;
    for (size_t i = start; i < end; ++i) {
      const char c = expr_[i];
      if (!std::isdigit(static_cast<unsigned char>(c))) {
        return error(std::string("'") + c + "' in brackets (expected digits, ',' or '-')", i);
      }
      v = v * 10 + static_cast<uint64_t>(c - '0');
    }
    return v;
  }

  static std::string padded(uint64_t v, size_t width) {
    std::string digits = std::to_string(v);
    if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
    return digits;
  }

  // Odometer over the groups, leftmost slowest (Slurm's order).
  static void expand(const std::vector<Piece>& pieces, size_t k, const std::string& prefix,
                     std::vector<std::string>& out) {
    if (k == pieces.size()) {
      out.push_back(prefix);
      return;
    }
    const Piece& p = pieces[k];
    if (p.ranges.empty()) {
      expand(pieces, k + 1, prefix + p.text, out);
      return;
    }
    for (const auto& r : p.ranges) {
      for (uint64_t v = r.lo; v <= r.hi; ++v)
        expand(pieces, k + 1, prefix + padded(v, r.width), out);
    }
  }

  std::string_view expr_;
  const HostlistOptions& options_;
};

}  // namespace

StatusOr<std::vector<std::string>> expandHostlist(std::string_view expr,
                                                  const HostlistOptions& options) {
  auto hosts = Parser(expr, options).run();
  // Messages quote the expression (it comes from the environment): one line, whatever it holds.
  if (!hosts.isOk()) return Status(hosts.status().code(), escapeControl(hosts.status().message()));
  return hosts;
}

StatusOr<std::string> firstHost(std::string_view expr, const HostlistOptions& options) {
  DDPRUN_ASSIGN_OR_RETURN(auto hosts, expandHostlist(expr, options));
  return hosts.front();
}

}  // namespace ddprun::slurm
