// ddprun on a real two-node Slurm cluster (tests/slurm/cluster.sh: n1 = 127.0.0.1, n2 = 127.0.0.2
// on this host), with real multi-node ddprun agents and real PyTorch / `train` workers.
//
// Each scenario runs in two ways:
//  - "ddprun slurm": ddprun's own subcommand and its auto-detection inside srun (the launcher
//    calling slurm::srunCommand and slurm::stepArgs);
//  - "api glue": ddprun_slurm_probe calls the same two functions and execs srun / the real ddprun
//    with their result, so the Slurm library is proven against the real agents independently of
//    how the launcher wires it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <regex>
#include <set>

#include "ddprun/common/strings.h"
#include "process_helpers.h"
#include "slurm_cluster.h"

using namespace ddprun;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

enum class Mode { kDdprunSlurm, kApiGlue };

std::string probeBin() { return buildDir() + "/tests/slurm/ddprun_slurm_probe"; }
std::string trainBin() { return buildDir() + "/examples/train"; }
std::string allreduceScript() { return sourceDir() + "/examples/pytorch/allreduce_check.py"; }

// The shell words that start `ddprun slurm` in a job script.
std::string ddprunSlurm(Mode mode) {
  if (mode == Mode::kDdprunSlurm) return "'" + ddprunBin() + "' slurm";
  return "env DDPRUN_PROBE_EXEC='" + ddprunBin() + "' '" + probeBin() + "' slurm";
}

std::map<std::string, std::string> jobEnv() {
  return {{"PYTHON_EXEC", torchPython()},
          {"DDPRUN_SLURM_PORT", std::to_string(freePort())},
          {"OMP_NUM_THREADS", "1"}};
}

struct Job {
  int sbatch_exit = -1;
  std::string output;
};

// sbatch -N2 --wait of `body` (a bash script body), bounded.
Job submitAndWait(const SlurmCluster& cluster, const std::string& name, const std::string& body,
                  std::chrono::seconds bound = 300s) {
  const std::string script = cluster.dir() / (name + ".sh");
  std::ofstream(script) << "#!/bin/bash\n" << body << "\n";
  const std::string out = cluster.dir() / (name + ".out");
  Job job;
  auto ran = run({"sbatch", "-N2", "--wait", "--chdir=" + cluster.dir().path(), "-o", out, script},
                 cluster.env(jobEnv()), bound);
  job.sbatch_exit = ran.exit_code;
  job.output = readFile(out) + ran.err;
  return job;
}

// "exit 0", or the exit code followed by the output's lines that say what went wrong (at most 6):
// a failed CHECK prints this expansion first, ahead of the whole output, so a truncated CI log
// still shows the cause.
std::string verdict(const Job& job) {
  std::string out = "exit " + std::to_string(job.sbatch_exit);
  if (job.sbatch_exit == 0) return out;
  static const std::regex bad(R"(error|fail|exit code|signal|timed out|refused|Killed|abort)",
                              std::regex::icase);
  int shown = 0;
  for (const std::string& line : split(job.output, '\n')) {
    if (shown == 6 || !std::regex_search(line, bad)) continue;
    out += "\n  " + line.substr(0, 200);
    ++shown;
  }
  return out;
}

std::set<std::string> allreduceLines(const std::string& output) {
  std::set<std::string> ranks;
  std::regex ok(R"(rank (\d+)/(\d+): all_reduce sum (\d+) \(expected (\d+)\) OK)");
  for (std::sregex_iterator it(output.begin(), output.end(), ok), end; it != end; ++it) {
    ranks.insert((*it)[1].str() + "/" + (*it)[2].str());
  }
  return ranks;
}

void allreduceAcrossBothNodes(Mode mode) {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  auto job = submitAndWait(
      cluster, "allreduce",
      "exec " + ddprunSlurm(mode) + " --nproc_per_node=2 '" + allreduceScript() + "'");
  INFO("job output:\n" << job.output);
  CHECK(verdict(job) == "exit 0");
  // World size 4 from 2 workers per node: both nodes joined; every rank saw the full sum.
  CHECK(allreduceLines(job.output) == std::set<std::string>{"0/4", "1/4", "2/4", "3/4"});
  CHECK_THAT(job.output, Catch::Contains("round 1 complete with 2 nodes, world size 4"));
}

void trainAcrossBothNodes(Mode mode) {
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  auto job =
      submitAndWait(cluster, "train",
                    "exec " + ddprunSlurm(mode) + " --nproc_per_node=2 --tee=3 '" + trainBin() +
                        "' 2 1 --snapshot-path '" + cluster.dir() / "snap.pt" + "'");
  INFO("job output:\n" << job.output);
  CHECK(verdict(job) == "exit 0");
  for (int rank = 0; rank < 4; ++rank) {
    CHECK_THAT(job.output, Catch::Contains("[RANK " + std::to_string(rank) + "] Epoch 1 |"));
  }
}

// The pid of the ddprun agent that Slurm started on `node`.
std::optional<int> agentOn(const std::string& node) {
  auto ps = run({"sh", "-c",
                 "for p in /proc/[0-9]*; do "
                 "[ \"$(cat $p/comm 2>/dev/null)\" = ddprun ] || continue; "
                 "tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qx SLURMD_NODENAME=" +
                     node + " && echo ${p#/proc/}; done"},
                {}, 30s);
  auto pid = parseInt(trim(split(ps.out, '\n').front()));
  if (!pid) return std::nullopt;
  return static_cast<int>(*pid);
}

void survivesALostNode(Mode mode) {
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  const std::string out = cluster.dir() / "elastic.out";
  const std::string script = cluster.dir() / "elastic.sh";
  std::ofstream(script) << "#!/bin/bash\nexec " << ddprunSlurm(mode)
                        << " --nnodes=1:2 --max-restarts=3 --nproc_per_node=1 --tee=3 '"
                        << trainBin() << "' 5 1 --model mlp --dataset-size 1024 --snapshot-path '"
                        << (cluster.dir() / "snap.pt") << "'\n";
  Process sbatch({"sbatch", "-N2", "--wait", "--chdir=" + cluster.dir().path(), "-o", out, script},
                 cluster.env(jobEnv()));
  // Both nodes train (world size 2) before n2's agent is killed. The job must still be running
  // when the kill lands, so it trains the 12.6 M-parameter mlp (~0.1 s a step, 16 steps an epoch,
  // compute-bound: load only slows it; the 4 epochs left are seconds after the epoch-0 line): the
  // linear model finishes all its epochs in milliseconds over shared memory, sooner than the
  // epoch-0 line reaches the job's output file.
  REQUIRE(waitUntil([&] { return readFile(out).find("[RANK 1] Epoch 0 |") != std::string::npos; },
                    240s));
  auto victim = agentOn("n2");
  REQUIRE(victim.has_value());
  ::kill(*victim, SIGKILL);
  auto done = sbatch.wait(300s);
  const std::string output = readFile(out);
  INFO("job output:\n" << output);
  REQUIRE(done.has_value());
  // n1 carries on alone (within 1:2) from the last snapshot and finishes all epochs.
  CHECK_THAT(output, Catch::Contains("world size 1"));
  CHECK_THAT(output, Catch::Contains("[RANK 0] Epoch 4 |"));
  CHECK_THAT(output, Catch::Contains("n2: task 1"));  // srun saw n2's agent die
  CHECK_THAT(output, !Catch::Contains("n1: task 0: Exited with exit code"));  // n1's did not fail
}

void preemptedJobResumesAfterRequeue(Mode mode) {
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  // As deploy/slurm/train_cpu.sbatch: USR1 to the batch shell checkpoints and requeues. The
  // requeued run (SLURM_RESTART_COUNT=1) trains to epoch 40 from the snapshot.
  const std::string out = cluster.dir() / "preempt.out";
  const std::string script = cluster.dir() / "preempt.sh";
  std::ofstream(script)
      << "#!/bin/bash\n"
      << "epochs=100000; [ \"${SLURM_RESTART_COUNT:-0}\" -gt 0 ] && epochs=40\n"
      << ddprunSlurm(mode) << " --nproc_per_node=1 --tee=3 '" << trainBin()
      << "' $epochs 1 --snapshot-path '" << (cluster.dir() / "snap.pt") << "' &\n"
      << "child=$!\npreempted=0\n"
      << "trap 'preempted=1; kill -USR1 $child' USR1\n"
      << "while true; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done\n"
      << "echo \"run ended rc=$rc preempted=$preempted\"\n"
      << "[ $preempted = 1 ] && scontrol requeue $SLURM_JOB_ID\n"
      << "exit $rc\n";
  Process sbatch({"sbatch", "-N2", "--wait", "--open-mode=append", "--requeue",
                  "--chdir=" + cluster.dir().path(), "-o", out, script},
                 cluster.env(jobEnv()));
  REQUIRE(waitUntil([&] { return readFile(out).find("[RANK 1] Epoch 1 |") != std::string::npos; },
                    240s));
  auto job_id = run({"squeue", "-h", "-o", "%i"}, cluster.env(), 30s);
  REQUIRE(job_id.exit_code == 0);
  auto notice = run({"scancel", "--signal=USR1", "--batch", trim(job_id.out)}, cluster.env(), 30s);
  REQUIRE(notice.exit_code == 0);
  auto done = sbatch.wait(400s);
  const std::string output = readFile(out);
  INFO("job output:\n" << output);
  REQUIRE(done.has_value());
  CHECK(done->exit_code == 0);
  CHECK_THAT(output, Catch::Contains("stopped by checkpoint signal"));
  CHECK_THAT(output, Catch::Contains("run ended rc=0 preempted=1"));
  CHECK_THAT(output, Catch::Contains("Resuming training from snapshot at Epoch"));
  CHECK_THAT(output, Catch::Contains("[RANK 1] Epoch 39 |"));
}

}  // namespace

TEST_CASE("ddprun slurm runs a PyTorch gloo job with ranks 0-3 across both nodes", "[slurm][e2e]") {
  allreduceAcrossBothNodes(Mode::kDdprunSlurm);
}

TEST_CASE("the API's srun command and step flags run a PyTorch gloo job across both nodes",
          "[slurm][e2e]") {
  allreduceAcrossBothNodes(Mode::kApiGlue);
}

TEST_CASE("ddprun slurm runs train with world size 4 to completion", "[slurm][e2e]") {
  trainAcrossBothNodes(Mode::kDdprunSlurm);
}

TEST_CASE("the API's srun command and step flags run train to completion", "[slurm][e2e]") {
  trainAcrossBothNodes(Mode::kApiGlue);
}

TEST_CASE("plain srun of ddprun inside an allocation derives the rendezvous itself",
          "[slurm][e2e][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  SlurmCluster cluster;
  DDPRUN_REQUIRE_SLURM(cluster);
  auto job = submitAndWait(cluster, "srun_ddprun",
                           "exec srun --ntasks-per-node=1 '" + ddprunBin() +
                               "' --nproc_per_node=2 '" + allreduceScript() + "'");
  INFO("job output:\n" << job.output);
  CHECK(verdict(job) == "exit 0");
  CHECK(allreduceLines(job.output) == std::set<std::string>{"0/4", "1/4", "2/4", "3/4"});
}

TEST_CASE("a ddprun slurm job survives losing a node's agent within --nnodes 1:2", "[slurm][e2e]") {
  survivesALostNode(Mode::kDdprunSlurm);
}

TEST_CASE("a job from the API's srun command survives losing a node's agent within 1:2",
          "[slurm][e2e]") {
  survivesALostNode(Mode::kApiGlue);
}

TEST_CASE("a preemption notice checkpoints the workers and the requeued job resumes",
          "[slurm][e2e]") {
  preemptedJobResumesAfterRequeue(Mode::kDdprunSlurm);
}

TEST_CASE("with the API's srun command a preemption notice checkpoints and the requeue resumes",
          "[slurm][e2e]") {
  preemptedJobResumesAfterRequeue(Mode::kApiGlue);
}
