// The kind a `fault` message gives a collective's failure (collective_fault.h), from the texts
// Gloo, NCCL and the SDK itself put in a CommError.
#include "collective_fault.h"

#include <catch2/catch.hpp>
#include <string>

using ddprun::worker::collectiveFaultKind;

TEST_CASE("a collective's failure is named by what its error says", "[worker][pure]") {
  // Gloo's TCP pairs, the shared-memory path and the store when a peer's process is gone.
  CHECK(std::string(collectiveFaultKind(
            "gloo: all_reduce: [/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
            "[127.0.0.2]:41731")) == "peer_closed");
  CHECK(std::string(collectiveFaultKind("Read error [127.0.0.3]:5012: Connection reset by peer")) ==
        "peer_closed");
  CHECK(std::string(collectiveFaultKind("Write error: Broken pipe")) == "peer_closed");
  CHECK(std::string(collectiveFaultKind("shared-memory all_reduce: rank 3 (pid 812) exited while "
                                        "rank 0 waited for it (arrive)")) == "peer_closed");
  // op_timeout, the store's waits.
  CHECK(std::string(collectiveFaultKind(
            "Timed out waiting 30000ms for recv operation to complete")) == "timeout");
  CHECK(std::string(collectiveFaultKind(
            "timed out after 300000 ms waiting for store keys [ddprun/pg0/g2/gloo/2]")) ==
        "timeout");
  // The GPU's own failures.
  CHECK(std::string(collectiveFaultKind("nccl allreduce failed: unhandled system error")) ==
        "cuda");
  CHECK(std::string(collectiveFaultKind("cuda stream synchronize failed: an illegal memory "
                                        "access was encountered")) == "cuda");
  // Anything else, and nothing at all.
  CHECK(std::string(collectiveFaultKind("ranks disagree on the collective")) == "other");
  CHECK(std::string(collectiveFaultKind("")) == "other");
  CHECK(std::string(collectiveFaultKind(std::string(1 << 20, '\xff'))) == "other");
}
