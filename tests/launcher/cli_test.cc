#include "ddprun/launcher/cli.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstdlib>
#include <fstream>

#include "ddprun/common/strings.h"

using namespace ddprun;
using namespace ddprun::launcher;
using Env = std::map<std::string, std::string>;

namespace {

// A scratch dir with a script, an executable and a non-executable file.
struct Files {
  Files() {
    char templ[] = "/tmp/ddprun_cli_XXXXXX";
    dir = mkdtemp(templ);
    script = dir + "/train.py";
    std::ofstream(script) << "print('hi')\n";
    exe = dir + "/prog";
    std::ofstream(exe) << "#!/bin/sh\n";
    chmod(exe.c_str(), 0755);
    plain = dir + "/data.txt";
    std::ofstream(plain) << "x";
    python = dir + "/python3";
    std::ofstream(python) << "#!/bin/sh\n";
    chmod(python.c_str(), 0755);
  }
  ~Files() { std::system(("rm -rf " + dir).c_str()); }
  Env env() const { return {{"PATH", dir + ":/usr/bin:/bin"}}; }
  std::string dir, script, exe, plain, python;
};

StatusOr<CliResult> parse(std::vector<std::string> args, Env env, HostFacts host = {8, 0}) {
  return parseCommandLine(args, env, host);
}

std::string errorOf(std::vector<std::string> args, Env env, HostFacts host = {8, 0}) {
  auto r = parse(std::move(args), std::move(env), host);
  if (r.isOk()) return "<ok>";
  return r.status().message();
}

}  // namespace

TEST_CASE("torchrun's defaults apply when no flag is given", "[launcher]") {
  Files f;
  auto r = parse({f.exe}, f.env());
  REQUIRE(r.isOk());
  const auto& c = r->config;
  CHECK(c.min_nodes == 1);
  CHECK(c.max_nodes == 1);
  CHECK(c.nproc_per_node == 1);
  CHECK(c.rdzv_backend == agent::RendezvousBackend::kStatic);
  CHECK(c.rdzv_id == "none");
  CHECK(c.max_restarts == 0);
  CHECK(c.role == "default");
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.master_port == 29500);
  CHECK(c.shutdown_timeout == 30.0);
  CHECK(c.heartbeat_timeout == 300.0);
  CHECK(c.signals_to_handle == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(c.worker_argv == std::vector<std::string>{f.exe});
  CHECK_FALSE(c.set_omp_num_threads);
  CHECK(r->notices.empty());
}

TEST_CASE("every flag is accepted with underscores, dashes and = or a separate value",
          "[launcher]") {
  Files f;
  auto r = parse({"--nnodes=1",
                  "--nproc_per_node",
                  "3",
                  "--rdzv-backend=static",
                  "--rdzv_id=job7",
                  "--max-restarts=4",
                  "--monitor_interval=0.5",
                  "--start-method",
                  "spawn",
                  "--role=trainer",
                  "--log-dir",
                  "/tmp/logs",
                  "-r",
                  "3",
                  "-t0:1,1:2",
                  "--local_ranks_filter=0,2",
                  "--node-rank=0",
                  "--master_addr=10.0.0.1",
                  "--master-port=1234",
                  "--local-addr=127.0.0.2",
                  "--shutdown_timeout=2.5",
                  "--signals-to-handle=SIGTERM,USR1",
                  "--log_line_prefix_template=${rank}|",
                  "--exit-barrier-timeout=9",
                  "--heartbeat_timeout=12.5",
                  "--snapshot-dir=/snap",
                  "--rdzv_conf=join_timeout=5",
                  f.exe,
                  "--lr",
                  "0.1"},
                 f.env());
  REQUIRE(r.isOk());
  const auto& c = r->config;
  CHECK(c.nproc_per_node == 3);
  CHECK(c.rdzv_id == "job7");
  CHECK(c.max_restarts == 4);
  CHECK(c.monitor_interval == 0.5);
  CHECK(c.role == "trainer");
  CHECK(c.log_dir == "/tmp/logs");
  CHECK(c.redirects.all == agent::StdStreams::kAll);
  CHECK(c.tee.forRank(0) == agent::StdStreams::kOut);
  CHECK(c.tee.forRank(1) == agent::StdStreams::kErr);
  CHECK(c.tee.forRank(2) == agent::StdStreams::kNone);
  CHECK(*c.local_ranks_filter == std::set<int>{0, 2});
  CHECK(c.master_addr == "10.0.0.1");
  CHECK(c.master_port == 1234);
  CHECK(c.master_port_given);
  CHECK(c.local_addr == "127.0.0.2");
  CHECK(c.shutdown_timeout == 2.5);
  CHECK(c.signals_to_handle == std::vector<int>{SIGTERM, SIGUSR1});
  CHECK(c.log_line_prefix_template == "${rank}|");
  CHECK(c.exit_barrier_timeout == 9.0);
  CHECK(c.heartbeat_timeout == 12.5);
  CHECK(c.snapshot_dir == "/snap");
  CHECK(c.rdzv_conf.join_timeout == std::chrono::seconds(5));
  // Everything after the program belongs to it, even what looks like our flags.
  CHECK(c.worker_argv == std::vector<std::string>{f.exe, "--lr", "0.1"});
  CHECK(r->notices.size() == 1);  // OMP_NUM_THREADS
  CHECK(c.set_omp_num_threads);
}

TEST_CASE("PET_ variables are defaults that the command line overrides", "[launcher]") {
  Files f;
  Env env = f.env();
  env["PET_NPROC_PER_NODE"] = "2";
  env["PET_MAX_RESTARTS"] = "5";
  env["PET_STANDALONE"] = "1";
  auto r = parse({"--max_restarts=1", f.exe}, env);
  REQUIRE(r.isOk());
  CHECK(r->config.nproc_per_node == 2);
  CHECK(r->config.max_restarts == 1);
  CHECK(r->config.standalone);
  env["PET_HEARTBEAT_TIMEOUT"] = "0";
  CHECK(parse({f.exe}, env)->config.heartbeat_timeout == 0.0);  // 0 disables hang detection
  CHECK(parse({"--heartbeat-timeout", "7", f.exe}, env)->config.heartbeat_timeout == 7.0);
  env["PET_HEARTBEAT_TIMEOUT"] = "soon";
  CHECK(errorOf({f.exe}, env) ==
        "argument PET_HEARTBEAT_TIMEOUT: expected a number of seconds >= 0 (0 disables hang "
        "detection, at most 1e9), got 'soon'");
  env.erase("PET_HEARTBEAT_TIMEOUT");
  env["PET_NNODES"] = "x";
  CHECK(errorOf({f.exe}, env) ==
        "argument PET_NNODES: expected N or MIN:MAX with 0 < MIN <= MAX, got 'x'");
}

TEST_CASE("standalone mode uses the c10d backend on localhost:0 with a fresh run id",
          "[launcher]") {
  Files f;
  auto a = parse({"--standalone", f.exe}, f.env());
  auto b = parse({"--standalone", f.exe}, f.env());
  REQUIRE(a.isOk());
  REQUIRE(b.isOk());
  CHECK(a->config.standalone);
  CHECK(a->config.rdzv_backend == agent::RendezvousBackend::kC10d);
  CHECK(a->config.rdzv_endpoint == "localhost:0");
  CHECK(a->config.rdzv_id.size() == 36);
  CHECK(a->config.rdzv_id != b->config.rdzv_id);
}

TEST_CASE("nproc-per-node accepts cpu, gpu and auto from the host facts", "[launcher]") {
  Files f;
  CHECK(parse({"--nproc-per-node=cpu", f.exe}, f.env(), {6, 0})->config.nproc_per_node == 6);
  CHECK(parse({"--nproc-per-node=auto", f.exe}, f.env(), {6, 0})->config.nproc_per_node == 6);
  CHECK(parse({"--nproc-per-node=auto", f.exe}, f.env(), {6, 2})->config.nproc_per_node == 2);
  CHECK(parse({"--nproc-per-node=gpu", f.exe}, f.env(), {6, 4})->config.nproc_per_node == 4);
  CHECK(errorOf({"--nproc-per-node=gpu", f.exe}, f.env(), {6, 0}).find("has none") !=
        std::string::npos);
}

TEST_CASE("nnodes and endpoints parse every documented form", "[launcher]") {
  Files f;
  auto r = parse({"--nnodes=1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=node1", f.exe}, f.env());
  REQUIRE(r.isOk());
  CHECK(r->config.min_nodes == 1);
  CHECK(r->config.max_nodes == 3);
  CHECK(r->config.rdzv_endpoint == "node1:29400");
  auto v6 = parse({"--rdzv-backend=grpc", "--rdzv-endpoint=[::1]:1234", f.exe}, f.env());
  REQUIRE(v6.isOk());
  CHECK(v6->config.rdzv_backend == agent::RendezvousBackend::kC10d);
  CHECK(v6->config.rdzv_endpoint == "[::1]:1234");
  CHECK(parse({"--rdzv-backend=c10d", "--rdzv-endpoint=[::1]", f.exe}, f.env())
            ->config.rdzv_endpoint == "[::1]:29400");
}

TEST_CASE("malformed values are usage errors naming the flag and the accepted form", "[launcher]") {
  Files f;
  const std::string x = f.exe;
  const std::string cert = f.dir + "/cert.pem";
  std::ofstream(cert) << "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--nnodes=0", x}, "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX, got '0'"},
      {{"--nnodes=3:1", x},
       "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX, got '3:1'"},
      {{"--nnodes=1:2:3", x},
       "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX, got '1:2:3'"},
      {{"--nnodes=a", x}, "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX, got 'a'"},
      {{"--nproc-per-node=0", x},
       "argument --nproc-per-node: expected an integer >= 1, or cpu, gpu, auto, got '0'"},
      {{"--nproc_per_node=two", x},
       "argument --nproc-per-node: expected an integer >= 1, or cpu, gpu, auto, got 'two'"},
      {{"--max-restarts=-1", x}, "argument --max-restarts: expected an integer >= 0, got '-1'"},
      {{"--monitor-interval=0", x},
       "argument --monitor-interval: expected a number of seconds > 0, got '0'"},
      {{"--shutdown-timeout=soon", x},
       "argument --shutdown-timeout: expected a number of seconds >= 0, got 'soon'"},
      {{"--heartbeat-timeout=-1", x},
       "argument --heartbeat-timeout: expected a number of seconds >= 0 (0 disables hang "
       "detection, at most 1e9), got '-1'"},
      {{"--heartbeat_timeout=ten", x},
       "argument --heartbeat-timeout: expected a number of seconds >= 0 (0 disables hang "
       "detection, at most 1e9), got 'ten'"},
      {{"--heartbeat-timeout=inf", x},
       "argument --heartbeat-timeout: expected a number of seconds >= 0 (0 disables hang "
       "detection, at most 1e9), got 'inf'"},
      {{"--heartbeat-timeout=1e12", x},
       "argument --heartbeat-timeout: expected a number of seconds >= 0 (0 disables hang "
       "detection, at most 1e9), got '1e12'"},
      {{"--heartbeat-timeout=", x},
       "argument --heartbeat-timeout: expected a number of seconds >= 0 (0 disables hang "
       "detection, at most 1e9), got ''"},
      {{"--heartbeat-timeout"}, "argument --heartbeat-timeout: expected one argument (SECONDS)"},
      {{"--master-port=70000", x},
       "argument --master-port: expected a port number in 1-65535, got '70000'"},
      {{"--redirects=4", x},
       "argument --redirects: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local "
       "rank like 0:3,1:1, got '4'"},
      {{"-t", "0:9", x},
       "argument -t: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank like "
       "0:3,1:1, got '0:9'"},
      {{"--tee=a:1", x},
       "argument --tee: expected 0-3, or <local_rank>:<0-3> pairs separated by commas like "
       "0:3,1:1, got 'a:1'"},
      {{"--local-ranks-filter=0,x", x},
       "argument --local-ranks-filter: expected local ranks separated by commas, like 0,1, got "
       "'0,x'"},
      {{"--signals-to-handle=SIGFOO", x},
       "argument --signals-to-handle: expected signal names separated by commas, like "
       "SIGTERM,SIGINT,SIGUSR1, got 'SIGFOO'"},
      {{"--rdzv-backend=zookeeper", x},
       "argument --rdzv-backend: expected static, c10d or grpc, got 'zookeeper'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=host:99999", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535, got "
       "'host:99999'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=::1:5", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535 "
       "(bracket IPv6 addresses), got '::1:5'"},
      {{"--rdzv-backend=c10d", x},
       "argument --rdzv-endpoint: the c10d backend needs HOST[:PORT] of the rendezvous"},
      {{"--rdzv-conf=join_timeout", x},
       "argument --rdzv-conf: expected <key>=<value> pairs separated by commas, got "
       "'join_timeout'"},
      {{"--rdzv-conf=colour=blue", x},
       "argument --rdzv-conf: unknown key 'colour' (accepted: join_timeout, last_call_timeout, "
       "close_timeout, heartbeat_interval, heartbeat_misses, is_host, read_timeout, token_file, "
       "timeout, failure_grace, tls_cert, tls_key, tls_ca)"},
      {{"--rdzv-conf=join_timeout=-3", x},
       "argument --rdzv-conf: join_timeout must be a number of seconds > 0, got '-3'"},
      {{"--rdzv-conf=is_host=maybe", x},
       "argument --rdzv-conf: is_host must be auto, true or false, got 'maybe'"},
      {{"--rdzv-conf=tls_ca=" + f.dir + "/missing-ca.pem", x},
       "argument --rdzv-conf: tls_ca: cannot read '" + f.dir +
           "/missing-ca.pem' (expected a PEM certificate)"},
      {{"--rdzv-conf=tls_ca=" + cert + ",tls_cert=" + cert, x},
       "argument --rdzv-conf: tls_cert=" + cert +
           " needs tls_key= too (the certificate's private "
           "key)"},
      {{"--rdzv-conf=tls_ca=" + f.plain, x},
       "argument --rdzv-conf: tls_ca: '" + f.plain + "' is not a PEM certificate"},
      {{"--rdzv-conf=token_file=" + f.dir + "/missing-token", x},
       "argument --rdzv-conf: token_file: cannot read " + f.dir + "/missing-token"},
      {{"--rdzv-conf=heartbeat_misses=0", x},
       "argument --rdzv-conf: heartbeat_misses must be an integer from 1 to 1000000, got '0'"},
      {{"--nnodes=1:2", x},
       "argument --nnodes: the static rendezvous needs a fixed number of nodes, got 1:2 (use "
       "--rdzv-backend=c10d for elastic MIN:MAX)"},
      {{"--nnodes=2", "--node-rank=2", x}, "argument --node-rank: must be below --nnodes=2, got 2"},
      {{"--standalone", "--nnodes=2", x},
       "argument --standalone: runs a single node, but --nnodes asks for 2 (drop one of them)"},
      {{"--standalone=1", x}, "argument --standalone: takes no value"},
      {{"--start-method=thread", x},
       "argument --start-method: expected spawn, fork or forkserver, got 'thread'"},
      {{"--rdzv-backend=etcd-v3", x},
       "argument --rdzv-backend: the etcd backends are not supported yet; use static or c10d"},
      {{"--bogus", x}, "unrecognized argument: --bogus (see ddprun --help)"},
      {{"-x", x}, "unrecognized argument: -x (see ddprun --help)"},
      {{"--n", x},
       "ambiguous option: --n could match --nnodes, --nproc-per-node, --no-python, --node-rank"},
      {{"--nnodes"}, "argument --nnodes: expected one argument (MIN:MAX)"},
      {{"--nproc-per-node=2"},
       "the following arguments are required: training_script (the program to run)"},
      {{"-m", "--no-python", "mod"}, "--no-python and -m/--module cannot be used together"},
  };
  for (const auto& c : cases) {
    INFO(join(c.args, " "));
    CHECK(errorOf(c.args, f.env()) == c.expected);
  }
}

TEST_CASE("rdzv-conf accepts every key of the rendezvous' parser and keeps the pairs for the agent",
          "[launcher]") {
  Files f;
  const std::string cert = f.dir + "/cert.pem", key = f.dir + "/key.pem";
  std::ofstream(cert) << "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  std::ofstream(key) << "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n";
  auto r = parse({"--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400",
                  "--rdzv-conf= timeout=20 ,failure_grace=0,last_call_timeout=0,tls_ca=" + cert +
                      ",tls_cert=" + cert + ",tls-key=" + key + ",is_host=false",
                  f.exe},
                 f.env());
  REQUIRE(r.isOk());
  // Parsed once, here: the agent takes the typed settings (files already read).
  const auto& conf = r->config.rdzv_conf;
  CHECK(conf.join_timeout == std::chrono::seconds(20));
  CHECK(conf.failure_grace == std::chrono::seconds(0));
  CHECK(conf.run.last_call_timeout == std::chrono::seconds(0));
  CHECK(conf.tls_ca_file == cert);
  CHECK(conf.tls_ca_pem.find("BEGIN CERTIFICATE") != std::string::npos);
  CHECK(conf.tls_cert_pem.find("BEGIN CERTIFICATE") != std::string::npos);
  CHECK(conf.tls_key_pem.find("PRIVATE KEY") != std::string::npos);
  CHECK(conf.is_host == rendezvous::IsHost::kFalse);
  // From the environment, the error names PET_RDZV_CONF.
  auto env = f.env();
  env["PET_RDZV_CONF"] = "tls_cert=" + cert + ",tls_ca=" + cert;
  CHECK(errorOf({f.exe}, env) == "argument PET_RDZV_CONF: tls_cert=" + cert +
                                     " needs tls_key= too (the certificate's private key)");
}

TEST_CASE("the agent gets --rdzv-conf parsed for the --nnodes range, defaults included",
          "[launcher]") {
  Files f;
  auto none = parse({"--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h", f.exe}, f.env());
  REQUIRE(none.isOk());
  CHECK(none->config.rdzv_conf.run.min_nodes == 2u);
  CHECK(none->config.rdzv_conf.run.max_nodes == 4u);
  CHECK(none->config.rdzv_conf.run.heartbeat_interval == rendezvous::kDefaultHeartbeatInterval);
  CHECK(none->config.rdzv_conf.join_timeout == std::chrono::seconds(600));
  auto given = parse({"--rdzv-conf=heartbeat_interval=2", "--nnodes=3", "--rdzv-backend=c10d",
                      "--rdzv-endpoint=h", f.exe},
                     f.env());
  REQUIRE(given.isOk());
  CHECK(given->config.rdzv_conf.run.min_nodes == 3u);
  CHECK(given->config.rdzv_conf.run.max_nodes == 3u);
  CHECK(given->config.rdzv_conf.run.heartbeat_interval == std::chrono::seconds(2));
  CHECK(given->config.rdzv_conf.failure_grace == std::chrono::seconds(4));
  // A default AgentConfig carries what an empty --rdzv-conf gives for one node.
  auto empty = rendezvous::parseRendezvousConf({}, 1, 1);
  REQUIRE(empty.isOk());
  const agent::AgentConfig d;
  CHECK(d.rdzv_conf.run.heartbeat_interval == empty->run.heartbeat_interval);
  CHECK(d.rdzv_conf.run.heartbeat_misses == empty->run.heartbeat_misses);
  CHECK(d.rdzv_conf.failure_grace == empty->failure_grace);
  CHECK(d.rdzv_conf.join_timeout == empty->join_timeout);
}

TEST_CASE("a unique prefix of a flag is accepted as argparse does", "[launcher]") {
  Files f;
  auto r = parse({"--nproc=2", "--max_rest", "3", f.exe}, f.env());
  REQUIRE(r.isOk());
  CHECK(r->config.nproc_per_node == 2);
  CHECK(r->config.max_restarts == 3);
}

TEST_CASE("programs resolve: .py under python3 -u, -m module, --no-python, executables",
          "[launcher]") {
  Files f;
  auto py = parse({f.script, "a"}, f.env());
  REQUIRE(py.isOk());
  CHECK(py->config.worker_argv == std::vector<std::string>{f.python, "-u", f.script, "a"});
  Env with_exec = f.env();
  with_exec["PYTHON_EXEC"] = f.exe;
  CHECK(parse({f.script}, with_exec)->config.worker_argv[0] == f.exe);
  auto mod = parse({"-m", "pkg.train", "x"}, f.env());
  REQUIRE(mod.isOk());
  CHECK(mod->config.worker_argv ==
        std::vector<std::string>{f.python, "-u", "-m", "pkg.train", "x"});
  auto direct = parse({"--no-python", "prog"}, f.env());  // found on PATH
  REQUIRE(direct.isOk());
  CHECK(direct->config.worker_argv == std::vector<std::string>{f.exe});
  CHECK(parse({"--", f.exe, "--nnodes=5"}, f.env())->config.worker_argv ==
        std::vector<std::string>{f.exe, "--nnodes=5"});
}

TEST_CASE("a missing or non-executable program is a clear error before anything starts",
          "[launcher]") {
  Files f;
  CHECK(errorOf({f.dir + "/nothere.py"}, f.env()) ==
        "training script '" + f.dir + "/nothere.py' does not exist");
  CHECK(errorOf({"no-such-program"}, f.env()) ==
        "program 'no-such-program' not found (looked on PATH and as a path)");
  CHECK(errorOf({f.plain}, f.env()) == "program '" + f.plain + "' is not an executable file");
  Env no_python = {{"PATH", "/nonexistent"}};
  CHECK(errorOf({f.script}, no_python) ==
        "cannot find the Python interpreter 'python3' (on PATH, or set PYTHON_EXEC to its path)");
}

TEST_CASE("help describes every flag", "[launcher]") {
  Files f;
  auto r = parse({"--nnodes=2", "--help"}, f.env());
  REQUIRE(r.isOk());
  CHECK(r->show_help);
  const std::string help = helpText();
  for (const char* flag : {"--nnodes",           "--nproc-per-node",
                           "--rdzv-backend",     "--rdzv-endpoint",
                           "--rdzv-id",          "--rdzv-conf",
                           "--standalone",       "--max-restarts",
                           "--monitor-interval", "--role",
                           "-m, --module",       "--no-python",
                           "--log-dir",          "-r, --redirects",
                           "-t, --tee",          "--local-ranks-filter",
                           "--node-rank",        "--master-addr",
                           "--master-port",      "--local-addr",
                           "--shutdown-timeout", "--signals-to-handle",
                           "--heartbeat-timeout"}) {
    INFO(flag);
    CHECK(help.find(flag) != std::string::npos);
  }
}
