#include "ddprun/worker/bucket_assignment.h"

#include <algorithm>
#include <map>
#include <utility>

#include "ddprun/worker/errors.h"

namespace ddprun::worker {

namespace {

struct OpenBucket {
  std::vector<std::size_t> indices;
  std::size_t bytes = 0;
  int closed_count = 0;  // buckets already closed for this key: selects the size limit
};

}  // namespace

std::vector<std::vector<std::size_t>> computeBucketAssignment(
    const std::vector<TensorSpec>& tensors, const BucketOptions& options) {
  if (options.first_bucket_bytes == 0 || options.bucket_cap_bytes == 0) {
    throw ConfigError("bucket size limits must be positive (first_bucket_bytes=" +
                      std::to_string(options.first_bucket_bytes) +
                      ", bucket_cap_bytes=" + std::to_string(options.bucket_cap_bytes) + ")");
  }
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (options.reverse) std::reverse(order.begin(), order.end());

  // Position of each closed bucket's first tensor in walk order, so the result is sorted by when
  // the bucket starts filling.
  std::vector<std::pair<std::size_t, std::vector<std::size_t>>> done;
  std::map<std::pair<int, int>, OpenBucket> open;
  std::map<std::size_t, std::size_t> position;  // tensor index -> walk position
  for (std::size_t pos = 0; pos < order.size(); ++pos) position[order[pos]] = pos;

  auto close = [&](OpenBucket& b) {
    if (b.indices.empty()) return;
    done.emplace_back(position[b.indices.front()], std::move(b.indices));
    b.indices.clear();
    b.bytes = 0;
    ++b.closed_count;
  };
  auto limitOf = [&](const OpenBucket& b) {
    return b.closed_count == 0 ? options.first_bucket_bytes : options.bucket_cap_bytes;
  };

  for (std::size_t idx : order) {
    const TensorSpec& t = tensors[idx];
    OpenBucket& b = open[{t.dtype, t.device}];
    const std::size_t bytes = t.numel * t.element_size;
    if (bytes > limitOf(b) && !b.indices.empty()) close(b);  // oversized tensor: alone
    b.indices.push_back(idx);
    b.bytes += bytes;
    if (b.bytes >= limitOf(b)) close(b);
  }
  for (auto& [key, b] : open) close(b);

  std::sort(done.begin(), done.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<std::size_t>> out;
  out.reserve(done.size());
  for (auto& [pos, indices] : done) out.push_back(std::move(indices));
  return out;
}

}  // namespace ddprun::worker
