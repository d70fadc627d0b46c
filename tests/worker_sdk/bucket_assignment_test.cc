#include "ddprun/worker/bucket_assignment.h"

#include <catch2/catch.hpp>

#include "ddprun/worker/errors.h"

using ddprun::worker::BucketOptions;
using ddprun::worker::computeBucketAssignment;
using ddprun::worker::TensorSpec;
using Buckets = std::vector<std::vector<std::size_t>>;

namespace {
constexpr std::size_t kMiB = BucketOptions::kMiB;
TensorSpec floats(std::size_t bytes) { return TensorSpec{bytes / 4, 4, 0, -1}; }
}  // namespace

TEST_CASE("buckets are filled in reverse parameter order with a 1 MiB first bucket",
          "[worker][bucket]") {
  // 6 parameters of 0.5 MiB each; cap 2 MiB: first bucket {5,4} (1 MiB), then {3,2,1,0} (2 MiB).
  std::vector<TensorSpec> t(6, floats(kMiB / 2));
  BucketOptions o;
  o.bucket_cap_bytes = 2 * kMiB;
  CHECK(computeBucketAssignment(t, o) == Buckets{{5, 4}, {3, 2, 1, 0}});
}

TEST_CASE("forward order is available when reverse is off", "[worker][bucket]") {
  std::vector<TensorSpec> t(4, floats(kMiB));
  BucketOptions o;
  o.reverse = false;
  o.bucket_cap_bytes = 2 * kMiB;
  CHECK(computeBucketAssignment(t, o) == Buckets{{0}, {1, 2}, {3}});
}

TEST_CASE("the default cap is 25 MiB after the first bucket", "[worker][bucket]") {
  std::vector<TensorSpec> t(30, floats(kMiB));
  auto b = computeBucketAssignment(t);
  REQUIRE(b.size() == 3);
  CHECK(b[0] == std::vector<std::size_t>{29});
  CHECK(b[1].size() == 25);
  CHECK(b[1].front() == 28);
  CHECK(b[2].size() == 4);
  CHECK(b[2].back() == 0);
}

TEST_CASE("a tensor larger than the cap gets a bucket of its own", "[worker][bucket]") {
  // reverse order walk: 3 (small), 2 (huge), 1 (small), 0 (small)
  std::vector<TensorSpec> t{floats(kMiB / 4), floats(kMiB / 4), floats(40 * kMiB),
                            floats(kMiB / 4)};
  auto b = computeBucketAssignment(t);
  CHECK(b == Buckets{{3}, {2}, {1, 0}});
}

TEST_CASE("buckets never mix dtypes and every index appears once", "[worker][bucket]") {
  std::vector<TensorSpec> t;
  for (int i = 0; i < 8; ++i) t.push_back(TensorSpec{1000, i % 2 ? 8u : 4u, i % 2, -1});
  auto b = computeBucketAssignment(t);
  std::vector<int> seen(t.size(), 0);
  for (const auto& bucket : b) {
    REQUIRE(!bucket.empty());
    for (auto i : bucket) {
      ++seen[i];
      CHECK(t[i].dtype == t[bucket.front()].dtype);
    }
  }
  for (int s : seen) CHECK(s == 1);
  CHECK(b == Buckets{{7, 5, 3, 1}, {6, 4, 2, 0}});
}

TEST_CASE("buckets never mix devices", "[worker][bucket]") {
  std::vector<TensorSpec> t{{10, 4, 0, 0}, {10, 4, 0, 1}, {10, 4, 0, 0}};
  CHECK(computeBucketAssignment(t) == Buckets{{2, 0}, {1}});
}

TEST_CASE("empty input gives no buckets and zero limits are rejected", "[worker][bucket]") {
  CHECK(computeBucketAssignment({}).empty());
  BucketOptions o;
  o.bucket_cap_bytes = 0;
  CHECK_THROWS_AS(computeBucketAssignment({floats(4)}, o), ddprun::worker::ConfigError);
}
