#include "host_identity.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

namespace ddprun::agent {

bool isThisHost(const std::string& host, const std::string& local_addr,
                const std::string& hostname) {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  if (host == "localhost" || host == local_addr || host == hostname || host == name) return true;
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  if (::getaddrinfo(bare.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return false;
  std::vector<std::string> wanted;
  bool loopback = false;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(a->ai_addr);
      loopback = loopback || (ntohl(in->sin_addr.s_addr) >> 24) == 127;
      ::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    } else if (a->ai_family == AF_INET6) {
      auto* in6 = reinterpret_cast<sockaddr_in6*>(a->ai_addr);
      loopback = loopback || IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
      ::inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    }
    wanted.emplace_back(buf);
  }
  ::freeaddrinfo(res);
  if (loopback) return true;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf,
                  sizeof(buf));
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, buf,
                  sizeof(buf));
    } else {
      continue;
    }
    for (const auto& w : wanted) found = found || w == buf;
  }
  ::freeifaddrs(ifs);
  return found;
}

std::string fullyQualifiedHostname() {
  // Python's socket.getfqdn(), which torchrun uses: resolve the host name, look the address up,
  // and take the first of (name, aliases...) that contains a dot, else the name.
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  if (::getaddrinfo(name, nullptr, &hints, &res) != 0 || res == nullptr) return name;
  std::string fqdn = name;
  const void* addr = nullptr;
  socklen_t len = 0;
  if (res->ai_family == AF_INET) {
    addr = &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    len = sizeof(in_addr);
  } else if (res->ai_family == AF_INET6) {
    addr = &reinterpret_cast<sockaddr_in6*>(res->ai_addr)->sin6_addr;
    len = sizeof(in6_addr);
  }
  if (addr != nullptr) {
    hostent entry{};
    hostent* found = nullptr;
    char buf[8192];
    int err = 0;
    if (::gethostbyaddr_r(addr, len, res->ai_family, &entry, buf, sizeof(buf), &found, &err) == 0 &&
        found != nullptr && found->h_name != nullptr) {
      fqdn = found->h_name;
      std::vector<std::string> candidates{found->h_name};
      for (char** a = found->h_aliases; a != nullptr && *a != nullptr; ++a)
        candidates.push_back(*a);
      for (const auto& c : candidates) {
        if (c.find('.') != std::string::npos) {
          fqdn = c;
          break;
        }
      }
    }
  }
  ::freeaddrinfo(res);
  return fqdn;
}

}  // namespace ddprun::agent
