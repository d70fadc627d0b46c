#include "ddprun/slurm/launch.h"

#include <catch2/catch.hpp>

#include "ddprun/common/strings.h"

using namespace ddprun;
using namespace ddprun::slurm;

namespace {

using Args = std::vector<std::string>;

// NodeAddr as a cluster would have it: names differ from addresses; nodes may share one.
struct FakeSlurm {
  std::map<std::string, std::string> addrs = {{"gpu01", "10.0.0.11"}, {"gpu02", "10.0.0.12"},
                                              {"gpu03", "10.0.0.13"}, {"n1", "127.0.0.1"},
                                              {"n2", "127.0.0.1"},    {"v6", "fd00::7"}};
  std::vector<std::string> asked;
  AddressLookup lookup() {
    return [this](const std::string& node) -> StatusOr<std::string> {
      asked.push_back(node);
      auto it = addrs.find(node);
      if (it == addrs.end()) return notFound("no node '" + node + "'");
      return it->second;
    };
  }
};

// The batch script's environment of a 3-node job.
Env batchEnv() {
  return {
      {"SLURM_JOB_ID", "4242"}, {"SLURM_JOB_NODELIST", "gpu[01-03]"}, {"SLURM_JOB_NUM_NODES", "3"},
      {"SLURM_NNODES", "3"},    {"SLURM_NODELIST", "gpu[01-03]"},     {"SLURM_NODEID", "0"},
      {"SLURM_PROCID", "0"},    {"SLURMD_NODENAME", "gpu01"},         {"SLURM_NTASKS", "6"},
      {"PATH", "/usr/bin"}};
}

// The environment of srun task `node_id` of step 0 of that job (one task per node).
Env stepEnv(int node_id) {
  Env env = batchEnv();
  env["SLURM_STEP_ID"] = "0";
  env["SLURM_STEPID"] = "0";
  env["SLURM_STEP_NODELIST"] = "gpu[01-03]";
  env["SLURM_STEP_NUM_NODES"] = "3";
  env["SLURM_STEP_NUM_TASKS"] = "3";
  env["SLURM_NTASKS"] = "3";
  env["SLURM_NODEID"] = std::to_string(node_id);
  env["SLURM_PROCID"] = std::to_string(node_id);
  env["SLURMD_NODENAME"] = "gpu0" + std::to_string(node_id + 1);
  return env;
}

const std::string kSignals = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1";

}  // namespace

TEST_CASE("ddprun slurm runs one agent per node of the allocation with the rendezvous flags",
          "[slurm]") {
  FakeSlurm slurm;
  auto plan = srunCommand({"--nproc_per_node=4", "train", "50", "10"}, batchEnv(),
                          "/opt/ddprun/bin/ddprun", slurm.lookup());
  REQUIRE(plan.isOk());
  CHECK(plan->argv == Args{"srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                           "--kill-on-bad-exit=0", "--whole", "/opt/ddprun/bin/ddprun",
                           "--nnodes=3", "--rdzv-backend=c10d", "--rdzv-id=4242",
                           "--rdzv-endpoint=10.0.0.11:29400", "--nproc_per_node=4", "train", "50",
                           "10"});
  CHECK(plan->ddprun_args == Args{"--nnodes=3", "--rdzv-backend=c10d", "--rdzv-id=4242",
                                  "--rdzv-endpoint=10.0.0.11:29400", "--nproc_per_node=4", "train",
                                  "50", "10"});
  CHECK(slurm.asked == Args{"gpu01"});  // the first node's NodeAddr, not its name
}

TEST_CASE("ddprun slurm keeps the user's --nnodes range, rdzv id and endpoint", "[slurm]") {
  FakeSlurm slurm;
  auto plan = srunCommand({"--nnodes", "2:3", "--rdzv_id=mine", "--rdzv-endpoint", "rdzv.host:5000",
                           "--no-python", "/bin/prog", "--nnodes=9"},
                          batchEnv(), "ddprun", slurm.lookup());
  REQUIRE(plan.isOk());
  CHECK(plan->ddprun_args == Args{"--rdzv-backend=c10d", "--nnodes", "2:3", "--rdzv_id=mine",
                                  "--rdzv-endpoint", "rdzv.host:5000", "--no-python", "/bin/prog",
                                  "--nnodes=9"});
  CHECK(slurm.asked.empty());

  // PET_<NAME> counts as given, as in the launcher.
  Env env = batchEnv();
  env["PET_NNODES"] = "1:3";
  auto pet = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE(pet.isOk());
  CHECK(pet->ddprun_args.front() == "--rdzv-backend=c10d");
}

TEST_CASE("ddprun slurm passes --srun-args through after its own srun options", "[slurm]") {
  FakeSlurm slurm;
  auto plan = srunCommand(
      {"--srun-args=--exclusive --time=10 --job-name='my job' -l", "--nproc-per-node", "2", "x.py"},
      batchEnv(), "ddprun", slurm.lookup());
  REQUIRE(plan.isOk());
  CHECK(plan->argv == Args{"srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                           "--kill-on-bad-exit=0", "--whole", "--exclusive", "--time=10",
                           "--job-name=my job", "-l", "ddprun", "--nnodes=3", "--rdzv-backend=c10d",
                           "--rdzv-id=4242", "--rdzv-endpoint=10.0.0.11:29400", "--nproc-per-node",
                           "2", "x.py"});

  SECTION("-N K runs on K nodes and leaves the endpoint to the tasks") {
    auto two = srunCommand({"--srun-args", "-N 2", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
    REQUIRE(two.isOk());
    CHECK(two->argv == Args{"srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                            "--kill-on-bad-exit=0", "--whole", "-N", "2", "ddprun", "--nnodes=2",
                            "--rdzv-backend=c10d", "--rdzv-id=4242", "x.py"});
  }
  SECTION("a node list leaves nnodes and the endpoint to the tasks") {
    auto listed =
        srunCommand({"--srun-args=-w gpu[02-03]", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
    REQUIRE(listed.isOk());
    CHECK(listed->argv == Args{"srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--whole",
                               "-w", "gpu[02-03]", "ddprun", "--rdzv-backend=c10d",
                               "--rdzv-id=4242", "x.py"});
  }
  SECTION("task counts are refused: ddprun starts the workers") {
    for (const char* bad : {"-n 8", "--ntasks=8", "--ntasks-per-node=2", "-n8"}) {
      auto refused = srunCommand({std::string("--srun-args=") + bad, "x.py"}, batchEnv(), "ddprun",
                                 slurm.lookup());
      REQUIRE_FALSE(refused.isOk());
      CHECK_THAT(refused.status().message(), Catch::Contains("one task per node"));
    }
  }
  SECTION("a node count beyond the allocation is refused") {
    auto refused =
        srunCommand({"--srun-args=--nodes=4", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
    REQUIRE_FALSE(refused.isOk());
    CHECK_THAT(refused.status().message(),
               Catch::Contains("-N/--nodes must be a node count from 1 to the allocation's 3, got "
                               "'4'"));
  }
  SECTION("an unterminated quote is refused") {
    auto refused =
        srunCommand({"--srun-args=--job-name='x", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
    REQUIRE_FALSE(refused.isOk());
    CHECK_THAT(refused.status().message(), Catch::Contains("unterminated ' (single quote)"));
  }
}

TEST_CASE("ddprun slurm --help asks for the help text, inside an allocation or not", "[slurm]") {
  FakeSlurm slurm;
  for (const Env& env : {Env{}, batchEnv()}) {
    auto help = srunCommand({"--nproc_per_node=2", "--help"}, env, "ddprun", slurm.lookup());
    REQUIRE(help.isOk());
    CHECK(help->show_help);
    CHECK(help->argv.empty());
  }
  // After the program, --help is the program's.
  auto program = srunCommand({"x.py", "--help"}, batchEnv(), "ddprun", slurm.lookup());
  REQUIRE(program.isOk());
  CHECK_FALSE(program->show_help);
  CHECK(program->argv.back() == "--help");
  CHECK_THAT(slurmHelpText(), Catch::Contains("usage: ddprun slurm"));
}

TEST_CASE("ddprun slurm outside an allocation says so", "[slurm]") {
  FakeSlurm slurm;
  auto plan = srunCommand({"x.py"}, {{"PATH", "/usr/bin"}}, "ddprun", slurm.lookup());
  REQUIRE_FALSE(plan.isOk());
  CHECK(plan.status().code() == StatusCode::kFailedPrecondition);
  CHECK(plan.status().message() ==
        "ddprun slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); use "
        "sbatch/salloc");
}

TEST_CASE("ddprun slurm with a malformed SLURM_JOB_NODELIST names the variable", "[slurm]") {
  FakeSlurm slurm;
  Env env = batchEnv();
  env["SLURM_JOB_NODELIST"] = "gpu[01-03";
  auto plan = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE_FALSE(plan.isOk());
  CHECK(plan.status().code() == StatusCode::kInvalidArgument);
  CHECK(plan.status().message() ==
        "ddprun slurm: SLURM_JOB_NODELIST is malformed: invalid hostlist 'gpu[01-03': '[' is "
        "never closed at character 4");

  env["SLURM_JOB_NODELIST"] = "gpu[01-02]";
  auto mismatch = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE_FALSE(mismatch.isOk());
  CHECK_THAT(mismatch.status().message(),
             Catch::Contains("SLURM_JOB_NUM_NODES=3 but SLURM_JOB_NODELIST names 2 nodes"));

  env.erase("SLURM_JOB_NODELIST");
  env.erase("SLURM_NODELIST");
  auto missing = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE_FALSE(missing.isOk());
  CHECK_THAT(missing.status().message(), Catch::Contains("SLURM_JOB_NODELIST is not set"));
}

TEST_CASE("ddprun slurm refuses what cannot work across the allocation", "[slurm]") {
  FakeSlurm slurm;
  auto no_program = srunCommand({"--nproc_per_node=2"}, batchEnv(), "ddprun", slurm.lookup());
  REQUIRE_FALSE(no_program.isOk());
  CHECK_THAT(no_program.status().message(), Catch::Contains("missing the training program"));

  auto standalone = srunCommand({"--standalone", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
  REQUIRE_FALSE(standalone.isOk());
  CHECK_THAT(standalone.status().message(), Catch::Contains("--standalone is single-node"));

  auto backend =
      srunCommand({"--rdzv-backend=static", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
  REQUIRE_FALSE(backend.isOk());
  CHECK_THAT(backend.status().message(), Catch::Contains("ddprun slurm uses c10d, got 'static'"));

  auto too_many = srunCommand({"--nnodes=4:8", "x.py"}, batchEnv(), "ddprun", slurm.lookup());
  REQUIRE_FALSE(too_many.isOk());
  CHECK_THAT(too_many.status().message(),
             Catch::Contains("at least 4 nodes asked for, but the step runs on 3"));

  Env env = batchEnv();
  env["SLURM_JOB_NODELIST"] = "gpu[07-09]";
  auto lookup_fails = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE_FALSE(lookup_fails.isOk());
  CHECK(lookup_fails.status().message() == "ddprun slurm: no node 'gpu07'");
}

TEST_CASE("the rendezvous port is DDPRUN_SLURM_PORT, and IPv6 addresses are bracketed", "[slurm]") {
  FakeSlurm slurm;
  Env env = batchEnv();
  env["DDPRUN_SLURM_PORT"] = "31000";
  env["SLURM_JOB_NODELIST"] = "v6,gpu[01-02]";
  auto plan = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE(plan.isOk());
  CHECK(std::find(plan->argv.begin(), plan->argv.end(), "--rdzv-endpoint=[fd00::7]:31000") !=
        plan->argv.end());

  env["DDPRUN_SLURM_PORT"] = "70000";
  auto bad = srunCommand({"x.py"}, env, "ddprun", slurm.lookup());
  REQUIRE_FALSE(bad.isOk());
  CHECK_THAT(bad.status().message(),
             Catch::Contains("DDPRUN_SLURM_PORT='70000' is not a port (1-65535)"));
  CHECK(joinHostPort("host", 1) == "host:1");
  CHECK(joinHostPort("[::1]", 2) == "[::1]:2");
}

TEST_CASE("inside an srun step each node derives the same rendezvous and its own address",
          "[slurm]") {
  FakeSlurm slurm;
  for (int node = 0; node < 3; ++node) {
    INFO("node " << node);
    auto step =
        stepArgs({"--nproc_per_node=4", "train.py", "--lr", "0.1"}, stepEnv(node), slurm.lookup());
    REQUIRE(step.isOk());
    CHECK(step->in_step);
    const Args derived = {"--nnodes=3",
                          "--rdzv-backend=c10d",
                          "--rdzv-id=4242",
                          "--rdzv-endpoint=10.0.0.11:29400",
                          std::string("--rdzv-conf=is_host=") + (node == 0 ? "true" : "false"),
                          "--local-addr=10.0.0.1" + std::to_string(node + 1),
                          kSignals};
    CHECK(step->added == derived);
    Args expected = derived;
    for (const char* a : {"--nproc_per_node=4", "train.py", "--lr", "0.1"}) expected.push_back(a);
    CHECK(step->args == expected);
  }
}

TEST_CASE("inside an srun step the flags the user gave are kept and not derived", "[slurm]") {
  FakeSlurm slurm;
  const Args user = {"--nnodes=2:3",
                     "--rdzv_endpoint",
                     "10.0.0.11:1234",
                     "--rdzv-id",
                     "x",
                     "--local-addr=me",
                     "--signals-to-handle=SIGTERM",
                     "--rdzv-conf",
                     "join_timeout=60",
                     "prog.py",
                     "--rdzv-id=not-ours"};
  auto step = stepArgs(user, stepEnv(1), slurm.lookup());
  REQUIRE(step.isOk());
  CHECK(step->in_step);
  // The endpoint is the first node's address, so that node alone hosts; is_host joins the
  // user's own --rdzv-conf instead of replacing it.
  CHECK(step->args == Args{"--rdzv-backend=c10d", "--nnodes=2:3", "--rdzv_endpoint",
                           "10.0.0.11:1234", "--rdzv-id", "x", "--local-addr=me",
                           "--signals-to-handle=SIGTERM", "--rdzv-conf",
                           "join_timeout=60,is_host=false", "prog.py", "--rdzv-id=not-ours"});
  CHECK(step->added == Args{"--rdzv-backend=c10d", "is_host=false (into your --rdzv-conf)"});

  SECTION("an inline --rdzv-conf= is merged too, an explicit is_host is left alone") {
    auto inl = stepArgs({"--rdzv-conf=join_timeout=60", "p.py"}, stepEnv(0), slurm.lookup());
    REQUIRE(inl.isOk());
    CHECK(std::find(inl->args.begin(), inl->args.end(),
                    "--rdzv-conf=join_timeout=60,is_host=true") != inl->args.end());
    auto own = stepArgs({"--rdzv-conf=is_host=false", "p.py"}, stepEnv(0), slurm.lookup());
    REQUIRE(own.isOk());
    CHECK(std::find(own->args.begin(), own->args.end(), "--rdzv-conf=is_host=false") !=
          own->args.end());
    CHECK(std::count_if(own->args.begin(), own->args.end(),
                        [](const std::string& a) { return startsWith(a, "--rdzv-conf"); }) == 1);
  }
  SECTION("PET_<NAME> variables count as given") {
    Env env = stepEnv(0);
    env["PET_NNODES"] = "1:3";
    env["PET_RDZV_CONF"] = "read_timeout=5";
    env["PET_LOCAL_ADDR"] = "here";
    auto pet = stepArgs({"p.py"}, env, slurm.lookup());
    REQUIRE(pet.isOk());
    CHECK(pet->args == Args{"--rdzv-backend=c10d", "--rdzv-id=4242",
                            "--rdzv-endpoint=10.0.0.11:29400",
                            "--rdzv-conf=read_timeout=5,is_host=true", kSignals, "p.py"});
  }
  SECTION("an endpoint on no node of the step leaves is_host to the agent") {
    auto outside =
        stepArgs({"--rdzv-endpoint=rdzv.example:29400", "p.py"}, stepEnv(0), slurm.lookup());
    REQUIRE(outside.isOk());
    for (const auto& a : outside->args) CHECK_FALSE(startsWith(a, "--rdzv-conf"));
  }
}

TEST_CASE("inside an srun step a malformed flag is passed on for the launcher to report",
          "[slurm]") {
  FakeSlurm slurm;
  // --rdzv-conf without its value, last: nothing is merged into a value that is not there.
  auto trailing = stepArgs({"--rdzv-conf"}, stepEnv(0), slurm.lookup());
  REQUIRE(trailing.isOk());
  CHECK(trailing->args.back() == "--rdzv-conf");
  CHECK(std::count(trailing->args.begin(), trailing->args.end(), "--rdzv-conf") == 1);
  auto unknown = stepArgs({"--bogus", "--n", "-x", "p.py"}, stepEnv(0), slurm.lookup());
  REQUIRE(unknown.isOk());
  CHECK(Args(unknown->args.end() - 4, unknown->args.end()) == Args{"--bogus", "--n", "-x", "p.py"});
}

TEST_CASE("nodes sharing one address still get exactly one rendezvous host", "[slurm]") {
  // Two slurmd on one host: n1 and n2 have the same NodeAddr.
  FakeSlurm slurm;
  int hosts = 0;
  for (int node = 0; node < 2; ++node) {
    Env env = {{"SLURM_JOB_ID", "7"},
               {"SLURM_JOB_NODELIST", "n[1-2]"},
               {"SLURM_JOB_NUM_NODES", "2"},
               {"SLURM_STEP_ID", "3"},
               {"SLURM_STEP_NODELIST", "n[1-2]"},
               {"SLURM_STEP_NUM_NODES", "2"},
               {"SLURM_STEP_NUM_TASKS", "2"},
               {"SLURM_NODEID", std::to_string(node)},
               {"SLURMD_NODENAME", node == 0 ? "n1" : "n2"}};
    // As `ddprun slurm` would start it: the endpoint is already given.
    auto step = stepArgs({"--rdzv-endpoint=127.0.0.1:29400", "p.py"}, env, slurm.lookup());
    REQUIRE(step.isOk());
    const bool is_host = std::find(step->args.begin(), step->args.end(),
                                   "--rdzv-conf=is_host=true") != step->args.end();
    const bool not_host = std::find(step->args.begin(), step->args.end(),
                                    "--rdzv-conf=is_host=false") != step->args.end();
    CHECK(is_host != not_host);
    hosts += is_host ? 1 : 0;
    CHECK(is_host == (node == 0));
  }
  CHECK(hosts == 1);
}

TEST_CASE("outside an srun step, or when opted out, the arguments are left alone", "[slurm]") {
  FakeSlurm slurm;
  const Args user = {"--nproc_per_node=2", "p.py"};
  auto none = stepArgs(user, {{"PATH", "/bin"}}, slurm.lookup());
  REQUIRE(none.isOk());
  CHECK_FALSE(none->in_step);
  CHECK(none->args == user);

  auto batch = stepArgs(user, batchEnv(), slurm.lookup());  // sbatch script: no SLURM_STEP_ID
  REQUIRE(batch.isOk());
  CHECK_FALSE(batch->in_step);

  Env interactive = stepEnv(0);
  interactive["SLURM_STEP_ID"] = "4294967290";  // salloc's interactive step
  auto inter = stepArgs(user, interactive, slurm.lookup());
  REQUIRE(inter.isOk());
  CHECK_FALSE(inter->in_step);

  Env off = stepEnv(0);
  off["DDPRUN_SLURM_AUTO"] = "0";
  auto disabled = stepArgs(user, off, slurm.lookup());
  REQUIRE(disabled.isOk());
  CHECK(disabled->args == user);

  for (const Args& opted : {Args{"--standalone", "p.py"}, Args{"--rdzv-backend", "static", "p.py"},
                            Args{"--rdzv_backend=static", "p.py"}}) {
    auto kept = stepArgs(opted, stepEnv(1), slurm.lookup());
    REQUIRE(kept.isOk());
    CHECK_FALSE(kept->in_step);
    CHECK(kept->args == opted);
  }
  CHECK(slurm.asked.empty());
}

TEST_CASE("inside an srun step, a bad environment or task layout is a clear error", "[slurm]") {
  FakeSlurm slurm;
  Env env = stepEnv(0);
  env["SLURM_STEP_NUM_TASKS"] = "6";
  auto layout = stepArgs({"p.py"}, env, slurm.lookup());
  REQUIRE_FALSE(layout.isOk());
  CHECK_THAT(layout.status().message(),
             Catch::Contains("the step runs 6 tasks on 3 nodes, but ddprun is one task per node"));

  env = stepEnv(0);
  env["SLURM_STEP_NODELIST"] = "gpu[01-03,]";
  auto list = stepArgs({"p.py"}, env, slurm.lookup());
  REQUIRE_FALSE(list.isOk());
  CHECK_THAT(list.status().message(),
             Catch::Contains("ddprun inside srun: SLURM_STEP_NODELIST is malformed: invalid "
                             "hostlist 'gpu[01-03,]': empty range in brackets at character 11"));

  env = stepEnv(0);
  env["SLURM_NODEID"] = "3";
  auto id = stepArgs({"p.py"}, env, slurm.lookup());
  REQUIRE_FALSE(id.isOk());
  CHECK_THAT(id.status().message(), Catch::Contains("SLURM_NODEID='3' is not an index"));

  env = stepEnv(2);
  env["SLURMD_NODENAME"] = "gpu99";
  auto addr = stepArgs({"p.py"}, env, slurm.lookup());
  REQUIRE_FALSE(addr.isOk());
  CHECK(addr.status().message() == "ddprun inside srun: no node 'gpu99'");

  env = stepEnv(0);
  env["DDPRUN_SLURM_AUTO"] = "maybe";
  CHECK_FALSE(stepArgs({"p.py"}, env, slurm.lookup()).isOk());
}

TEST_CASE("srun options split like a shell", "[slurm]") {
  auto words = splitShellWords(R"(  -l --job-name="a \"b\" c" 'x y'\ z "" e\ f)");
  REQUIRE(words.isOk());
  CHECK(*words == Args{"-l", "--job-name=a \"b\" c", "x y z", "", "e f"});
  CHECK(splitShellWords("")->empty());
  CHECK_FALSE(splitShellWords("\"open").isOk());
}
