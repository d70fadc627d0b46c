// The heartbeat file's mark (worker_sdk/src/peer_wait.h), as the agent reads it
// (ddprun/common/heartbeat_file.h).
#include "peer_wait.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/heartbeat_file.h"

using ddprun::HeartbeatMark;
using ddprun::readHeartbeatMark;
using ddprun::worker::markWaitsIn;
using ddprun::worker::stopMarkingWaits;
using ddprun::worker::touchHeartbeat;
using ddprun::worker::WaitingForPeers;

namespace {
std::string tempDir() {
  char dir[] = "/tmp/ddprun_peer_wait_XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  return dir;
}
std::string contents(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

TEST_CASE(
    "the heartbeat says whether the worker waits for its peers, from its first touch on, and "
    "nothing before it",
    "[worker][pure]") {
  const std::string dir = tempDir();
  const std::string path = dir + "/heartbeat";
  const int token = markWaitsIn(path);
  {
    WaitingForPeers before_the_first_touch;  // the file is not created: no heartbeat yet
  }
  CHECK(::access(path.c_str(), F_OK) != 0);
  CHECK(readHeartbeatMark(path) == HeartbeatMark::kUnknown);
  REQUIRE(touchHeartbeat() == 0);  // the Trainer's first step
  CHECK(readHeartbeatMark(path) == HeartbeatMark::kNotWaiting);
  {
    WaitingForPeers outer;
    CHECK(readHeartbeatMark(path) == HeartbeatMark::kWaiting);
    {
      WaitingForPeers nested;  // another thread's wait, or a wait inside one
      CHECK(readHeartbeatMark(path) == HeartbeatMark::kWaiting);
    }
    CHECK(readHeartbeatMark(path) == HeartbeatMark::kWaiting);  // the outer one still waits
    REQUIRE(touchHeartbeat() == 0);                             // a touch meanwhile keeps the mark
    CHECK(readHeartbeatMark(path) == HeartbeatMark::kWaiting);
  }
  CHECK(contents(path) == "-");
  // Concurrent waits on many threads end unmarked.
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 200; ++i) WaitingForPeers w;
    });
  }
  for (auto& t : threads) t.join();
  CHECK(contents(path) == "-");
  // A file removed meanwhile is made again by the next touch (the agent watches the path).
  REQUIRE(::unlink(path.c_str()) == 0);
  REQUIRE(touchHeartbeat() == 0);
  CHECK(contents(path) == "-");
  {
    WaitingForPeers again;
    CHECK(readHeartbeatMark(path) == HeartbeatMark::kWaiting);
  }
  // A newer Trainer's file outlives an older Trainer destroyed after the newer one was built.
  const std::string newer = dir + "/newer";
  const int newer_token = markWaitsIn(newer);
  stopMarkingWaits(token);
  REQUIRE(touchHeartbeat() == 0);
  CHECK(contents(newer) == "-");
  // No file: waits and touches write nothing.
  stopMarkingWaits(newer_token);
  {
    WaitingForPeers after;
    CHECK(touchHeartbeat() == 0);
    CHECK(readHeartbeatMark(path) == HeartbeatMark::kNotWaiting);
    CHECK(readHeartbeatMark(newer) == HeartbeatMark::kNotWaiting);
  }
  // A file that cannot be created is an error the Trainer reports.
  stopMarkingWaits(markWaitsIn(dir + "/missing/heartbeat") - 1);  // an older token: no effect
  CHECK(touchHeartbeat() == ENOENT);
  stopMarkingWaits(markWaitsIn(""));
  ::unlink(newer.c_str());
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("the agent reads a heartbeat's first byte, and only a file's", "[worker][pure]") {
  const std::string dir = tempDir();
  const std::string path = dir + "/heartbeat";
  CHECK(readHeartbeatMark(path) == HeartbeatMark::kUnknown);  // missing
  for (const auto& [text, mark] :
       std::vector<std::pair<std::string, HeartbeatMark>>{{"", HeartbeatMark::kUnknown},
                                                          {"-", HeartbeatMark::kNotWaiting},
                                                          {"w", HeartbeatMark::kWaiting},
                                                          {"w-", HeartbeatMark::kWaiting},
                                                          {"x", HeartbeatMark::kUnknown},
                                                          {"W", HeartbeatMark::kUnknown}}) {
    INFO("'" << text << "'");
    std::ofstream(path, std::ios::trunc) << text;
    CHECK(readHeartbeatMark(path) == mark);
  }
  // A symbolic link is not followed, a directory is no heartbeat.
  const std::string link = dir + "/link";
  REQUIRE(::symlink(path.c_str(), link.c_str()) == 0);
  CHECK(readHeartbeatMark(link) == HeartbeatMark::kUnknown);
  CHECK(readHeartbeatMark(dir) == HeartbeatMark::kUnknown);
  ::unlink(link.c_str());
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}
