// Two jobs that share one --rdzv-id: the check that names the other job (agent/src/job_identity.h).
#include "job_identity.h"

#include <catch2/catch.hpp>

using namespace ddprun;
using namespace ddprun::agent;

TEST_CASE("nodes that run one program are one job, wherever they keep it", "[agent]") {
  CHECK(checkSameJob({encodeJobIdentity("10.0.0.1", "/home/a/train.py"),
                      encodeJobIdentity("10.0.0.2", "/scratch/b/train.py")},
                     1, "job")
            .isOk());
  CHECK(checkSameJob({encodeJobIdentity("10.0.0.1", "train.py")}, 0, "job").isOk());
}

TEST_CASE("a node of the round that runs another program is named, with the job id", "[agent]") {
  const Status st = checkSameJob({encodeJobIdentity("10.0.0.1", "/srv/train.py"),
                                  encodeJobIdentity("10.0.0.2", "/srv/eval.py")},
                                 0, "nightly");
  REQUIRE(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message() ==
        "another job uses --rdzv-id 'nightly': node 1 of this round (10.0.0.2) runs "
        "'/srv/eval.py', this node runs '/srv/train.py'; give each job an id of its own");
  // What a node published is escaped in the message.
  const Status odd =
      checkSameJob({encodeJobIdentity("h", "a"), encodeJobIdentity("h\x1b", "b\x1b[2J")}, 0, "j");
  CHECK(odd.message().find("\\x1b[2J") != std::string::npos);
  CHECK(odd.message().find('\x1b') == std::string::npos);
}
