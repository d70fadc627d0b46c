#include "main_common.h"

#include <cstdio>
#include <exception>
#include <iostream>

#include "ddprun/agent/agent_runner.h"
#include "ddprun/launcher/cli.h"

extern char** environ;

namespace ddprun::launcher {

int launcherMain(const char* program_name, int argc, char** argv) {
  try {
    std::vector<std::string> args(argv + 1, argv + argc);
    std::map<std::string, std::string> env;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      std::string kv = *e;
      auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    auto parsed = parseCommandLine(args, env, probeHost());
    if (!parsed.isOk()) {
      std::fprintf(stderr, "%s: error: %s\n", program_name, parsed.status().message().c_str());
      return 2;
    }
    if (parsed->show_help) {
      std::cout << helpText();
      return 0;
    }
    for (const auto& notice : parsed->notices) {
      std::fprintf(stderr, "%s: %s\n", program_name, notice.c_str());
    }
    return agent::runAgent(parsed->config);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", program_name, e.what());
    return 1;
  }
}

}  // namespace ddprun::launcher
