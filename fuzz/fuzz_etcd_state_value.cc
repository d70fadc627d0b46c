// libFuzzer target: the value the etcd-v3 backend stores under <prefix>/state
// (etcd/src/state_value.h), as every agent parses it from each pushed change: the header,
// the join answers, and the snapshot, deflated or not, imported into a RendezvousState. Whatever
// the value, the parser accepts or refuses it with one clean line, never allocates more than a
// stated snapshot within the bound, and an accepted snapshot either imports or is refused.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ddprun/rendezvous/state.h"
#include "fuzz_check.h"
#include "state_value.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto stored = std::make_shared<const std::string>(reinterpret_cast<const char*>(data), size);
  auto value = ddprun::etcd::StateValue::parse(stored);
  if (!value.isOk()) {
    FUZZ_CHECK(isOneCleanLine(value.status().message()));
    return 0;
  }
  for (const auto& change : value->changes()) (void)change.node_id.size();
  // Join answers by a few call ids taken from the input (and ones no value has).
  for (uint64_t call : {uint64_t{0}, uint64_t{1}, uint64_t{size}, ~uint64_t{0}}) {
    auto answer = value->joinAnswer(call);
    if (answer && !answer->isOk()) (void)answer->status().message();
    if (answer && answer->isOk() && answer->value().participants) {
      FUZZ_CHECK(answer->value().participants->size() <= size);
    }
  }
  auto snapshot = value->snapshot();
  if (!snapshot.isOk()) {
    FUZZ_CHECK(isOneCleanLine(snapshot.status().message()));
    return 0;
  }
  FUZZ_CHECK(snapshot->size() <= ddprun::etcd::kMaxStateSnapshotBytes);
  ddprun::rendezvous::RendezvousState state;
  (void)state.importRun("run", *snapshot);
  return 0;
}
