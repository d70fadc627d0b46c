// Which gloo and which std::filesystem the SDK's programs reach. LibTorch 2.x exports a gloo of its
// own and std::filesystem functions from libtorch_cpu.so; the ddprun::worker target links libgloo
// and libstdc++ ahead of it. When LibTorch's gloo is loaded first anyway, the SDK (built against
// libgloo's headers) must say so instead of crashing in it.
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gloo/transport/tcp/device.h>
#include <link.h>

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

namespace {
// The first library, in the order the dynamic linker searches them (load order), that defines
// `symbol`: where a call from the program binds. (The address of a function taken in the
// executable may be its own PLT entry, so dladdr of it says nothing.)
std::string firstDefiner(const char* symbol) {
  std::pair<const char*, std::string> state{symbol, ""};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* st = static_cast<std::pair<const char*, std::string>*>(data);
        if (info->dlpi_name == nullptr || *info->dlpi_name == '\0') return 0;  // the executable
        void* handle = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
        if (handle == nullptr) return 0;
        void* address = dlsym(handle, st->first);  // this library or one it loads
        dlclose(handle);
        Dl_info where{};
        if (address == nullptr || dladdr(address, &where) == 0 || where.dli_fname == nullptr ||
            std::string(where.dli_fname) != info->dlpi_name) {
          return 0;
        }
        st->second = info->dlpi_name;
        return 1;
      },
      &state);
  return state.second;
}
}  // namespace

TEST_CASE("the SDK's programs reach libstdc++'s std::filesystem, not LibTorch's copy of it",
          "[worker][gloo]") {
  // remove_all is the one that crashed in LibTorch 2.11's copy with GCC 13's headers.
  const std::string lib =
      firstDefiner("_ZNSt10filesystem10remove_allERKNS_7__cxx114pathERSt10error_code");
  INFO("std::filesystem::remove_all binds to " << lib);
  CHECK_THAT(lib, Catch::Contains("libstdc++"));
  CHECK(firstDefiner("_ZN4gloo9transport3tcp12CreateDeviceERKNS1_4attrE").find("libgloo") !=
        std::string::npos);
}
