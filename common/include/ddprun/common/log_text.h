// Logging for sources that must not see spdlog or fmt: everything that includes LibTorch. LibTorch
// 2.x ships fmt headers of its own in its include directory, and the distribution's spdlog does
// not compile against them, so which fmt comes first on the include path must not matter. Here the
// caller builds the text with a stream; the sink, level and line format are those of logger() in
// log.h ("[ddprun <component>] level: message", DDPRUN_LOG_LEVEL).
//
//   static const ddprun::TextLogger log("worker");
//   DDPRUN_LOG(log, kDebug, "rank " << rank << ": " << what);
//
// Thread-safe; a TextLogger may be a function-local static. The stream expression (the macro's
// last arguments: template commas need no parentheses) is only evaluated when the level is enabled.
#pragma once

#include <memory>
#include <sstream>
#include <string>

namespace spdlog {
class logger;
}

namespace ddprun {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError };

class TextLogger {
 public:
  explicit TextLogger(const std::string& component);
  bool enabled(LogLevel level) const;
  void write(LogLevel level, const std::string& text) const;

 private:
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace ddprun

#define DDPRUN_LOG(logger, level, ...)                                   \
  do {                                                                   \
    if ((logger).enabled(::ddprun::LogLevel::level)) {                   \
      std::ostringstream ddprun_log_text_;                               \
      ddprun_log_text_ << __VA_ARGS__;                                   \
      (logger).write(::ddprun::LogLevel::level, ddprun_log_text_.str()); \
    }                                                                    \
  } while (0)
