// rendezvous_join_probe ENDPOINT RUN NODE MIN MAX: one agent's join in its own process, for the
// test that kills an agent mid-join. Prints "joined RANK" or the error; exit 0 when joined.
#include <cstdlib>
#include <iostream>

#include "ddprun/rendezvous/client.h"

int main(int argc, char** argv) {
  using namespace ddprun::rendezvous;
  if (argc != 6) {
    std::cerr << "usage: rendezvous_join_probe ENDPOINT RUN NODE MIN MAX" << std::endl;
    return 2;
  }
  ClientOptions options;
  options.endpoint = argv[1];
  Client client(options);
  JoinRequest req;
  req.run_id = argv[2];
  req.node_id = argv[3];
  req.address = "127.0.0.1";
  req.config.min_nodes = static_cast<uint32_t>(std::atoi(argv[4]));
  req.config.max_nodes = static_cast<uint32_t>(std::atoi(argv[5]));
  req.config.last_call_timeout = std::chrono::milliseconds(100);
  auto round = client.join(req);
  if (!round.isOk()) {
    std::cout << round.status() << std::endl;
    return 1;
  }
  std::cout << "joined " << round->group_rank << std::endl;
  return 0;
}
