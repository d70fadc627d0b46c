# Install rules and the Debian package (issue 15). Included last from the top-level CMakeLists.
#   cmake --install build --prefix P   binaries, libddprun_worker + headers, find_package(ddprun),
#                                      ddprun-worker.pc, man pages, bash completion, systemd unit,
#                                      /etc/default file (P/etc/default; /etc/default for /usr),
#                                      the Slurm and Kubernetes templates under share/ddprun
#   cpack -G DEB (in build/)           ddprun_<version>_<arch>.deb of the same, for /usr
# tests/install checks all of it.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# --- binaries -------------------------------------------------------------------------------
# DDPRUN_SDK_ONLY builds have the worker SDK and train only.
if(DDPRUN_SDK_ONLY)
  set(_ddprun_binaries train)
else()
  set(_ddprun_binaries ddprun ddprun-agent ddprun-rendezvous train)
endif()
install(TARGETS ${_ddprun_binaries} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# train links libddprun_worker: find it next to the binary wherever the prefix is.
set_target_properties(train PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")

# --- worker SDK: library, headers, CMake package, pkg-config --------------------------------
if(DDPRUN_WORKER_SHARED)
  set_target_properties(ddprun_worker PROPERTIES EXPORT_NAME worker)
  install(TARGETS ddprun_worker EXPORT ddprunTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  # Public headers: LibTorch and the standard library only (no gRPC, protobuf, Asio, common).
  install(FILES
    worker_sdk/include/ddprun/worker/bucket_assignment.h
    worker_sdk/include/ddprun/worker/communicator.h
    worker_sdk/include/ddprun/worker/ddp.h
    worker_sdk/include/ddprun/worker/env.h
    worker_sdk/include/ddprun/worker/errors.h
    worker_sdk/include/ddprun/worker/loss_scaler.h
    worker_sdk/include/ddprun/worker/mixed_precision.h
    worker_sdk/include/ddprun/worker/nccl.h
    worker_sdk/include/ddprun/worker/process_group.h
    worker_sdk/include/ddprun/worker/sampler.h
    worker_sdk/include/ddprun/worker/signals.h
    worker_sdk/include/ddprun/worker/snapshot.h
    worker_sdk/include/ddprun/worker/store.h
    worker_sdk/include/ddprun/worker/trainer.h
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ddprun/worker)

  set(DDPRUN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ddprun)
  install(EXPORT ddprunTargets NAMESPACE ddprun:: DESTINATION ${DDPRUN_CMAKE_DIR})
  configure_package_config_file(cmake/ddprunConfig.cmake.in
    ${CMAKE_CURRENT_BINARY_DIR}/cmake-package/ddprunConfig.cmake INSTALL_DESTINATION ${DDPRUN_CMAKE_DIR})
  write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/cmake-package/ddprunConfigVersion.cmake
    COMPATIBILITY SameMinorVersion)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/cmake-package/ddprunConfig.cmake
                ${CMAKE_CURRENT_BINARY_DIR}/cmake-package/ddprunConfigVersion.cmake
          DESTINATION ${DDPRUN_CMAKE_DIR})

  # pkg-config for non-CMake builds. LibTorch ships no .pc file, so its flags are spelled out
  # from what this build found.
  set(_pc_cflags "${TORCH_CXX_FLAGS}")
  foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
    string(APPEND _pc_cflags " -I${dir}")
  endforeach()
  get_filename_component(_pc_torch_libdir "${TORCH_LIBRARY}" DIRECTORY)
  set(_pc_libs_torch "-L${_pc_torch_libdir} -ltorch -ltorch_cpu -lc10")
  if(DDPRUN_WITH_NCCL)
    string(APPEND _pc_cflags " -DDDPRUN_WITH_NCCL=1")
    # CUDA::cudart is imported GLOBAL by worker_sdk/; the CUDAToolkit variables are not.
    get_target_property(_pc_cuda_inc CUDA::cudart INTERFACE_INCLUDE_DIRECTORIES)
    foreach(dir IN LISTS _pc_cuda_inc)
      string(APPEND _pc_cflags " -I${dir}")
    endforeach()
    get_target_property(_pc_cudart CUDA::cudart IMPORTED_LOCATION)
    get_filename_component(_pc_cuda_libdir "${_pc_cudart}" DIRECTORY)
    string(APPEND _pc_libs_torch " -L${_pc_cuda_libdir} -lcudart")
  endif()
  # Relocatable: the prefix is found from where the .pc file lies (cmake --install --prefix P).
  file(RELATIVE_PATH _pc_up "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
  string(REGEX REPLACE "/$" "" _pc_up "${_pc_up}")
  configure_file(cmake/ddprun-worker.pc.in ${CMAKE_CURRENT_BINARY_DIR}/cmake-package/ddprun-worker.pc @ONLY)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/cmake-package/ddprun-worker.pc
          DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
else()
  message(STATUS "ddprun install: DDPRUN_WORKER_SHARED=OFF, the worker SDK is not installed")
endif()

# --- man pages (help2man over each binary's --help) and bash completion ----------------------
find_program(DDPRUN_HELP2MAN help2man)
if(DDPRUN_HELP2MAN)
  set(_man_pages "")
  foreach(pair "ddprun|torchrun-compatible elastic launcher"
               "ddprun-agent|ddprun per-node agent daemon"
               "ddprun-rendezvous|ddprun rendezvous server (gRPC)"
               "train|example DDP training program on the ddprun worker SDK")
    string(REPLACE "|" ";" pair "${pair}")
    list(GET pair 0 bin)
    list(GET pair 1 what)
    if(NOT bin IN_LIST _ddprun_binaries)
      continue()
    endif()
    set(page ${CMAKE_CURRENT_BINARY_DIR}/man/${bin}.1)
    add_custom_command(OUTPUT ${page}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/man
      COMMAND ${DDPRUN_HELP2MAN} --no-info --no-discard-stderr "--name=${what}"
              "--version-string=${PROJECT_VERSION}" --output=${page} $<TARGET_FILE:${bin}>
      DEPENDS ${bin} VERBATIM)
    list(APPEND _man_pages ${page})
  endforeach()
  add_custom_target(ddprun_man ALL DEPENDS ${_man_pages})
  install(FILES ${_man_pages} DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
else()
  message(STATUS "ddprun install: help2man not found (deploy/install-deps.sh installs it); "
                 "no man pages: run each binary with --help")
endif()
if(DDPRUN_SDK_ONLY)
  return()  # the daemons' files and the Debian package come from a full build
endif()
# One script for the three commands: it completes from the command's own --help.
foreach(bin ddprun ddprun-agent ddprun-rendezvous)
  install(FILES deploy/bash-completion/ddprun RENAME ${bin}
          DESTINATION ${CMAKE_INSTALL_DATADIR}/bash-completion/completions)
endforeach()

# --- deployment files -------------------------------------------------------------------------
install(FILES deploy/systemd/ddprun-rendezvous.service
        DESTINATION lib/systemd/system)
# /etc/default when installing to /usr (the .deb), <prefix>/etc/default otherwise.
install(CODE "
  if(CMAKE_INSTALL_PREFIX STREQUAL \"/usr\")
    set(_ddprun_etc /etc)
  else()
    set(_ddprun_etc \"\${CMAKE_INSTALL_PREFIX}/etc\")
  endif()
  file(INSTALL DESTINATION \"\${_ddprun_etc}/default\" TYPE FILE
       RENAME ddprun-rendezvous FILES \"${PROJECT_SOURCE_DIR}/deploy/systemd/ddprun-rendezvous.default\")
")
install(FILES deploy/slurm/README.md deploy/slurm/train_cpu.sbatch deploy/slurm/train_gpu.sbatch
        DESTINATION ${CMAKE_INSTALL_DATADIR}/ddprun/slurm)
install(FILES deploy/kubernetes/README.md deploy/kubernetes/rendezvous.yaml
              deploy/kubernetes/train-job.yaml
        DESTINATION ${CMAKE_INSTALL_DATADIR}/ddprun/kubernetes)

# --- Debian package (cpack -G DEB) ------------------------------------------------------------
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ddprun)
set(CPACK_PACKAGE_VENDOR ddprun)
set(CPACK_PACKAGE_CONTACT "ddprun developers <dev@ddprun>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "torchrun-compatible elastic launcher and C++ DDP worker SDK")
set(CPACK_PACKAGE_DESCRIPTION
  "ddprun starts, supervises and restarts distributed training workers with torchrun's command\n"
  "line and worker environment. ddprun-rendezvous is its standalone rendezvous server.\n"
  "libddprun_worker is DDP for LibTorch (headers, CMake package and pkg-config included).")
string(REPLACE ";" "" CPACK_PACKAGE_DESCRIPTION "${CPACK_PACKAGE_DESCRIPTION}")
# Install with prefix /usr into a DESTDIR, so that the install code above sees /usr and
# writes /etc/default.
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_SET_DESTDIR ON)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
# Runtime dependencies from what the binaries link (dpkg-shlibdeps). Libraries no Debian package
# owns (an NVIDIA CUDA/NCCL install for DDPRUN_WITH_NCCL builds) are skipped by it; build the
# package for plain Debian with -DDDPRUN_NCCL=OFF.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# Building against the SDK (headers, find_package(ddprun) finds Torch and Gloo) needs these.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libtorch-dev, libgloo-dev")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "slurm-client, python3-torch")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
  ${PROJECT_SOURCE_DIR}/deploy/debian/conffiles
  ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
  ${PROJECT_SOURCE_DIR}/deploy/debian/postrm)
include(CPack)
