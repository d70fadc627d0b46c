// zlib's deflate and a bounded inflate, for values a peer stores and others read (the etcd-v3
// rendezvous state, a node's snapshot holdings).
// Threading: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ddprun/common/status.h"

namespace ddprun {

// `data` deflated at zlib's fastest level; nothing when zlib fails.
std::optional<std::string> deflateFast(std::string_view data);

// zlib's inflation of `deflated`, which must give exactly `size` bytes. The output grows with what
// the stream delivers (from 64 KiB, doubling), never past `size`: a value that states a large size
// but holds garbage costs no more than what it inflates to. INVALID_ARGUMENT saying why otherwise
// ("does not inflate", "does not inflate to the N bytes stated: it gives M"); the caller bounds
// `size` first.
StatusOr<std::string> inflateExactly(std::string_view deflated, uint64_t size);

}  // namespace ddprun
