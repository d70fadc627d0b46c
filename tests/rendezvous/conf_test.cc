// parseRendezvousConf: the one parser of --rdzv-conf. The launcher parses --rdzv-conf with it once,
// for the --nnodes range, and hands the agent the result (AgentConfig::rdzv_conf). Every key, the
// defaults, every error. (The launcher's own view, messages naming --rdzv-conf or PET_RDZV_CONF,
// is in tests/launcher/cli_test.cc.)
#include "ddprun/rendezvous/conf.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "ddprun/rendezvous/files.h"

using namespace ddprun;
using namespace ddprun::rendezvous;
using namespace std::chrono_literals;
using Conf = std::map<std::string, std::string>;

namespace {

const char kCert[] = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
const char kKey[] = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n";

// Scratch files: a token, a certificate, a CA, a key and a file that is none of them.
struct Files {
  Files() {
    char templ[] = "/tmp/ddprun_rdzv_conf_XXXXXX";
    dir = ::mkdtemp(templ);
    token = write("token", "  s3cret \n");
    empty_token = write("empty_token", "\n");
    cert = write("server.pem", kCert);
    ca = write("ca.pem", std::string("# our CA\n") + kCert);
    key = write("server.key", kKey);
    rsa_key =
        write("rsa.key", "-----BEGIN RSA PRIVATE KEY-----\nMII\n-----END RSA PRIVATE KEY-----\n");
    junk = write("junk.txt", "hello\n");
  }
  ~Files() { std::system(("rm -rf " + dir).c_str()); }
  std::string write(const std::string& name, const std::string& content) const {
    std::string path = dir + "/" + name;
    std::ofstream(path) << content;
    return path;
  }
  std::string dir, token, empty_token, cert, ca, key, rsa_key, junk;
};

std::string errorOf(const Conf& conf) {
  auto r = parseRendezvousConf(conf, 1, 1);
  if (r.isOk()) return "<ok>";
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  return r.status().message();
}

}  // namespace

TEST_CASE("an empty rdzv-conf gives ddprun's defaults, heartbeats every 0.5 s times 3", "[conf]") {
  auto c = parseRendezvousConf({}, 2, 4);
  REQUIRE(c.isOk());
  CHECK(c->run.min_nodes == 2);
  CHECK(c->run.max_nodes == 4);
  CHECK(c->run.heartbeat_interval == 500ms);
  CHECK(c->run.heartbeat_interval == kDefaultHeartbeatInterval);
  CHECK(c->run.heartbeat_misses == 3u);
  CHECK(c->run.heartbeat_misses == kDefaultHeartbeatMisses);
  CHECK(c->run.last_call_timeout == 30s);
  CHECK(c->join_timeout == 600s);
  CHECK(c->close_timeout == 30s);
  CHECK(c->read_timeout == 60s);
  CHECK(c->failure_grace == 1s);  // two heartbeat intervals
  CHECK(c->is_host == IsHost::kAuto);
  CHECK(c->token.empty());
  CHECK(c->tls_ca_pem.empty());
  CHECK(c->tls_cert_pem.empty());
  CHECK(c->tls_key_pem.empty());
  // A default-constructed RendezvousConf agrees with what the parser returns.
  RendezvousConf d;
  CHECK(d.failure_grace == c->failure_grace);
}

TEST_CASE("every rdzv-conf key sets its setting, with '_' or '-' in its name", "[conf]") {
  Files f;
  auto c = parseRendezvousConf({{"join_timeout", "5"},
                                {"last-call-timeout", "0.25"},
                                {"close_timeout", "7"},
                                {"heartbeat_interval", "2"},
                                {"heartbeat-misses", "4"},
                                {"read_timeout", "9.5"},
                                {"failure_grace", "0.75"},
                                {"is_host", "true"},
                                {"token_file", f.token},
                                {"tls_ca", f.ca},
                                {"tls_cert", f.cert},
                                {"tls-key", f.key}},
                               1, 3);
  REQUIRE(c.isOk());
  CHECK(c->join_timeout == 5s);
  CHECK(c->run.last_call_timeout == 250ms);
  CHECK(c->close_timeout == 7s);
  CHECK(c->run.heartbeat_interval == 2s);
  CHECK(c->run.heartbeat_misses == 4u);
  CHECK(c->read_timeout == 9500ms);
  CHECK(c->failure_grace == 750ms);
  CHECK(c->is_host == IsHost::kTrue);
  CHECK(c->token == "s3cret");
  CHECK(c->tls_ca_pem == std::string("# our CA\n") + kCert);
  CHECK(c->tls_ca_file == f.ca);
  CHECK(c->tls_cert_pem == kCert);
  CHECK(c->tls_key_pem == kKey);
}

TEST_CASE("inplace_timeout bounds an in-place recovery: 60 s unless given, seconds > 0", "[conf]") {
  auto d = parseRendezvousConf({}, 1, 1);
  REQUIRE(d.isOk());
  CHECK(d->inplace_timeout == 60s);
  auto c = parseRendezvousConf({{"inplace-timeout", "2.5"}}, 1, 1);
  REQUIRE(c.isOk());
  CHECK(c->inplace_timeout == 2500ms);
  for (const char* bad : {"0", "-1", "soon"}) {
    auto r = parseRendezvousConf({{"inplace_timeout", bad}}, 1, 1);
    REQUIRE_FALSE(r.isOk());
    CHECK_THAT(r.status().message(),
               Catch::Contains("inplace_timeout must be a number of seconds"));
  }
}

TEST_CASE("is_host takes auto, true, false and the usual boolean spellings", "[conf]") {
  const std::vector<std::pair<std::string, IsHost>> cases = {
      {"auto", IsHost::kAuto}, {"AUTO", IsHost::kAuto}, {"true", IsHost::kTrue},
      {"1", IsHost::kTrue},    {"yes", IsHost::kTrue},  {"false", IsHost::kFalse},
      {"0", IsHost::kFalse},   {"Off", IsHost::kFalse}};
  for (const auto& [value, expected] : cases) {
    INFO(value);
    auto c = parseRendezvousConf({{"is_host", value}}, 1, 1);
    REQUIRE(c.isOk());
    CHECK(c->is_host == expected);
  }
}

TEST_CASE("torchrun's timeout is the join timeout unless join_timeout is given", "[conf]") {
  CHECK(parseRendezvousConf({{"timeout", "42"}}, 1, 1)->join_timeout == 42s);
  // std::map orders "join_timeout" before "timeout"; both orders of the user's text end here.
  CHECK(parseRendezvousConf({{"timeout", "42"}, {"join_timeout", "8"}}, 1, 1)->join_timeout == 8s);
  CHECK(parseRendezvousConf({{"timeout", "42"}, {"join-timeout", "8"}}, 1, 1)->join_timeout == 8s);
  CHECK(errorOf({{"timeout", "0"}, {"join_timeout", "8"}}) ==
        "timeout must be a number of seconds > 0, got '0'");
}

TEST_CASE("the failure grace follows the heartbeat interval unless given, and 0 reports at once",
          "[conf]") {
  CHECK(parseRendezvousConf({{"heartbeat_interval", "3"}}, 1, 1)->failure_grace == 6s);
  CHECK(parseRendezvousConf({{"heartbeat_interval", "0.1"}}, 1, 1)->run.heartbeat_interval ==
        kMinHeartbeatInterval);
  CHECK(parseRendezvousConf({{"heartbeat_interval", "3"}, {"failure_grace", "1"}}, 1, 1)
            ->failure_grace == 1s);
  CHECK(parseRendezvousConf({{"failure_grace", "0"}}, 1, 1)->failure_grace == 0s);
}

TEST_CASE("zero is a valid last call, close timeout and grace but not a timeout or interval",
          "[conf]") {
  auto c = parseRendezvousConf({{"last_call_timeout", "0"}, {"close_timeout", "0"}}, 1, 1);
  REQUIRE(c.isOk());
  CHECK(c->run.last_call_timeout == 0s);
  CHECK(c->close_timeout == 0s);
  for (const char* key : {"join_timeout", "timeout", "read_timeout", "heartbeat_interval"}) {
    INFO(key);
    CHECK(errorOf({{key, "0"}}) == std::string(key) + " must be a number of seconds > 0, got '0'");
  }
}

TEST_CASE("malformed rdzv-conf values are one line naming the key and the accepted form",
          "[conf]") {
  Files f;
  const std::vector<std::pair<Conf, std::string>> cases = {
      {{{"join_timeout", "-3"}}, "join_timeout must be a number of seconds > 0, got '-3'"},
      {{{"join_timeout", "soon"}}, "join_timeout must be a number of seconds > 0, got 'soon'"},
      {{{"join_timeout", ""}}, "join_timeout must be a number of seconds > 0, got ''"},
      {{{"join_timeout", "inf"}}, "join_timeout must be a number of seconds > 0, got 'inf'"},
      {{{"join_timeout", "1e12"}}, "join_timeout must be at most 1e9 seconds, got '1e12'"},
      {{{"last_call_timeout", "-1"}},
       "last_call_timeout must be a number of seconds >= 0, got '-1'"},
      {{{"close_timeout", "x"}}, "close_timeout must be a number of seconds >= 0, got 'x'"},
      {{{"failure_grace", "-0.5"}}, "failure_grace must be a number of seconds >= 0, got '-0.5'"},
      {{{"read_timeout", "nan"}}, "read_timeout must be a number of seconds > 0, got 'nan'"},
      {{{"heartbeat_interval", "-2"}},
       "heartbeat_interval must be a number of seconds > 0, got '-2'"},
      // Less: the node's own heartbeats cannot keep up, it is declared dead over and over.
      {{{"heartbeat_interval", "1e-9"}}, "heartbeat_interval must be at least 0.1 s, got '1e-9'"},
      {{{"heartbeat_interval", "0.099"}}, "heartbeat_interval must be at least 0.1 s, got '0.099'"},
      {{{"heartbeat_misses", "0"}},
       "heartbeat_misses must be an integer from 1 to 1000000, got '0'"},
      {{{"heartbeat_misses", "2.5"}},
       "heartbeat_misses must be an integer from 1 to 1000000, got '2.5'"},
      {{{"heartbeat_misses", "99999999999"}},
       "heartbeat_misses must be an integer from 1 to 1000000, got '99999999999'"},
      {{{"is_host", "maybe"}}, "is_host must be auto, true or false, got 'maybe'"},
      {{{"is-host", "true"}, {"is_host", "false"}},
       "is_host is given twice, as 'is-host' and 'is_host'; give it once"},
      {{{"token_file", ""}}, "token_file needs a path, got ''"},
      {{{"token_file", f.dir + "/nope"}}, "token_file: cannot read " + f.dir + "/nope"},
      {{{"token_file", f.empty_token}}, "token_file: token file " + f.empty_token + " is empty"},
      {{{"tls_ca", ""}}, "tls_ca needs the path of a PEM certificate, got ''"},
      {{{"tls_ca", f.dir + "/nope.pem"}},
       "tls_ca: cannot read '" + f.dir + "/nope.pem' (expected a PEM certificate)"},
      {{{"tls_ca", f.junk}}, "tls_ca: '" + f.junk + "' is not a PEM certificate"},
      {{{"tls_ca", f.key}}, "tls_ca: '" + f.key + "' is not a PEM certificate"},
      {{{"tls_ca", f.ca}, {"tls_cert", f.junk}, {"tls_key", f.key}},
       "tls_cert: '" + f.junk + "' is not a PEM certificate"},
      {{{"tls_ca", f.ca}, {"tls_cert", f.cert}, {"tls_key", f.cert}},
       "tls_key: '" + f.cert + "' is not a PEM private key"},
      {{{"tls_ca", f.ca}, {"tls_cert", f.cert}, {"tls_key", f.dir + "/nope.key"}},
       "tls_key: cannot read '" + f.dir + "/nope.key' (expected a PEM private key)"},
      {{{"tls_ca", f.ca}, {"tls_cert", f.cert}},
       "tls_cert=" + f.cert + " needs tls_key= too (the certificate's private key)"},
      {{{"tls_ca", f.ca}, {"tls_key", f.key}},
       "tls_key=" + f.key + " needs tls_cert= too (the certificate it belongs to)"},
      {{{"tls_cert", f.cert}, {"tls_key", f.key}},
       "tls_cert= and tls_key= (serve TLS) need tls_ca= too: the certificate every agent "
       "trusts, this one included (for a self-signed certificate, the same file as tls_cert)"},
  };
  for (const auto& [conf, expected] : cases) {
    std::string shown;
    for (const auto& [k, v] : conf) shown += k + "=" + v + " ";
    INFO(shown);
    const std::string message = errorOf(conf);
    CHECK(message == expected);
    CHECK(message.find('\n') == std::string::npos);
  }
}

TEST_CASE("an RSA private key and a CA alone are accepted: TLS client without serving", "[conf]") {
  Files f;
  auto client_only = parseRendezvousConf({{"tls_ca", f.ca}}, 1, 1);
  REQUIRE(client_only.isOk());
  CHECK_FALSE(client_only->tls_ca_pem.empty());
  CHECK(client_only->tls_cert_pem.empty());
  auto rsa =
      parseRendezvousConf({{"tls_ca", f.ca}, {"tls_cert", f.cert}, {"tls_key", f.rsa_key}}, 1, 1);
  REQUIRE(rsa.isOk());
  CHECK(rsa->tls_key_pem.find("RSA PRIVATE KEY") != std::string::npos);
}

// The rendezvous component's first tests of the same parser.

TEST_CASE("rdzv-conf defaults follow the spec", "[rendezvous][conf]") {
  auto conf = parseRendezvousConf({}, 2, 4);
  REQUIRE(conf.isOk());
  CHECK(conf->run.min_nodes == 2);
  CHECK(conf->run.max_nodes == 4);
  CHECK(conf->join_timeout == std::chrono::seconds(600));
  CHECK(conf->run.last_call_timeout == std::chrono::seconds(30));
  CHECK(conf->read_timeout == std::chrono::seconds(60));
  CHECK(conf->is_host == IsHost::kAuto);
  CHECK(conf->token.empty());
}

TEST_CASE("rdzv-conf keys set timeouts, heartbeats, hosting and the token", "[rendezvous][conf]") {
  const std::string token_file = "/tmp/ddprun-conf-test-token-" + std::to_string(::getpid());
  std::ofstream(token_file) << "  abc \n";
  auto conf = parseRendezvousConf({{"join_timeout", "5"},
                                   {"last_call_timeout", "0.5"},
                                   {"heartbeat_interval", "2"},
                                   {"heartbeat-misses", "4"},
                                   {"is_host", "false"},
                                   {"token_file", token_file}},
                                  1, 1);
  std::remove(token_file.c_str());
  REQUIRE(conf.isOk());
  CHECK(conf->join_timeout == std::chrono::seconds(5));
  CHECK(conf->run.last_call_timeout == std::chrono::milliseconds(500));
  CHECK(conf->run.heartbeat_interval == std::chrono::seconds(2));
  CHECK(conf->run.heartbeat_misses == 4);
  CHECK(conf->is_host == IsHost::kFalse);
  CHECK(conf->token == "abc");
}

TEST_CASE("rdzv-conf accepts unknown keys as torchrun does and lists them for a notice",
          "[rendezvous][conf]") {
  auto conf =
      parseRendezvousConf({{"store_type", "tcp"}, {"join_timeout", "5"}, {"colour", ""}}, 1, 1);
  REQUIRE(conf.isOk());
  CHECK(conf->unknown_keys == std::vector<std::string>{"colour", "store_type"});
  CHECK(conf->join_timeout == std::chrono::seconds(5));  // known keys are still read
  CHECK(parseRendezvousConf({{"join_timeout", "5"}}, 1, 1)->unknown_keys.empty());
  // A known key's malformed value stays an error even beside unknown keys.
  CHECK_FALSE(parseRendezvousConf({{"store_type", "tcp"}, {"join_timeout", "x"}}, 1, 1).isOk());
}

TEST_CASE("rdzv-conf rejects malformed values", "[rendezvous][conf]") {
  CHECK(parseRendezvousConf({{"join_timeout", "-1"}}, 1, 1).status().message() ==
        "join_timeout must be a number of seconds > 0, got '-1'");
  CHECK_FALSE(parseRendezvousConf({{"heartbeat_misses", "0"}}, 1, 1).isOk());
  CHECK_FALSE(parseRendezvousConf({{"is_host", "maybe"}}, 1, 1).isOk());
  CHECK_FALSE(parseRendezvousConf({{"token_file", "/nonexistent/t"}}, 1, 1).isOk());
}

TEST_CASE("a token file with a control or non-ASCII byte, or that is no regular file, is refused",
          "[conf]") {
  Files f;
  const std::string control = f.dir + "/control";
  std::ofstream(control) << "abc\x07"
                            "def\n";
  auto bad = parseRendezvousConf({{"token_file", control}}, 1, 1);
  REQUIRE_FALSE(bad.isOk());
  CHECK(bad.status().message() == "token_file: token file " + control +
                                      ": the token must be printable ASCII without spaces; byte "
                                      "3 is 0x07");
  const std::string spaced = f.dir + "/spaced";
  std::ofstream(spaced) << "two words\n";
  CHECK_FALSE(parseRendezvousConf({{"token_file", spaced}}, 1, 1).isOk());
  auto dev = parseRendezvousConf({{"token_file", "/dev/urandom"}}, 1, 1);
  REQUIRE_FALSE(dev.isOk());
  CHECK(dev.status().message() == "token_file: /dev/urandom is not a regular file");
  CHECK(validateToken(std::string(kMaxTokenBytes, 'a')).isOk());
  CHECK_FALSE(validateToken(std::string(kMaxTokenBytes + 1, 'a')).isOk());
}

TEST_CASE("rdzv-conf bounds the etcd key-value store each agent keeps", "[rendezvous][conf]") {
  auto defaults = parseRendezvousConf({}, 1, 1);
  REQUIRE(defaults.isOk());
  CHECK(defaults->etcd.max_kv_keys == 65536);
  CHECK(defaults->etcd.max_kv_bytes == (16u << 20));
  auto set = parseRendezvousConf({{"kv_max_keys", "100"}, {"kv-max-bytes", "4096"}}, 1, 1);
  REQUIRE(set.isOk());
  CHECK(set->etcd.max_kv_keys == 100);
  CHECK(set->etcd.max_kv_bytes == 4096);
  CHECK(set->unknown_keys.empty());
  CHECK(parseRendezvousConf({{"kv_max_keys", "0"}}, 1, 1).status().message() ==
        "kv_max_keys must be a whole number from 1 to 10000000 (etcd-v3: the run's key-value "
        "store each agent keeps), got '0'");
  CHECK_FALSE(parseRendezvousConf({{"kv_max_bytes", "lots"}}, 1, 1).isOk());
}
