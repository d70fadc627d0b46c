#include "posix_files.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <memory>

namespace ddprun::worker::files {

namespace {
// "/a//b/./c/" -> {"a", "b", "c"}; ".." kept (resolved() applies them).
std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < path.size()) {
    const size_t j = path.find('/', i);
    const std::string part = path.substr(i, j == std::string::npos ? std::string::npos : j - i);
    if (!part.empty() && part != ".") out.push_back(part);
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

std::string joined(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) out += "/" + p;
  return out.empty() ? "/" : out;
}
}  // namespace

std::string parentOf(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return "";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

std::string nameOf(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool isDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool makeDirs(const std::string& path) {
  if (path.empty() || isDirectory(path)) return true;
  const std::string parent = parentOf(path);
  if (!parent.empty() && parent != path && !makeDirs(parent)) return false;
  return ::mkdir(path.c_str(), 0755) == 0 || (errno == EEXIST && isDirectory(path));
}

std::optional<std::vector<std::string>> listDir(const std::string& dir) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.empty() ? "." : dir.c_str()), ::closedir);
  if (!d) return std::nullopt;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d.get())) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  return names;
}

std::optional<std::string> resolved(const std::string& path) {
  std::string absolute = path;
  if (path.empty() || path[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) return std::nullopt;
    absolute = std::string(cwd) + "/" + path;
  }
  // Resolve the longest existing prefix with realpath; append the rest lexically.
  std::vector<std::string> parts = components(absolute);
  for (size_t keep = parts.size() + 1; keep-- > 0;) {
    const std::vector<std::string> head(parts.begin(), parts.begin() + static_cast<long>(keep));
    char buf[PATH_MAX];
    if (::realpath(joined(head).c_str(), buf) == nullptr) continue;
    std::vector<std::string> out = components(buf);
    for (size_t i = keep; i < parts.size(); ++i) {
      if (parts[i] == "..") {
        if (!out.empty()) out.pop_back();
      } else {
        out.push_back(parts[i]);
      }
    }
    return joined(out);
  }
  return std::nullopt;
}

bool isInside(const std::string& path, const std::string& dir) {
  const auto file = resolved(path);
  const auto top = resolved(dir);
  if (!file || !top) return false;
  const std::string prefix = *top == "/" ? "/" : *top + "/";
  return file->size() > prefix.size() && file->compare(0, prefix.size(), prefix) == 0;
}

}  // namespace ddprun::worker::files
