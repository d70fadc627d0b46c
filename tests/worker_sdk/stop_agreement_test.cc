// The agreed stop's decision (stop_agreement.h): who stops, who leaves, who re-forms in place.
// The end-to-end cases (a SIGTERM to one worker, to one node, to every node) are in
// inplace_process_test.cc and tests/launcher/inplace_e2e_test.cc.
#include "stop_agreement.h"

#include <catch2/catch.hpp>

using ddprun::worker::agreeOnStop;
using ddprun::worker::StopAgreement;

TEST_CASE("agreed stop: nobody asked, everyone goes on", "[worker][pure]") {
  CHECK(agreeOnStop(0, 0, 4, false, true) == StopAgreement::kGoOn);
  CHECK(agreeOnStop(0, 0, 4, false, false) == StopAgreement::kGoOn);
}

TEST_CASE("agreed stop: without in-place recovery any request stops every rank", "[worker][pure]") {
  for (bool asked : {false, true}) {
    CHECK(agreeOnStop(1, 1, 4, asked, false) == StopAgreement::kAllStop);
    CHECK(agreeOnStop(1, 0, 4, asked, false) == StopAgreement::kAllStop);
  }
}

TEST_CASE("agreed stop: in place, ranks sent SIGTERM leave and the others re-form",
          "[worker][pure]") {
  CHECK(agreeOnStop(2, 2, 4, true, true) == StopAgreement::kLeave);
  CHECK(agreeOnStop(2, 2, 4, false, true) == StopAgreement::kOthersLeave);
  CHECK(agreeOnStop(3, 3, 4, true, true) == StopAgreement::kLeave);
}

TEST_CASE("agreed stop: in place, SIGTERM to every rank or any other request stops everyone",
          "[worker][pure]") {
  CHECK(agreeOnStop(4, 4, 4, true, true) == StopAgreement::kAllStop);   // the whole job
  CHECK(agreeOnStop(1, 1, 1, true, true) == StopAgreement::kAllStop);   // a world of one
  CHECK(agreeOnStop(2, 1, 4, false, true) == StopAgreement::kAllStop);  // a SIGUSR1 among them
  CHECK(agreeOnStop(1, 0, 4, true, true) == StopAgreement::kAllStop);   // requestCheckpoint()
  CHECK(agreeOnStop(5, 5, 4, true, true) == StopAgreement::kAllStop);   // (more than the world)
}
