#include "ddprun/rendezvous/conf.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>

using namespace ddprun;
using namespace ddprun::rendezvous;

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

TEST_CASE("rdzv-conf rejects unknown keys and malformed values", "[rendezvous][conf]") {
  CHECK(parseRendezvousConf({{"bogus", "1"}}, 1, 1).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(parseRendezvousConf({{"join_timeout", "-1"}}, 1, 1).status().message() ==
        "join_timeout must be a number of seconds > 0, got '-1'");
  CHECK_FALSE(parseRendezvousConf({{"heartbeat_misses", "0"}}, 1, 1).isOk());
  CHECK_FALSE(parseRendezvousConf({{"is_host", "maybe"}}, 1, 1).isOk());
  CHECK_FALSE(parseRendezvousConf({{"token_file", "/nonexistent/t"}}, 1, 1).isOk());
}
