#include "ddprun/rendezvous/files.h"

#include <fstream>
#include <sstream>

#include "ddprun/common/strings.h"

namespace ddprun::rendezvous {

StatusOr<std::string> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return notFound("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

StatusOr<std::string> readTokenFile(const std::string& path) {
  DDPRUN_ASSIGN_OR_RETURN(std::string content, readFile(path));
  std::string token = trim(content);
  if (token.empty()) return invalidArgument("token file " + path + " is empty");
  return token;
}

}  // namespace ddprun::rendezvous
