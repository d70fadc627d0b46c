#include "ddprun/common/log.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <mutex>

#include "ddprun/common/log_text.h"

namespace ddprun {
namespace {

std::mutex g_mu;

spdlog::level::level_enum initialLevel() {
  const char* env = std::getenv("DDPRUN_LOG_LEVEL");
  if (env == nullptr || *env == '\0') return spdlog::level::info;
  return spdlog::level::from_str(env);
}

}  // namespace

std::shared_ptr<spdlog::logger> logger(const std::string& component) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::string name = "ddprun." + component;
  if (auto existing = spdlog::get(name)) return existing;
  auto log = spdlog::stderr_logger_mt(name);
  log->set_pattern("[ddprun " + component + "] %l: %v");
  log->set_level(initialLevel());
  return log;
}

void setLogLevel(const std::string& level) {
  std::lock_guard<std::mutex> lock(g_mu);
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& l) {
    l->set_level(spdlog::level::from_str(level));
  });
}

namespace {
spdlog::level::level_enum spdlogLevel(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      break;
  }
  return spdlog::level::err;
}
}  // namespace

TextLogger::TextLogger(const std::string& component) : logger_(logger(component)) {}

bool TextLogger::enabled(LogLevel level) const { return logger_->should_log(spdlogLevel(level)); }

void TextLogger::write(LogLevel level, const std::string& text) const {
  logger_->log(spdlogLevel(level), "{}", text);
}

}  // namespace ddprun
