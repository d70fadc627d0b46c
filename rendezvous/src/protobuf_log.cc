#include "ddprun/rendezvous/protobuf_log.h"

#include <google/protobuf/stubs/logging.h>

#include <mutex>
#include <optional>

#include "ddprun/common/clock.h"
#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/strings.h"
#include "ddprun/common/thread_annotations.h"

namespace ddprun::rendezvous {
namespace {

// Keyed by libprotobuf's file:line, a few dozen at most; never destroyed (logging may run during
// static destruction). libprotobuf logs from any thread.
struct Throttle {
  Mutex mu;
  LogThrottle lines GUARDED_BY(mu){std::chrono::minutes(1), 256, kProtobufLinesPerMinute};
};
Throttle& throttle() {
  static auto* t = new Throttle;
  return *t;
}

void onProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                   const std::string& message) {
  auto log = logger("protobuf");
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    log->critical("{}", escapeControl(message));
    return;
  }
  if (level == google::protobuf::LOGLEVEL_INFO) {
    log->debug("{}", escapeControl(message));
    return;
  }
  std::optional<uint64_t> n;
  {
    Throttle& t = throttle();
    MutexLock lock(t.mu);
    n = t.lines.note(std::string(filename != nullptr ? filename : "?") + ":" + std::to_string(line),
                     std::chrono::steady_clock::now());
  }
  if (n) log->warn("{}", protobufLogLine(message, *n));
}

}  // namespace

std::string protobufLogLine(const std::string& message, uint64_t count) {
  std::string text = escapeControl(message);
  while (!text.empty() && text.back() == ' ') text.pop_back();
  if (count > 1) {
    text += " (and " + std::to_string(count - 1) +
            " more like it since the last such line: at most " +
            std::to_string(kProtobufLinesPerMinute) + " a minute are logged)";
  }
  return text;
}

void routeProtobufLogs() {
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&onProtobufLog); });
}

}  // namespace ddprun::rendezvous
