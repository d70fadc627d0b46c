// LibTorch (through glog) defines a CHECK macro that clashes with Catch2's: include LibTorch
// first, drop glog's CHECK, then include Catch2. Test files include this instead of either.
#pragma once

#include <torch/torch.h>

#undef CHECK
#include <catch2/catch.hpp>
