# LibTorch for the worker SDK, its examples and tests: found once here, so its imported targets and
# TORCH_CXX_FLAGS reach every directory below. Any LibTorch >= 1.13 works: Debian's libtorch-dev,
# a libtorch zip from pytorch.org, or pip's torch (CMAKE_PREFIX_PATH=$(python -c 'import torch;
# print(torch.utils.cmake_prefix_path)')); see docs/libtorch.md.
find_package(Torch REQUIRED)
# LibTorch's config file looks its libraries up in the system directories before its own: with
# Debian's libtorch-dev installed too, pip's or a zip's TorchConfig.cmake picks Debian's
# libtorch.so and libc10.so (1.13) for its 2.x headers. Look them up again beside the config file
# only, and find the package again with those.
set(_ddprun_torch_libdir "${TORCH_INSTALL_PREFIX}/lib")
set(_ddprun_refind FALSE)
foreach(pair "TORCH_LIBRARY torch" "c10_LIBRARY c10" "C10_CUDA_LIBRARY c10_cuda")
  separate_arguments(pair)
  list(GET pair 0 var)
  list(GET pair 1 lib)
  if(${var})
    string(FIND "${${var}}" "${_ddprun_torch_libdir}/" _at)
    if(NOT _at EQUAL 0)
      unset(${var} CACHE)
      find_library(${var} ${lib} PATHS "${_ddprun_torch_libdir}" NO_DEFAULT_PATH)
      set(_ddprun_refind TRUE)
    endif()
  endif()
endforeach()
if(_ddprun_refind)
  find_package(Torch REQUIRED)
endif()
if(Torch_VERSION)
  set(DDPRUN_TORCH_VERSION "${Torch_VERSION}")
else()
  set(DDPRUN_TORCH_VERSION "unknown")
endif()

# pip's torch loads its CUDA runtime and NCCL from the wheels beside it (site-packages/nvidia/...),
# which may be newer than a CUDA toolkit installed on the machine (whose nvcc LibTorch's CMake
# files still want). Programs built here must load the same libraries LibTorch does, or
# libtorch_cuda meets an older NCCL or CUDA runtime: those directories go first in the build
# tree's RPATH, and first where the linker looks for libtorch_cuda's own dependencies.
get_filename_component(_ddprun_torch_libdir "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(_ddprun_site "${_ddprun_torch_libdir}/../.." ABSOLUTE)
set(DDPRUN_TORCH_WHEEL_LIBDIRS "")
foreach(sub nccl/lib cu13/lib cuda_runtime/lib)
  if(IS_DIRECTORY "${_ddprun_site}/nvidia/${sub}")
    list(APPEND DDPRUN_TORCH_WHEEL_LIBDIRS "${_ddprun_site}/nvidia/${sub}")
  endif()
endforeach()
# pip's NCCL, when it is there: the one libtorch_cuda was built against.
if(IS_DIRECTORY "${_ddprun_site}/nvidia/nccl/include")
  set(DDPRUN_TORCH_WHEEL_NCCL "${_ddprun_site}/nvidia/nccl")
endif()
if(DDPRUN_TORCH_WHEEL_LIBDIRS)
  message(STATUS "ddprun: LibTorch ${DDPRUN_TORCH_VERSION} from a wheel; its CUDA/NCCL libraries "
                 "first: ${DDPRUN_TORCH_WHEEL_LIBDIRS}")
  list(PREPEND CMAKE_BUILD_RPATH ${DDPRUN_TORCH_WHEEL_LIBDIRS})
  foreach(dir IN LISTS DDPRUN_TORCH_WHEEL_LIBDIRS)
    add_link_options("LINKER:-rpath-link,${dir}")
  endforeach()
else()
  message(STATUS "ddprun: LibTorch ${DDPRUN_TORCH_VERSION} (${_ddprun_torch_libdir})")
endif()
