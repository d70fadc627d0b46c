// How this host names itself, and whether a rendezvous endpoint's host is this host (torchrun's
// is_host check). Each call resolves names (DNS, /etc/hosts) and reads the interfaces; any thread.
#pragma once

#include <string>

namespace ddprun::agent {

// The host's fully qualified name (what torchrun advertises as MASTER_ADDR).
std::string fullyQualifiedHostname();

// True when `host` (a name, an IPv4 address or a bracketed IPv6 address) is this host: localhost,
// `local_addr`, `hostname`, the kernel's host name, a loopback address, or an address of one of
// this host's interfaces.
bool isThisHost(const std::string& host, const std::string& local_addr,
                const std::string& hostname);

}  // namespace ddprun::agent
