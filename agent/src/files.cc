#include "files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace ddprun::agent {

Status makeDirs(const std::string& path) {
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || (path[i] == '/' && i > 0)) {
      const std::string partial = path.substr(0, i);
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        return failedPrecondition("cannot create directory " + partial + ": " +
                                  std::strerror(errno));
      }
    }
  }
  return Status::ok();
}

StatusOr<std::string> makeTempDir(const std::string& parent, const std::string& prefix) {
  DDPRUN_RETURN_IF_ERROR(makeDirs(parent));
  std::string templ = parent + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    return failedPrecondition("cannot create a directory under " + parent + ": " +
                              std::strerror(errno));
  }
  return std::string(buf.data());
}

Status removeIfExists(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return failedPrecondition("cannot remove " + path + ": " + std::strerror(errno));
  }
  return Status::ok();
}

}  // namespace ddprun::agent
