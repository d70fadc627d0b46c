// EtcdCluster: a real etcd (Debian's etcd-server, /usr/bin/etcd) started by a test on loopback
// ports with temp data dirs: one member or several forming one cluster. Members can be killed
// (SIGKILL) and started again on the same ports and data, to test failover and outages.
// Tests that need it call etcdAvailable() first and SKIP with a clear message without it.
#pragma once

#include <sys/statvfs.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "process_helpers.h"

namespace ddprun::testing {

inline std::string etcdBinary() { return envOr("DDPRUN_ETCD", "/usr/bin/etcd"); }
inline std::string etcdctlBinary() { return envOr("DDPRUN_ETCDCTL", "/usr/bin/etcdctl"); }
inline bool etcdAvailable() { return fileExists(etcdBinary()) && fileExists(etcdctlBinary()); }

struct EtcdTls {
  std::string ca, cert, key;  // a CA and a server/client certificate it signed (127.0.0.1)
};

// A CA and one certificate for 127.0.0.1/localhost signed by it, written under `dir`.
inline EtcdTls makeEtcdTls(const std::string& dir) {
  const std::string cmd =
      "cd '" + dir +
      "' && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca "
      "-keyout ca.key -out ca.pem && "
      "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout node.key -out node.csr && "
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nextendedKeyUsage=serverAuth,"
      "clientAuth\\n' > ext.cnf && "
      "openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
      "-extfile ext.cnf -out node.pem";
  if (std::system((cmd + " >/dev/null 2>&1").c_str()) != 0) {
    throw std::runtime_error("openssl failed to make the etcd test certificates");
  }
  return {dir + "/ca.pem", dir + "/node.pem", dir + "/node.key"};
}

class EtcdCluster {
 public:
  struct Options {
    int members = 1;
    std::optional<EtcdTls> tls;           // serve clients over TLS, asking for client certificates
    std::vector<std::string> extra_args;  // more etcd flags, for every member
  };

  EtcdCluster() : EtcdCluster(Options{}) {}
  explicit EtcdCluster(Options options) : options_(options) {
    for (int i = 0; i < options_.members; ++i) {
      client_ports_.push_back(freePort());
      peer_ports_.push_back(freePort());
    }
    procs_.resize(options_.members);
    for (int i = 0; i < options_.members; ++i) start(i);
    if (!waitHealthy()) throw std::runtime_error("etcd did not become healthy:\n" + logs());
  }

  // "127.0.0.1:p1,127.0.0.1:p2,..."
  std::string endpoints() const {
    std::string out;
    for (size_t i = 0; i < client_ports_.size(); ++i) {
      if (i) out += ",";
      out += endpoint(static_cast<int>(i));
    }
    return out;
  }
  std::string endpoint(int i) const { return "127.0.0.1:" + std::to_string(client_ports_[i]); }
  int size() const { return options_.members; }

  void kill(int i) {
    if (procs_[i]) procs_[i]->signal(SIGKILL);
    if (procs_[i]) procs_[i]->waitExit(std::chrono::seconds(10));
    procs_[i].reset();
  }
  // Removes member i's data directory (stop it first): started again, it is an empty store.
  void wipe(int i) { std::system(("rm -rf '" + data_ / ("m" + std::to_string(i)) + "'").c_str()); }
  void start(int i) {
    const std::string name = "m" + std::to_string(i);
    const std::string scheme = options_.tls ? "https" : "http";
    std::vector<std::string> argv;
    // A test that aborts (no destructor runs) must not leave etcd behind: it dies with us.
    if (fileExists("/usr/bin/setpriv")) argv = {"/usr/bin/setpriv", "--pdeathsig", "KILL"};
    argv.insert(argv.end(), {
                                etcdBinary(),
                                "--name",
                                name,
                                "--data-dir",
                                data_ / name,
                                "--listen-client-urls",
                                scheme + "://127.0.0.1:" + std::to_string(client_ports_[i]),
                                "--advertise-client-urls",
                                scheme + "://127.0.0.1:" + std::to_string(client_ports_[i]),
                                "--listen-peer-urls",
                                "http://127.0.0.1:" + std::to_string(peer_ports_[i]),
                                "--initial-advertise-peer-urls",
                                "http://127.0.0.1:" + std::to_string(peer_ports_[i]),
                                "--initial-cluster",
                                initialCluster(),
                                "--initial-cluster-state",
                                "new",
                                "--heartbeat-interval",
                                "50",
                                "--election-timeout",
                                "500",
                            });
    if (options_.tls) {
      const EtcdTls& t = *options_.tls;
      argv.insert(argv.end(), {"--cert-file", t.cert, "--key-file", t.key, "--trusted-ca-file",
                               t.ca, "--client-cert-auth"});
    }
    argv.insert(argv.end(), options_.extra_args.begin(), options_.extra_args.end());
    procs_[i] = std::make_unique<Process>(argv, std::map<std::string, std::string>{},
                                          ProcessOptions{dir_ / (name + ".log"), false});
  }

  // etcdctl against the cluster; its exit code and output.
  Finished etcdctl(std::vector<std::string> args, const std::string& user = "") const {
    std::vector<std::string> argv = {etcdctlBinary(), "--endpoints=" + endpoints()};
    if (options_.tls) {
      argv.push_back("--cacert=" + options_.tls->ca);
      argv.push_back("--cert=" + options_.tls->cert);
      argv.push_back("--key=" + options_.tls->key);
    }
    if (!user.empty()) argv.push_back("--user=" + user);
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, {{"ETCDCTL_API", "3"}}, std::chrono::seconds(30));
  }

  // The store's current revision (0 when etcdctl cannot say).
  int64_t revision() const {
    const Finished f = etcdctl({"get", "ddprun-test-revision", "-w", "json"});
    std::smatch m;
    if (f.exit_code != 0 || !std::regex_search(f.out, m, std::regex(R"("revision":(\d+))"))) {
      return 0;
    }
    return std::stoll(m[1]);
  }

  bool waitHealthy(std::chrono::milliseconds bound = std::chrono::seconds(30)) const {
    return waitUntil(
        [&] {
          return etcdctl({"--command-timeout=1s", "endpoint", "health"}).exit_code == 0 &&
                 etcdctl({"--command-timeout=1s", "put", "/ddprun-test/ping", "1"}).exit_code == 0;
        },
        bound);
  }

  // The index of the member that is the leader now, or -1.
  int leader() const {
    for (int i = 0; i < size(); ++i) {
      if (!procs_[i]) continue;
      auto f =
          run({etcdctlBinary(), "--endpoints=" + endpoint(i), "endpoint", "status", "-w", "fields"},
              {{"ETCDCTL_API", "3"}}, std::chrono::seconds(10));
      if (f.exit_code != 0) continue;
      const auto leader_pos = f.out.find("\"Leader\" : ");
      const auto id_pos = f.out.find("\"MemberID\" : ");
      if (leader_pos == std::string::npos || id_pos == std::string::npos) continue;
      auto value = [&](size_t pos, const char* label) {
        pos += std::string(label).size();
        return f.out.substr(pos, f.out.find('\n', pos) - pos);
      };
      if (value(leader_pos, "\"Leader\" : ") == value(id_pos, "\"MemberID\" : ")) return i;
    }
    return -1;
  }

  std::string logs() const {
    std::string out;
    for (int i = 0; i < size(); ++i) out += readFile(dir_ / ("m" + std::to_string(i) + ".log"));
    return out;
  }

 private:
  std::string initialCluster() const {
    std::string out;
    for (int i = 0; i < options_.members; ++i) {
      if (i) out += ",";
      out += "m" + std::to_string(i) + "=http://127.0.0.1:" + std::to_string(peer_ports_[i]);
    }
    return out;
  }

  // etcd fsyncs every write: on a disk shared with other tests (snapshots of hundreds of MB) one
  // fsync can take seconds and let a test's short leases lapse. Its data lives in memory.
  // Only where /dev/shm has room to spare (each member preallocates a 64 MiB WAL): workers'
  // shared-memory all-reduce in tests running beside it needs /dev/shm too.
  static std::string memoryBase() {
    struct statvfs fs {};
    const bool roomy = ::access("/dev/shm", W_OK) == 0 && ::statvfs("/dev/shm", &fs) == 0 &&
                       static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize >= (4ull << 30);
    return roomy ? "/dev/shm" : envOr("TMPDIR", "/tmp");
  }

  Options options_;
  TempDir dir_;
  TempDir data_{memoryBase()};
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<Process>> procs_;
};

}  // namespace ddprun::testing
