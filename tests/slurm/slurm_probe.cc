// Stands in for ddprun's main on a real Slurm cluster, calling the Slurm API the way the launcher
// does, and printing what the launcher would parse:
//   ddprun_slurm_probe slurm ARGS   srunCommand(ARGS) with this program as "ddprun", then exec
//                                   srun (so each node runs `ddprun_slurm_probe DERIVED ARGS`)
//   ddprun_slurm_probe ARGS         stepArgs(ARGS): prints "node=<SLURMD_NODENAME>",
//                                   "job=<SLURM_JOB_ID>", "in_step=0|1", then "arg=<a>" per
//                                   argument ddprun would parse; or, with DDPRUN_PROBE_EXEC=PATH
//                                   set, execs PATH (the real ddprun) with those arguments: the
//                                   launcher's future wiring, glued on from outside.
// Errors: one line on stderr, exit 2 (as ddprun's usage errors).
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "ddprun/slurm/launch.h"
#include "ddprun/slurm/scontrol.h"

using namespace ddprun;

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const slurm::Env env = slurm::processEnvironment();
  const auto lookup = slurm::scontrolAddressLookup();
  if (!args.empty() && args[0] == "slurm") {
    args.erase(args.begin());
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = '\0';
    auto plan = slurm::srunCommand(args, env, self, lookup);
    if (!plan.isOk()) {
      std::cerr << plan.status().message() << "\n";
      return 2;
    }
    std::cout << "srun:";
    for (const auto& a : plan->argv) std::cout << " " << a;
    std::cout << std::endl;
    std::vector<char*> exec_argv;
    for (auto& a : plan->argv) exec_argv.push_back(a.data());
    exec_argv.push_back(nullptr);
    ::execvp(exec_argv[0], exec_argv.data());
    std::cerr << "cannot run " << plan->argv[0] << ": " << std::strerror(errno) << "\n";
    return 127;
  }
  auto step = slurm::stepArgs(args, env, lookup);
  if (!step.isOk()) {
    std::cerr << step.status().message() << "\n";
    return 2;
  }
  if (auto real = env.find("DDPRUN_PROBE_EXEC"); real != env.end()) {
    std::vector<std::string> argv_out = step->args;
    argv_out.insert(argv_out.begin(), real->second);
    std::vector<char*> exec_argv;
    for (auto& a : argv_out) exec_argv.push_back(a.data());
    exec_argv.push_back(nullptr);
    ::execv(exec_argv[0], exec_argv.data());
    std::cerr << "cannot run " << real->second << ": " << std::strerror(errno) << "\n";
    return 127;
  }
  auto it = env.find("SLURMD_NODENAME");
  std::string out = "node=" + (it == env.end() ? std::string("none") : it->second) + "\n";
  auto job = env.find("SLURM_JOB_ID");
  out += "job=" + (job == env.end() ? std::string("none") : job->second) + "\n";
  out += std::string("in_step=") + (step->in_step ? "1" : "0") + "\n";
  for (const auto& a : step->args) out += "arg=" + a + "\n";
  std::cout << out << std::flush;
  return 0;
}
