// On a real two-node Slurm cluster (tests/slurm/cluster.sh): n1 (NodeAddr 127.0.0.1) and n2
// (NodeAddr 127.0.0.2), two slurmd on this host. ddprun_slurm_probe stands in for ddprun's main.
#include <catch2/catch.hpp>
#include <cstdlib>

#include "ddprun/common/strings.h"
#include "ddprun/slurm/scontrol.h"
#include "process_helpers.h"
#include "slurm_cluster.h"

using namespace ddprun;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

std::string probeBin() { return buildDir() + "/tests/slurm/ddprun_slurm_probe"; }

const std::string kSignals = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1";

// The probe's report per srun task, from `srun -l` output ("<task>: key=value").
struct Report {
  std::string node, job;
  std::vector<std::string> args;
};

std::map<int, Report> reportsByTask(const std::string& output) {
  std::map<int, Report> out;
  for (const auto& raw : split(output, '\n')) {
    const std::string line = trim(raw);
    const auto colon = line.find(": ");
    if (colon == std::string::npos) continue;
    auto task = parseInt(line.substr(0, colon));
    if (!task) continue;
    const std::string kv = line.substr(colon + 2);
    Report& r = out[static_cast<int>(*task)];
    if (startsWith(kv, "node=")) r.node = kv.substr(5);
    if (startsWith(kv, "job=")) r.job = kv.substr(4);
    if (startsWith(kv, "arg=")) r.args.push_back(kv.substr(4));
  }
  return out;
}

}  // namespace

TEST_CASE("srun with one task per node gives each node the same rendezvous and its own address",
          "[slurm][cluster]") {
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  auto ran = run({"srun", "-N2", "--ntasks-per-node=1", "-l", "--chdir=" + cluster.dir().path(),
                  probeBin(), "--nproc_per_node=2", "prog.py", "--lr", "0.1"},
                 cluster.env(), 120s);
  INFO("srun output:\n" << ran.out << ran.err);
  REQUIRE(ran.exit_code == 0);
  auto reports = reportsByTask(ran.out);
  REQUIRE(reports.size() == 2);
  REQUIRE(reports[0].node == "n1");
  REQUIRE(reports[1].node == "n2");
  const std::string job = reports[0].job;
  CHECK(parseInt(job).has_value());
  CHECK(reports[1].job == job);
  for (int task = 0; task < 2; ++task) {
    INFO("task " << task);
    CHECK(reports[task].args ==
          std::vector<std::string>{
              "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=" + job,
              "--rdzv-endpoint=127.0.0.1:29400",
              std::string("--rdzv-conf=is_host=") + (task == 0 ? "true" : "false"),
              "--local-addr=127.0.0." + std::to_string(task + 1), kSignals, "--nproc_per_node=2",
              "prog.py", "--lr", "0.1"});
  }
}

TEST_CASE("sbatch --wait of a job running `ddprun slurm` starts one task per node with the flags",
          "[slurm][cluster]") {
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  const std::string script = cluster.dir() / "job.sh";
  std::ofstream(script) << "#!/bin/bash\n"
                        << "exec '" << probeBin()
                        << "' slurm --srun-args='-l --job-name=ddprun-step' --nproc_per_node=2 "
                           "prog.py --epochs 3\n";
  const std::string out = cluster.dir() / "job.out";
  auto ran = run({"sbatch", "-N2", "--wait", "--chdir=" + cluster.dir().path(), "-o", out, script},
                 cluster.env({{"DDPRUN_SLURM_PORT", "29555"}}), 120s);
  const std::string job_out = readFile(out);
  INFO("sbatch:\n" << ran.out << ran.err << "job output:\n" << job_out);
  REQUIRE(ran.exit_code == 0);
  // The srun command ddprun would exec, with the first node's NodeAddr as endpoint.
  CHECK_THAT(job_out, Catch::Contains("srun: srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
                                      "--kill-on-bad-exit=0 --whole -l --job-name=ddprun-step " +
                                      probeBin() + " --nnodes=2 --rdzv-backend=c10d --rdzv-id="));
  auto reports = reportsByTask(job_out);
  REQUIRE(reports.size() == 2);
  CHECK(reports[0].node == "n1");
  CHECK(reports[1].node == "n2");
  for (int task = 0; task < 2; ++task) {
    INFO("task " << task);
    const std::string job = reports[task].job;
    CHECK(reports[task].args ==
          std::vector<std::string>{
              std::string("--rdzv-conf=is_host=") + (task == 0 ? "true" : "false"),
              "--local-addr=127.0.0." + std::to_string(task + 1), kSignals, "--nnodes=2",
              "--rdzv-backend=c10d", "--rdzv-id=" + job, "--rdzv-endpoint=127.0.0.1:29555",
              "--nproc_per_node=2", "prog.py", "--epochs", "3"});
  }
}

TEST_CASE("the scontrol lookup finds each node's NodeAddr on a real cluster", "[slurm][cluster]") {
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  // scontrol reads SLURM_CONF from the environment it inherits.
  const char* old = std::getenv("SLURM_CONF");
  const std::string saved = old ? old : "";
  ::setenv("SLURM_CONF", (cluster.dir() / "slurm.conf").c_str(), 1);
  auto lookup = slurm::scontrolAddressLookup();
  auto n1 = lookup("n1");
  auto n2 = lookup("n2");
  auto n9 = lookup("n9");
  if (old) {
    ::setenv("SLURM_CONF", saved.c_str(), 1);
  } else {
    ::unsetenv("SLURM_CONF");
  }
  CHECK(n1.value() == "127.0.0.1");
  CHECK(n2.value() == "127.0.0.2");
  REQUIRE_FALSE(n9.isOk());
  CHECK_THAT(n9.status().message(),
             Catch::StartsWith("looking up the address of Slurm node 'n9': 'scontrol show node -o "
                               "n9' exited with 1"));
}

TEST_CASE("ddprun slurm outside an allocation, or with a malformed nodelist, exits 2 with one line",
          "[slurm]") {
  auto outside = run({"env", "-u", "SLURM_JOB_ID", probeBin(), "slurm", "x.py"}, {}, 30s);
  CHECK(outside.exit_code == 2);
  CHECK(outside.err ==
        "ddprun slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); use "
        "sbatch/salloc\n");
  auto malformed = run(
      {probeBin(), "slurm", "x.py"},
      {{"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "n[2-1]"}, {"SLURM_JOB_NUM_NODES", "2"}}, 30s);
  CHECK(malformed.exit_code == 2);
  CHECK(malformed.err ==
        "ddprun slurm: SLURM_JOB_NODELIST is malformed: invalid hostlist 'n[2-1]': descending "
        "range 2-1 (write LO-HI with LO <= HI) at character 3\n");
}
