// Which gloo and which std::filesystem the SDK's programs reach. LibTorch 2.x exports a gloo of its
// own and std::filesystem functions from libtorch_cpu.so; the ddprun::worker target links libgloo
// and libstdc++ ahead of it. When LibTorch's gloo is loaded first anyway, the SDK (built against
// libgloo's headers) must say so instead of crashing in it.
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gloo/transport/tcp/device.h>

#include <catch2/catch.hpp>
#include <filesystem>
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

TEST_CASE("the SDK's programs reach libstdc++'s std::filesystem, not LibTorch's copy of it",
          "[worker][gloo]") {
  // remove_all is the one that crashed in LibTorch 2.11's copy with GCC 13's headers.
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&, std::error_code&);
  const auto* fn =
      reinterpret_cast<const void*>(static_cast<RemoveAll>(&std::filesystem::remove_all));
  Dl_info info{};
  REQUIRE(dladdr(fn, &info) != 0);
  REQUIRE(info.dli_fname != nullptr);
  CHECK_THAT(std::string(info.dli_fname), Catch::Contains("libstdc++"));
}
