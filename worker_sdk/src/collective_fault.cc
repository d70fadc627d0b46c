#include "collective_fault.h"

#include <algorithm>
#include <initializer_list>
#include <string>

#include "ddprun/common/strings.h"

namespace ddprun::worker {

namespace {

bool containsAny(const std::string& text, std::initializer_list<const char*> words) {
  return std::any_of(words.begin(), words.end(),
                     [&](const char* w) { return text.find(w) != std::string::npos; });
}

}  // namespace

const char* collectiveFaultKind(std::string_view what) {
  const std::string text = ddprun::toLower(what);
  // A peer that went away: its sockets closed (Gloo's TCP pairs, the store), or the shared-memory
  // path saw its process gone.
  if (containsAny(text, {"closed by peer", "reset by peer", "broken pipe", "connection refused",
                         "connection closed", "exited while", "end of file", "hung up"})) {
    return "peer_closed";
  }
  if (containsAny(text, {"timed out", "timeout"})) return "timeout";
  if (containsAny(text, {"cuda", "nccl"})) return "cuda";
  return "other";
}

}  // namespace ddprun::worker
