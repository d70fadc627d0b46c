#include "ddprun/rendezvous/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "ddprun/common/strings.h"

namespace ddprun::rendezvous {

StatusOr<std::string> readFile(const std::string& path, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO with no writer must not hang; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return notFound("cannot read " + path);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalidArgument(path + " is not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return invalidArgument(path + " is larger than " + std::to_string(max_bytes) + " bytes");
  }
  std::string out;
  char buf[65536];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      return notFound("cannot read " + path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes) {  // grew while we read it
      ::close(fd);
      return invalidArgument(path + " is larger than " + std::to_string(max_bytes) + " bytes");
    }
  }
  ::close(fd);
  return out;
}

Status validateToken(const std::string& token) {
  if (token.empty()) return invalidArgument("the token is empty");
  if (token.size() > kMaxTokenBytes) {
    return invalidArgument("the token is longer than " + std::to_string(kMaxTokenBytes) + " bytes");
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02x", c);
      return invalidArgument("the token must be printable ASCII without spaces; byte " +
                             std::to_string(i) + " is " + hex);
    }
  }
  return Status::ok();
}

StatusOr<std::string> readPem(const std::string& label, const std::string& path, bool private_key) {
  const std::string what = private_key ? "a PEM private key" : "a PEM certificate";
  if (path.empty()) return invalidArgument(label + " needs the path of " + what + ", got ''");
  auto pem = readFile(path);
  if (!pem.isOk()) {
    return invalidArgument(label + ": cannot read '" + path + "' (expected " + what + ")");
  }
  const std::string& text = pem.value();
  const bool ok = private_key ? text.find("-----BEGIN ") != std::string::npos &&
                                    text.find("PRIVATE KEY-----") != std::string::npos
                              : text.find("-----BEGIN CERTIFICATE-----") != std::string::npos;
  if (!ok) return invalidArgument(label + ": '" + path + "' is not " + what);
  return text;
}

StatusOr<std::string> readTokenFile(const std::string& path) {
  DDPRUN_ASSIGN_OR_RETURN(std::string content, readFile(path, 64 * 1024));
  std::string token = trim(content);
  if (token.empty()) return invalidArgument("token file " + path + " is empty");
  if (Status st = validateToken(token); !st.isOk()) {
    return invalidArgument("token file " + path + ": " + st.message());
  }
  return token;
}

}  // namespace ddprun::rendezvous
