#include "backend.h"

namespace ddprun::etcd {

EtcdOptions Backend::clientOptions(const EtcdServiceOptions& o) {
  auto endpoints = splitEtcdEndpoints(o.endpoints);
  EtcdOptions c;
  c.endpoints = endpoints.isOk() ? endpoints.value() : std::vector<std::string>{o.endpoints};
  c.tls = o.tls;
  c.ca_pem = o.ca_pem;
  c.cert_pem = o.cert_pem;
  c.key_pem = o.key_pem;
  c.ca_file = o.ca_file;
  c.cert_file = o.cert_file;
  c.username = o.username;
  c.password = o.password;
  c.rpc_timeout = o.rpc_timeout;
  return c;
}

Backend::Backend(const EtcdServiceOptions& options, const Keys& keys, Watcher::Events events)
    : client(clientOptions(options)),
      lease(client, stopper, keys, LeaseKeeper::ttlFor(options.run_config)),
      worker(client, stopper, held, lease, keys, options.run_id),
      watcher(client, stopper, held, keys, std::move(events)) {
  worker.start();
}

void Backend::startWatching() {
  watcher.start();
  lease.start();
}

void Backend::stop() {
  stopper.stop();
  worker.close();
  client.shutdown();
  worker.join();
  watcher.join();
  lease.join();
  lease.revoke();
}

}  // namespace ddprun::etcd
