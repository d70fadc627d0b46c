#include "ddprun/launcher/cli.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstdlib>
#include <fstream>

#include "ddprun/common/launch_flags.h"
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
        "argument PET_NNODES: expected N or MIN:MAX with 0 < MIN <= MAX <= 1000000, got 'x'");
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
      {{"--nnodes=0", x},
       "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX <= 1000000, got '0'"},
      {{"--nnodes=3:1", x},
       "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX <= 1000000, got '3:1'"},
      {{"--nnodes=1:2:3", x},
       "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX <= 1000000, got '1:2:3'"},
      {{"--nnodes=a", x},
       "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX <= 1000000, got 'a'"},
      {{"--nproc-per-node=0", x},
       "argument --nproc-per-node: expected an integer from 1 to 4096, or cpu, gpu, xpu, auto, got "
       "'0'"},
      {{"--nproc_per_node=two", x},
       "argument --nproc-per-node: expected an integer from 1 to 4096, or cpu, gpu, xpu, auto, got "
       "'two'"},
      {{"--max-restarts=-1", x},
       "argument --max-restarts: expected an integer from 0 to 1000000, got '-1'"},
      {{"--restart-mode=inplace", x},
       "argument --restart-mode: expected process or in-place, got 'inplace'"},
      {{"--restart-mode=", x}, "argument --restart-mode: expected process or in-place, got ''"},
      {{"--monitor-interval=0", x},
       "argument --monitor-interval: expected a number of seconds > 0, got '0'"},
      {{"--shutdown-timeout=soon", x},
       "argument --shutdown-timeout: expected a number of seconds >= 0, got 'soon'"},
      // Huge durations are refused, not wrapped (1e300 once killed after 0.05 s).
      {{"--shutdown-timeout=1e300", x},
       "argument --shutdown-timeout: expected a number of seconds >= 0 and at most 1e9, got "
       "'1e300'"},
      {{"--shutdown-timeout=9.3e9", x},
       "argument --shutdown-timeout: expected a number of seconds >= 0 and at most 1e9, got "
       "'9.3e9'"},
      {{"--exit-barrier-timeout=1e300", x},
       "argument --exit-barrier-timeout: expected a number of seconds >= 0 and at most 1e9, got "
       "'1e300'"},
      {{"--monitor-interval=1e10", x},
       "argument --monitor-interval: expected a number of seconds > 0 and at most 1e9, got "
       "'1e10'"},
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
       "SIGTERM,SIGINT,SIGUSR1 (of SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, "
       "SIGCONT, SIGWINCH, SIGPWR, SIGXCPU, SIGTSTP), got 'SIGFOO'"},
      {{"--rdzv-backend=zookeeper", x},
       "argument --rdzv-backend: expected static, c10d, grpc or etcd-v3, got 'zookeeper'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=host:99999", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535, got "
       "'host:99999'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=::1:5", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535 "
       "(bracket IPv6 addresses), got '::1:5'"},
      {{"--rdzv-backend=c10d", x},
       "argument --rdzv-endpoint: the c10d backend needs HOST[:PORT] of the rendezvous"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=:0", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535 "
       "(the host is missing), got ':0'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=a b:29400", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535, the "
       "host a name (letters, digits, '.', '-', '_') or an IPv4 address, got 'a b:29400'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=h\nx:1", x},
       "argument --rdzv-endpoint: expected HOST[:PORT] or [IPv6]:PORT with a port in 0-65535, the "
       "host a name (letters, digits, '.', '-', '_') or an IPv4 address, got 'h\\nx:1'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=[node1]:5", x},
       "argument --rdzv-endpoint: expected an IPv6 address in the brackets, got '[node1]:5'"},
      // A value flag followed by another flag: argparse's error, not a value of "--nnodes=2".
      {{"--master-addr", "--nnodes=2", x}, "argument --master-addr: expected one argument (ADDR)"},
      {{"--role", "--", x}, "argument --role: expected one argument (ROLE)"},
      {{"--local-addr=no such host", x},
       "argument --local-addr: expected a host name (letters, digits, '.', '-', '_') or an IP "
       "address, got 'no such host'"},
      {{"--master-addr=10.0.0.1/8", x},
       "argument --master-addr: expected a host name (letters, digits, '.', '-', '_') or an IP "
       "address, got '10.0.0.1/8'"},
      {{"--local-addr=[node1]", x},
       "argument --local-addr: expected a host name (letters, digits, '.', '-', '_') or an IP "
       "address, got '[node1]'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=h", "--rdzv-conf=heartbeat_interval=1e-9", x},
       "argument --rdzv-conf: heartbeat_interval must be at least 0.1 s, got '1e-9'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=node1:0", x},
       "argument --rdzv-endpoint: port 0 cannot be dialled; give the rendezvous' real port "
       "(HOST:PORT, default 29400), got 'node1:0'"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=[::1]:0", x},
       "argument --rdzv-endpoint: port 0 cannot be dialled; give the rendezvous' real port "
       "(HOST:PORT, default 29400), got '[::1]:0'"},
      {{"--rdzv-conf=join_timeout", x},
       "argument --rdzv-conf: expected <key>=<value> pairs separated by commas, got "
       "'join_timeout'"},
      {{"--rdzv-conf=join_timeout=-3", x},
       "argument --rdzv-conf: join_timeout must be a number of seconds > 0, got '-3'"},
      {{"--rdzv-conf=inplace_timeout=0", x},
       "argument --rdzv-conf: inplace_timeout must be a number of seconds > 0, got '0'"},
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
      {{"--rdzv-backend=etcd", x},
       "argument --rdzv-backend: 'etcd' is torchrun's etcd v2 backend (etcd 3.6 removed the v2 "
       "API); use --rdzv-backend=etcd-v3, which speaks etcd's v3 API"},
      {{"--rdzv-backend=etcd-v2", x},
       "argument --rdzv-backend: 'etcd-v2' is torchrun's etcd v2 backend (etcd 3.6 removed the v2 "
       "API); use --rdzv-backend=etcd-v3, which speaks etcd's v3 API"},
      {{"--rdzv-backend=etcd-v3", x},
       "argument --rdzv-endpoint: the etcd-v3 backend needs the etcd members, "
       "HOST[:PORT][,HOST[:PORT]...] (default port 2379)"},
      {{"--rdzv-backend=etcd-v3", "--rdzv-endpoint=h1:2379,,h2", x},
       "argument --rdzv-endpoint: the member list 'h1:2379,,h2' has an empty item; give "
       "HOST[:PORT][,HOST[:PORT]...]"},
      {{"--rdzv-backend=c10d", "--rdzv-endpoint=h1:2379,h2:2379", x},
       "argument --rdzv-endpoint: a comma list of members is for --rdzv-backend=etcd-v3; the c10d "
       "backend takes one HOST[:PORT], got 'h1:2379,h2:2379'"},
      {{"--rdzv-backend=etcd-v3", "--rdzv-endpoint=h1", "--rdzv-conf=protocol=ftp", x},
       "argument --rdzv-conf: protocol must be http or https (etcd-v3), got 'ftp'"},
      {{"--rdzv-backend=etcd-v3", "--rdzv-endpoint=h1", "--rdzv-conf=username=root", x},
       "argument --rdzv-conf: username=root needs password_file= (a file holding the etcd "
       "password)"},
      {{"--bogus", x}, "unrecognized argument: --bogus (see ddprun --help)"},
      {{"-x", x}, "unrecognized argument: -x (see ddprun --help)"},
      {{"--n", x},
       "ambiguous option: --n could match --nnodes, --nproc-per-node, --numa-binding, --no-python, "
       "--node-rank"},
      {{"--nnodes"}, "argument --nnodes: expected one argument (MIN:MAX)"},
      {{"--nproc-per-node=2"},
       "the following arguments are required: training_script (the program to run)"},
      {{"-m", "--no-python", "mod"}, "--no-python and -m/--module cannot be used together"},
      // The flags of torchrun 2.x and torch.distributed.launch added for issue 13.
      {{"--run-path=1", x}, "argument --run-path: takes no value"},
      {{"--run_path", "-m", "mod"}, "--run-path and -m/--module cannot be used together"},
      {{"--run-path", "--no-python", x}, "--run-path and --no-python cannot be used together"},
      {{"--run-path", f.dir + "/nothere.py"},
       "training script '" + f.dir + "/nothere.py' does not exist"},
      {{"--use-env=1", x}, "argument --use-env: takes no value"},
      {{"--use_env=true", x}, "argument --use-env: takes no value"},
      {{"--local-rank-arg=rank", x},
       "argument --local-rank-arg: expected local-rank (torch 2.x), local_rank (torch 1.x) or "
       "none, got 'rank'"},
      {{"--local_rank_arg=--local_rank", x},
       "argument --local-rank-arg: expected local-rank (torch 2.x), local_rank (torch 1.x) or "
       "none, got '--local_rank'"},
      {{"--local-rank-arg="},
       "argument --local-rank-arg: expected local-rank (torch 2.x), "
       "local_rank (torch 1.x) or none, got ''"},
      {{"--local-rank-arg"}, "argument --local-rank-arg: expected one argument (NAME)"},
      {{"--use-env", "--local-rank-arg=local_rank", x},
       "argument --local-rank-arg: asks for --local_rank=N, but --use-env passes the local rank "
       "only as LOCAL_RANK (drop one of them)"},
      {{"--virtual-local-rank=1", x}, "argument --virtual-local-rank: takes no value"},
      {{"--virtual_local_rank=yes", x}, "argument --virtual-local-rank: takes no value"},
      {{"--logs-specs=", x},
       "argument --logs-specs: expected the name of a LogsSpecs plug-in, got ''"},
      {{"--logs_specs"}, "argument --logs-specs: expected one argument (NAME)"},
      {{"--event-log-handler= ", x},
       "argument --event-log-handler: expected the name of an event-log handler (e.g. null), got "
       "' '"},
      {{"--event_log_handler"}, "argument --event-log-handler: expected one argument (NAME)"},
      {{"--duplicate-stdout-filters=", x},
       "argument --duplicate-stdout-filters: expected strings separated by commas, like "
       "'loss,NaN', none of them empty, got ''"},
      {{"--duplicate_stderr_filters", "a,,b", x},
       "argument --duplicate-stderr-filters: expected strings separated by commas, like "
       "'loss,NaN', none of them empty, got 'a,,b'"},
      {{"--duplicate-stdout-filters= , ", x},
       "argument --duplicate-stdout-filters: expected strings separated by commas, like "
       "'loss,NaN', none of them empty, got ' , '"},
      {{"--duplicate-stdout-filters=a\nb", x},
       "argument --duplicate-stdout-filters: expected strings separated by commas, like "
       "'loss,NaN' (a line never contains a newline), got 'a\\nb'"},
      {{"--duplicate-stdout-filters"},
       "argument --duplicate-stdout-filters: expected one argument (FILTERS)"},
      {{"--nproc-per-node=xpu", x},
       "argument --nproc-per-node: 'xpu' asks for one worker per Intel XPU device, but this host "
       "has none (use an integer, cpu, gpu or auto)"},
      {{"--rdzv-conf='join_timeout=-3'", x},
       "argument --rdzv-conf: join_timeout must be a number of seconds > 0, got '-3'"},
      {{"--rdzv-conf='join_timeout'", x},
       "argument --rdzv-conf: expected <key>=<value> pairs separated by commas, got "
       "''join_timeout''"},
  };
  for (const auto& c : cases) {
    INFO(join(c.args, " "));
    CHECK(errorOf(c.args, f.env()) == c.expected);
  }
}

TEST_CASE("duplicate filters: both spellings, PET default, notice without tee", "[launcher]") {
  Files f;
  auto r = parse({"--duplicate-stdout-filters= loss ,NaN", "--duplicate_stderr_filters=Error", "-t",
                  "3", f.exe},
                 f.env());
  REQUIRE(r.isOk());
  CHECK(r->config.duplicate_stdout_filters == std::vector<std::string>{"loss", "NaN"});
  CHECK(r->config.duplicate_stderr_filters == std::vector<std::string>{"Error"});
  for (const auto& n : r->notices) CHECK(n.find("duplicate") == std::string::npos);

  auto env = f.env();
  env["PET_DUPLICATE_STDOUT_FILTERS"] = "epoch";
  auto pet = parse({"--tee=0:1", f.exe}, env);
  REQUIRE(pet.isOk());
  CHECK(pet->config.duplicate_stdout_filters == std::vector<std::string>{"epoch"});
  auto over = parse({"--duplicate-stdout-filters=x", "-t", "1", f.exe}, env);
  REQUIRE(over.isOk());
  CHECK(over->config.duplicate_stdout_filters == std::vector<std::string>{"x"});

  // Nothing tees stdout: the filters would see nothing, and the user is told so.
  auto untee = parse({"--duplicate-stdout-filters=loss", "-t", "2", f.exe}, f.env());
  REQUIRE(untee.isOk());
  bool warned = false;
  for (const auto& n : untee->notices) {
    warned |= n ==
              "warning: --duplicate-stdout-filters has no effect: it filters the streams of "
              "tee'd workers, and no local rank tees stdout (add -t 1 or -t 3)";
  }
  CHECK(warned);
  auto huge = parse({"--duplicate-stdout-filters=" + std::string(70000, 'a'), f.exe}, f.env());
  REQUIRE_FALSE(huge.isOk());
  CHECK(huge.status().message().find("(at most 64 KiB)") != std::string::npos);
}

TEST_CASE("etcd-v3 takes a list of etcd members, port 2379 by default, and its conf keys",
          "[launcher]") {
  Files f;
  const std::string ca = f.dir + "/ca.pem", password = f.dir + "/password";
  std::ofstream(ca) << "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  std::ofstream(password) << "s3cret\n";
  auto r = parse(
      {"--nnodes=1:4", "--rdzv-backend=etcd-v3", "--rdzv-endpoint=h1, h2:2380,[::1]",
       "--rdzv-conf=cacert=" + ca + ",username=u,password_file=" + password + ",key_prefix=/jobs/x",
       f.exe},
      f.env());
  REQUIRE(r.isOk());
  CHECK(r->config.rdzv_backend == agent::RendezvousBackend::kEtcdV3);
  CHECK(r->config.rdzv_endpoint == "h1:2379,h2:2380,[::1]:2379");
  const auto& etcd = r->config.rdzv_conf.etcd;
  CHECK(etcd.https);  // a CA given: TLS
  CHECK(etcd.ca_file == ca);
  CHECK(etcd.username == "u");
  CHECK(etcd.password == "s3cret");
  CHECK(etcd.key_prefix == "/jobs/x");
  CHECK(r->config.rdzv_conf.unknown_keys.empty());
  auto one = parse({"--rdzv-backend=etcd-v3", "--rdzv-endpoint=etcd.local", f.exe}, f.env());
  REQUIRE(one.isOk());
  CHECK(one->config.rdzv_endpoint == "etcd.local:2379");
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

TEST_CASE("an IPv6 address is taken bare or in brackets, a name or IPv4 address as it is",
          "[launcher]") {
  Files f;
  for (const auto& [given, taken] : std::vector<std::pair<std::string, std::string>>{
           {"[::1]", "::1"},
           {"::1", "::1"},
           {"fe80::1%eth0", "fe80::1%eth0"},
           {"node-1.cluster_a.local", "node-1.cluster_a.local"},
           {" 10.1.2.3 ", "10.1.2.3"}}) {
    INFO(given);
    auto r = parse({"--local-addr=" + given, "--master-addr=" + given, f.exe}, f.env());
    REQUIRE(r.isOk());
    CHECK(r->config.local_addr == taken);
    CHECK(r->config.master_addr == taken);
  }
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

TEST_CASE("ddprun launch passes --local-rank=N as torch.distributed.launch did, unless --use-env",
          "[launcher]") {
  Files f;
  auto launch = [&](std::vector<std::string> args, Env env) {
    return parseCommandLine(args, env, HostFacts{8, 0}, CliMode::kLaunch);
  };
  auto legacy = launch({"--nproc-per-node=2", f.script, "--lr=1"}, f.env());
  REQUIRE(legacy.isOk());
  CHECK(legacy->config.local_rank_arg == "local-rank");
  // Inserted per worker right after the script, before the script's own arguments.
  CHECK(legacy->config.worker_argv == std::vector<std::string>{f.python, "-u", f.script, "--lr=1"});
  CHECK(legacy->config.local_rank_arg_at == 3u);
  // One deprecation notice, pointing at LOCAL_RANK.
  int notices = 0;
  for (const auto& n : legacy->notices) {
    if (n.find("torch.distributed.launch") != std::string::npos) {
      ++notices;
      CHECK(n.find("--local-rank=<local rank>") != std::string::npos);
      CHECK(n.find("os.environ['LOCAL_RANK']") != std::string::npos);
    }
  }
  CHECK(notices == 1);
  // torch 1.x scripts declare --local_rank.
  CHECK(launch({"--local-rank-arg=local_rank", f.script}, f.env())->config.local_rank_arg ==
        "local_rank");
  // --use-env in both spellings: LOCAL_RANK only, as torchrun.
  CHECK(launch({"--use-env", f.script}, f.env())->config.local_rank_arg.empty());
  CHECK(launch({"--use_env", f.script}, f.env())->config.local_rank_arg.empty());
  Env pet = f.env();
  pet["PET_USE_ENV"] = "1";
  CHECK(launch({f.script}, pet)->config.local_rank_arg.empty());
  pet["PET_USE_ENV"] = "0";
  pet["PET_LOCAL_RANK_ARG"] = "local_rank";
  CHECK(launch({f.script}, pet)->config.local_rank_arg == "local_rank");
  // A program run directly needs --use-env, as torch.distributed.launch requires.
  auto direct = launch({"--no-python", f.exe}, f.env());
  REQUIRE_FALSE(direct.isOk());
  CHECK(direct.status().message() ==
        "ddprun launch: --no-python needs --use-env too (or --local-rank-arg to pass the local "
        "rank as an argument anyway)");
  CHECK(launch({"--no-python", "--use-env", f.exe}, f.env()).isOk());
  CHECK(helpText(CliMode::kLaunch).find("usage: ddprun launch") != std::string::npos);
}

TEST_CASE("plain ddprun accepts --use-env as a no-op and passes --local-rank only on request",
          "[launcher]") {
  Files f;
  auto plain = parse({"--use-env", f.script}, f.env());
  REQUIRE(plain.isOk());
  CHECK(plain->config.local_rank_arg.empty());
  CHECK(plain->notices.empty());
  auto asked = parse({"--local-rank-arg", "local_rank", "-m", "pkg.train", "x"}, f.env());
  REQUIRE(asked.isOk());
  CHECK(asked->config.local_rank_arg == "local_rank");
  CHECK(asked->config.local_rank_arg_at == 4u);  // python -u -m pkg.train | x
  CHECK(parse({"--local-rank-arg=none", f.script}, f.env())->config.local_rank_arg.empty());
  Env env = f.env();
  env["PET_LOCAL_RANK_ARG"] = "rank";
  CHECK(errorOf({f.script}, env) ==
        "argument PET_LOCAL_RANK_ARG: expected local-rank (torch 2.x), local_rank (torch 1.x) or "
        "none, got 'rank'");
  env.erase("PET_LOCAL_RANK_ARG");
  env["PET_USE_ENV"] = "yes please";
  CHECK(
      errorOf({f.script}, env) ==
      "environment PET_USE_ENV: expected 1 or 0 (or true/false, yes/no, on/off), got 'yes please'");
}

TEST_CASE("the flag --run-path runs any file or directory under the Python interpreter",
          "[launcher]") {
  Files f;
  auto r = parse({"--run_path", f.exe, "a"}, f.env());  // no .py suffix needed
  REQUIRE(r.isOk());
  CHECK(r->config.worker_argv == std::vector<std::string>{f.python, "-u", f.exe, "a"});
  CHECK(r->config.python_interpreter == f.python);
  CHECK(r->config.python_interpreter_source == "PATH");
  auto dir = parse({"--run-path", f.dir}, f.env());  // a directory with __main__.py
  REQUIRE(dir.isOk());
  CHECK(dir->config.worker_argv == std::vector<std::string>{f.python, "-u", f.dir});
  Env env = f.env();
  env["PET_RUN_PATH"] = "1";
  env["PYTHON_EXEC"] = f.exe;
  auto pet = parse({f.plain}, env);
  REQUIRE(pet.isOk());
  CHECK(pet->config.worker_argv == std::vector<std::string>{f.exe, "-u", f.plain});
  CHECK(pet->config.python_interpreter_source == "PYTHON_EXEC");
  env["PET_RUN_PATH"] = "2";
  CHECK(errorOf({f.plain}, env) ==
        "environment PET_RUN_PATH: expected 1 or 0 (or true/false, yes/no, on/off), got '2'");
  // Not Python: no interpreter for the report's hint.
  CHECK(parse({f.exe}, f.env())->config.python_interpreter.empty());
}

TEST_CASE("a conflict a PET_ variable is part of names the variable", "[launcher]") {
  Files f;
  Env env = f.env();
  env["PET_MODULE"] = "1";
  CHECK(errorOf({"--no-python", f.exe}, env) ==
        "--no-python and -m/--module (PET_MODULE) cannot be used together");
  env = f.env();
  env["PET_RUN_PATH"] = "true";
  CHECK(errorOf({"-m", "mod"}, env) ==
        "--run-path (PET_RUN_PATH) and -m/--module cannot be used together");
  env = f.env();
  env["PET_STANDALONE"] = "1";
  CHECK(errorOf({"--nnodes=2", f.exe}, env) ==
        "argument --standalone (PET_STANDALONE): runs a single node, but --nnodes asks for 2 "
        "(drop one of them)");
  env = f.env();
  env["PET_NNODES"] = "3";
  CHECK(errorOf({"--standalone", f.exe}, env) ==
        "argument --standalone: runs a single node, but PET_NNODES asks for 3 (drop one of them)");
}

TEST_CASE("the flag --rdzv-conf strips quotes and passes unknown keys on with one warning",
          "[launcher]") {
  Files f;
  // As PyTorch's test_run.py passes it: the quotes are part of the argument.
  auto r = parse({"--rdzv_conf='join_timeout=5,last_call_timeout=1,timeout=5'", f.exe}, f.env());
  REQUIRE(r.isOk());
  CHECK(r->config.rdzv_conf.join_timeout == std::chrono::seconds(5));
  CHECK(r->config.rdzv_conf.run.last_call_timeout == std::chrono::seconds(1));
  CHECK(r->notices.empty());
  CHECK(
      parse({"--rdzv-conf=\"join_timeout='7'\"", f.exe}, f.env())->config.rdzv_conf.join_timeout ==
      std::chrono::seconds(7));
  auto unknown = parse({"--rdzv-conf=store_type=tcp,join_timeout=5,use_libuv=1", f.exe}, f.env());
  REQUIRE(unknown.isOk());
  CHECK(unknown->config.rdzv_conf.join_timeout == std::chrono::seconds(5));
  REQUIRE(unknown->notices.size() == 1);
  CHECK(unknown->notices[0] ==
        "warning: --rdzv-conf: ddprun's rendezvous does not use store_type, use_libuv (torchrun "
        "would pass them to its backend); ignoring them");
  Env env = f.env();
  env["PET_RDZV_CONF"] = "store_type=tcp";
  auto pet = parse({f.exe}, env);
  REQUIRE(pet.isOk());
  CHECK(pet->notices.at(0).find("warning: PET_RDZV_CONF: ") == 0);
}

TEST_CASE("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE is the default of --log-line-prefix-template",
          "[launcher]") {
  Files f;
  Env env = f.env();
  env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:";
  CHECK(parse({f.exe}, env)->config.log_line_prefix_template == "[rank${rank}]:");
  CHECK(parse({"--log-line-prefix-template=X", f.exe}, env)->config.log_line_prefix_template ==
        "X");
  env["PET_LOG_LINE_PREFIX_TEMPLATE"] = "Y";
  CHECK(parse({f.exe}, env)->config.log_line_prefix_template == "Y");
  CHECK(parse({f.exe}, f.env())->config.log_line_prefix_template.empty());
}

TEST_CASE("torchrun 2.x flags: --virtual-local-rank, xpu, and the Python plug-in flags",
          "[launcher]") {
  Files f;
  CHECK(parse({"--virtual-local-rank", f.exe}, f.env())->config.virtual_local_rank);
  Env env = f.env();
  env["PET_VIRTUAL_LOCAL_RANK"] = "1";
  CHECK(parse({f.exe}, env)->config.virtual_local_rank);
  CHECK_FALSE(parse({f.exe}, f.env())->config.virtual_local_rank);
  CHECK(
      parse({"--nproc_per_node=xpu", f.exe}, f.env(), HostFacts{8, 0, 3})->config.nproc_per_node ==
      3);
  // Plug-ins of torchrun's Python API: accepted, ignored, and said so.
  auto specs = parse({"--logs-specs=my_specs", "--event-log-handler=console", f.exe}, f.env());
  REQUIRE(specs.isOk());
  REQUIRE(specs->notices.size() == 2);
  CHECK(specs->notices[0].find("--logs-specs=my_specs ignored: it names a Python plug-in") == 0);
  CHECK(specs->notices[1].find("--event-log-handler=console ignored") == 0);
  CHECK(parse({"--event_log_handler=null", f.exe}, f.env())->notices.empty());
}

TEST_CASE("the flag --numa-binding plans each local rank's CPUs or says why it cannot",
          "[launcher]") {
  Files f;
  HostFacts host{8, 0};
  CHECK(errorOf({"--numa-binding=cores", f.exe}, f.env()) ==
        "argument --numa-binding: expected node, socket, exclusive or core-complex, got 'cores'");
  CHECK(errorOf({"--numa_binding="}, f.env()) ==
        "argument --numa-binding: expected node, socket, exclusive or core-complex, got ''");
  CHECK(errorOf({"--numa-binding"}, f.env()) ==
        "argument --numa-binding: expected one argument (POLICY)");
  Env env = f.env();
  env["PET_NUMA_BINDING"] = "sockets";
  CHECK(errorOf({f.exe}, env) ==
        "argument PET_NUMA_BINDING: expected node, socket, exclusive or core-complex, got "
        "'sockets'");
  host.sysfs_root = f.dir + "/no-sysfs";
  CHECK(errorOf({"--numa-binding=node", f.exe}, f.env(), host) ==
        "--numa-binding: cannot read the CPU topology from " + f.dir +
            "/no-sysfs/node/node*/cpulist (is /sys mounted? drop --numa-binding to run unbound)");
  // This machine's own topology: one CPU list per local rank.
  auto r = parse({"--numa-binding=node", "--nproc-per-node=2", f.exe}, f.env());
  if (r.isOk()) {
    CHECK(r->config.cpu_affinity.size() == 2u);
    CHECK_FALSE(r->config.cpu_affinity[0].empty());
  }
  CHECK(parse({f.exe}, f.env())->config.cpu_affinity.empty());
}

TEST_CASE("a usage error quoting a value with control bytes stays one line", "[launcher]") {
  // Found by fuzz_nnodes_endpoint and fuzz_cli: values were quoted raw, so a newline split the
  // error and an escape sequence reached the terminal.
  Files f;
  CHECK(errorOf({"--nnodes=1\nx", f.exe}, f.env()) ==
        "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX <= 1000000, got '1\\nx'");
  CHECK(errorOf({"--nnodes=1", f.exe}, {{"PET_NPROC_PER_NODE", "\x1b[31mred"}}).find('\x1b') ==
        std::string::npos);
  const std::string missing = errorOf({"--no-python", std::string("scri\0pt", 7)}, f.env());
  CHECK(missing.find('\0') == std::string::npos);
  CHECK_THAT(missing, Catch::Contains("scri\\x00pt"));
}

TEST_CASE("a replicated --snapshot-dir needs a token unless the risk is accepted by name",
          "[launcher]") {
  Files f;
  const std::vector<std::string> multi = {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h",
                                          "--snapshot-dir=/snap", f.exe};
  const std::string refused = errorOf(multi, f.env());
  CHECK(refused.find("argument --snapshot-dir: on a multi-node job the agents replicate /snap") ==
        0);
  CHECK(refused.find("plant or delete files") != std::string::npos);
  CHECK(refused.find("token_file=") != std::string::npos);
  CHECK(refused.find("--snapshot-allow-unauthenticated") != std::string::npos);
  // MIN:MAX that may grow past one node is multi-node too.
  CHECK(errorOf({"--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=h", "--snapshot-dir=/snap",
                 f.exe},
                f.env()) == refused);

  // A token, or the opt-in flag (or its PET_ variable), and it is accepted.
  const std::string token = f.dir + "/token";
  std::ofstream(token) << "secret\n";
  auto with_token = multi;
  with_token.insert(with_token.begin(), "--rdzv-conf=token_file=" + token);
  REQUIRE(parse(with_token, f.env()).isOk());
  auto opted = multi;
  opted.insert(opted.begin(), "--snapshot-allow-unauthenticated");
  auto r = parse(opted, f.env());
  REQUIRE(r.isOk());
  CHECK(r->config.snapshot_allow_unauthenticated);
  Env env = f.env();
  env["PET_SNAPSHOT_ALLOW_UNAUTHENTICATED"] = "1";
  CHECK(parse(multi, env).isOk());
  // One node replicates nothing: no token needed.
  CHECK(parse({"--snapshot-dir=/snap", f.exe}, f.env()).isOk());
}

TEST_CASE("the snapshot limits flag sets the replication's bounds and names a bad key or value",
          "[launcher]") {
  Files f;
  auto r = parse({"--snapshot-limits=streams_per_peer=4,streams=8,buffered-mb=16,names_per_peer="
                  "10,names=20,stall_timeout=2.5",
                  f.exe},
                 f.env());
  REQUIRE(r.isOk());
  const auto& l = r->config.snapshot_limits;
  CHECK(l.streams_per_peer == 4);
  CHECK(l.streams == 8);
  CHECK(l.buffered_bytes == (uint64_t{16} << 20));
  CHECK(l.names_per_peer == 10);
  CHECK(l.names == 20);
  CHECK(l.stall_seconds == 2.5);
  const auto d = agent::SnapshotLimits{};
  auto defaults = parse({f.exe}, f.env());
  CHECK(defaults->config.snapshot_limits.streams_per_peer == d.streams_per_peer);
  CHECK(d.streams_per_peer == 16);
  CHECK(d.streams == 64);
  CHECK(d.names_per_peer == 65536);
  CHECK(d.names == 131072);

  CHECK(errorOf({"--snapshot-limits=streams=0", f.exe}, f.env()) ==
        "argument --snapshot-limits: streams must be a whole number from 1 to 65536, got '0'");
  CHECK(errorOf({"--snapshot-limits=bogus=1", f.exe}, f.env()) ==
        "argument --snapshot-limits: unknown key 'bogus' (known: streams_per_peer, streams, "
        "buffered_mb, names_per_peer, names, stall_timeout)");
  CHECK(errorOf({"--snapshot-limits=stall_timeout=x", f.exe}, f.env())
            .find("stall_timeout must be a number of seconds > 0") != std::string::npos);
  CHECK(errorOf({"--snapshot-limits=streams_per_peer=9,streams=8", f.exe}, f.env()) ==
        "argument --snapshot-limits: streams_per_peer (9) is more than streams (8)");
}

TEST_CASE("the job id is checked itself and named, not as a --log-dir problem", "[launcher]") {
  Files f;
  CHECK(errorOf({"--rdzv-id=a/b", f.exe}, f.env()) ==
        "argument --rdzv-id: the job id 'a/b' contains '/' (it names the run's log directory; "
        "use letters, digits, '-', '_', '.')");
  const std::string err = errorOf({"--rdzv-id=" + std::string(300, 'x'), f.exe}, f.env());
  CHECK(err.find("argument --rdzv-id: the job id '" + std::string(60, 'x') +
                 "...' is 300 bytes long, more than 200") == 0);
  CHECK(errorOf({"--rdzv-id=..", f.exe}, f.env()).find("is not a file name") != std::string::npos);
  CHECK(errorOf({"--rdzv-id=a\tb", f.exe}, f.env()).find("'a?b' contains a control byte") !=
        std::string::npos);
  Env env = f.env();
  env["PET_RDZV_ID"] = "x/y";
  CHECK(errorOf({f.exe}, env).find("argument PET_RDZV_ID: the job id 'x/y'") == 0);
  CHECK(parse({"--rdzv-id=job-7.a_b", f.exe}, f.env()).isOk());
}

TEST_CASE("the flag --print-completion asks for a shell's script and needs no program, as torchrun",
          "[launcher]") {
  Files f;
  for (const char* shell : {"bash", "zsh", "tcsh"}) {
    auto r = parse({"--nnodes=2", "--print-completion", shell}, f.env());
    REQUIRE(r.isOk());
    CHECK(r->completion_shell == shell);
  }
  auto underscored = parse({"--print_completion=zsh"}, f.env());
  REQUIRE(underscored.isOk());
  CHECK(underscored->completion_shell == "zsh");
  CHECK(errorOf({"--print-completion", "fish"}, f.env()) ==
        "argument --print-completion: invalid choice: 'fish' (choose from bash, zsh, tcsh)");
  CHECK(errorOf({"--print-completion"}, f.env()) ==
        "argument --print-completion: expected one argument (SHELL)");
  // Not an environment default: a run is never turned into printing a script.
  Env env = f.env();
  env["PET_PRINT_COMPLETION"] = "bash";
  auto run = parse({f.exe}, env);
  REQUIRE(run.isOk());
  CHECK(run->completion_shell.empty());
}

TEST_CASE("every value a completion offers is one the command line takes", "[launcher]") {
  Files f;
  int offered = 0;
  for (const auto& flag : launchFlags()) {
    if (flag.choices == nullptr || std::string(flag.name) == "print_completion") continue;
    for (const std::string& value : split(flag.choices, ',')) {
      ++offered;
      INFO(dashedFlagName(flag.name) << "=" << value);
      auto r =
          parse({dashedFlagName(flag.name) + "=" + value, "--nproc-per-node=2", f.exe}, f.env());
      if (!r.isOk()) {
        // --numa-binding may fail for this machine's topology, never for its value.
        CHECK(r.status().message().find("expected") == std::string::npos);
      }
    }
  }
  CHECK(offered >= 13);
}

TEST_CASE("each shell's completion names every flag and the values of those with fixed ones",
          "[launcher]") {
  for (const char* shell : {"bash", "zsh", "tcsh"}) {
    const std::string script = completionScript(shell);
    INFO(shell);
    for (const auto& flag : launchFlags()) {
      const std::string dashed = dashedFlagName(flag.name);
      CHECK(script.find(std::string(shell) == "tcsh" ? dashed.substr(2) : dashed) !=
            std::string::npos);
      if (flag.choices != nullptr) {
        CHECK(script.find(replaceAll(flag.choices, ",", " ")) != std::string::npos);
      }
    }
  }
  CHECK(completionScript("bash").find("complete -F _ddprun ddprun") != std::string::npos);
  CHECK(completionScript("zsh").rfind("#compdef ddprun\n", 0) == 0);
  CHECK(completionScript("tcsh").find("complete ddprun ") != std::string::npos);
}
