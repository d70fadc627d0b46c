// Stand-in for gloo/common/memory.h, which Debian's libgloo-dev (0.0~git20220518) leaves out
// although gloo/transport/tcp/pair.h includes it. Searched after every other include directory
// (-idirafter), so a libgloo that ships the header uses its own. gloo_abort.cc includes pair.h
// only to name two members of tcp::Pair that sit before any use of these types; nothing here is
// ever constructed or called.
#pragma once

#include <memory>

namespace gloo {

template <typename T>
class ShareableNonOwningPtr {
  std::shared_ptr<T> ptr_;
};

template <typename T>
class NonOwningPtr {
  std::shared_ptr<T> ptr_;
};

template <typename T>
class WeakNonOwningPtr {
  std::weak_ptr<T> ptr_;
};

}  // namespace gloo
