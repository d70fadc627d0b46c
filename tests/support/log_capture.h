// What one ddprun logger wrote while a test ran: an extra sink on logger(component) for the
// lifetime of a LogCapture, so a test can check the line a user would read.
#pragma once

#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>

#include "ddprun/common/log.h"

namespace ddprun::testing {

class LogCapture {
 public:
  explicit LogCapture(const std::string& component)
      : logger_(logger(component)), sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(text_)) {
    sink_->set_pattern("%l: %v");
    logger_->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = logger_->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  std::string text() const { return text_.str(); }
  // How many times `needle` occurs in what was written.
  int count(const std::string& needle) const {
    const std::string all = text();
    int n = 0;
    for (auto at = all.find(needle); at != std::string::npos; at = all.find(needle, at + 1)) ++n;
    return n;
  }

 private:
  std::shared_ptr<spdlog::logger> logger_;
  std::ostringstream text_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

}  // namespace ddprun::testing
