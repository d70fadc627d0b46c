// One spdlog logger per component. Components include this header, never spdlog directly, so
// the sink and format are decided in one place (stderr, "[ddprun <component>] level: message").
// Loggers are created on first use and are thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace ddprun {

// Returns the logger for `component` ("agent", "launcher", "rendezvous", ...).
std::shared_ptr<spdlog::logger> logger(const std::string& component);

// Sets the level of every ddprun logger: "trace".."off"; from DDPRUN_LOG_LEVEL by default.
void setLogLevel(const std::string& level);

}  // namespace ddprun
