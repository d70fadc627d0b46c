#include "ddprun/agent/failure_report.h"

#include <algorithm>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ddprun/common/strings.h"

namespace ddprun::agent {

std::optional<ErrorFileContents> parseErrorFile(const std::string& json_text) {
  auto doc = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("message")) return std::nullopt;
  ErrorFileContents out;
  const auto& msg = doc["message"];
  if (msg.is_string()) {
    out.message = msg.get<std::string>();
    return out;
  }
  if (!msg.is_object()) return std::nullopt;
  if (msg.contains("message") && msg["message"].is_string()) {
    out.message = msg["message"].get<std::string>();
  }
  if (msg.contains("extraInfo") && msg["extraInfo"].is_object()) {
    const auto& extra = msg["extraInfo"];
    if (extra.contains("py_callstack") && extra["py_callstack"].is_string()) {
      out.traceback = extra["py_callstack"].get<std::string>();
    }
    if (extra.contains("timestamp")) {
      const auto& ts = extra["timestamp"];
      if (ts.is_number()) out.timestamp = ts.get<double>();
      if (ts.is_string()) out.timestamp = parseDouble(ts.get<std::string>());
    }
  }
  return out;
}

std::optional<ErrorFileContents> readErrorFile(const std::string& path) {
  if (path.empty()) return std::nullopt;
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return parseErrorFile(ss.str());
}

std::string signalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev == nullptr) return "signal " + std::to_string(sig);
  return std::string("SIG") + abbrev;
}

namespace {

std::string formatTime(double unix_seconds) {
  std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

struct Entry {
  const WorkerFailure* failure;
  std::optional<ErrorFileContents> error;
  double time;
};

void formatEntry(std::ostringstream& os, const Entry& e, const std::string& hostname) {
  const WorkerFailure& f = *e.failure;
  os << "[" << f.global_rank << "]:\n";
  os << "  time      : " << formatTime(e.time) << "\n";
  os << "  host      : " << hostname << "\n";
  os << "  rank      : " << f.global_rank << " (local_rank: " << f.local_rank << ")\n";
  os << "  exitcode  : " << f.exit.torchrunExitCode() << " (pid: " << f.pid << ")\n";
  os << "  error_file: " << (e.error ? f.error_file : "<N/A>") << "\n";
  std::string traceback;
  if (!f.hang.empty()) {
    // The agent stopped it: its exit code and any error file (e.g. a SignalException written on
    // our SIGTERM) are consequences; the hang is the cause.
    traceback = f.hang + "; the agent stopped it";
    if (e.error) {
      traceback += "\n" + (e.error->traceback.empty() ? e.error->message : e.error->traceback);
    }
  } else if (e.error) {
    traceback = e.error->traceback.empty() ? e.error->message : e.error->traceback;
  } else if (f.exit.signaled) {
    traceback = "Signal " + std::to_string(f.exit.code) + " (" + signalName(f.exit.code) +
                ") received by PID " + std::to_string(f.pid);
  } else {
    traceback = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html";
  }
  // Continuation lines of a multi-line traceback are indented under the field.
  std::string indented;
  for (char c : traceback) {
    indented += c;
    if (c == '\n') indented += "  ";
  }
  os << "  traceback : " << trim(indented) << "\n";
}

}  // namespace

std::string formatFailureReport(const std::string& entrypoint, const std::string& hostname,
                                const std::vector<WorkerFailure>& failures) {
  std::vector<Entry> entries;
  for (const auto& f : failures) {
    Entry e{&f, readErrorFile(f.error_file), f.wall_time};
    // A hung worker failed when the hang was seen, not when it wrote its error file on our stop.
    if (e.error && e.error->timestamp && f.hang.empty()) e.time = *e.error->timestamp;
    entries.push_back(std::move(e));
  }
  // Root cause: the earliest failure; ties go to the lower rank.
  auto root = std::min_element(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.time != b.time) return a.time < b.time;
    return a.failure->global_rank < b.failure->global_rank;
  });
  const std::string rule(60, '=');
  const std::string thin(60, '-');
  std::ostringstream os;
  os << rule << "\n" << entrypoint << " FAILED\n" << thin << "\nFailures:\n";
  bool others = false;
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (it == root) continue;
    formatEntry(os, *it, hostname);
    others = true;
  }
  if (!others) os << "  <NO_OTHER_FAILURES>\n";
  os << thin << "\nRoot Cause (first observed failure):\n";
  formatEntry(os, *root, hostname);
  os << rule << "\n";
  return os.str();
}

namespace {

// The first line of `text` that names a missing Python module, or "".
std::string missingModuleLine(const std::string& text) {
  for (const auto& line : split(text, '\n')) {
    if (line.find("ModuleNotFoundError") != std::string::npos ||
        line.find("No module named") != std::string::npos) {
      return trim(line);
    }
  }
  return "";
}

std::string readText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string pythonInterpreterHint(const std::string& interpreter, const std::string& source,
                                  const std::vector<WorkerFailure>& failures) {
  if (interpreter.empty()) return "";
  std::string missing;
  for (const auto& f : failures) {
    if (!missing.empty()) break;
    if (auto error = readErrorFile(f.error_file)) {
      missing = missingModuleLine(error->message + "\n" + error->traceback);
    }
    if (missing.empty() && !f.error_file.empty()) {
      const std::string dir = f.error_file.substr(0, f.error_file.rfind('/') + 1);
      missing = missingModuleLine(readText(dir + "stderr.log"));
    }
  }
  const std::string used = "the workers ran under " + interpreter + " (" +
                           (source == "PYTHON_EXEC" ? "PYTHON_EXEC" : "python3 found on PATH") +
                           ")";
  if (!missing.empty()) {
    return "hint: a worker failed with '" + missing + "': " + used +
           ", which lacks it; set PYTHON_EXEC to the interpreter that has it (e.g. "
           "PYTHON_EXEC=/path/to/venv/bin/python)\n";
  }
  return "note: " + used + "; set PYTHON_EXEC to run another interpreter\n";
}

}  // namespace ddprun::agent
