// Which gloo the SDK's calls reach. LibTorch 2.x exports a gloo of its own from libtorch_cpu.so;
// when that copy is loaded first, the SDK (built against libgloo's headers) must say so instead of
// crashing in it.
#include <ATen/Parallel.h>
#include <gloo/transport/tcp/device.h>

#include <catch2/catch.hpp>
#include <string>

#include "gloo_communicator.h"  // worker_sdk/src

using ddprun::worker::glooBindingProblem;

TEST_CASE("the SDK's gloo calls reach libgloo, as the ddprun::worker target links it",
          "[worker][gloo]") {
  CHECK(glooBindingProblem(reinterpret_cast<const void*>(&gloo::transport::tcp::CreateDevice)) ==
        "");
}

TEST_CASE("a gloo function found in another library (LibTorch's own gloo) is a clear error",
          "[worker][gloo]") {
  // Any function of libtorch_cpu.so stands in for LibTorch's copy of gloo.
  const auto* in_torch = reinterpret_cast<const void*>(&at::get_num_threads);
  const std::string problem = glooBindingProblem(in_torch);
  CHECK_THAT(problem, Catch::Contains("gloo: this process reaches gloo's functions in "));
  CHECK_THAT(problem, Catch::Contains("libtorch"));
  CHECK_THAT(problem, Catch::Contains("Link libgloo before LibTorch"));
  CHECK(glooBindingProblem(nullptr) == "");  // nothing known about it: no claim
}
