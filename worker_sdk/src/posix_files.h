// The few file-system operations of the SDK, on POSIX calls rather than std::filesystem: LibTorch
// 2.x wheels export std::filesystem functions of their own (libtorch_cpu.so, built with another
// libstdc++), and in a program that loads LibTorch before libstdc++ calls reach that copy, which
// crashed with other compilers' headers (GCC 13: std::filesystem::remove_all). Pure functions of
// paths; thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace ddprun::worker::files {

// The directory part ("a/b/c" -> "a/b", "c" -> "", "/c" -> "/"), and the last component.
std::string parentOf(const std::string& path);
std::string nameOf(const std::string& path);

// Whether something exists at `path` (a dangling symlink counts as nothing).
bool exists(const std::string& path);
// Whether `path` is a directory (following symlinks).
bool isDirectory(const std::string& path);

// mkdir -p; false (errno set) when a component cannot be made.
bool makeDirs(const std::string& path);

// The names in `dir` (not "." or ".."); nullopt when it cannot be read.
std::optional<std::vector<std::string>> listDir(const std::string& dir);

// `path` made absolute, with the symlinks of its longest existing prefix resolved and "." / ".."
// removed, like std::filesystem::weakly_canonical; nullopt when the working directory is unknown.
std::optional<std::string> resolved(const std::string& path);

// Whether `path` lies strictly inside `dir`, both resolved.
bool isInside(const std::string& path, const std::string& dir);

}  // namespace ddprun::worker::files
